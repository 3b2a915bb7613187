"""Tables on the ps tasks under `tfstrat.Hybrid`, whatever `keras.layers.Embedding` made them.

Parallax decides by the gradient: a variable whose gradient is sparse lives on the ps. In Keras
a table's gradient is sparse when the table is read only by its layer's lookup, so under Hybrid
with ps tasks every `keras.layers.Embedding` (and subclass: keras-hub's `ReversibleEmbedding`,
keras-rs's `EmbedReduce`, `tfstrat.keras.layers.Embedding`) builds its table on the ps tasks
(`Hybrid.remote_table` says which, and keeps a table with an `embeddings_regularizer` mirrored:
its gradient has a term for every row). The worker holds no copy:

- the layer's `_embeddings` is a `PsTable`, which reads and writes the whole table on the ps
  (`numpy()`, `assign()`: what saving and loading use, so files load into plain Keras);
- its lookup (`call`) fetches the batch's rows; the rows' gradient is pushed to the ps through a
  scalar "anchor" weight (`tfstrat.ps.remote.RemoteTable.lookup`), which Keras's weight APIs
  (`get_weights`, `set_weights`, `weights`, `count_params`) see as the table itself
  (`tfstrat.keras._ps_weights.TableWeight`);
- a read of the whole table inside a traced function (a tied output projection such as
  keras-hub's `ReversibleEmbedding(tie_weights=True)` with `reverse=True`, GPT-2's logits) means
  a dense gradient: met while Keras builds the model symbolically, the table comes back to the
  workers, mirrored, with the values the ps held, and Hybrid's start-up line says why; met only
  in a training step (a custom `train_step`), it is an error that names the layer and the fix.

The table's optimizer slots live on the ps too; the optimizer's variables for them are
`_ps_weights.SlotWeight`s, which show (and save, and load) the whole slots. A model's file holds
them twice: in the optimizer's variables, and beside the layer (`table_slots`, which
weights-only checkpoints carry). So `model.save` gives a file plain Keras's `load_model` takes,
optimizer included, and loading one writes them back to the ps.

`install()` patches `keras.layers.Embedding.build` and `.call`, and the optimizers'
`add_variable_from_reference` (`tfstrat._compat.patches`); Hybrid installs them when it has ps
tasks. A layer built under any other strategy is untouched.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from tfstrat._compat import patches
from tfstrat._compat.keras import BaseOptimizer, KerasSaveable, in_symbolic_scope
from tfstrat.errors import UsageError
from tfstrat.keras._ps_weights import TableWeight, slot_for

logger = logging.getLogger(__name__)


class PsTable:
    """A ps-held table where Keras expects the layer's embeddings variable (`_embeddings`)."""

    name = "embeddings"
    trainable = True

    def __init__(self, layer, remote, strategy):
        self.layer, self.remote, self.strategy = layer, remote, strategy

    @property
    def shape(self):
        return (self.remote.rows, self.remote.dim)

    @property
    def dtype(self):
        return "float32"

    @property
    def path(self) -> str:
        return table_path(self.layer)

    def numpy(self) -> np.ndarray:
        """The whole table, read from the ps tasks."""
        return self.remote.numpy()

    def __array__(self, dtype=None, copy=None):
        table = self.numpy()
        return table if dtype is None else table.astype(dtype)

    def assign(self, value) -> None:
        """Writes the whole table to the ps tasks (what loading a checkpoint does)."""
        value = np.asarray(value, np.float32)
        if value.shape != self.shape:
            raise UsageError(
                f"Layer {self.layer.name!r}: the table to assign has shape {value.shape}, this "
                f"layer {self.shape}."
            )
        self.remote.assign(value)

    def __tf_tensor__(self, dtype=None, name=None):
        """The whole table as a tensor: a read outside the lookup (see the module's docstring)."""
        if tf.executing_eagerly():
            return tf.constant(self.numpy(), dtype=dtype, name=name)
        if in_symbolic_scope():  # Keras building the model: the table's gradient will be dense
            mirror(
                self.layer, "the table is also read whole outside its lookup, as tied weights are"
            )
            return tf.convert_to_tensor(self.layer._embeddings, dtype=dtype, name=name)
        return tf.cast(_read_whole(self, self.layer._anchor), dtype or tf.float32, name=name)

    def __repr__(self):
        return f"<PsTable {self.path} {self.shape} on {self.remote.devices}>"


def _read_whole(held: PsTable, anchor):
    """The whole table in a traced step (a forward read: predict, evaluate); a gradient through
    it would be the table's dense gradient, which a ps-held table cannot take: an error when the
    backward pass is traced, naming the layer and the fix."""

    @tf.custom_gradient
    def whole(a):
        table = tf.numpy_function(held.numpy, [], tf.float32, stateful=True, name="read_table")

        def grad(dy):
            name = held.layer.name
            raise UsageError(
                f"Layer {name!r}: its table is on the ps tasks, but this step reads all of it "
                "and trains through that read (a tied output projection, or a custom "
                "train_step reading layer.embeddings): a dense gradient, which a ps-held table "
                f"cannot take. Keep it mirrored: Hybrid(sparse=['!{name}'])."
            )

        return tf.reshape(table, held.shape), grad

    return whole(anchor)


class TableSlots(KerasSaveable):
    """The optimizer slots of a ps-held table, as a child that Keras's saving visits.

    Keras saves a layer's own variables under `<layer>/vars` and checks their count when it
    loads them, so the slots cannot go there; it also visits every attribute of a layer that is
    a `KerasSaveable` and saves it under `<layer>/<attribute>` (`table_slots`). A layer with a
    mirrored table has no such attribute, so it never reads this group: files still load into
    plain Keras.
    """

    def __init__(self, remote, strategy):
        self._remote, self._strategy = remote, strategy

    def _obj_type(self):
        # Only names the attributes Keras's saving skips (a Loss's; this has no saveable one).
        # Every Keras from 3.10 accepts "Loss"; "Operation" came in 3.11.
        return "Loss"

    def save_own_variables(self, store):
        fills = slot_fills(getattr(self._strategy, "_optimizer", None))
        for name, value in self._remote.slots(fills).items():
            store[name] = value

    def load_own_variables(self, store):
        # A file without slots (from a stock model, or saved before the first step) keeps the
        # ps's slots, as Keras keeps an optimizer's state when a file has none for it.
        self._remote.assign_slots({name: np.asarray(store[name]) for name in store.keys()})


def table_path(layer) -> str:
    """The path the layer's table variable has, or would have, in Keras (`<layer path>/embeddings`)."""
    return f"{layer.path or layer.name}/embeddings"


def slot_fills(optimizer) -> dict[str, float]:
    """The value a slot the ps has not made yet starts from (Adagrad's accumulator's)."""
    return {"accumulator": float(getattr(optimizer, "initial_accumulator_value", 0.1))}


def holds_tables(model) -> bool:
    """Whether any layer of `model` has its table on the ps tasks."""
    flatten = getattr(model, "_flatten_layers", None)
    return bool(flatten) and any(remote(layer) is not None for layer in flatten())


def remote(layer):
    """The layer's `tfstrat.ps.remote.RemoteTable`, or None when its table is mirrored."""
    held = getattr(layer, "_embeddings", None)
    return held.remote if isinstance(held, PsTable) else None


def build(layer) -> bool:
    """Builds `layer`'s table on the ps tasks when the strategy in scope holds it there; True
    if it did (the layer is then built), False to build it as usual."""
    if getattr(layer, "_tfstrat_table_placed", False):  # a subclass's build asked already
        return False
    strategy = tf.distribute.get_strategy()
    remote_table = getattr(strategy, "remote_table", None)
    if remote_table is None or layer.quantization_mode or layer.lora_rank:
        return False
    layer._tfstrat_table_placed = True
    table = remote_table(layer)
    if table is None:
        return False
    layer._tfstrat_strategy = strategy
    table.read_step = lambda: _steps_done(strategy)
    layer._embeddings = PsTable(layer, table, strategy)
    # The worker holds no copy of the table: a scalar stands in for it in Keras's gradient,
    # and its gradient is what pushes the rows' gradient to the ps. To Keras's weight APIs it
    # is the table (`_ps_weights`), named as the table would be, so excluding the table from
    # weight decay by name excludes it too.
    import keras

    with keras.name_scope(layer.name, caller=layer):
        anchor = TableWeight(layer._embeddings, trainable=True, name="embeddings")
    layer._track_variable(anchor)  # as add_weight does (before the attribute: tracked once)
    layer._anchor = anchor
    layer._anchor._tfstrat_table = layer._embeddings  # its optimizer slots are the table's
    layer.table_slots = TableSlots(table, strategy)
    layer.built = True
    return True


def _steps_done(strategy) -> int | None:
    """The training steps this worker has run (its optimizer's iterations), read eagerly."""
    optimizer = getattr(strategy, "_optimizer", None)
    if optimizer is None or not tf.executing_eagerly():
        return None
    return int(optimizer.iterations.numpy())


def lookup(layer, inputs):
    """The rows of `inputs` from the ps tasks (the layer's `call`)."""
    strategy, table = layer._tfstrat_strategy, remote(layer)
    if layer.lora_enabled:
        raise UsageError(
            f"Layer {layer.name!r}: enable_lora() on a table Hybrid holds on the ps tasks; LoRA "
            "adds a term of every row on the worker. Keep it mirrored: "
            f"Hybrid(sparse=['!{layer.name}'])."
        )
    refuse_settings(layer, strategy._optimizer)  # at trace time
    decays = uses_weight_decay(strategy._optimizer, layer)
    # Under loss scaling (mixed_float16) the rows wait for the step's verdict (`_loss_scale`).
    held = hasattr(strategy._optimizer, "inner_optimizer")
    rows = table.lookup(
        inputs, layer._anchor, strategy.table_step, lambda: strategy.table_hyper(decays), held
    )
    return tf.cast(rows, layer.compute_dtype)


def mirror(layer, why: str) -> None:
    """Brings a ps-held table back to the workers (a variable with the values the ps held)."""
    held = layer._embeddings
    values = held.numpy()
    held.strategy.mirror_table(layer, why)  # drops it from the ps, records why
    tracker_locked = layer._tracker.locked
    layer._untrack_variable(layer._anchor)
    layer._tracker.unlock()
    del layer._anchor
    layer.table_slots = None
    layer._embeddings = None
    layer._embeddings = layer.add_weight(
        shape=(layer.input_dim, layer.output_dim),
        initializer=lambda shape, dtype=None: values,
        name="embeddings",
        regularizer=layer.embeddings_regularizer,
        constraint=layer.embeddings_constraint,
        trainable=True,
    )
    mode = getattr(layer, "sparse_updates", None)
    if mode is not None:  # tfstrat's Embedding marks its table for the row-wise updates
        from tfstrat.keras import _rowwise

        _rowwise.mark(layer._embeddings, mode)
    if tracker_locked:
        layer._tracker.lock()
    logger.info("tfstrat: table %s back on the workers, mirrored: %s", layer.name, why)


def uses_weight_decay(optimizer, layer) -> bool:
    """Whether `optimizer` decays the layer's table (Keras's rule, by the variable's name)."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    if optimizer is None or not getattr(optimizer, "weight_decay", None):
        return False
    return bool(optimizer._use_weight_decay(layer._anchor))


def refuse_settings(layer, optimizer) -> None:
    """A ps updates its table's rows on each push: optimizer settings that would change the
    step of a mirrored table (clipping over every gradient, accumulation, EMA, a dense "exact"
    step) are refused rather than ignored. Weight decay is applied (`tfstrat.ps.tables`)."""
    if optimizer is None:
        return
    name = layer.name
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    settings = {
        "clipnorm": optimizer.clipnorm,
        "global_clipnorm": optimizer.global_clipnorm,
        "clipvalue": optimizer.clipvalue,
        "gradient_accumulation_steps": optimizer.gradient_accumulation_steps,
        "use_ema": optimizer.use_ema or None,
        "loss_scale_factor": getattr(optimizer, "loss_scale_factor", None),
    }
    given = {k: v for k, v in settings.items() if v}
    if given:
        k, v = next(iter(given.items()))
        raise UsageError(
            f"Received: {type(optimizer).__name__}({k}={v!r}) with {name!r}, whose table Hybrid "
            f"keeps on the ps tasks, where {k} would not apply to it (the ps updates the rows "
            f"of each push as it comes). Drop {k}, or keep this table mirrored: "
            f"Hybrid(sparse=['!{name}'])."
        )
    from tfstrat.ps.remote import optimizer_kind

    if getattr(layer, "sparse_updates", "lazy") == "exact" and optimizer_kind(optimizer) not in (
        "sgd",
        "adagrad",
        None,
    ):
        raise UsageError(
            f"Received: sparse_updates='exact' on {name!r}, whose table Hybrid "
            f"puts on the ps tasks, with {type(optimizer).__name__}: a ps updates "
            "only the batch's rows (lazily). Use sparse_updates='lazy', or keep "
            f"this table mirrored: Hybrid(sparse=['!{name}'])."
        )


def install() -> None:
    """Patches `keras.layers.Embedding.build` and `.call`, and the optimizers'
    `add_variable_from_reference` (once per process)."""
    import keras

    cls = keras.layers.Embedding
    if patches.is_patched(cls, "build"):
        return
    keras_build = patches.original(cls, "build")
    keras_call = patches.original(cls, "call")

    def build_(self, input_shape=None):
        if self.built or build(self):
            return
        return keras_build(self, input_shape)

    def call_(self, inputs):
        if remote(self) is not None:
            return lookup(self, inputs)
        return keras_call(self, inputs)

    build_.__doc__, call_.__doc__ = keras_build.__doc__, keras_call.__doc__
    why = "under Hybrid with ps tasks, the table lives on the ps and the lookup runs there"
    patches.patch(cls, "build", build_, why)
    patches.patch(cls, "call", call_, why)
    keras_slot = patches.original(BaseOptimizer, "add_variable_from_reference")

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        slot = slot_for(self, reference_variable, name, initializer)
        if slot is None:
            return keras_slot(self, reference_variable, name=name, initializer=initializer)
        return slot

    add_variable_from_reference.__doc__ = keras_slot.__doc__
    why = "a ps-held table's slots show the table's slots on the ps (optimizer.variables)"
    patches.patch(BaseOptimizer, "add_variable_from_reference", add_variable_from_reference, why)
