"""`tfstrat.launch` as a module path: `from tfstrat.launch import LaunchConfig, launch` keeps
working. The launcher lives in `tfstrat.launcher`."""

from tfstrat.cluster.layout import NodeLayout
from tfstrat.launcher.api import LaunchConfig, launch

__all__ = ["LaunchConfig", "NodeLayout", "launch"]
