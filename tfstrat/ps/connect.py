"""Connecting a worker process to the ps tasks (DESIGN.md fact 4), with a timeout."""

from __future__ import annotations

import logging
import socket
import time

import tensorflow as tf

from tfstrat.cluster import TFConfig

logger = logging.getLogger(__name__)


def wait_for_ps(tf_config: TFConfig, timeout: float, port_offset: int = 0) -> None:
    """Blocks until every ps task accepts TCP connections; fails after `timeout` seconds.

    TensorFlow's own connect retries silently for a long time; this names the missing task.
    `port_offset=1` waits for the ps tasks' table servers (Hybrid) instead.
    """
    deadline = time.monotonic() + timeout
    for index, address in enumerate(tf_config.addresses("ps")):
        if port_offset:
            host, port = address.rsplit(":", 1)
            address = f"{host}:{int(port) + port_offset}"
        host, port = address.rsplit(":", 1)
        while True:
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                    break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"Could not reach ps:{index} at {address} within {timeout:g} s ({e}). "
                        "Is the ps task running (`tfstrat launch --ps N` or `tfstrat server`), "
                        "and is its address in TF_CONFIG right?"
                    ) from None
                time.sleep(0.2)


def connect(tf_config: TFConfig, timeout: float) -> str:
    """Connects this process's eager context to the ps tasks; returns its own device name.

    The cluster view holds every ps task and this task alone: with the full worker list,
    concurrent clients try to reach each other and hang or fail with "Socket closed".
    """
    wait_for_ps(tf_config, timeout)
    task_type, index = tf_config.task_type, tf_config.task_index
    view = {"ps": list(tf_config.addresses("ps")), task_type: {index: tf_config.task_address}}
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(view), task_type=task_type, task_id=index, rpc_layer="grpc"
    )
    tf.config.experimental_connect_to_cluster(
        resolver, job_name=task_type, task_index=index, make_master_device_default=False
    )
    return f"/job:{task_type}/replica:0/task:{index}/device:CPU:0"
