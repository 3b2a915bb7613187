"""Compressed gradients for slow links: `compression="fp16" | "bf16" | "powersgd"`.

Lossy by design, for workers joined by a link slower than their compute (1 Gbit/s between
machines); only a step's dense gradients are compressed. The step's extras (row counts, stop
flags, metric states) and sparse gradients (an embedding table's rows, gathered or on a ps
task) stay exact, and every worker gets the same bits, so the weights stay identical.

- **"fp16" / "bf16"**: each worker rounds its gradients to 16 bits (round to nearest even), the
  workers all-gather the rounded vectors, and each sums them in float32 in rank order: the
  result is the float32 all-reduce of the rounded gradients. Bytes per worker: (n - 1) / 2 of
  the float32 vector, against the float32 ring's 2 (n - 1) / n: half at 2 workers, three
  quarters at 3, the same at 4 (use PowerSGD there). "fp16" keeps more mantissa (10 bits) but
  turns values beyond +-65,504 into inf and flushes below about 6e-8 to zero (a
  LossScaleOptimizer skips a step that would overflow the wire on every worker:
  `tfstrat.keras._loss_scale`); "bf16" keeps float32's range with 7 bits of mantissa.
- **"powersgd"** (`PowerSGD(rank=4)`; Vogels et al., 2019): each gradient matrix M (a kernel
  seen as `(prod(shape[:-1]), shape[-1])`) travels as two thin factors. With error feedback e
  (this worker's share of what earlier steps' approximations left out, kept on the worker):

      M_i = G_i + e_i                         every worker i, its own gradient G_i
      P = sum_i M_i Q;  P^ = orthonormal(P)   one exchange of every matrix's P (n x r)
      Q = sum_i M_i^T P^                      a second exchange of every Q (m x r)
      approximation = P^ Q^T                  the same bits on every worker
      e_i = M_i - approximation / n

  Q starts from a fixed random matrix (`initial_q`) and is reused from step to step (warm
  start). Matrices too small to gain (n m < `min_ratio` r (n + m)) and vectors go exactly,
  with the first exchange. Bytes per matrix: r (n + m) floats against n m.

  A model's first `warmup_steps` steps (100 by default) go exact, as one all-reduce of the
  gradients then the exact vector: the same bits as `compression=None`. The warm-up counts the
  optimizer's steps (`iterations`, saved with the model), so a run resumed past it compresses
  from its first step.

The state (error feedback and Q) is kept per set of variables (a new model, even of the same
shapes, starts afresh) in the worker's memory, not in checkpoints: a run resumed from a backup
starts it afresh (the first steps after it differ from an uninterrupted run's).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np

from tfstrat.errors import UsageError
from tfstrat.reduce.ring import Results

ROUNDING = {"fp16": "float16", "bf16": "bfloat16"}
WARMUP_STEPS = 100  # PowerSGD's exact first steps, by default


@dataclass(frozen=True)
class PowerSGD:
    """PowerSGD compression: every large gradient matrix sent as two rank-`rank` factors,
    with error feedback.

    Args:
        rank: the factors' width r; more is closer to the exact gradient and sends more.
        min_ratio: compress a matrix only if it shrinks at least this many times
            (n m >= min_ratio r (n + m)); smaller ones, and vectors, go exactly.
        warmup_steps: the model's first steps go exact (the same bits as `compression=None`),
            as PyTorch's PowerSGD hook runs plain all-reduces for its first
            `start_powerSGD_iter` steps: early gradients change fast, and an approximation
            of them costs accuracy that later steps do not win back soon. Counted on the
            optimizer's `iterations`: a run resumed past them compresses at once. 0: none.
    """

    rank: int = 4
    min_ratio: float = 2.0
    warmup_steps: int = WARMUP_STEPS

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise UsageError(f"Received: PowerSGD(rank={self.rank!r}). Use an integer >= 1.")
        steps = self.warmup_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise UsageError(
                f"Received: PowerSGD(warmup_steps={steps!r}). Use an integer >= 0 (0: compress "
                "from the first step)."
            )
        if not self.min_ratio >= 1.0:
            raise UsageError(
                f"Received: PowerSGD(min_ratio={self.min_ratio!r}). Use a number >= 1."
            )

    def compresses(self, shape) -> bool:
        """Whether a gradient of `shape` travels as factors."""
        if len(shape) < 2:
            return False
        n, m = matrix_shape(shape)
        return n * m >= self.min_ratio * self.rank * (n + m)


def parse(compression) -> str | PowerSGD | None:
    """None, "fp16", "bf16" or a `PowerSGD` from what a user passed."""
    if compression is None or isinstance(compression, PowerSGD):
        return compression
    if compression in ROUNDING:
        return compression
    if compression == "powersgd":
        return PowerSGD()
    raise UsageError(
        f"Received: compression={compression!r}. Use None, 'fp16', 'bf16', 'powersgd' or "
        "tfstrat.PowerSGD(rank=...)."
    )


def describe(compression) -> str:
    """How start-up lines and the workers' agreement name it."""
    if isinstance(compression, PowerSGD):
        c = compression
        return f"powersgd(rank={c.rank}, min_ratio={c.min_ratio}, warmup_steps={c.warmup_steps})"
    return str(compression)


def matrix_shape(shape) -> tuple[int, int]:
    """A kernel as PowerSGD's matrix: every axis but the last as rows."""
    n = int(np.prod(shape[:-1], dtype=np.int64))
    return n, int(shape[-1])


def initial_q(index: int, columns: int, rank: int) -> np.ndarray:
    """Q of the `index`-th compressed matrix before its first step: the same on every worker."""
    return np.random.default_rng(index).standard_normal((columns, rank)).astype(np.float32)


FLOAT16_MAX = 65504.0


def overflows_the_wire(grads, scale):
    """Under `compression="fp16"`: whether any of this replica's dense gradients, divided by
    `scale` (a LossScaleOptimizer's) and weighted by its rows as the step's all-reduce sends
    them (`tfstrat.strategies._exact_step.step_reduce`), is beyond float16's range, which the
    wire would turn into inf after the loss scale's finite check (a bool tensor). None under
    any other compression or none.

    The check is a little stricter than the wire (inf from 65,520 up): the same value computed
    in another order cannot pass here and overflow there."""
    import tensorflow as tf

    from tfstrat.reduce import sparse
    from tfstrat.runtime.step import _step

    sparse_ = lambda g: isinstance(g, tf.IndexedSlices)  # noqa: E731 - rows stay exact
    strategy = tf.distribute.get_strategy()
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    if getattr(ops, "compression", None) != "fp16":
        return None
    dense = [g / tf.cast(scale, g.dtype) for g in grads if g is not None and not sparse_(g)]
    if _step.scaled and _step.rows is not None:  # as the step weights them
        dense = [sparse.scale(g, _step.rows * strategy.num_replicas_in_sync) for g in dense]
    if not dense:
        return None
    largest = tf.reduce_max([tf.reduce_max(tf.abs(tf.cast(g, tf.float32))) for g in dense])
    return largest > FLOAT16_MAX


# -- which tensors are gradients -------------------------------------------------------------

# The dense gradients of the step being reduced (`mark`), by tensor reference, each with its
# variable's token: only they are compressed (any other all-reduce, such as the extras, metrics
# and batch statistics, stays exact), and PowerSGD keeps its state per set of variables.
_marked: dict = {}
_steps: dict = {}  # gradient ref -> the optimizer's iterations variable
_lock = threading.Lock()
_tokens = itertools.count()


def token(variable) -> int:
    """A number naming `variable` for as long as it lives (ids can be reused)."""
    found = getattr(variable, "_tfstrat_compression_token", None)
    if found is None:
        found = next(_tokens)
        try:
            variable._tfstrat_compression_token = found
        except AttributeError:  # a variable that takes no attributes: its id
            return id(variable)
    return found


def mark(pairs, step=None) -> list:
    """Marks dense gradients to compress, `(gradient, variable)` pairs; returns the marks, for
    `forget` afterwards. `step`: the optimizer's iterations (a variable, checkpointed with the
    model), which PowerSGD's warm-up counts when given."""
    found = {g.ref(): token(v) for g, v in pairs}
    with _lock:
        _marked.update(found)
        if step is not None:
            _steps.update(dict.fromkeys(found, step))
    return list(found)


def forget(marks) -> None:
    with _lock:
        for m in marks:
            _marked.pop(m, None)
            _steps.pop(m, None)


def step_of(tensor):
    """The optimizer step `tensor` was marked with (`mark(..., step=)`), or None."""
    with _lock:
        return _steps.get(tensor.ref())


def marked(tensor) -> bool:
    with _lock:
        return tensor.ref() in _marked


def owner(tensor) -> int | None:
    """The token of the variable whose gradient `tensor` is (`mark`), or None."""
    with _lock:
        return _marked.get(tensor.ref())


# -- PowerSGD's two exchanges, in NumPy on each worker ------------------------------------------


class PowerSGDState:
    """One worker's PowerSGD for one list of gradient shapes: its error feedback and Qs.

    `exchange(ring, lossy, exact, gathers)` reduces a step: `lossy` is the compressible
    gradients flattened and concatenated (float32), `exact` a vector summed exactly (the other
    gradients and the extras, or None), `gathers` blocks of rows to all-gather. Returns
    (approximate sum of `lossy`, exact sum of `exact`, gathered blocks).
    """

    def __init__(self, config: PowerSGD, shapes: list[tuple[int, ...]]):
        self.config = config
        self.steps = 0  # exchanges made: the first `config.warmup_steps` go exact
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.factored = [config.compresses(s) for s in shapes]
        self.matrices = [matrix_shape(s) if f else None for s, f in zip(shapes, self.factored)]
        total = sum(self.sizes)
        self.error = np.zeros(total, np.float32)
        self.q = [
            initial_q(i, m[1], config.rank) if m else None for i, m in enumerate(self.matrices)
        ]
        #: Floats per step that go as factors (P and Q) and exactly, for byte counts.
        r = config.rank
        self.factor_floats = sum(r * (m[0] + m[1]) for m in self.matrices if m)
        self.exact_floats = sum(s for s, f in zip(self.sizes, self.factored) if not f)
        # Kept between steps: fresh memory of the model's size would be page-faulted in every
        # step. The result goes to TensorFlow without a copy (`ring.Results`).
        self._results = Results()
        self._scratch = np.empty(total, np.float32)

    def exchange(self, ring, lossy, exact, gathers, step=None):
        """`step`: the optimizer's steps before this one (checkpointed with the model: a run
        resumed past the warm-up does not warm up again); else the exchanges made here."""
        self.steps += 1
        done = self.steps - 1 if step is None else int(step)
        if done < self.config.warmup_steps:
            return self._exact(ring, lossy, exact, gathers)
        # A step's inf or NaN is handled below (its matrices start afresh): no warnings.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return self._exchange(ring, lossy, exact, gathers)

    def _exact(self, ring, lossy, exact, gathers):
        """A warm-up step: one exact sum of the gradients then `exact`, the vector
        `compression=None` sums (the gradients come first in a step's all-reduce)."""
        parts = [lossy] if exact is None else [lossy, exact.reshape(-1)]
        vector = np.concatenate(parts).astype(np.float32, copy=False)
        summed, gathered = ring.exchange(vector, gathers)
        out = self._results.get(lossy.shape, np.float32)
        out[:] = summed[: lossy.size]
        exact_sum = None if exact is None else np.array(summed[lossy.size :]).reshape(exact.shape)
        return out, exact_sum, gathered

    def _exchange(self, ring, lossy, exact, gathers):
        n = ring.size
        error = self.error
        error += lossy  # M_i = G_i + e_i, in place
        views = _split(error, self.sizes)
        fac = [k for k, m in enumerate(self.matrices) if m]  # the factored ones
        plain = [k for k, m in enumerate(self.matrices) if not m]
        mats = {k: views[k].reshape(self.matrices[k]) for k in fac}
        # First exchange: every P, the uncompressed gradients, and `exact`.
        ps = [mats[k] @ self.q[k] for k in fac]
        extra = [] if exact is None else [exact.reshape(-1)]
        outgoing = np.concatenate([p.reshape(-1) for p in ps] + [views[k] for k in plain] + extra)
        summed, gathered = ring.exchange(outgoing.astype(np.float32, copy=False), gathers)
        parts = _split(
            np.array(summed, copy=True),  # the ring's buffer is reused by the next call
            [p.size for p in ps] + [self.sizes[k] for k in plain] + [e.size for e in extra],
        )
        p_hats = [
            np.linalg.qr(part.reshape(p.shape))[0].astype(np.float32, copy=False)
            for part, p in zip(parts, ps)
        ]
        out = self._results.get(lossy.shape, np.float32)
        outs = _split(out, self.sizes)
        for k, part in zip(plain, parts[len(ps) :]):
            outs[k][:] = part
        exact_sum = None if exact is None else parts[-1].reshape(exact.shape)
        # Second exchange: every Q = M_i^T P^, summed; the approximation is P^ Q^T.
        reset = set()  # matrices whose sum was not finite: their state starts afresh
        if fac:
            qs = [mats[k].T @ p_hat for k, p_hat in zip(fac, p_hats)]
            q_sum, _ = ring.exchange(np.concatenate([q.reshape(-1) for q in qs]), [])
            for k, p_hat, part in zip(fac, p_hats, _split(q_sum, [q.size for q in qs])):
                q = part.reshape(-1, p_hat.shape[1]).copy()  # m x r
                np.matmul(p_hat, q.T, out=outs[k].reshape(self.matrices[k]))
                # The warm start of the next step; after an inf or NaN (the sum is the same on
                # every worker, so all decide alike), a fresh start rather than NaN for good.
                if np.isfinite(q).all():
                    self.q[k] = q
                else:
                    self.q[k] = initial_q(k, self.matrices[k][1], self.config.rank)
                    reset.add(k)
        # e_i = M_i - approximation / n: only the factored parts leave anything behind.
        scratch = _split(self._scratch, self.sizes)
        for k in fac:
            if k in reset:
                views[k][:] = 0.0
            else:
                np.divide(outs[k], n, out=scratch[k])
                views[k] -= scratch[k]
        for k in plain:
            views[k][:] = 0.0
        return out, exact_sum, gathered


def _split(vector: np.ndarray, sizes) -> list[np.ndarray]:
    """Consecutive views of `vector` of these sizes."""
    starts = np.cumsum([0, *sizes])
    return [vector[a:b] for a, b in zip(starts[:-1], starts[1:])]
