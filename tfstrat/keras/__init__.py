"""Keras pieces: `layers.Embedding` (lookups where the table lives) and chief-aware `callbacks`."""

from tfstrat.keras import callbacks, layers

__all__ = ["callbacks", "layers"]
