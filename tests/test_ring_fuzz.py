"""The ring's framing (tfstrat/reduce/ring.py) against a peer that sends what it likes after
joining: random bytes, headers that lie about the call, the parts and their sizes (up to
2^64 - 1). Every case ends in a `RingError` that names the peer (or a correct result), never
another exception, and no case makes the worker allocate past the ring's block cap.

Only a task that knows the job's secret gets this far (tests/test_ring.py: strangers are
refused at connect); this is about a peer that runs another program or breaks.

A longer run: `TFSTRAT_FUZZ_EXAMPLES=20000 pytest tests/test_ring_fuzz.py`.
"""

import os
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfstrat.cluster import ports as _ports
from tfstrat.cluster import secret
from tfstrat.errors import RingError
from tfstrat.reduce import ring, shared_memory

EXAMPLES = int(os.environ.get("TFSTRAT_FUZZ_EXAMPLES", "120"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
KEY = b"the job"
CAP = 1 << 20  # TFSTRAT_RING_MAX_BLOCK_BYTES while fuzzing
HEADER, SIZE, HELLO = struct.Struct("!QI"), struct.Struct("!Q"), struct.Struct("!II")
TWO_PARTS = 2 | ring._VECTOR  # the parts field of a call that sums a vector and gathers rows


@pytest.fixture(autouse=True)
def settings_for_fuzzing(monkeypatch):
    monkeypatch.setenv(shared_memory.ENV, "0")  # the framing on the socket
    monkeypatch.setenv(ring.MAX_BLOCK_ENV, str(CAP))


def _read(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "the worker closed during the set-up"
        buf += chunk
    return buf


def _worker_and_peer(offer=None, flag=b"\0"):
    """Worker 0, a real `Ring`, and worker 1 played by hand: (ring, the socket that sends to
    the ring, the socket the ring sends to). `offer(its own offer)`: the shared-memory offer
    worker 1 answers with (default: none), then `flag` (whether it opened worker 0's)."""
    listeners = [ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [_ports.join("127.0.0.1", s.getsockname()[1]) for s in listeners]
    made = {}
    worker = threading.Thread(
        target=lambda: made.update(ring=ring.Ring(0, addresses, listeners[0], 5.0, key=KEY))
    )
    worker.start()
    listeners[1].settimeout(10)
    incoming, _ = listeners[1].accept()  # the worker's connection to its next: us
    incoming.settimeout(10)
    secret.accept(incoming, KEY, "the fake peer")
    assert HELLO.unpack(_read(incoming, HELLO.size)) == (0, 2)
    outgoing = socket.create_connection(("127.0.0.1", listeners[0].getsockname()[1]), timeout=10)
    secret.connect(outgoing, KEY, "worker 0", 10)
    outgoing.sendall(HELLO.pack(1, 2))
    theirs = _read(incoming, shared_memory.OFFER.size)  # its offer (none if shared memory is off)
    mine = offer(theirs) if offer else shared_memory.OFFER.pack(0, 0, bytes(16))
    outgoing.sendall(mine + flag)
    _read(incoming, 1)
    worker.join(10)
    listeners[1].close()
    return made["ring"], outgoing, incoming


def _exchange_against(data: bytes):
    """What worker 0's exchange does when worker 1 sends `data` and closes."""
    r, outgoing, incoming = _worker_and_peer()
    outcome = {}

    def call():
        try:
            outcome["result"] = r.exchange(np.ones(4, np.float32), [np.ones((2, 3), np.float32)])
        except Exception as e:  # noqa: BLE001 (the test's to judge)
            outcome["error"] = e

    tracemalloc.reset_peak()
    started = time.monotonic()
    caller = threading.Thread(target=call)
    caller.start()
    try:
        outgoing.sendall(data)
    except OSError:
        pass
    outgoing.close()
    caller.join(30)
    took = time.monotonic() - started
    _, peak = tracemalloc.get_traced_memory()
    incoming.close()
    r.close()
    assert not caller.is_alive(), "the exchange did not end"
    assert took < 5.0 + 10, took  # the ring's timeout, and a busy machine's slack
    assert peak < 4 * CAP, peak  # nothing announced was allocated past the cap
    error = outcome.get("error")
    assert error is None or isinstance(error, RingError), repr(error)
    if error is not None:
        assert "worker 1" in str(error) or "other worker" in str(error), str(error)
    else:
        summed, gathers = outcome["result"]
        assert len(gathers) == 1, gathers
        _check_result(data, summed, gathers[0])
    return outcome


def _check_result(data: bytes, summed, gathered) -> None:
    """A call that succeeded took a frame a worker could have sent (call 1, two parts: the
    4 floats summed, rows of 3 gathered), and its result is exactly what that frame said."""
    call, count = HEADER.unpack(data[: HEADER.size])
    assert (call, count) == (1, TWO_PARTS), (call, count)
    at = HEADER.size + 2 * SIZE.size
    first, second = (SIZE.unpack(data[k : k + SIZE.size])[0] for k in (HEADER.size, at - 8))
    assert first == 16 and second % 12 == 0, (first, second)
    theirs = np.frombuffer(data[at : at + 16], np.float32)
    rows = np.frombuffer(data[at + 16 : at + 16 + second], np.float32).reshape(-1, 3)
    np.testing.assert_array_equal(summed, theirs + 1)
    np.testing.assert_array_equal(gathered, np.concatenate([np.ones((2, 3), np.float32), rows]))


@pytest.fixture(scope="module", autouse=True)
def traced_memory():
    tracemalloc.start()
    yield
    tracemalloc.stop()


@FUZZ
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    _exchange_against(data)


SIZES = st.one_of(
    st.integers(0, 64), st.sampled_from([2**31, 2**32 - 1, 2**63, 2**64 - 1, (CAP // 12 + 1) * 12])
)


@FUZZ
@given(
    call=st.sampled_from([0, 1, 2, 2**64 - 1]),
    count=st.sampled_from([0, 1, 2, 3, TWO_PARTS, 2 | ring._SHARED, TWO_PARTS + 1, 2**32 - 1]),
    sizes=st.lists(SIZES, max_size=4),
    body=st.binary(max_size=64),
)
def test_fuzz_lying_headers(call, count, sizes, body):
    frame = HEADER.pack(call, count) + b"".join(SIZE.pack(n) for n in sizes) + body
    _exchange_against(frame)


def test_a_block_over_the_cap_is_refused_before_allocating():
    block = (CAP // 12 + 1) * 12  # rows of 3 floats, one row over the cap
    frame = HEADER.pack(1, TWO_PARTS) + SIZE.pack(16) + SIZE.pack(block)
    outcome = _exchange_against(frame)
    message = str(outcome["error"])
    assert f"a block of {block:,} bytes to gather, over the ring's cap of {CAP:,}" in message
    assert ring.MAX_BLOCK_ENV in message


def test_the_right_frame_is_summed_and_gathered():
    """The fake peer is faithful when it sends what a worker sends: the fuzz tests its framing."""
    mine = np.arange(4, dtype=np.float32)
    rows = np.full((1, 3), 7, np.float32)
    frame = HEADER.pack(1, TWO_PARTS) + SIZE.pack(16) + SIZE.pack(12) + mine.tobytes()
    frame += rows.tobytes()
    outcome = _exchange_against(frame)
    summed, (gathered,) = outcome["result"]
    assert summed.tolist() == (mine + 1).tolist()
    assert gathered.tolist() == [[1, 1, 1], [1, 1, 1], [7, 7, 7]]


@FUZZ
@given(
    pid=st.sampled_from(["this process", 0, 1, 2**32 - 1]),
    fd=st.integers(0, 40),
    token=st.sampled_from(["the worker's", "zeros", "random"]),
    flag=st.sampled_from([b"\0", b"\1", b"\x7f"]),
)
def test_fuzz_the_shared_memory_offer(monkeypatch, pid, fd, token, flag):
    """Worker 1's shared-memory offer (process, file number, token) pointing anywhere in this
    process or none, with the worker's own token or another, and any flag: the ring forms
    within its timeout and shares memory only with a region it could open and prove; every
    other offer leaves it on TCP."""
    monkeypatch.setenv(shared_memory.ENV, "1")

    def offer(own):
        own_pid, own_fd, own_token = shared_memory.OFFER.unpack(own)
        proof = {"the worker's": own_token, "zeros": bytes(16)}.get(token, os.urandom(16))
        return shared_memory.OFFER.pack(os.getpid() if pid == "this process" else pid, fd, proof)

    started = time.monotonic()
    r, outgoing, incoming = _worker_and_peer(offer, flag)
    try:
        assert time.monotonic() - started < 5.0 + 10
        # A region opens only by this process's file of that token: the worker's own offer
        # played back is the one way (a broken peer could do it; the test shows no other).
        if r.transport == "shared memory":
            assert pid == "this process" and token == "the worker's" and flag == b"\1"
    finally:
        outgoing.close()
        incoming.close()
        r.close()
