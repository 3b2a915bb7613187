"""Custom training loops (TensorFlow's tutorials: `strategy.run(train_step)` with a
`tf.GradientTape` and `optimizer.apply_gradients`), as `fit` trains them.

Keras's `fit` hands a strategy its model and optimizer (`strategy.run(model.train_step)`); a
custom loop does not, so what a strategy needs of its optimizer it learns here, at the
optimizer's own calls (`install`, once per process):

- An optimizer is built eagerly. Keras builds an unbuilt optimizer at its first `apply`, which
  in a custom loop is inside the `tf.function`: its slot variables (Adam's moments, momentum)
  are then created while tracing, which TensorFlow 2.21 cannot do under a multi-replica
  strategy (stock `MirroredStrategy` fails with "You must feed a value for placeholder
  tensor"). So the first `apply` builds it outside the graph, once for every replica, as `fit`
  does before its first step.
- A strategy in whose scope an optimizer is created is told (`_tfstrat_note_optimizer`):
  Hybrid's ps-held tables push their rows' gradient while the tape computes it, so the
  table's optimizer (its hyperparameters and step) must be known before `apply_gradients`.
- An optimizer stepping variables whose strategy cannot train a custom loop exactly refuses
  by name (`_tfstrat_check_apply` on the strategy).
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat._compat import patches
from tfstrat._compat.keras import BaseOptimizer


def _strategy_of(optimizer):
    return getattr(optimizer, "_distribution_strategy", None)


def _in_replica_graph() -> bool:
    """Not a loop's body or a cond's branch (where a merge_call cannot run)."""
    return not getattr(tf.compat.v1.get_default_graph(), "is_control_flow_graph", False)


def _build_eagerly(optimizer, variables) -> None:
    """Builds `optimizer` for `variables` outside the traced function, once for all replicas."""
    import keras

    strategy = _strategy_of(optimizer)

    def build(*_):
        if optimizer.built:
            return
        with tf.init_scope():
            scope = strategy.scope() if strategy is not None else _nothing()
            with scope, keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
            optimizer.built = True

    context = tf.distribute.get_replica_context()
    if context is not None and not tf.distribute.in_cross_replica_context():
        context.merge_call(build)
    else:
        build()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _apply(keras_apply):
    def apply(self, grads, trainable_variables=None):
        strategy = _strategy_of(self)
        check = getattr(strategy, "_tfstrat_check_apply", None)
        if check is not None:
            check(self, trainable_variables)
        if (
            trainable_variables is not None
            and not self.built
            and len(grads)
            and not tf.executing_eagerly()
            and getattr(strategy, "_tfstrat_builds_eagerly", False)
            and _in_replica_graph()
        ):
            _build_eagerly(self, list(trainable_variables))
        return keras_apply(self, grads, trainable_variables)

    return apply


def _init(keras_init):
    def __init__(self, *args, **kwargs):
        keras_init(self, *args, **kwargs)
        note = getattr(tf.distribute.get_strategy(), "_tfstrat_note_optimizer", None)
        if note is not None:
            note(self)

    return __init__


def install() -> None:
    """Patches `BaseOptimizer.apply` and `__init__` (once per process)."""
    if patches.is_patched(BaseOptimizer, "apply"):
        return
    patches.patch(
        BaseOptimizer,
        "apply",
        _apply(patches.original(BaseOptimizer, "apply")),
        "a custom loop's first apply builds the optimizer outside its tf.function, and a "
        "strategy that cannot train the loop exactly refuses it by name",
    )
    patches.patch(
        BaseOptimizer,
        "__init__",
        _init(patches.original(BaseOptimizer, "__init__")),
        "the strategy in scope learns of each optimizer made in it (Hybrid's ps-held tables "
        "push with their optimizer's step)",
    )


def adopted(optimizer) -> None:
    """Marks `optimizer` (and a LossScaleOptimizer's inner one) as stepped by `fit`'s protocol."""
    for o in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if o is not None:
            o._tfstrat_ps_adopted = True


def refuse_outside_fit(optimizer, _variables) -> None:
    """ParameterServer(mode="sync")'s check: its synchronous step runs only in `fit`."""
    from tfstrat.errors import UsageError

    if getattr(optimizer, "_tfstrat_ps_adopted", False):
        return
    raise UsageError(
        f"Received: {type(optimizer).__name__}.apply_gradients outside model.fit under "
        "tfstrat.ParameterServer(mode='sync'). Its synchronous step (every worker's "
        "gradient aggregated, then applied once) runs only in fit; here each worker "
        "would apply its own gradient to the ps variables and train differently from "
        "one device. Train with model.fit (a custom train_step is fine), or run the "
        "loop under tfstrat.CollectiveAllReduce, or ParameterServer(mode='async')."
    )
