"""The one seam to TensorFlow's and Keras's internals (`tfstrat._compat`): the supported
versions, the list of Keras patches and the way back, and the layout rules that keep every
private import behind the seam and the packages free of import cycles."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tfstrat._compat import patches, versions
from tfstrat.errors import TfstratError, VersionError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tfstrat"
PY = sys.executable

pytestmark = pytest.mark.timeout(240)


# --- versions ---------------------------------------------------------------------------------


def test_supported_versions_pass_and_others_are_named():
    assert versions.problems("2.21.0", "3.15.1") == []
    assert versions.problems("2.19.0", "3.10.0") == []
    assert versions.problems("2.21.3rc1", "3.15.0.dev2026") == []
    assert versions.problems("2.22.0", "3.16.0") == []  # newer minors: supported, untested
    assert versions.problems("2.18.1", "3.15.1") == [
        "TensorFlow 2.18.1 (tfstrat supports tensorflow>=2.19,<3)"
    ]
    assert versions.problems("3.0.0", "3.9.2") == [
        "TensorFlow 3.0.0 (tfstrat supports tensorflow>=2.19,<3)",
        "Keras 3.9.2 (tfstrat supports keras>=3.10,<4)",
    ]
    assert versions.problems("nightly", "4.0.0") == [
        "TensorFlow nightly (tfstrat supports tensorflow>=2.19,<3)",
        "Keras 4.0.0 (tfstrat supports keras>=3.10,<4)",
    ]


def test_newer_than_tested_is_named_and_the_tested_range_is_inside_the_supported():
    assert versions.untested("2.21.0", "3.15.1") == []
    assert versions.untested("2.22.1", "3.16.0") == [
        "TensorFlow 2.22.1 (tested: 2.19-2.21)",
        "Keras 3.16.0 (tested: 3.10-3.15)",
    ]
    for supported, tested in (
        (versions.TENSORFLOW, versions.TESTED_TENSORFLOW),
        (versions.KERAS, versions.TESTED_KERAS),
    ):
        assert supported[0] == tested[0] and tested[1] < supported[1], (supported, tested)
    tf_minors = {tuple(map(int, tf.split("."))) for tf, _ in versions.PAIRS + (versions.NEWEST,)}
    keras_minors = {tuple(map(int, k.split("."))) for _, k in versions.PAIRS + (versions.NEWEST,)}
    assert min(tf_minors) == versions.TESTED_TENSORFLOW[0], versions.PAIRS
    assert max(tf_minors) == versions.TESTED_TENSORFLOW[1], versions.PAIRS
    # every Keras minor of the tested range runs in some pair
    (major, low), (_, high) = versions.TESTED_KERAS
    assert keras_minors == {(major, m) for m in range(low, high + 1)}, versions.PAIRS


def test_pyproject_allows_the_supported_range_and_the_suite_runs_the_newest_pair():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for pip, bounds in (("tensorflow", versions.TENSORFLOW), ("keras", versions.KERAS)):
        assert f"{pip}{versions.spec(bounds)}" in project["dependencies"], project["dependencies"]
    test = project["optional-dependencies"]["test"]
    tf, keras = versions.NEWEST
    for pip, minor in (("tensorflow", tf), ("keras", keras)):
        major, low = map(int, minor.split("."))
        assert f"{pip}>={minor},<{major}.{low + 1}" in test, test


def test_the_readmes_release_table_shows_the_tested_pairs():
    """`c` cells are `versions.PAIRS`, the one `T` is `versions.NEWEST`, and its rows and
    columns span the tested range."""
    text = (ROOT / "README.md").read_text()
    table = text.split("| TensorFlow / Keras |", 1)[1].split("\n\n", 1)[0].splitlines()
    columns = [c.strip() for c in table[0].strip(" |").split("|")]
    cells = {}
    for row in table[2:]:
        tf, *marks = [c.strip() for c in row.strip(" |").split("|")]
        cells.update({(tf, keras): mark for keras, mark in zip(columns, marks)})
    assert sorted(k for k, v in cells.items() if v == "c") == sorted(versions.PAIRS), cells
    assert [k for k, v in cells.items() if v == "T"] == [versions.NEWEST], cells
    (a, b), (c, d) = versions.TESTED_TENSORFLOW
    assert sorted({tf for tf, _ in cells}) == [f"{a}.{m}" for m in range(b, d + 1)], cells
    (a, b), (c, d) = versions.TESTED_KERAS
    assert columns == [f"{a}.{m}" for m in range(b, d + 1)], columns


def _run(code: str, **env) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if k != versions.ALLOW_ENV}
    full.update(TF_CPP_MIN_LOG_LEVEL="2", **env)
    return subprocess.run(
        [PY, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=200
    )


CREATE = """
    import keras
    keras.__version__ = "{version}"  # as another Keras would report itself
    {change}
    import tfstrat
    try:
        tfstrat.MirroredNCCL(devices=["/cpu:0"])
        print("CREATED")
    except tfstrat.TfstratError as e:
        print("REFUSED", type(e).__name__, e)
"""
UNSUPPORTED = CREATE.format(version="3.9.2", change="")


def _last(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_strategy_refuses_an_unsupported_keras_naming_versions_and_the_fix():
    line = _last(_run(UNSUPPORTED))
    assert line.startswith("REFUSED VersionError"), line
    assert "Keras 3.9.2 (tfstrat supports keras>=3.10,<4)" in line, line
    assert "pip install 'tensorflow>=2.19,<3' 'keras>=3.10,<4'" in line, line
    assert "TFSTRAT_ALLOW_UNSUPPORTED=1" in line, line


def test_allow_unsupported_warns_once_and_goes_on():
    proc = _run(UNSUPPORTED, TFSTRAT_ALLOW_UNSUPPORTED="1")
    assert proc.returncode == 0 and "CREATED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    warned = [x for x in proc.stderr.splitlines() if "running on unsupported Keras 3.9.2" in x]
    assert len(warned) == 1, proc.stderr[-3000:]


def test_a_newer_keras_whose_patched_attributes_match_starts_with_one_warning():
    proc = _run(CREATE.format(version="3.16.0", change=""))
    assert _last(proc) == "CREATED", proc.stdout + proc.stderr[-3000:]
    warned = [x for x in proc.stderr.splitlines() if "Keras 3.16.0 (tested: 3.10-3.15)" in x]
    assert len(warned) == 1 and "has not been tested" in warned[0], proc.stderr[-3000:]


CHANGED = """
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    keras_make = TensorFlowTrainer._make_function
    TensorFlowTrainer._make_function = lambda self, step_function, jit=False: keras_make(
        self, step_function)
    from keras.src.losses import loss
    del loss.scale_loss_for_distribution
"""


def test_a_keras_whose_patched_attribute_changed_or_went_is_refused_naming_it():
    line = _last(_run(CREATE.format(version="3.16.0", change=CHANGED)))
    assert line.startswith("REFUSED VersionError"), line
    assert (
        "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._make_function is "
        "(self, step_function, jit=False) in Keras 3.16.0; tfstrat's replacement is written "
        "for (self, step_function) in Keras 3.10-3.15" in line
    ), line
    assert (
        "keras.src.losses.loss.scale_loss_for_distribution does not exist in Keras 3.16.0 "
        "(Keras 3.10-3.15 have it)" in line
    ), line
    assert "pip install 'keras>=3.10,<3.16'" in line and "TFSTRAT_ALLOW_UNSUPPORTED=1" in line


def test_every_patched_keras_attribute_is_listed_with_the_signature_installed():
    import keras

    from tfstrat._compat import surface

    assert surface.problems(keras.__version__, patches.original) == []
    owner = keras.layers.Dense  # a Keras class that is not in the table: refused by name
    with pytest.raises(AssertionError, match=r"Dense'>.call, which tfstrat._compat.surface"):
        patches.patch(owner, "call", owner.call, "a test's reason")
    assert not patches.is_patched(owner, "call")


def test_version_error_is_a_tfstrat_error():
    assert issubclass(VersionError, TfstratError) and issubclass(VersionError, RuntimeError)


# --- patches ----------------------------------------------------------------------------------


def test_patch_lists_keeps_the_first_original_and_removes_own_and_inherited():
    class Base:
        def hello(self):
            return "base"

    class Child(Base):
        def own(self):
            return "own"

    keras_own = Child.__dict__["own"]
    try:
        first = patches.patch(Child, "own", lambda self: "patched", "a test's reason")
        assert first is keras_own and Child().own() == "patched"
        again = patches.patch(Child, "own", lambda self: "twice", "a test's reason")
        assert again is keras_own and patches.original(Child, "own") is keras_own
        patches.patch(Child, "hello", lambda self: "child", "an inherited one")
        assert Child().hello() == "child" and patches.is_patched(Child, "hello")
        listed = [x for x in patches.installed() if ".Child." in x]
        assert listed == [
            f"{__name__}.test_patch_lists_keeps_the_first_original_and_removes_own_and_inherited"
            ".<locals>.Child.own: a test's reason",
            f"{__name__}.test_patch_lists_keeps_the_first_original_and_removes_own_and_inherited"
            ".<locals>.Child.hello: an inherited one",
        ]
    finally:
        patches.remove(Child, "own")
        patches.remove(Child, "hello")
    assert Child.__dict__["own"] is keras_own and "hello" not in Child.__dict__
    assert Child().hello() == "base" and not patches.is_patched(Child, "own")


FIT_THEN_REMOVE = """
    import json
    import numpy as np
    import keras
    import tfstrat
    from tfstrat._compat import patches
    from tfstrat._compat.keras import TensorFlowTrainer, CallbackList, EpochIterator

    before = {
        "make_function": TensorFlowTrainer.__dict__["_make_function"],
        "callbacks": CallbackList.__dict__["__init__"],
        "iterator": EpochIterator.__dict__["__init__"],
        "save_model": keras.saving.save_model,
    }
    strategy = tfstrat.CollectiveAllReduce()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("adam", "mse")
    x = np.ones((8, 3), "float32")
    model.fit(x, x[:, :1], epochs=1, batch_size=4, verbose=0)
    installed = patches.installed()
    patched = {
        "make_function": TensorFlowTrainer.__dict__["_make_function"] is not before["make_function"],
        "callbacks": CallbackList.__dict__["__init__"] is not before["callbacks"],
    }
    patches.remove_all()
    after = {
        "make_function": TensorFlowTrainer.__dict__["_make_function"] is before["make_function"],
        "callbacks": CallbackList.__dict__["__init__"] is before["callbacks"],
        "iterator": EpochIterator.__dict__["__init__"] is before["iterator"],
        "save_model": keras.saving.save_model is before["save_model"],
    }
    left = patches.installed()
    # The next strategy installs them again.
    again_strategy = tfstrat.CollectiveAllReduce()
    with again_strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(x, x[:, :1], epochs=1, batch_size=4, verbose=0)
    again = patches.installed()
    print("REPORT " + json.dumps({"installed": installed, "patched": patched, "after": after,
                                  "left": left, "again": again}))
"""


def test_a_fit_lists_every_keras_patch_with_its_reason_and_remove_all_restores_keras():
    proc = _run(FIT_THEN_REMOVE)
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    assert proc.returncode == 0 and line, proc.stdout + proc.stderr[-3000:]
    report = json.loads(line[0][7:])
    installed = report["installed"]
    for where in (
        "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._make_function",
        "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._maybe_symbolic_build",
        "keras.src.callbacks.callback_list.CallbackList.__init__",
        "keras.src.trainers.epoch_iterator.EpochIterator.__init__",
        "keras.src.losses.loss.scale_loss_for_distribution",
    ):
        found = [x for x in installed if x.startswith(where + ": ")]
        assert len(found) == 1 and len(found[0]) > len(where) + 10, (where, installed)
    # Keras's, and TensorFlow's two: the collectives' watchdog times function calls, and
    # input every worker slices alike skips the per-step "any data left" all-reduce.
    tensorflow = {
        "tensorflow.python.eager.polymorphic_function.concrete_function.ConcreteFunction._call_flat",
        "tensorflow.python.distribute.input_lib._calculate_replicas_with_values",
    }
    outside = {x.split(":")[0] for x in installed if not x.startswith("keras.")}
    assert outside and outside <= tensorflow, outside
    assert all(report["patched"].values()), report
    assert all(report["after"].values()) and report["left"] == [], report
    again = {x.split(": ")[0] for x in report["again"]}
    assert again == {x.split(": ")[0] for x in installed}, (again, installed)


# --- layout: private imports behind the seam, no import cycles ---------------------------------


def _imports(path: Path, module: str, modules=()):
    """(imported module names, line) of a tfstrat source file, imports inside functions too;
    `from package import submodule` imports the submodule, not the package's __init__."""
    is_pkg = path.name == "__init__.py"
    base = module if is_pkg else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                mod = ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""]).strip(
                    "."
                )
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
            if len(subs) < len(node.names):
                yield mod, node.lineno
            for sub in subs:
                yield sub, node.lineno


def _modules():
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def test_no_private_tensorflow_or_keras_import_outside_compat():
    found = []
    for module, path in _modules().items():
        if module.startswith("tfstrat._compat"):
            continue
        for name, line in _imports(path, module):
            if name.startswith(("tensorflow.python", "keras.src", "tf_keras.src")):
                found.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert found == [], found


def test_the_modules_and_packages_import_each_other_without_cycles():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        deps = set()
        for name, _ in _imports(path, module, modules):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    # A depth-first search for a back edge: a module reached again while still on the path.
    state, path_ = {}, []

    def visit(m):
        state[m] = "open"
        path_.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError(" -> ".join(path_[path_.index(d) :] + [d]))
            if d not in state:
                visit(d)
        path_.pop()
        state[m] = "done"

    sys.setrecursionlimit(10000)
    for m in sorted(graph):
        if m not in state:
            visit(m)

    def part(m):
        return ".".join(m.split(".")[:2])

    edges = {(part(a), part(b)) for a, ds in graph.items() for b in ds if part(a) != part(b)}
    both = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert both == [], both


def test_every_package_directory_has_an_init_so_a_wheel_holds_it():
    # setuptools' find_packages skips a directory without __init__.py: it would be missing
    # from an installed (non-editable) tfstrat.
    missing = [
        str(d.relative_to(ROOT))
        for d in PACKAGE.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
        if not (d / "__init__.py").exists()
    ]
    assert missing == [], missing


def test_doctor_reads_the_same_ranges():
    from types import SimpleNamespace

    from tfstrat.commands import doctor

    def check(tf, keras):
        return doctor._versions(SimpleNamespace(tensorflow_version=tf, keras_version=keras))

    tested = check("2.19.1", "3.10.0")
    assert tested.status == "ok" and "2.19/3.10, 2.19/3.15" in tested.text, tested
    assert "2.21/3.15; this pair is one" in tested.text, tested
    between = check("2.20.0", "3.12.1")
    assert between.status == "ok" and "this pair is not one, though both releases" in between.text
    newer = check("2.21.0", "3.16.0")
    assert newer.status == "note" and "Keras 3.16.0 (tested: 3.10-3.15)" in newer.text
    old = check("2.18.0", "3.15.1")
    assert old.status == "FAIL", old
    assert "TensorFlow 2.18.0 (tfstrat supports tensorflow>=2.19,<3)" in old.text, old
    assert "pip install 'tensorflow>=2.19,<3' 'keras>=3.10,<4'" in old.text, old
    assert check("2.21.0", None).status == "FAIL"


def test_a_tf_keras_model_is_refused_by_name_where_tf_keras_is_tf_keras():
    """TF_USE_LEGACY_KERAS=1 with tf-keras installed (Ray Train's TensorflowTrainer sets the
    variable on every worker): a `tf.keras` model compiled under a tfstrat strategy is refused
    naming the variable, tf-keras and `import keras`, instead of training without tfstrat's
    Keras 3 step; a Keras 3 model (`import keras`) trains in the same environment."""
    from paths import WORKERS  # noqa: PLC0415

    tf_keras = os.environ.get("TFSTRAT_TEST_TFKERAS", "")
    if not os.path.isdir(os.path.join(tf_keras, "tf_keras")):
        why = (
            "needs tf-keras beside the venv, which scripts/test installs into .venv/tfkeras "
            "(TFSTRAT_TEST_TFKERAS): run it with `scripts/test tests/test_compat.py -k tf_keras`"
        )
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(why)
        pytest.skip(why)
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join([tf_keras, env.get("PYTHONPATH", "")])
    runs = {}
    for kind in ("tf", "keras"):
        runs[kind] = subprocess.run(
            [sys.executable, "legacy_keras_run.py", kind], cwd=WORKERS, env=env,
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    refused = runs["tf"]
    assert refused.returncode != 0 and "TRAINED" not in refused.stdout, refused.stdout
    assert "UsageError: tfstrat: this model is a tf-keras (Keras 2) model" in refused.stderr
    for named in ("TF_USE_LEGACY_KERAS='1'", "Ray Train's TensorflowTrainer", "`import keras`"):
        assert named in refused.stderr, (named, refused.stderr[-2000:])
    trained = runs["keras"]
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "TRAINED keras.src.models" in trained.stdout, trained.stdout
    assert "tf.keras is tf-keras (Keras 2) here" in trained.stderr  # the warning, once
