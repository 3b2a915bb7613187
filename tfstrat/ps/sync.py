"""Synchronous training over ps tasks: TF1's SyncReplicasOptimizer protocol in TF2 eager.

Every worker keeps a mailbox on the ps for each variable's gradient (dense: a tensor shaped
like the variable; sparse: its indices and rows). A step `s` runs like this:

1. Every worker reads the global step `s` (`begin_step`) before it reads any variable.
2. It writes its gradients into its mailboxes, then mails step `s` (with its rows) on ps 0.
   A worker whose mail finds the global step already past `s` (a backup that came too late)
   is not recorded; its gradient is stale and counted as dropped.
3. The chief waits until at least `replicas_to_aggregate` workers mailed step `s` (fewer if
   workers finished their fit), averages their mailboxes weighted by rows (below; the ops run
   on the ps that holds each variable), applies the optimizer once (so the optimizer's
   iteration counter advances once per step), and then publishes `global_step = s + 1`.
4. Every other worker waits for `global_step > s` before its next step, so the next gradient
   is computed from the new variables. A worker whose fresh gradient was not among those the
   chief took (it arrived after the chief's count) also counts it as dropped.

Weighting. A worker's gradient is the mean over its own n_w rows. It writes g_w * n_w into its
mailboxes and mails n_w; the chief divides the sum of the gradients it takes by the
sum of their n_w, so a step's gradient is the mean over the rows of the workers aggregated
(for all workers: one device's gradient of the global batch, whatever the split; with backup
workers, of the batches that made it). A step whose loss Keras did not compute (a custom
train_step) hands in weight 1: the plain mean of the workers' gradients.

The step's shared state (the global step, who mailed which step, who was taken, fits done)
lives in ps 0's process (`tfstrat.ps.steps`): each check is one call from the step's graph, and
each wait blocks there until what it waits for happens, so no task reads in a loop. A wait
fails after `timeout` seconds with a message naming the step and the workers that did not
deliver.
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat.reduce.sparse import dedup, scale


class SyncReplicas:
    """The shared state of synchronous training and the in-graph steps of its protocol."""

    def __init__(self, strategy, *, num_workers, worker, replicas_to_aggregate, steps):
        self.num_workers = num_workers
        self.steps = steps  # tfstrat.ps.steps.Client: the shared state, on ps 0
        self.worker = worker
        self.required = replicas_to_aggregate
        self.timeout = steps.timeout
        with tf.init_scope():
            self.dropped_count = tf.Variable(0, dtype=tf.int64, trainable=False, name="dropped")
        self._strategy = strategy
        self._mailboxes: dict[tuple[str, bool], list] = {}
        self._step = None

    @property
    def dropped(self) -> int:
        """Gradients this worker computed that no step applied (stale backups)."""
        return int(self.dropped_count.numpy())

    def mark_done(self):
        """Eager, at the end of each of this worker's fits: the others stop waiting for it."""
        self.steps.fit_done()

    # -- step boundaries -----------------------------------------------------------------

    def begin_step(self):
        """Reads the global step, which the step's variable reads must wait for (a variable
        read before it could belong to a step the chief applied meanwhile, without this
        worker: a backup's, or one whose fit ended early)."""
        self._step = self.steps.begin(self.num_workers, self.required)
        return self._step

    # -- mailboxes ----------------------------------------------------------------------

    def _boxes(self, var, sparse: bool):
        """This variable's mailboxes, one per worker, created on first use (while tracing)."""
        key = (var._shared_name if hasattr(var, "_shared_name") else var.name, sparse)
        if key not in self._mailboxes:
            device, base = var.device, key[0]
            make = lambda suffix, shape, dtype, w: self._strategy.extended.shared(  # noqa: E731
                f"mail/{base}/w{w}/{suffix}", shape, dtype, device, owner=w
            )
            if sparse:
                boxes = [
                    (make("indices", None, tf.int64, w), make("values", None, var.dtype, w))
                    for w in range(self.num_workers)
                ]
            else:
                boxes = [(make("dense", var.shape, var.dtype, w),) for w in range(self.num_workers)]
            self._mailboxes[key] = boxes
        return self._mailboxes[key]

    def _write(self, var, grad):
        if isinstance(grad, tf.IndexedSlices):
            grad = dedup(grad)  # local aggregation: rows sharing an index are summed first
            indices, values = self._boxes(var, True)[self.worker]
            with tf.device(var.device):
                return [
                    indices.assign(tf.cast(grad.indices, tf.int64), read_value=False),
                    values.assign(grad.values, read_value=False),
                ]
        (box,) = self._boxes(var, False)[self.worker]
        return [box.assign(grad, read_value=False)]

    def _average(self, var, grad_like, mask, count):
        """The sum of the (weighted) gradients in the mailboxes of the workers in `mask`,
        divided by `count` (the sum of their weights), on var's ps."""
        with tf.device(var.device):
            if isinstance(grad_like, tf.IndexedSlices):
                parts_i, parts_v = [], []
                dim = grad_like.values.shape[1:]
                for w, (indices, values) in enumerate(self._boxes(var, True)):
                    take = mask[w]
                    parts_i.append(
                        tf.cond(take, indices.read_value, lambda: tf.zeros([0], tf.int64))
                    )
                    parts_v.append(
                        tf.cond(
                            take,
                            lambda v=values: tf.reshape(v.read_value(), [-1, *dim]),
                            lambda: tf.zeros([0, *dim], var.dtype),
                        )
                    )
                summed = dedup(
                    tf.IndexedSlices(
                        tf.concat(parts_v, 0), tf.concat(parts_i, 0), grad_like.dense_shape
                    )
                )
                return tf.IndexedSlices(
                    tf.math.divide_no_nan(summed.values, tf.cast(count, var.dtype)),
                    summed.indices,
                    summed.dense_shape,
                )
            zeros = lambda: tf.zeros(var.shape, var.dtype)  # noqa: E731
            total = tf.add_n(
                [
                    tf.cond(mask[w], box.read_value, zeros)  # an unused box may be empty
                    for w, (box,) in enumerate(self._boxes(var, False))
                ]
            )
            return tf.math.divide_no_nan(total, tf.cast(count, var.dtype))

    # -- the step -----------------------------------------------------------------------

    def push(self, grads_and_vars, rows=None, asks=None):
        """Step 2: this worker's gradients into its mailboxes, then mailed for step `s` on
        ps 0; a stale one (the global step moved past `s`) is counted as dropped.

        `rows` (a scalar tensor, or None for weight 1) is the number of rows the gradients are
        the mean of: they are handed in multiplied by it, and the mail carries it. So does
        `asks`, this worker's two stop requests (`tfstrat.strategies._stopping`; None: none).
        """
        weight = tf.constant(1.0) if rows is None else tf.cast(rows, tf.float32)
        asks = tf.zeros([2]) if asks is None else tf.cast(asks, tf.float32)
        writes = [op for g, v in grads_and_vars for op in self._write(v, scale(g, weight))]
        with tf.control_dependencies(writes):
            fresh = self.steps.mail(self._step, weight, asks)
        return self.dropped_count.assign_add(1 - fresh)

    def aggregate(self, grads_and_vars, after):
        """Step 3 (chief): waits for enough fresh mailboxes; returns their rows-weighted mean
        and the step's stop requests (any of the workers taken)."""
        s, required, timeout = self._step, self.required, self.timeout

        def why(step, mailed):
            return (
                f"tfstrat ParameterServer: waited {timeout:g} s for the gradients of "
                f"{required} worker(s) at step {step}; the step each worker last delivered "
                f"(-1: none): {mailed}. A worker that stopped early or is stuck holds the "
                "others; see its log."
            )

        with tf.control_dependencies([after]):
            mask, count, stop = self.steps.wait_mailed(s, why)
        mask = tf.unstack(tf.reshape(mask, [self.num_workers]))
        averaged = [(self._average(v, g, mask, count), v) for g, v in grads_and_vars]
        return averaged, stop

    def publish(self, applied):
        """Step 3, last (chief): the next step may begin."""
        with tf.control_dependencies(applied):
            return self.steps.publish(self._step)

    def finish(self, after):
        """Step 4 (the other workers): waits until the step is applied; counts this worker's
        gradient if it was left out; returns (that count, the step's stop requests, as the
        chief got them). The chief applied the step itself, with its own gradient: it waits
        for nothing, and does not call this."""
        w = self.worker

        def why(step, _):
            return (
                f"tfstrat ParameterServer: worker {w} waited {self.timeout:g} s for the chief "
                f"to apply step {step}. Is the chief alive? See its log."
            )

        with tf.control_dependencies(after):
            left_out, stop = self.steps.wait_applied(self._step, why)
        return self.dropped_count.assign_add(left_out), stop
