"""tfstrat's TCP ring all-reduce (tfstrat/reduce/ring.py): real sockets on 127.0.0.1.

The ring's peers are threads here; tests/test_collective.py runs it between worker processes
inside Keras training (CollectiveAllReduce uses it by default on CPU-only workers).
"""

import logging
import socket
import threading
import time

import numpy as np
import pytest

from tfstrat.cluster import ports as _ports
from tfstrat.cluster import secret
from tfstrat.errors import RingError
from tfstrat.reduce import ring, shared_memory

# Tests of what comes before or beside an exchange (connecting, the handshake, shared-memory
# files by themselves): run once, with the default transport.
ONE_TRANSPORT = {
    "test_a_missing_peer_fails_the_connect_within_the_timeout",
    "test_an_offer_this_process_cannot_open_or_whose_token_differs_is_declined",
    "test_a_grown_memory_file_stays_open_until_the_other_worker_has_opened_it",
    "test_an_offer_of_something_that_is_not_a_memory_file_is_declined_without_blocking",
    "test_only_the_jobs_tasks_join_the_ring",
}


def pytest_generate_tests(metafunc):
    if "transport" in metafunc.fixturenames:
        both = metafunc.function.__name__ not in ONE_TRANSPORT
        ways = ["shared memory", "tcp"] if both else ["shared memory"]
        metafunc.parametrize("transport", ways, indirect=True)


@pytest.fixture(autouse=True)
def transport(request, monkeypatch):
    """Every exchange test runs on both ways two workers of one machine can exchange: through
    shared memory (the default) and over TCP alone (as two machines do)."""
    monkeypatch.setenv(shared_memory.ENV, "1" if request.param == "shared memory" else "0")
    return request.param


def _rings(n, timeout=10.0, host="127.0.0.1"):
    """n connected rings whose calls time out after `timeout`; the connect itself has 30 s, so
    a short `timeout` on a busy machine does not fail the set-up instead of the call."""
    listeners = [ring.listen(host) for _ in range(n)]
    addresses = [_ports.join(host, s.getsockname()[1]) for s in listeners]
    rings, errors = _on_threads(lambda i: ring.Ring(i, addresses, listeners[i], 30.0), n)
    assert not any(errors), errors
    for r in rings:
        r.set_timeout(timeout)
        shared = n == 2 and shared_memory.enabled()
        assert r.transport == ("shared memory" if shared else "tcp"), (n, r.transport)
    return rings, errors


def _host_rings(hosts, k, timeout=10.0):
    """Rings of `hosts` x `k` workers, host h's at 127.0.0.(h + 1): as many hosts to the ring
    (a host is an address's host part), all on loopback."""
    rings = _rings_at([f"127.0.0.{h + 1}" for h in range(hosts) for _ in range(k)])
    for r in rings:
        r.set_timeout(timeout)
    return rings


def _on_threads(fn, n):
    results, errors = [None] * n, [None] * n

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 (handed to the test)
            errors[i] = e

    # Daemon threads and one deadline for all: a call stuck for good (a swap that sends before
    # receiving) fails the test here in a minute, and cannot hold pytest's exit.
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"ranks {stuck} still in their call after 60 s"
    return results, errors


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sums_every_size_and_shape(n):
    rings, errors = _rings(n)
    assert not any(errors), errors
    rng = np.random.default_rng(n)
    for shape in [(), (0,), (1,), (5,), (3, 7), (1 << 18,)]:
        xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
        outs, errors = _on_threads(lambda i, xs=xs: rings[i].all_reduce(xs[i]), n)
        assert not any(errors), errors
        for out in outs:
            assert out.shape == shape and out.dtype == np.float32
            np.testing.assert_allclose(out, np.sum(xs, axis=0), rtol=1e-5, atol=1e-5)
            # Every worker gets the same bits (equivalence with one device depends on it).
            np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32))
        for x, original in zip(xs, [x.copy() for x in xs]):
            np.testing.assert_array_equal(x, original)  # inputs untouched
    for r in rings:
        r.close()


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_a_small_vector_alone_goes_by_recursive_doubling(n):
    """3+ workers, a vector of at most 1 KiB alone: workers P..n-1 (P the largest power of two
    <= n) hand theirs to worker r - P, workers 0..P-1 swap partial sums with the worker whose
    rank differs in one bit (log2 P rounds) and hand the sum back: one message per partner
    and round, exactly those sums on every worker; a larger vector takes the ring's stream."""
    rings, _ = _rings(n)
    rng = np.random.default_rng(7)
    big = 1 << (n.bit_length() - 1)
    header = ring._PAIR.size
    for size in (4, 1024):
        xs = [rng.standard_normal(size // 4).astype(np.float32) for _ in range(n)]
        before = [r.bytes_sent for r in rings]
        outs, errors = _on_threads(lambda i, xs=xs: rings[i].all_reduce(xs[i]), n)
        assert not any(errors), errors
        partial = [x.copy() for x in xs[:big]]
        for r in range(big, n):
            partial[r - big] = partial[r - big] + xs[r]
        bit = 1
        while bit < big:
            partial = [partial[i] + partial[i ^ bit] for i in range(big)]
            bit <<= 1
        for r, out, b in zip(rings, outs, before):
            np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32))
            np.testing.assert_array_equal(out, partial[0])  # recursive doubling's sums
            sends = 1 if r.rank >= big else (big.bit_length() - 1) + (r.rank + big < n)
            assert r.bytes_sent - b == sends * (header + size), (r.rank, r.bytes_sent - b)
    for r in rings:
        r.close()


def _halving_sums(xs: list[np.ndarray]) -> np.ndarray:
    """What recursive halving and doubling give (n a power of two): at each level (bit n/2
    down to 1) worker r keeps the lower half of its range if its bit is 0, else the upper,
    and adds its partner's sums there to its own."""
    n = len(xs)
    totals = [x.copy() for x in xs]
    ranges = [(0, xs[0].size)] * n
    bit = n >> 1
    while bit:
        new = [t.copy() for t in totals]
        for r in range(n):
            lo, hi = ranges[r]
            mid = lo + (hi - lo) // 2
            lo, hi = (lo, mid) if not r & bit else (mid, hi)
            new[r][lo:hi] = totals[r][lo:hi] + totals[r ^ bit][lo:hi]
            ranges[r] = (lo, hi)
        totals, bit = new, bit >> 1
    out = np.empty_like(xs[0])
    for r, (lo, hi) in enumerate(ranges):
        out[lo:hi] = totals[r][lo:hi]
    return out


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_a_mid_sized_vector_alone_goes_by_recursive_halving_and_doubling(n):
    """A power of two of workers, a vector of more than 1 KiB and at most 32 KiB alone:
    recursive halving, then doubling (Rabenseifner), over the direct connections: exactly
    those sums on every worker, 2 log2(n) messages and 2(n-1)/n of the vector sent by each.
    Other counts (3, 5), and larger vectors, take the ring's stream: one header, 2(n-1)/n of
    the vector."""
    rings, _ = _rings(n)
    rng = np.random.default_rng(11)
    for size in (1028, 4100, 32 << 10, (32 << 10) + 4):
        halving = not n & (n - 1) and size <= 32 << 10
        xs = [rng.standard_normal(size // 4).astype(np.float32) for _ in range(n)]
        before = [r.bytes_sent for r in rings]
        outs, errors = _on_threads(lambda i, xs=xs: rings[i].all_reduce(xs[i]), n)
        assert not any(errors), errors
        if halving:
            expected = _halving_sums(xs)
            np.testing.assert_allclose(expected, np.sum(xs, axis=0), rtol=1e-4, atol=1e-4)
        for r, out, b in zip(rings, outs, before):
            np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32))
            if halving:
                np.testing.assert_array_equal(out, expected)
            messages = 2 * (n.bit_length() - 1) if halving else 1
            header = ring._PAIR.size if halving else ring._HEADER.size + ring._SIZE.size
            sent = r.bytes_sent - b - messages * header
            assert abs(sent - 2 * (n - 1) / n * size) <= 4 * n, (r.rank, sent)
    for r in rings:
        r.close()


@pytest.mark.parametrize("n", [4, 8])
def test_recursive_halving_sums_every_dtype_and_size_alike(n, monkeypatch):
    """Halving forced on for every size: vectors of fewer elements than workers (some ranges
    empty), integers and bfloat16 give exactly the algorithm's sums, the same bits on all; a
    4 MiB vector (far more than a socket holds: each swap sends and receives at once) too."""
    import ml_dtypes  # ships with TensorFlow

    monkeypatch.setattr(ring, "_SMALL_VECTOR", 0)
    monkeypatch.setattr(ring, "_HALVING_MAX", 8 << 20)
    rings, _ = _rings(n)
    for r in rings:  # small socket buffers: a swap that sent before receiving would stall
        for sock in r._pairs.values():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    rng = np.random.default_rng(n)
    cases = [(shape, dtype) for shape in [(), (1,), (3,), (257,)]
             for dtype in (np.float32, np.int32, ml_dtypes.bfloat16)]  # fmt: skip
    for shape, dtype in cases + [((1 << 20,), np.float32)]:
        xs = [(rng.standard_normal(shape) * 100).astype(dtype) for _ in range(n)]
        outs, errors = _on_threads(lambda i, xs=xs: rings[i].all_reduce(xs[i]), n)
        assert not any(errors), (shape, dtype, errors)
        flat = [x.reshape(-1) for x in xs]
        expected = _halving_sums(flat).reshape(shape)
        for out in outs:
            assert out.shape == shape and out.dtype == dtype
            np.testing.assert_array_equal(
                out.reshape(-1).view(np.uint8), expected.reshape(-1).view(np.uint8)
            )
    for r in rings:
        r.close()


def test_recursive_halving_refuses_vectors_whose_halves_match_but_not_the_whole():
    """Worker 3 sums 2,049 floats, the others 2,048: what worker 1 first gets from worker 3
    (its lower half, 1,024 floats) is the size worker 1 expects; only the whole vector's size
    tells them apart. Every worker fails at once (those waiting on a failed one: it closed),
    none by the timeout."""
    rings, _ = _rings(4, timeout=60.0)
    sizes = [2048, 2048, 2048, 2049]
    started = time.monotonic()
    _, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(sizes[i], np.float32)), 4)
    assert time.monotonic() - started < 30, "refused, long before the timeout"
    assert all(isinstance(e, RingError) for e in errors), errors
    messages = [str(e) for e in errors]
    assert any("a vector of 8196" in m and "a vector of 8192 bytes" in m for m in messages)
    for r in rings:
        r.close()


def test_recursive_doubling_names_a_silent_partner_and_a_mismatch():
    rings, _ = _rings(4, timeout=1.0)
    started = time.monotonic()
    _, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(4, np.float32)), 3)
    assert "worker 3 (ring at" in str(errors[2]) and "sent nothing for 1.0 s" in str(errors[2])
    assert time.monotonic() - started < 2 * 1.0 + 10, "a timeout per round, and some slack"
    for r in rings:
        r.close()
    rings, _ = _rings(4, timeout=5.0)
    sizes = [4, 4, 4, 8]  # worker 3 sums 2 floats, the others 1
    _, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(sizes[i] // 4, np.float32)), 4)
    messages = [str(e) for e in errors if e is not None]
    assert any("1 part of 4 bytes" in m and "different programs" in m for m in messages), messages
    for r in rings:
        r.close()


def test_recursive_doubling_names_a_partner_that_closed():
    rings, _ = _rings(4, timeout=5.0)
    rings[3].close()  # worker 3 stopped early
    _, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(4, np.float32)), 3)
    assert "worker 3 (ring at" in str(errors[2]), errors
    assert "closed the connection: it failed or stopped early" in str(errors[2]), errors
    for r in rings:
        r.close()


@pytest.mark.parametrize("n", [3, 4])
def test_a_small_vector_with_blocks_goes_around_whole_in_n_minus_1_rounds(n):
    """3+ workers, a vector of at most 1 KiB with blocks to gather: each worker's whole vector
    goes around the ring with the blocks (n-1 rounds, not 2(n-1)), and each adds them in rank
    order: the exact sum in rank order on every worker."""
    rings, _ = _rings(n)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(200).astype(np.float32) for _ in range(n)]
    blocks = [np.full((i + 1, 2), i, np.float32) for i in range(n)]
    before = [r.bytes_sent for r in rings]
    outs, errors = _on_threads(lambda i: rings[i].exchange(xs[i], [blocks[i]]), n)
    assert not any(errors), errors
    expected = xs[0].copy()
    for x in xs[1:]:
        expected += x
    header = ring._HEADER.size + 2 * ring._SIZE.size  # two parts a round
    for r, b, (summed, (gathered,)) in zip(rings, before, outs):
        np.testing.assert_array_equal(summed, expected)  # rank order, bit for bit
        np.testing.assert_array_equal(gathered, np.concatenate(blocks, axis=0))
        rounds = [header + xs[0].nbytes + blocks[(r.rank - s) % n].nbytes for s in range(n - 1)]
        assert r.bytes_sent - b == sum(rounds), (r.rank, r.bytes_sent - b, rounds)
    for r in rings:
        r.close()


@pytest.mark.parametrize("n", [3, 4, 5])
def test_a_streamed_ring_sums_each_chunk_in_ring_order_bit_for_bit(n, monkeypatch):
    """3+ workers, a vector alone: the 2(n-1) rounds stream (a piece of round t goes on as
    soon as that piece of round t-1 is in and summed). Chunk c is summed as the ring passes
    it: x[c] first, then x[c+1] + that, ... x[c-1] last: those bits on every worker, for
    sizes that split into uneven chunks, chunks of several pieces, and pieces cut mid-chunk.
    (4 workers would sum these sizes by recursive halving: here they stream too.)"""
    monkeypatch.setattr(ring, "_HALVING_MAX", 0)
    rings, _ = _rings(n)
    rng = np.random.default_rng(n)
    piece = ring._STREAM_PIECE // 4
    for size in (257, 3 * piece + 5, 8 * n * piece + 3, 1 << 18):
        xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
        before = [r.bytes_sent for r in rings]
        outs, errors = _on_threads(lambda i, xs=xs: rings[i].all_reduce(xs[i]), n)
        assert not any(errors), errors
        bounds = np.linspace(0, size, n + 1).astype(np.int64)
        expected = np.empty(size, np.float32)
        for c in range(n):
            part = slice(bounds[c], bounds[c + 1])
            total = xs[c][part].copy()
            for k in range(1, n):
                total = xs[(c + k) % n][part] + total
            expected[part] = total
        for r, out, b in zip(rings, outs, before):
            np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
            # one header a call, and 2(n-1) chunks of about size/n
            sent = r.bytes_sent - b
            assert sent - (ring._HEADER.size + ring._SIZE.size) <= 2 * (n - 1) * (size // n + 1) * 4
    for r in rings:
        r.close()


class _Held:
    """A socket whose sends stop after `limit` bytes until `go` is set (the kernel "full")."""

    def __init__(self, sock, limit: int, go: threading.Event):
        self.sock, self.limit, self.go, self.sent = sock, limit, go, 0

    def sendmsg(self, buffers):
        room = self.limit - self.sent if not self.go.is_set() else None
        if room is not None and room <= 0:
            time.sleep(0.001)  # poll says writable: do not spin
            raise BlockingIOError
        if room is not None:
            cut, out = [], 0
            for b in buffers:
                take = memoryview(b)[: room - out]
                cut.append(take)
                out += take.nbytes
                if out >= room:
                    break
            buffers = cut
        n = self.sock.sendmsg(buffers)
        self.sent += n
        return n

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_streamed_round_goes_on_before_the_whole_round_is_in():
    """Worker 0 sends only the first 256 KiB of its 1 MiB chunk and stalls: worker 1 has
    already summed that piece and sent it on to worker 2 (round 1 began before round 0 was
    whole). Once worker 0 goes on, the sum is exact."""
    n, size = 3, 3 << 18  # 3 chunks of 1 MiB (float32)
    rings, _ = _rings(n)
    go = threading.Event()
    rings[0]._next = _Held(rings[0]._next, 256 << 10, go)
    counted = rings[1]._next = _Held(rings[1]._next, 1 << 40, threading.Event())
    xs = [np.full(size, i + 1, np.float32) for i in range(n)]
    outs = [None] * n
    threads = [
        threading.Thread(target=lambda i=i: outs.__setitem__(i, rings[i].all_reduce(xs[i])))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    header, chunk = ring._HEADER.size + ring._SIZE.size, (size // n) * 4
    deadline = time.monotonic() + 20
    while counted.sent < header + chunk + (128 << 10) and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = counted.sent
    go.set()
    for t in threads:
        t.join(30)
    # worker 1's own chunk (round 0), and of round 1 at least half of what worker 0 let through
    assert sent >= header + chunk + (128 << 10), sent
    for out in outs:
        np.testing.assert_array_equal(out, np.full(size, 6, np.float32))
    for r in rings:
        r.close()


@pytest.mark.parametrize("odd", ["size", "no vector"])
def test_streamed_workers_reducing_different_things_fail_saying_so(odd):
    """A streamed call met by one of another size, or by a call with no vector (whose header
    is shorter): a worker refuses it as a mismatch naming both sides."""
    rings, _ = _rings(3, timeout=5.0)

    def call(i):
        if i == 2 and odd == "no vector":
            return rings[i].exchange(None, [])
        return rings[i].all_reduce(np.ones(4100 if i == 2 else 4096, np.float32))

    _, errors = _on_threads(call, 3)
    messages = [str(e) for e in errors if e is not None]
    assert any("a worker stopped early" in m and "different programs" in m for m in messages), (
        messages
    )
    for r in rings:
        r.close()


@pytest.mark.parametrize("hosts,k", [(2, 2), (3, 2), (2, 3)])
def test_hosts_with_several_workers_sum_within_the_host_then_across(hosts, k, transport):
    """H hosts x k workers: a vector alone is summed within each host (two workers: through
    shared memory), across the hosts by each host's first worker, and handed back: the same
    bits on every worker, and only the first workers send across the hosts, 2(H-1)/H of it."""
    rings = _host_rings(hosts, k)
    n = hosts * k
    shared = k == 2 and transport == "shared memory"
    for i, r in enumerate(rings):
        local, across = r.levels
        assert local.size == k and local.transport == ("shared memory" if shared else "tcp")
        # on the flat ring's listeners: no other port opens
        assert set(local.addresses) < set(r.addresses), (local.addresses, r.addresses)
        if i % k:
            assert across is None, i
        else:
            assert across.size == hosts and across.transport == "tcp"  # never shared memory
    rng = np.random.default_rng(hosts * k)
    for shape in [(), (0,), (1,), (5,), (3, 7), (1 << 18,)]:
        xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
        sent = [r.levels[1].bytes_sent if r.levels[1] else 0 for r in rings]
        outs, errors = _on_threads(lambda i, xs=xs: rings[i].all_reduce(xs[i]), n)
        assert not any(errors), errors
        for out in outs:
            assert out.shape == shape
            np.testing.assert_allclose(out, np.sum(xs, axis=0), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32))
        if (hosts, k) == (2, 2):  # (x0 + x1) + (x2 + x3) exactly: host sums, then across
            np.testing.assert_array_equal(outs[0], (xs[0] + xs[1]) + (xs[2] + xs[3]))
        if shape == (1 << 18,):  # across: the whole vector, 2(H-1)/H of it for 3+ hosts
            part = xs[0].nbytes * (1 if hosts == 2 else 2 * (hosts - 1) / hosts)
            for i, (r, before) in enumerate(zip(rings, sent)):
                if i % k == 0:
                    assert part <= r.levels[1].bytes_sent - before < part + 1024
            if shared:
                assert rings[0].shared_bytes > xs[0].nbytes  # within the host: no socket
    # Blocks to gather (with or without a vector) take the flat ring: by rank, as always.
    blocks = [np.full((i, 2), i, np.float32) for i in range(n)]
    outs, errors = _on_threads(lambda i: rings[i].exchange(np.ones(3), [blocks[i]]), n)
    assert not any(errors), errors
    for summed, (gathered,) in outs:
        np.testing.assert_array_equal(summed, np.full(3, n))
        np.testing.assert_array_equal(gathered, np.concatenate(blocks))
    for r in rings:
        r.close()


def _rings_at(where, options=None):
    """Rings at these hosts (127.0.0.x: one host each), worker i's made with options[i]."""
    listeners = [ring.listen(h) for h in where]
    addresses = [_ports.join(h, s.getsockname()[1]) for h, s in zip(where, listeners)]

    def make(i):
        return ring.Ring(i, addresses, listeners[i], 30.0, **(options or {}).get(i, {}))

    rings, errors = _on_threads(make, len(where))
    assert not any(errors), errors
    return rings


def _sum_ranks_and_close(rings):
    """Each worker's rank summed: every worker gets 0 + 1 + ... + n-1."""
    n = len(rings)
    outs, errors = _on_threads(lambda i: rings[i].all_reduce(np.full(1000, i, np.float32)), n)
    assert not any(errors), errors
    for out in outs:
        np.testing.assert_array_equal(out, np.full(1000, n * (n - 1) // 2))
    for r in rings:
        r.close()


def test_two_levels_where_a_host_has_several_workers_and_every_worker_wants_them(monkeypatch):
    # 1 + 3 workers (a chief alone on its host): the lone worker's host sum is its vector.
    rings = _rings_at(["127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.2"])
    assert [r.levels[0] is None for r in rings] == [True, False, False, False]
    assert [r.levels[1] is None for r in rings] == [False, False, True, True]
    _sum_ranks_and_close(rings)
    # One worker per host, or one host: the flat ring is all there is.
    for where in (["127.0.0.1", "127.0.0.2", "127.0.0.3"], ["127.0.0.1"] * 3):
        rings = _rings_at(where)
        assert all(r.levels is None for r in rings), where
        for r in rings:
            r.close()
    # One worker that wants one plain ring (TFSTRAT_RING_FLAT=1 there): one plain ring on all.
    monkeypatch.setenv(ring.FLAT_ENV, "1")
    wants = {i: {"flat": False} for i in range(3)}  # worker 3 reads the environment
    rings = _rings_at(["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"], wants)
    assert all(r.levels is None and not r._pairs for r in rings)
    _sum_ranks_and_close(rings)


def test_the_hand_back_within_a_host_is_not_held_to_the_sparse_rows_cap(monkeypatch):
    monkeypatch.setenv(ring.MAX_BLOCK_ENV, "1024")  # far below the vector: still summed
    rings = _host_rings(2, 2)
    xs = [np.full(1 << 14, i, np.float32) for i in range(4)]
    outs, errors = _on_threads(lambda i: rings[i].all_reduce(xs[i]), 4)
    assert not any(errors), errors
    for out in outs:
        np.testing.assert_array_equal(out, np.full(1 << 14, 6))
    for r in rings:
        r.close()


@pytest.mark.parametrize("hosts,k", [(2, 2), (3, 2)])
def test_the_sum_across_comes_back_in_pieces_each_within_the_timeout(hosts, k, monkeypatch):
    """A vector larger than a piece goes across and back a piece at a time: the host's other
    workers wait one piece's sum across, not the whole vector's. Here host 0's first worker
    sums across as a link of 4 KiB per 0.7 s would (5 pieces: 3.5 s in all) and the ring's
    timeout is 2 s."""
    monkeypatch.setattr(ring, "_HAND_BACK_PIECE", 4096)
    rings = _host_rings(hosts, k, timeout=2.0)
    across = rings[0].levels[1]
    plain = across.exchange

    def slow(x, gathers):
        time.sleep(0.7 * -(-x.nbytes // 4096) if x is not None else 0)
        return plain(x, gathers)

    across.exchange = slow
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(5 * 1024 - 3).astype(np.float32) for _ in range(hosts * k)]
    outs, errors = _on_threads(lambda i: rings[i].all_reduce(xs[i]), hosts * k)
    assert not any(errors), errors
    for out in outs:
        np.testing.assert_allclose(out, np.sum(xs, axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32))
    if hosts == 2:  # host sums, then across: exactly, piece by piece
        np.testing.assert_array_equal(outs[0], (xs[0] + xs[1]) + (xs[2] + xs[3]))
    for r in rings:
        r.close()


def test_hosts_summing_vectors_of_different_piece_counts_fail_naming_both(monkeypatch):
    """Each piece's call checks only its own size: the hosts' first workers compare the whole
    vectors' sizes first, so 2 pieces against 3 fail at once on both hosts."""
    monkeypatch.setattr(ring, "_HAND_BACK_PIECE", 4096)
    rings = _host_rings(2, 2, timeout=60.0)
    sizes = [2048, 2048, 3072, 3072]  # floats: host 0 has 2 pieces of 4 KiB, host 1 has 3
    started = time.monotonic()
    _, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(sizes[i], np.float32)), 4)
    assert time.monotonic() - started < 30, "refused, long before the timeout"
    assert all(isinstance(e, RingError) for e in errors), errors
    for i in (0, 2):
        assert "8192 bytes on worker 0" in str(errors[i]), errors[i]
        assert "12288 bytes on worker 2" in str(errors[i]), errors[i]
    for r in rings:
        r.close()


def test_a_first_worker_whose_sum_across_fails_lets_its_host_fail_at_once_naming_it():
    rings = _host_rings(2, 2, timeout=1.0)
    rings[1].set_timeout(60.0)  # worker 1 waits for its host's sum much longer than that
    started = time.monotonic()
    _, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(1 << 16, np.float32)), 2)
    assert "sent nothing for 1.0 s" in str(errors[0]), errors  # worker 2 never sums across
    assert "worker 0 (ring at" in str(errors[1]) and "closed the connection" in str(errors[1])
    assert time.monotonic() - started < 1.0 + 10, "worker 0's timeout, not worker 1's 60 s"
    for r in rings:
        r.close()


def test_a_silent_worker_of_a_host_times_out_its_host_naming_it():
    rings = _host_rings(2, 2, timeout=1.0)
    started = time.monotonic()
    _, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(1 << 16, np.float32)), 3)
    assert all(isinstance(e, RingError) for e in errors), errors
    assert "worker 3" in str(errors[2]) and "sent nothing for 1.0 s" in str(errors[2]), errors
    assert time.monotonic() - started < 2 * 1.0 + 10, "two levels' timeouts and some slack"
    for r in rings:
        r.close()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_all_gather_stacks_every_workers_block_by_rank(n):
    rings, errors = _rings(n)
    assert not any(errors), errors
    for shape in [(0, 3), (1, 1), (4, 5), (1000, 9)]:
        xs = [
            np.full(shape, i, np.float32) + np.arange(shape[-1], dtype=np.float32) for i in range(n)
        ]
        outs, errors = _on_threads(lambda i, xs=xs: rings[i].all_gather(xs[i]), n)
        assert not any(errors), errors
        for out in outs:
            np.testing.assert_array_equal(out, np.concatenate(xs, axis=0))
    for r in rings:
        r.close()


def test_all_gather_takes_a_different_row_count_from_each_worker():
    rings, _ = _rings(3, timeout=3.0)
    xs = [np.full((rows, 2), rows, np.float32) for rows in (3, 0, 5)]
    outs, errors = _on_threads(lambda i: rings[i].all_gather(xs[i]), 3)
    assert not any(errors), errors
    for out in outs:
        np.testing.assert_array_equal(out, np.concatenate(xs, axis=0))
    # Rows of another width do not fit: a clear error, not mixed data.
    ys = [np.ones((2, 2), np.float32), np.ones((1, 3), np.float32), np.ones((2, 2), np.float32)]
    _, errors = _on_threads(lambda i: rings[i].all_gather(ys[i]), 3)
    assert any("a multiple of 8 bytes" in str(e) for e in errors), errors


def test_two_workers_sum_a_small_vector_in_one_message_each_way():
    """Two workers, a vector of at most 1 KiB alone: one message each way (header and the
    vector, over TCP even where shared memory is on), the same bits on both."""
    rings, _ = _rings(2)
    header = ring._HEADER.size + ring._SIZE.size
    rng = np.random.default_rng(2)
    for shape in [(), (0,), (3, 5), (256,)]:
        xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
        before = [(r.bytes_sent, r.shared_bytes) for r in rings]
        outs, errors = _on_threads(lambda i, xs=xs: rings[i].all_reduce(xs[i]), 2)
        assert not any(errors), errors
        for r, out, (sent, shared) in zip(rings, outs, before):
            assert out.shape == shape
            np.testing.assert_array_equal(out, xs[0] + xs[1])
            assert (r.bytes_sent - sent, r.shared_bytes - shared) == (header + xs[0].nbytes, 0)
    for r in rings:
        r.close()


@pytest.mark.parametrize("sizes", [(8, 10), (256, 257), (1, 300)])
def test_workers_reducing_different_tensors_fail_with_both_sizes(sizes):
    """Also when one vector is small enough for one message each way and the other is not
    (and shorter than the other's header through shared memory): refused at once, not by the
    timeout."""
    rings, _ = _rings(2, timeout=60.0)
    started = time.monotonic()
    _, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(sizes[i], np.float32)), 2)
    assert time.monotonic() - started < 30, "refused by the header, long before the timeout"
    assert all(errors), errors  # both: neither sums the other's message as its own size
    messages = [str(e) for e in errors]
    assert any("a worker stopped early" in m and "different programs" in m for m in messages), (
        messages
    )
    small, large = (f"{4 * k} bytes" for k in sizes)
    assert any(small in m and large in m for m in messages), messages


def test_a_sum_against_a_gather_of_the_same_bytes_fails_on_both_workers():
    """The header says what a call exchanges: one worker summing 16 bytes while the other
    gathers 16 bytes of rows fail both, naming what each sent, instead of mixing them."""
    rings, _ = _rings(2, timeout=60.0)
    calls = [
        lambda: rings[0].all_reduce(np.ones(4, np.float32)),
        lambda: rings[1].all_gather(np.ones((1, 4), np.float32)),
    ]
    _, errors = _on_threads(lambda i: calls[i](), 2)
    assert all(isinstance(e, RingError) for e in errors), errors
    assert "(rows)" in str(errors[0]) and "(the first a vector)" in str(errors[1]), errors
    for r in rings:
        r.close()


def test_after_a_failure_the_ring_refuses_further_calls_saying_why():
    rings, _ = _rings(2, timeout=1.0)
    with pytest.raises(RingError, match="sent nothing"):
        rings[0].all_reduce(np.ones(4, np.float32))  # worker 1 never calls: times out
    # Worker 1's call comes late: its message must not be taken as the next call's.
    late = threading.Thread(target=_ignoring_errors(rings[1].all_reduce, np.full(4, 5, np.float32)))
    late.start()
    late.join(10)
    with pytest.raises(RingError, match="failed earlier.*sent nothing"):
        rings[0].all_reduce(np.ones(4, np.float32))


def _ignoring_errors(fn, *args):
    def run():
        try:
            fn(*args)
        except RingError:
            pass  # the other ring failed first: this call may fail too

    return run


def test_sums_dtypes_the_buffer_protocol_cannot_cast():
    import ml_dtypes  # ships with TensorFlow

    rings, _ = _rings(2)
    xs = [np.arange(6, dtype=ml_dtypes.bfloat16) * (i + 1) for i in range(2)]
    outs, errors = _on_threads(lambda i: rings[i].all_reduce(xs[i]), 2)
    assert not any(errors), errors
    np.testing.assert_array_equal(outs[0].astype(np.float32), np.arange(6) * 3.0)


def test_a_peer_that_closes_fails_the_other_naming_it():
    listeners = [ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
    names = ["/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]
    rings, _ = _on_threads(lambda i: ring.Ring(i, addresses, listeners[i], 10, names), 2)
    rings[1].close()
    with pytest.raises(RingError, match="task:1"):
        rings[0].all_reduce(np.ones(1 << 16, np.float32))


def test_a_peer_that_closes_before_a_small_call_fails_the_other_naming_it():
    rings, _ = _rings(2)
    rings[1].close()
    with pytest.raises(RingError, match="worker 1 .*closed the connection"):
        rings[0].all_reduce(np.ones(4, np.float32))


def test_a_silent_peer_times_out_naming_it():
    rings, _ = _rings(2, timeout=1.0)
    started = time.monotonic()
    with pytest.raises(RingError, match="worker 1 .*sent nothing for 1.0 s"):
        rings[0].all_reduce(np.ones(4, np.float32))  # worker 1 never calls
    assert time.monotonic() - started < 1.0 + 5, "the 1 s timeout, and a busy machine's slack"


def test_a_worker_stuck_on_both_sides_names_both_neighbours():
    """3 workers, worker 2 never calls: worker 1 has all of worker 0's first round, cannot
    pass it on to worker 2 (which reads nothing) and waits for worker 0's next round (which
    needs worker 2's): its error names both, the one not reading among them."""
    rings, _ = _rings(3, timeout=1.0)
    x = np.ones(16 << 20, np.float32)  # far more than the sockets' buffers hold
    _, errors = _on_threads(lambda i: rings[i].all_reduce(x), 2)
    assert "worker 0 (ring at" in str(errors[1]) and "worker 2 (ring at" in str(errors[1]), errors
    assert "sent nothing for 1.0 s, and" in str(errors[1]) and "took nothing" in str(errors[1])
    for r in rings:
        r.close()


def test_a_missing_peer_fails_the_connect_within_the_timeout():
    listener = ring.listen("127.0.0.1")
    dead = ring.listen("127.0.0.1")
    address = f"127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nobody listens there
    started = time.monotonic()
    with pytest.raises(RingError, match="Could not connect to worker 1"):
        ring.Ring(0, [f"127.0.0.1:{listener.getsockname()[1]}", address], listener, 0.5)
    assert time.monotonic() - started < 0.5 + 5, "the 0.5 s timeout, and a busy machine's slack"


def test_ipv6_peers():
    if _ports.route_source(["::1"]) is None:
        pytest.skip("this machine has no IPv6 loopback (::1)")
    rings, errors = _rings(3, host="::1")
    assert errors == [None] * 3, errors
    assert rings[0].addresses[1].startswith("[::1]:")
    sums, errors = _on_threads(lambda i: rings[i].all_reduce(np.full(5, i, np.float32)), 3)
    assert errors == [None] * 3, errors
    np.testing.assert_array_equal(sums[0], np.full(5, 3, np.float32))


def test_a_result_still_referenced_is_never_overwritten_by_the_next_call():
    """`tf.numpy_function` keeps a 64-byte aligned result as its output tensor's memory
    without a copy, so a result TensorFlow still holds must not be reused; a free one is."""
    rings, _ = _rings(2)
    xs = [np.full(1000, i + 1, np.float32) for i in range(2)]
    firsts, errors = _on_threads(lambda i: rings[i].exchange(xs[i], [])[0], 2)
    assert not any(errors), errors
    assert all(f.ctypes.data % 64 == 0 for f in firsts)  # what lets TensorFlow take it as is
    seconds, errors = _on_threads(lambda i: rings[i].exchange(2 * xs[i], [])[0], 2)
    assert not any(errors), errors
    for first, second in zip(firsts, seconds):
        np.testing.assert_array_equal(first, 3.0)  # still the first call's sum
        np.testing.assert_array_equal(second, 6.0)
        assert not np.shares_memory(first, second)
    # Once nothing refers to them, the buffers are reused (no fresh memory every step).
    freed = {a.ctypes.data for a in firsts + seconds}
    del firsts, first, seconds, second
    thirds, _ = _on_threads(lambda i: rings[i].exchange(xs[i], [])[0], 2)
    assert {a.ctypes.data for a in thirds} <= freed
    for r in rings:
        r.close()


def test_a_message_larger_than_the_shared_slot_grows_it_and_smaller_ones_follow():
    rings, _ = _rings(2)
    for size in (10, 1 << 15, 1 << 20, 7, 3 << 20, 100):  # slots start at 64 KiB
        xs = [np.full(size, i + 1, np.float32) for i in range(2)]
        gathers = [np.full((i + 2, 3), i, np.int64) for i in range(2)]
        outs, errors = _on_threads(
            lambda i, xs=xs, gs=gathers: rings[i].exchange(xs[i], [gs[i]]), 2
        )
        assert not any(errors), errors
        for summed, (rows,) in outs:
            np.testing.assert_array_equal(summed, np.full(size, 3, np.float32))
            np.testing.assert_array_equal(rows, np.concatenate(gathers))
    for r in rings:
        r.close()


def test_an_offer_this_process_cannot_open_or_whose_token_differs_is_declined():
    region = shared_memory.Region()
    try:
        pid, fd, token = shared_memory.OFFER.unpack(region.offer())
        peer = shared_memory.open_peer(region.offer())  # /proc/PID/fd/FD opens here
        assert peer is not None and peer.token() == token
        peer.close()
        wrong = shared_memory.OFFER.pack(pid, fd, bytes(16))
        assert shared_memory.open_peer(wrong) is None  # e.g. that PID on another machine
        assert shared_memory.open_peer(shared_memory.OFFER.pack(pid, 9999, token)) is None
        assert shared_memory.open_peer(shared_memory.OFFER.pack(0, 0, bytes(16))) is None
    finally:
        region.close()


def test_a_grown_memory_file_stays_open_until_the_other_worker_has_opened_it():
    """Each file stays open for two calls after the call that introduced it: the other worker
    opens it during that call, by its number, which a file closed sooner could hand on."""
    import os

    region = shared_memory.Region()
    try:
        small, big, bigger = (memoryview(bytes(n)) for n in (8, 1 << 17, 1 << 19))
        region.write(1, [small])
        first = region.fd
        region.write(2, [big])  # grows: the file of call 0 retires
        second = region.fd
        region.write(3, [bigger])  # grows again, the next call
        third = region.fd
        # The file made in call 2 must still open (the other worker may not have yet).
        assert second in [fd for fd, _, _ in region.retired]
        opened = os.open(f"/proc/{os.getpid()}/fd/{second}", os.O_RDONLY)
        assert os.fstat(opened).st_size == 2 * (1 << 17)
        os.close(opened)
        assert first not in [fd for fd, _, _ in region.retired]  # made in call 0: closed
        region.write(4, [small])
        assert region.retired == [] and region.fd == third  # call 2 + 2: closed now
    finally:
        region.close()


def test_an_offer_of_something_that_is_not_a_memory_file_is_declined_without_blocking():
    import os

    read, write = os.pipe()  # e.g. the PID and FD of a process on another machine
    try:
        offer = shared_memory.OFFER.pack(os.getpid(), read, bytes(16))
        assert shared_memory.open_peer(offer) is None
    finally:
        os.close(read)
        os.close(write)


def test_only_the_jobs_tasks_join_the_ring(caplog, monkeypatch):
    """A stranger that connects to a worker's ring port first is refused and logged with its
    address, and the ring still forms; a worker with another job's secret (another job, or
    an earlier attempt) is refused both ways, by name."""
    monkeypatch.setattr(secret, "_refused", set())  # each address is logged once a process
    listeners = [ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [_ports.join("127.0.0.1", s.getsockname()[1]) for s in listeners]
    stranger = socket.create_connection(("127.0.0.1", listeners[0].getsockname()[1]))
    stranger.sendall(b"stats " * 20)  # not the handshake: refused before anything is read
    with caplog.at_level(logging.WARNING, logger="tfstrat.cluster.secret"):
        rings, errors = _on_threads(
            lambda i: ring.Ring(i, addresses, listeners[i], 30.0, key=b"job A"), 2
        )
    assert errors == [None, None], errors
    sums, errors = _on_threads(lambda i: rings[i].all_reduce(np.ones(3, np.float32)), 2)
    assert errors == [None, None] and sums[0].tolist() == [2.0, 2.0, 2.0], (sums, errors)
    assert "this worker's ring refused a connection from 127.0.0.1" in caplog.text
    got = b""
    try:  # the challenge at most, then the end (a reset may discard even the challenge)
        while chunk := stranger.recv(100):
            got += chunk
    except ConnectionResetError:  # closed with the stranger's bytes unread
        pass
    assert got == b"" or (got.startswith(secret.MAGIC) and len(got) == len(secret.MAGIC) + 16)
    stranger.close()
    for r in rings:
        r.close()

    listeners = [ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [_ports.join("127.0.0.1", s.getsockname()[1]) for s in listeners]
    keys = [b"job A, attempt 1", b"job A, attempt 0"]
    started = time.monotonic()
    _, errors = _on_threads(lambda i: ring.Ring(i, addresses, listeners[i], 3.0, key=keys[i]), 2)
    assert all(isinstance(e, RingError) for e in errors), errors
    words = " ".join(str(e) for e in errors)
    assert "refused this task: its job secret differs" in words, words
    assert time.monotonic() - started < 3.0 + 10, "within the timeout and the handshake's"
