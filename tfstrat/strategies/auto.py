"""`tfstrat.auto()`: the strategy that suits this process, and one line saying why."""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from tfstrat.cluster import TFConfig
from tfstrat.devices import devices

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
    if tf_config is None and "TF_CONFIG" in os.environ:
        tf_config = TFConfig.from_env()  # set but empty: an error that says so
    info = devices()
    if info.tpu:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu="" if info.tpu == "local" else info.tpu
        )
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        logger.info("tfstrat.auto: TPUStrategy (TPU %s found)", info.tpu)
        return tf.distribute.TPUStrategy(resolver)
    kwargs = {} if timeout is None else {"timeout": timeout}
    if tf_config is not None and tf_config.addresses("ps"):
        from tfstrat.strategies.hybrid import Hybrid

        logger.info(
            "tfstrat.auto: Hybrid (TF_CONFIG has %d ps task(s): dense variables all-reduced, "
            "tfstrat Embedding tables on the ps tasks)",
            len(tf_config.addresses("ps")),
        )
        return Hybrid(tf_config, **kwargs)
    if tf_config is not None and tf_config.num_workers > 1:
        from tfstrat.strategies.collective import CollectiveAllReduce

        logger.info(
            "tfstrat.auto: CollectiveAllReduce (TF_CONFIG has %d workers)", tf_config.num_workers
        )
        return CollectiveAllReduce(tf_config, **kwargs)
    if len(info.gpus) >= 2:
        from tfstrat.strategies.mirrored import MirroredNCCL

        logger.info("tfstrat.auto: MirroredNCCL (%d local GPUs)", len(info.gpus))
        return MirroredNCCL()
    logger.info(
        "tfstrat.auto: TensorFlow's default strategy (one worker, %d GPU(s), no TPU)",
        len(info.gpus),
    )
    return tf.distribute.get_strategy()
