"""Pieces shared by the all-reduce strategies."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tensorflow as tf

from tfstrat import runtime
from tfstrat.errors import UsageError
from tfstrat.reduce import sparse
from tfstrat.strategies import _compute, _exact_step, _watchdog

Impl = tf.distribute.experimental.CommunicationImplementation  # by `transport.Transport`
logger = logging.getLogger(__name__)


# --- Clipping the aggregated gradient --------------------------------------------------------
# Keras 3 clips in `optimizer.apply` before its all-reduce (base_optimizer.py, Keras 3.15), so
# under a strategy each replica's share is clipped, not the sum. tfstrat takes the clipping
# over for optimizers created in its scope: the optimizer's own clipping becomes a no-op and
# the same clipping runs on the all-reduced gradient.


def _square_norm(g):
    # tfstrat's sparse gradients arrive deduplicated, so the rows' norm is the dense norm.
    values = g.values if isinstance(g, tf.IndexedSlices) else g
    return tf.reduce_sum(tf.square(tf.cast(values, tf.float32)))


def clip_aggregated(optimizer, grads, square_norms=None, dense_rows: bool = False):
    """Applies `optimizer`'s clipnorm / global_clipnorm / clipvalue to all-reduced `grads`;
    `square_norms(grads)` gives each gradient's squared norm (None: computed here; a strategy
    whose devices hold parts of a variable sums the parts' over them). `dense_rows`: row
    gradients arrive as one device's (ModelParallel: repeats apart), and are scaled as Keras
    scales them on one device, made dense (the others' are deduplicated: kept as rows)."""
    scale = sparse.scale
    if dense_rows:
        scale = lambda g, s: tf.convert_to_tensor(g) * s  # noqa: E731
    if square_norms is None:
        square_norms = lambda gs: [None if g is None else _square_norm(g) for g in gs]  # noqa: E731
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        c = optimizer.clipnorm
        return [
            g if g is None else scale(g, c / tf.maximum(tf.sqrt(n), c))
            for g, n in zip(grads, square_norms(grads))
        ]
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        c = optimizer.global_clipnorm
        norm = tf.sqrt(tf.add_n([n for n in square_norms(grads) if n is not None]))
        factor = c / tf.maximum(norm, c) + (norm - norm)  # NaN/inf norm -> NaN, as Keras does
        return [g if g is None else scale(g, factor) for g in grads]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        v = optimizer.clipvalue

        def clip(g):
            if isinstance(g, tf.IndexedSlices):
                return tf.IndexedSlices(tf.clip_by_value(g.values, -v, v), g.indices, g.dense_shape)
            return tf.clip_by_value(g, -v, v)

        return [g if g is None else clip(g) for g in grads]
    return grads


def _take_over_clipping(optimizer, stop, replicas, square_norms=None, dense_rows=False):
    reduce_sum = _exact_step.step_reduce(
        optimizer._all_reduce_sum_gradients, stop, replicas, getattr(optimizer, "iterations", None)
    )

    def reduce_then_clip(grads_and_vars):
        pairs = list(reduce_sum(grads_and_vars))
        norms = None
        if square_norms is not None:
            norms = lambda grads: square_norms(grads, [v for _, v in pairs])  # noqa: E731
        grads = clip_aggregated(optimizer, [g for g, _ in pairs], norms, dense_rows)
        return [(g, v) for g, (_, v) in zip(grads, pairs, strict=True)]

    optimizer._clip_gradients = lambda grads: grads
    optimizer._all_reduce_sum_gradients = reduce_then_clip
    optimizer._tfstrat_clipping = True


class AdoptsKerasOptimizers:
    """Strategy mixin: takes over the gradient reduction of the Keras optimizer `fit` steps.

    Keras's train step reaches the strategy as `strategy.run(model.train_step, ...)`: a bound
    method, so the model and its optimizer are at hand before the step is traced. (An earlier
    version looked for optimizers up the Python stack at variable creation; reading frames'
    locals is avoided on purpose.) The step's one all-reduce then also carries the rows
    weighting, the metric states (`_exact_step`) and, multi-worker, the stop flags; clipping
    applies to the reduced gradient.
    """

    def __new__(cls, *args, **kwargs):
        # tfstrat's process settings (`tfstrat.runtime`), before TensorFlow creates its
        # devices; in __new__ because CollectiveAllReduce's __init__ does not run the mixins'.
        runtime.apply()
        from tfstrat.keras import _loss_scale

        _loss_scale.install()  # mixed precision: every replica skips the same steps
        from tfstrat.strategies import _custom_loops

        _custom_loops.install()  # custom training loops: optimizers built eagerly
        return super().__new__(cls)

    _tfstrat_builds_eagerly = True

    def run(self, fn, args=(), kwargs=None, options=None):
        from keras.optimizers import Optimizer

        _watchdog.WATCHDOG.tick()  # a step begins: progress for the collectives' watchdog

        model = getattr(fn, "__self__", None)
        optimizer = getattr(model, "optimizer", None)
        stop = getattr(self, "_stop", None)  # multi-worker strategies stop together
        inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer's
        if isinstance(inner, Optimizer) and not getattr(inner, "_tfstrat_clipping", False):
            square_norms = getattr(self, "_tfstrat_square_norms", None)
            dense_rows = getattr(self, "_tfstrat_dense_rows", False)
            _take_over_clipping(inner, stop, self.num_replicas_in_sync, square_norms, dense_rows)
        if getattr(fn, "__name__", "") == "train_step" and hasattr(model, "metrics"):
            if stop is not None:
                stop.attach(model)
            exact_logs_for_empty_slices(model)
            if isinstance(inner, Optimizer):
                fn = _exact_step.replica_step(model, fn)
        if getattr(fn, "__name__", "") == "train_step" and model is not None:
            from tfstrat.strategies import _batchnorm  # BatchNormalization's moving statistics

            fn = _batchnorm.averaging(self, fn, model)
        predict = _compute.keras_predict_model(fn)
        if predict is not None or (
            getattr(fn, "__name__", "") == "test_step" and model is not None
        ):
            # No forward pass on 0 rows; XLA on each replica (`_compute`). Keras compiles
            # predict's per-replica step itself.
            model = predict if predict is not None else model
            apart = _compute.can_skip(model)
            skip = apart and self.num_replicas_in_sync > 1
            jit = apart and predict is None and getattr(model, "_tfstrat_jit", False)
            if skip or jit:
                fn = _compute.replica_fn(fn, model, skip, jit, predict=predict is not None)
        return super().run(fn, args=args, kwargs=kwargs, options=options)


# --- One CPU device per worker: a plain iterator ----------------------------------------------
# TF 2.21 feeds a worker's devices through a MultiDeviceIterator even when there is one. Its
# per-device GeneratorDataset makes TensorFlow set mallopt(M_MMAP_THRESHOLD, 128 KiB) for the
# whole process (GeneratorDatasetOp -> ApplyPython311MemoryPatch, seen with gdb), after which
# glibc maps and unmaps every large step buffer instead of reusing it: ~13,600 page faults and
# 40 ms of system time per step of benchmarks/overhead's CNN, half plain Keras's speed with
# TensorFlow's default allocator. Its background thread also crashes TF now and then when the
# iterator is deleted while it prefetches (keras/_build.py). A worker whose one device is the
# host CPU needs neither: the step reads its batch from a plain iterator on the host.

PLAIN_INPUT = tf.distribute.InputOptions(
    experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
    experimental_fetch_to_device=False,
)


def plain_input_options(devices: Sequence[str], options):
    """`PLAIN_INPUT` for a worker with one CPU device, when the caller gave no options (else
    None: TensorFlow's MultiDeviceIterator, which prefetches to each GPU)."""
    if options is not None or len(devices) != 1:
        return None
    return PLAIN_INPUT if tf.DeviceSpec.from_string(devices[0]).device_type == "CPU" else None


# --- Input that cannot train ------------------------------------------------------------------


_EMPTY = (
    "Received: input with no batches. fit, evaluate and predict need at least one batch: "
    "check that the arrays or files are not empty, and that a dataset's `.batch(...)` does "
    "not drop every row (drop_remainder=True with fewer rows than the batch size)."
)


def check_not_empty(dataset) -> None:
    """Refuses a dataset known to have no batches (cardinality 0) at once."""
    if tf.executing_eagerly() and int(dataset.cardinality().numpy()) == 0:
        raise UsageError(_EMPTY)


def name_empty_input(distributed):
    """`distributed` (a DistributedDataset), whose iterators raise a ValueError that says the
    input is empty where TensorFlow's raise a bare StopIteration at their first `next()`:
    Keras 3.15 reads one batch to build the model under any strategy, and an empty input
    (of unknown cardinality, as Keras's NumPy input is) ends `fit` with StopIteration."""
    if not hasattr(type(distributed), "__iter__"):
        return distributed
    dataset_cls = type(distributed)

    def __iter__(self):
        iterator = dataset_cls.__iter__(self)
        iterator.__class__ = _named_iterator_class(type(iterator))
        return iterator

    distributed.__class__ = type(dataset_cls.__name__, (dataset_cls,), {"__iter__": __iter__})
    return distributed


_iterator_classes: dict[type, type] = {}


def _named_iterator_class(cls: type) -> type:
    if cls not in _iterator_classes:

        def __next__(self):
            try:
                element = cls.__next__(self)
            except StopIteration:
                if getattr(self, "_tfstrat_seen", False):
                    raise
                raise UsageError(_EMPTY) from None
            self._tfstrat_seen = True
            return element

        _iterator_classes[cls] = type(cls.__name__, (cls,), {"__next__": __next__})
    return _iterator_classes[cls]


def exact_logs_for_empty_slices(model) -> None:
    """A replica whose slice of a (last, partial) batch is empty computes a loss of 0/0 = NaN,
    and Keras 3.15's loss tracker adds NaN x 0 rows: the epoch's loss would be NaN on every
    worker. Such a replica adds nothing instead (its gradient is zero anyway)."""
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None or getattr(tracker, "_tfstrat_exact", False):
        return
    update = tracker.update_state

    def update_state(values, sample_weight=None):
        if sample_weight is not None:
            values = tf.where(tf.equal(sample_weight, 0), tf.zeros_like(values), values)
        return update(values, sample_weight=sample_weight)

    tracker.update_state = update_state
    tracker._tfstrat_exact = True
