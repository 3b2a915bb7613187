"""Hybrid's account of its embedding tables: where each one lives and how its gradient travels.

Which tables go to the ps tasks is decided by the layer's class and `sparse=` (only
`tfstrat.keras.layers.Embedding` tables can live there), and how a mirrored table's gradient is
reduced by its type, known only once the first step is traced: an `Embedding` whose gradient
has a dense term (an `embeddings_regularizer`, the table used outside a lookup) is all-reduced
whole, every step. So Hybrid says it per table, once, when the first training step is traced.
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat.reduce import sparse as _sparse


def _shape(layer) -> str:
    return f"{layer.input_dim} x {layer.output_dim}"


def _is_tfstrat(layer) -> bool:
    from tfstrat.keras.layers import Embedding

    return isinstance(layer, Embedding)


def _kind(layer) -> str:
    return "tfstrat.keras.layers.Embedding" if _is_tfstrat(layer) else "keras.layers.Embedding"


def _dense_because(layer) -> str:
    if getattr(layer, "embeddings_regularizer", None) is not None:
        name = type(layer.embeddings_regularizer).__name__
        return f"embeddings_regularizer={name} adds a term for every row"
    return "the table is also used outside its lookup (or densified by a custom step)"


def _how_to_ps(strategy, layer, dense: bool) -> str:
    if not strategy.ps_addresses:
        fix = "start ps tasks (`tfstrat launch --ps 1`, or ps tasks in TF_CONFIG)"
        if not _is_tfstrat(layer):
            fix += " and use tfstrat.keras.layers.Embedding (same arguments)"
    elif _is_tfstrat(layer):
        fix = f"add a pattern that matches {layer.name!r} to Hybrid(sparse=[...])"
    else:
        fix = "use tfstrat.keras.layers.Embedding (same arguments)"
        if strategy.sparse != "auto":
            fix += f" and a pattern that matches {layer.name!r} in Hybrid(sparse=[...])"
    if dense:
        fix += (
            "; a ps-held table is updated row by row and takes no embeddings_regularizer, "
            "so drop it there"
        )
    return f"To put it on the ps: {fix}."


def _mirrored_line(strategy, layer, grad) -> str:
    head = f"table {layer.name} ({_shape(layer)}, {_kind(layer)}): mirrored on every worker"
    if not strategy.ps_addresses:
        why = "no ps tasks in TF_CONFIG"
    elif _is_tfstrat(layer):
        why = f"sparse={strategy.sparse!r} does not name it"
    else:
        why = "only tfstrat.keras.layers.Embedding tables go to the ps tasks"
    if grad is None:
        how = "no gradient in this step"
    elif isinstance(grad, tf.IndexedSlices):
        rows, vocab = _sparse.static_rows(grad), _sparse.table_rows(grad)
        n = strategy.num_replicas_in_sync
        share = None if rows is None or vocab is None else min(1.0, n * rows / max(vocab, 1))
        threshold = strategy.density.threshold
        if (share is None and threshold == 0.0) or (share is not None and share >= threshold):
            how = "sparse gradient, all-reduced as dense (the replicas may touch "
            how += f"{'?' if share is None else f'{share:.0%}'} of its rows, sparse_as_dense "
            how += f"threshold {threshold:g})"
        else:
            how = "sparse gradient: deduplicated rows all-gathered"
    else:
        nbytes = layer.input_dim * layer.output_dim * grad.dtype.size
        how = (
            f"dense gradient, all-reduced whole ({nbytes:,} bytes per step), because "
            f"{_dense_because(layer)}"
        )
    dense = grad is not None and not isinstance(grad, tf.IndexedSlices)
    return f"{head} ({why}); {how}. {_how_to_ps(strategy, layer, dense)}"


def _ps_line(strategy, layer, table) -> str:
    devices = table.devices
    tasks = sorted({d.split("/task:")[1].split("/")[0] for d in devices}, key=int)
    line = (
        f"table {layer.name} ({_shape(layer)}, {_kind(layer)}): on ps {', '.join(tasks)} in "
        f"{len(devices)} part(s); the batch's rows are fetched from the ps and their gradient, "
        "summed per id, is pushed there and applied row by row"
    )
    if getattr(layer, "embeddings_regularizer", None) is not None:
        line += " (its embeddings_regularizer is not applied to a ps-held table)"
    return line + "."


def lines(strategy, model, grads_by_path: dict) -> tuple[list[str], set[str]]:
    """One line per Embedding layer of `model`, in layer order, and the tables' paths."""
    import keras

    out, paths = [], set()
    flatten = getattr(model, "_flatten_layers", None)
    for layer in flatten() if flatten else ():
        if not isinstance(layer, keras.layers.Embedding) or not layer.built:
            continue
        table = strategy.tables.get(f"{layer.name}/embeddings")
        if table is not None and getattr(layer, "_remote", None) is table:
            out.append(_ps_line(strategy, layer, table))
            continue
        variable = getattr(layer, "_embeddings", None)
        path = getattr(variable, "path", f"{layer.name}/embeddings")
        paths.add(path)
        out.append(_mirrored_line(strategy, layer, grads_by_path.get(path)))
    return [f"tfstrat: Hybrid {line}" for line in out], paths
