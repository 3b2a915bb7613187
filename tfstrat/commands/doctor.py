"""`tfstrat doctor`: what this process would run with, and whether its peers are there.

One line per check, `ok`, `note` (worth knowing, not a failure) or `FAIL`, then exit 0 when
no check failed, else 1:

- TensorFlow, Keras and Python versions (TensorFlow outside the range tfstrat supports fails);
- the devices (`tfstrat devices`, without starting TensorFlow's runtime);
- TF_CONFIG: this task and the cluster, or why it is invalid;
- what `tfstrat.auto()` would pick for it, without creating the strategy (which starts servers);
- the ports this task would listen on (`tfstrat/cluster/ports.py`): TensorFlow's P, tfstrat's P + 1;
- every other task in TF_CONFIG: its name resolves, and its TensorFlow port accepts a TCP
  connection within `timeout` seconds (it is only a connect: nothing is sent).

tfstrat's own port (P + 1) is not checked on peers: it listens only while a task trains.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Mapping
from typing import TextIO

from tfstrat.cluster import TFConfig, TFConfigError
from tfstrat.cluster import ports as _ports
from tfstrat.commands import _args
from tfstrat.strategies.choice import choose, describe


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report."""

    status: str  # "ok", "note" or "FAIL"
    text: str

    def line(self) -> str:
        return f"{self.status:<5} {self.text}"


def _versions(info) -> Check:
    """The releases against tfstrat's supported and tested ranges (`tfstrat._compat.versions`)."""
    from tfstrat._compat import versions

    text = (
        f"TensorFlow {info.tensorflow_version}, Keras {info.keras_version or 'not installed'}, "
        f"Python {sys.version.split()[0]}"
    )
    found = versions.problems(info.tensorflow_version, info.keras_version or "none")
    if found:
        return Check(
            "FAIL",
            f"{text}: {' and '.join(found)}; pip install "
            f"'tensorflow{versions.spec(versions.TENSORFLOW)}' 'keras{versions.spec(versions.KERAS)}'",
        )
    newer = versions.untested(info.tensorflow_version, info.keras_version)
    if newer:
        return Check("note", f"{text}: {' and '.join(newer)}, supported but not yet tested")
    return Check("ok", f"{text} ({_tested_pairs(info.tensorflow_version, info.keras_version)})")


def _tested_pairs(tf: str, keras: str | None) -> str:
    """Which (TensorFlow, Keras) pairs tfstrat's tests run, and whether this one is of them."""
    from tfstrat._compat import versions

    pairs = [*versions.PAIRS, versions.NEWEST]
    here = tuple(".".join(v.split(".")[:2]) for v in (tf, keras or ""))
    listed = ", ".join(f"{t}/{k}" for t, k in pairs)
    which = (
        "this pair is one"
        if here in pairs
        else "this pair is not one, though both releases are in the tested ranges"
    )
    return f"the suite runs TensorFlow/Keras {listed}; {which}"


def _devices(info) -> Check:
    gpus = f"{len(info.gpus)} GPU(s)" if info.gpus else "no GPU"
    nccl = ", NCCL usable" if info.nccl else ""
    tpu = f", TPU {info.tpu}" if info.tpu else ", no TPU"
    return Check("ok", f"devices: {info.cpu_count} CPU(s), {gpus}{nccl}{tpu}")


def _tasks(config: TFConfig) -> list[tuple[str, str]]:
    return [
        (f"{job}:{i}", address)
        for job in ("chief", "worker", "ps", "evaluator")
        for i, address in enumerate(config.addresses(job))
    ]


def _own_ports(config: TFConfig, timeout: float) -> Check:
    """The ports this task would listen on, and whether something answers there already."""
    me = f"{config.task_type}:{config.task_index}"
    host, port = _ports.split(config.task_address)
    if config.task_type == "evaluator":
        return Check("ok", f"{me} at {config.task_address} listens on no port")
    try:
        mine = _ports.tfstrat_port(config.task_address)
    except ValueError as e:
        return Check("FAIL", str(e))
    peers = [a for name, a in _tasks(config) if name != me and not name.startswith("evaluator")]
    bind = _ports.route_source(peers) or _ports.wildcard(host)
    used = [p for p in (port, mine) if _ports.refusal(_ports.join(host, p), timeout) is None]
    state = f"; in use now: {', '.join(map(str, used))} (by this task, if it runs)" if used else ""
    return Check(
        "note" if used else "ok",
        f"{me} listens on {port}/tcp (TensorFlow gRPC server, all interfaces) and "
        f"{mine}/tcp ({_ports.LISTENERS[config.task_type]}, {bind}){state}",
    )


def _peer(name: str, address: str, timeout: float) -> Check:
    host, port = _ports.split(address)
    try:
        resolved = sorted({info[4][0] for info in socket.getaddrinfo(host, port)})
    except OSError as e:
        return Check(
            "FAIL",
            f"{name} at {address}: {host!r} does not resolve ({e.strerror or e}): fix the name "
            "in TF_CONFIG, or /etc/hosts or DNS on this host",
        )
    why = _ports.refusal(_ports.join(host, port), timeout)
    where = ", ".join(resolved[:3])
    if why is not None:
        return Check(
            "FAIL",
            f"{name} at {address} ({where}) does not answer on port {port} ({why}): start its "
            f"task, or let this host reach {host} on ports {port} and "
            f"{port + _ports.offset()} (a firewall, a NetworkPolicy)",
        )
    return Check("ok", f"{name} at {address} ({where}) answers on port {port}")


def checks(env: Mapping[str, str] | None = None, timeout: float = 2.0) -> list[Check]:
    """Every check, in order (see the module's docstring).

    Args:
        env: the environment to read TF_CONFIG from (default: this process's).
        timeout: seconds each peer gets to accept a connection.
    """
    from tfstrat.cluster.devices import devices

    env = os.environ if env is None else env
    info = devices()
    out = [_versions(info), _devices(info)]
    if "TF_CONFIG" not in env:
        out.append(Check("ok", "TF_CONFIG is not set: a one-process job"))
        out.append(Check("ok", f"tfstrat.auto() would pick {describe(*choose(None, info))}"))
        return out
    try:
        config = TFConfig.from_env(env)
    except TFConfigError as e:
        return out + [Check("FAIL", f"TF_CONFIG: {e}")]
    counts = ", ".join(
        f"{len(a)} {job}{'s' if len(a) > 1 and job != 'ps' else ''}"
        for job, a in config.cluster.items()
    )
    me = f"{config.task_type}:{config.task_index}" if config.task_type else None
    out.append(Check("ok", f"TF_CONFIG: this task is {me or 'not named'}; cluster: {counts}"))
    out.append(Check("ok", f"tfstrat.auto() would pick {describe(*choose(config, info))}"))
    if config.task_address is not None:
        out.append(_own_ports(config, timeout))
    for name, address in _tasks(config):
        if name != me and not name.startswith("evaluator"):  # an evaluator runs no server
            out.append(_peer(name, address, timeout))
    return out


def run(out: TextIO | None = None, env: Mapping[str, str] | None = None, timeout=2.0) -> int:
    """Prints every check, one line each; returns 0 when none failed, else 1."""
    out = out or sys.stdout
    results = checks(env, timeout)
    for check in results:
        out.write(check.line() + "\n")
    failed = sum(c.status == "FAIL" for c in results)
    out.write(f"tfstrat doctor: {failed} check(s) failed\n" if failed else "tfstrat doctor: ok\n")
    out.flush()
    return 1 if failed else 0


def command(args) -> int:
    from tfstrat.runtime.quiet import quiet_tensorflow_import

    with quiet_tensorflow_import():  # TensorFlow's import prints C++ start-up lines
        return run(timeout=args.timeout)


def add_parser(sub) -> None:
    """The `tfstrat doctor` subcommand, added to the parser `main` builds."""
    p = sub.add_parser(
        "doctor",
        help="versions, devices, what tfstrat.auto() picks for $TF_CONFIG, this task's ports, "
        "and whether its peers resolve and answer; exit 1 if a check fails",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=_args.env("doctor-timeout", 2.0, float),
        metavar="SECONDS",
        help="how long each peer gets to accept a TCP connection (default 2)",
    )
    p.set_defaults(run=command)
