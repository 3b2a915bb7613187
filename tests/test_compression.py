"""Compressed gradients (`compression=`): real workers through `tfstrat launch`, checked
against the same algorithms written out in NumPy.

Lossy by design, so not held to the single-device contract. Instead, every step of
tests/workers/compression_run.py is checked: the exchange's result against the algorithm
(fp16/bf16: the float32 sum of each worker's rounded gradients, bit for bit; PowerSGD: its
error feedback and warm-started factors, to 1e-5), the workers' weights identical after every
step, the optimizer applying exactly that result, the sparse table's rows and the logged loss
(the step's extras) exact, and the ring's measured bytes below what the exact exchange sends.
"""

import json
import re

import ml_dtypes
import numpy as np
import pytest
from cluster import RUN_TIMEOUT, launch_script

LR, BATCH, STEPS, RANK = 0.1, 16, 8, 2


def _initial_q(index, columns, rank):  # the documented start: the same on every worker
    return np.random.default_rng(index).standard_normal((columns, rank))


def _powersgd(raws, n, m):
    """PowerSGD with error feedback (Vogels et al. 2019) on one matrix, every step:
    `raws[s][i]` is worker i's gradient at step s. Returns each step's approximate sum."""
    workers = len(raws[0])
    q = _initial_q(0, m, RANK)
    error = [np.zeros((n, m)) for _ in range(workers)]
    out = []
    for step in raws:
        ms = [error[i] + step[i].reshape(n, m) for i in range(workers)]
        p_hat = np.linalg.qr(sum(mat @ q for mat in ms))[0]
        q = sum(mat.T @ p_hat for mat in ms)
        approx = p_hat @ q.T
        error = [mat - approx / workers for mat in ms]
        out.append(approx.reshape(-1))
    return out


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
    ],
)
def test_compressed_training_is_the_algorithm_written_out(tmp_path, method, workers, kind):
    code, log = launch_script(
        "compression_run.py", str(tmp_path), method, kind, workers=workers,
        ps=1 if kind == "hybrid" else 0,
    )  # fmt: skip
    assert code == 0, log[-6000:]
    assert f"tfstrat: compression={method}" in log
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

    # 2. The exchange is the algorithm written out, on the gradients the workers recorded.
    raws = [[r["raw"][s] for r in runs] for s in range(STEPS)]
    if method == "powersgd":
        factored = _powersgd([[g[:size] for g in step] for step in raws], *kernel_shape)
        bias = [np.sum([g[size:] for g in step], axis=0, dtype=np.float64) for step in raws]
        expected = [np.concatenate([f, b]) for f, b in zip(factored, bias)]
        for s in range(STEPS):
            got = first["reduced"][s]
            scale = np.abs(expected[s]).max()
            assert np.abs(got - expected[s]).max() <= 1e-5 * scale, s
            # the bias (a vector) and the anchor go exactly
            np.testing.assert_allclose(got[size:], bias[s], rtol=1e-6, atol=1e-7)
    else:
        wire = np.float16 if method == "fp16" else ml_dtypes.bfloat16
        for s in range(STEPS):
            assert np.array_equal(first["reduced"][s], _rounded_sum(raws[s], wire)), s
    exact = [np.sum(step, axis=0, dtype=np.float64) for step in raws]
    off = max(np.abs(first["reduced"][s] - exact[s]).max() / np.abs(exact[s]).max()
              for s in range(STEPS))  # fmt: skip
    assert off > 1e-4, off  # it did compress

    # 3. The optimizer applied that result, and the table's rows and the loss stay exact.
    x, ids, y = first["x"], first["ids"], first["y"]
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
        error = _forward(x[rows], ids[rows], kernel, bias, table) - y[rows]
        d = 2.0 / error.shape[1] * error / BATCH  # d(mean loss)/d(output)
        table_grad = np.zeros_like(table)
        np.add.at(table_grad, ids[rows], d)
        np.testing.assert_allclose(
            first[f"w{s}_table"], table - LR * table_grad, rtol=1e-5, atol=1e-7
        )
        running.append(float(np.mean(error**2)))
        assert abs(first["losses"][s] - np.mean(running)) <= 1e-5 * np.mean(running), s

    # 4. Measured on the ring: less than the dense gradients alone take uncompressed.
    ring_share = 1.0 if workers == 2 else 2 * (workers - 1) / workers
    uncompressed = 4 * first["raw"].shape[1] * ring_share
    sent = reports[0]["bytes_per_step"]
    assert sent < (0.3 if method == "powersgd" else 0.9) * uncompressed, (sent, uncompressed)


@pytest.mark.parametrize(
    "value,words",
    [
        ("fp8", "Received: compression='fp8'. Use None, 'fp16', 'bf16', 'powersgd'"),
        ("PowerSGD(rank=0)", "Received: PowerSGD(rank=0). Use an integer >= 1."),
        ("PowerSGD(min_ratio=0.5)", "Received: PowerSGD(min_ratio=0.5). Use a number >= 1."),
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
