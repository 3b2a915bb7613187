"""A ring all-reduce over plain TCP sockets between the workers: tfstrat's "tcp" transport.

TensorFlow's collectives between two local processes take 2-3 ms even for 4 bytes and carry
about 0.2 GB/s over gRPC, where one loopback TCP stream carries about 4 GB/s (`tfstrat bench
allreduce`). This is the classic ring (reduce-scatter, then all-gather: each worker sends
2(n-1)/n of the data) on one TCP connection to the next worker, with NumPy doing the sums; and
the ring all-gather that carries packed sparse rows.

Every message carries a header (call number, bytes), so workers that disagree on what they
are reducing fail with an error naming both sides instead of mixing data. Every socket
operation has the strategy's timeout.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time

import numpy as np

from tfstrat import _ports

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!QQ")  # call number, payload bytes
_HELLO = struct.Struct("!II")  # sender rank, group size


class RingError(RuntimeError):
    """A peer failed, timed out, or disagreed about the call."""


class Ring:
    """One worker's place in the ring: a connection from the previous worker, one to the next.

    Args:
        rank: this worker's index.
        addresses: "host:port" of every worker's ring listener, by rank.
        listener: this worker's bound, listening socket (at addresses[rank]).
        timeout: seconds any connect, send or receive may take.
        names: how errors name each worker (e.g. TensorFlow's "/job:worker/replica:0/task:1").
    """

    def __init__(
        self,
        rank: int,
        addresses: list[str],
        listener: socket.socket,
        timeout: float,
        names: list[str] | None = None,
    ):
        self.rank, self.size, self.timeout = rank, len(addresses), timeout
        self.addresses = addresses
        names = names or [f"worker {i}" for i in range(self.size)]
        self.names = [f"{n} (ring at {a})" for n, a in zip(names, addresses)]
        self.calls = 0
        self._lock = threading.Lock()
        nxt, prev = (rank + 1) % self.size, (rank - 1) % self.size
        self._next = _connect(addresses[nxt], timeout, self.names[nxt])
        self._next.sendall(_HELLO.pack(rank, self.size))
        self._prev = _accept(listener, timeout, prev, self.size, self.names[prev])
        listener.close()
        self._error: BaseException | None = None
        self._sends: queue.Queue = queue.Queue()
        self._sent: queue.Queue = queue.Queue()
        threading.Thread(target=self._send_loop, name="tfstrat-ring-send", daemon=True).start()

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """Sum of `x` over every worker (same shape and dtype on all), as a new array."""
        return self._call(self._all_reduce, x)

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """Every worker's `x` concatenated along axis 0, by rank. The workers' `x` share their
        dtype and the shape of a row (`x.shape[1:]`); the row counts may differ."""
        return self._call(self._all_gather, x)

    def _call(self, fn, x):
        """One call at a time; after a failure the ring is broken for good (a half-read
        message would otherwise be taken for the next call's), and says why."""
        with self._lock:
            if self._error is not None:
                raise RingError(f"the ring failed earlier and cannot be used: {self._error}")
            self.calls += 1
            try:
                return fn(np.asarray(x))
            except BaseException as e:
                self._error = e
                raise

    def _all_reduce(self, x: np.ndarray) -> np.ndarray:
        out = np.array(x, copy=True).reshape(-1)
        if self.size == 1 or out.size == 0:
            return out.reshape(x.shape)
        n, r = self.size, self.rank
        bounds = np.linspace(0, out.size, n + 1).astype(np.int64)
        chunk = lambda i: out[bounds[i % n] : bounds[i % n + 1]]  # noqa: E731
        scratch = np.empty(bounds[1] - bounds[0] + 1, out.dtype)
        for step in range(n - 1):  # reduce-scatter: chunk r+1 ends up summed here
            incoming = chunk(r - step - 1)
            self._send(chunk(r - step))
            buf = scratch[: incoming.size]
            self._recv(buf)
            self._wait_sent()
            np.add(incoming, buf, out=incoming)
        for step in range(n - 1):  # all-gather: pass the summed chunks around
            self._send(chunk(r + 1 - step))
            self._recv(chunk(r - step))
            self._wait_sent()
        return out.reshape(x.shape)

    def _all_gather(self, x: np.ndarray) -> np.ndarray:
        n, r = self.size, self.rank
        blocks = [None] * n
        blocks[r] = np.ascontiguousarray(x)
        for step in range(n - 1):  # pass each block on until it has gone round
            self._send(blocks[(r - step) % n])
            blocks[(r - step - 1) % n] = self._recv_rows(x.dtype, x.shape[1:])
            self._wait_sent()
        return np.concatenate(blocks, axis=0)

    def set_timeout(self, timeout: float) -> None:
        """Every later send and receive may take up to `timeout` seconds."""
        self.timeout = timeout
        for s in (self._next, self._prev):
            s.settimeout(timeout)

    def close(self):
        for s in (self._next, self._prev):
            try:
                s.close()
            except OSError:
                pass
        self._sends.put(None)

    # -- framing ------------------------------------------------------------------------

    def _send(self, array: np.ndarray):
        self._sends.put((self.calls, array))

    def _wait_sent(self):
        try:  # the header and the payload may each take up to the timeout
            error = self._sent.get(timeout=2 * self.timeout + 1)
        except queue.Empty:
            error = (
                f"sending to {self.names[(self.rank + 1) % self.size]} took over {self.timeout} s"
            )
        if error:
            raise RingError(error)

    def _send_loop(self):
        while (item := self._sends.get()) is not None:
            call, array = item
            try:
                data = _bytes_of(np.ascontiguousarray(array))
                self._next.sendall(_HEADER.pack(call, data.nbytes))
                self._next.sendall(data)
                self._sent.put(None)
            except Exception as e:  # noqa: BLE001 (handed to the waiting call)
                self._sent.put(
                    f"sending to {self.names[(self.rank + 1) % self.size]} failed: {e!r}"
                )

    def _recv(self, buf: np.ndarray):
        self._recv_header(buf.nbytes)
        prev = self.names[(self.rank - 1) % self.size]
        _read_into(self._prev, _bytes_of(buf), prev, self.timeout)

    def _recv_rows(self, dtype, row_shape) -> np.ndarray:
        """A block of whole rows of `row_shape`, as many as the sender sent."""
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        nbytes = self._recv_header(None, row_bytes)
        buf = np.empty((nbytes // row_bytes if row_bytes else 0, *row_shape), dtype)
        prev = self.names[(self.rank - 1) % self.size]
        _read_into(self._prev, _bytes_of(buf), prev, self.timeout)
        return buf

    def _recv_header(self, nbytes_expected: int | None, multiple_of: int = 1) -> int:
        prev = self.names[(self.rank - 1) % self.size]
        call, nbytes = _HEADER.unpack(_read(self._prev, _HEADER.size, prev, self.timeout))
        fits = (
            nbytes == nbytes_expected
            if nbytes_expected is not None
            else (nbytes % multiple_of == 0 if multiple_of else nbytes == 0)
        )
        if call != self.calls or not fits:
            expected = (
                f"{nbytes_expected} bytes"
                if nbytes_expected is not None
                else f"a multiple of {multiple_of} bytes"
            )
            raise RingError(
                f"{prev} sent call {call} with {nbytes} bytes; {self.names[self.rank]} "
                f"expected call {self.calls} with {expected}. The workers are at different "
                "places of their programs: a worker stopped early (stop_training, an "
                "exception, or the end of its data), or they run different programs or models."
            )
        return nbytes


def _bytes_of(array: np.ndarray) -> memoryview:
    """The bytes of a contiguous array as a writable-if-the-array-is view (any dtype, even
    ones the buffer protocol cannot cast, such as bfloat16)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def listen(host: str, port: int = 0, task: str = "this worker") -> socket.socket:
    """A listening socket on `host`:`port` (0: the OS picks) for `Ring`'s previous worker."""
    return _ports.listen(host, port, task, "ring")


def _tune(s: socket.socket, timeout: float) -> socket.socket:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(timeout)
    return s


def _connect(address: str, timeout: float, who: str) -> socket.socket:
    host, port = _ports.split(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _tune(socket.create_connection((host, int(port)), timeout=timeout), timeout)
        except OSError as e:
            if time.monotonic() > deadline:
                raise RingError(
                    f"Could not connect to {who} within {timeout} s ({e}). Is it running?"
                ) from e
            time.sleep(0.05)


def _accept(
    listener: socket.socket, timeout: float, rank: int, size: int, who: str
) -> socket.socket:
    listener.settimeout(timeout)
    try:
        conn, _ = listener.accept()
    except TimeoutError as e:
        raise RingError(f"{who} did not connect to this worker's ring within {timeout} s") from e
    conn = _tune(conn, timeout)
    got_rank, got_size = _HELLO.unpack(_read(conn, _HELLO.size, who, timeout))
    if (got_rank, got_size) != (rank, size):
        raise RingError(
            f"expected worker {rank} of {size} to connect, got worker {got_rank} of {got_size}"
        )
    return conn


def _read(s: socket.socket, n: int, peer: str, timeout: float) -> bytes:
    buf = bytearray(n)
    _read_into(s, memoryview(buf), peer, timeout)
    return bytes(buf)


def _read_into(s: socket.socket, view: memoryview, peer: str, timeout: float):
    got = 0
    while got < len(view):
        try:
            n = s.recv_into(view[got:])
        except TimeoutError as e:
            raise RingError(f"{peer} sent nothing for {timeout} s") from e
        except OSError as e:
            raise RingError(f"receiving from {peer} failed: {e!r}") from e
        if n == 0:
            raise RingError(
                f"{peer} closed the connection: it failed or stopped early (stop_training, an "
                "exception, or the end of its data); its own output says why"
            )
        got += n
