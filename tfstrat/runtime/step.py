"""The step being traced, per replica thread: what the strategies' exact step records
(`tfstrat.strategies._exact_step`) and what reads it while the same step is traced (Hybrid's
ps-held tables weight their pushes by the replica's rows, `tfstrat.ps.remote`)."""

import threading


class _Step(threading.local):
    """The step being traced, per replica: MirroredStrategy traces each replica in a thread."""

    rows = None  # this replica's rows (scalar int32 tensor), while a train_step is traced
    pending = None  # deferred apply_gradients calls (Keras's default train_step), or None
    scaled = False  # Keras divided a loss by the replica count in this step
    metrics = None  # metrics whose states ride in the gradient all-reduce
    states = None  # their all-reduced states, once the reduce has run
    pushes = None  # Hybrid's row pushes held for the loss scaling's verdict (`_loss_scale`)

    _FIELDS = ("rows", "pending", "scaled", "metrics", "states", "pushes")

    def capture(self) -> dict:
        """This replica's step state, to carry into another thread of the same replica."""
        return {name: getattr(self, name) for name in self._FIELDS}

    def restore(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)


_step = _Step()


def row_weight(replicas: int, dtype):
    """This replica's weight R n_r for a gradient summed inside the step's backward pass (as
    `tfstrat.strategies._exact_step` weighs the step's sum), or None when Keras scaled no loss
    in this step (the gradient is summed as it is)."""
    if _step.rows is None or not _step.scaled:
        return None
    import tensorflow as tf

    return tf.cast(_step.rows, dtype) * replicas
