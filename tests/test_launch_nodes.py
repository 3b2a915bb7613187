"""Multi-node launch (`tfstrat launch --nodes ... --node-rank R`), `tfstrat tf-config --explain`
and the cluster recipes of examples/clusters.

The real runs start one launcher per "node" side by side on this machine: node 0 at
127.0.0.1:A and node 1 at 127.0.0.2:B (Linux routes all of 127/8 to lo). The nodes need
different ports: TensorFlow's server binds its port on every interface, so two launchers with
the same --port on one machine would collide whatever their addresses.
"""

import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import procs
import pytest
from paths import WORKERS

from tfstrat import TFConfig
from tfstrat.cluster.layout import NodeLayout
from tfstrat.commands import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "examples", "clusters")
PY = sys.executable


# ---------------------------------------------------------------- the same TF_CONFIG everywhere


@pytest.mark.parametrize(
    "nodes, workers, ps, port, expected",
    [
        ("a,b", 2, 0, 2222, {"worker": ["a:2222", "a:2224", "b:2222", "b:2224"]}),
        (
            "node[01-03]",
            1,
            "1,0,0",
            5000,
            {"worker": ["node01:5000", "node02:5000", "node03:5000"], "ps": ["node01:5002"]},
        ),
        (
            "127.0.0.1:7000,127.0.0.1:7100",
            "1,2",
            "0,1",
            12345,
            {
                "worker": ["127.0.0.1:7000", "127.0.0.1:7100", "127.0.0.1:7102"],
                "ps": ["127.0.0.1:7104"],
            },
        ),
        (
            "[fd00::1]:3000,fd00::2",
            1,
            "0,1",
            2222,
            {"worker": ["[fd00::1]:3000", "[fd00::2]:2222"], "ps": ["[fd00::2]:2224"]},
        ),
        ("a,b,c", "1,1,0", "0,0,1", 2222, {"worker": ["a:2222", "b:2222"], "ps": ["c:2222"]}),
    ],
)
def test_every_rank_builds_the_same_tf_config(nodes, workers, ps, port, expected, capsys):
    layouts = [
        NodeLayout(nodes, rank, workers, ps, port)
        for rank in range(len(NodeLayout(nodes, 0, workers, ps, port).plan))
    ]
    configs = {layout.tf_config().to_json() for layout in layouts}
    assert configs == {TFConfig(expected).to_json()}
    # Each task is started by exactly one node, which holds its address.
    started = [name for layout in layouts for name, _ in layout.local_tasks()]
    everyone = [f"{job}:{i}" for job, a in expected.items() for i in range(len(a))]
    assert sorted(started) == sorted(everyone)
    for layout in layouts:
        for _, (job, i) in layout.local_tasks():
            host = expected[job][i].rsplit(":", 1)[0].strip("[]")
            assert layout.node.host == host
    # `tfstrat tf-config --nodes` prints the same cluster.
    argv = ["tf-config", "--nodes", nodes, "--workers-per-node", str(workers)]
    argv += ["--ps-per-node", str(ps), "--port", str(port)]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == expected


def _slurm(node_id, **extra):
    env = {
        "SLURM_JOB_NODELIST": "gpu[1-4]",
        "SLURM_STEP_NODELIST": "gpu[2-3]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": str(node_id),
        "SLURM_LOCALID": "0",
    }
    return {**env, **extra}


def test_slurm_gives_the_step_nodes_and_this_nodes_rank():
    layouts = [NodeLayout.from_slurm(_slurm(r), workers_per_node=2, port=4000) for r in (0, 1)]
    assert [layout.rank for layout in layouts] == [0, 1]
    expected = NodeLayout("gpu2,gpu3", 0, 2, 0, 4000).tf_config()
    assert all(layout.tf_config() == expected for layout in layouts)
    assert [n for n, _ in layouts[1].local_tasks()] == ["worker:2", "worker:3"]
    # No step variables (an allocation's batch shell): the job's nodes.
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "3", "SLURM_NODEID": "2"}
    assert NodeLayout.from_slurm(env).node.host == "n3"


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--nodes", "a,b", "--node-rank", "2"], {}, "node_rank=2 for 2 nodes (a, b). Use 0..1"),
        (["--nodes", "a,b", "--node-rank", "-1"], {}, "node_rank=-1 for 2 nodes"),
        (["--nodes", "a,b"], {}, "without --node-rank"),
        (["--nodes", "a,,b", "--node-rank", "0"], {}, "nodes='a,,b'. List the nodes"),
        (["--nodes", "n[3-1]", "--node-rank", "0"], {}, "Write ranges like [01-03,07]"),
        (["--nodes", "a:99999", "--node-rank", "0"], {}, "Port 99999 is out of range"),
        (["--nodes", "a,a", "--node-rank", "0"], {}, "nodes 0 and 1 both on a"),
        (["--nodes", "a,b", "--node-rank", "0", "--workers-per-node", "1,1,1"], {}, "for 2 nodes"),
        (
            ["--nodes", "a,b", "--node-rank", "0", "--workers-per-node", "1,0"],
            {},
            "node 1 (b) with 0 workers",
        ),
        (
            ["--nodes", "a,b", "--node-rank", "0", "--workers", "2"],
            {},
            "--workers/--ps/--chief with --nodes",
        ),
        (
            ["--nodes", "a,b", "--node-rank", "0", "--restarts", "1"],
            {},
            "restarts=1 with nodes and no backup_dir",
        ),
        (
            ["--nodes", "a,b", "--node-rank", "0", "--restarts", "1", "--backup-dir", "/b"]
            + ["--min-nodes", "3"],
            {},
            "min_nodes=3 for 2 nodes. Use 1..2.",
        ),
        (["--workers", "2", "--min-nodes", "2"], {}, "min_nodes=2 without nodes"),
        (
            ["--nodes", "a,b", "--node-rank", "0", "--private-network"],
            {},
            "private_network=True with nodes",
        ),
        (["--workers-per-node", "2"], {}, "without --nodes, outside SLURM"),
        (["--port", "2222"], {}, "--port 2222 without --nodes"),
        (["--workers-per-node", "1"], {"SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_NODEID unset"),
        (
            ["--workers-per-node", "1"],
            _slurm(0, SLURM_STEP_TASKS_PER_NODE="2(x2)"),
            "srun started several launchers on one node",
        ),
        (["--workers-per-node", "1"], _slurm(0, SLURM_STEP_NUM_NODES="3"), "lists 2 nodes"),
        (["--workers-per-node", "1"], _slurm(5), "node_rank=5 for 2 nodes (gpu2, gpu3)"),
    ],
)
def test_bad_layouts_are_clear_errors(argv, env, message, monkeypatch, capsys):
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TFSTRAT_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["launch", *argv, "--", PY, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_launch_help_says_what_restarts_and_port_retries_do_with_nodes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Ports are fixed: no port retries. With --restarts K and --backup-dir DIR" in text
    assert "(each listens on its node's port P - 1)" in text
    assert "none with --nodes, whose ports are fixed" in text
    assert "srun --ntasks-per-node=1 tfstrat launch --workers-per-node 2" in text


# ------------------------------------------------------------------------- tf-config --explain


def test_tf_config_explain_lists_every_port_and_where_it_binds(capsys, monkeypatch):
    monkeypatch.delenv("TFSTRAT_PORT_OFFSET", raising=False)
    argv = ["tf-config", "--worker", "127.0.0.1:5000,10.9.0.2:5000", "--ps", "10.9.0.3:6000"]
    assert cli.main([*argv, "--explain"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert ["worker:0", "127.0.0.1:5000"] in lines
    assert "  5000/tcp  TensorFlow gRPC server  all interfaces (0.0.0.0 and ::)" in out
    # A task on this machine: the address computed here (the route to 10.9.0.2, or loopback
    # and all interfaces where this machine has no route there).
    here = re.search(
        r"  5001/tcp  tfstrat ring +(\S+) \(this machine's address on its route to worker:1\)", out
    )
    assert here, out
    assert (
        "  6001/tcp  Hybrid's table server   10.9.0.3's own address on its route to worker:0, worker:1"
        in out
    )
    assert re.search(
        r"Open these ports.*\n  127\.0\.0\.1 +5000-5001/tcp\n  10\.9\.0\.2 +5000-5001/tcp\n  10\.9\.0\.3 +6000-6001/tcp",
        out,
    )
    # With no addresses, the TF_CONFIG of the environment (a TFJob's pod).
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["w-0.svc:2222"]}}))
    assert cli.main(["tf-config", "--explain"]) == 0
    assert "worker:0  w-0.svc:2222\n  2222/tcp" in capsys.readouterr().out
    monkeypatch.delenv("TF_CONFIG")
    # The offset moves tfstrat's port; --nodes gives the launcher's cluster.
    monkeypatch.setenv("TFSTRAT_PORT_OFFSET", "3")
    argv = ["tf-config", "--nodes", "a,b", "--workers-per-node", "2", "--port", "2222", "--explain"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "P + 3 (TFSTRAT_PORT_OFFSET=3)" in out
    assert re.search(r"worker:1  a:2226\n  2226/tcp .*\n  2229/tcp  tfstrat ring ", out), out
    assert out.endswith(
        "\n  a  2222/tcp 2225-2226/tcp 2229/tcp\n  b  2222/tcp 2225-2226/tcp 2229/tcp\n"
    )


# ----------------------------------------------------------------------------------- recipes


def _check_tfjob(text: str) -> None:
    """The TFJob manifest, parsed as Kubernetes parses it: every replica declares the port the
    operator writes into TF_CONFIG (named tfjob-port) and the tfstrat port tfstrat computes from
    it; the NetworkPolicy admits exactly those between the job's own pods; the TF_CONFIG the
    operator writes for it makes tfstrat.auto() pick Hybrid."""
    import yaml

    from tfstrat.cluster import ports
    from tfstrat.cluster.devices import DeviceInfo
    from tfstrat.strategies.choice import choose

    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(text)}
    assert set(docs) == {"TFJob", "NetworkPolicy"}, set(docs)
    job = docs["TFJob"]
    name = job["metadata"]["name"]
    specs = job["spec"]["tfReplicaSpecs"]
    assert {kind: spec["replicas"] for kind, spec in specs.items()} == {"PS": 1, "Worker": 2}
    labels, commands, declared = [], [], set()
    for spec in specs.values():
        pod = spec["template"]
        labels.append(pod["metadata"]["labels"])
        (container,) = pod["spec"]["containers"]
        commands.append(container["command"])
        by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert set(by_name) == {"tfjob-port", "tfstrat-port"}, by_name
        declared |= {by_name["tfjob-port"], by_name["tfstrat-port"]}
        # The operator's TF_CONFIG names each pod at tfjob-port: tfstrat listens one above.
        address = f"{name}-worker-0.default.svc:{by_name['tfjob-port']}"
        assert ports.tfstrat_port(address) == by_name["tfstrat-port"], by_name
    assert len({repr(c) for c in commands}) == 1, commands  # every pod runs the same program
    policy = docs["NetworkPolicy"]["spec"]
    assert all(policy["podSelector"]["matchLabels"].items() <= lab.items() for lab in labels)
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"podSelector": policy["podSelector"]}]
    assert {p["port"] for p in rule["ports"]} == declared == {2222, 2223}
    pods = {kind: [f"{name}-{kind}-{i}.default.svc:2222" for i in range(n)] for kind, n in
            (("worker", 2), ("ps", 1))}  # fmt: skip
    tf_config = TFConfig.from_hosts(pods["worker"], ps=pods["ps"], task_type="worker", task_index=0)
    host = DeviceInfo(2, (), (), False, None, "2.21.0", "3.15.1")
    assert choose(tf_config, host)[0] == "Hybrid"


def _read(name):
    with open(os.path.join(RECIPES, name)) as f:
        return f.read()


def _flag(text, name):
    """The value of `name` where it is set: NAME=value, or `--name value` on a command line."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    match = re.search(rf"{name}[ =](\S+)", "\n".join(lines))
    assert match, name
    return match[1].strip('"')


def test_recipes_use_the_ports_and_names_the_code_uses(monkeypatch):
    monkeypatch.delenv("TFSTRAT_PORT_OFFSET", raising=False)
    # SLURM: one launcher per node; the TF_CONFIG and ports its comments show.
    sbatch = _read("slurm.sbatch")
    assert "srun --ntasks-per-node=1" in sbatch and "#SBATCH --nodes=2" in sbatch
    workers, port = int(_flag(sbatch, "--workers-per-node")), int(_flag(sbatch, "--port"))
    env = {"SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1"}
    config = NodeLayout.from_slurm(env, workers_per_node=workers, port=port).tf_config()
    shown = "  ".join(f"worker:{i} {a}" for i, a in enumerate(config.addresses("worker")))
    assert shown in " ".join(sbatch.split("#")), shown
    assert f"{port}-{port + 2 * workers - 1}/tcp" in sbatch
    # Two machines: the same arguments on both; the firewall's last port per node.
    shell = _read("two_machines.sh")
    nodes, port = _flag(shell, "NODES"), int(_flag(shell, "PORT"))
    layout = dict(
        workers_per_node=_flag(shell, "--workers-per-node"),
        ps_per_node=_flag(shell, "--ps-per-node"),
        port=port,
    )
    plan = NodeLayout(nodes, 0, **layout).plan
    for node in plan:
        last = int(node.tasks[-1][2].rsplit(":", 1)[1]) + 1
        assert f"{node.rank}) PEER=" in shell and f"LAST={last} ;;" in shell
        assert f"{node.host} uses {port}-{last}/tcp" in " ".join(shell.replace("#", "").split())
    for job in ("worker", "ps"):
        for i, address in enumerate(TFConfig.from_nodes(nodes, **layout).addresses(job)):
            assert f"{job}:{i} {address}" in shell
    _check_tfjob(_read("tfjob.yaml"))
    # Ray: the snippet's fixed-port rewrite gives what TFConfig accepts, ports 2 apart.
    spec = importlib.util.spec_from_file_location(
        "ray_train", os.path.join(RECIPES, "ray_train.py")
    )
    ray_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ray_train)
    ray = {
        "cluster": {"worker": ["10.0.0.5:41231", "10.0.0.6:1", "10.0.0.5:9"]},
        "task": {"type": "worker", "index": 2},
    }
    config = TFConfig.from_json(ray_train.declared_ports(json.dumps(ray), 2222))
    assert config.addresses("worker") == ("10.0.0.5:2222", "10.0.0.6:2222", "10.0.0.5:2224")
    assert "port + 1 (`TFSTRAT_PORT_OFFSET`)" in " ".join(_read("ray_train.py").split())


def test_the_elastic_slurm_recipe_parses_to_a_restarting_multi_node_launch(monkeypatch):
    """slurm_elastic.sbatch's `tfstrat launch` line, read by tfstrat's own parser under the
    variables srun sets on node 1: a multi-node launch with restarts, a shared backup
    directory, and SLURM kept from killing the job or the step on a node failure."""
    import shlex

    from tfstrat.commands import launch as launch_command
    from tfstrat.launcher import api

    sbatch = _read("slurm_elastic.sbatch")
    for flag in ("#SBATCH --no-kill", "#SBATCH --requeue", "srun --ntasks-per-node=1 --no-kill"):
        assert flag in sbatch, flag
    assert "--kill-on-bad-exit=0" in sbatch
    command = " ".join(sbatch.rsplit("\nsrun ", 1)[1].replace("\\\n", " ").split())
    words = shlex.split(command.replace('"', ""))
    argv = words[words.index("tfstrat") + 1 :]
    slurm = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_STEP_NODELIST": "node[01-02]"}
    slurm.update(SLURM_STEP_NUM_NODES="2", SLURM_NODEID="1")
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    made = {}

    def keep(config, out=None):
        made["config"] = config
        return 0

    monkeypatch.setattr(api, "launch", keep)
    monkeypatch.setattr(api.LaunchConfig, "__post_init__", lambda self: None)  # no files here
    args = cli.build_parser().parse_args(argv)
    assert launch_command.run(args) == 0
    config = made["config"]
    assert config.restarts == 3 and config.min_nodes == 1
    assert config.backup_dir.endswith("/backup") and config.secret_file.endswith("/secret")
    assert config.nodes.rank == 1 and [n.host for n in config.nodes.plan] == ["node01", "node02"]
    assert f"{config.nodes.plan[0].port - 1}/tcp (the rendezvous)" in " ".join(
        sbatch.replace("#", "").split()
    )


# ------------------------------------------------------------------ real runs, two launchers


def _free_base(count):
    """A port p with p..p+count-1 free on every interface (TensorFlow binds 0.0.0.0)."""
    for _ in range(200):
        base = random.randrange(20000, 32000)  # below Linux's ephemeral range
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no free port range")


def _second_loopback():
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip(
            "cannot bind 127.0.0.2, the second node's address (Linux puts all of 127/8 on lo; "
            "this kernel or sandbox does not)"
        )


def _start_nodes(tmp_path, layout_args, script_args, marker):
    _second_loopback()
    base = _free_base(12)  # one range for both nodes: two picks could overlap (0.0.0.0 binds)
    nodes = f"127.0.0.1:{base},127.0.0.2:{base + 6}"
    env = dict(os.environ, TFSTRAT_TEST_RUN=marker, TF_CPP_MIN_LOG_LEVEL="2")
    for name in [n for n in env if n.startswith("SLURM_")]:
        del env[name]
    procs = []
    for rank in (0, 1):
        argv = [PY, "-m", "tfstrat", "launch", "--nodes", nodes, "--node-rank", str(rank)]
        argv += [*layout_args, "--threads-per-task", "1", "--timeout", "240", "--grace", "2"]
        argv += ["--", PY, "nodes_train.py", str(tmp_path), *script_args]
        procs.append(
            subprocess.Popen(
                argv,
                cwd=WORKERS,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return nodes, procs


def _finish(procs, timeout=280):
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=timeout)[0])
        finally:
            proc.kill()
    return outs


def _cluster_line(out):
    lines = [line for line in out.splitlines() if "; cluster " in line]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[0].split("; cluster ", 1)[1])


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_two_launchers_train_together_and_the_ps_outlives_its_nodes_worker(tmp_path):
    """Node 0: worker:0 and ps:0; node 1: worker:1 (Hybrid, the table on ps:0). worker:1 reads
    the table only after worker:0 has exited: node 0's launcher must keep ps:0 serving."""
    nodes, procs = _start_nodes(
        tmp_path,
        ["--workers-per-node", "1", "--ps-per-node", "1,0"],
        ["--late-read"],
        uuid.uuid4().hex,
    )
    outs = _finish(procs)
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, f"node {rank}:\n{out[-4000:]}"
    # Written out: on each node its workers, then its ps tasks, 2 ports apart from the node's.
    base = int(nodes.split(",")[0].rsplit(":", 1)[1])
    expected = {
        "worker": [f"127.0.0.1:{base}", f"127.0.0.2:{base + 6}"],
        "ps": [f"127.0.0.1:{base + 2}"],
    }
    assert _cluster_line(outs[0]) == _cluster_line(outs[1]) == expected
    assert "starts worker:0, ps:0" in outs[0] and "starts worker:1" in outs[1]
    assert "ps:0 keeps serving until these have ended: worker:1 on node 1 (127.0.0.2)" in outs[0]
    assert "[worker:1] worker:0 has ended; reading the table now" in outs[1], outs[1][-3000:]
    first, second = (np.load(tmp_path / f"worker:{i}.npz") for i in (0, 1))
    assert len(first.files) == 3
    for name in first.files:
        np.testing.assert_array_equal(first[name], second[name])


def _pid_of(task, marker):
    found = procs.find(env=[f"TFSTRAT_TEST_RUN={marker}", f"TFSTRAT_TASK={task}"])
    return found[0] if found else None


@pytest.mark.cluster
@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_task_killed_on_one_node_fails_the_other_node_fast_naming_it(tmp_path):
    marker = uuid.uuid4().hex
    nodes, procs = _start_nodes(tmp_path, ["--workers-per-node", "1"], ["--forever"], marker)
    deadline = time.monotonic() + 200
    while not all((tmp_path / f"worker:{i}.epoch").exists() for i in (0, 1)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            outs = _finish(procs, 10)
            pytest.fail(f"training never started:\n{outs[0][-3000:]}\n{outs[1][-3000:]}")
        time.sleep(0.2)
    os.kill(_pid_of("worker:1", marker), signal.SIGKILL)
    killed = time.monotonic()
    outs = _finish(procs)
    took = time.monotonic() - killed
    assert procs[1].returncode == 137, outs[1][-3000:]
    assert (
        "worker:1 on node 1 (127.0.0.2) failed first (exit code 137, killed by SIGKILL)" in outs[1]
    )
    assert procs[0].returncode not in (0, None), outs[0][-3000:]
    assert (
        "worker:1 on node 1 (127.0.0.2) is the probable cause: worker:0 on node 0 (127.0.0.1) "
        "failed first" in outs[0]
    ), outs[0][-3000:]
    # The ring sees the connection close: far below the strategy's 120 s timeout.
    assert took < 60, took


@pytest.mark.cluster
@pytest.mark.faults
@pytest.mark.timeout(200)
def test_a_taken_port_fails_a_node_without_retries_naming_the_port(tmp_path, capsys):
    """A node holding only a ps task, whose port another process holds: no retry on other ports
    (the other nodes expect these), the ps named, and the way out said."""
    base = _free_base(2)
    with socket.socket() as taken:
        taken.bind(("", base))
        taken.listen(1)
        argv = [
            "launch",
            "--nodes",
            f"127.0.0.1:{_free_base(2)},127.0.0.1:{base}",
            "--node-rank",
            "1",
        ]
        argv += ["--workers-per-node", "1,0", "--ps-per-node", "0,1", "--timeout", "150"]
        code = cli.main([*argv, "--", PY, "-c", "pass"])
    out = capsys.readouterr().out
    assert code != 0, out[-3000:]
    assert "retrying" not in out
    assert "ps:0 on node 1 (127.0.0.1) failed first" in out, out[-3000:]
    assert "A multi-node run's ports are fixed (no retries)" in out


@pytest.mark.cluster
@pytest.mark.faults
@pytest.mark.timeout(200)
def test_a_ps_only_node_gives_up_on_a_node_that_never_starts(capsys):
    """Was: a node holding only a ps task waited forever when another node never started."""
    base = _free_base(4)
    argv = ["launch", "--nodes", f"127.0.0.1:{base},127.0.0.1:{base + 2}", "--node-rank", "1"]
    argv += ["--workers-per-node", "1,0", "--ps-per-node", "0,1", "--peer-timeout", "5"]
    started = time.monotonic()
    code = cli.main([*argv, "--", PY, "-c", "pass"])  # node 0 is never started
    took = time.monotonic() - started
    out = capsys.readouterr().out
    assert code == 1, out[-3000:]
    assert f"worker:0 at 127.0.0.1:{base} on node 0 (127.0.0.1) never came up within 5 s" in out, (
        out[-3000:]
    )
    assert "stopping ps:0" in out and "--peer-timeout" in out
    assert took < 5 + 30, took  # the deadline, a ps's start-up and a busy machine's slack
