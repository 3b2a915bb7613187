"""Variables that live on ps tasks and are shared by every worker (a raw `VarHandleOp` with the same `shared_name` and `container` on every worker).

Each worker creates the same variables in the same order. The n-th variable gets the same
`shared_name` in every worker, so their handles name one resource on the ps task that holds
it: the chief initialises it, the others wait until it is initialised. Where a variable goes
is decided here, by bytes: each new variable goes to the least-loaded ps task, unless it is a
part of a partitioned table (`pinned`) or an optimizer slot (placed with its variable).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import tensorflow as tf

from tfstrat._compat.tf import gen_resource_variable_ops as gen_rv
from tfstrat._compat.tf import handle_data_util, resource_variable_ops

logger = logging.getLogger(__name__)

CONTAINER = "tfstrat"
_pin = threading.local()


@contextlib.contextmanager
def pinned(ps_index: int):
    """Variables created inside go to ps task `ps_index` (used for the parts of a table)."""
    saved = getattr(_pin, "index", None)
    _pin.index = ps_index
    try:
        yield
    finally:
        _pin.index = saved


def ps_device(index: int) -> str:
    return f"/job:ps/replica:0/task:{index}/device:CPU:0"


def ps_index_of(variable) -> int | None:
    """The ps task a variable lives on, or None for a variable on a worker."""
    match = re.search(r"/job:ps/replica:\d+/task:(\d+)", getattr(variable, "device", "") or "")
    return int(match.group(1)) if match else None


def shared_variable(
    shared_name: str,
    shape,
    dtype,
    device: str,
    *,
    strategy=None,
    trainable: bool = False,
    name: str | None = None,
    aggregation=tf.VariableAggregation.NONE,
) -> tf.Variable:
    """A handle to the resource `shared_name` on `device`: the same resource in every worker.

    `shape=None` makes a variable that takes values of any shape (a mailbox).
    """
    shape = tf.TensorShape(shape)
    with tf.init_scope(), tf.device(device):
        handle = gen_rv.var_handle_op(
            dtype=dtype, shape=shape, shared_name=shared_name, container=CONTAINER
        )
        # Shape and dtype on the handle, so reads inside tf.function know their shape.
        resource_variable_ops._set_handle_shapes_and_types(
            handle, handle_data_util.create_handle_data(shape, dtype), graph_mode=False
        )
    return resource_variable_ops.BaseResourceVariable(
        trainable=trainable,
        shape=shape,
        dtype=dtype,
        handle=handle,
        distribute_strategy=strategy,
        name=name or shared_name,
        unique_id=f"{CONTAINER}/{shared_name}",
        handle_name=shared_name,
        aggregation=aggregation,
        in_graph_mode=False,
        validate_shape=shape.is_fully_defined(),
    )


def is_initialized(variable: tf.Variable) -> bool:
    return bool(gen_rv.var_is_initialized_op(variable.handle))


def wait_initialized(variable: tf.Variable, timeout: float, who: str) -> None:
    """Blocks until the chief has initialised `variable`; fails after `timeout` seconds."""
    deadline, pause = time.monotonic() + timeout, 0.005
    while not is_initialized(variable):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Waited {timeout:g} s for {who} to initialise variable {variable.name!r} on "
                f"{variable.device}. Is the chief running the same model code, and alive?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def resource_shape(variable: tf.Variable) -> tf.TensorShape:
    """The shape of the resource on the ps, whatever the handle declares (TensorFlow does not check a shared variable's shape against its creator's)."""
    with tf.device(variable.device):
        return tf.TensorShape(gen_rv.variable_shape(variable.handle, out_type=tf.int64).numpy())


def _slot(key: str, index: int, strategy) -> tf.Variable:
    return shared_variable(f"{key}/{index}", [], tf.string, ps_device(0), strategy=strategy)


def publish(key: str, index: int, payload: dict, strategy=None) -> None:
    """Writes task `index`'s `payload` (JSON) under `key` on ps 0, for the others to read."""
    _slot(key, index, strategy).assign(json.dumps(payload), read_value=False)


def read_published(
    key: str,
    indices: list[int],
    timeout: float,
    name: Callable[[int], str],
    where: str,
    what: str,
    strategy=None,
) -> Iterator[tuple[int, dict]]:
    """Yields `(index, payload)` for each of `indices` as it is published under `key`.

    Raises:
        TimeoutError: after `timeout` seconds, naming the first task that never published.
    """
    slots = {i: _slot(key, i, strategy) for i in indices}
    deadline, pause = time.monotonic() + timeout, 0.005
    while slots:
        for index, slot in list(slots.items()):
            if is_initialized(slot):
                del slots[index]
                yield index, json.loads(slot.read_value().numpy())
        if not slots:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"tfstrat: waited {timeout:g} s for {name(min(slots))} to publish its {what} on "
                f"{where}. Is it running, with the same TF_CONFIG cluster and model code? (See "
                "its log; a task whose TF_CONFIG names other ps tasks publishes elsewhere.)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


class Placement:
    """Assigns variables to ps tasks, balancing bytes, and logs each decision once."""

    def __init__(self, num_ps: int):
        self.num_ps = num_ps
        self.bytes = [0] * num_ps
        self.rows: list[tuple[str, int, int]] = []  # (name, ps, bytes)

    def choose(self, name: str, nbytes: int, pinned_to: int | None = None) -> int:
        index = pinned_to if pinned_to is not None else int(np.argmin(self.bytes))
        self.bytes[index] += nbytes
        self.rows.append((name, index, nbytes))
        logger.debug("tfstrat: %s (%d bytes) -> ps:%d", name, nbytes, index)
        return index

    def summary(self) -> str:
        loads = ", ".join(f"ps:{i} {b / 2**20:.2f} MiB" for i, b in enumerate(self.bytes))
        return f"{len(self.rows)} variables on {self.num_ps} ps task(s): {loads}"


def static_shape(initial_value: Callable | tf.Tensor, shape) -> tf.TensorShape:
    """The shape of a variable's initial value without computing it (traces a callable)."""
    if shape is not None and tf.TensorShape(shape).is_fully_defined():
        return tf.TensorShape(shape)
    if callable(initial_value):
        traced = tf.function(initial_value, autograph=False).get_concrete_function()
        return tf.TensorShape(traced.structured_outputs.shape)
    return tf.TensorShape(np.shape(initial_value))
