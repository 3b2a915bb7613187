"""Every error tfstrat raises on purpose, under one base, `TfstratError`.

Each also derives from the built-in error it was before (ValueError for bad input,
RuntimeError for a failure of a task or of the machine), so `except ValueError` still works.
Messages name the value or the task, and the fix.

Example:
    >>> import tfstrat
    >>> try:
    ...     tfstrat.TFConfig.from_hosts(["a:2222", "a:2222"])
    ... except tfstrat.TfstratError as e:
    ...     print(type(e).__name__)
    TFConfigError
"""

from __future__ import annotations


class TfstratError(Exception):
    """The base of every error tfstrat raises on purpose."""


class TFConfigError(TfstratError, ValueError):
    """A TF_CONFIG, or the input it is built from, is malformed or inconsistent.

    Example:
        >>> from tfstrat import TFConfig
        >>> try:
        ...     TFConfig.from_hosts(["a:2222", "a:2222"])
        ... except TFConfigError as e:
        ...     print(e)  # doctest: +ELLIPSIS
        Received: TF_CONFIG['cluster']['worker'][1]='a:2222', also used by ...
    """


class UsageError(TfstratError, ValueError):
    """A function, strategy, layer or command of tfstrat was given a value it cannot use (the
    message names the value and the fix)."""


class AgreementError(TfstratError, ValueError):
    """Tasks of one cluster disagree on the cluster, the strategy's options or the model."""


class VersionError(TfstratError, RuntimeError):
    """The installed TensorFlow or Keras is outside the range this tfstrat supports."""


class ListenError(TfstratError, RuntimeError):
    """A tfstrat listener could not bind its address and port (`in_use`: another socket holds
    that port)."""

    in_use = False


class ServerError(TfstratError, RuntimeError):
    """A task's server could not start (its port taken, its address not local)."""


class RingError(TfstratError, RuntimeError):
    """A peer of the all-reduce ring failed, timed out, or disagreed about the call."""


class TableServerError(TfstratError, RuntimeError):
    """A call to a ps task's table server failed (it stopped, timed out, or raised)."""


class UnknownRows(TfstratError, ValueError):
    """`tfstrat bench --rows` named a row the benchmark does not have."""


__all__ = [
    "TfstratError",
    "TFConfigError",
    "UsageError",
    "AgreementError",
    "VersionError",
    "ListenError",
    "ServerError",
    "RingError",
    "TableServerError",
    "UnknownRows",
]
