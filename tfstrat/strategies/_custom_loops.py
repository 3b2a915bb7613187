"""Custom training loops under strategies that cannot train them as `fit` does: refused by name.

ParameterServer's synchronous step (every worker's gradient aggregated on ps 0, then applied
once by the chief) is wired into the optimizer of a model `fit` trains (`ParameterServer._adopt`).
An optimizer stepped outside `fit` (a `tf.GradientTape` loop calling `apply_gradients`) would
apply each worker's gradient to the ps variables on its own: a different algorithm from one
device, without a word. So under `ParameterServer(mode="sync")` such a step fails, naming the
strategy, the call and what to use instead. A custom `train_step` inside `fit` is adopted like
Keras's own. Asynchronous mode applies each worker's update as it comes anyway: allowed.
"""

from __future__ import annotations

from tfstrat._compat import patches
from tfstrat._compat.keras import BaseOptimizer
from tfstrat.errors import UsageError


def adopted(optimizer) -> None:
    """Marks `optimizer` (and a LossScaleOptimizer's inner one) as stepped by `fit`'s protocol."""
    for o in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if o is not None:
            o._tfstrat_ps_adopted = True


def _refusing(keras_apply):
    def apply(self, grads, trainable_variables=None):
        strategy = getattr(self, "_distribution_strategy", None)
        sync = getattr(strategy, "_tfstrat_refuses_custom_loops", False)
        if sync and not getattr(self, "_tfstrat_ps_adopted", False):
            raise UsageError(
                f"Received: {type(self).__name__}.apply_gradients outside model.fit under "
                "tfstrat.ParameterServer(mode='sync'). Its synchronous step (every worker's "
                "gradient aggregated, then applied once) runs only in fit; here each worker "
                "would apply its own gradient to the ps variables and train differently from "
                "one device. Train with model.fit (a custom train_step is fine), or run the "
                "loop under tfstrat.CollectiveAllReduce, or ParameterServer(mode='async')."
            )
        return keras_apply(self, grads, trainable_variables)

    return apply


def refuse_under_ps_sync() -> None:
    """Installs the refusal (once per process): `BaseOptimizer.apply` checks its strategy."""
    if patches.is_patched(BaseOptimizer, "apply"):
        return
    patches.patch(
        BaseOptimizer,
        "apply",
        _refusing(patches.original(BaseOptimizer, "apply")),
        "ParameterServer(mode='sync') refuses an optimizer step outside fit, by name",
    )
