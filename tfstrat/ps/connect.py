"""Connecting a worker process to the ps tasks (TensorFlow's remote eager devices), with a timeout."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

import tensorflow as tf

from tfstrat.cluster import TFConfig
from tfstrat.cluster import ports as _ports
from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)


def wait_for_ps(tf_config: TFConfig, timeout: float, port_offset: int = 0) -> None:
    """Blocks until every ps task accepts TCP connections; fails after `timeout` seconds.

    TensorFlow's own connect retries silently for a long time; this names the missing task.
    `port_offset=1` waits for the ps tasks' table servers (Hybrid) instead.
    """
    deadline = time.monotonic() + timeout
    for index, declared in enumerate(tf_config.addresses("ps")):
        address, where = declared, declared
        if port_offset:
            host, port = _ports.split(declared)
            address = _ports.join(host, port + port_offset)
            where = f"{address} (its table server: the TF_CONFIG port {port} + {port_offset})"
        host, port = _ports.split(address)
        while True:
            try:
                with socket.create_connection((host, port), timeout=2):
                    break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"Could not reach ps:{index} at {where} within {timeout:g} s ({e}). "
                        "Is the ps task running (`tfstrat launch --ps N` or `tfstrat server`), "
                        "and is its address in TF_CONFIG right?"
                    ) from None
                time.sleep(0.2)


def compute_device(task_type: str, index: int, gpus: int) -> str:
    """The device a ParameterServer worker computes on: its GPU when it sees one (as stock
    `ParameterServerStrategy` computes on the workers' GPUs), else its CPU; the variables stay
    on the ps tasks' CPUs.

    Raises:
        UsageError: with several GPUs, naming the fix (one worker per GPU).

    Example:
        >>> compute_device("worker", 1, 1)
        '/job:worker/replica:0/task:1/device:GPU:0'
        >>> compute_device("worker", 0, 0)
        '/job:worker/replica:0/task:0/device:CPU:0'
    """
    if gpus > 1:
        raise UsageError(
            f"Received: {gpus} GPUs visible to {task_type}:{index}. A ParameterServer worker "
            "computes on one device: start one worker per GPU (`tfstrat launch --workers N` "
            "gives each its own GPU), or make one visible (CUDA_VISIBLE_DEVICES=0)."
        )
    return f"/job:{task_type}/replica:0/task:{index}/device:{'GPU' if gpus else 'CPU'}:0"


def connect(tf_config: TFConfig, timeout: float) -> str:
    """Connects this process's eager context to the ps tasks; returns the device it computes
    on (`compute_device`).

    The cluster view holds every ps task and this task alone: with the full worker list,
    concurrent clients try to reach each other and hang or fail with "Socket closed".
    """
    wait_for_ps(tf_config, timeout)
    task_type, index = tf_config.task_type, tf_config.task_index
    view = {"ps": list(tf_config.addresses("ps")), task_type: {index: tf_config.task_address}}
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(view), task_type=task_type, task_id=index, rpc_layer="grpc"
    )
    gpus = len(tf.config.get_visible_devices("GPU"))  # before connecting: no runtime yet
    device = compute_device(task_type, index, gpus)
    tf.config.experimental_connect_to_cluster(
        resolver, job_name=task_type, task_index=index, make_master_device_default=False
    )
    return device


# TensorFlow's worker service, served by every task's gRPC server (also by a plain
# `tf.distribute.Server`): an empty request asks for the task's devices, a cheap answer. A
# stopped ps (SIGSTOP) accepts the connection but never answers: the call hits its deadline.
_STATUS_METHOD = "/tensorflow.WorkerService/GetStatus"
EXIT_PS_LOST = 1


class Heartbeat:
    """Asks every ps task for its status on a daemon thread; ends the process when one has not
    answered for `timeout` seconds.

    Remote eager ops on a ps have no deadline (TF 2.21): a ps that is alive but
    silent (SIGSTOP, a frozen host, a partition that drops packets) leaves the main thread
    blocked inside TensorFlow forever, where no Python exception can reach it. A TCP connect
    would not notice (the kernel accepts connections for a stopped process); an RPC with a
    deadline does. The process then exits with `EXIT_PS_LOST` after printing one line that
    names the ps task.
    """

    def __init__(self, tf_config: TFConfig, timeout: float, interval: float | None = None):
        self.addresses = list(tf_config.addresses("ps"))
        self.me = tf_config.trainer_name()
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else min(5.0, self.timeout / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tfstrat-ps-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self):
        import grpc

        channels = [grpc.insecure_channel(a) for a in self.addresses]
        calls = [c.unary_unary(_STATUS_METHOD) for c in channels]  # raw bytes in and out
        last_ok = [time.monotonic()] * len(calls)
        while not self._stop.wait(self.interval):
            # Probes run at once, so one silent ps does not delay the others' answers.
            futures = [call.future(b"", timeout=max(self.interval, 0.5)) for call in calls]
            for index, future in enumerate(futures):
                try:
                    future.result()
                    last_ok[index] = time.monotonic()
                except grpc.RpcError as e:
                    silent = time.monotonic() - last_ok[index]
                    if silent >= self.timeout and not self._stop.is_set():
                        self._fail(index, silent, e)

    def _fail(self, index: int, silent: float, error) -> None:
        import grpc

        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            what = "it accepts connections but does not answer (stopped, hung or cut off)"
        else:
            details = (error.details() or str(error.code())).splitlines()[0]
            what = f"it cannot be reached: {details}"
        print(
            f"tfstrat: {self.me} lost ps:{index} at {self.addresses[index]}: no answer for "
            f"{silent:.0f} s (timeout={self.timeout:g}); {what}. Exiting with code "
            f"{EXIT_PS_LOST} instead of waiting forever.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(EXIT_PS_LOST)
