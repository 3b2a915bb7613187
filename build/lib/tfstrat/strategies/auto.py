"""`tfstrat.auto()`: the strategy that suits this process, and one line saying why."""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from tfstrat import runtime
from tfstrat.cluster import TFConfig
from tfstrat.cluster.devices import devices
from tfstrat.strategies.choice import choose, describe

logger = logging.getLogger(__name__)


def auto(
    tf_config: TFConfig | None = None, *, timeout: float | None = None
) -> tf.distribute.Strategy:
    """Picks a strategy for this process and logs what it chose and why.

    TPU -> `tf.distribute.TPUStrategy`; TF_CONFIG with ps tasks -> `Hybrid`;
    TF_CONFIG with several workers -> `CollectiveAllReduce`; two or more GPUs ->
    `MirroredNCCL`; else TensorFlow's default strategy. Call it first in the program: it may
    create a multi-worker strategy, which must exist before any TensorFlow op runs.

    Args:
        tf_config: the cluster; None reads `TF_CONFIG` if it is set.
        timeout: passed to the multi-worker strategies (their default if None).

    Returns:
        A `tf.distribute.Strategy`.

    Example:
        >>> import tfstrat
        >>> strategy = tfstrat.auto()  # doctest: +SKIP
    """
    runtime.apply()  # tfstrat's process settings, before TensorFlow creates its devices
    if tf_config is None and "TF_CONFIG" in os.environ:
        tf_config = TFConfig.from_env()  # set but empty: an error that says so
    info = devices()
    name, why = choose(tf_config, info)
    logger.info("tfstrat.auto: %s", describe(name, why))
    if name == "TPUStrategy":
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu="" if info.tpu == "local" else info.tpu
        )
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    kwargs = {} if timeout is None else {"timeout": timeout}
    if name == "Hybrid":
        from tfstrat.strategies.hybrid import Hybrid

        return Hybrid(tf_config, **kwargs)
    if name == "CollectiveAllReduce":
        from tfstrat.strategies.collective import CollectiveAllReduce

        return CollectiveAllReduce(tf_config, **kwargs)
    if name == "MirroredNCCL":
        from tfstrat.strategies.mirrored import MirroredNCCL

        return MirroredNCCL()
    return tf.distribute.get_strategy()
