"""`tfstrat.keras.layers.Embedding`: Keras's Embedding with a lookup that runs where the table is.

Keras 3's `Embedding` calls `ops.take(table, ids)`, which converts the whole table to a tensor
before gathering: with the table on a ps task, every step would copy all of it to the worker.
This subclass gathers through the variable (`tf.nn.embedding_lookup`), so the gather runs on
the ps and only the looked-up rows travel; its gradient stays `IndexedSlices`. Under a strategy
that partitions tables (`tfstrat.ParameterServer(partitions=...)`), the table is built as
parts split along the first axis, one variable per part, each on its own ps task.

Its table's gradient holds one row per distinct id (the repeats' sum; the repeats' rows are zero),
so Adam, Adagrad and RMSprop step on the table's true gradient under every strategy and on one
device: with ids that repeat in a batch a stock Embedding takes larger steps (Keras 3 squares
each repeat separately), which no multi-replica strategy can reproduce.

Same arguments, weight names and saved format as `keras.layers.Embedding`: a partitioned table
is saved as one array and loads into a stock layer, or into a different number of parts.
Under `tfstrat.Hybrid` with ps tasks the table lives on the ps tasks (`tfstrat.ps.remote`): the
layer holds only a scalar "anchor" weight whose gradient carries the rows' gradient to the ps.
The table's optimizer slots live there too (Adagrad's accumulator, Adam's moments), outside
Keras's optimizer: checkpoints keep them in a group of their own beside the layer's
(`<layer>/table_slots`), which a stock Keras model never reads, so the file still loads into
one. Quantized and LoRA tables fall back to the stock path.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfstrat._compat.keras import KerasSaveable
from tfstrat.errors import UsageError
from tfstrat.keras import _local


def _layout(layer) -> list[int | None]:
    """The ps task of each part of `layer`'s table ([None]: one part, placed as usual)."""
    strategy = tf.distribute.get_strategy()
    table_layout = getattr(strategy, "table_layout", None)
    if table_layout is None:
        return [None]
    nbytes = layer.input_dim * layer.output_dim * np.dtype(layer.variable_dtype).itemsize
    return table_layout(layer.name, layer.input_dim, nbytes)


def part_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """Row ranges of `parts` parts: the first `rows % parts` parts get one row more, as
    `tf.nn.embedding_lookup`'s "div" strategy expects."""
    edges = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(rows), parts)])
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


@tf.custom_gradient
def _one_row_per_id(rows, ids):
    """Identity on `rows` (the lookup of `ids`) whose gradient gives each id's summed gradient
    to its first occurrence and zero to its repeats.

    Why: the table's gradient is an `IndexedSlices` with one row per looked-up id. Keras 3's
    Adam (and every optimizer that squares the gradient: Adagrad, RMSprop, ...) squares those
    rows before it sums the repeats, so on one device an id seen k times in a batch gets
    `sum(g_i**2)` as its second moment instead of `(sum g_i)**2`: a step up to sqrt(k) times
    larger than Adam's. Replicas cannot reproduce that (tfstrat's sparse reduction sums the
    repeats, and so does a densified gradient), so one device and two replicas disagreed
    (examples/word_lm.py: held-out perplexity 15 against 99). With the repeats summed here,
    every strategy, one device included, applies Adam to the table's true gradient. The row
    count stays static (the all-gather of sparse gradients pads to it).
    """

    def grad(dy):
        dy = tf.convert_to_tensor(dy)
        flat = tf.reshape(ids, [-1])
        count = tf.size(flat)
        unique, position = tf.unique(flat)
        values = tf.reshape(dy, tf.stack([count, -1]))
        sums = tf.math.unsorted_segment_sum(values, position, tf.size(unique))
        first = tf.math.unsorted_segment_min(tf.range(count), position, tf.size(unique))
        merged = tf.scatter_nd(first[:, None], sums, tf.shape(values))
        return tf.ensure_shape(tf.reshape(merged, tf.shape(dy)), dy.shape), None

    return tf.identity(rows), grad


class _TableSlots(KerasSaveable):
    """The optimizer slots of a ps-held table, as a child that Keras's saving visits.

    Keras saves a layer's own variables under `<layer>/vars` and checks their count when it
    loads them, so the slots cannot go there; it also visits every attribute of a layer that is
    a `KerasSaveable` and saves it under `<layer>/<attribute>`. A stock Embedding has no such
    attribute, so it never reads this group; a tfstrat Embedding with a ps-held table does.
    """

    def __init__(self, remote, strategy):
        self._remote, self._strategy = remote, strategy

    def _obj_type(self):
        return "Operation"  # only names the attributes Keras's saving skips; we have none

    def save_own_variables(self, store):
        optimizer = getattr(self._strategy, "_optimizer", None)
        fills = {"accumulator": float(getattr(optimizer, "initial_accumulator_value", 0.1))}
        for name, value in self._remote.slots(fills).items():
            store[name] = value

    def load_own_variables(self, store):
        # A file without slots (from a stock model, or saved before the first step) keeps the
        # ps's slots, as Keras keeps an optimizer's state when a file has none for it.
        self._remote.assign_slots({name: np.asarray(store[name]) for name in store.keys()})


def _refuse_for_ps_table(layer, optimizer) -> None:
    """A ps updates its table's rows on each push, lazily: optimizer settings that would
    change the step of a mirrored table (clipping over every gradient, accumulation, EMA,
    weight decay, a dense "exact" step) are refused rather than ignored."""
    if optimizer is None:
        return
    name = layer.name
    settings = {
        "clipnorm": optimizer.clipnorm,
        "global_clipnorm": optimizer.global_clipnorm,
        "clipvalue": optimizer.clipvalue,
        "gradient_accumulation_steps": optimizer.gradient_accumulation_steps,
        "use_ema": optimizer.use_ema or None,
    }
    given = {k: v for k, v in settings.items() if v}
    if given:
        k, v = next(iter(given.items()))
        raise UsageError(
            f"Received: {type(optimizer).__name__}({k}={v!r}) with {name!r}, whose table Hybrid "
            f"keeps on the ps tasks, where {k} would not apply to it (the ps updates the rows "
            f"of each push as it comes). Drop {k}, or keep this table mirrored: "
            f"Hybrid(sparse=[...]) without {name!r}."
        )
    decay = getattr(optimizer, "weight_decay", None)
    if decay and optimizer._use_weight_decay(layer._anchor):
        raise UsageError(
            f"Received: {type(optimizer).__name__}(weight_decay={decay:g}) for "
            f"{name!r}, whose table Hybrid keeps on the ps tasks, where weight "
            "decay is not applied (it would move every row every step). Exclude the "
            "table: optimizer.exclude_from_weight_decay(var_names=['embeddings']), or "
            f"keep it mirrored: Hybrid(sparse=[...]) without {name!r}."
        )
    from tfstrat.ps.remote import optimizer_kind

    if layer.sparse_updates == "exact" and optimizer_kind(optimizer) not in (
        "sgd",
        "adagrad",
        None,
    ):
        raise UsageError(
            f"Received: sparse_updates='exact' on {name!r}, whose table Hybrid "
            f"puts on the ps tasks, with {type(optimizer).__name__}: a ps updates "
            "only the batch's rows (lazily). Use sparse_updates='lazy', or keep "
            f"this table mirrored: Hybrid(sparse=[...]) without {name!r}."
        )


@keras.saving.register_keras_serializable(package="tfstrat")
class Embedding(keras.layers.Embedding):
    """Drop-in `keras.layers.Embedding` whose lookup moves only the rows it needs."""

    _parts: list | None = None
    _remote = None  # a table on ps tasks under tfstrat.Hybrid (tfstrat.ps.remote.RemoteTable)

    def __init__(self, *args, sparse_updates: str = "lazy", **kwargs):
        """`keras.layers.Embedding`'s arguments, and `sparse_updates`: "lazy" (the default:
        Adam, SGD with momentum and RMSprop update only the batch's rows of the table and of
        their slots, as tf-keras and TF1 did; a step costs the rows, not the table) or "exact"
        (Keras 3's dense update: every row's moments decay each step). SGD and Adagrad update
        the touched rows only either way, with Keras's exact values."""
        from tfstrat.keras import _rowwise

        super().__init__(*args, **kwargs)
        self.sparse_updates = _rowwise.check(sparse_updates)

    def get_config(self):
        return {**super().get_config(), "sparse_updates": self.sparse_updates}

    def build(self, input_shape=None):
        if self.built:
            return
        self._build_table(input_shape)
        from tfstrat.keras import _rowwise

        for variable in (self._parts or []) + [getattr(self, "_embeddings", None)]:
            if variable is not None:
                _rowwise.mark(variable, self.sparse_updates)

    def _build_table(self, input_shape):
        strategy = tf.distribute.get_strategy()
        remote_table = getattr(strategy, "remote_table", None)
        if remote_table and not (self.quantization_mode or self.lora_rank):
            self._remote = remote_table(self)
            if self._remote is not None:
                # The worker holds no copy of the table: a scalar stands in for it in Keras's
                # gradient, and its gradient is what pushes the rows' gradient to the ps.
                self._strategy = strategy
                self._anchor = self.add_weight(
                    # "embeddings_anchor": what excludes the table from weight decay
                    # (var_names=["embeddings"]) excludes this weight too.
                    shape=(),
                    initializer="zeros",
                    name="embeddings_anchor",
                    trainable=True,
                )
                self.built = True
                return
        layout = _layout(self)
        if len(layout) == 1 or self.quantization_mode or self.lora_rank:
            from tfstrat.ps.variables import pinned

            if layout[0] is None:
                return super().build(input_shape)
            with pinned(layout[0]):
                return super().build(input_shape)
        from tfstrat.ps.variables import pinned

        full = {}

        def part_initializer(lo, hi):
            def initialize(shape, dtype=None):
                draw = lambda: keras.initializers.get(self.embeddings_initializer)(  # noqa: E731
                    (self.input_dim, self.output_dim), dtype=dtype
                )
                if not tf.executing_eagerly():  # traced for its shape only
                    return draw()[lo:hi]
                if "table" not in full:  # one draw for the whole table, as the stock layer
                    full["table"] = draw()
                return full["table"][lo:hi]

            return initialize

        self._parts = []
        for k, (ps, (lo, hi)) in enumerate(zip(layout, part_bounds(self.input_dim, len(layout)))):
            with pinned(ps):
                self._parts.append(
                    self.add_weight(
                        shape=(hi - lo, self.output_dim),
                        initializer=part_initializer(lo, hi),
                        name=f"embeddings_part_{k}",
                        regularizer=self.embeddings_regularizer,
                        constraint=self.embeddings_constraint,
                        trainable=True,
                    )
                )
        full.clear()
        self.built = True

    @property
    def table_slots(self) -> _TableSlots | None:
        """The optimizer slots of a ps-held table, for checkpoints (None otherwise)."""
        if self._remote is None:
            return None
        return _TableSlots(self._remote, self._strategy)

    @property
    def partitions(self) -> int:
        return len(self._parts) if self._parts else 1

    @property
    def embeddings(self):
        if self._remote is not None:  # a copy of the whole table, read from the ps tasks
            return tf.constant(self._remote.numpy())
        if self._parts:
            return tf.concat([p.value for p in self._parts], axis=0)
        return super().embeddings

    def _tables(self):
        # This replica's own variables: a gather on a tf.distribute variable reads all of it.
        if self._parts:
            return [_local.local(p.value) for p in self._parts]
        table = self._embeddings.value if self._embeddings is not None else None
        return [_local.local(table)] if isinstance(table, tf.Variable) else None

    def call(self, inputs):
        if self._remote is not None:
            s = self._strategy
            _refuse_for_ps_table(self, s._optimizer)  # at trace time
            rows = self._remote.lookup(inputs, self._anchor, s.table_step, s.table_hyper)
            return tf.cast(rows, self.compute_dtype)
        tables = None if (self.quantization_mode or self.lora_enabled) else self._tables()
        if tables is None:
            return super().call(inputs)
        if inputs.dtype not in (tf.int32, tf.int64):
            inputs = tf.cast(inputs, tf.int32)
        # Each gather is colocated with its part: it runs on the part's ps task.
        outputs = tf.nn.embedding_lookup(tables if len(tables) > 1 else tables[0], inputs)
        return tf.cast(_one_row_per_id(outputs, inputs), self.compute_dtype)

    def save_own_variables(self, store):
        if self._remote is not None:
            store["0"] = self._remote.numpy()
            return
        if not self._parts:
            return super().save_own_variables(store)
        store["0"] = np.concatenate([p.numpy() for p in self._parts], axis=0)

    def load_own_variables(self, store):
        if not self._parts and self._remote is None:
            return super().load_own_variables(store)
        table = np.asarray(store["0"])
        if table.shape != (self.input_dim, self.output_dim):
            raise UsageError(
                f"Layer {self.name!r}: the saved table has shape {table.shape}, this layer "
                f"{(self.input_dim, self.output_dim)}."
            )
        if self._remote is not None:
            self._remote.assign(table)
            return
        for part, (lo, hi) in zip(self._parts, part_bounds(self.input_dim, len(self._parts))):
            part.assign(table[lo:hi])
