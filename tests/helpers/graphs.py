"""What a model's traced training step holds, read from its graph: which TensorFlow collectives
it runs (and over what: "ring", "nccl"; NCCL all-reduces among one process's GPUs) and where its
gradient ops are placed."""

from __future__ import annotations

from collections import Counter


def _tf_functions(fn, seen: set, depth: int = 0) -> list:
    """The `tf.function`s behind `fn` (Keras wraps its traced step in plain closures)."""
    if id(fn) in seen or depth > 6:
        return []
    seen.add(id(fn))
    if hasattr(fn, "_list_all_concrete_functions"):
        return [fn]
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(inner):
            found += _tf_functions(inner, seen, depth + 1)
    return found


def step_nodes(model) -> list:
    """Every node of every traced graph of `model.train_function`, nested functions included
    (a `tf.cond`'s branches, a while loop's body)."""
    nodes = []
    for function in _tf_functions(model.train_function, set()):
        for concrete in function._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            nodes += list(graph.node)
            nodes += [n for f in graph.library.function for n in f.node_def]
    return nodes


def summary(model) -> dict:
    """{"hints": {communication hint: collective reduce ops}, "gradient_devices": [...]}."""
    nodes = step_nodes(model)
    hints = Counter(
        n.attr["communication_hint"].s.decode() or "auto"
        for n in nodes
        if n.op.startswith("CollectiveReduce") and "communication_hint" in n.attr
    )
    devices = {n.device for n in nodes if "gradient" in n.name.lower() and n.device}
    nccl = sum(n.op == "NcclAllReduce" for n in nodes)  # ModelParallel's model-axis sums
    names = sorted(n.name for n in nodes if n.op.startswith("Collective"))
    return {
        "hints": dict(hints),
        "gradient_devices": sorted(devices),
        "nccl_all_reduce": nccl,
        "collectives": names,
    }
