"""Keras pieces: `layers.Embedding` (lookups where the table lives) and chief-aware `callbacks`."""

from tfstrat.keras import _rowwise, callbacks, layers

_rowwise.install()  # Keras's Adagrad on sparse gradients: the touched rows only (TFSTRAT_ROWWISE)

__all__ = ["callbacks", "layers"]
