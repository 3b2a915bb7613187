"""Pieces shared by the all-reduce strategies."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

_Impl = tf.distribute.experimental.CommunicationImplementation


def communication_implementation(communication: str, devices: Sequence[str]) -> _Impl:
    """Maps `communication=` to a collective implementation, checking NCCL can run.

    "auto" is NCCL when every device is a physical GPU of a CUDA build and there are two or
    more; ring otherwise (CPUs, virtual GPUs, one device).
    """
    gpus = [d for d in devices if "GPU" in d.upper()]
    physical = tf.config.list_physical_devices("GPU")
    cuda = bool(tf.sysconfig.get_build_info().get("is_cuda_build", False))
    nccl_ok = cuda and len(gpus) == len(devices) and len(physical) >= 2
    if communication == "auto":
        return _Impl.NCCL if nccl_ok else _Impl.RING
    if communication == "ring":
        return _Impl.RING
    if communication == "nccl":
        if not nccl_ok:
            raise ValueError(
                f"Received: communication='nccl' with devices {list(devices)} on a host with "
                f"{len(physical)} GPU(s){'' if cuda else ' and a TensorFlow build without CUDA'}."
                " NCCL needs two or more physical GPUs; use communication='auto' or 'ring'."
            )
        return _Impl.NCCL
    raise ValueError(f"Received: communication={communication!r}. Use 'auto', 'nccl' or 'ring'.")


# --- Clipping the aggregated gradient --------------------------------------------------------
# Keras 3 clips in `optimizer.apply` before its all-reduce (base_optimizer.py, Keras 3.15), so
# under a strategy each replica's share is clipped, not the sum. tfstrat takes the clipping
# over for optimizers created in its scope: the optimizer's own clipping becomes a no-op and
# the same clipping runs on the all-reduced gradient.


def _scale(g, s):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(s, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(s, g.dtype)


def _square_norm(g):
    # tfstrat's sparse gradients arrive deduplicated, so the rows' norm is the dense norm.
    values = g.values if isinstance(g, tf.IndexedSlices) else g
    return tf.reduce_sum(tf.square(tf.cast(values, tf.float32)))


def clip_aggregated(optimizer, grads):
    """Applies `optimizer`'s clipnorm / global_clipnorm / clipvalue to all-reduced `grads`."""
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        c = optimizer.clipnorm
        return [
            g if g is None else _scale(g, c / tf.maximum(tf.sqrt(_square_norm(g)), c))
            for g in grads
        ]
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        c = optimizer.global_clipnorm
        norm = tf.sqrt(tf.add_n([_square_norm(g) for g in grads if g is not None]))
        scale = c / tf.maximum(norm, c) + (norm - norm)  # NaN/inf norm -> NaN, as Keras does
        return [g if g is None else _scale(g, scale) for g in grads]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        v = optimizer.clipvalue

        def clip(g):
            if isinstance(g, tf.IndexedSlices):
                return tf.IndexedSlices(tf.clip_by_value(g.values, -v, v), g.indices, g.dense_shape)
            return tf.clip_by_value(g, -v, v)

        return [g if g is None else clip(g) for g in grads]
    return grads


def _reduce_with_stop_flags(reduce_sum, stop):
    """Keras's gradient all-reduce, with the workers' stop requests (`_stopping`) riding in
    the same collective."""

    def reduce(grads_and_vars):
        pairs = list(grads_and_vars)
        have = [i for i, (g, _) in enumerate(pairs) if g is not None]
        context = tf.distribute.get_replica_context()
        if not have or context is None:
            return reduce_sum(pairs)
        grads = [pairs[i][0] for i in have]
        dense = [g for g in grads if not isinstance(g, tf.IndexedSlices)]
        flags = stop.flags(dense[0].dtype if dense else tf.float32)
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, grads + [flags])
        stop.agree(reduced[-1])
        for i, r in zip(have, reduced[:-1], strict=True):
            pairs[i] = (r, pairs[i][1])
        return pairs

    return reduce


def _take_over_clipping(optimizer, stop=None):
    reduce_sum = optimizer._all_reduce_sum_gradients
    if stop is not None:
        reduce_sum = _reduce_with_stop_flags(reduce_sum, stop)

    def reduce_then_clip(grads_and_vars):
        pairs = list(reduce_sum(grads_and_vars))
        grads = clip_aggregated(optimizer, [g for g, _ in pairs])
        return [(g, v) for g, (_, v) in zip(grads, pairs, strict=True)]

    optimizer._clip_gradients = lambda grads: grads
    optimizer._all_reduce_sum_gradients = reduce_then_clip
    optimizer._tfstrat_clipping = True


class AdoptsKerasOptimizers:
    """Strategy mixin: takes over the clipping of the Keras optimizer that `fit` steps.

    Keras's train step reaches the strategy as `strategy.run(model.train_step, ...)`: a bound
    method, so the model and its optimizer are at hand before the step is traced. (An earlier
    version looked for optimizers up the Python stack at variable creation; reading frames'
    locals is avoided on purpose.)
    """

    def run(self, fn, args=(), kwargs=None, options=None):
        from keras.optimizers import Optimizer

        model = getattr(fn, "__self__", None)
        optimizer = getattr(model, "optimizer", None)
        stop = getattr(self, "_stop", None)  # multi-worker strategies stop together
        if isinstance(optimizer, Optimizer) and not getattr(optimizer, "_tfstrat_clipping", False):
            _take_over_clipping(optimizer, stop)
        if stop is not None and getattr(fn, "__name__", "") == "train_step":
            stop.attach(model)
        return super().run(fn, args=args, kwargs=kwargs, options=options)
