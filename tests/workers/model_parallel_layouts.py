"""ModelParallel's answers to layouts it cannot apply, and to a layer it does not split.

Usage: python model_parallel_layouts.py OUT.json
Writes, per case, the error's type and message (or None); for the layer tfstrat does not
split (a Conv1D whose kernel a rule splits) and for a tied ReversibleEmbedding under Keras's own
DeviceMesh and LayoutMap: the start-up line, the parts, and the difference from one device
after training.
"""

import json
import logging
import sys

import numpy as np

import tfstrat

tfstrat.split_cpu(4)

import keras  # noqa: E402

OUT = sys.argv[1]
TWO = ["/device:CPU:0", "/device:CPU:1"]
results = {}


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


lines = Lines()
logging.getLogger("tfstrat").addHandler(lines)
logging.getLogger("tfstrat").setLevel(logging.INFO)


def mlp():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(10, name="up")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


def attempt(name, rules, mesh_shape=(1, 2), axis_names=("batch", "model"), batch="batch"):
    try:
        mesh = tfstrat.DeviceMesh(
            mesh_shape, list(axis_names), devices=TWO[: int(np.prod(mesh_shape))]
        )
        layout = tfstrat.LayoutMap(mesh)
        for key, value in rules.items():
            layout[key] = value
        strategy = tfstrat.ModelParallel(layout_map=layout, batch_dim_name=batch)
        with strategy.scope():
            model = mlp()
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((4, 6), "float32"), np.ones((4, 2), "float32"), verbose=0)
        results[name] = None
    except Exception as e:  # noqa: BLE001 (the message is the result)
        results[name] = [type(e).__name__, str(e)]


lines.lines.clear()
attempt("unknown_axis", {"up/kernel": (None, "tensor")})
attempt("two_rules", {"up/kernel": (None, "model"), "up/.*": (None, "model")})
attempt("wrong_rank", {"up/kernel": ("model",)})
attempt("two_dims_on_model", {"up/kernel": ("model", "model")})
attempt("unknown_batch_axis", {}, batch="data")
attempt("three_axes", {}, mesh_shape=(1, 1, 2), axis_names=("batch", "model", "expert"))
lines.lines.clear()
attempt("matches_nothing", {"dense_99/kernel": (None, "model"), "up/kernel": (None, "model")})
results["matches_nothing_lines"] = [line for line in lines.lines if "matches no variable" in line]

# A dimension that does not divide: Dense(5) split over 2.
try:
    mesh = tfstrat.DeviceMesh((1, 2), ["batch", "model"], devices=TWO)
    layout = tfstrat.LayoutMap(mesh)
    layout[".*five/kernel"] = (None, "model")
    with tfstrat.ModelParallel(layout_map=layout).scope():
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="five")])
    results["five"] = None
except Exception as e:  # noqa: BLE001
    results["five"] = [type(e).__name__, str(e)]

# A layer tfstrat does not split: computed on its whole kernel, equal to one device.
rng = np.random.default_rng(0)
x = rng.normal(size=(16, 8, 3)).astype("float32")
y = rng.normal(size=(16, 8, 4)).astype("float32")


def conv():
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [keras.Input((8, 3)), keras.layers.Conv1D(4, 3, padding="same", name="conv")]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


reference = conv()
reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
mesh = tfstrat.DeviceMesh((1, 2), ["batch", "model"], devices=TWO)
layout = tfstrat.LayoutMap(mesh)
layout[".*conv/kernel"] = (None, None, "model")
lines.lines.clear()
with tfstrat.ModelParallel(layout_map=layout).scope():
    model = conv()
model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
results["whole_line"] = [line for line in lines.lines if "/conv (Conv1D)" in line]
results["whole_diff"] = max(
    float(np.max(np.abs(a - b))) for a, b in zip(reference.get_weights(), model.get_weights())
)
results["whole_parts"] = [list(p.shape) for p in model.get_layer("conv").kernel._value.values]


# Keras's own mesh and layout classes, and ReversibleEmbedding's tied logits, in a subclassed
# model: vocabulary-parallel both ways.
class TiedLM(keras.Model):
    def __init__(self):
        super().__init__()
        self.tokens = keras.layers.ReversibleEmbedding(32, 8, tie_weights=True, name="tokens")
        self.mix = keras.layers.Dense(8, activation="tanh", name="mix")

    def call(self, ids):
        return self.tokens(self.mix(self.tokens(ids)), reverse=True)


def tied():
    keras.utils.set_random_seed(3)
    model = TiedLM()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model(np.zeros((1, 5), "int32"))
    return model


ids = rng.integers(0, 32, size=(24, 5)).astype("int32")
reference = tied()
reference.fit(ids, np.roll(ids, -1, 1), batch_size=8, epochs=2, shuffle=False, verbose=0)
mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
layout = keras.distribution.LayoutMap(mesh)
layout[".*tokens/embeddings"] = ("model", None)
lines.lines.clear()
with tfstrat.ModelParallel(layout_map=layout, batch_dim_name="batch").scope():
    model = tied()
model.fit(ids, np.roll(ids, -1, 1), batch_size=8, epochs=2, shuffle=False, verbose=0)
results["tied_line"] = [line for line in lines.lines if "(ReversibleEmbedding)" in line]
results["tied_diff"] = max(
    float(np.max(np.abs(a - b))) for a, b in zip(reference.get_weights(), model.get_weights())
)
results["tied_parts"] = [list(p.shape) for p in model.tokens._embeddings._value.values]


# A Sequential without an Input, built by its first call (column then row), a metric that
# counts rows (each slice of the batch once), and predict of a model with two inputs.
class Rows(keras.metrics.Metric):
    def __init__(self, name="rows"):
        super().__init__(name=name)
        self.n = self.add_variable(shape=(), initializer="zeros", aggregation="sum", name="n")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.n.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

    def result(self):
        return self.n


def lazy():
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [keras.layers.Dense(16, name="up"), keras.layers.Dense(3, name="down")]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=[Rows()])
    return model


xs, ys = rng.normal(size=(20, 6)).astype("float32"), rng.normal(size=(20, 3)).astype("float32")
reference = lazy()
reference.fit(xs, ys, batch_size=8, epochs=2, shuffle=False, verbose=0)
mesh = tfstrat.DeviceMesh((1, 2), ["batch", "model"], devices=TWO)
layout = tfstrat.LayoutMap(mesh)
layout[".*up/kernel"] = (None, "model")
layout[".*down/kernel"] = ("model", None)
with tfstrat.ModelParallel(layout_map=layout).scope():
    model = lazy()
model.fit(xs, ys, batch_size=8, epochs=2, shuffle=False, verbose=0)
results["lazy_diff"] = max(
    float(np.max(np.abs(a - b))) for a, b in zip(reference.get_weights(), model.get_weights())
)
results["lazy_shapes"] = [list(w.shape) for w in model.weights]
results["rows_counted"] = [
    reference.evaluate(xs, ys, batch_size=8, verbose=0, return_dict=True)["rows"],
    model.evaluate(xs, ys, batch_size=8, verbose=0, return_dict=True)["rows"],
]


def two_inputs():
    keras.utils.set_random_seed(5)
    a, b = keras.Input((3,)), keras.Input((4,))
    h = keras.layers.Dense(8, name="both")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], keras.layers.Dense(2, name="out")(h))
    model.compile(optimizer="sgd", loss="mse")
    return model


pair = (rng.normal(size=(10, 3)).astype("float32"), rng.normal(size=(10, 4)).astype("float32"))
layout = tfstrat.LayoutMap(mesh)
layout["both/kernel"] = (None, "model")
reference = two_inputs()
with tfstrat.ModelParallel(layout_map=layout).scope():
    model = two_inputs()
expected = reference.predict(pair, batch_size=4, verbose=0)
got = model.predict(pair, batch_size=4, verbose=0)
results["two_inputs_predict"] = [list(got.shape), float(np.max(np.abs(expected - got)))]


# A self-attention layer split by heads: its query, key and value projections read the same
# input, so their gradients meet on each device and cross the model axis in one sum.
def attention():
    keras.utils.set_random_seed(6)
    x = keras.Input((4, 8))
    h = keras.layers.Dense(8, name="before")(x)  # so that the input's gradient is needed
    model = keras.Model(x, keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h))
    model.compile(optimizer="sgd", loss="mse")
    return model


layout = tfstrat.LayoutMap(mesh)
layout["attention/(query|key|value)/kernel"] = (None, "model", None)
layout["attention/(query|key|value)/bias"] = ("model", None)
layout["attention/attention_output/kernel"] = ("model", None, None)
strategy = tfstrat.ModelParallel(layout_map=layout)
with strategy.scope():
    model = attention()
traffic = strategy.extended._cross_device_ops.traffic
traffic.start()
rows = rng.normal(size=(6, 4, 8)).astype("float32")
model.fit(rows, rows, batch_size=6, epochs=1, verbose=0)
# one step on (1, 2): bytes one device sends, and the size of the layer's input and output
results["attention_model_axis"] = [traffic.read()["model axis"], rows.size * 4]

with open(OUT, "w") as f:
    json.dump(results, f)
