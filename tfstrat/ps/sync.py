"""Synchronous training over ps tasks: TF1's SyncReplicasOptimizer protocol in TF2 eager.

Every worker keeps a mailbox on the ps for each variable's gradient (dense: a tensor shaped
like the variable; sparse: its indices and rows). A step `s` runs like this:

1. Every worker reads the global step `s` (`begin_step`); with backup workers, before it reads
   any variable.
2. It writes its gradients into its mailboxes, then its `mail_step[w] = s`. A worker that finds
   the global step already past `s` (a backup that came too late) writes nothing; its gradient
   is stale and counted as dropped.
3. The chief waits until at least `replicas_to_aggregate` mailboxes hold step `s`, averages
   those weighted by rows (below; the ops run on the ps that holds each variable), applies the
   optimizer once (so the optimizer's iteration counter advances once per step), records which
   workers made it in `included`, and then publishes `global_step = s + 1`.
4. Every other worker waits for `global_step > s` before its next step, so the next gradient
   is computed from the new variables. A worker whose fresh gradient was not among those the
   chief took (it arrived after the chief's count) also counts it as dropped.

Without backups (every worker aggregated, the default) no step is applied without every
running worker's push, so steps 1 and 2 skip their checks of the global step: the step read
runs alongside the variable reads, and no push can be stale.

Weighting. A worker's gradient is the mean over its own n_w rows. It writes g_w * n_w into its
mailboxes and n_w into `rows[w]`; the chief divides the sum of the gradients it takes by the
sum of their n_w, so a step's gradient is the mean over the rows of the workers aggregated
(for all workers: one device's gradient of the global batch, whatever the split; with backup
workers, of the batches that made it). A step whose loss Keras did not compute (a custom
train_step) hands in weight 1: the plain mean of the workers' gradients.

Every wait reads small variables on ps 0, and between reads blocks on ps 0's table server until
the state it waits on was signalled to change (`tfstrat.ps.signals`), so no task spins. It fails
after `timeout` seconds with a message naming the step and the workers that did not deliver.
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat.ps import variables as psvars
from tfstrat.reduce.sparse import dedup, scale


def poll_until(ready, deadline_s: float, message: list, wake=None):
    """In-graph: loops until `ready()` holds; errors after `deadline_s`. Returns the last
    `seen` value (below), or the number of reads.

    `ready()` returns a scalar bool op, or (that op, `seen`: an int64 tensor of what it read,
    returned to the caller). It reads variables on a ps task. `message` is a list of strings
    and tensors, printed in the error on timeout. `wake` is (signals, key)
    (`tfstrat.ps.signals`): between reads the loop blocks on ps 0 until `key` is signalled (or
    a second passes) instead of reading again at once; the count is read before the first
    read, so no signal is missed.
    """
    start = tf.timestamp()
    signals, key = wake if wake is not None else (None, None)
    count0 = signals.count(key) if signals else tf.constant(0, tf.int64)

    pair = []  # whether ready() returns (done, seen)

    def read():
        out = ready()
        pair[:] = [isinstance(out, tuple)]
        return out if pair[0] else (out, tf.zeros([], tf.int64))

    with tf.control_dependencies([count0]):
        done0, seen0 = read()

    def cond(done, *_):
        return tf.logical_not(done)

    def body(_, count, seen, tries):
        if signals:
            count = signals.wait(key, count)
        with tf.control_dependencies([count]):
            done, seen = read()
        late = tf.timestamp() - start > deadline_s
        check = tf.debugging.Assert(
            tf.logical_or(done, tf.logical_not(late)), message, summarize=64
        )
        with tf.control_dependencies([check]):
            return tf.identity(done), count, seen, tries + 1

    _, _, seen, tries = tf.while_loop(
        cond, body, [done0, count0, seen0, tf.constant(0)], parallel_iterations=1
    )
    return seen if pair[0] else tries


class SyncReplicas:
    """The shared state of synchronous training and the in-graph steps of its protocol."""

    def __init__(
        self, strategy, *, num_workers, worker, is_chief, replicas_to_aggregate, timeout, signals
    ):
        self.num_workers = num_workers
        self.signals = signals  # tfstrat.ps.signals.Client: wake-ups instead of spinning
        self.worker = worker
        self.is_chief = is_chief
        self.required = replicas_to_aggregate
        # Without backups every running worker's gradient is in every step: no push can be
        # stale, so no step read gates the variable reads and no fresh check is needed.
        self.backups = replicas_to_aggregate < num_workers
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
        for key in ("mailed", "applied"):  # the chief's count of running workers, the others'
            self.signals.signal_now(key)  # "has the chief finished its fit" both moved

    def _applied_or_chief_done(self, s):
        """(whether step `s` was applied or the chief finished the fit this worker is in, the
        global step). Once the chief has finished, no step is applied: the worker's remaining
        gradients are dropped."""
        fits, step = self.fits.read_value(), self.global_step.read_value()
        return tf.logical_or(step > s, fits[0] > fits[self.worker]), step

    # -- step boundaries -----------------------------------------------------------------

    def begin_step(self) -> list:
        """Reads the global step; returns what the step's variable reads must wait for: the
        read itself with backups (a variable read before it could belong to a step the chief
        applied meanwhile), else nothing (no step is applied without this worker's push)."""
        self._step = self.global_step.read_value()
        return [self._step] if self.backups else []

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

        def deliver():
            writes = [op for g, v in grads_and_vars for op in self._write(v, scale(g, weight))]
            writes.append(self.rows.scatter_update(tf.IndexedSlices(tf.reshape(weight, [1]), [w])))
            with tf.control_dependencies(writes):
                mailed = self.mail_step.scatter_update(tf.IndexedSlices(tf.reshape(s, [1]), [w]))
            with tf.control_dependencies([mailed]):
                signalled = self.signals.signal("mailed")
            with tf.control_dependencies([signalled]):
                return tf.constant(True)

        def drop():
            with tf.control_dependencies([self.dropped_count.assign_add(1)]):
                return tf.constant(False)

        if not self.backups:
            return deliver()
        return tf.cond(tf.equal(self.global_step.read_value(), s), deliver, drop)

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
                wake=(self.signals, "mailed"),
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
            published = self.global_step.assign(self._step + 1, read_value=False)
        with tf.control_dependencies([published]):
            return self.signals.signal("applied")

    def finish(self, after):
        """Step 4: waits until the step is applied; counts this worker's gradient if dropped.
        The chief applied the step itself, with its own gradient (always fresh): it waits for
        nothing."""
        s, w = self._step, self.worker
        if self.is_chief:
            with tf.control_dependencies(after):
                return self.dropped_count.read_value()
        with tf.control_dependencies(after):
            step = poll_until(
                lambda: self._applied_or_chief_done(s),
                self.timeout,
                [
                    f"tfstrat ParameterServer: worker {w} waited {self.timeout:g} s for the chief "
                    "to apply step",
                    s,
                    ". Is the chief alive? See its log.",
                ],
                wake=(self.signals, "applied"),
            )

        def left_out():  # delivered in time, yet not among the gradients the chief took
            with tf.control_dependencies([step]):  # reads after the wait (not ordered otherwise)
                missed = tf.logical_and(
                    tf.equal(self.mail_step.read_value()[w], s),
                    tf.not_equal(self.included.read_value()[w], s),
                )
            return tf.cond(
                missed,
                lambda: self.dropped_count.assign_add(1),
                lambda: self.dropped_count.read_value(),
            )

        if self.backups:
            return left_out()
        # Without backups a step applied includes every running worker's push: only a chief
        # that finished its fit leaves one out.
        return tf.cond(step > s, self.dropped_count.read_value, left_out)
