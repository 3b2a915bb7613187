"""The old module path of `ParameterServer` (`from tfstrat.strategies.ps import
ParameterServer` keeps working); the strategy lives in `parameter_server`."""

from tfstrat.strategies.parameter_server import ParameterServer

__all__ = ["ParameterServer"]
