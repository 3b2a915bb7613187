"""The ps's table server (tfstrat/ps/wire.py, tfstrat/ps/tables.py) against frames that are not
its own: random bytes, headers that lie about their arrays, calls with wrong arrays, a client
that trickles bytes. Thousands of generated cases (hypothesis); after each, a well-behaved
worker's connection still gets its answers, and no case makes the server allocate past its caps.

A longer run: `TFSTRAT_FUZZ_EXAMPLES=100000 pytest tests/test_wire.py -k fuzz`.
"""

import collections
import json
import logging
import os
import re
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfstrat.cluster import secret
from tfstrat.cluster.ports import free_port
from tfstrat.ps import tables, wire

EXAMPLES = int(os.environ.get("TFSTRAT_FUZZ_EXAMPLES", "300"))  # per test; CI runs them all
# NaN and inf rows a fuzzed push carries make NaN rows (as Keras would): not a finding.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the repository
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
LENGTH = struct.Struct("<I")
TABLE = 2**62
FUZZED = {0: (50, 4), 1: (7, 3)}  # tables the generated calls reach (ids -2..3 are drawn)
# What a malformed call may raise on the server (answered as "failed: <type>: ..."); anything
# else (a TypeError, a KeyError) is a bug the fuzzer found.
HANDLED = ("UsageError", "ValueError", "BadFrame")
ANSWERED = collections.Counter()  # generated calls answered (not refused), by method
CRASHES: list[str] = []  # exceptions that escaped a server thread (none may)
CAP = 1 << 20  # TFSTRAT_WIRE_MAX_BYTES while fuzzing: no case may allocate much beyond it


@pytest.fixture(scope="module")
def server():
    """A table server on loopback with one 50 x 4 table (number 2**62, which no generated
    call names), and a worker's connection to it."""
    logging.getLogger("tfstrat.ps.wire").setLevel(logging.CRITICAL)  # thousands of bad frames
    before = os.environ.get("TFSTRAT_WIRE_MAX_BYTES")
    os.environ["TFSTRAT_WIRE_MAX_BYTES"] = str(CAP)  # read by the server at every frame
    tracemalloc.start()
    hook = threading.excepthook
    threading.excepthook = lambda args: CRASHES.append(
        f"{args.exc_type.__name__}: {args.exc_value}"
    )
    port = free_port()
    served, _ = tables.serve_tables("127.0.0.1", port, "ps:0")
    worker = wire.Connection(f"127.0.0.1:{port}", 10, "ps:0")
    spec = np.frombuffer(json.dumps({"zeros": True}).encode(), np.uint8)
    worker.send("create", np.int64(TABLE), np.int64(50), np.int64(4), np.int64(1), spec)
    worker.receive("create")
    _create_fuzzed(worker)
    yield port, worker
    worker.close()
    served.close()
    threading.excepthook = hook
    tracemalloc.stop()
    if before is None:
        del os.environ["TFSTRAT_WIRE_MAX_BYTES"]
    else:
        os.environ["TFSTRAT_WIRE_MAX_BYTES"] = before
    logging.getLogger("tfstrat.ps.wire").setLevel(logging.NOTSET)


def _create_fuzzed(worker) -> None:
    """The tables the generated calls reach (again, after a generated `drop`; `create` of a
    table that exists does nothing). One worker each: a generated push is applied at once."""
    spec = np.frombuffer(json.dumps({"zeros": True}).encode(), np.uint8)
    for number, (rows, dim) in FUZZED.items():
        worker.send("create", np.int64(number), np.int64(rows), np.int64(dim), np.int64(1), spec)
        worker.receive("create")


def _still_serves(worker) -> None:
    assert not CRASHES, CRASHES  # every bad frame was handled, none killed its thread
    worker.send("lookup", np.int64(TABLE), np.array([3, 49], np.int64), np.int64(-1))
    (rows,) = worker.receive("lookup")
    assert rows.shape == (8,) and not rows.any()


def _exchange(port: int, data: bytes, wait: float = 2.0, handshake: bool = True):
    """Sends `data` on a new connection (after the job handshake, as a task of this job:
    this process has no secret, nor has the server), ends its sending side, returns what
    comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        if handshake:
            secret.connect(sock, secret.key(), "the table server", wait)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server already dropped it
            return b""
        got = []
        try:
            while chunk := sock.recv(65536):
                got.append(chunk)
        except OSError:
            pass
        return b"".join(got)


def _frame(header, arrays=b"", length=None) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return LENGTH.pack(len(head) if length is None else length) + head + arrays


def _replies(data: bytes) -> list[dict]:
    """The headers of the frames in `data` (the server's answers)."""
    out = []
    while len(data) >= LENGTH.size:
        (n,) = LENGTH.unpack(data[: LENGTH.size])
        header = json.loads(data[LENGTH.size : LENGTH.size + n])
        size = sum(
            int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
            for dt, shape in header["arrays"]
        )
        out.append(header)
        data = data[LENGTH.size + n + size :]
    return out


@FUZZ
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes(server, data):
    port, worker = server
    for reply in _replies(_exchange(port, data)):
        assert "error" in reply, reply
    _still_serves(worker)


@FUZZ
@given(data=st.binary(max_size=200))
def test_fuzz_the_handshake(server, data):
    """Bytes from someone who does not know the job's secret: nothing but the server's
    challenge comes back, and the server goes on serving the job's tasks."""
    port, worker = server
    got = _exchange(port, data, handshake=False)
    # The challenge at most (the reset for the unread bytes may discard even that), no answer.
    challenge = len(got) == len(secret.MAGIC) + 16 and got.startswith(secret.MAGIC)
    assert got == b"" or challenge, got
    _still_serves(worker)


DTYPES = st.sampled_from(["<i8", "<f4", "|u1", "<f8", "|O", "<U4", "x", 7, "<c8"])
SHAPES = st.lists(
    st.one_of(st.integers(-3, 40), st.integers(2**31, 2**64), st.just("1"), st.none()), max_size=4
)


@FUZZ
@given(
    method=st.sampled_from(["lookup", "push", "read", "stats", "nope", "__init__", 3]),
    arrays=st.one_of(
        st.lists(st.tuples(DTYPES, SHAPES).map(list), max_size=20), st.integers(), st.text()
    ),
    length=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    body=st.binary(max_size=64),
)
def test_fuzz_lying_headers(server, method, arrays, length, body):
    """Headers whose arrays have bad dtypes, negative or huge shapes (lengths near 2^64),
    wrong types, or whose length field is anything up to 2^32 - 1: an error naming the problem
    (or the call's own answer, or nothing for a frame cut short), never an allocation past the
    caps, and the server keeps serving."""
    port, worker = server
    frame = _frame({"method": method, "arrays": arrays}, body, length)
    tracemalloc.reset_peak()
    held = tracemalloc.get_traced_memory()[0]  # what hypothesis and the rest hold already
    start = time.monotonic()
    replies = _replies(_exchange(port, frame))
    assert time.monotonic() - start < 5  # no gigabyte was waited for
    assert tracemalloc.get_traced_memory()[1] - held < 8 * CAP  # nor allocated
    for header in replies:
        assert set(header) <= {"error", "arrays"}, header
    _still_serves(worker)


ARRAYS = st.lists(
    st.one_of(
        st.integers(-2, 3).map(np.int64),  # a table of FUZZED, a worker, a step
        st.integers(-(2**40), 2**40).map(np.int64),
        st.lists(st.integers(-5, 60), max_size=6).map(lambda v: np.array(v, np.int64)),
        st.lists(st.floats(allow_nan=True, width=32), max_size=8).map(
            lambda v: np.array(v, np.float32)
        ),
        st.binary(max_size=16).map(lambda b: np.frombuffer(b, np.uint8)),
    ),
    max_size=8,
)


FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def table_calls(draw):
    """A call of a table method with plausible arrays (real tables, ids and rows near their
    bounds, any float32 value, the optimizer numbers a push carries), sometimes mutated (an
    array dropped, added or replaced by any of ARRAYS'): (method, arrays)."""
    method = draw(st.sampled_from(["lookup", "push", "read", "write", "read_slot", "write_slot"]))
    table = draw(st.sampled_from([0, 1, 1, 7]))  # 7 does not exist
    rows, dim = FUZZED.get(table, (5, 2))
    ids = np.array(draw(st.lists(st.integers(-2, rows + 1), max_size=6)), np.int64)
    step, lo = np.int64(draw(st.integers(-1, 3))), np.int64(draw(st.integers(-2, rows + 1)))
    hi, slot = np.int64(draw(st.integers(-2, rows + 2))), np.int64(draw(st.integers(-1, 3)))
    n = draw(st.integers(0, 4)) * dim
    values = np.array(draw(st.lists(FLOATS, min_size=n, max_size=n)), np.float32)
    if method == "lookup":
        arrays = [np.int64(table), ids, step]
    elif method == "push":
        grads = draw(st.lists(FLOATS, min_size=ids.size * dim, max_size=ids.size * dim))
        kind = draw(st.integers(-1, 6))
        hyper = [
            kind,
            *draw(st.lists(FLOATS, min_size=tables.HYPER - 1, max_size=tables.HYPER - 1)),
        ]
        arrays = [np.int64(table), step, ids, np.array(grads, np.float32),
                  np.array(hyper, np.float32), np.float32(draw(FLOATS)),
                  np.int64(draw(st.integers(-1, 2)))]  # fmt: skip
    elif method == "read":
        arrays = [np.int64(table), lo, hi, step]
    elif method == "write":
        arrays = [np.int64(table), lo, values]
    elif method == "read_slot":
        arrays = [np.int64(table), slot, lo, hi, step]
    else:
        arrays = [np.int64(table), slot, lo, values]
    mutation = draw(st.sampled_from(["none", "none", "drop", "add", "replace"]))
    if mutation == "drop" and arrays:
        del arrays[draw(st.integers(0, len(arrays) - 1))]
    elif mutation == "add":
        arrays.append(draw(ARRAYS.filter(bool))[0])
    elif mutation == "replace" and arrays:
        arrays[draw(st.integers(0, len(arrays) - 1))] = draw(ARRAYS.filter(bool))[0]
    return method, arrays


@FUZZ
@given(call=table_calls())
def test_fuzz_table_calls_near_their_bounds(server, call):
    """Calls on real tables, plausible but for their values (ids and row ranges past the
    table's bounds, NaN and inf rows, any optimizer kind, a missing or extra array): each is
    answered or refused with a handled error, and the connection still serves."""
    _check_call(server, *call)


@FUZZ
@given(
    # create and begin (a new run of the job, which drops the tables) change what is served
    method=st.sampled_from(sorted(tables.Registry.METHODS - {"create", "begin"})),
    arrays=ARRAYS,
)
def test_fuzz_calls_with_wrong_arrays_keep_the_connection(server, method, arrays):
    """Well-formed frames with the wrong arrays (arity, dtypes, shapes, ids out of range,
    unknown tables, NaN): each gets its own answer or an error on the same connection, which
    then still serves. (`create` is left out: a generated size could take the machine's
    memory, which is a ps's job to hold.)"""
    _check_call(server, method, arrays)


@pytest.mark.parametrize(
    "method, arrays, named",
    [
        ("lookup", [np.int64(1)], "lookup takes (table, ids, step), not 1 array(s)"),
        ("read", [np.int64(1), np.int64(0), np.int64(2), np.int64(0), np.int64(0)], "read takes (table, lo, hi, step), not 5"),
        ("read", [np.int64(1), np.array([0, 1], np.int64), np.int64(2), np.int64(0)],
         "read: lo is a single integer, not an array of shape (2,)"),
    ],
)  # fmt: skip
def test_a_call_with_the_wrong_arrays_is_refused_naming_the_arguments(
    server, method, arrays, named
):
    """The cases the fuzzers above find only when they happen to draw them: a missing or
    extra array, an array where a number belongs, refused by name before the method runs."""
    _, worker = server
    _create_fuzzed(worker)
    worker.send(method, *arrays)
    with pytest.raises(wire.TableServerError, match=re.escape(named)):
        worker.receive(method)
    _still_serves(worker)


def _check_call(server, method, arrays):
    """Sends the call; its answer or a handled refusal (HANDLED), then the server still serves."""
    _, worker = server
    _create_fuzzed(worker)
    worker.send(method, *arrays)
    try:
        worker.receive(method)
        ANSWERED[method] += 1
    except wire.TableServerError as e:
        kind = str(e).split("failed: ", 1)[1].split(":", 1)[0]
        assert kind in HANDLED, e  # a handled refusal, not an internal error
    _still_serves(worker)


def test_the_fuzzer_reached_the_tables():
    """Generated calls were answered, not only refused: the fuzzer reached real tables."""
    if not ANSWERED:
        pytest.skip(
            "it checks what the fuzz tests of this file reached, and they were deselected: run "
            "them with it (`pytest tests/test_wire.py -k 'fuzz or reached'`)"
        )
    for method in ("lookup", "push", "read", "write", "read_slot"):
        assert ANSWERED[method] > 0, dict(ANSWERED)


def test_worker_counts_past_the_cap_are_refused(server):
    """A synchronous group keeps state per worker: a frame claiming 2^40 workers is refused
    before anything of that length is made."""
    _, worker = server
    tracemalloc.reset_peak()
    held = tracemalloc.get_traced_memory()[0]
    calls = [
        ("steps_open", np.int64(7), np.int64(2**40), np.int64(1)),
        ("steps_begin_run", np.int64(7), np.zeros(16, np.uint8), np.int64(2**40), np.int64(1)),
        ("steps_join_run", np.int64(7), np.int64(1), np.zeros(16, np.uint8), np.int64(2**40),
         np.int64(1)),
        ("steps_exchange", np.int64(7), np.int64(0), np.int64(2**40), np.int64(0),
         np.zeros(1), np.int64(1)),
    ]  # fmt: skip
    for method, *arrays in calls:
        worker.send(method, *arrays)
        with pytest.raises(wire.TableServerError, match="a group has 1 to 65,536"):
            worker.receive(method)
    assert tracemalloc.get_traced_memory()[1] - held < CAP
    _still_serves(worker)


def test_caps_and_the_read_deadline(server, monkeypatch):
    """The caps are named in the errors; a client that trickles a frame is dropped once the
    read deadline passes, and the others are served meanwhile."""
    port, worker = server
    huge = _frame({"method": "read", "arrays": [["<f4", [CAP // 4 + 1]]]})
    (reply,) = _replies(_exchange(port, huge))
    assert f"more than {CAP:,} bytes of arrays (TFSTRAT_WIRE_MAX_BYTES)" in reply["error"], reply
    (reply,) = _replies(_exchange(port, _frame(b"x" * 10, length=2**32 - 1)))
    assert "frame header of 4,294,967,295 bytes" in reply["error"], reply
    (reply,) = _replies(_exchange(port, _frame(b"{not json")))
    assert "not JSON" in reply["error"], reply
    (reply,) = _replies(_exchange(port, _frame({"method": "stats", "arrays": [["|O", [1]]]})))
    assert "cannot cross the wire" in reply["error"], reply

    monkeypatch.setenv("TFSTRAT_WIRE_READ_DEADLINE", "0.5")  # read when a server starts
    slow_port = free_port()
    slow_server, _ = tables.serve_tables("127.0.0.1", slow_port, "ps:1")
    frame = _frame({"method": "stats", "arrays": []})
    with socket.create_connection(("127.0.0.1", slow_port), timeout=10) as slow:
        secret.connect(slow, secret.key(), "ps:1's table server", 10)
        start = time.monotonic()
        for byte in frame[:6]:  # one byte every 0.2 s: the frame would take 5 s
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                break
            _still_serves(worker)  # the other server, and this one's other clients, go on
            time.sleep(0.2)
        got = b""
        try:
            while chunk := slow.recv(65536):
                got += chunk
        except OSError:
            pass
        took = time.monotonic() - start
    slow_server.close()
    (reply,) = _replies(got)
    assert "did not arrive whole in 0.5 s" in reply["error"], reply
    assert took < 5, took
    monkeypatch.setenv("TFSTRAT_WIRE_READ_DEADLINE", "soon")  # refused when a server starts
    with pytest.raises(ValueError, match="TFSTRAT_WIRE_READ_DEADLINE='soon'"):
        tables.serve_tables("127.0.0.1", free_port(), "ps:2")


def test_a_call_over_the_cap_is_refused_before_sending(server):
    """A worker's own call over TFSTRAT_WIRE_MAX_BYTES fails on the worker, naming the cap,
    and its connection stays usable (nothing was sent)."""
    _, worker = server
    ids = np.zeros(CAP // 8 + 1, np.int64)
    with pytest.raises(wire.TableServerError, match="over the table server's cap"):
        worker.send("lookup", np.int64(TABLE), ids, np.int64(-1))
    _still_serves(worker)
