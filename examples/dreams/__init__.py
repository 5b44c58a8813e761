"""DreaMS-style fine-tuning of a transformer over MS/MS spectra, on synthetic data."""

__all__: list[str] = []
