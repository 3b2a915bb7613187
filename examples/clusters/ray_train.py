"""Ray Train running a tfstrat strategy: Ray starts the workers and writes their TF_CONFIG.

    python examples/clusters/ray_train.py --workers 2   # on a Ray cluster, or a local ray.init()

Ray's `TensorflowTrainer` sets TF_CONFIG in every training worker before the loop runs:
`{"cluster": {"worker": ["10.0.0.5:41231", "10.0.0.6:38877"]}, "task": {"type": "worker",
"index": 1}}`, workers only (so CollectiveAllReduce, or Hybrid without ps tasks), each at its
node's IP and a port Ray found free there (it binds port 0). tfstrat reads that TF_CONFIG as it
is: create the strategy first thing in the loop.

Port caveat: tfstrat's ring listens on each worker's port + 1 (`TFSTRAT_PORT_OFFSET`), a port
Ray did not reserve. If another socket holds it, that worker's ring listens on a free port
instead (its peers learn the port at start) and logs "worker:1: its ring port 38878 (TF_CONFIG
port + 1) is in use, so the ring listens on ... instead". With a firewall between the Ray nodes
those random ports cannot be declared; `--declared-ports 2222` rewrites Ray's TF_CONFIG to fixed ports (see
`declared_ports`): each worker at P, P + 2, ... of its node and its ring on the port above, so
a rule opening P..P+2K-1/tcp (K workers per node) between the nodes is enough.
"""

from __future__ import annotations

import argparse
import json
import os


def declared_ports(tf_config: str, port: int) -> str:
    """Ray's TF_CONFIG with fixed ports: the k-th worker on a host gets port + 2k (and its
    tfstrat ring port + 2k + 1). Every worker computes the same from the same list.

    Example:
        >>> ray = {"cluster": {"worker": ["10.0.0.5:41231", "10.0.0.6:38877", "10.0.0.5:40001"]},
        ...        "task": {"type": "worker", "index": 2}}
        >>> json.loads(declared_ports(json.dumps(ray), 2222))["cluster"]["worker"]
        ['10.0.0.5:2222', '10.0.0.6:2222', '10.0.0.5:2224']
    """
    config = json.loads(tf_config)
    seen: dict[str, int] = {}
    workers = []
    for address in config["cluster"]["worker"]:
        host = address.rsplit(":", 1)[0]
        workers.append(f"{host}:{port + 2 * seen.get(host, 0)}")
        seen[host] = seen.get(host, 0) + 1
    config["cluster"]["worker"] = workers
    return json.dumps(config)


def train_loop_per_worker(config: dict) -> None:
    if config.get("declared_ports"):
        os.environ["TF_CONFIG"] = declared_ports(os.environ["TF_CONFIG"], config["declared_ports"])

    import tfstrat

    strategy = tfstrat.CollectiveAllReduce()  # reads TF_CONFIG; before any other TensorFlow op

    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 32)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(x, y, batch_size=256, epochs=config.get("epochs", 3), verbose=0)

    from ray import train

    train.report({"accuracy": float(history.history["accuracy"][-1])})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--declared-ports", type=int, default=0, metavar="P")
    args = parser.parse_args()

    from ray.train import ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config={"epochs": args.epochs, "declared_ports": args.declared_ports},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
    )
    print(trainer.fit().metrics)


if __name__ == "__main__":
    main()
