"""Sparse gradients: local deduplication, one-collective all-gather, and the density switch.

An Embedding's gradient is an `IndexedSlices` with one row per looked-up id, duplicates included.
Stock TensorFlow either sends it to one device (NCCL / hierarchical copy) or all-gathers it with
three collectives (lengths, values, indices). tfstrat sums duplicate rows first, pads to the
static row count so no length exchange is needed, and gathers values and indices in one tensor.
"""

from __future__ import annotations

import logging
import threading

import tensorflow as tf

from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)

#: `sparse_as_dense="auto"`: densify when the gathered rows could cover this share of the table.
AUTO_DENSITY = 0.5


def scale(g, s):
    """`g * s` for a dense gradient or an IndexedSlices, and 0 where `s` is 0 even if `g` is
    NaN or inf (multiply_no_nan): a replica or worker with no rows has a 0/0 loss, and its
    gradient must count as 0."""
    if isinstance(g, tf.IndexedSlices):
        values = tf.math.multiply_no_nan(g.values, tf.cast(s, g.values.dtype))
        return tf.IndexedSlices(values, g.indices, g.dense_shape)
    return tf.math.multiply_no_nan(g, tf.cast(s, g.dtype))


def dedup(slices: tf.IndexedSlices) -> tf.IndexedSlices:
    """Sums the rows of `slices` that share an index, so each index appears once.

    Returns:
        An `IndexedSlices` with unique indices (in order of first appearance).
    """
    unique, position = tf.unique(slices.indices)
    values = tf.math.unsorted_segment_sum(slices.values, position, tf.size(unique))
    return tf.IndexedSlices(values, unique, slices.dense_shape)


def densify(slices: tf.IndexedSlices) -> tf.Tensor:
    """`slices` as a dense tensor, of a static shape when its dense shape is known (TensorFlow's
    conversion leaves the rows dimension unknown, which keeps a step off the TCP ring)."""
    dense = tf.convert_to_tensor(slices)
    shape = tf.get_static_value(slices.dense_shape)
    if shape is not None:
        dense.set_shape(shape)
    return dense


def pack_rows(slices: tf.IndexedSlices, rows: int | None) -> tf.Tensor:
    """One float32 tensor `[rows, 1 + width]`: the index (bit-cast to float32) then the row.

    Rows past `slices`' own are zero with index 0, which adds nothing when summed; `rows=None`
    pads nothing. Values must be float32 (the bit-cast index would not survive a cast to
    another float type).
    """
    row_shape = slices.values.shape[1:]
    width = row_shape.num_elements() if row_shape.is_fully_defined() else None
    # A static width also reshapes an empty local batch (with 0 rows a -1 width is unknown).
    values = tf.reshape(
        slices.values, [-1, width] if width is not None else [tf.shape(slices.values)[0], -1]
    )
    index = tf.bitcast(tf.cast(slices.indices, tf.int32), tf.float32)
    packed = tf.concat([index[:, None], values], axis=1)
    if rows is None:
        packed.set_shape([None, None if width is None else 1 + width])
        return packed
    pad = rows - tf.shape(packed)[0]
    packed = tf.pad(packed, [[0, pad], [0, 0]])
    packed.set_shape([rows, None if width is None else 1 + width])
    return packed


def unpack_rows(packed: tf.Tensor, like: tf.IndexedSlices) -> tf.IndexedSlices:
    """The inverse of `pack_rows` for a gathered tensor; duplicate indices summed."""
    index = tf.bitcast(packed[:, 0], tf.int32)
    row_shape = tf.shape(like.values)[1:]
    values = tf.reshape(packed[:, 1:], tf.concat([[-1], row_shape], 0))
    return dedup(tf.IndexedSlices(values, tf.cast(index, like.indices.dtype), like.dense_shape))


def static_rows(slices: tf.IndexedSlices) -> int | None:
    """The static number of rows in `slices` (an upper bound after dedup), or None."""
    return tf.compat.dimension_value(slices.indices.shape[0])


def table_rows(slices: tf.IndexedSlices) -> int | None:
    shape = tf.get_static_value(slices.dense_shape)
    return int(shape[0]) if shape is not None else None


# The values of gradients that must stay sparse: a table marked "lazy" (`tfstrat.keras._rowwise`)
# gets Adam's / momentum's / RMSprop's row-wise step only while its gradient is `IndexedSlices`;
# densified, it would get Keras's dense step on 2 replicas and the lazy one on one device.
_lazy_values: set = set()


def keep_sparse(slices: tf.IndexedSlices):
    """Marks a gradient the density switch must not densify (see `_lazy_values`); returns
    the mark, for `forget` once the gradient is reduced."""
    mark = slices.values.ref()
    _lazy_values.add(mark)
    return mark


def forget(marks) -> None:
    """Drops `keep_sparse`'s marks (they hold their graphs' tensors)."""
    for mark in marks:
        _lazy_values.discard(mark)


class DensityPolicy:
    """Decides, once per gradient, whether a sparse gradient is cheaper to all-reduce densely.

    The decision must be the same on every replica and worker, so it uses static shapes only:
    the share of the table that `group_size` replicas could touch, `group_size * rows / vocab`.

    Args:
        sparse_as_dense: "auto" (threshold `AUTO_DENSITY`), a float threshold in (0, 1],
            True (always densify) or False (never).
    """

    def __init__(self, sparse_as_dense: str | float | bool = "auto"):
        if sparse_as_dense == "auto":
            self.threshold = AUTO_DENSITY
        elif sparse_as_dense is True or sparse_as_dense is False:
            self.threshold = 0.0 if sparse_as_dense else float("inf")
        elif isinstance(sparse_as_dense, (int, float)) and 0 < sparse_as_dense <= 1:
            self.threshold = float(sparse_as_dense)
        else:
            raise UsageError(
                f"Received: sparse_as_dense={sparse_as_dense!r}. Use 'auto', True, False, or a "
                "fraction of table rows in (0, 1] above which sparse gradients are densified."
            )
        self._logged: set = set()
        self._lock = threading.Lock()
        #: Every decision made, `(dense_shape, rows, "sparse" | "dense")`, for tests and logs.
        self.decisions: list[tuple[tuple, int | None, str]] = []

    def densify(self, slices: tf.IndexedSlices, group_size: int) -> bool:
        rows, vocab = static_rows(slices), table_rows(slices)
        if slices.values.ref() in _lazy_values:
            dense, why = (
                False,
                "a table with sparse_updates='lazy': its lazy update needs the rows; a dense "
                "gradient would change its step",
            )
        elif rows is None or vocab is None:
            dense, why = self.threshold == 0.0, "shape unknown until run time"
        else:
            density = min(1.0, group_size * rows / max(vocab, 1))
            dense = density >= self.threshold
            why = f"up to {density:.1%} of {vocab} rows touched, threshold {self.threshold:g}"
        shape = tf.get_static_value(slices.dense_shape)
        shape = tuple(int(s) for s in shape) if shape is not None else None
        with self._lock:
            self.decisions.append((shape, rows, "dense" if dense else "sparse"))
            if (shape, rows) not in self._logged:
                self._logged.add((shape, rows))
                logger.info(
                    "tfstrat: sparse gradient of shape %s reduced %s (%s)",
                    list(shape) if shape else "?",
                    "as dense" if dense else "sparsely (dedup + all-gather)",
                    why,
                )
        return dense
