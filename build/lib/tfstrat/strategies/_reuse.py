"""A multi-worker strategy created again in the same process reuses the cluster's state.

keras.io's distributed-training guide calls `run_training()`, which creates the strategy, more
than once per process. Stock `MultiWorkerMirroredStrategy` (TF 2.21) then calls
`TFE_EnableCollectiveOps` again, which replaces the process's collective executor: a peer that
created its second strategy earlier may already have sent its part of the next collective into
the executor being dropped, and both fail with `InternalError: ... Delete called on non-empty
BufRendezvous`. TensorFlow's server, its coordination service and the collective executor only
depend on TF_CONFIG's cluster and task, so a second strategy of the same TF_CONFIG keeps them:
it skips the re-enabling (no reset, so no exchange is lost however late a peer arrives), takes
group keys of its own (so its collectives never meet an earlier strategy's instance keys) and
keeps tfstrat's TCP ring. A strategy of another TF_CONFIG cannot share the process: TensorFlow
has one server per process, so it is refused with both configurations named.

Every task must create its strategies in the same order (it runs the same program), which is
what gives each strategy the same group keys on every worker.
"""

from __future__ import annotations

import dataclasses
import logging

from tfstrat.cluster import TFConfig
from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)

# Group keys of the n-th strategy of a process start at 1 + n * KEY_STRIDE (TF's
# CollectiveKeys hands out one key per distinct device group: a handful per strategy).
KEY_STRIDE = 100_000


@dataclasses.dataclass
class _Cluster:
    tf_config: TFConfig
    strategies: int = 0
    ring: object | None = None  # tfstrat.reduce.ring.Ring of the first strategy that made one


_cluster: _Cluster | None = None


def _describe(tf_config: TFConfig) -> str:
    return f"TF_CONFIG={tf_config.to_json()}"


def enter(strategy, tf_config: TFConfig | None) -> bool:
    """Prepares `strategy` (before its extended is built); True when it reuses a running cluster.

    Sets `strategy._collective_key_base` (read by TF's extended as it starts) and
    `strategy._tfstrat_reused` (read by tfstrat's extended: skip TF's server start-up).

    Raises:
        ValueError: this process already runs another TF_CONFIG's cluster.
    """
    global _cluster
    if tf_config is None or not tf_config.cluster:
        return False
    if _cluster is None:
        _cluster = _Cluster(tf_config)
    elif _cluster.tf_config != tf_config:
        raise UsageError(
            f"Received: {_describe(tf_config)} for a new {type(strategy).__name__}, but this "
            f"process already runs TensorFlow's server for {_describe(_cluster.tf_config)} "
            "(from an earlier strategy). TensorFlow has one server per process: create every "
            "strategy of a process with the same TF_CONFIG, or start a new process."
        )
    reused = _cluster.strategies > 0
    strategy._collective_key_base = _cluster.strategies * KEY_STRIDE
    strategy._tfstrat_reused = reused
    _cluster.strategies += 1
    if reused:
        logger.info(
            "tfstrat: strategy %d of this process reuses TensorFlow's server and collectives "
            "for the same TF_CONFIG (group keys from %d)",
            _cluster.strategies,
            strategy._collective_key_base + 1,
        )
    return reused


def ring(connect, timeout: float):
    """The process's TCP ring: the earlier strategy's (with `timeout`), else `connect()`'s."""
    assert _cluster is not None, "enter() first"
    existing = _cluster.ring
    if existing is not None and getattr(existing, "_error", None) is None:
        existing.set_timeout(timeout)
        return existing
    _cluster.ring = connect()
    return _cluster.ring


_ps_strategies = [0]


def ps_prefix() -> str:
    """A prefix for the ps-shared names of this process's next ParameterServer strategy.

    Variables on a ps are shared by name, and a strategy names them by a counter that starts
    at each strategy: a second `ParameterServer` of the same process (keras.io's
    `run_training()` twice) would take the first's variables, trained values included, and
    their sync state. The first strategy keeps the plain names (a restarted chief finds its
    variables on the ps); every later one gets its own ("g1/", "g2/"...), the same on every
    worker because every worker creates its strategies in the same order.
    """
    n = _ps_strategies[0]
    _ps_strategies[0] += 1
    return f"g{n}/" if n else ""
