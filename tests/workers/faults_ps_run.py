"""One worker of a ParameterServer fault test (started by hand or by `tfstrat launch`).

Usage (under TF_CONFIG):
    python faults_ps_run.py OUT stop MODE TIMEOUT   trains long; at batch 5 writes
                                                     OUT/<task>.running (the test then
                                                     SIGSTOPs ps:0)
    python faults_ps_run.py OUT model TIMEOUT        worker 1 builds Dense(33) as "hidden", the others
                                                     Dense(32)
    python faults_ps_run.py OUT cluster TIMEOUT      the same model; the test gives the tasks
                                                     different clusters
    python faults_ps_run.py OUT input                fit, evaluate and predict with a global
                                                     batch of 1 and with empty input; writes
                                                     OUT/<task>.json: each call's error (type,
                                                     message) or null
Prints "training finished" when `fit` returns.
"""

import json
import os
import sys

import tfstrat

out, scenario = sys.argv[1], sys.argv[2]
mode = sys.argv[3] if scenario == "stop" else "sync"
timeout = float(sys.argv[-1]) if scenario != "input" else 60
strategy = tfstrat.ParameterServer(mode=mode, timeout=timeout)

import keras  # noqa: E402
import numpy as np  # noqa: E402

task = os.environ["TFSTRAT_TASK"].replace(":", "_")


class MarkRunning(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5:
            open(os.path.join(out, f"{task}.running"), "w").close()


def build(units: int):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((20,)),
                keras.layers.Dense(units, name="hidden"),
                keras.layers.Dense(4, name="head"),
            ]
        )
        model.compile(optimizer="sgd", loss="mse")
    return model


rng = np.random.default_rng(0)
x, y = rng.normal(size=(480, 20)).astype("float32"), rng.normal(size=(480, 4)).astype("float32")
if scenario == "input":
    model = build(32)
    cases = {
        "fit_batch_1": lambda: model.fit(x[:8], y[:8], batch_size=1, verbose=0),
        "fit_empty": lambda: model.fit(x[:0], y[:0], batch_size=8, verbose=0),
        "fit_batch_8": lambda: model.fit(x[:48], y[:48], batch_size=8, verbose=0),
        "fit_batch_1_again": lambda: model.fit(x[:8], y[:8], batch_size=1, verbose=0),
        "evaluate_batch_1": lambda: model.evaluate(x[:8], y[:8], batch_size=1, verbose=0),
        "predict_one_row": lambda: model.predict(x[:1], verbose=0),
        "predict_empty": lambda: model.predict(x[:0], verbose=0),
    }
    errors = {}
    for case, call in cases.items():
        try:
            call()
            errors[case] = None
        except Exception as e:  # the test checks the type and the message
            errors[case] = [type(e).__name__, str(e)]
    with open(os.path.join(out, f"{task}.json"), "w") as f:
        json.dump(errors, f)
    raise SystemExit(0)

units = 33 if scenario == "model" and strategy.worker_index == 1 else 32
model = build(units)
epochs = 1000 if scenario == "stop" else 1
model.fit(x, y, batch_size=24, epochs=epochs, verbose=0, callbacks=[MarkRunning()])
print("training finished", flush=True)
