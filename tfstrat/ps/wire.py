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
from tfstrat.errors import TableServerError, UsageError

logger = logging.getLogger(__name__)
_LENGTH = struct.Struct("<I")
_MAX_HEADER = 1 << 20  # a header is a few hundred bytes: more is not one of our frames


def _send(sock: socket.socket, header: dict, arrays) -> None:
    arrays = [np.asarray(a, order="C") for a in arrays]  # keeps 0-d arrays 0-d
    header["arrays"] = [[a.dtype.str, list(a.shape)] for a in arrays]
    head = json.dumps(header).encode()
    sock.sendall(b"".join([_LENGTH.pack(len(head)), head, *(a.tobytes() for a in arrays)]))


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the connection closed")
        got += k
    return buf


def _recv(sock: socket.socket) -> tuple[dict, list[np.ndarray]]:
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if length > _MAX_HEADER:
        raise UsageError(f"a frame header of {length} bytes: not a tfstrat table call")
    header = json.loads(bytes(_recv_exact(sock, length)))
    arrays = []
    for dtype, shape in header.pop("arrays"):
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise UsageError(f"dtype {dtype} cannot cross the wire")
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        arrays.append(np.frombuffer(_recv_exact(sock, n), dtype).reshape(shape))
    return header, arrays


# -- the ps's side ------------------------------------------------------------------------


class Server:
    """Serves `handler.METHOD(*arrays) -> array or list of arrays` to every connection, for the
    names in `handler.METHODS`."""

    def __init__(self, listener: socket.socket, handler, name: str):
        self.listener, self.handler, self.name = listener, handler, name
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
            while True:
                try:
                    header, arrays = _recv(conn)
                except (EOFError, OSError):
                    return  # the worker is gone (or only checked that the port is open)
                except (ValueError, KeyError, TypeError) as e:  # not our protocol
                    logger.warning("%s: dropped a connection: %s", self.name, e)
                    return
                method = header.get("method", "")
                try:
                    if method not in self.handler.METHODS:
                        raise UsageError(f"no method {method!r}")
                    fn = getattr(self.handler, method)
                    out = fn(*arrays)
                    out = out if isinstance(out, (list, tuple)) else [out]
                    reply = {}
                except Exception as e:  # the worker raises it, naming this ps
                    logger.exception("%s: %s failed", self.name, method)
                    out, reply = [], {"error": f"{type(e).__name__}: {e}"}
                try:
                    _send(conn, reply, [np.asarray(a) for a in out])
                except OSError:
                    return

    def close(self):
        self.listener.close()


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
            self._sock = sock
        return self._sock

    def send(self, method: str, *arrays) -> None:
        """The first half of a call (`receive` is the second): lets a caller ask several ps
        tasks at once."""
        try:
            _send(self._connected(), {"method": method}, [np.asarray(a) for a in arrays])
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
