"""ParameterServer(mode="async"): each worker's own gradients reach the ps (run by
`tfstrat launch --workers 2 --ps 1`), or the reference (`--reference`, one process).

Usage: python ps_async_rows.py OUT [--reference]

A table of 20 rows of one number, each output the row its id picks (Embedding then Flatten, MSE,
SGD without momentum): an update moves only the rows its batch looks up. Worker w trains on
rows [4w, 4w + 4) of each global batch of 8 (the strategy's split), and worker 0's rows look
up ids 0-9 only, worker 1's ids 10-19: each half of the table is moved by one worker's
gradients alone, and no update reads the other half. So however the two workers' steps
interleave, the ps's table must end as one device training on worker 0's rows gives ids 0-9
and on worker 1's rows gives ids 10-19. A ps that dropped a worker's updates, or applied one
worker's gradient twice, leaves that half elsewhere; `iterations` counts updates, not what they
applied.

Each worker waits (up to 120 s) until the ps has counted both workers' steps, then writes
OUT/<task>.npz (the table). --reference writes OUT/reference.npz: the tables of one device
trained on each worker's rows alone (`worker_0`, `worker_1`).
"""

import os
import sys
import time

import numpy as np

REFERENCE = "--reference" in sys.argv
OUT = sys.argv[1]
GLOBAL, EPOCHS, BATCHES, IDS, SEQ = 8, 2, 10, 20, 3
LR = 0.1

import tfstrat  # noqa: E402

strategy = None if REFERENCE else tfstrat.ParameterServer(mode="async", timeout=60)

import keras  # noqa: E402


def data():
    """Global batches of 8: rows 0-3 look up ids 0-9 (worker 0's), rows 4-7 ids 10-19."""
    rng = np.random.default_rng(0)
    x = np.empty((BATCHES * GLOBAL, SEQ), "int32")
    for b in range(BATCHES):
        x[b * GLOBAL : b * GLOBAL + 4] = rng.integers(0, 10, size=(4, SEQ))
        x[b * GLOBAL + 4 : (b + 1) * GLOBAL] = rng.integers(10, 20, size=(4, SEQ))
    return x, rng.normal(size=(len(x), SEQ)).astype("float32")


def build():
    model = keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(
                IDS,
                1,
                name="table",
                embeddings_initializer=keras.initializers.RandomUniform(-1, 1, seed=3),
            ),
            keras.layers.Flatten(),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    return model


x, y = data()
if REFERENCE:
    tables = {}
    for w in (0, 1):
        mine = np.concatenate([np.arange(b * GLOBAL + 4 * w, b * GLOBAL + 4 * w + 4)
                               for b in range(BATCHES)])  # fmt: skip
        model = build()
        model.fit(x[mine], y[mine], batch_size=4, epochs=EPOCHS, shuffle=False, verbose=0)
        tables[f"worker_{w}"] = model.get_layer("table").get_weights()[0]
    np.savez(os.path.join(OUT, "reference.npz"), **tables)
    sys.exit(0)

with strategy.scope():
    model = build()
model.fit(x, y, batch_size=GLOBAL, epochs=EPOCHS, shuffle=False, verbose=0)
steps = 2 * EPOCHS * BATCHES  # both workers' updates
deadline = time.monotonic() + 120
while int(model.optimizer.iterations.numpy()) < steps:
    if time.monotonic() > deadline:
        raise SystemExit(
            f"{os.environ['TFSTRAT_TASK']}: the ps counted "
            f"{int(model.optimizer.iterations.numpy())} of {steps} updates after 120 s"
        )
    time.sleep(0.1)
task = os.environ["TFSTRAT_TASK"].replace(":", "_")
np.savez(
    os.path.join(OUT, f"{task}.npz"),
    table=model.get_layer("table").get_weights()[0],
    iterations=int(model.optimizer.iterations.numpy()),
)
