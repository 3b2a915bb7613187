"""Keras's `LossScaleOptimizer` under a data-parallel strategy: one decision for every replica.

Mixed precision (`mixed_float16`) scales the loss and skips a step whose gradients are not
finite, halving the scale. Keras 3.15 decides "finite" from the gradients `apply` is handed
(`keras/src/optimizers/loss_scale_optimizer.py`, `_tf_apply`): under a strategy those are one
replica's local gradients, before the all-reduce, and in the merge-call path it takes replica
0's answer. So when one replica overflows (one outlier example, one worker's batch) the
replicas and workers disagree: the all-reduce sums an inf into every replica's weights (stock
`MirroredStrategy`), or one worker all-reduces while another skips, and their collectives no
longer match.

Here every replica counts its non-finite gradients and the counts are summed over every
replica of every worker (one scalar all-reduce per step, beside the gradients'); the step is
applied, or skipped with the scale halved, on all of them alike, as one device would for the
global batch. Under one replica (one device, a ParameterServer worker, whose chief decides
from the aggregated gradients), and under LocalSGD with `sync_every > 1` (each worker steps
alone between syncs, with its own loss scale), Keras's own `apply` runs unchanged.

A table Hybrid holds on its ps is updated there from the rows' gradient each replica pushes.
Under loss scaling its layer holds the push (`tfstrat.ps.remote.RemoteTable.lookup`, `held`)
and hands it here: once the verdict is known it sends the rows' gradient divided by the loss
scale, or an empty push that tells the ps the step was skipped; a non-finite rows' gradient
makes its stand-in weight's gradient NaN, so the verdict covers the rows too.

With `compression="fp16"` the gradients cross the wire as float16 after the verdict; a value
beyond float16's range would arrive as inf in every weight. The verdict counts such values as
non-finite too (the step is skipped and the scale halved, as PyTorch's GradScaler does after an
fp16-compressed all-reduce).
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat._compat import patches
from tfstrat.reduce import compression
from tfstrat.runtime.step import _step


def _nonfinite(optimizer, grads):
    """1.0 if any of this replica's gradients is inf or NaN, or would be once sent as float16
    (`compression="fp16"`), else 0.0."""
    finite = optimizer.check_finite(grads)
    overflow = compression.overflows_the_wire(grads, optimizer.dynamic_scale)
    if overflow is not None:
        finite = tf.logical_and(finite, tf.logical_not(overflow))
    return tf.cast(tf.logical_not(finite), tf.float32)


def _replica():
    """This replica's id (a constant under the Mirrored strategies), or None."""
    value = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
    return None if value is None else int(value)


def _agreed_apply(keras_tf_apply):
    def _tf_apply(self, grads, trainable_variables=None):
        strategy = tf.distribute.get_strategy()
        held, _step.pushes = _step.pushes or [], None  # ps-held rows waiting for the verdict
        localsgd = getattr(self.inner_optimizer, "_tfstrat_localsgd", None)
        alone = localsgd is not None and localsgd.sync_every > 1  # each worker steps alone
        if (strategy.num_replicas_in_sync <= 1 or alone) and not held:
            return keras_tf_apply(self, grads, trainable_variables)
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        nonfinite = _nonfinite(self, grads)
        if strategy.num_replicas_in_sync > 1:
            context = tf.distribute.get_replica_context()
            nonfinite = context.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)
        finite = tf.equal(nonfinite, 0.0)
        for send in held:  # before the scale changes: the rows are unscaled by this step's
            send(finite, self.dynamic_scale)
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(
                finite,
                lambda: self._stateful_handle_finite_grads(grads, trainable_variables),
                self._stateful_handle_non_finite_grads,
            )
            return

        # Keras applies in a new call for each replica (below), which MirroredStrategy runs in
        # new threads: this replica's step state (its rows and whether Keras scaled its loss:
        # the exact weighting of `_exact_step`) goes with it. The metric states stay out of
        # that all-reduce (inside a cond, they could not come out): a step's logs under loss
        # scaling are each replica's own.
        # Shared by this optimizer's replicas (each traces this function in its own thread).
        states = self.__dict__.setdefault("_tfstrat_step_states", {})
        replica = _replica()
        states[replica] = _step.capture()

        def finite_on_replica(grads, trainable_variables):
            _step.restore(dict(states.get(_replica(), {}), metrics=None, states=None))
            self._stateful_handle_finite_grads(grads, trainable_variables)

        def cross_replica(distribution, finite, grads, trainable_variables):
            def apply_everywhere():
                distribution.extended.call_for_each_replica(
                    finite_on_replica, args=(grads, trainable_variables)
                )

            # In cross-replica context, as Keras does: a cond in a replica context cannot have
            # a branch that calls merge_call (the inner optimizer's apply does). Every replica
            # holds the same verdict.
            agreed = distribution.experimental_local_results(finite)[0]
            tf.cond(agreed, apply_everywhere, self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(finite, grads, trainable_variables)
        )
        _step.restore(states[replica])

    return _tf_apply


def install() -> None:
    """Patches `keras.optimizers.LossScaleOptimizer._tf_apply` (once per process)."""
    import keras

    cls = keras.optimizers.LossScaleOptimizer
    if patches.is_patched(cls, "_tf_apply"):
        return
    patches.patch(
        cls,
        "_tf_apply",
        _agreed_apply(patches.original(cls, "_tf_apply")),
        "a step is applied or skipped on every replica and worker alike: the finite check "
        "counts every replica's non-finite gradients",
    )
