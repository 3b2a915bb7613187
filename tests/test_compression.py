"""Compressed gradients (`compression=`): real workers through `tfstrat launch`, checked
against the same algorithms written out in NumPy.

Lossy by design, so not held to the single-device contract. Instead, every step of
tests/workers/compression_run.py is checked: each worker's recorded gradient against the
model's (x^T d from that step's weights and its rows), the exchange's result against the
algorithm (fp16/bf16: the float32 sum of each worker's rounded gradients, bit for bit;
PowerSGD: its error feedback and warm-started factors, to 1e-5, and two controls without them
that the check must reject), the workers' weights identical after every step, the optimizer
applying exactly that result to the kernel and the bias, the sparse table's rows and the logged
loss (the step's extras) exact, and the ring's measured bytes within what the method sends.
"""

import json
import re

import ml_dtypes
import numpy as np
import pytest
from cluster import RUN_TIMEOUT, launch_script

LR, BATCH, STEPS, RANK = 0.1, 16, 8, 2
WARMUP = {"powersgd": 0, "powersgd-warmup": 3}  # PowerSGD(warmup_steps=) of each method


def _initial_q(index, columns, rank):  # the documented start: the same on every worker
    return np.random.default_rng(index).standard_normal((columns, rank))


def _powersgd(raws, n, m, feedback=True, warm=True):
    """PowerSGD with error feedback (Vogels et al. 2019) on one matrix, every step:
    `raws[s][i]` is worker i's gradient at step s. Returns each step's approximate sum.
    `feedback=False` (no error feedback) and `warm=False` (a fresh Q each step) are the
    controls: the reference must tell them apart from the algorithm."""
    workers = len(raws[0])
    q = _initial_q(0, m, RANK)
    error = [np.zeros((n, m)) for _ in range(workers)]
    out = []
    for s, step in enumerate(raws):
        if not warm:
            q = _initial_q(s + 1, m, RANK)
        ms = [error[i] + step[i].reshape(n, m) for i in range(workers)]
        p_hat = np.linalg.qr(sum(mat @ q for mat in ms))[0]
        q = sum(mat.T @ p_hat for mat in ms)
        approx = p_hat @ q.T
        if feedback:
            error = [mat - approx / workers for mat in ms]
        out.append(approx.reshape(-1))
    return out


def _worker_rows(step, worker, workers):
    """The rows of the global batch of `step` that `worker` trains on (CollectiveAllReduce:
    [w*n//W, (w+1)*n//W) of each global batch of n rows)."""
    lo, hi = worker * BATCH // workers, (worker + 1) * BATCH // workers
    return slice(step * BATCH + lo, step * BATCH + hi)


def _rounded_sum(raws, wire):
    total = np.zeros_like(raws[0])
    for r in raws:  # in rank order, in float32
        total = total + r.astype(wire).astype(np.float32)
    return total


def _forward(x, ids, kernel, bias, table):
    return x @ kernel + bias + table[ids]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize(
    "method,workers,kind",
    [
        ("fp16", 2, "collective"),
        ("bf16", 3, "collective"),
        ("powersgd", 3, "collective"),
        ("powersgd", 2, "hybrid"),
        ("powersgd-warmup", 2, "collective"),
    ],
)
def test_compressed_training_is_the_algorithm_written_out(tmp_path, method, workers, kind):
    code, log = launch_script(
        "compression_run.py", str(tmp_path), method, kind, workers=workers,
        ps=1 if kind == "hybrid" else 0,
    )  # fmt: skip
    assert code == 0, log[-6000:]
    assert f"tfstrat: compression={method.split('-')[0]}" in log
    if method in WARMUP:
        assert f"warmup_steps={WARMUP[method]})" in log, log[-3000:]
    runs = [np.load(tmp_path / f"worker_{i}.npz") for i in range(workers)]
    reports = [json.loads((tmp_path / f"worker_{i}.json").read_text()) for i in range(workers)]
    first = runs[0]
    kernel_shape = first["w-1_kernel"].shape
    size = int(np.prod(kernel_shape))
    # The kernel, the bias and, under Hybrid, the table's anchor (a scalar whose gradient is 0)
    vectors = kernel_shape[1] + (1 if kind == "hybrid" else 0)
    assert first["raw"].shape == (STEPS, size + vectors)

    # 1. Every worker got the same bits, each step, and holds the same weights after it.
    for other in runs[1:]:
        assert np.array_equal(other["reduced"], first["reduced"])
        for key in first.files:
            if key.startswith("w"):
                assert np.array_equal(other[key], first[key]), key

    # 2. What each worker recorded is its gradient of the model at that step's weights: the
    #    sum over its rows of d(loss)/d(W) = x^T d and d(loss)/d(b) = d (the rows weighting
    #    makes each worker's share the sum over its rows, the all-reduce their total).
    x, ids, y = first["x"], first["ids"], first["y"]
    for s in range(STEPS):
        kernel, bias, table = (
            first[f"w{s - 1}_{k}"].astype(np.float64) for k in ("kernel", "bias", "table")
        )
        for i, run in enumerate(runs):
            rows = _worker_rows(s, i, workers)
            error = _forward(x[rows], ids[rows], kernel, bias, table) - y[rows]
            d = 2.0 / error.shape[1] * error  # per example: d(its loss)/d(output)
            expected = np.concatenate([(x[rows].T @ d).reshape(-1), d.sum(axis=0)])
            raw = run["raw"][s][: size + kernel_shape[1]]
            scale = np.abs(expected).max()
            assert np.abs(raw - expected).max() <= 1e-4 * scale, (s, i)
            if kind == "hybrid":
                assert run["raw"][s][-1] == 0.0  # the table's anchor: its gradient is 0

    # 3. The exchange is the algorithm written out, on those gradients: after the warm-up's
    #    exact steps (the float32 sum, as compression=None sums 2 workers: the same bits).
    raws = [[r["raw"][s] for r in runs] for s in range(STEPS)]
    warm = WARMUP.get(method, 0)
    for s in range(warm):
        assert np.array_equal(first["reduced"][s], raws[s][0] + raws[s][1]), s
    if method in WARMUP:
        matrices = [[g[:size] for g in step] for step in raws]
        factored = [None] * warm + _powersgd(matrices[warm:], *kernel_shape)
        bias = [np.sum([g[size:] for g in step], axis=0, dtype=np.float64) for step in raws]
        expected = [None if f is None else np.concatenate([f, b]) for f, b in zip(factored, bias)]
        for s in range(warm, STEPS):
            got = first["reduced"][s]
            scale = np.abs(expected[s]).max()
            assert np.abs(got - expected[s]).max() <= 1e-5 * scale, s
            # the bias (a vector) and the anchor go exactly
            np.testing.assert_allclose(got[size:], bias[s], rtol=1e-6, atol=1e-7)
        # Controls: without error feedback, or with a fresh Q each step, the reference would
        # differ from what the workers did by far more than the tolerance.
        for control in (dict(feedback=False), dict(warm=False)):
            other = [None] * warm + _powersgd(matrices[warm:], *kernel_shape, **control)
            worst = max(
                np.abs(first["reduced"][s][:size] - other[s]).max() / np.abs(other[s]).max()
                for s in range(warm + 1, STEPS)
            )
            assert worst > 1e-3, (control, worst)
        if kind == "collective":
            # A second model of the same shapes in the same strategy starts afresh: its own
            # warm-up, else the algorithm's first step (no error feedback of the first model's,
            # the initial Q). With a warm-up its optimizer starts at step 2 (as after a
            # restore): the warm-up counts the optimizer's steps, so step 2 is exact and step 3
            # is the algorithm's first (a count of its own would make both exact).
            second = [[r["second_raw"][s] for r in runs] for s in range(2)]
            exact_steps = max(0, warm - 2)
            for s in range(2):
                got = first["second_reduced"][s]
                assert all(np.array_equal(got, r["second_reduced"][s]) for r in runs[1:])
                if s < exact_steps:
                    assert np.array_equal(got, sum(second[s])), s
            begins = exact_steps  # the algorithm's first step, on a fresh state
            fresh = _powersgd([[g[:size] for g in second[begins]]], *kernel_shape)[0]
            got = first["second_reduced"][begins][:size]
            assert np.abs(got - fresh).max() <= 1e-5 * np.abs(fresh).max()
    else:
        wire = np.float16 if method == "fp16" else ml_dtypes.bfloat16
        for s in range(STEPS):
            assert np.array_equal(first["reduced"][s], _rounded_sum(raws[s], wire)), s
    exact = [np.sum(step, axis=0, dtype=np.float64) for step in raws]
    off = max(np.abs(first["reduced"][s] - exact[s]).max() / np.abs(exact[s]).max()
              for s in range(warm, STEPS))  # fmt: skip
    assert off > 1e-4, off  # it did compress

    # 4. The optimizer applied that result to the kernel and the bias, and the table's rows
    #    and the loss stay exact.
    running = []
    for s in range(STEPS):
        kernel, bias, table = (
            first[f"w{s - 1}_{k}"].astype(np.float64) for k in ("kernel", "bias", "table")
        )
        rows = slice(s * BATCH, (s + 1) * BATCH)
        reduced = first["reduced"][s].astype(np.float64) / BATCH
        step_kernel = first[f"w{s}_kernel"] - first[f"w{s - 1}_kernel"]
        np.testing.assert_allclose(
            step_kernel, -LR * reduced[:size].reshape(kernel_shape), rtol=1e-4, atol=1e-7
        )
        step_bias = first[f"w{s}_bias"] - first[f"w{s - 1}_bias"]
        np.testing.assert_allclose(
            step_bias, -LR * reduced[size : size + kernel_shape[1]], rtol=1e-4, atol=1e-7
        )
        error = _forward(x[rows], ids[rows], kernel, bias, table) - y[rows]
        d = 2.0 / error.shape[1] * error / BATCH  # d(mean loss)/d(output)
        table_grad = np.zeros_like(table)
        np.add.at(table_grad, ids[rows], d)
        np.testing.assert_allclose(
            first[f"w{s}_table"], table - LR * table_grad, rtol=1e-5, atol=1e-7
        )
        running.append(float(np.mean(error**2)))
        assert abs(first["losses"][s] - np.mean(running)) <= 1e-5 * np.mean(running), s

    # 5. Measured on the ring: what the method sends for the dense gradients, derived (at
    #    least that), plus at most what goes exactly in any case (the sparse table's rows, the
    #    step's extras, frame headers).
    if warm:
        return  # bytes averaged over exact and compressed steps: the cases above check both
    floats = first["raw"].shape[1]
    if method == "powersgd":  # P (n x r) and Q (m x r) all-reduced, the vectors exactly
        n, m = kernel_shape
        share = 1.0 if workers == 2 else 2 * (workers - 1) / workers  # of an all-reduce
        dense = share * 4 * ((n + m) * RANK + vectors)
    else:  # every float in 2 bytes, all-gathered: this worker's block to W - 1 others
        dense = 2 * floats * (workers - 1)
    rest = (BATCH // workers + 1) * (kernel_shape[1] + 2) * 4 * (workers - 1) + 512
    sent = reports[0]["bytes_per_step"]
    assert dense <= sent <= dense + rest, (sent, dense, rest)


@pytest.mark.parametrize(
    "value,words",
    [
        ("fp8", "Received: compression='fp8'. Use None, 'fp16', 'bf16', 'powersgd'"),
        ("PowerSGD(rank=0)", "Received: PowerSGD(rank=0). Use an integer >= 1."),
        ("PowerSGD(min_ratio=0.5)", "Received: PowerSGD(min_ratio=0.5). Use a number >= 1."),
        ("PowerSGD(warmup_steps=-1)", "Received: PowerSGD(warmup_steps=-1). Use an integer >= 0"),
    ],
)
def test_bad_compression_names_the_value_and_the_fix(value, words):
    import tfstrat
    from tfstrat.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(words)):
        compression = eval(value, {"PowerSGD": tfstrat.PowerSGD}) if "(" in value else value
        tfstrat.CollectiveAllReduce(compression=compression)


def test_compression_without_the_tcp_ring_is_refused_before_anything_starts():
    import tfstrat
    from tfstrat.errors import UsageError

    config = tfstrat.TFConfig.from_hosts(
        worker=["127.0.0.1:1", "127.0.0.1:2"], task_type="worker", task_index=0
    )
    with pytest.raises(UsageError, match="Compressed gradients travel on tfstrat's TCP ring"):
        tfstrat.CollectiveAllReduce(config, compression="bf16", communication="ring")


def test_powersgd_compresses_only_matrices_that_shrink():
    import tfstrat

    psgd = tfstrat.PowerSGD(rank=4)
    assert psgd.compresses((3072, 2048)) and psgd.compresses((3, 3, 64, 64))
    assert not psgd.compresses((2048,))  # a vector
    assert not psgd.compresses((2048, 4))  # 2 x 4 (2048 + 4) > 2048 x 4


def _powersgd_steps(config, shape, grads, extras=None, optimizer_steps=None):
    """`PowerSGDState.exchange` of every step on every worker at once, over tfstrat's TCP ring
    between threads of this process: `grads[step, worker]` (and `extras[step, worker]`, the
    exact vector; `optimizer_steps[step]`, the optimizer's steps before it). Returns, per step
    and worker, (approximate sum, exact sum or None)."""
    from concurrent.futures import ThreadPoolExecutor

    from tfstrat.cluster import ports
    from tfstrat.reduce import ring
    from tfstrat.reduce.compression import PowerSGDState

    workers = grads.shape[1]
    listeners = [ring.listen("127.0.0.1") for _ in range(workers)]
    addresses = [ports.join("127.0.0.1", s.getsockname()[1]) for s in listeners]
    states = [PowerSGDState(config, [shape]) for _ in range(workers)]

    def connect(i):
        return ring.Ring(i, addresses, listeners[i], 30.0)

    with ThreadPoolExecutor(workers) as pool:  # each exchange needs every worker
        rings = list(pool.map(connect, range(workers), timeout=60))
        try:
            results = []
            for s in range(len(grads)):

                def step(i, s=s):
                    extra = None if extras is None else extras[s, i]
                    done = None if optimizer_steps is None else optimizer_steps[s]
                    approx, exact, _ = states[i].exchange(
                        rings[i], grads[s, i].copy(), extra, [], step=done
                    )
                    return approx.copy(), None if exact is None else exact.copy()

                results.append(list(pool.map(step, range(workers), timeout=60)))
        finally:
            for r in rings:
                r.close()
    return results


@pytest.mark.timeout(120)
def test_powersgd_starts_afresh_after_a_non_finite_sum():
    """Worker 1's gradient of step 2 holds an inf: that step's sum is not finite on every
    worker alike (the optimizer's loss scaling skips it), and PowerSGD's state (Q and the error
    feedback) starts afresh: step 3 on is the algorithm begun at step 3, finite, the same bits
    on every worker. Keeping the state would make every later step NaN."""
    import tfstrat

    n, m, workers, steps = 12, 10, 2, 6
    rng = np.random.default_rng(7)
    grads = rng.standard_normal((steps, workers, n * m)).astype(np.float32)
    grads[2, 1, 5] = np.inf
    config = tfstrat.PowerSGD(rank=RANK, warmup_steps=0)
    results = [[approx for approx, _ in step] for step in _powersgd_steps(config, (n, m), grads)]
    for s, got in enumerate(results):
        assert np.array_equal(got[0], got[1], equal_nan=True), s  # every worker alike
        assert np.isfinite(got[0]).all() == (s != 2), s
    before = _powersgd(grads[:2].astype(np.float64), n, m)
    after = _powersgd(grads[3:].astype(np.float64), n, m)  # begun afresh at step 3
    for s, expected in [*enumerate(before), *enumerate(after, start=3)]:
        assert np.abs(results[s][0] - expected).max() <= 1e-5 * np.abs(expected).max(), s


@pytest.mark.timeout(120)
def test_powersgd_warm_up_steps_are_exact_then_the_algorithm_begins():
    """warmup_steps=2: the first two exchanges are the float32 sum of the gradients and of
    the exact vector (the bits compression=None gives two workers); the third is PowerSGD's
    first step, from the initial Q and no error feedback."""
    import tfstrat

    n, m, workers, steps = 12, 10, 2, 4
    rng = np.random.default_rng(3)
    grads = rng.standard_normal((steps, workers, n * m)).astype(np.float32)
    extras = rng.standard_normal((steps, workers, 5)).astype(np.float32)
    config = tfstrat.PowerSGD(rank=RANK, warmup_steps=2)
    results = _powersgd_steps(config, (n, m), grads, extras)
    for s in range(steps):
        (got, exact), (other, other_exact) = results[s]
        assert np.array_equal(got, other) and np.array_equal(exact, other_exact), s
        assert np.array_equal(exact, extras[s][0] + extras[s][1]), s  # exact throughout
        if s < 2:
            assert np.array_equal(got, grads[s][0] + grads[s][1]), s
    expected = _powersgd(grads[2:].astype(np.float64), n, m)
    for s, want in enumerate(expected, start=2):
        assert np.abs(results[s][0][0] - want).max() <= 1e-5 * np.abs(want).max(), s


@pytest.mark.timeout(120)
def test_powersgd_warm_up_counts_the_optimizers_steps():
    """warmup_steps=3 on a state made when the optimizer has taken 2 steps (a model restored
    from a backup): one exact step, then PowerSGD's first step, afresh; made at step 5, it
    compresses from its first exchange. The warm-up is not repeated after a resume."""
    import tfstrat

    n, m, workers = 12, 10, 2
    rng = np.random.default_rng(5)
    grads = rng.standard_normal((3, workers, n * m)).astype(np.float32)
    config = tfstrat.PowerSGD(rank=RANK, warmup_steps=3)
    for begun, exact in ((2, 1), (5, 0)):
        steps = [begun + s for s in range(3)]
        results = _powersgd_steps(config, (n, m), grads, optimizer_steps=steps)
        for s in range(exact):
            assert np.array_equal(results[s][0][0], grads[s][0] + grads[s][1]), (begun, s)
        expected = _powersgd(grads[exact:].astype(np.float64), n, m)
        for s, want in enumerate(expected, start=exact):
            got = results[s][0][0]
            assert np.array_equal(got, results[s][1][0]), (begun, s)
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (begun, s)
