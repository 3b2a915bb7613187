"""`tfstrat server`: runs this host's TensorFlow server task (usually a ps) until stopped."""

from __future__ import annotations

import logging
import os

from tfstrat import runtime
from tfstrat.cluster import ports
from tfstrat.cluster.config import TFConfig
from tfstrat.errors import ListenError, ServerError, TFConfigError

logger = logging.getLogger(__name__)


def start_server(tf_config: TFConfig, task: tuple[str, int] | None = None):
    """Starts the TensorFlow gRPC server of one task and returns it (not yet joined).

    Args:
        tf_config: the cluster; its own task is used unless `task` is given.
        task: `(type, index)` to serve instead of `tf_config`'s task.

    Returns:
        A started `tf.distribute.Server`.

    Raises:
        TFConfigError: no task given, or the task is not in the cluster.
        ServerError: the server could not bind its address.
    """
    import faulthandler

    runtime.apply()  # tfstrat's process settings (allocator, filters, versions), as a strategy does
    import tensorflow as tf

    faulthandler.enable()  # a crash of the server prints its Python stacks
    if task is not None:
        tf_config = tf_config.for_task(*task)
    if tf_config.task_type is None:
        raise TFConfigError(
            "Received: no task. `tfstrat server` needs TF_CONFIG['task'] or --task ps:INDEX."
        )
    task_type, index = tf_config.task_type, tf_config.task_index
    address = tf_config.task_address
    config = tf.compat.v1.ConfigProto()
    if task_type == "ps":
        # A ps never needs to see the workers; without the filter it waits for all of them.
        config.device_filters.append(f"/job:ps/task:{index}")
        # One thread handles the workers' requests, one after another: with several, the
        # eager service crashed now and then (SIGSEGV in GetOrCreateKernelAndDevice while two
        # workers' eager ops ran at once). Nothing a worker asks of a ps blocks.
        config.inter_op_parallelism_threads = 1
    elif os.environ.get("TF_NUM_INTEROP_THREADS") == "1":
        # A worker server runs the functions other tasks send it (stock
        # ParameterServerStrategy's closures); with one inter-op thread those hang (measured
        # under `tfstrat launch --threads-per-task 1`). Two threads, as a 2-core host's default.
        config.inter_op_parallelism_threads = 2
    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec({k: list(v) for k, v in tf_config.cluster.items()}),
            job_name=task_type,
            task_index=index,
            protocol=tf_config.rpc_layer,
            config=config,
            start=True,
        )
    except (tf.errors.UnknownError, tf.errors.InternalError, tf.errors.UnavailableError) as e:
        raise ServerError(
            f"Could not start gRPC server for {task_type}:{index} at {address}: "
            f"{str(e).splitlines()[0]}. Is the port in use, or the host not this machine?"
        ) from e
    logger.info("tfstrat server: %s:%d serving at %s", task_type, index, address)
    if task_type == "ps":
        _serve_tables(tf_config, f"ps:{index}")
    return server


_table_servers: list = []  # kept alive with the process


def _serve_tables(tf_config: TFConfig, task: str) -> None:
    """Hybrid's tables: a table server (`tfstrat.ps.tables`) on the ps task's tfstrat port
    (TF_CONFIG port + 1), bound to the ps's own address towards the workers (`tfstrat.cluster.ports`)."""
    from tfstrat.ps.tables import serve_tables

    address = tf_config.task_address
    trainers = tf_config.addresses("chief") + tf_config.addresses("worker")
    host = ports.route_source(trainers) or ports.wildcard(ports.split(address)[0])
    rpc = ports.join(host, ports.tfstrat_port(address))
    what = f"table server (TF_CONFIG port + {ports.offset()})"
    try:
        _table_servers.append(serve_tables(host, ports.tfstrat_port(address), task, what))
    except ListenError as e:
        raise ServerError(str(e)) from None
    logger.info("tfstrat server: %s tables at %s", task, rpc)


def serve(tf_config: TFConfig, task: tuple[str, int] | None = None) -> None:
    """Starts a task's server and blocks until the process is stopped."""
    start_server(tf_config, task).join()


def serve_until_workers_exit(tf_config: TFConfig, poll: float = 1.0) -> None:
    """Serves this ps task; exits the process (code 0) once every training task has come up
    and gone again. For clusters where every task runs the same script (Kubeflow's TFJob)."""
    import os
    import sys
    import time

    start_server(tf_config)
    trainers = set(tf_config.addresses("chief")) | set(tf_config.addresses("worker"))
    seen: set[str] = set()
    while True:
        time.sleep(poll)
        up = {a for a in trainers if ports.accepts(a)}
        seen |= up
        if seen == trainers and not up:
            logger.info("tfstrat server: every worker has finished; ps exits")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
