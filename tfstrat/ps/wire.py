"""Requests to a ps task's table server over plain TCP: a method name and NumPy arrays each way.

Hybrid's step makes two calls per ps (a lookup, a push) and both sit on the step's critical
path, so their fixed cost matters. TensorFlow's `tf.distribute.experimental.rpc` cost 0.9 ms
for an empty call on loopback (a traced function and a `py_function` on each side, gRPC
between) and refused messages over 4 MiB; measured in the sparse benchmark, a lookup of ~700
rows took 4.7 ms and a push 3.8 ms of a 58 ms step. Here a call is one frame each way on a
socket each worker keeps open to each ps, handled by a thread per connection on the ps:

    frame = u32 header length, header (JSON: method or error, [dtype, shape] per array),
            then each array's bytes, in order

Every call has the strategy's timeout; a ps that stops, or does not answer in time, fails the
call with an error naming the method, the ps task and its address.

A frame that is not one of ours never costs the server more than its caps (read when it
starts), checked before anything is allocated: a header of at most `MAX_HEADER` bytes that is a JSON object, at most
`MAX_ARRAYS` arrays of numeric dtypes with non-negative shapes, at most `max_frame_bytes()`
bytes of arrays (`TFSTRAT_WIRE_MAX_BYTES`, 1 GiB: a lookup of a million 64-wide rows is 256
MiB; checkpoints move 3 MiB a call), and a frame begun must arrive whole within
`read_deadline()` seconds (`TFSTRAT_WIRE_READ_DEADLINE`, 120 s), so a client that sends a byte
a second is dropped. Such a frame is answered with an error that names the problem, then the
connection is closed (the rest of its bytes cannot be framed); the other connections are
served as before. A bad call in a good frame (an unknown method, wrong arrays, an id out of
range) is answered with its error and the connection stays open.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import numpy as np

from tfstrat.cluster import ports as _ports
from tfstrat.cluster import secret as _secret
from tfstrat.errors import TableServerError, UsageError

logger = logging.getLogger(__name__)
_LENGTH = struct.Struct("<I")
MAX_HEADER = 1 << 20  # a header is a few hundred bytes: more is not one of our frames
MAX_ARRAYS = 16  # a call carries at most 8
DTYPES = frozenset(
    np.dtype(t).str for t in ("bool", "uint8", "int32", "int64", "float32", "float64")
)


def max_frame_bytes() -> int:
    """The most array bytes one frame may carry (`TFSTRAT_WIRE_MAX_BYTES`, default 1 GiB)."""
    return _positive("TFSTRAT_WIRE_MAX_BYTES", 1 << 30, int)


def read_deadline() -> float:
    """Seconds a begun frame has to arrive whole (`TFSTRAT_WIRE_READ_DEADLINE`, default 120)."""
    return _positive("TFSTRAT_WIRE_READ_DEADLINE", 120.0, float)


def _positive(name: str, default, kind):
    import os

    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise UsageError(f"Received: {name}={raw!r}. Use a positive number, or unset it.")
    return value


class BadFrame(UsageError):
    """A frame that is not one of tfstrat's: the server answers it, then closes the connection."""


def _send(sock: socket.socket, header: dict, arrays, cap: int | None = None) -> None:
    arrays = [np.asarray(a, order="C") for a in arrays]  # keeps 0-d arrays 0-d
    if cap is not None and sum(a.nbytes for a in arrays) > cap:
        raise UsageError(
            f"a call of {sum(a.nbytes for a in arrays):,} bytes, over the table server's cap of "
            f"{cap:,} (TFSTRAT_WIRE_MAX_BYTES, the same on the workers and the ps): raise it, "
            "or use smaller batches"
        )
    header["arrays"] = [[a.dtype.str, list(a.shape)] for a in arrays]
    head = json.dumps(header).encode()
    sock.sendall(b"".join([_LENGTH.pack(len(head)), head, *(a.tobytes() for a in arrays)]))


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """`n` bytes; with a `deadline` (time.monotonic()), all of them before it (TimeoutError)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes arrived before the read deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the connection closed")
        got += k
    return buf


def _layout(header, cap: int | None) -> list[tuple[np.dtype, tuple[int, ...]]]:
    """The arrays a header announces, checked against the caps (`BadFrame` names the problem)."""
    if not isinstance(header, dict):
        raise BadFrame(f"a frame header must be a JSON object, not {type(header).__name__}")
    announced = header.pop("arrays", None)
    if not isinstance(announced, list) or len(announced) > MAX_ARRAYS:
        raise BadFrame(f"a frame header's 'arrays' must be a list of at most {MAX_ARRAYS}")
    layout, total = [], 0
    for item in announced:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
            raise BadFrame(f"an array must be announced as [dtype, shape], not {item!r:.80}")
        dtype, shape = item
        if dtype not in DTYPES:
            raise BadFrame(
                f"dtype {dtype!r:.40} cannot cross the wire (use one of {sorted(DTYPES)})"
            )
        if len(shape) > 8 or not all(type(d) is int and 0 <= d < 2**31 for d in shape):
            raise BadFrame(f"shape {shape!r:.80} is not a list of at most 8 sizes in 0..2^31-1")
        dtype = np.dtype(dtype)
        total += int(np.prod(shape, dtype=object)) * dtype.itemsize
        if cap is not None and total > cap:
            raise BadFrame(
                f"a frame of more than {cap:,} bytes of arrays (TFSTRAT_WIRE_MAX_BYTES); "
                "split the call"
            )
        layout.append((dtype, tuple(shape)))
    return layout


def _recv(
    sock: socket.socket, deadline_s: float | None = None, cap: int | None = None
) -> tuple[dict, list[np.ndarray]]:
    """One frame. With `deadline_s`, once its first byte is in, the rest must arrive within
    that many seconds (the server's guard against clients that trickle bytes); with `cap`, at
    most that many bytes of arrays."""
    if deadline_s is None:  # a worker reading an answer: one read for the length
        deadline, head = None, _recv_exact(sock, _LENGTH.size)
    else:  # the server: the deadline starts with the frame's first byte
        first = _recv_exact(sock, 1)
        deadline = time.monotonic() + deadline_s
        head = first + _recv_exact(sock, _LENGTH.size - 1, deadline)
    (length,) = _LENGTH.unpack(bytes(head))
    if length > MAX_HEADER:
        raise BadFrame(f"a frame header of {length:,} bytes (at most {MAX_HEADER:,})")
    raw = bytes(_recv_exact(sock, length, deadline))
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not JSON, or JSON no header of ours has
        raise BadFrame(
            f"a frame header that is not JSON ({type(e).__name__}: {str(e)[:100]})"
        ) from None
    arrays = []
    for dtype, shape in _layout(header, cap):
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        data = np.frombuffer(_recv_exact(sock, n, deadline), dtype)
        try:
            arrays.append(data.reshape(shape))
        except ValueError as e:  # e.g. a 0 beside sizes whose product overflows
            raise BadFrame(f"shape {list(shape)!r:.80} cannot be made: {e}") from None
    return header, arrays


# -- the ps's side ------------------------------------------------------------------------


class Server:
    """Serves `handler.METHOD(*arrays) -> array or list of arrays` to every connection, for the
    names in `handler.METHODS`."""

    def __init__(self, listener: socket.socket, handler, name: str):
        self.listener, self.handler, self.name = listener, handler, name
        # Read once: a bad value fails here, when the server starts, naming the variable.
        self.cap, self.deadline = max_frame_bytes(), read_deadline()
        self.key = _secret.key()
        host, port = listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        threading.Thread(target=self._accept, name=f"{name} accept", daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as e:
                if self.listener.fileno() == -1:
                    return  # closed
                logger.warning("%s: accept failed (%s); still listening", self.name, e)
                time.sleep(0.1)  # e.g. out of file descriptors for a moment
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket):
        with conn:
            try:  # only the job's tasks get in (`tfstrat.cluster.secret`); refusals are logged
                _secret.accept(conn, self.key, self.name)
            except _secret.Refused:
                return
            while True:
                try:
                    conn.settimeout(None)  # idle between calls as long as the worker likes
                    header, arrays = _recv(conn, self.deadline, self.cap)
                except TimeoutError as e:
                    self._drop(conn, f"a frame did not arrive whole in {self.deadline:g} s: {e}")
                    return
                except (EOFError, OSError):
                    return  # the worker is gone (or only checked that the port is open)
                except BadFrame as e:  # not our protocol: answered, then dropped
                    self._drop(conn, str(e))
                    return
                method = header.get("method", "")
                try:
                    if method not in self.handler.METHODS:
                        raise UsageError(f"no method {method!r}")
                    fn = getattr(self.handler, method)
                    _check_arity(method, fn, arrays)
                    out = fn(*arrays)
                    out = out if isinstance(out, (list, tuple)) else [out]
                    reply = {}
                except Exception as e:  # the worker raises it, naming this ps
                    logger.exception("%s: %s failed", self.name, method)
                    out, reply = [], {"error": f"{type(e).__name__}: {e}"}
                try:
                    conn.settimeout(self.deadline)  # a worker that stops reading is dropped
                    _send(conn, reply, [np.asarray(a) for a in out])
                except OSError:
                    return

    def _drop(self, conn: socket.socket, why: str) -> None:
        """Answers a frame that is not one of ours with its problem, then closes."""
        try:
            host, port = conn.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "a closed peer"
        logger.warning("%s: dropped the connection from %s: %s", self.name, peer, why)
        try:
            conn.settimeout(1.0)
            _send(conn, {"error": f"BadFrame: {why}"}, [])
        except OSError:
            pass

    def close(self):
        self.listener.close()


# The arguments of the servers' methods that are single numbers: integers, or (a weight) any
# real number. A frame with an array there is refused naming it, before the method runs.
_INTEGERS = frozenset(
    "table dim workers droppers key value step lo hi replica group worker ms call required "
    "slot".split()
)


def _check_arity(method: str, fn, arrays) -> None:
    """A call with the wrong number of arrays, or an array where a number belongs, is refused
    naming the method's arguments (not a TypeError from inside the server)."""
    import inspect

    signature = inspect.signature(fn)
    try:
        bound = signature.bind(*arrays)
    except TypeError:
        names = ", ".join(signature.parameters)
        raise UsageError(f"{method} takes ({names}), not {len(arrays)} array(s)") from None
    for name, value in bound.arguments.items():
        kinds = "iub" if name in _INTEGERS else "iubf" if name == "rows" else None
        if kinds and (np.ndim(value) != 0 or np.asarray(value).dtype.kind not in kinds):
            raise UsageError(
                f"{method}: {name} is a single {'integer' if name != 'rows' else 'number'}, "
                f"not an array of shape {np.shape(value)} and dtype {np.asarray(value).dtype}"
            )


def serve(host: str, port: int, handler, task: str, what: str) -> Server:
    """Starts serving `handler` on `host`:`port`; a `tfstrat.errors.ListenError` names `task`'s `what`
    if it cannot listen."""
    return Server(_ports.listen(host, port, task, what), handler, f"{task} {what}")


# -- the worker's side --------------------------------------------------------------------


class Connection:
    """One worker's connection to one ps task's table server. Not thread-safe: its user
    (`tfstrat.ps.remote.TableClients`) makes one call at a time."""

    def __init__(self, address: str, timeout: float, task: str):
        self.address, self.timeout, self.task = address, timeout, task
        self.cap = max_frame_bytes()
        self.key = _secret.key()  # read now: an unreadable secret file fails here, by name
        self._sock: socket.socket | None = None

    def what(self, method: str) -> str:
        return f"{method} on {self.task} (table server at {self.address})"

    @property
    def is_open(self) -> bool:
        """False after a failure closed the connection (its unread answers with it)."""
        return self._sock is not None

    def _connected(self) -> socket.socket:
        if self._sock is None:
            host, port = _ports.split(self.address)
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    sock = socket.create_connection((host, int(port)), timeout=self.timeout)
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise TableServerError(
                            f"Could not connect to {self.task}'s table server at {self.address} "
                            f"within {self.timeout:g} s ({e}). Is the ps task running?"
                        ) from None
                    time.sleep(0.05)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
            try:
                _secret.connect(sock, self.key, f"{self.task}'s table server", self.timeout)
            except _secret.Refused as e:
                sock.close()
                raise TableServerError(
                    f"tfstrat: could not join {self.task}'s table server at {self.address}: {e}"
                ) from None
            self._sock = sock
        return self._sock

    def send(self, method: str, *arrays) -> None:
        """The first half of a call (`receive` is the second): lets a caller ask several ps
        tasks at once."""
        try:
            _send(self._connected(), {"method": method}, [np.asarray(a) for a in arrays], self.cap)
        except UsageError as e:  # too large: nothing was sent, the connection stays
            raise TableServerError(f"tfstrat: {self.what(method)} refused: {e}") from None
        except BaseException as e:  # a frame half sent (even on Ctrl-C) ends the connection
            self._fail(method, e)

    def receive(self, method: str) -> list[np.ndarray]:
        try:
            header, arrays = _recv(self._sock)
        except BaseException as e:  # a frame half read (even on Ctrl-C) ends the connection
            self._fail(method, e)
        if "error" in header:
            raise TableServerError(f"tfstrat: {self.what(method)} failed: {header['error']}")
        return arrays

    def _fail(self, method: str, error: BaseException):
        """Closes the connection (a half-read frame cannot be resumed) and raises, naming it."""
        self.close()
        if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: as they are
            raise error
        if isinstance(error, TimeoutError):
            why = f"no answer within {self.timeout:g} s"
        elif isinstance(error, (EOFError, ConnectionError)):
            why = "the connection closed: did the ps task stop? Its own output says why"
        elif isinstance(error, TableServerError):
            raise error
        else:
            why = repr(error)
        raise TableServerError(f"tfstrat: {self.what(method)} failed: {why}") from error

    def close(self):
        """Drops the connection (an unanswered request with it); the next call reconnects."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
