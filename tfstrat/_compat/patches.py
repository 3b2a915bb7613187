"""Every change tfstrat makes to a class or module of Keras goes through `patch`: one list of
what is changed and why (`installed()`), one way back (`remove`, `remove_all`). So do the
two changes to TensorFlow: `ConcreteFunction._call_flat`, where the collectives' watchdog
times the eager calls of functions that run tfstrat's collectives
(`tfstrat.strategies._watchdog`), and `input_lib._calculate_replicas_with_values`, skipped for
input every worker slices alike (`tfstrat.strategies.collective._same_batches`).

tfstrat patches only what Keras offers no hook for (the loss scaling per replica, the fit
loop's epoch hooks, the savers, the trainer's step functions); each patch's `why` says what.
Patches are installed when the first strategy that needs them is created; the row-wise
optimizer steps (`tfstrat.keras._rowwise`, `TFSTRAT_ROWWISE=0` turns them off) when
`tfstrat.keras` is first imported, which the strategies do. Never at `import tfstrat`. After
`remove_all()`, the next strategy installs them again.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any


@dataclasses.dataclass
class Patch:
    owner: Any
    name: str
    original: Any
    why: str
    own: bool  # whether `owner` itself had the attribute (else it was inherited)

    @property
    def where(self) -> str:
        owner = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", "?")
        module = getattr(self.owner, "__module__", None)
        prefix = f"{module}." if module and module != owner else ""
        return f"{prefix}{owner}.{self.name}"


_patches: dict[tuple[int, str], Patch] = {}


def patch(owner: Any, name: str, replacement: Any, why: str) -> Any:
    """Sets `owner.name = replacement`; returns what was there before tfstrat's first patch of
    it (patching twice keeps that original).

    A Keras attribute must be a row of `surface.PATCHED`, whose signature `versions.check`
    verifies on the installed release."""
    key = (id(owner), name)
    if key not in _patches and _is_keras(owner):
        from tfstrat._compat import surface

        if not surface.listed(owner, name):
            raise AssertionError(
                f"tfstrat patches {owner!r}.{name}, which tfstrat._compat.surface.PATCHED "
                "does not list: add its row (the attribute and its signature)"
            )
    if key not in _patches:
        own = name in vars(owner)
        _patches[key] = Patch(
            owner, name, vars(owner)[name] if own else getattr(owner, name), why, own
        )
    setattr(owner, name, replacement)
    return _patches[key].original


def _is_keras(owner: Any) -> bool:
    module = owner.__name__ if inspect.ismodule(owner) else getattr(owner, "__module__", "")
    return str(module).split(".")[0] == "keras"


def original(owner: Any, name: str) -> Any:
    """Keras's own `owner.name` (the current one when tfstrat did not patch it)."""
    found = _patches.get((id(owner), name))
    return found.original if found else getattr(owner, name)


def is_patched(owner: Any, name: str) -> bool:
    return (id(owner), name) in _patches


def installed() -> list[str]:
    """ "module.Class.name: why" for every patch in place, in the order they were made."""
    return [f"{p.where}: {p.why}" for p in _patches.values()]


def remove(owner: Any, name: str) -> None:
    """Puts Keras's own `owner.name` back (nothing when it is not patched)."""
    found = _patches.pop((id(owner), name), None)
    if found is not None and found.own:
        setattr(owner, name, found.original)
    elif found is not None:
        delattr(owner, name)  # the inherited one shows again


def remove_all() -> None:
    """Every patch undone, the latest first."""
    for p in reversed(list(_patches.values())):
        remove(p.owner, p.name)
