"""Every Keras attribute tfstrat patches, with the signatures its replacement was written for,
checked when a strategy is created (`check`).

A Keras release that renames a patched method, or changes its parameters, would otherwise
break tfstrat far from the cause (a replacement called with arguments it does not take, or
never called at all). `patches.patch` refuses an attribute this table does not list, so the
table is complete by construction.

Each row: (owner as tfstrat reaches it, attribute, {signature: the Keras releases that have
it}). The releases are the tested ones (`versions.TESTED_KERAS`); a signature only some of
them have is listed with those.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

_ALL = "3.10-3.15"
_SLOTS_STEP = {"(self, gradient, variable, learning_rate)": _ALL}
_TRAINER = "keras.src.backend.tensorflow.trainer"

PATCHED: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("keras.src.losses.loss", "scale_loss_for_distribution", {"(value)": _ALL}),
    ("keras.src.optimizers.base_optimizer.BaseOptimizer", "build", {"(self, variables)": _ALL}),
    (
        "keras.src.optimizers.base_optimizer.BaseOptimizer",
        "apply",
        {"(self, grads, trainable_variables=None)": _ALL},
    ),
    (
        "keras.src.optimizers.base_optimizer.BaseOptimizer",
        "__init__",
        {
            "(self, learning_rate, weight_decay=None, clipnorm=None, clipvalue=None, "
            "global_clipnorm=None, use_ema=False, ema_momentum=0.99, "
            "ema_overwrite_frequency=None, loss_scale_factor=None, "
            "gradient_accumulation_steps=None, name=None, **kwargs)": _ALL
        },
    ),
    (
        "keras.src.optimizers.base_optimizer.BaseOptimizer",
        "add_variable_from_reference",
        {"(self, reference_variable, name=None, initializer='zeros')": _ALL},
    ),
    ("keras.Variable", "_initialize", {"(self, value)": _ALL}),
    ("keras.layers.Layer", "_maybe_build", {"(self, call_spec)": _ALL}),
    (
        f"{_TRAINER}.TFEpochIterator",
        "__init__",
        {"(self, distribute_strategy=None, *args, **kwargs)": _ALL},
    ),
    (f"{_TRAINER}.TensorFlowTrainer", "_make_function", {"(self, step_function)": _ALL}),
    (f"{_TRAINER}.TensorFlowTrainer", "make_predict_function", {"(self, force=False)": _ALL}),
    (
        f"{_TRAINER}.TensorFlowTrainer",
        "_maybe_symbolic_build",
        {"(self, iterator=None, data_batch=None)": _ALL},
    ),
    ("keras.layers.Embedding", "build", {"(self, input_shape=None)": _ALL}),
    ("keras.layers.Embedding", "call", {"(self, inputs)": _ALL}),
    (
        "keras.optimizers.LossScaleOptimizer",
        "_tf_apply",
        {"(self, grads, trainable_variables=None)": _ALL},
    ),
    (
        "keras.src.saving.saving_api",
        "save_model",
        {"(model, filepath, overwrite=True, zipped=None, **kwargs)": _ALL},
    ),
    (
        "keras.src.saving.saving_api",
        "save_weights",
        {"(model, filepath, overwrite=True, max_shard_size=None, **kwargs)": _ALL},
    ),
    (
        "keras.saving",
        "save_model",
        {"(model, filepath, overwrite=True, zipped=None, **kwargs)": _ALL},
    ),
    (
        "keras.models",
        "save_model",
        {"(model, filepath, overwrite=True, zipped=None, **kwargs)": _ALL},
    ),
    (
        "keras.src.callbacks.callback_list.CallbackList",
        "__init__",
        {
            "(self, callbacks=None, add_history=False, add_progbar=False, model=None, **params)": _ALL
        },
    ),
    (
        "keras.src.callbacks.callback_list.CallbackList",
        "on_epoch_begin",
        {"(self, epoch, logs=None)": _ALL},
    ),
    (
        "keras.src.trainers.epoch_iterator.EpochIterator",
        "__init__",
        {
            "(self, x, y=None, sample_weight=None, batch_size=None, steps_per_epoch=None, "
            "shuffle=False, class_weight=None, steps_per_execution=1)": _ALL
        },
    ),
    ("keras.src.trainers.epoch_iterator.EpochIterator", "_enumerate_iterator", {"(self)": _ALL}),
    (
        "keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter",
        "get_tf_dataset",
        {"(self)": _ALL},
    ),
    ("keras.optimizers.Adagrad", "update_step", _SLOTS_STEP),
    ("keras.optimizers.Adam", "update_step", _SLOTS_STEP),
    ("keras.optimizers.SGD", "update_step", _SLOTS_STEP),
    ("keras.optimizers.RMSprop", "update_step", _SLOTS_STEP),
)


def resolve(path: str) -> Any:
    """The module, or the object inside one, that a dotted `path` names (None if missing)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            found = getattr(found, part, None)
            if found is None:
                return None
        return found
    return None


def listed(owner: Any, name: str) -> bool:
    """Whether `owner.name` is a row of PATCHED (the owner as an object)."""
    return any(resolve(path) is owner and attr == name for path, attr, _ in PATCHED)


def problems(keras_version: str, original: Callable[[Any, str], Any] = getattr) -> list[str]:
    """What differs from the table in the installed Keras: a missing owner or attribute, or a
    signature no tested release has (empty when everything matches). `original(owner, name)`
    gives Keras's own attribute where tfstrat has patched it (`patches.original`)."""
    out = []
    for path, name, signatures in PATCHED:
        owner = resolve(path)
        if owner is None:
            out.append(f"{path} does not exist in Keras {keras_version}")
            continue
        attr = original(owner, name) if hasattr(owner, name) else None
        if attr is None:
            versions = ", ".join(sorted(set(signatures.values())))
            out.append(
                f"{path}.{name} does not exist in Keras {keras_version} (Keras {versions} have it)"
            )
            continue
        try:
            found = str(inspect.signature(attr))
        except (TypeError, ValueError):
            found = "(a signature Python cannot read)"
        if found not in signatures:
            expected = "; ".join(f"{sig} in Keras {where}" for sig, where in signatures.items())
            out.append(
                f"{path}.{name} is {found} in Keras {keras_version}; tfstrat's replacement is "
                f"written for {expected}"
            )
    return out
