"""`compile(jit_compile=True)` under tfstrat strategies.

Keras 3.15 wraps its whole step function, `strategy.run` of every replica and the reduction
of their logs, in `tf.function(jit_compile=True)`. Under a strategy XLA cannot compile that:
tfstrat's TCP all-reduce is a `PyFunc` ("Detected unsupported operations ... PyFunc"), and one
XLA cluster cannot hold the variables of several devices ("Trying to access resource ...
located in device CPU:1 from device CPU:0"). Stock tf.distribute fails the same ways.

So, under a tfstrat strategy, Keras builds its step function without XLA, and the model is
marked: each replica's computation (forward, backward and metric updates) is compiled by XLA
on its own device, and the exchange and the optimizer's update run outside the compiled part
(`tfstrat.strategies._compute`).

A model with tables Hybrid holds on the ps tasks runs without XLA (its lookups are calls to the
ps, which XLA cannot compile), predict included; one line says so.
"""

from __future__ import annotations

import logging

from tfstrat._compat import patches

logger = logging.getLogger(__name__)
_installed = False


def _without_xla(model) -> bool:
    """Whether `model` runs without XLA under jit_compile=True (said once): its forward pass
    calls the ps (ps-held tables) or exchanges with other devices (ModelParallel's model
    axis), which XLA cannot compile."""
    from tfstrat.keras._ps_tables import holds_tables

    mesh = getattr(getattr(model._distribute_strategy, "extended", None), "_tfstrat_mesh", None)
    if holds_tables(model):
        why = "its tables are on the ps tasks, and the lookups are calls to the ps"
    elif mesh is not None and mesh.model_size > 1:
        why = "ModelParallel's layers exchange activations between the devices in each step"
    else:
        return False
    if not getattr(model, "_tfstrat_no_xla_said", False):
        model._tfstrat_no_xla_said = True
        logger.info(
            "tfstrat: jit_compile=True: %s runs without XLA (%s, which XLA cannot compile)",
            model.name,
            why,
        )
    return True


def install() -> None:
    """Wraps Keras's step-function builder (once per process); acts only under tfstrat."""
    global _installed
    from tfstrat._compat.keras import TensorFlowTrainer

    if _installed and patches.is_patched(TensorFlowTrainer, "_make_function"):
        return  # (after `patches.remove_all()` it installs again)

    keras_make_function = TensorFlowTrainer._make_function
    keras_make_predict_function = TensorFlowTrainer.make_predict_function

    def _make_function(self, step_function):
        strategy = self._distribute_strategy
        tfstrat = strategy is not None and type(strategy).__module__.startswith("tfstrat.")
        jit = bool(tfstrat and not self.run_eagerly and self.jit_compile)
        self._tfstrat_jit = jit and not _without_xla(self)
        if not jit:
            return keras_make_function(self, step_function)
        self._jit_compile = False  # read once, as the function is made
        try:
            return keras_make_function(self, step_function)
        finally:
            self._jit_compile = True

    def make_predict_function(self, force=False):
        # Keras compiles predict's per-replica step itself (each replica apart): only a
        # model whose forward pass calls the ps or other devices must be built without XLA.
        if not (self.jit_compile and not self.run_eagerly and _without_xla(self)):
            return keras_make_predict_function(self, force)
        self._jit_compile = False
        try:
            return keras_make_predict_function(self, force)
        finally:
            self._jit_compile = True

    why = "jit_compile=True compiles each replica's computation, not the exchange"
    patches.patch(TensorFlowTrainer, "_make_function", _make_function, why)
    patches.patch(
        TensorFlowTrainer,
        "make_predict_function",
        make_predict_function,
        "no XLA for a model whose forward pass calls the ps or other devices",
    )
    _installed = True
