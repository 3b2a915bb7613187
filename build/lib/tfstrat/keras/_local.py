"""Reads a few rows of a variable without copying the whole of it.

`tf.gather(variable, ids)` on a plain `tf.Variable` is one `ResourceGather`: only the rows
move. On a `tf.distribute` variable (what every variable created in a strategy's scope is, one
device or many) it is a `ReadVariableOp` of the whole variable followed by a `GatherV2`,
because `DistributedVariable` has no `sparse_read`: for the sparse benchmark's 200,000 x 64
table that is a 49 MiB copy for the Embedding's lookup and another for Adagrad's accumulator,
about 6 ms each per step on one core (CollectiveAllReduce with one worker ran at 0.81x of plain
Keras). `rows(variable, ids)` gathers from this replica's own component instead, which is what
the distributed variable itself would read in this replica (or this update's device), so the
values and the gradient (an `IndexedSlices` on the same handle) are the same.
"""

from __future__ import annotations

import tensorflow as tf


def local(variable):
    """This replica's (or this update device's) component of a distributed `variable`;
    `variable` itself when it is not one, or when the component cannot gather rows."""
    component = getattr(variable, "_get_on_device_or_primary", None)
    if component is None or not isinstance(variable, tf.distribute.DistributedValues):
        return variable
    part = component()
    return part if hasattr(part, "sparse_read") else variable


def rows(variable, ids):
    """`tf.gather(variable, ids)` that reads only the rows, on any variable."""
    return tf.gather(local(variable), ids)
