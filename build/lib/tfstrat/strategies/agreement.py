"""What every task of a cluster must agree on before its first step, and how to say where not.

Each task describes itself: the cluster in its TF_CONFIG, the strategy options that must be
equal everywhere, and the model's variables (name, shape, dtype) in creation order. Tasks
exchange descriptions (or their digests) through whatever channel their strategy has, and a
task whose description differs from the chief's fails every task with one line naming the
first difference, e.g.

    worker:1 has variable hidden/kernel of shape (20, 33); chief has (20, 32). Run the same
    model on every task.

Functions here are pure: the exchange belongs to each strategy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

_SAME_MODEL = "Run the same model code on every task."
_SAME_CLUSTER = "Give every task the same TF_CONFIG cluster (only 'task' differs)."
_SAME_OPTIONS = "Create the strategy with the same arguments on every task."


def describe(tf_config, variables: Iterable = (), options: Mapping[str, Any] | None = None) -> dict:
    """A JSON-able description of what must agree across tasks.

    Args:
        tf_config: a `tfstrat.TFConfig` (its cluster is described, not its task), or None.
        variables: Keras or TensorFlow variables in creation order, or (name, shape, dtype)
            tuples. A Keras variable is named by its `path` (e.g. 'dense/kernel').
        options: the strategy's arguments that must be equal on every task.

    Returns:
        `{"cluster": {job: [address, ...]}, "options": {...}, "variables": [[name, shape,
        dtype], ...]}`.
    """
    cluster = {} if tf_config is None else {k: list(v) for k, v in tf_config.cluster.items()}
    return {
        "cluster": cluster,
        "options": {k: _plain(v) for k, v in sorted((options or {}).items())},
        "variables": [_variable(v) for v in variables],
    }


def digest(desc: Mapping) -> str:
    """A short hash of a description: equal descriptions, equal digests."""
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def first_difference(mine: Mapping, theirs: Mapping, me: str, them: str) -> str | None:
    """One line naming the first item where `mine` (task `me`) differs from `theirs` (`them`).

    Cluster first, then options, then variables in order. None when they agree.
    """
    return (
        _cluster_difference(mine.get("cluster", {}), theirs.get("cluster", {}), me, them)
        or _options_difference(mine.get("options", {}), theirs.get("options", {}), me, them)
        or _variables_difference(mine.get("variables", []), theirs.get("variables", []), me, them)
    )


def _plain(value):
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _variable(v) -> list:
    if isinstance(v, (tuple, list)):
        name, shape, dtype = v
    else:
        name = getattr(v, "path", None) or v.name
        shape, dtype = v.shape, v.dtype
    name = str(name).removesuffix(":0")
    dims = [None if d is None else int(d) for d in _dims(shape)]
    return [name, dims, getattr(dtype, "name", None) or str(dtype)]


def _dims(shape) -> list:
    as_list = getattr(shape, "as_list", None)
    return as_list() if as_list is not None else list(shape)


def _shape(dims) -> str:
    return str(tuple(dims))


def _cluster_difference(mine, theirs, me, them):
    for job in sorted(set(mine) | set(theirs), key=_job_order):
        a, b = mine.get(job, []), theirs.get(job, [])
        if a != b:
            return f"{me} has {job} {a} in its TF_CONFIG cluster; {them} has {b}. {_SAME_CLUSTER}"
    return None


def _job_order(job: str):
    order = ("chief", "worker", "ps", "evaluator")
    return (order.index(job) if job in order else len(order), job)


def _options_difference(mine, theirs, me, them):
    for key in sorted(set(mine) | set(theirs)):
        if key in mine and key in theirs and mine[key] == theirs[key]:
            continue
        a = f"{key}={mine[key]!r}" if key in mine else f"no {key}"
        b = repr(theirs[key]) if key in theirs else f"no {key}"
        return f"{me} has {a}; {them} has {b}. {_SAME_OPTIONS}"
    return None


def _variables_difference(mine, theirs, me, them):
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a == b:
            continue
        (name_a, shape_a, dtype_a), (name_b, shape_b, dtype_b) = a, b
        if name_a != name_b:
            return (
                f"{me}'s variable {index} is {name_a} of shape {_shape(shape_a)}; {them}'s is "
                f"{name_b} of shape {_shape(shape_b)}. {_SAME_MODEL}"
            )
        if shape_a != shape_b:
            return (
                f"{me} has variable {name_a} of shape {_shape(shape_a)}; {them} has "
                f"{_shape(shape_b)}. {_SAME_MODEL}"
            )
        return f"{me} has variable {name_a} of dtype {dtype_a}; {them} has {dtype_b}. {_SAME_MODEL}"
    if len(mine) != len(theirs):
        longer, who = (mine, me) if len(mine) > len(theirs) else (theirs, them)
        name, shape, _ = longer[min(len(mine), len(theirs))]
        return (
            f"{me} has {len(mine)} variables; {them} has {len(theirs)}: the first extra one is "
            f"{who}'s {name} of shape {_shape(shape)}. {_SAME_MODEL}"
        )
    return None
