"""The order of Keras's training batches: reshuffled every epoch from (seed, epoch), replayable.

Keras 3.15 shuffles array input (NumPy, tensors) in
`keras/src/trainers/data_adapters/array_data_adapter.py`, `get_tf_dataset`: a
`tf.random.shuffle` inside a `tf.data` map. Its random state lives in the iterator, and Keras
makes a new iterator every epoch: with TensorFlow's global seed set (which tfstrat does, so
that workers agree) every epoch draws the same permutation; without one, workers draw
different ones. Neither can be replayed by a relaunched run.

`seed_shuffles` changes three things in Keras's training loop, for this whole process:

- `shuffle=True` array input gets Keras's dataset (same batches, options, prefetching) in the
  order `stateless_shuffle(range(n), seed=(seed, epoch))`: a new order every epoch, the same
  on every worker, and the same in a run resumed at that epoch. `seed` is TensorFlow's global
  seed when the dataset is made (tfstrat's constant without one).
- `epoch` is the one Keras's fit loop announces to its callbacks (`CallbackList.
  on_epoch_begin`, which runs just before the epoch's iterator is made).
- A run resumed in the middle of an epoch (`skip_batches`, asked for by
  `tfstrat.keras.callbacks.BackupAndRestore`) draws that epoch's first batches from its input
  without training on them, and trains on the rest: Keras's epoch loop
  (`EpochIterator._enumerate_iterator`) runs that many fewer steps, so no step is run past
  the end of the data (a failed step can still have advanced `optimizer.iterations`). The
  same loop hands each epoch's iterator to `_release`, which destroys it off the training
  thread (TensorFlow's destructor can wait seconds for the pipeline's autotuner).
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from tfstrat._compat import patches
from tfstrat.keras import _release

logger = logging.getLogger(__name__)

SHUFFLE_SEED = 20190325  # any constant: the same on every worker is what matters


class _Clock:
    """The epoch the fit loop is in, and batches to skip at the start of one epoch."""

    def __init__(self):
        self.lock = threading.Lock()
        self.epoch = 0
        self.skip: tuple[int, int] | None = None  # (epoch, batches)
        self.skipped = False

    def read_epoch(self) -> np.ndarray:
        with self.lock:
            return np.array(self.epoch, np.int64)

    def take_skip(self) -> int:
        """Batches the epoch now starting must skip (once: validation runs after it)."""
        with self.lock:
            if self.skip is None or self.skip[0] != self.epoch:
                return 0
            count, self.skip, self.skipped = self.skip[1], None, True
            return count


clock = _Clock()
_installed = False


def skip_batches(epoch: int, count: int) -> None:
    """The next training epoch `epoch` starts after its first `count` batches."""
    with clock.lock:
        clock.skip = (epoch, count) if count else None
        clock.skipped = False


def skip_applied() -> bool:
    """Whether the last `skip_batches` was applied."""
    with clock.lock:
        return clock.skipped


def cancel_skip() -> None:
    with clock.lock:
        clock.skip = None


def seed_shuffles(set_global_seed: bool = True) -> None:
    """Makes the order of array input a function of (seed, epoch), in this whole process.

    Args:
        set_global_seed: also set TensorFlow's global seed when none is set, so that unseeded
            random ops in the user's own `tf.data` pipelines agree across workers too.
    """
    from tfstrat._compat.tf import random_seed

    if set_global_seed and random_seed.get_seed(None)[0] is None:
        import tensorflow as tf

        tf.random.set_seed(SHUFFLE_SEED)
        logger.info(
            "tfstrat: set TensorFlow's global seed to %d so every worker shuffles alike",
            SHUFFLE_SEED,
        )
    from tfstrat._compat.keras import ArrayDataAdapter

    if not (_installed and patches.is_patched(ArrayDataAdapter, "get_tf_dataset")):
        _install()
    from tfstrat.keras import (
        _build,  # every tfstrat strategy's other Keras hook (keras.io's GAN)
        _rowwise,
        _throughput,
        _xla,
    )

    _rowwise.install()  # also at `import tfstrat.keras`; again after `patches.remove_all()`
    _build.install()
    _xla.install()  # jit_compile=True compiles each replica's computation, not the exchange
    _throughput.install()  # examples/s on the progress bar and in History (TFSTRAT_THROUGHPUT=0)


def _install() -> None:
    global _installed
    from tfstrat._compat.keras import ArrayDataAdapter, CallbackList, EpochIterator

    keras_dataset = ArrayDataAdapter.get_tf_dataset
    keras_epoch_begin = CallbackList.on_epoch_begin
    keras_enumerate = EpochIterator._enumerate_iterator

    def get_tf_dataset(self):
        if self._shuffle is not True:  # False, or "batch" (within each batch)
            return keras_dataset(self)
        return _seeded_dataset(self)

    def on_epoch_begin(self, epoch, logs=None):
        with clock.lock:
            clock.epoch = int(epoch)
        return keras_epoch_begin(self, epoch, logs)

    def enumerate_iterator(self):
        for item in _enumerate_skipping(self):
            _release.when_dropped(item[-1])  # (once per iterator)
            yield item
        # Keras may have made the next epoch's iterator as this one ended.
        _release.when_dropped(getattr(self, "_current_iterator", None))

    def _enumerate_skipping(self):
        skip = clock.take_skip()
        if not skip:
            yield from keras_enumerate(self)
            return
        counts = self.steps_per_epoch, self._num_batches
        self.steps_per_epoch = counts[0] and counts[0] - skip  # None (unknown) stays None
        self._num_batches = counts[1] and counts[1] - skip
        try:
            # (begin, end, iterator); (step, iterator) before Keras 3.11
            for i, item in enumerate(keras_enumerate(self)):
                if i == 0:
                    for _ in range(skip):  # trained before the interruption
                        next(item[-1])
                yield item
        finally:
            self.steps_per_epoch, self._num_batches = counts

    patches.patch(
        ArrayDataAdapter,
        "get_tf_dataset",
        get_tf_dataset,
        "shuffle=True draws each epoch's order from (seed, epoch): the same on every worker",
    )
    patches.patch(
        CallbackList, "on_epoch_begin", on_epoch_begin, "the epoch the shuffle order is drawn for"
    )
    patches.patch(
        EpochIterator,
        "_enumerate_iterator",
        enumerate_iterator,
        "BackupAndRestore resumes in the middle of an epoch: skips the batches already trained;"
        " each epoch's iterator is destroyed off the training thread (_release)",
    )
    _installed = True
    logger.info("tfstrat: shuffle=True draws each epoch's order from (seed, epoch)")


def _seed() -> int:
    from tfstrat._compat.tf import random_seed

    seed = random_seed.get_seed(None)[0]
    return SHUFFLE_SEED if seed is None else int(seed)


def _seeded_dataset(adapter):
    """Keras's shuffled array dataset, in the order (seed, epoch) draws."""
    import tensorflow as tf

    from tfstrat._compat.keras import array_slicing, tree

    n, size, seed = adapter._num_samples, adapter._batch_size, _seed()

    def batches_of_epoch(_):
        epoch = tf.numpy_function(clock.read_epoch, [], tf.int64, stateful=True)
        seeds = tf.stack([tf.constant(seed, tf.int64), tf.reshape(epoch, [])])
        order = tf.random.experimental.stateless_shuffle(tf.range(n, dtype=tf.int64), seeds)
        return tf.data.Dataset.from_tensor_slices(order).batch(size)

    indices = tf.data.Dataset.range(1).flat_map(batches_of_epoch)
    inputs = tree.lists_to_tuples(
        array_slicing.convert_to_sliceable(adapter._inputs, target_backend="tensorflow")
    )

    def grab_batch(i, data):
        def grab_one(x):
            if isinstance(x, array_slicing.TensorflowSparseWrapper):
                return array_slicing.slice_tensorflow_sparse_wrapper(x, i)
            if isinstance(x, (list, tuple, dict)):
                return None
            if tf.is_tensor(x):
                return tf.gather(x, i, axis=0)
            return x

        return tree.traverse(grab_one, data)

    # The inputs ride along as a repeated element (as in Keras) instead of being captured by
    # the map function: captured arrays would become constants of its graph (2 GB limit).
    dataset = tf.data.Dataset.zip((indices, tf.data.Dataset.from_tensors(inputs).repeat()))
    dataset = dataset.map(grab_batch, num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)
