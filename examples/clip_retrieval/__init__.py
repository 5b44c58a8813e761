"""CLIP-style multitask video-text retrieval on synthetic data, evaluated without the full score matrix."""

__all__: list[str] = []
