"""Across "machines": one task per Linux network namespace, the namespaces joined by a bridge
(tests/helpers/netns.py), each task started as a user would start it on its own host
(`ip netns exec NS env TF_CONFIG=... python script.py`, `python -m tfstrat server` for a ps).

Every case compares the workers' final weights with each other and with single-device
training on the same global batches. Needs root (skipped otherwise); the ClusterIP case also
needs iptables. Run: `scripts/test -m multihost`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import netns
import numpy as np
import pytest
from common import relative_errors
from paths import WORKERS

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [pytest.mark.multihost, pytest.mark.cluster]

TOLERANCE = 1e-5  # against one device
AGREEMENT = 1e-6  # between workers
PORT = 2222  # every host's TF port (P); tfstrat's listener is on P + 1
TASK_TIMEOUT = 150  # a cluster run: start-up (imports) of 3 processes on 2 cores, 6 steps
HOSTS = 3
# The namespaces share this machine's memory, which two machines do not: the ring shares
# memory only between workers whose addresses name one host (tfstrat.reduce.ring), so across
# the namespaces it exchanges over TCP alone, as between machines.


@pytest.fixture(scope="module")
def net():
    """Three hosts for the whole module (building them takes ~1 s, but fewer is tidier)."""
    yield from netns.module_network(HOSTS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device, no tfstrat, in this (the root) namespace: every model's final weights, and
    the initial weights the ps/Hybrid workers load."""
    out = tmp_path_factory.mktemp("multihost_reference")
    proc = subprocess.run(
        [sys.executable, "multihost_train.py", str(out), "--reference"],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=TASK_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _env(cluster: dict, task_type: str, index: int) -> dict[str, str]:
    config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    return {
        "TF_CONFIG": json.dumps(config),
        # 3 processes on this machine's cores, as `tfstrat launch --threads-per-task 1` does.
        "TF_NUM_INTRAOP_THREADS": "1",
        "TF_NUM_INTEROP_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    }


def _train(net, out, model: str, workers, ps=(), *args, per_host=1) -> tuple[list[dict], str]:
    """Worker i on host i (`per_host` K: host i // K, ports 2 apart, `workers` naming each
    worker's host), ps j on the host after the workers; returns each worker's npz and every
    task's output."""
    cluster = {"worker": [f"{h}:{PORT + 2 * (i % per_host)}" for i, h in enumerate(workers)]}
    if ps:
        cluster["ps"] = [f"{h}:{PORT}" for h in ps]
    servers = [
        net.start(
            len(workers) // per_host + j,
            [sys.executable, "-m", "tfstrat", "server"],
            env=_env(cluster, "ps", j),
            name=f"ps:{j}",
            cwd=WORKERS,
        )
        for j in range(len(ps))
    ]
    tasks = [
        net.start(
            i // per_host,
            [sys.executable, "multihost_train.py", str(out), "--model", model, *args],
            env=_env(cluster, "worker", i),
            name=f"worker:{i}",
            cwd=WORKERS,
        )
        for i in range(len(workers))
    ]
    net.wait(tasks, TASK_TIMEOUT, background=servers)
    return [dict(np.load(out / f"worker_{i}.npz")) for i in range(len(workers))], net.report(
        [*servers, *tasks], limit=3000
    )


def _check(results, reference, model: str, log: str) -> None:
    ref = np.load(reference / "reference.npz")
    expected = [ref[f"{model}/w{i}"] for i in range(len(ref.files)) if f"{model}/w{i}" in ref]
    for i, r in enumerate(results):
        weights = [r[f"w{k}"] for k in range(len(expected))]
        errs = relative_errors(weights, expected)
        assert max(errs) <= TOLERANCE, (f"worker:{i} against one device", errs, log)
        assert int(r["iterations"]) == 6, (i, r["iterations"], log)
    for i, r in enumerate(results[1:], 1):
        errs = relative_errors(
            [r[f"w{k}"] for k in range(len(expected))],
            [results[0][f"w{k}"] for k in range(len(expected))],
        )
        assert max(errs) <= AGREEMENT, (f"worker:{i} against worker:0", errs, log)


def _copy_init(reference, out) -> None:
    for name in os.listdir(reference):
        if name.endswith(".init.weights.h5"):
            shutil.copy(reference / name, out / name)


def _collective(net, reference, tmp_path, hosts: list[str], *args) -> str:
    results, log = _train(net, tmp_path, "collective", hosts, (), *args)
    _check(results, reference, "collective", log)
    return log


def _probe(net, host: int, *args: str) -> str:
    return net.run(host, [sys.executable, os.path.join(WORKERS, "multihost_probe.py"), *args])


@pytest.mark.timeout(60)
def test_the_network_is_what_the_cases_claim(net):
    """No TensorFlow: names, both address families, and ClusterIP semantics (declared ports
    forwarded, others not, the service address bindable nowhere)."""
    listener = net.start(1, [sys.executable, "multihost_probe.py", "listen", "2222", "2224"],
                         name="listener", cwd=WORKERS)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "listening" not in listener.output():
            assert listener.proc.poll() is None, net.report([listener])
            assert time.monotonic() < deadline, (
                "no 'listening' within 30 s",
                net.report([listener]),
            )
            time.sleep(0.1)
        assert _probe(net, 0, "connect", net.names[1], "2222").split() == ["ok", net.ipv4(0)]
        assert _probe(net, 0, "connect", net.ipv6(1), "2222").split() == ["ok", net.ipv6(0)]
        assert _probe(net, 2, "connect", net.names[1], "2224").startswith("ok")
        # ClusterIP: svc1 forwards 2222 only; nobody has its address.
        try:
            net.declare_services({1: [2222]})
        except netns.Unavailable as e:
            netns.skip_or_fail(f"names, IPv4 and IPv6 checked; the ClusterIP part cannot run: {e}")
        try:
            assert _probe(net, 0, "connect", net.services[1], "2222").startswith("ok")
            assert _probe(net, 1, "connect", net.services[1], "2222").startswith("ok")
            assert not _probe(net, 0, "connect", net.services[1], "2224").startswith("ok")
            for host in range(HOSTS):
                assert _probe(net, host, "bind", net.services[1]).split() == [
                    "error",
                    "EADDRNOTAVAIL",
                ]
        finally:
            net.clear_services()
        # A host whose own name is 127.0.1.1 on itself, its address elsewhere.
        net.write_hosts(own_name_loopback=[1])
        try:
            assert _probe(net, 1, "bind", net.names[1]).strip() == "ok"
            assert net.run(1, ["getent", "hosts", net.names[1]]).split()[0] == "127.0.1.1"
            assert net.run(0, ["getent", "hosts", net.names[1]]).split()[0] == net.ipv4(1)
        finally:
            net.write_hosts()
    finally:
        net.stop(listener)
    # The root namespace has none of it.
    assert not any(name.startswith(net.prefix) for name in os.listdir("/sys/class/net"))


@pytest.mark.timeout(240)
def test_collective_by_ip(net, reference, tmp_path):
    log = _collective(net, reference, tmp_path, [net.ipv4(i) for i in range(HOSTS)])
    assert "tcp ring (dense)" in log, log


@pytest.mark.timeout(240)
def test_collective_own_name_is_127_0_1_1(net, reference, tmp_path):
    """Debian's and many SLURM nodes' /etc/hosts: a host's own name is 127.0.1.1 there, its
    real address everywhere else. tfstrat's listener must bind and advertise the address the
    peers reach, not what the TF_CONFIG name resolves to on its own host."""
    net.write_hosts(own_name_loopback=range(HOSTS))
    try:
        assert net.run(0, ["getent", "hosts", net.names[0]]).split()[0] == "127.0.1.1"
        assert net.run(1, ["getent", "hosts", net.names[0]]).split()[0] == net.ipv4(0)
        _collective(net, reference, tmp_path, net.names)
    finally:
        net.write_hosts()


@pytest.mark.timeout(240)
def test_two_workers_a_host_whose_own_name_is_127_0_1_1(net, reference, tmp_path):
    """Two workers on each of two hosts named as SLURM names them, each host's own name
    127.0.1.1 there: a worker whose ring neighbour is on its own host must still listen on
    the address the other host reaches (the next host's worker, and the two levels' first
    workers, connect to it). Equal to one device; the dense sum in two levels."""
    net.write_hosts(own_name_loopback=range(HOSTS))
    try:
        hosts = [net.names[0], net.names[0], net.names[1], net.names[1]]
        results, log = _train(net, tmp_path, "collective", hosts, per_host=2)
        _check(results, reference, "collective", log)
        assert "within this host first (shared memory), then one worker a host" in log, log
    finally:
        net.write_hosts()


@pytest.mark.timeout(240)
def test_collective_by_clusterip_service_names(net, reference, tmp_path):
    """Kubernetes ClusterIP Services (kube-proxy's iptables mode): each task's name is an
    address on no interface, and only the Service's declared ports (P and P + 1) are forwarded
    to the pod."""
    try:
        net.declare_services({i: [PORT, PORT + 1] for i in range(HOSTS)})
    except netns.Unavailable as e:
        netns.skip_or_fail(str(e))
    try:
        _collective(net, reference, tmp_path, net.services)
    finally:
        net.clear_services()


@pytest.mark.timeout(240)
def test_collective_over_ipv6(net, reference, tmp_path):
    _collective(net, reference, tmp_path, [f"[{net.ipv6(i)}]" for i in range(HOSTS)])


@pytest.mark.timeout(240)
def test_parameter_server_with_the_ps_on_a_third_host(net, reference, tmp_path):
    _copy_init(reference, tmp_path)
    results, log = _train(net, tmp_path, "ps", net.names[:2], net.names[2:3])
    _check(results, reference, "ps", log)


@pytest.mark.timeout(240)
def test_multi_node_launcher_once_per_host(net, reference, tmp_path):
    """examples/clusters/two_machines.sh's layout: `tfstrat launch --nodes node0,node1
    --node-rank R --workers-per-node 2 --ps-per-node 1,0` started once on each host. Node 0
    holds worker:0, worker:1 and ps:0 (ports 2222, 2224, 2226), node 1 worker:2 and worker:3;
    Hybrid, the table on ps:0, the dense part all-reduced in two levels (within each host,
    then across): equal to one device."""
    _copy_init(reference, tmp_path)
    nodes = ",".join(net.names[:2])
    launchers = [
        net.start(
            rank,
            [
                sys.executable,
                "-m",
                "tfstrat",
                "launch",
                "--nodes",
                nodes,
                "--node-rank",
                str(rank),
                "--workers-per-node",
                "2",
                "--ps-per-node",
                "1,0",
                "--port",
                str(PORT),
                "--threads-per-task",
                "1",
                "--timeout",
                str(TASK_TIMEOUT),
                "--show",
                "all",
                "--",
                sys.executable,
                "multihost_train.py",
                str(tmp_path),
                "--model",
                "hybrid",
            ],
            # A host's two workers share memory (the hosts' addresses differ: never between)
            env={"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"},
            name=f"launcher node {rank}",
            cwd=WORKERS,
        )  # fmt: skip
        for rank in range(2)
    ]
    net.wait(launchers, TASK_TIMEOUT + 30)
    log = net.report(launchers, limit=20000)
    results = [dict(np.load(tmp_path / f"worker_{i}.npz")) for i in range(4)]
    _check(results, reference, "hybrid", log)
    # The same cluster on both nodes, and the table on node 0's ps at its port + 1.
    cluster = '{"worker":["node0:2222","node0:2224","node1:2222","node1:2224"],"ps":["node0:2226"]}'
    for rank, names in ((0, "worker:0, worker:1, ps:0"), (1, "worker:2, worker:3")):
        line = f"node {rank} (node{rank}) of 2 nodes starts {names}; cluster {cluster}"
        assert line in launchers[rank].output(limit=10**6), log
    assert f"ps:0 tables at {net.ipv4(0)}:{PORT + 5}" in log, log
    # The dense gradients: summed within each host (shared memory), then across the hosts.
    assert "within this host first (shared memory), then one worker a host" in log, log


@pytest.mark.timeout(240)
# By DNS name Hybrid runs in the launcher case, and CollectiveAllReduce in the own-name case
# (both kept out of their own cases for CI's time budget).
@pytest.mark.parametrize("naming", ["clusterip"])
def test_hybrid_with_the_ps_on_a_third_host(net, reference, tmp_path, naming):
    """The dense part over the workers' ring, the table on the ps's table server (P + 1).
    With ClusterIP names the ps's table server must bind its pod address, not the service's."""
    _copy_init(reference, tmp_path)
    names = net.names
    if naming == "clusterip":
        try:
            net.declare_services({i: [PORT, PORT + 1] for i in range(HOSTS)})
        except netns.Unavailable as e:
            netns.skip_or_fail(str(e))
        names = net.services
    try:
        results, log = _train(net, tmp_path, "hybrid", names[:2], names[2:3])
    finally:
        net.clear_services()
    _check(results, reference, "hybrid", log)
    assert f"ps:0 tables at {net.ipv4(2)}:{PORT + 1}" in log, log


@pytest.mark.timeout(240)
def test_input_by_file_each_host_reads_its_share(net, tmp_path):
    """Two hosts, 8 TFRecord files (the same paths on both, as on a shared file system): each
    worker reads and trains on exactly its files' records (tests/test_input_files.py's run)."""
    import test_input_files as files

    data, out = tmp_path / "records", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    files.write_records(data)
    cluster = {"worker": [f"{net.ipv4(i)}:{PORT}" for i in range(files.WORKERS)]}
    tasks = [
        net.start(
            i,
            [sys.executable, "input_files_run.py", str(data), str(out)],
            env=_env(cluster, "worker", i),
            name=f"worker:{i}",
            cwd=WORKERS,
        )
        for i in range(files.WORKERS)
    ]
    net.wait(tasks, TASK_TIMEOUT)
    results = [json.loads((out / f"worker_{w}.json").read_text()) for w in range(files.WORKERS)]
    files._by_file(results, "even_auto", "even", steps=6)
    files._by_file(results, "uneven_auto", "uneven", steps=10)
