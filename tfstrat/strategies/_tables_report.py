"""Hybrid's account of its embedding tables: where each one lives and how its gradient travels.

Where a table lives is decided when its layer is built (`Hybrid.remote_table`, and
`tfstrat.keras._ps_tables.mirror` for a table found to be read whole), and how a mirrored
table's gradient is reduced by its type, known only once the first step is traced. So Hybrid
says it per table, once, when the first training step is traced.
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat.reduce import sparse as _sparse


def _kind(layer) -> str:
    """The layer's class as its user knows it: keras.layers.Embedding, keras_hub.X, ..."""
    cls = type(layer)
    package = cls.__module__.split(".")[0]
    if package == "tfstrat":
        return f"tfstrat.keras.layers.{cls.__name__}"
    if package == "keras":
        return f"keras.layers.{cls.__name__}"
    return f"{package}.{cls.__name__}"


def _head(layer) -> str:
    return f"table {layer.name} ({layer.input_dim} x {layer.output_dim}, {_kind(layer)})"


def _how_to_ps(strategy, layer, why: str | None, grad) -> str:
    if not strategy.ps_addresses:
        return "To put it on the ps: start ps tasks (`tfstrat launch --ps 1`, or ps tasks in TF_CONFIG)."
    if why and "sparse=" in why:
        return f"To put it on the ps: let Hybrid(sparse=[...]) match {layer.name!r}."
    if why and "regularizer" in why:
        return "To put it on the ps: drop its embeddings_regularizer."
    if grad is not None and not isinstance(grad, tf.IndexedSlices):
        return "A table with a dense gradient is all-reduced; only a sparse one can go to the ps."
    return ""


def _mirrored_line(strategy, layer, why: str | None, grad) -> str:
    head = f"{_head(layer)}: mirrored on every worker ({why or 'not placed by Hybrid'})"
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
        how = f"dense gradient, all-reduced whole ({nbytes:,} bytes per step)"
    fix = _how_to_ps(strategy, layer, why, grad)
    return f"{head}; {how}." + (f" {fix}" if fix else "")


def _ps_line(strategy, layer, table) -> str:
    devices = table.devices
    tasks = sorted({d.split("/task:")[1].split("/")[0] for d in devices}, key=int)
    return (
        f"{_head(layer)}: on ps {', '.join(tasks)} in {len(devices)} part(s), no copy on the "
        "workers; the batch's rows are fetched from the ps and their gradient, summed per id, "
        "is pushed there and applied row by row."
    )


def lines(strategy, model, grads_by_path: dict) -> tuple[list[str], set[str]]:
    """One line per Embedding layer of `model`, in layer order, and the mirrored tables' paths."""
    import keras

    from tfstrat.keras._ps_tables import remote, table_path

    out, paths = [], set()
    flatten = getattr(model, "_flatten_layers", None)
    for layer in flatten() if flatten else ():
        if not isinstance(layer, keras.layers.Embedding) or not layer.built:
            continue
        table = remote(layer)
        if table is not None:
            out.append(_ps_line(strategy, layer, table))
            continue
        variable = getattr(layer, "_embeddings", None)
        path = getattr(variable, "path", table_path(layer))
        paths.add(path)
        why = strategy.mirrored_why.get(table_path(layer))
        out.append(_mirrored_line(strategy, layer, why, grads_by_path.get(path)))
    return [f"tfstrat: Hybrid {line}" for line in out], paths
