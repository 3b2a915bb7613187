"""Where a `tfstrat launch` job listens. Plain launch: every listening socket of the job that is
not a TensorFlow TF_CONFIG port is on loopback. `--private-network`: no listening socket of the
job is in this machine's network namespace, and training still works. Read from /proc: each
task's socket inodes (/proc/PID/fd) matched against the listening sockets of its namespace
(/proc/PID/net/tcp{,6}) and of this test's (/proc/self/net/tcp{,6})."""

import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest
from paths import WORKERS

from tfstrat import LaunchConfig, launch

SCRIPT = str(WORKERS / "nodes_train.py")
PY = sys.executable


def _tasks(marker):
    """{pid: (task, TF_CONFIG)} of the processes whose environment holds TFSTRAT_TEST_RUN=marker."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(
                    item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item
                )
        except OSError:
            continue
        if environ.get(b"TFSTRAT_TEST_RUN") == marker.encode():
            found[int(pid)] = (environ[b"TFSTRAT_TASK"].decode(), json.loads(environ[b"TF_CONFIG"]))
    return found


def _sockets(net_dir, listening=True):
    """{inode: (address, port)} of the TCP sockets in /proc/.../net: listening ones, or
    the others (connections)."""
    sockets = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(net_dir, name)) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 here
            continue
        for row in rows:
            fields = row.split()
            if (fields[3] == "0A") != listening:  # 0A: TCP_LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            sockets[int(fields[9])] = (str(ipaddress.ip_address(raw)), int(hex_port, 16))
    return sockets


def _is_loopback(address):
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # gRPC's dual-stack sockets: ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def _socket_inodes(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _job_listeners(marker, listening=True):
    """[(task, pid, address, port, inode)] of every listening socket (or every connection) of
    the job's tasks, as their own network namespace shows them."""
    found = []
    for pid, (task, _) in _tasks(marker).items():
        try:
            mine = _sockets(f"/proc/{pid}/net", listening)
            inodes = _socket_inodes(pid)
        except OSError:  # a helper process of the task (e.g. its start-up watchdog) that ended
            continue
        for inode in inodes & set(mine):
            found.append((task, pid, *mine[inode], inode))
    return found


def _run_holding(tmp_path, marker, workers=2, **kw):
    """Starts a Hybrid job (`workers` workers, 1 ps) that holds after training; returns
    (thread, result)."""
    config = LaunchConfig(
        [PY, SCRIPT, str(tmp_path), "--hold"],
        workers=workers,
        ps=1,
        threads_per_task=1,
        timeout=240,
        env={"TFSTRAT_TEST_RUN": marker, "TF_CPP_MIN_LOG_LEVEL": "2"},
        **kw,
    )
    result = {}

    def run():
        import io

        out = io.StringIO()
        result["code"] = launch(config, out)
        result["out"] = out.getvalue()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 220
    while not all((tmp_path / f"worker:{i}.trained").exists() for i in range(workers)):
        if not thread.is_alive() or time.monotonic() > deadline:
            (tmp_path / "go").touch()
            thread.join(60)
            pytest.fail(f"the workers never finished training:\n{result.get('out', '')[-4000:]}")
        time.sleep(0.2)
    return thread, result


def _finish(tmp_path, thread, result):
    (tmp_path / "go").touch()
    thread.join(120)
    assert result.get("code") == 0, result.get("out", "")[-4000:]
    return result["out"]


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_listeners_other_than_tensorflows_ports_are_on_loopback(tmp_path):
    marker = uuid.uuid4().hex
    thread, result = _run_holding(tmp_path, marker)
    try:
        tasks = _tasks(marker)
        listeners = _job_listeners(marker)
        connections = _job_listeners(marker, listening=False)
    finally:
        _finish(tmp_path, thread, result)
    config = next(iter(tasks.values()))[1]
    address = {f"{job}:{i}": a for job, a_s in config["cluster"].items() for i, a in enumerate(a_s)}
    tf_ports = {int(a.rsplit(":", 1)[1]) for a in address.values()}
    others = [(t, a, p) for t, _, a, p, _ in listeners if p not in tf_ports]
    assert all(_is_loopback(a) for _, a, _ in others), others
    assert {t for t, *_ in listeners} == {"ps:0", "worker:0", "worker:1"}, listeners
    for task, tf_address in address.items():
        port = int(tf_address.rsplit(":", 1)[1])
        mine = {(a, p) for t, _, a, p, _ in listeners if t == task}
        assert port in {p for _, p in mine}, (task, mine)  # TensorFlow's, on all interfaces
        if task == "ps:0":  # the table server listens as long as the ps runs
            assert any(p == port + 1 and _is_loopback(a) for a, p in mine), (task, mine)
        else:  # the ring closes its listener once its neighbour is in: the accepted connection
            ring = {(a, p) for t, _, a, p, _ in connections if t == task and p == port + 1}
            assert ring and all(_is_loopback(a) for a, _ in ring), (task, connections)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_private_network_keeps_every_listener_out_of_the_hosts_namespace(tmp_path):
    marker = uuid.uuid4().hex
    # One worker: the ps's gRPC server and table server, the worker's, all inside; two
    # workers' ring inside a namespace adds nothing but start-up time.
    thread, result = _run_holding(tmp_path, marker, workers=1, private_network=True)
    try:
        tasks = _tasks(marker)
        listeners = _job_listeners(marker)
        host = _sockets("/proc/self/net")
        here = os.readlink("/proc/self/ns/net")
        namespaces = set()
        for pid in tasks:
            with contextlib.suppress(OSError):  # a helper process that ended meanwhile
                namespaces.add(os.readlink(f"/proc/{pid}/ns/net"))
    finally:
        out = _finish(tmp_path, thread, result)
    assert "every task runs in a new network namespace with only loopback (lo) up" in out, out
    assert len(namespaces) == 1 and here not in namespaces, namespaces  # one, not this one
    assert {t for t, *_ in listeners} == {"ps:0", "worker:0"}, listeners
    assert len(listeners) >= 3, listeners  # TensorFlow's port on both tasks, the table server
    assert not {inode for *_, inode in listeners} & set(host), (listeners, host)
    assert "[worker:0] done" in out, out[-3000:]


def _unshare_or_skip():
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux's unshare")
    probe = subprocess.run(
        [unshare, "--user", "--map-user=1000", "--map-group=1000", "true"], capture_output=True
    )
    if probe.returncode:
        pytest.skip(f"user namespaces unavailable here: {probe.stderr.decode().strip()}")
    return unshare


LIST_INTERFACES = (
    "import os, socket; print('IFACES', [n for _, n in socket.if_nameindex()], os.getuid())"
)


def test_private_network_without_root_uses_a_user_namespace():
    """As uid 1000 (in a user namespace of this test's, which maps it to this user)."""
    unshare = _unshare_or_skip()
    argv = [unshare, "--user", "--map-user=1000", "--map-group=1000", PY, "-m", "tfstrat"]
    argv += ["launch", "--private-network", "--workers", "2", "--show", "all"]
    argv += ["--", PY, "-c", LIST_INTERFACES]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runs in a new user and network namespace (unprivileged)" in proc.stdout, proc.stdout
    for task in ("worker:0", "worker:1"):
        assert f"[{task}] IFACES ['lo'] 1000" in proc.stdout, proc.stdout


def test_private_network_refused_by_the_kernel_says_what_and_the_fix():
    """Namespace limits of 0 (set inside a user namespace of this test's, not the machine's)."""
    unshare = _unshare_or_skip()
    launch_cmd = f"{PY} -m tfstrat launch --private-network -- {PY} -c pass"
    script = (
        "echo 0 > /proc/sys/user/max_net_namespaces && "
        f"echo 0 > /proc/sys/user/max_user_namespaces && exec {launch_cmd}"
    )
    proc = subprocess.run(
        [unshare, "--user", "--map-root-user", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert (
        "tfstrat launch --private-network: could not create the private network: "
        "unshare(CLONE_NEWNET) as root: No space left on device (ENOSPC); then "
        "unshare(CLONE_NEWUSER|CLONE_NEWNET) as uid 0: No space left on device (ENOSPC). Fix: "
        "a namespace limit is reached or 0: raise sysctl user.max_user_namespaces and "
        "user.max_net_namespaces"
    ) in proc.stdout, proc.stdout
    assert "Nothing was started." in proc.stdout
