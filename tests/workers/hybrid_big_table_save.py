"""A ps-held table whose part is over gRPC's 4 MiB message limit, saved and loaded (Hybrid).

Usage (under `tfstrat launch --workers 2 --ps 1`): python hybrid_big_table_save.py OUT_DIR
70,000 x 32 float32 (8.5 MiB on one ps): a checkpoint reads and writes it in chunks. The chief
then loads the file into a stock Keras model and prints "round trip <max |difference|>" of
the two models' predictions. Then the same with a plain `keras.layers.Embedding` (Hybrid holds
its table on the ps too) saved whole by `model.save` (.keras) and loaded by plain Keras
`load_model`: "keras file round trip <max |difference|>".
"""

import os
import sys

import numpy as np

import tfstrat

strategy = tfstrat.Hybrid(timeout=60)
import keras  # noqa: E402

from tfstrat.keras.layers import Embedding  # noqa: E402

V, D = 70000, 32
rng = np.random.default_rng(0)
x = rng.integers(0, V, (128, 4)).astype("int32")
y = (x[:, 0] % 2).astype("int64")


def build(embedding):
    inp = keras.Input((4,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(embedding(V, D, name="table")(inp))
    return keras.Model(inp, keras.layers.Dense(2, name="head")(hidden))


with strategy.scope():
    model = build(Embedding)
    model.compile(
        optimizer="adagrad", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
path = os.path.join(sys.argv[1], "big.weights.h5")
model.save_weights(path)  # every worker calls it; the chief writes
want = model.predict(x[:16], verbose=0)
if os.environ.get("TFSTRAT_TASK") == "worker:0":
    stock = build(keras.layers.Embedding)
    stock.load_weights(path)
    got = stock.predict(x[:16], verbose=0)
    sys.stdout.write(f"round trip {float(np.abs(got - want).max())}\n")  # one write(2)

with strategy.scope():
    plain = build(keras.layers.Embedding)
    plain.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
plain.fit(x, y, batch_size=32, epochs=1, verbose=0)
assert plain.get_layer("table").embeddings.remote is not None  # the table is on the ps
path = os.path.join(sys.argv[1], "plain.keras")
plain.save(path)  # every worker calls it; the chief writes
want = plain.predict(x[:16], verbose=0)
if os.environ.get("TFSTRAT_TASK") == "worker:0":
    loaded = keras.models.load_model(path)  # plain Keras, outside the strategy
    assert type(loaded.get_layer("table")._embeddings).__name__ == "Variable"
    got = loaded.predict(x[:16], verbose=0)
    # The optimizer came along: Adam's moments of the table are the ps's.
    table = loaded.get_layer("table").embeddings
    index = loaded.optimizer._get_variable_index(table)
    ps_slots = plain.get_layer("table").embeddings.remote.slots({})
    for name, slot in (
        ("momentum", loaded.optimizer._momentums),
        ("velocity", loaded.optimizer._velocities),
    ):
        assert np.array_equal(slot[index].numpy(), ps_slots[name]), name
    sys.stdout.write(f"keras file round trip {float(np.abs(got - want).max())}\n")
