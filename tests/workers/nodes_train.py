"""A worker of the launcher's multi-node and network tests (test_launch_nodes.py,
test_private_network.py): Hybrid with one tfstrat Embedding (held by the ps when the cluster has
one, else all-reduced over tfstrat's TCP ring) and a dense head, a few steps of SGD.

Usage (under `tfstrat launch`): python nodes_train.py OUT [--hold] [--late-read] [--forever]
    writes OUT/<task>.npz: the final weights (the table as read from where it lives)
    --hold       after training, creates OUT/<task>.trained and waits up to 120 s for OUT/go
                 (the test reads the task's listening sockets meanwhile)
    --late-read  the last worker reads the table only after worker:0's process has ended (a
                 ps must outlive the workers of its own node)
    --forever    trains epoch after epoch (creating OUT/<task>.epoch after the first) until
                 killed
"""

import argparse
import json
import os
import pathlib
import socket
import time

parser = argparse.ArgumentParser()
parser.add_argument("out", type=pathlib.Path)
parser.add_argument("--hold", action="store_true")
parser.add_argument("--late-read", action="store_true")
parser.add_argument("--forever", action="store_true")
args = parser.parse_args()

import tfstrat  # noqa: E402

# Longer than any upper bound the tests put on noticing a dead peer: they must see the ring
# notice it, not this timeout.
strategy = tfstrat.Hybrid(partitions=1, timeout=120)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import CLASSES, SEQ, VOCAB, data  # noqa: E402

task = os.environ["TFSTRAT_TASK"]
cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
x, y = data(16 * 6)
with strategy.scope():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    h = tfstrat.keras.layers.Embedding(VOCAB, 8, name="table")(inputs)
    h = keras.layers.Dense(CLASSES)(keras.layers.Flatten()(h))
    model = keras.Model(inputs, h)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


class EpochMark(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch} done", flush=True)
        (args.out / f"{task}.epoch").touch()


epochs = 100_000 if args.forever else 1
model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=[EpochMark()])
print("trained", flush=True)


def accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
        return True
    except OSError:
        return False


if args.late_read and task == f"worker:{len(cluster['worker']) - 1}":
    deadline = time.monotonic() + 60
    while accepts(cluster["worker"][0]):
        assert time.monotonic() < deadline, "worker:0 did not end within 60 s"
        time.sleep(0.2)
    print("worker:0 has ended; reading the table now", flush=True)

weights = [np.asarray(model.get_layer("table").embeddings)]
weights += [w.numpy() for w in model.layers[-1].weights]
np.savez(args.out / f"{task}.npz", *weights)

if args.hold:
    (args.out / f"{task}.trained").touch()
    deadline = time.monotonic() + 120
    while not (args.out / "go").exists():
        assert time.monotonic() < deadline, "the test never said go"
        time.sleep(0.1)
print("done", flush=True)
