"""Unit tests for tfstrat.cluster: TF_CONFIG build, parse, validate (in-process, no TF runtime)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import doctest
import itertools
import json
import pathlib
import pickle
import socket

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tfstrat import cluster
from tfstrat.cluster import TFConfig, TFConfigError, free_port

KUBEFLOW_EVALUATOR = {
    "cluster": {
        "chief": ["mnist-chief-0.kubeflow.svc:2222"],
        "worker": ["mnist-worker-0.kubeflow.svc:2222", "mnist-worker-1.kubeflow.svc:2222"],
        "ps": ["mnist-ps-0.kubeflow.svc:2222"],
    },
    "task": {"type": "evaluator", "index": 0},
    "environment": "cloud",
}
RAY_WORKER = {
    "cluster": {"worker": ["10.0.0.1:40001", "10.0.0.2:40002", "10.0.0.3:40003"]},
    "task": {"type": "worker", "index": 2},
}


def _slurm_env(procid, nodelist, tasks_per_node=None, **extra):
    env = {"SLURM_PROCID": str(procid), "SLURM_JOB_NODELIST": nodelist, **extra}
    if tasks_per_node is not None:
        env["SLURM_TASKS_PER_NODE"] = tasks_per_node
    return env


# ----- formats written by others -----


def test_kubeflow_evaluator_outside_cluster():
    config = TFConfig.from_json(json.dumps(KUBEFLOW_EVALUATOR))
    assert config.environment == "cloud"
    assert (config.task_type, config.task_index) == ("evaluator", 0)
    assert config.task_address is None
    assert config.task_types == ("chief", "worker", "ps")
    assert not config.is_chief
    assert config.num_workers == 3
    assert json.loads(config.to_json())["environment"] == "cloud"


def test_kubeflow_worker_and_chief():
    data = {**KUBEFLOW_EVALUATOR, "task": {"type": "worker", "index": 1}}
    config = TFConfig.from_dict(data)
    assert config.task_address == "mnist-worker-1.kubeflow.svc:2222"
    assert not config.is_chief
    assert config.for_task("chief", 0).is_chief


def test_ray_train_workers_only():
    config = TFConfig.from_env({"TF_CONFIG": json.dumps(RAY_WORKER)})
    assert config.task_types == ("worker",)
    assert config.task_address == "10.0.0.3:40003"
    assert config.num_workers == 3
    assert not config.is_chief
    assert config.for_task("worker", 0).is_chief


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(RAY_WORKER))
    assert TFConfig.from_env().task_index == 2


@pytest.mark.parametrize("index", [1, "1"])
def test_task_index_int_or_digit_string(index):
    data = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": index}}
    assert TFConfig.from_dict(data).task_index == 1


def test_ipv6_addresses_in_brackets():
    config = TFConfig.from_hosts(
        ["[::1]:2222", "[fe80::1%eth0]:2222"], task_type="worker", task_index=0
    )
    assert config.task_address == "[::1]:2222"


def test_cluster_is_normalized_and_read_only():
    config = TFConfig({"ps": ["c:1"], "worker": ["a:1", "b:1"], "evaluator": []})
    assert list(config.cluster) == ["worker", "ps"]  # canonical order, empty jobs dropped
    assert config.cluster["worker"] == ("a:1", "b:1")
    with pytest.raises(TypeError):
        config.cluster["worker"] = ("x:1",)  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.task_type = "worker"  # type: ignore[misc]


def test_equality_pickle_and_deepcopy():
    config = TFConfig.from_dict(KUBEFLOW_EVALUATOR)
    assert config == TFConfig.from_dict(json.loads(json.dumps(KUBEFLOW_EVALUATOR)))
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config


# ----- SLURM -----


@pytest.mark.parametrize(
    ("nodelist", "tasks_per_node", "procid", "workers", "address"),
    [
        (
            "node[01-03,07]",
            "2(x3),1",
            6,
            [
                "node01:5000",
                "node01:5002",
                "node02:5000",
                "node02:5002",
                "node03:5000",
                "node03:5002",
                "node07:5000",
            ],
            "node07:5000",
        ),
        ("node[01-03,07]", "2(x3),1", 3, None, "node02:5002"),
        ("a[1-2],b3", "1(x3)", 2, ["a1:5000", "a2:5000", "b3:5000"], "b3:5000"),
        ("node1", "4", 3, ["node1:5000", "node1:5002", "node1:5004", "node1:5006"], "node1:5006"),
        ("n[08-10]", "1(x3)", 0, ["n08:5000", "n09:5000", "n10:5000"], "n08:5000"),
        ("r[1-2]n[1-2]", "1(x4)", 1, ["r1n1:5000", "r1n2:5000", "r2n1:5000", "r2n2:5000"], None),
        ("a,b", None, 1, ["a:5000", "b:5000"], "b:5000"),  # tasks per node unset: 1 each
    ],
)
def test_from_slurm(nodelist, tasks_per_node, procid, workers, address):
    config = TFConfig.from_slurm(_slurm_env(procid, nodelist, tasks_per_node), port=5000)
    if workers is not None:
        assert config.addresses("worker") == tuple(workers)
    if address is not None:
        assert config.task_address == address
    assert (config.task_type, config.task_index) == ("worker", procid)


def test_from_slurm_prefers_step_variables_and_checks_local_id():
    env = _slurm_env(1, "big[1-9]", "1(x9)", SLURM_STEP_NODELIST="x[1-2]")
    env.update(SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="x1", SLURM_LOCALID="1")
    config = TFConfig.from_slurm(env, port=7000)
    assert config.addresses("worker") == ("x1:7000", "x1:7002")
    with pytest.raises(TFConfigError, match=r"SLURM_LOCALID='0'.*--distribution=block"):
        TFConfig.from_slurm({**env, "SLURM_LOCALID": "0"})


def test_from_slurm_ps_tasks_come_first():
    env = _slurm_env(0, "n[1-3]", "1(x3)")
    config = TFConfig.from_slurm(env, ps=1)
    assert config.addresses("ps") == ("n1:12345",)
    assert config.addresses("worker") == ("n2:12345", "n3:12345")
    assert (config.task_type, config.task_index) == ("ps", 0)
    assert TFConfig.from_slurm({**env, "SLURM_PROCID": "2"}, ps=1).task_index == 1
    with pytest.raises(
        TFConfigError, match=r"ps=3. Use a value in 0..2 \(3 tasks, one must be a worker\)"
    ):
        TFConfig.from_slurm(env, ps=3)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, r"SLURM_PROCID unset"),
        (_slurm_env(5, "n[1-2]", "2(x2)"), r"SLURM_PROCID=5 for 4 tasks"),
        (_slurm_env(0, "n[1-2]", "2"), r"SLURM_TASKS_PER_NODE='2' for 2 nodes"),
        (_slurm_env(0, "n[3-1]"), r"range '3-1'"),
        (_slurm_env(0, "n[1-2"), r"SLURM_JOB_NODELIST='n\[1-2'"),
        (_slurm_env(0, "a,,b"), r"SLURM_JOB_NODELIST='a,,b'"),
        (_slurm_env(0, "n[1-999999999]"), r"range '1-999999999'"),
        (_slurm_env("x", "n1"), r"SLURM_PROCID='x'"),
    ],
)
def test_from_slurm_errors(env, match):
    with pytest.raises(TFConfigError, match=match):
        TFConfig.from_slurm(env)


# ----- hostfile, hosts, local -----


def test_from_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# Horovod hostfile\n\nnode-a slots=2\nnode-b   # one slot\n  node-c slots=1\n")
    config = TFConfig.from_hostfile(path, port=3000, task_type="worker", task_index=3)
    assert config.addresses("worker") == (
        "node-a:3000",
        "node-a:3002",
        "node-b:3000",
        "node-c:3000",
    )
    assert config.task_address == "node-c:3000"
    assert TFConfig.from_hostfile(str(path)).addresses("worker")[0] == "node-a:12345"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"with 0 slots"),
        ("# nothing\n", r"with 0 slots"),
        ("a slots=0\n", r"'slots=0' at .*hosts:1"),
        ("a\nb slots=x\n", r"'slots=x' at .*hosts:2"),
        ("a\na\n", r"also used by"),
        ("a:1 slots=1\n", r"hosts:1='a:1:12345'. An address"),
    ],
)
def test_from_hostfile_errors(tmp_path, text, match):
    (tmp_path / "hosts").write_text(text)
    with pytest.raises(TFConfigError, match=match):
        TFConfig.from_hostfile(tmp_path / "hosts")


def test_from_hostfile_brackets_bare_ipv6(tmp_path):
    (tmp_path / "hosts").write_text("::1 slots=2\n#\nfe80::2\n")
    config = TFConfig.from_hostfile(tmp_path / "hosts")
    assert config.addresses("worker") == ("[::1]:12345", "[::1]:12347", "[fe80::2]:12345")


def test_from_hostfile_missing(tmp_path):
    with pytest.raises(TFConfigError, match=r"nope"):
        TFConfig.from_hostfile(tmp_path / "nope")


def test_from_hosts_full_cluster():
    config = TFConfig.from_hosts(
        worker=["w0:1", "w1:1"],
        ps=["p0:1"],
        chief="c:1",
        evaluator="e:1",
        task_type="ps",
        task_index="0",
    )
    assert config.task_types == ("chief", "worker", "ps", "evaluator")
    assert config.task_address == "p0:1"
    assert config.num_workers == 3
    assert not config.is_chief


def _assert_bindable(address):
    host, port = address.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, int(port)))


def test_local_distinct_bindable_ports():
    config = TFConfig.local(workers=3, ps=2, chief=True, evaluator=True)
    addresses = [a for job in config.task_types for a in config.addresses(job)]
    assert len(addresses) == len(set(addresses)) == 7
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    for address in addresses:
        _assert_bindable(address)
    assert config.task_type is None and config.task_index is None
    assert config.num_workers == 4
    _assert_bindable(f"127.0.0.1:{free_port()}")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"workers": 0}, r"workers=0, chief=False"), ({"ps": -1}, r"ps=-1"), ({"workers": "x"}, "x")],
)
def test_local_errors(kwargs, match):
    with pytest.raises(TFConfigError, match=match):
        TFConfig.local(**kwargs)


# ----- use -----


def test_round_trip_and_json_shape():
    config = TFConfig.from_dict(KUBEFLOW_EVALUATOR)
    assert TFConfig.from_json(config.to_json()) == config
    assert TFConfig.from_json(config.to_json().encode()) == config
    plain = TFConfig.from_hosts(["a:1"])
    assert plain.to_json() == '{"cluster":{"worker":["a:1"]},"rpc_layer":"grpc"}'
    assert TFConfig.from_json(plain.to_json()) == plain


def test_to_env():
    config = TFConfig.from_dict(RAY_WORKER)
    assert config.to_env() == {"TF_CONFIG": config.to_json()}
    base = {"PATH": "/bin", "TF_CONFIG": "old"}
    env = config.to_env(base)
    assert env == {"PATH": "/bin", "TF_CONFIG": config.to_json()}
    assert base["TF_CONFIG"] == "old"
    assert TFConfig.from_env(env) == config


def test_for_task():
    config = TFConfig.from_hosts(["a:1", "b:1"], ps=["c:1"])
    worker = config.for_task("worker", 1)
    assert (worker.task_type, worker.task_index, worker.task_address) == ("worker", 1, "b:1")
    assert config.task_type is None
    assert worker.for_task(None, None) == config
    with pytest.raises(TFConfigError, match=r"task=ps:1"):
        config.for_task("ps", 1)


@pytest.mark.parametrize(
    ("cluster", "task", "is_chief"),
    [
        ({"chief": ["c:1"], "worker": ["w:1"]}, ("chief", 0), True),
        ({"chief": ["c:1"], "worker": ["w:1"]}, ("worker", 0), False),
        ({"worker": ["w:1", "v:1"]}, ("worker", 0), True),
        ({"worker": ["w:1", "v:1"]}, ("worker", 1), False),
        ({"worker": ["w:1"], "ps": ["p:1"]}, ("ps", 0), False),
        ({"worker": ["w:1"], "evaluator": ["e:1"]}, ("evaluator", 0), False),
        ({"worker": ["w:1"]}, (None, None), False),
    ],
)
def test_is_chief(cluster, task, is_chief):
    assert TFConfig(cluster, *task).is_chief is is_chief


def test_addresses_unknown_type():
    assert TFConfig.from_hosts(["a:1"]).addresses("ps") == ()
    with pytest.raises(TFConfigError, match=r"task_type='master'"):
        TFConfig.from_hosts(["a:1"]).addresses("master")


CONFIGS_FOR_TF = [
    KUBEFLOW_EVALUATOR,
    RAY_WORKER,
    {**KUBEFLOW_EVALUATOR, "task": {"type": "ps", "index": 0}},
    {"cluster": {"worker": ["[::1]:2222", "[::1]:2223"]}},
]


@pytest.mark.parametrize("data", CONFIGS_FOR_TF)
def test_tensorflow_accepts_our_json(monkeypatch, data):
    tf = pytest.importorskip("tensorflow")
    config = TFConfig.from_dict(data)
    monkeypatch.setenv("TF_CONFIG", config.to_json())
    theirs = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    expected = {job: list(addresses) for job, addresses in config.cluster.items()}
    assert theirs.cluster_spec().as_dict() == expected
    assert (theirs.task_type, theirs.task_id) == (config.task_type, config.task_index)
    assert theirs.rpc_layer == config.rpc_layer
    ours = config.resolver()
    assert ours.cluster_spec().as_dict() == expected
    assert (ours.task_type, ours.task_id, ours.rpc_layer) == (
        config.task_type,
        config.task_index,
        config.rpc_layer,
    )


def test_package_does_not_import_tensorflow_at_top_level():
    files = sorted(pathlib.Path(cluster.__file__).parent.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [name for name in names if name.split(".")[0] in ("tensorflow", "keras")], path


def test_docstring_examples_run():
    import tfstrat.errors
    from tfstrat.cluster import config, layout, ports

    attempted = 0
    for module in (config, layout, ports, tfstrat.errors):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
        attempted += result.attempted
    assert attempted > 5


# ----- bad input: one line naming the value and the fix -----

GOOD = {"worker": ["a:2222", "b:2222"]}


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: TFConfig(GOOD, "master", 0), r"task_type='master'. Use one of chief"),
        (lambda: TFConfig({"master": ["a:1"]}), r"task type 'master' in TF_CONFIG\['cluster'\]"),
        (lambda: TFConfig(GOOD, "worker", -1), r"task=worker:-1. .* has 2 tasks \(0..1\)"),
        (
            lambda: TFConfig({"worker": ["a:1"], "ps": ["a:1"]}),
            r"\['ps'\]\[0\]='a:1', also used by",
        ),
        (
            lambda: TFConfig({"worker": ["a"]}),
            r"\['worker'\]\[0\]='a'. An address is a 'host:port'",
        ),
        (lambda: TFConfig({"worker": [":1"]}), r"':1'. An address"),
        (lambda: TFConfig({"worker": ["::1:2222"]}), r"'::1:2222'. An address"),
        (lambda: TFConfig({"worker": ["a:70000"]}), r"'a:70000'. Port 70000 is out of range"),
        (lambda: TFConfig({"worker": ["a:0"]}), r"Port 0 is out of range"),
        (
            lambda: TFConfig.from_hosts(["a:1"], chief="b:1", task_type="chief", task_index=1),
            r"task=chief:1",
        ),
        (
            lambda: TFConfig({"chief": ["a:1", "b:1"]}),
            r"\['chief'\]=\['a:1', 'b:1'\]. A cluster "
            r"has at most one chief",
        ),
        (
            lambda: TFConfig({"evaluator": ["a:1", "b:1"], "worker": ["c:1"]}),
            r"at most one evaluator",
        ),
        (lambda: TFConfig(GOOD, "ps", 0), r"task=ps:0. TF_CONFIG\['cluster'\] has no 'ps' tasks"),
        (lambda: TFConfig(GOOD, "evaluator", 1), r"task=evaluator:1. There is one evaluator"),
        (lambda: TFConfig({}, "worker", 0), r"task=worker:0 with an empty cluster"),
        (lambda: TFConfig(GOOD, "worker", None), r"task_type='worker', task_index=None. Give both"),
        (lambda: TFConfig(GOOD, None, 0), r"task_type=None, task_index=0"),
        (lambda: TFConfig(GOOD, "worker", 1.0), r"task_index=1.0"),
        (lambda: TFConfig(GOOD, "worker", True), r"task_index=True"),
        (lambda: TFConfig(["a:1"]), r"TF_CONFIG\['cluster'\]=\['a:1'\]"),
        (lambda: TFConfig({"worker": "a:1"}), r"\['worker'\]='a:1'. Use a list"),
        (lambda: TFConfig({"worker": {"1": "a:1"}}), r"sparse"),
        (lambda: TFConfig(GOOD, rpc_layer=""), r"rpc_layer=''"),
        (lambda: TFConfig.from_env({}), r"TF_CONFIG unset or empty"),
        (
            lambda: TFConfig.from_json("{'cluster': {}}"),
            r"TF_CONFIG=\"{'cluster': {}}\". It is not",
        ),
        (lambda: TFConfig.from_json("[" * 100_000), r"not valid JSON"),
        (lambda: TFConfig.from_json(None), r"TF_CONFIG=None. It is not valid JSON"),
        (lambda: TFConfig.from_json("[]"), r"TF_CONFIG=\[\]. Use an object with a 'cluster'"),
        (lambda: TFConfig.from_json('{"cluster": {}, "task": []}'), r"TF_CONFIG\['task'\]=\[\]"),
        (lambda: TFConfig.from_hostfile(3), r"path=3"),
        (lambda: TFConfig.from_slurm({}, port=70000), r"port=70000"),
    ],
)
def test_bad_input_message(build, match):
    with pytest.raises(TFConfigError, match=match) as info:
        build()
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("Received: ")


def test_index_out_of_range_message_exact():
    with pytest.raises(TFConfigError) as info:
        TFConfig(GOOD, "worker", 3)
    assert str(info.value) == (
        "Received: task=worker:3. TF_CONFIG['cluster']['worker'] has 2 tasks (0..1); "
        "pick an index in range or add the address."
    )


def test_absent_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(TFConfigError, match=r"TF_CONFIG unset"):
        TFConfig.from_env()


# ----- property: any input gives a TFConfig or TFConfigError, nothing else -----
# Each generator mixes valid inputs, valid inputs with one part replaced by junk, and pure junk,
# so that both the accepting and the rejecting paths get exercised.

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
GOOD_HOST = st.sampled_from(["a", "b", "node-1", "10.0.0.1", "[::1]", "w.ns.svc"])
GOOD_ADDRESS = st.builds("{}:{}".format, GOOD_HOST, st.integers(1, 65535))
TASK_TYPE = (
    st.sampled_from(cluster.TASK_TYPES)
    | st.sampled_from(["master", "", "Worker"])
    | st.text(max_size=6)
)
HOST = GOOD_HOST | st.sampled_from(["::1", "", "h h", "[x]", "é", "-"]) | st.text(max_size=8)
PORT = (
    st.integers(-1, 70000).map(str)
    | st.sampled_from(["", "0", "65536", "2x"])
    | st.text("0123456789", max_size=8)
)
ADDRESS = GOOD_ADDRESS | st.builds("{}:{}".format, HOST, PORT) | st.text(max_size=12)
INDEX = st.integers(-2, 4) | st.sampled_from(["0", "1", "01", "-1", "", "1.0", " 1", "٣"]) | JSONISH
JUNK = JSONISH | ADDRESS | TASK_TYPE | INDEX
ADDRESS_LISTS = (
    st.lists(GOOD_ADDRESS, max_size=4, unique=True) | st.lists(ADDRESS, max_size=4) | JUNK
)


@st.composite
def tf_config_dicts(draw, mutate=True):
    """A valid TF_CONFIG dict, sometimes with one value replaced by junk or one key deleted."""
    ports = iter(draw(st.lists(st.integers(1, 65535), min_size=9, max_size=9, unique=True)))
    sizes = {"chief": (0, 1), "worker": (1, 4), "ps": (0, 2), "evaluator": (0, 1)}
    jobs = {
        job: [f"h:{next(ports)}" for _ in range(draw(st.integers(*n)))] for job, n in sizes.items()
    }
    data = {"cluster": {job: a for job, a in jobs.items() if a or draw(st.booleans())}}
    if draw(st.booleans()):
        job = draw(st.sampled_from([job for job, addresses in jobs.items() if addresses]))
        index = draw(st.integers(0, len(jobs[job]) - 1))
        data["task"] = {"type": job, "index": draw(st.sampled_from([index, str(index)]))}
    for key, value in [("rpc_layer", "grpc"), ("environment", "cloud")]:
        if draw(st.booleans()):
            data[key] = value
    if mutate and draw(st.booleans()):
        parent, key = draw(st.sampled_from(list(_slots(data))))
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = draw(JUNK)
    return data


def _slots(node):
    """Every (container, key) in a JSON-like tree, for replacing one value."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in list(items):
        yield node, key
        if isinstance(value, dict | list):
            yield from _slots(value)


RANDOM_TF_CONFIG = st.fixed_dictionaries(
    {},
    optional={
        "cluster": st.dictionaries(TASK_TYPE, ADDRESS_LISTS, max_size=4) | JSONISH,
        "task": st.fixed_dictionaries({}, optional={"type": TASK_TYPE | JSONISH, "index": INDEX})
        | JSONISH,
        "rpc_layer": st.sampled_from(["grpc", "", None]) | JSONISH,
        "environment": st.just("cloud") | JSONISH,
    },
)
JSON_TEXT = (
    tf_config_dicts().map(json.dumps)
    | RANDOM_TF_CONFIG.map(json.dumps)
    | JSONISH.map(json.dumps)
    | st.text(max_size=40)
)
FUZZ = settings(max_examples=300, deadline=None)


def _outcome(build):
    """A valid TFConfig must round-trip; a failure must be a one-line TFConfigError."""
    try:
        config = build()
    except TFConfigError as err:
        assert str(err).startswith("Received: ") and "\n" not in str(err)
        event("TFConfigError")
        return None
    event("TFConfig")
    assert isinstance(config, TFConfig)
    assert TFConfig.from_json(config.to_json()) == config
    return config


@FUZZ
@given(JSON_TEXT)
def test_fuzz_from_json(text):
    _outcome(lambda: TFConfig.from_json(text))


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["PATH", "TF_CONFIG "]) | st.text(max_size=4), st.text(max_size=4)
    ),
    st.just({})
    | st.fixed_dictionaries({"TF_CONFIG": tf_config_dicts().map(json.dumps)})
    | st.fixed_dictionaries({"TF_CONFIG": JSON_TEXT | JSONISH}),
)
def test_fuzz_from_env(other, tf_config):
    _outcome(lambda: TFConfig.from_env({**other, **tf_config}))


@st.composite
def hosts_args(draw):
    """from_hosts arguments of a valid cluster, sometimes with one argument replaced by junk."""
    data = draw(tf_config_dicts(mutate=False))
    cluster, task = data["cluster"], data.get("task", {})
    args = [cluster.get("worker", ()), cluster.get("ps")]
    args += [(cluster.get(job) or [None])[0] for job in ("chief", "evaluator")]
    args += [task.get("type"), task.get("index")]
    if draw(st.booleans()):
        args[draw(st.integers(0, 5))] = draw(st.none() | ADDRESS_LISTS | JUNK)
    return args


RANDOM_HOSTS_ARGS = st.tuples(
    ADDRESS_LISTS,
    st.none() | ADDRESS_LISTS,
    st.none() | ADDRESS | JSONISH,
    st.none() | ADDRESS | JSONISH,
    st.none() | TASK_TYPE | JSONISH,
    st.none() | INDEX,
)


@FUZZ
@given(hosts_args() | RANDOM_HOSTS_ARGS)
def test_fuzz_from_hosts(args):
    _outcome(lambda: TFConfig.from_hosts(*args))


NUMBER = st.integers(0, 12) | st.integers(0, 10**10)
JUNK_NODELIST = st.lists(
    st.builds(
        "{}{}{}".format,
        st.sampled_from(["node", "a", "b-", "", "n["]),
        st.just("")
        | st.lists(
            st.builds("{:0{}d}-{}".format, NUMBER, st.integers(1, 3), NUMBER)
            | NUMBER.map(str)
            | st.text("0123456789-,x", max_size=4),
            min_size=1,
            max_size=3,
        ).map(lambda parts: "[" + ",".join(parts) + "]"),
        st.sampled_from(["", "x", "]"]),
    ),
    min_size=1,
    max_size=3,
).map(",".join) | st.text(max_size=12)
JUNK_TASKS_PER_NODE = st.lists(
    st.builds("{}(x{})".format, st.integers(0, 3), st.integers(0, 4)) | st.integers(0, 3).map(str),
    min_size=1,
    max_size=4,
).map(",".join) | st.text("0123456789(x),", max_size=10)
JUNK_PROC_ID = st.integers(-1, 12).map(str) | st.text(max_size=3) | JSONISH


@st.composite
def slurm_envs(draw):
    """(environ, expected task address): a coherent SLURM environment, sometimes with junk."""
    numbers = sorted(draw(st.lists(st.integers(0, 30), min_size=1, max_size=5, unique=True)))
    width = draw(st.integers(1, 3))
    hosts = [f"node{n:0{width}d}" for n in numbers] + draw(st.sampled_from([[], ["b3"]]))
    nodelist = f"node[{','.join(f'{n:0{width}d}' for n in numbers)}]"
    nodelist += ",b3" if hosts[-1] == "b3" else ""
    counts = draw(st.lists(st.integers(1, 3), min_size=len(hosts), max_size=len(hosts)))
    runs = [(c, len(list(group))) for c, group in itertools.groupby(counts)]
    tasks_per_node = ",".join(f"{c}(x{r})" if r > 1 else str(c) for c, r in runs)
    tasks = [(host, k) for host, count in zip(hosts, counts, strict=True) for k in range(count)]
    proc_id = draw(st.integers(0, len(tasks) - 1))
    step = draw(st.sampled_from(["STEP_", ""]))
    environ = {
        "SLURM_PROCID": str(proc_id),
        f"SLURM_{step or 'JOB_'}NODELIST": nodelist,
        f"SLURM_{step}TASKS_PER_NODE": tasks_per_node,
        "SLURM_LOCALID": str(tasks[proc_id][1]),
    }
    expected = f"{tasks[proc_id][0]}:{12345 + 2 * tasks[proc_id][1]}"  # port, tfstrat port
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(environ)))
        junk = {"NODELIST": JUNK_NODELIST, "TASKS_PER_NODE": JUNK_TASKS_PER_NODE}
        environ[key] = draw(next((s for k, s in junk.items() if k in key), JUNK_PROC_ID) | JSONISH)
        expected = None
    return environ, expected


JUNK_SLURM_ENV = st.fixed_dictionaries(
    {},
    optional={
        "SLURM_PROCID": JUNK_PROC_ID,
        "SLURM_STEP_NODELIST": JUNK_NODELIST,
        "SLURM_JOB_NODELIST": JUNK_NODELIST | JSONISH,
        "SLURM_STEP_TASKS_PER_NODE": JUNK_TASKS_PER_NODE,
        "SLURM_TASKS_PER_NODE": JUNK_TASKS_PER_NODE | JSONISH,
        "SLURM_LOCALID": JUNK_PROC_ID,
    },
).map(lambda environ: (environ, None))


@FUZZ
@given(slurm_envs() | JUNK_SLURM_ENV, st.just(12345) | st.integers(-5, 70000) | JSONISH)
def test_fuzz_from_slurm(environ_and_expected, port):
    environ, expected = environ_and_expected
    config = _outcome(lambda: TFConfig.from_slurm(environ, port=port))
    if expected is not None and port == 12345:
        assert config is not None and config.task_address == expected


@FUZZ
@given(slurm_envs(), st.integers(-2, 4) | JSONISH)
def test_fuzz_from_slurm_ps(environ_and_expected, ps):
    _outcome(lambda: TFConfig.from_slurm(environ_and_expected[0], ps=ps))


GOOD_HOSTFILE_LINE = st.builds(
    "{}{}{}".format,
    st.sampled_from(["a", "b", "c", "10.0.0.1", "::1", "n-1.svc"]),
    st.sampled_from(["", " slots=1", " slots=3", "\tslots=2"]),
    st.sampled_from(["", "  # comment", "#x"]),
) | st.sampled_from(["", "   ", "# comment"])
JUNK_HOSTFILE_LINE = (
    st.builds("{} slots={}".format, HOST, st.integers(-1, 70000) | st.text(max_size=3))
    | HOST
    | st.sampled_from(["a max_slots=4", "slots=2", "a slots=2 slots=x", "a:1"])
    | st.text(max_size=15)
)
GOOD_HOSTFILE = st.lists(
    st.sampled_from(["a", "b", "c", "10.0.0.1", "::1", "n-1.svc"]),
    min_size=1,
    max_size=4,
    unique=True,
).flatmap(
    lambda hosts: st.tuples(
        *[
            st.builds(
                "{}{}{}".format,
                st.sampled_from(["", "# rack 1\n", "\n  \n"]),
                st.just(host),
                st.sampled_from(["", " slots=1", " slots=3 # three", "\tslots=2"]),
            )
            for host in hosts
        ]
    )
)
HOSTFILE = (
    GOOD_HOSTFILE.map(lambda lines: "\n".join(lines).encode())
    | st.lists(GOOD_HOSTFILE_LINE, max_size=5).map(lambda lines: "\n".join(lines).encode())
    | st.lists(GOOD_HOSTFILE_LINE | JUNK_HOSTFILE_LINE, max_size=6).map(
        lambda lines: "\n".join(lines).encode()
    )
    | st.text(max_size=40).map(lambda text: text.encode("utf-8", "surrogatepass"))
    | st.binary(max_size=40)
)


@settings(FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    HOSTFILE,
    st.just(12345) | st.integers(-5, 70000) | JSONISH,
    st.just((None, None)) | st.tuples(st.none() | TASK_TYPE, st.none() | INDEX),
)
def test_fuzz_from_hostfile(tmp_path, content, port, task):
    path = tmp_path / "hostfile"
    path.write_bytes(content)
    _outcome(lambda: TFConfig.from_hostfile(path, port, *task))


@FUZZ
@given(tf_config_dicts())
def test_fuzz_valid_configs_agree_with_their_dict(data):
    config = _outcome(lambda: TFConfig.from_dict(data))
    if config is None:
        return
    cluster_dict = {job: tuple(a) for job, a in data["cluster"].items() if a}
    assert dict(config.cluster) == cluster_dict
    assert config.num_workers == len(cluster_dict.get("worker", ())) + len(
        cluster_dict.get("chief", ())
    )
    if config.task_type in cluster_dict:
        assert config.task_address == cluster_dict[config.task_type][config.task_index]
    elif config.task_type is not None:  # Kubeflow's evaluator, outside the cluster
        assert (config.task_type, config.task_index, config.task_address) == ("evaluator", 0, None)
    if config.task_type is not None:
        chief = "chief" if "chief" in cluster_dict else "worker"
        assert config.is_chief == (config.task_type == chief and config.task_index == 0)
