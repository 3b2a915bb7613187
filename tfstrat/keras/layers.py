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
Under `tfstrat.Hybrid` with ps tasks its table lives on the ps tasks, as every Keras
Embedding's does there (`tfstrat.keras._ps_tables`). Quantized and LoRA tables fall back to the
stock path.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfstrat.errors import UsageError
from tfstrat.keras import _local, _ps_tables


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


@keras.saving.register_keras_serializable(package="tfstrat")
class Embedding(keras.layers.Embedding):
    """Drop-in `keras.layers.Embedding` whose lookup moves only the rows it needs."""

    _parts: list | None = None

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
        if _ps_tables.build(self):  # under Hybrid with ps tasks: the table lives there
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
    def partitions(self) -> int:
        return len(self._parts) if self._parts else 1

    @property
    def embeddings(self):
        if self._parts:
            return tf.concat([p.value for p in self._parts], axis=0)
        return super().embeddings

    def _tables(self):
        # This replica's own variables: a gather on a tf.distribute variable reads all of it.
        if self._parts:
            return [_local.local(p.value) for p in self._parts]
        table = getattr(self._embeddings, "value", None)  # None: on the ps (a PsTable)
        return [_local.local(table)] if isinstance(table, tf.Variable) else None

    def call(self, inputs):
        if _ps_tables.remote(self) is not None:
            return _ps_tables.lookup(self, inputs)
        tables = None if (self.quantization_mode or self.lora_enabled) else self._tables()
        if tables is None:
            return super().call(inputs)
        if inputs.dtype not in (tf.int32, tf.int64):
            inputs = tf.cast(inputs, tf.int32)
        # Each gather is colocated with its part: it runs on the part's ps task.
        outputs = tf.nn.embedding_lookup(tables if len(tables) > 1 else tables[0], inputs)
        return tf.cast(_one_row_per_id(outputs, inputs), self.compute_dtype)

    def save_own_variables(self, store):
        if not self._parts:
            return super().save_own_variables(store)
        store["0"] = np.concatenate([p.numpy() for p in self._parts], axis=0)

    def load_own_variables(self, store):
        if not self._parts:
            return super().load_own_variables(store)
        table = np.asarray(store["0"])
        if table.shape != (self.input_dim, self.output_dim):
            raise UsageError(
                f"Layer {self.name!r}: the saved table has shape {table.shape}, this layer "
                f"{(self.input_dim, self.output_dim)}."
            )
        for part, (lo, hi) in zip(self._parts, part_bounds(self.input_dim, len(self._parts))):
            part.assign(table[lo:hi])
