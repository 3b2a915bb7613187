"""Input read from files: each worker reads only its share of the files (`_input_files`).

The cluster test launches 2 workers through `tfstrat launch` (tests/workers/input_files_run.py)
on TFRecord files whose records carry unique ids. Each worker records the ids its input
pipeline read and the ids its train steps trained on. By file (AUTO with 8 files, FILE, and
OFF with a share the script picks), each worker reads exactly the records of files w, w+2, ...
and trains on each once; together they train on every record once. Files of unequal sizes
(11 records for worker 0, 37 for worker 1) finish, both workers running the longer share's
steps; `evaluate` gives the same global result on both workers and `predict` every row to
each. By data (DATA, or AUTO with one file) every worker reads every record and trains on
its slice. FILE with one file, or with no files, is refused with a clear error. Under
Hybrid with a table on a ps task, the file cases give the same shares.

The unit tests below check, in this process, which pipelines count as "read from files" and
what each policy chooses.
"""

import json
import os

import pytest
from cluster import launch_script

# prefix -> records per file; ids are consecutive from the prefix's base, file after file.
LAYOUT = {
    "even": (0, [6] * 8),
    "uneven": (1000, [3, 9, 2, 10, 5, 7, 1, 11]),  # worker 0: 11 records, worker 1: 37
    "one": (2000, [16]),
}
WORKERS = 2


def _ids(prefix: str, files=None) -> list[int]:
    base, counts = LAYOUT[prefix]
    ids, start = [], base
    for k, n in enumerate(counts):
        if files is None or k in files:
            ids.extend(range(start, start + n))
        start += n
    return ids


def _share(prefix: str, worker: int) -> list[int]:
    """The records of files worker, worker + W, ... (the list is sorted by name)."""
    return _ids(prefix, set(range(worker, len(LAYOUT[prefix][1]), WORKERS)))


def write_records(folder) -> None:
    import tensorflow as tf

    for prefix, (base, counts) in LAYOUT.items():
        i = base
        for k, n in enumerate(counts):
            with tf.io.TFRecordWriter(os.path.join(folder, f"{prefix}-{k}.tfrecord")) as w:
                for _ in range(n):
                    feature = {
                        "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
                        "x": tf.train.Feature(
                            float_list=tf.train.FloatList(value=[i % 7 / 7, i % 5 / 5])
                        ),
                    }
                    example = tf.train.Example(features=tf.train.Features(feature=feature))
                    w.write(example.SerializeToString())
                    i += 1


# --- On a real cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    data = tmp_path_factory.mktemp("records")
    out = tmp_path_factory.mktemp("input_files")
    write_records(data)
    code, output = launch_script("input_files_run.py", str(data), str(out), workers=WORKERS)
    assert code == 0, output[-6000:]
    results = [json.loads((out / f"worker_{w}.json").read_text()) for w in range(WORKERS)]
    return results, output


def _by_file(results, case, prefix, steps):
    for w in range(WORKERS):
        r = results[w][case]
        assert "error" not in r, (case, r)
        assert r["read"] == _share(prefix, w), (case, w, "read other files' records")
        assert r["trained"] == _share(prefix, w), (case, w, "trained other than its share once")
        assert r["iterations"] == steps, (case, w, r["iterations"])
    assert results[0][case]["loss"] == results[1][case]["loss"], case  # global logs
    trained = results[0][case]["trained"] + results[1][case]["trained"]
    assert sorted(trained) == _ids(prefix), (case, "every record trained on once")


@pytest.mark.cluster
def test_auto_reads_each_worker_its_share_of_the_files(run):
    results, output = run
    _by_file(results, "even_auto", "even", steps=6)  # 24 records per worker, 4 per step
    assert results[0]["even_auto"]["evaluate"] == results[1]["even_auto"]["evaluate"]
    for w in range(WORKERS):
        assert f"input sharded by file (it reads 8 files, at least one per worker): worker {w}" in (
            output
        )


@pytest.mark.cluster
def test_off_trains_each_worker_on_its_own_dataset(run):
    results, _ = run
    _by_file(results, "even_off", "even", steps=6)  # the share the script picked, not re-sharded


@pytest.mark.cluster
def test_files_of_unequal_sizes_finish_on_the_longest_share(run):
    """Worker 0 runs out after 3 steps of its 11 records; it trains on empty batches until
    worker 1 has done its 10 steps of 37 records: no hang, and no record is lost."""
    results, _ = run
    _by_file(results, "uneven_auto", "uneven", steps=10)
    assert results[0]["uneven_auto"]["evaluate"] == results[1]["uneven_auto"]["evaluate"]
    assert [r["uneven_auto"]["predicted"] for r in results] == [48, 48]


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    data = tmp_path_factory.mktemp("records_hybrid")
    out = tmp_path_factory.mktemp("input_files_hybrid")
    write_records(data)
    code, output = launch_script(
        "input_files_run.py", str(data), str(out), "hybrid", workers=WORKERS, ps=1
    )
    assert code == 0, output[-6000:]
    return [json.loads((out / f"worker_{w}.json").read_text()) for w in range(WORKERS)]


@pytest.mark.cluster
@pytest.mark.slow
def test_hybrid_with_a_ps_table_reads_by_file_and_finishes_unequal_files(hybrid_run):
    """The worker out of records pushes empty gradients to the ps-held table meanwhile."""
    _by_file(hybrid_run, "uneven_auto", "uneven", steps=10)


@pytest.mark.cluster
def test_data_policy_and_too_few_files_slice_by_data(run):
    """Every worker reads every record and trains on its slice of each global batch."""
    results, output = run
    for case, prefix in (("even_data", "even"), ("one_auto", "one")):
        for w in range(WORKERS):
            assert results[w][case]["read"] == _ids(prefix), (case, w)
        trained = results[0][case]["trained"] + results[1][case]["trained"]
        assert sorted(trained) == _ids(prefix), case
        assert not set(results[0][case]["trained"]) & set(results[1][case]["trained"]), case
    assert (
        "input read from files, sharded by data: it reads 1 file(s), fewer than the 2 workers"
        in output
    )


@pytest.mark.cluster
def test_file_policy_with_too_few_or_no_files_is_refused(run):
    results, _ = run
    for w in range(WORKERS):
        error = results[w]["one_file"]["error"]
        assert "read from 1 file(s)" in error and "for 2 workers" in error, error
        assert "at least 2 files" in error and "AutoShardPolicy.DATA" in error, error
        error = results[w]["range_file"]["error"]
        assert "reads no files" in error and "AutoShardPolicy.DATA" in error, error


# --- In this process: what counts as files, what each policy chooses ------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    data = tmp_path_factory.mktemp("records_local")
    write_records(data)
    return str(data)


def test_find_files_follows_tensorflows_readers(folder):
    import numpy as np
    import tensorflow as tf

    from tfstrat.strategies._input_files import find_files

    even = sorted(os.path.join(folder, f"even-{k}.tfrecord") for k in range(8))
    pattern = os.path.join(folder, "even-*.tfrecord")
    listed = tf.data.Dataset.list_files(pattern).interleave(tf.data.TFRecordDataset)
    found = find_files(listed.map(lambda r: r).batch(4).prefetch(1))
    assert found.count == 8 and sorted(found.names) == even
    assert find_files(tf.data.TFRecordDataset(even, num_parallel_reads=2).batch(2)).count == 8
    assert find_files(tf.data.TextLineDataset(even[:3]).batch(2)).count == 3
    assert find_files(tf.data.Dataset.list_files(pattern).map(tf.data.TFRecordDataset)).count == 8
    pair = tf.data.Dataset.zip((tf.data.TFRecordDataset(even), tf.data.TFRecordDataset(even[:2])))
    assert find_files(pair).count == 2  # each zipped reader is sharded alone
    computed = tf.data.Dataset.from_tensor_slices(["a"]).map(lambda s: s + ".tfrecord")
    assert find_files(computed.interleave(tf.data.TFRecordDataset)).count is None
    assert find_files(tf.data.Dataset.range(10).batch(2)) is None
    assert find_files(tf.data.Dataset.from_tensor_slices(np.zeros((8, 2))).batch(2)) is None
    mixed = tf.data.Dataset.zip((tf.data.TFRecordDataset(even), tf.data.Dataset.range(9)))
    assert find_files(mixed) is None  # TensorFlow cannot shard the range by file


def test_choose_by_policy():
    import tensorflow as tf

    from tfstrat.strategies._input_files import FileSource, choose

    policy = tf.data.experimental.AutoShardPolicy
    eight, one, unknown = FileSource(8), FileSource(1), FileSource(None)
    assert choose(policy.AUTO, eight, 2).mode == "file"
    assert choose(policy.AUTO, eight, 8).mode == "file"
    assert choose(policy.AUTO, eight, 9).mode == "data"
    assert "1 file(s), fewer than the 2 workers" in choose(policy.AUTO, one, 2).reason
    assert choose(policy.AUTO, unknown, 2).mode == "data"
    assert choose(policy.AUTO, None, 2).mode == "data"
    assert choose(policy.DATA, eight, 2).mode == "data"
    assert choose(policy.OFF, eight, 2).mode == "off"
    assert choose(policy.FILE, unknown, 2).mode == "file"  # TensorFlow checks when it reads
    with pytest.raises(ValueError, match=r"read from 1 file\(s\).*for 2 workers"):
        choose(policy.FILE, one, 2)
    with pytest.raises(ValueError, match="reads no files"):
        choose(policy.FILE, None, 2)
