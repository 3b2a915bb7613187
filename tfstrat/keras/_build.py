"""Models that never build themselves, and optimizers Keras never builds, under tfstrat.

keras.io's GAN (guide `custom_train_step_in_tensorflow`) is a `keras.Model` subclass without
`call()`, holding a discriminator and a generator, with two optimizers of its own applied in its
`train_step`. Under any strategy Keras 3.15's `fit` first builds the model symbolically
(`TensorFlowTrainer._maybe_symbolic_build`), which needs `call()`: "Unable to automatically build
the model". Past that, the two optimizers would create their variables inside the distributed
step, which TF 2.21 cannot do ("You must feed a value for placeholder tensor
.../cond/Placeholder_2"). Without a strategy Keras defers both to the traced step, where they
work. Stock tf.distribute fails the same way.

So, when a tfstrat strategy's `fit` (or evaluate, predict, train_on_batch) starts on such a
model, `prepare` traces its `train_step` once in a scratch graph, in the strategy's replica
context, with every unbuilt optimizer's `apply` recording the variables it is given instead of
updating them. Nothing of that graph runs: tracing builds the sub-models that are not built yet
(their variables are created in the strategy's scope, eagerly) and says which variables each
optimizer updates. Each optimizer is then built on exactly those variables (the slots a
single-device run creates), and a model without `call()` whose layers are all built is marked
built, as its first step would on one device. Models with `call()` and no optimizers of their
own are left to Keras.
"""

from __future__ import annotations

import logging

from tfstrat._compat import patches

logger = logging.getLogger(__name__)

_installed = False


def install() -> None:
    """Wraps Keras's symbolic build (once per process); acts only under tfstrat strategies."""
    global _installed
    from tfstrat._compat.keras import TensorFlowTrainer

    if _installed and patches.is_patched(TensorFlowTrainer, "_maybe_symbolic_build"):
        return  # (after `patches.remove_all()` it installs again)

    keras_build = TensorFlowTrainer._maybe_symbolic_build

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        prepare_model = getattr(strategy, "_tfstrat_prepare_model", None)
        if prepare_model is not None:  # ModelParallel: the layers' calls on their parts
            prepare_model(self)
        if strategy is not None and _is_tfstrat(strategy) and _all_built(self):
            # Nothing to build, so no batch to read. Keras would read one anyway, then drop
            # the iterator: deleting a MultiDeviceIterator whose background thread is still
            # prefetching crashes TF 2.21 now and then (SIGSEGV in
            # MultiDeviceBuffer::BackgroundThread -> DatasetBaseIterator::GetNext, seen with
            # gdb; about one evaluate in 50 on 2 workers), and the batch's cross-worker mean
            # is one more collective per fit/evaluate/predict.
            return None
        if strategy is not None and _is_tfstrat(strategy):
            if data_batch is None and iterator is not None:
                # Keras would average the replicas' first batches (`strategy.reduce("MEAN")`)
                # only to read their shapes: AddN has no kernel for bool and string inputs
                # (keras-hub's padding masks, raw text), and fails on slices of different
                # sizes. One replica's slice has the shapes.
                data_batch, iterator = _first_batch(strategy, iterator), None
            if data_batch is not None and _needs_help(self):
                prepare(self, strategy, data_batch)
        return keras_build(self, iterator=iterator, data_batch=data_batch)

    patches.patch(
        TensorFlowTrainer,
        "_maybe_symbolic_build",
        _maybe_symbolic_build,
        "builds from one replica's batch (bool/string inputs, uneven slices), not their mean",
    )
    _installed = True


def _all_built(model) -> bool:
    """What Keras's `_symbolic_build` would build is built (its conditions, Keras 3.15)."""
    compiled = [getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None)]
    return (
        all(layer.built for layer in model._flatten_layers())
        and all(c is None or c.built for c in compiled)
        and (model.optimizer is None or model.optimizer.built)
    )


def _is_tfstrat(strategy) -> bool:
    return type(strategy).__module__.startswith("tfstrat.")


def _has_no_call(model) -> bool:
    import keras

    return getattr(type(model), "call", None) in (keras.Model.call, keras.layers.Layer.call)


def own_optimizers(model) -> list:
    """Optimizers held in the model's attributes (directly, or in a list/tuple/dict), other
    than `model.optimizer`, which Keras builds itself."""
    import keras

    found = []
    for value in vars(model).values():
        items = value.values() if isinstance(value, dict) else value
        items = items if isinstance(items, (list, tuple)) else [value]
        for item in list(items):
            if isinstance(item, keras.optimizers.Optimizer) and item is not model.optimizer:
                if not any(item is f for f in found):
                    found.append(item)
    return found


def _needs_help(model) -> bool:
    unbuilt_model = _has_no_call(model) and not model.built
    return unbuilt_model or any(not o.built for o in own_optimizers(model))


def _first_batch(strategy, iterator):
    """The first batch as one replica's tensors (what Keras's symbolic build reads for its
    shapes): the replica with the most rows. When even that one has none (a worker's slice of
    a batch smaller than the workers), specs with an unknown batch size instead."""
    import tensorflow as tf

    from tfstrat._compat.keras import tree

    batch = None
    for *_, it in iterator:  # (begin, end, iterator); (step, iterator) before Keras 3.11
        batch = next(it)
        break
    if batch is None:
        return None
    local = strategy.experimental_local_results
    ranked = [
        v
        for v in tree.flatten(batch)
        if isinstance(v, tf.distribute.DistributedValues) and len(local(v)[0].shape)
    ]
    rows = [int(c.shape[0] or 0) for c in local(ranked[0])] if ranked else [1]
    replica = rows.index(max(rows))

    def pick(v):
        if isinstance(v, tf.distribute.DistributedValues):
            v = local(v)[replica]
        if max(rows) == 0 and tf.is_tensor(v) and len(v.shape):
            return tf.TensorSpec([None, *v.shape[1:]], v.dtype)
        return v

    return tree.map_structure(pick, batch)


def prepare(model, strategy, data_batch) -> None:
    """Builds `model`'s sub-models and unbuilt optimizers from a scratch trace of its
    `train_step` on batches shaped like `data_batch` (see the module docstring)."""
    import tensorflow as tf

    from tfstrat._compat.keras import tree

    optimizers = [o for o in own_optimizers(model) if not o.built]
    if model.optimizer is not None and not model.optimizer.built:
        optimizers.append(model.optimizer)  # recorded too, so the trace updates nothing
    recorded: dict[int, list] = {}
    saved = {id(o): o.__dict__.get("apply") for o in optimizers}
    for o in optimizers:
        o.apply = _recorder(recorded.setdefault(id(o), []))
    specs = tree.map_structure(
        lambda t: None if t is None else tf.TensorSpec([None, *t.shape[1:]], t.dtype), data_batch
    )

    def step(batch):
        return strategy.run(lambda b: model.train_step(b), args=(batch,))

    try:
        with strategy.scope():
            tf.function(step).get_concrete_function(specs)
    finally:
        for o in optimizers:
            if saved[id(o)] is None:
                del o.apply
            else:
                o.apply = saved[id(o)]
    with strategy.scope():
        for o in optimizers:
            if o is not model.optimizer and recorded[id(o)]:
                o.build(recorded[id(o)])
                logger.info(
                    "tfstrat: built optimizer %r on the %d variable(s) %s's train_step gives it",
                    o.name,
                    len(recorded[id(o)]),
                    model.name,
                )
    layers = model._flatten_layers(include_self=False)
    if _has_no_call(model) and not model.built and all(layer.built for layer in layers):
        model.built = True


def _recorder(seen: list):
    def apply(grads, trainable_variables=None):
        for v in trainable_variables or ():
            if not any(v is s for s in seen):
                seen.append(v)

    return apply
