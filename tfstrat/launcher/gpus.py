"""Which GPUs each task `tfstrat launch` starts may use: its own `CUDA_VISIBLE_DEVICES`.

A process sees every GPU of its machine unless told otherwise, and TensorFlow reserves most of
the memory of every GPU it sees: several training tasks on one machine that all see all GPUs
fight over every card, and NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). So,
as torchrun, Horovod and SLURM's `SlurmClusterResolver` do, each training task (chief,
workers) gets its own GPUs, the same number each, and ps tasks (which hold variables and
tables on the host) get none. TensorFlow-free, like the rest of the launcher.

The GPUs to hand out: `gpus` when given (`--gpus 0,1,...`; `--gpus none` hides every GPU from
every task, for CPU training on a GPU host), else the launcher's own `CUDA_VISIBLE_DEVICES`
when set, else the NVIDIA driver's list (`/proc/driver/nvidia/gpus`); none found: nothing is
set and every task sees what the launcher sees. A task's GPUs are listed as the launcher knows
them (the indices or UUIDs of its `CUDA_VISIBLE_DEVICES`), so inside a restricted launcher they
stay inside its set. GPUs found (not named) that do not split evenly among the training tasks
are bound as many to each as go evenly, the rest unused, with a line that says so; fewer found
than training tasks are refused (two tasks on one card are never right: each TensorFlow
process takes most of its memory, and NCCL refuses two ranks on one GPU); named ones
(`--gpus`, `--gpus-per-task`) that do not split are refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tfstrat.errors import UsageError

_DRIVER = "/proc/driver/nvidia/gpus"


def available(
    gpus: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """The GPUs the launcher may hand out (see the module's docstring)."""
    if gpus is not None:
        return [str(g).strip() for g in gpus if str(g).strip()]
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [g.strip() for g in visible.split(",") if g.strip()]
        # CUDA stops at the first invalid entry; "-1" (or "") is the usual way to hide all.
        return [] if not ids or ids[0].startswith("-") else ids
    try:
        return [str(i) for i in range(len(os.listdir(_DRIVER)))]
    except OSError:
        return []


def bind(
    trainers: Sequence[str],
    gpus: Sequence[str],
    per_task: int | None = None,
    others: Sequence[str] = (),
) -> dict[str, str]:
    """{task name: its CUDA_VISIBLE_DEVICES} for the training tasks `trainers` and the ps
    tasks `others`; {} when there are no GPUs to hand out.

    Args:
        trainers: the chief and worker tasks this launcher starts, in order ("worker:0", ...).
        gpus: the GPUs to hand out (`available()`).
        per_task: GPUs per training task; None: all of them split evenly (refused when the
            count does not divide).
        others: tasks that get no GPU (ps tasks): an empty CUDA_VISIBLE_DEVICES.

    Raises:
        UsageError: naming the counts and the fix, when the GPUs cannot be split so.

    Example:
        >>> bind(["worker:0", "worker:1"], ["0", "1", "2", "3"], others=["ps:0"])
        {'worker:0': '0,1', 'worker:1': '2,3', 'ps:0': ''}
    """
    gpus = list(gpus)
    twice = sorted({g for g in gpus if gpus.count(g) > 1})
    if twice:
        raise UsageError(
            f"Received: GPUs {','.join(gpus)}, naming {','.join(twice)} more than once (two "
            "tasks on one card). Name each GPU once."
        )
    if per_task is not None and per_task < 1:
        raise UsageError(f"Received: gpus_per_task={per_task}. Use 1 or more (or leave it unset).")
    if not gpus:
        if per_task is not None:
            raise UsageError(
                f"Received: gpus_per_task={per_task}, but this launcher finds no GPU (no "
                "CUDA_VISIBLE_DEVICES, no NVIDIA driver). Name them with --gpus 0,1,..."
            )
        return {}
    if not trainers:
        return {name: "" for name in others}
    if per_task is None:
        if len(gpus) % len(trainers):
            fix = (
                f"--gpus-per-task {len(gpus) // len(trainers)} (or --gpus with a multiple of the "
                "task count)"
                if len(gpus) > len(trainers)
                else f"at most {len(gpus)} training task(s) here"
            )
            raise UsageError(
                f"Received: {len(gpus)} GPU(s) ({','.join(gpus)}) for {len(trainers)} training "
                f"task(s) on this machine, which does not split evenly. Give each task the "
                f"same number: {fix}; or --gpus none to train on the CPUs."
            )
        per_task = len(gpus) // len(trainers)
    if per_task * len(trainers) > len(gpus):
        raise UsageError(
            f"Received: gpus_per_task={per_task} for {len(trainers)} training task(s): "
            f"{per_task * len(trainers)} GPUs, but this launcher has {len(gpus)} "
            f"({','.join(gpus)}). Start fewer tasks or give fewer GPUs per task."
        )
    out = {
        name: ",".join(gpus[k * per_task : (k + 1) * per_task]) for k, name in enumerate(trainers)
    }
    out.update({name: "" for name in others})
    return out


def plan(
    trainers: Sequence[str],
    others: Sequence[str],
    gpus: Sequence[str] | None = None,
    per_task: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], str | None]:
    """(`bind`'s {task: CUDA_VISIBLE_DEVICES}, a line to print or None) for the launcher's
    flags: `gpus` None (found), [] or ["none"] (hide them all), or names.

    Raises:
        UsageError: named GPUs or `per_task` that cannot be split so.
    """
    if gpus is not None and [g.strip().lower() for g in gpus if g.strip()] in ([], ["none"]):
        return {name: "" for name in [*trainers, *others]}, None
    found = available(gpus, environ)
    if gpus is not None or per_task is not None:
        return bind(trainers, found, per_task, others), None
    if not found or not trainers or len(found) % len(trainers) == 0:
        return bind(trainers, found, None, others), None
    if len(found) < len(trainers):
        raise UsageError(
            f"Received: {len(trainers)} training task(s) on this machine, which has "
            f"{len(found)} GPU(s) ({','.join(found)}): each task needs GPUs of its own (two "
            "processes on one card: each TensorFlow process takes most of its memory, and "
            "NCCL refuses two ranks on one GPU). Start at most "
            f"{len(found)} training task(s) here, or pass --gpus none to train on the CPUs."
        )
    each = len(found) // len(trainers)
    binding = bind(trainers, found, each, others)
    unused = found[each * len(trainers) :]
    return binding, (
        f"{describe(binding)}; {len(found)} GPU(s) do not split evenly among "
        f"{len(trainers)} training task(s): {each} each, {','.join(unused)} unused "
        "(--gpus-per-task N or --gpus LIST chooses)"
    )


def uuids(environ: Mapping[str, str] | None = None, driver: str | None = None) -> list[str]:
    """The UUIDs of the GPUs this process's CUDA may use, in CUDA's order, read from the NVIDIA
    driver (`/proc/driver/nvidia/gpus/<PCI address>/information`, "GPU UUID: GPU-..."); []
    without the driver. `CUDA_VISIBLE_DEVICES` selects among them as CUDA does: indices (in
    PCI bus order, CUDA's order for identical cards), UUIDs or their unique prefixes, up to the
    first entry that names no GPU; unset, every GPU.

    Example:
        >>> uuids({"CUDA_VISIBLE_DEVICES": "1"}, "/nonexistent")
        []
    """
    environ = os.environ if environ is None else environ
    driver = _DRIVER if driver is None else driver
    try:
        cards = sorted(os.listdir(driver))
    except OSError:
        return []
    found = []
    for card in cards:
        try:
            with open(os.path.join(driver, card, "information"), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        ids = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("GPU UUID")]
        found.append(ids[0] if ids else f"PCI-{card}")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    chosen = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            match = [found[int(entry)]] if int(entry) < len(found) else []
        else:
            match = [u for u in found if entry and u.startswith(entry)]
        if len(match) != 1:  # CUDA stops at the first entry that names no (single) GPU
            break
        chosen += match
    return chosen


def shared(records: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """{GPU UUID: the tasks that see it} for every GPU that more than one task of `records`
    ({task: its GPUs' UUIDs}; UUIDs are unique to a card, so tasks of any machines) sees.

    Example:
        >>> shared({"worker:0": ["GPU-a", "GPU-b"], "worker:1": ["GPU-b"]})
        {'GPU-b': ['worker:0', 'worker:1']}
    """
    seen: dict[str, list[str]] = {}
    for task, ids in records.items():
        for uuid in dict.fromkeys(ids):
            seen.setdefault(uuid, []).append(task)
    return {uuid: tasks for uuid, tasks in seen.items() if len(tasks) > 1}


def sharing(records: Mapping[str, Sequence[str]]) -> str | None:
    """The refusal for training tasks (`records`: {task: its GPUs' UUIDs}, from `uuids` in
    each task) that see one GPU between them, naming the tasks and the card; None if none do.
    UUIDs are unique to a card, so the tasks of every machine are compared at once.

    Example:
        >>> print(sharing({"worker:0": ["GPU-a"], "worker:1": ["GPU-a"]}))
        worker:0 and worker:1 both see GPU GPU-a: two TensorFlow processes on one card fight \
over its memory and NCCL refuses them ("Duplicate GPU detected"). Give each task its own GPUs: \
`tfstrat launch` binds them (`--gpus 0,1,...`, or `--gpus none` to train on the CPU), or set \
each task's CUDA_VISIBLE_DEVICES to different GPUs.
        >>> sharing({"worker:0": ["GPU-a"], "worker:1": []}) is None
        True
    """
    both = shared(records)
    if not both:
        return None
    uuid, tasks = next(iter(both.items()))
    more = f" (and {len(both) - 1} more GPU(s))" if len(both) > 1 else ""
    return (
        f"{', '.join(tasks[:-1])} and {tasks[-1]} {'both' if len(tasks) == 2 else 'all'} see "
        f"GPU {uuid}{more}: two TensorFlow "
        'processes on one card fight over its memory and NCCL refuses them ("Duplicate GPU '
        'detected"). Give each task its own GPUs: `tfstrat launch` binds them (`--gpus '
        "0,1,...`, or `--gpus none` to train on the CPU), or set each task's "
        "CUDA_VISIBLE_DEVICES to different GPUs."
    )


def describe(binding: Mapping[str, str]) -> str:
    """One line for the launcher's start: who has which GPU."""
    parts = [f"{name} GPU {ids}" if ids else f"{name} none" for name, ids in binding.items()]
    return "tfstrat launch: GPUs (CUDA_VISIBLE_DEVICES): " + ", ".join(parts)
