"""Worker script of tests/test_input_files.py: Keras `fit` on input read from TFRecord files.

Usage (under `tfstrat launch --workers 2`): input_files_run.py DATA_DIR OUT_DIR
    or (under `tfstrat launch --workers 2 --ps 1`): input_files_run.py DATA_DIR OUT_DIR hybrid

DATA_DIR holds `even-*.tfrecord` (8 files of equal record counts), `uneven-*.tfrecord` (8
files whose counts differ, so the workers' shares do too) and `one-0.tfrecord`; each record
has a unique int64 "id" and a float "x". Each case records, on this worker, the ids its
input pipeline *read* (counted in a variable by the parsing map) and the ids its train steps
*trained on* (counted in `train_step`), and `optimizer.iterations`; errors are
recorded by message. Results go to OUT_DIR/worker_<index>.json.

"hybrid" runs the unequal-files case under `tfstrat.Hybrid` with an embedding table on the ps
task (the worker out of records pushes empty gradients to it while the other trains).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import tfstrat

HYBRID = sys.argv[3:] == ["hybrid"]
# In the ps task, Hybrid serves until the workers are done and exits.
strategy = tfstrat.Hybrid(timeout=120) if HYBRID else tfstrat.CollectiveAllReduce(timeout=120)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

DATA, OUT = sys.argv[1], sys.argv[2]
GLOBAL_BATCH = 8
IDS = 4096  # every id of the test's files is below
# Counts per id, in variables of this worker (outside the strategy's scope): no py_function,
# whose wait for the GIL stalled a trace by 15-20 s when an old input iterator was
# garbage-collected inside it.
read = tf.Variable(tf.zeros([IDS], tf.int32), trainable=False)
trained = tf.Variable(tf.zeros([IDS], tf.int32), trainable=False)


def _count(counts, ids):
    ids = tf.reshape(tf.cast(ids, tf.int32), [-1, 1])
    return counts.scatter_nd_add(ids, tf.ones(tf.shape(ids)[:1], tf.int32))


def parse(record):
    parsed = tf.io.parse_single_example(
        record,
        {
            "id": tf.io.FixedLenFeature([], tf.int64),
            "x": tf.io.FixedLenFeature([2], tf.float32),
        },
    )
    with tf.control_dependencies([_count(read, parsed["id"])]):
        ident = tf.cast(parsed["id"], tf.float32)
    # Column 0 carries the id into the train step; the model ignores it.
    x = tf.concat([[ident], parsed["x"]], 0)
    return x, tf.reduce_sum(parsed["x"])


class Recording(keras.Model):
    def train_step(self, data):
        x, _ = data
        with tf.control_dependencies([_count(trained, x[:, 0])]):
            return super().train_step(data)


def make_model():
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((3,))
        features = keras.layers.Lambda(lambda t: t[:, 1:])(inputs)
        if HYBRID:  # a table on the ps, looked up by id % 50
            rows = keras.layers.Lambda(lambda t: tf.cast(t[:, 0], tf.int32) % 50)(inputs)
            table = tfstrat.keras.layers.Embedding(50, 2, name="ids")(rows)
            features = keras.layers.Concatenate()([features, table])
        model = Recording(inputs, keras.layers.Dense(1)(features))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    return model


def with_policy(dataset, policy):
    options = tf.data.Options()
    # Deleting an old input iterator (at a garbage collection inside a later trace, or at
    # exit) now and then waited 15-200 s for a tf.data thread to finish (TF 2.21, loaded
    # machine; gdb: the main thread in ~MultiDeviceIterator -> ~RootDataset::Iterator ->
    # ~LogicalThreadWrapper). Without autotuning's model threads it happened less often.
    options.autotune.enabled = False
    if policy is not None:
        options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def files(prefix):
    return sorted(glob.glob(os.path.join(DATA, f"{prefix}-*.tfrecord")))


def pipelines():
    """name -> (dataset maker, policy, what runs after fit)"""
    policy = tf.data.experimental.AutoShardPolicy

    def listed(prefix):
        pattern = os.path.join(DATA, f"{prefix}-*.tfrecord")
        return lambda: (
            tf.data.Dataset.list_files(pattern)  # shuffled: the rewrite shards before that
            .interleave(tf.data.TFRecordDataset, cycle_length=2)
            .map(parse)
            .batch(GLOBAL_BATCH)
        )

    def records(prefix):
        return lambda: tf.data.TFRecordDataset(files(prefix)).map(parse).batch(GLOBAL_BATCH)

    def own_share():  # OFF: this worker's files, chosen by the script
        mine = files("even")[strategy.worker_index :: strategy.num_workers]
        return tf.data.TFRecordDataset(mine).map(parse).batch(GLOBAL_BATCH)

    # evaluate and predict only where they say something: every input iterator costs a
    # teardown (see `with_policy`).
    return {
        "even_auto": (listed("even"), None, ("evaluate",)),
        "uneven_auto": (records("uneven"), None, ("evaluate", "predict")),
        "even_data": (listed("even"), policy.DATA, ()),
        "even_off": (own_share, policy.OFF, ()),
        "one_auto": (records("one"), None, ()),
        "one_file": (records("one"), policy.FILE, ()),
        "range_file": (
            lambda: tf.data.Dataset.range(16).map(lambda i: (tf.ones([3]), 1.0)).batch(8),
            policy.FILE,
            (),
        ),
    }


def run_case(make, policy, after) -> dict:
    read.assign(tf.zeros_like(read))
    trained.assign(tf.zeros_like(trained))
    model = make_model()
    try:
        history = model.fit(with_policy(make(), policy), epochs=1, verbose=0)
    except ValueError as e:
        return {"error": str(e)}
    result = {
        # Distinct ids: Keras reads a batch to build the model from an iterator it then
        # drops, and that iterator's prefetching reads some records a second time.
        "read": np.flatnonzero(read.numpy()).tolist(),
        "trained": np.repeat(np.arange(IDS), trained.numpy()).tolist(),
        "iterations": int(model.optimizer.iterations.numpy()),
        "loss": float(history.history["loss"][-1]),
    }
    if "evaluate" in after:  # global results, identical on every worker
        result["evaluate"] = float(model.evaluate(with_policy(make(), policy), verbose=0))
    if "predict" in after:  # every worker gets every row (by file: each step's in worker order)
        result["predicted"] = len(model.predict(with_policy(make(), policy), verbose=0))
    return result


results = {}
only = os.environ.get("INPUT_FILES_CASES")  # a comma-separated subset, for debugging
only = only or ("uneven_auto" if HYBRID else None)
for name, (make, policy, after) in pipelines().items():
    if only and name not in only.split(","):
        continue
    start = time.time()
    results[name] = run_case(make, policy, after)
    shown = {k: v for k, v in results[name].items() if k not in ("read", "trained")}
    print(f"case {name} ({time.time() - start:.1f} s): {json.dumps(shown)}")

with open(os.path.join(OUT, f"worker_{strategy.worker_index}.json"), "w") as f:
    json.dump(results, f)
print("done", flush=True)
# No collective is left to run. Skip the interpreter's teardown of TensorFlow's input
# iterators, which can outlast the test (see `with_policy`).
sys.stderr.flush()
os._exit(0)
