"""Synchronous training over ps tasks: TF1's SyncReplicasOptimizer protocol in TF2 eager.

Every worker keeps a mailbox on the ps for each variable's gradient (dense: a tensor shaped
like the variable; sparse: its indices and rows). A step `s` runs like this:

1. Every worker reads the global step `s` before it reads any variable (`begin_step`).
2. It writes its gradients into its mailboxes, then its `mail_step[w] = s`. A worker that finds
   the global step already past `s` (a backup that came too late) writes nothing; its gradient
   is stale and counted as dropped.
3. The chief waits until at least `replicas_to_aggregate` mailboxes hold step `s`, averages
   those weighted by rows (below; the ops run on the ps that holds each variable), applies the
   optimizer once (so the
   optimizer's iteration counter advances once per step), records which workers made it in
   `included`, and then publishes `global_step = s + 1`.
4. Every worker waits for `global_step > s` before its next step, so the next gradient is
   computed from the new variables. A worker whose fresh gradient was not among those the
   chief took (it arrived after the chief's count) also counts it as dropped.

Weighting. A worker's gradient is the mean over its own n_w rows. It writes g_w * n_w into its
mailboxes and n_w into `rows[w]`; the chief divides the sum of the gradients it takes by the
sum of their n_w, so a step's gradient is the mean over the rows of the workers aggregated
(for all workers: one device's gradient of the global batch, whatever the split; with backup
workers, of the batches that made it). A step whose loss Keras did not compute (a custom
train_step) hands in weight 1: the plain mean of the workers' gradients.

Every wait polls a small variable on ps 0 and fails after `timeout` seconds with a message
naming the step and the workers that did not deliver; nothing blocks inside the ps.
"""

from __future__ import annotations

import time

import tensorflow as tf

from tfstrat.ps import variables as psvars
from tfstrat.reduce.sparse import dedup, scale


def _sleep(seconds: float):
    def nap():
        time.sleep(seconds)
        return 0

    return tf.py_function(nap, [], tf.int32)


def poll_until(ready, deadline_s: float, message: list, pause: float = 0.0):
    """In-graph: loops until `ready()` (a scalar bool op) holds; errors after `deadline_s`.

    `message` is a list of strings and tensors, printed in the error on timeout. `ready`
    reads a variable on a ps task, a round trip of a millisecond or more here, so the loop
    needs no sleep of its own (`pause` adds one, in seconds).
    """
    start = tf.timestamp()

    def cond(done, _):
        return tf.logical_not(done)

    def body(_, tries):
        with tf.control_dependencies([_sleep(pause)] if pause else []):
            done = ready()
        late = tf.timestamp() - start > deadline_s
        check = tf.debugging.Assert(
            tf.logical_or(done, tf.logical_not(late)), message, summarize=64
        )
        with tf.control_dependencies([check]):
            return tf.identity(done), tries + 1

    done0 = ready()
    _, tries = tf.while_loop(cond, body, [done0, tf.constant(0)], parallel_iterations=1)
    return tries


class SyncReplicas:
    """The shared state of synchronous training and the in-graph steps of its protocol."""

    def __init__(self, strategy, *, num_workers, worker, is_chief, replicas_to_aggregate, timeout):
        self.num_workers = num_workers
        self.worker = worker
        self.is_chief = is_chief
        self.required = replicas_to_aggregate
        self.timeout = float(timeout)
        device = psvars.ps_device(0)
        n = num_workers
        make = lambda name, shape, value: strategy.extended.shared(  # noqa: E731
            f"sync/{name}", shape, tf.int64, device, initial_value=value
        )
        self.global_step = make("global_step", [], tf.constant(0, tf.int64))
        self.mail_step = make("mail_step", [n], tf.fill([n], tf.constant(-1, tf.int64)))
        self.included = make("included", [n], tf.fill([n], tf.constant(-1, tf.int64)))
        self.fits = make("fits", [n], tf.zeros([n], tf.int64))  # fits each worker finished
        # The weight of each worker's mailed gradients (its rows), written before `mail_step`.
        self.rows = strategy.extended.shared(
            "sync/rows", [n], tf.float32, device, initial_value=tf.zeros([n], tf.float32)
        )
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
        self.fits.scatter_add(tf.IndexedSlices(tf.ones([1], tf.int64), [self.worker]))

    def _applied_or_chief_done(self, s):
        # Once the chief has finished the fit this worker is in, no step is applied: the
        # worker's remaining gradients are dropped.
        fits = self.fits.read_value()
        return tf.logical_or(self.global_step.read_value() > s, fits[0] > fits[self.worker])

    # -- step boundaries -----------------------------------------------------------------

    def begin_step(self):
        """Reads the global step; called before the step reads any variable."""
        self._step = self.global_step.read_value()
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

    def push(self, grads_and_vars, rows=None):
        """Step 2: this worker's gradients into its mailboxes (or counted dropped if stale).

        `rows` (a scalar tensor, or None for weight 1) is the number of rows the gradients are
        the mean of: they are handed in multiplied by it, and it goes to `rows[w]`.
        """
        s, w = self._step, self.worker
        weight = tf.constant(1.0) if rows is None else tf.cast(rows, tf.float32)
        fresh = tf.equal(self.global_step.read_value(), s)

        def deliver():
            writes = [op for g, v in grads_and_vars for op in self._write(v, scale(g, weight))]
            writes.append(self.rows.scatter_update(tf.IndexedSlices(tf.reshape(weight, [1]), [w])))
            with tf.control_dependencies(writes):
                mailed = self.mail_step.scatter_update(tf.IndexedSlices(tf.reshape(s, [1]), [w]))
            with tf.control_dependencies([mailed]):
                return tf.constant(True)

        def drop():
            with tf.control_dependencies([self.dropped_count.assign_add(1)]):
                return tf.constant(False)

        return tf.cond(fresh, deliver, drop)

    def aggregate(self, grads_and_vars, after):
        """Step 3 (chief): waits for enough fresh mailboxes; returns their rows-weighted mean."""
        s = self._step

        def enough():
            # Workers that finished the chief's current fit deliver nothing more.
            fits = self.fits.read_value()
            running = tf.reduce_sum(tf.cast(fits <= fits[0], tf.int32))
            need = tf.maximum(1, tf.minimum(self.required, running))
            fresh = tf.reduce_sum(tf.cast(tf.equal(self.mail_step.read_value(), s), tf.int32))
            return fresh >= need

        with tf.control_dependencies([after]):
            waited = poll_until(
                enough,
                self.timeout,
                [
                    f"tfstrat ParameterServer: waited {self.timeout:g} s for the gradients of "
                    f"{self.required} worker(s) at step",
                    s,
                    "; the step each worker last delivered (-1: none):",
                    self.mail_step.read_value(),
                    ". A worker that stopped early or is stuck holds the others; see its log.",
                ],
            )
        with tf.control_dependencies([waited]):  # reads after the wait (not ordered otherwise)
            mask = tf.equal(self.mail_step.read_value(), s)
            # A worker writes rows[w] before mail_step[w]: these are the masked steps' weights.
            count = tf.reduce_sum(tf.where(mask, self.rows.read_value(), 0.0))
        averaged = [(self._average(v, g, mask, count), v) for g, v in grads_and_vars]
        record = self.included.assign(tf.where(mask, s, self.included.read_value()))
        return averaged, record

    def publish(self, applied):
        """Step 3, last (chief): the next step may begin."""
        with tf.control_dependencies(applied):
            return self.global_step.assign(self._step + 1, read_value=False)

    def finish(self, after):
        """Step 4: waits until the step is applied; counts this worker's gradient if dropped."""
        s, w = self._step, self.worker
        with tf.control_dependencies(after):
            waited = poll_until(
                lambda: self._applied_or_chief_done(s),
                self.timeout,
                [
                    f"tfstrat ParameterServer: worker {w} waited {self.timeout:g} s for the chief "
                    "to apply step",
                    s,
                    ". Is the chief alive? See its log.",
                ],
            )
        with tf.control_dependencies([waited]):
            delivered_but_left_out = tf.logical_and(
                tf.equal(self.mail_step.read_value()[w], s),
                tf.not_equal(self.included.read_value()[w], s),
            )
            return tf.cond(
                delivered_but_left_out,
                lambda: self.dropped_count.assign_add(1),
                lambda: self.dropped_count.read_value(),
            )
