"""Hybrid: dense variables all-reduced, embedding tables on ps tasks; real processes."""

import json
import os
import re

import numpy as np
import pytest
from cluster import launch_script, run_script
from common import relative_errors

TOLERANCE = 1e-5
STEPS = 40  # hybrid_equiv.py: 2 epochs of 20 global batches


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid_reference")
    run_script("hybrid_equiv.py", str(out), "--reference")
    return out


def _check(out, reference):
    names = ("sgd", "adagrad")
    files = [str(out / f"{n}.weights.h5") for n in names]
    run_script("hybrid_equiv.py", str(out), "--reference", "--load", *files)
    ref = np.load(reference / "reference.npz")
    for name, path in zip(names, files):
        npz = np.load(path + ".npz")
        weights = [npz[f"arr_{i}"] for i in range(len(npz.files))]
        errs = relative_errors(weights, [ref[f"{name}/w{i}"] for i in range(len(weights))])
        assert max(errs) <= TOLERANCE, (name, errs)


def _copy_init(reference, out):
    import shutil

    shutil.copy(reference / "init.weights.h5", out / "init.weights.h5")


@pytest.mark.cluster
@pytest.mark.parametrize("ps", [1, 0])
def test_two_workers_equal_single_device(reference, tmp_path, ps):
    _copy_init(reference, tmp_path)
    code, log = launch_script("hybrid_equiv.py", str(tmp_path), "--partitions=2", workers=2, ps=ps)
    assert code == 0, log[-6000:]
    _check(tmp_path, reference)
    report = json.loads((tmp_path / "worker_1.json").read_text())
    for name in ("sgd", "adagrad"):
        assert report[name]["iterations"] == STEPS
        assert report[name]["predict_rows"] == 480
    # Every worker's per-epoch losses (global logs) and evaluate: one device's, alike on both.
    expected = json.loads((reference / "reference.json").read_text())
    chief = json.loads((tmp_path / "worker_0.json").read_text())
    for name in ("sgd", "adagrad"):
        for key in ("loss", "evaluate"):
            assert chief[name][key] == report[name][key], (name, key)
            mine, ref = np.asarray(report[name][key]), np.asarray(expected[name][key])
            assert np.allclose(mine, ref, rtol=1e-5, atol=1e-6), (name, key, mine, ref)
    dense = report["dense_devices"]
    assert all(d.startswith("/job:worker/") for p, d in dense.items() if "dense" in p), dense
    if ps:  # both tables on the ps task, in two parts each; nothing of them on the workers
        assert report["placement"] == {
            "users/embeddings": ["/job:ps/replica:0/task:0/device:CPU:0"] * 2,
            "items/embeddings": ["/job:ps/replica:0/task:0/device:CPU:0"] * 2,
        }
        assert not any("users" in p or "items" in p for p in dense), dense
    else:  # mirrored on the workers
        assert report["placement"] == {}
        assert dense["users/embeddings"].startswith("/job:worker/"), dense


@pytest.mark.cluster
@pytest.mark.parametrize("spe", [1, 3])
def test_workers_of_two_devices_fetch_and_push_once_per_table_per_step(reference, tmp_path, spe):
    """Two workers of two replicas each (logical CPUs), 1 ps: equal to one device, and each
    worker fetches a table's rows in one call and pushes them in one per step, whatever its
    replica count (on GPUs a worker's replicas are its GPUs); with steps_per_execution 3 too
    (the replicas' collectives inside Keras's loop: each replica draws its own instance keys)."""
    _copy_init(reference, tmp_path)
    args = ("hybrid_equiv.py", str(tmp_path), "--partitions=2", "--devices=2", f"--spe={spe}")
    code, log = launch_script(*args, workers=2, ps=1)
    assert code == 0, log[-6000:]
    _check(tmp_path, reference)
    for worker in (0, 1):
        report = json.loads((tmp_path / f"worker_{worker}.json").read_text())
        for name in ("sgd", "adagrad"):
            assert report[name]["iterations"] == STEPS
            calls = report[name]["calls"]
            assert set(calls) == {"users/embeddings", "items/embeddings"}, calls
            for table, counts in calls.items():
                assert counts == {"fetch": STEPS, "push": STEPS}, (worker, name, table, counts)


@pytest.mark.cluster
def test_bytes_per_step_scale_with_rows_touched_not_vocabulary(tmp_path):
    sent = {}
    for scale in (1, 10):
        out = tmp_path / f"x{scale}"
        out.mkdir()
        code, log = launch_script(
            "hybrid_equiv.py",
            str(out),
            "--steps-only=10",
            f"--vocab-scale={scale}",
            workers=2,
            ps=1,
        )
        assert code == 0, log[-6000:]
        sent[scale] = json.loads((out / "worker_0.json").read_text())["bytes_per_step"]
        # A stock Embedding goes by its gradient too: its table on the ps, said in its line.
        stock = re.findall(r"tfstrat: Hybrid table users \(\d+ x 8, ([\w.]+)\): (on ps \d)", log)
        assert ("keras.layers.Embedding", "on ps 0") in stock, (stock, log[-3000:])
    table_bytes = (1000 + 500) * 10 * 8 * 4
    assert 0 < sent[10] < 0.2 * table_bytes, sent
    assert abs(sent[10] - sent[1]) <= 0.2 * sent[1], sent


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_ps_table_over_grpcs_message_limit_saves_and_loads_into_stock_keras(tmp_path):
    # 70,000 x 32 on one ps (8.5 MiB): read in one RPC, gRPC refused it ("Received message
    # larger than max"), so such a model could not be saved.
    code, out = launch_script("hybrid_big_table_save.py", str(tmp_path), workers=2, ps=1)
    assert code == 0, out[-6000:]
    (line,) = [x for x in out.splitlines() if "] round trip " in x]
    assert float(line.rsplit(" ", 1)[1]) < 1e-5, line
    # A plain keras.layers.Embedding's ps-held table, in a .keras file plain Keras loads.
    (line,) = [x for x in out.splitlines() if "] keras file round trip " in x]
    assert float(line.rsplit(" ", 1)[1]) < 1e-5, line


def test_which_tables_stay_mirrored_and_why():
    """`sparse=` patterns (fnmatch on the layer's name and the table's path; "!" keeps a
    table mirrored) and the dense-gradient rule for regularizers, with the reason each
    mirrored table's start-up line gives."""
    import types

    import keras

    from tfstrat import Hybrid

    def why(sparse, name="items", regularizer=None, ps=("127.0.0.1:1",)):
        layer = keras.layers.Embedding(10, 2, name=name, embeddings_regularizer=regularizer)
        hybrid = types.SimpleNamespace(ps_addresses=ps, sparse=sparse)
        return Hybrid._mirrored_because(hybrid, layer, f"tower/{name}/embeddings")

    assert why("auto") is None
    assert why(["*item*"]) is None
    assert why(["tower/*"]) is None  # the table's path
    assert why(["*user*"]) == "sparse=['*user*'] does not name it"
    assert why(["!*item*"]) == "sparse=['!*item*'] excludes it"
    assert why(["!*user*"]) is None  # only exclusions: every other table goes
    assert why(["*", "!items"]) == "sparse=['*', '!items'] excludes it"
    assert why([]) == "sparse=[] does not name it"
    assert why("auto", regularizer="l2") == "embeddings_regularizer=L2 gives every row a gradient"
    assert why("auto", ps=()) == "no ps tasks in TF_CONFIG"


WEIGHT_API_MODELS = "TFSTRAT_TEST_WEIGHT_API_MODELS"  # the models of the test below


@pytest.mark.cluster
def test_kerass_weight_apis_see_ps_held_tables_as_one_device_does(tmp_path):
    """`weights`, `get_weights`, `set_weights`, `count_params`, `summary`, a table layer's
    `get_weights` and `embeddings`, and the optimizer's variables (the table's Adagrad
    accumulator) on both workers, for a plain Keras model and keras-hub's BERT whose tables
    are on the ps: as on one device. The weights are set to values unlike the initializer's
    before `fit`, so equal final weights mean training started from them."""
    # keras-hub comes with the test extra, so BERT runs wherever the suite does, and fails if
    # keras-hub is missing. The compat tier (tests/test_releases.py), whose venvs have no
    # keras-hub, asks for the plain model alone, and says so.
    models = tuple(os.environ.get(WEIGHT_API_MODELS, "plain,bert").split(","))
    chosen = ("--models", ",".join(models))
    run_script("hybrid_weights_api.py", str(tmp_path), "--reference", *chosen)
    code, log = launch_script("hybrid_weights_api.py", str(tmp_path), *chosen, workers=2, ps=1)
    assert code == 0, log[-6000:]
    for model in models:  # the tables are on the ps, said in the start-up lines
        table = "emb (50 x 4" if model == "plain" else "token_embedding (60 x 16"
        assert re.search(rf"Hybrid table {re.escape(table)}, [\w.]+\): on ps 0", log), log[-3000:]
    ref = json.loads((tmp_path / "reference.json").read_text())
    ref_arrays = np.load(tmp_path / "reference.npz")
    for worker in ("worker_0", "worker_1"):
        mine = json.loads((tmp_path / f"{worker}.json").read_text())
        arrays = np.load(tmp_path / f"{worker}.npz")
        assert mine == ref, (worker, mine, ref)  # paths, shapes, counts, summary, set-then-get
        assert sorted(arrays.files) == sorted(ref_arrays.files)
        for key in ref_arrays.files:
            got, want = arrays[key], ref_arrays[key]
            assert got.shape == want.shape, (worker, key, got.shape, want.shape)
            (err,) = relative_errors([got], [want])
            assert err <= TOLERANCE, (worker, key, err)
