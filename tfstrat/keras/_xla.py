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
"""

from __future__ import annotations

from tfstrat._compat import patches

_installed = False


def install() -> None:
    """Wraps Keras's step-function builder (once per process); acts only under tfstrat."""
    global _installed
    from tfstrat._compat.keras import TensorFlowTrainer

    if _installed and patches.is_patched(TensorFlowTrainer, "_make_function"):
        return  # (after `patches.remove_all()` it installs again)

    keras_make_function = TensorFlowTrainer._make_function

    def _make_function(self, step_function):
        strategy = self._distribute_strategy
        tfstrat = strategy is not None and type(strategy).__module__.startswith("tfstrat.")
        self._tfstrat_jit = bool(tfstrat and not self.run_eagerly and self.jit_compile)
        if not self._tfstrat_jit:
            return keras_make_function(self, step_function)
        self._jit_compile = False  # read once, as the function is made
        try:
            return keras_make_function(self, step_function)
        finally:
            self._jit_compile = True

    patches.patch(
        TensorFlowTrainer,
        "_make_function",
        _make_function,
        "jit_compile=True compiles each replica's computation, not the exchange",
    )
    _installed = True
