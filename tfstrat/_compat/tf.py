"""Every private TensorFlow module tfstrat uses (`tensorflow.python`), imported here only.

What each is for:
- `collective_all_reduce_strategy`, `cross_device_utils`, `cross_device_ops`, `values`,
  `input_util`, `distribute_lib`, `one_device_strategy`: the classes tfstrat's strategies
  extend (MultiWorkerMirroredStrategy's extended object, the collective launcher, the
  cross-device reduction, per-replica values, distributed input, the Strategy base).
- `mirrored_strategy`: MirroredStrategy's extended object, which ModelParallel's creates each
  device's part of a sharded variable through.
- `input_lib`: distributed iterators; its `_calculate_replicas_with_values` (the per-step
  "does any worker still have data" all-reduce) is skipped for input every worker slices
  alike (`collective._same_batches`).
- `concrete_function`: the class every eager `tf.function` call goes through (`_call_flat`),
  where the collectives' watchdog times calls (`tfstrat.strategies._watchdog`).
- `context`: the eager context (is the runtime up; the coordination service's key-value store).
- `random_seed`: the global seed Keras's array shuffling reads.
- `gen_resource_variable_ops`, `handle_data_util`, `resource_variable_ops`: variables placed
  on a ps task.
- `nccl_ops`: NCCL all-reduces among one process's GPUs (ModelParallel's model-axis sums).
- `nest`: TensorFlow's structure utilities, as the strategies it extends use them.
- `in_control_flow()`: whether ops made now go into a loop's body or a cond's branch (a graph's
  private `is_control_flow_graph`), where a MirroredStrategy `merge_call` cannot run.
"""

from tensorflow.python.distribute import (  # noqa: F401
    collective_all_reduce_strategy,
    cross_device_ops,
    cross_device_utils,
    distribute_lib,
    input_lib,
    input_util,
    mirrored_strategy,
    one_device_strategy,
    values,
)
from tensorflow.python.eager import context  # noqa: F401
from tensorflow.python.eager.polymorphic_function import concrete_function  # noqa: F401
from tensorflow.python.framework import random_seed  # noqa: F401
from tensorflow.python.ops import (  # noqa: F401
    gen_resource_variable_ops,
    handle_data_util,
    nccl_ops,
    resource_variable_ops,
)
from tensorflow.python.util import nest  # noqa: F401


def in_control_flow() -> bool:
    """Whether ops made now go into a loop's body or a cond's branch, not the function's own
    graph: there a MirroredStrategy `merge_call` cannot run (TensorFlow 2.21 raises)."""
    from tensorflow.python.framework import ops

    return bool(getattr(ops.get_default_graph(), "is_control_flow_graph", False))
