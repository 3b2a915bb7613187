"""A fit of a model built outside the strategy's scope, while a multi-worker tfstrat strategy
lives in this process: each worker would train it alone. Warned about at `fit` (the
`Throughput` hook on Keras's CallbackList is fit's one hook)."""

import logging
import weakref

import tensorflow as tf

logger = logging.getLogger(__name__)

_multi_worker = weakref.WeakSet()  # the live tfstrat strategies of 2 or more workers
_warned = weakref.WeakSet()  # models warned about (once each)


def note_multi_worker(strategy) -> None:
    """Remembers a strategy of 2+ workers, so that `warn_fit_outside_scope` can name a `fit`
    of a model built outside its scope."""
    _multi_worker.add(strategy)


def warn_fit_outside_scope(model) -> None:
    """Warns (once per model) when `model.fit` trains a model built outside every strategy's
    scope while a tfstrat strategy of 2+ workers lives in this process: each worker then trains
    it alone and the workers end with different weights. A warning, not an error: training a
    model on one worker on purpose (a reference on the chief, a per-worker probe) is fine."""
    strategy = next(iter(_multi_worker), None)
    if strategy is None or getattr(model, "_distribute_strategy", None) is not None:
        return
    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if current is not None and current not in _multi_worker:  # another strategy's scope
        return
    if model in _warned:
        return
    _warned.add(model)
    logger.warning(
        "tfstrat: model.fit of %r, a model built outside `strategy.scope()`, while %s runs %d "
        "workers: each worker trains it alone, and the workers will end with different "
        "weights. To train it across the workers, build and compile it inside `with "
        "strategy.scope():` (the strategy first, then the model).",
        model.name,
        type(strategy).__name__,
        strategy.num_workers,
    )
