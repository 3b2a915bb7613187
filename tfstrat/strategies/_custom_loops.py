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
- A strategy whose step wraps the optimizer's (ParameterServer's synchronous protocol) adopts
  the optimizer at its first `apply` (`_tfstrat_custom_apply`), as `fit` adopts its model's.
- An optimizer stepping variables whose strategy cannot train a custom loop exactly refuses
  by name (`_tfstrat_check_apply`: LocalSGD with local steps, a Hybrid table pushed with
  another optimizer's settings).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tfstrat._compat import patches
from tfstrat._compat.keras import BaseOptimizer
from tfstrat._compat.tf import in_control_flow


def _strategy_of(optimizer):
    return getattr(optimizer, "_distribution_strategy", None)


def _build_eagerly(optimizer, variables) -> None:
    """Builds `optimizer` for `variables` outside the traced function, once for all replicas."""
    import keras

    strategy = _strategy_of(optimizer)

    def build(*_):
        if optimizer.built:
            return
        with tf.init_scope():
            inside = strategy is None or tf.distribute.get_strategy() is strategy
            scope = contextlib.nullcontext() if inside else strategy.scope()
            with scope, keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
            optimizer.built = True

    context = tf.distribute.get_replica_context()
    local = len(getattr(getattr(strategy, "extended", None), "worker_devices", ())) or 1
    if context is None or tf.distribute.in_cross_replica_context():
        build()
    elif not in_control_flow():
        context.merge_call(build)  # once, in the cross-replica context, as fit builds it
    elif local == 1:
        build()  # a loop's body: no other replica of this process builds it
    # else: a loop's body on several local replicas; Keras builds it in the graph


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
        ):
            _build_eagerly(self, list(trainable_variables))
        route = getattr(strategy, "_tfstrat_custom_apply", None)
        routed = route(self) if route is not None else None
        if routed is not None:  # the strategy's own step around Keras's (ParameterServer)
            return routed(grads, trainable_variables)
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
    """Marks `optimizer` (and a LossScaleOptimizer's inner one) as stepped by ParameterServer's
    protocol (`fit`'s or a custom loop's)."""
    for o in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if o is not None:
            o._tfstrat_ps_adopted = True
