"""Chief-aware callbacks on a CollectiveAllReduce or ParameterServer cluster (`tfstrat launch`).

Usage: python callbacks_run.py DIR [collective|ps]
Run 1 trains 2 epochs with ModelCheckpoint, TensorBoard and BackupAndRestore writing under DIR;
run 2 (a fresh model, as after a restart) asks for 3 epochs and must resume after epoch 2.
"""

import json
import os
import sys

import tfstrat

if len(sys.argv) > 2 and sys.argv[2] == "ps":
    strategy = tfstrat.ParameterServer(timeout=60)
else:
    strategy = tfstrat.CollectiveAllReduce(timeout=60)

import keras  # noqa: E402
from common import build_model, compile_model, data, optimizer  # noqa: E402

from tfstrat.keras.callbacks import BackupAndRestore, ModelCheckpoint, TensorBoard  # noqa: E402

out = sys.argv[1]
x, y = data(24 * 10)


class Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(epoch)


runs = []
for epochs in (2, 3):
    with strategy.scope():
        model = compile_model(build_model(), optimizer("sgdm"))
    seen = Epochs()
    callbacks = [
        ModelCheckpoint(os.path.join(out, "ckpt", "e{epoch}.weights.h5"), save_weights_only=True),
        TensorBoard(os.path.join(out, "tb")),
        BackupAndRestore(os.path.join(out, "backup"), delete_checkpoint=False),
        seen,
    ]
    model.fit(x, y, batch_size=24, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    runs.append(seen.seen)
task = os.environ["TFSTRAT_TASK"].replace(":", "_")
with open(os.path.join(out, f"{task}.json"), "w") as f:
    json.dump({"epochs": runs, "weights0": model.weights[0].numpy().sum().item()}, f)
