"""The tests' view of `tfstrat.bench._netns` (several hosts as network namespaces): the same
names, and what a test does when this machine cannot build them."""

from __future__ import annotations

import os

from tfstrat.bench._netns import (  # noqa: F401
    IP,
    SERVICES4,
    SUBNET4,
    SUBNET6,
    Network,
    Task,
    TaskError,
    Unavailable,
    check_available,
    counters_delta,
    iptables,
    sweep_stale,
)


def module_network(hosts: int):
    """The body of a module-scoped pytest fixture (`yield from module_network(3)`): a Network
    of `hosts`, skipped where it cannot be built (a failure in CI as root), closed after."""
    try:
        network = Network(hosts).__enter__()
    except Unavailable as e:
        skip_or_fail(str(e))
    try:
        yield network
    finally:
        network.close()


def skip_or_fail(reason: str) -> None:
    """Skips the test saying why, except in CI (`CI=true`, set by `.ci/run`) as root, where
    `scripts/test` installs what the tier needs: there a tier that cannot run is a failure,
    never a silent skip."""
    import pytest

    if os.environ.get("CI", "").lower() in ("1", "true") and os.geteuid() == 0:
        pytest.fail(f"CI runs as root and must run this tier, but: {reason}")
    pytest.skip(reason)
