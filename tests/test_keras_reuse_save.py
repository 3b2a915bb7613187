"""A strategy created twice per process; model.save on every worker.

One CollectiveAllReduce cluster run (tests/workers/reuse_save.py) checks both: three
`run_training()` calls per process (one worker 2 s late each time, the third over TensorFlow's
collectives) each equal single-device training; the first strategy, still referenced, trains
again exactly; another TF_CONFIG is refused naming both; then both workers save in a row
(`model.save`, `save_weights`, Keras's `ModelCheckpoint`) with weights that differ per worker
and load each file at once. Stock Keras in the same script (`--stock-save`, 8 saves of each
kind) gave worker 1 a BadZipFile (Bad CRC-32), an h5py lock error on save and one on load, and
13 of 16 loads of its own weights instead of the chief's; its ModelCheckpoint then crashed.
"""

import json
import os

import numpy as np
import pytest
from cluster import launch_script, run_script
from common import relative_errors

pytestmark = pytest.mark.cluster

TOLERANCE = 1e-5


def _weights(npz, name):
    keys = [k for k in npz.files if k.startswith(f"{name}/w")]
    return [npz[k] for k in sorted(keys, key=lambda k: int(k.split("/w")[1]))]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_strategy_twice_and_save_on_every_worker(tmp_path):
    run_script("reuse_save.py", str(tmp_path), "--reference")
    ref = np.load(tmp_path / "reference.npz")
    code, out = launch_script("reuse_save.py", str(tmp_path), "--saves", "4", workers=2)
    assert code == 0, out[-6000:]
    for w in range(2):
        got = np.load(tmp_path / f"worker_{w}.npz")
        # Item 4: every run_training() equals single-device training, the first strategy too.
        for run in ("run1", "run2", "run3", "first_again"):
            errs = relative_errors(_weights(got, run), _weights(ref, run))
            assert max(errs) <= TOLERANCE, (w, run, errs)
            assert int(got[f"{run}/iterations"]) == int(ref[f"{run}/iterations"])
        np.testing.assert_allclose(
            got["first_again/evaluate"], ref["first_again/evaluate"], rtol=1e-5
        )
        outcome = json.loads((tmp_path / f"worker_{w}.json").read_text())
        # The late worker was late: worker 1 in run 2, worker 0 in run 3.
        late = {0: "run3/late_by", 1: "run2/late_by"}[w]
        assert outcome[late] >= 2.0, (w, outcome[late])
        refused = outcome["other_tf_config"]
        assert "127.0.0.1:1" in refused and "already runs TensorFlow's server" in refused
        assert '"index":' + str(w) in refused.replace(" ", "")
        # Item 5: every load, on every worker, predicts what the chief's model predicts
        # (floats: a torn file or a stale or non-chief file would be an error string or ~1e-2).
        for kind, count in (("save", 4), ("save_weights", 4), ("checkpoint", 1)):
            diffs = outcome[kind]
            assert len(diffs) == count, (w, kind, diffs)
            assert all(isinstance(d, float) and d <= 1e-5 for d in diffs), (w, kind, diffs)
        assert all(isinstance(d, float) and d <= 1e-5 for d in outcome["checkpoint_weights"])
        # Only the final files: no temporaries left, nothing written by the non-chief.
        assert not [f for f in outcome["files"] if f.startswith(".tmp-")], outcome["files"]
    files = sorted(os.listdir(tmp_path))
    assert [f for f in files if f.endswith((".keras", ".h5"))] == [
        "ck.keras",
        "ck.weights.h5",
        "m.keras",
        "m.weights.h5",
    ], files
