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
from the aggregated gradients) Keras's own `apply` runs unchanged.
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat._compat import patches


def _nonfinite(optimizer, grads):
    """1.0 if any of this replica's gradients is inf or NaN, else 0.0."""
    return tf.cast(tf.logical_not(optimizer.check_finite(grads)), tf.float32)


def _agreed_apply(keras_tf_apply):
    def _tf_apply(self, grads, trainable_variables=None):
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync <= 1:
            return keras_tf_apply(self, grads, trainable_variables)
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        finite_branch = lambda: self._stateful_handle_finite_grads(grads, trainable_variables)  # noqa: E731
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            context = tf.distribute.get_replica_context()
            everywhere = context.all_reduce(tf.distribute.ReduceOp.SUM, _nonfinite(self, grads))
            tf.cond(
                tf.equal(everywhere, 0.0), finite_branch, self._stateful_handle_non_finite_grads
            )
            return

        def cross_replica(distribution, grads, trainable_variables):
            counts = distribution.extended.call_for_each_replica(
                lambda g: _nonfinite(self, g), args=(grads,)
            )
            everywhere = distribution.reduce(tf.distribute.ReduceOp.SUM, counts, axis=None)

            def apply_everywhere():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables)
                )

            # In cross-replica context, as Keras does: a cond in a replica context cannot have
            # a branch that calls merge_call (the inner optimizer's apply does).
            tf.cond(
                tf.equal(everywhere, 0.0), apply_everywhere, self._stateful_handle_non_finite_grads
            )

        tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(grads, trainable_variables)
        )

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
