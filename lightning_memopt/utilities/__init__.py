"""Internal helpers. Not part of the public API; names may change between releases."""
