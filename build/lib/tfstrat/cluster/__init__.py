"""The cluster, described without TensorFlow: TF_CONFIG (`config`), host lists from SLURM and
hostfiles (`hosts`), multi-node plans (`nodes`, `layout`), ports and addresses (`ports`), and
this machine's devices (`devices`). Nothing here imports TensorFlow at import time."""

from tfstrat.cluster.config import TASK_TYPES, TFConfig
from tfstrat.cluster.layout import NodeLayout
from tfstrat.cluster.ports import free_port
from tfstrat.errors import TFConfigError

__all__ = ["TASK_TYPES", "TFConfig", "TFConfigError", "NodeLayout", "free_port"]
