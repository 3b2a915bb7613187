"""All-reduce and all-gather over plain TCP sockets between the workers: tfstrat's "tcp"
transport.

TensorFlow's collectives between two local processes take 2-3 ms even for 4 bytes and carry
about 0.2-0.4 GB/s over gRPC, where one loopback TCP stream carries 4-5 GB/s (`tfstrat bench
allreduce`). Each worker holds one TCP connection from the previous worker and one to the next.

One call, `Ring.exchange`, carries everything a training step sends: a dense vector to sum and
any number of blocks of rows to gather (sparse gradients), so a step waits for its peers once.
- **2 workers**: each sends the other its whole vector and its blocks in one message, and sums
  as the bytes arrive (x0 + x1 on one, x1 + x0 on the other: the same bits, addition being
  commutative). The bytes are the ring's (S each way) in one round instead of two. On one
  machine the message goes through shared memory instead (`tfstrat.reduce.shared_memory`):
  each copies it into its own memory file, the TCP connection carries only the header, and
  each sums straight from the other's memory. A vector of 1 KiB or less alone goes over TCP
  in any case, read in one receive (`Ring._pair_small`): there only the latency counts.
- **3+ workers**: the classic ring (reduce-scatter, then all-gather: each worker sends
  2(n-1)/n of the vector); the blocks travel with the reduce-scatter's messages. A vector
  alone streams: each round's bytes go on to the next worker in pieces as they arrive and are
  summed, not once the whole round is in (`Ring._ring_stream`), so the 2(n-1) rounds overlap.
  A vector of 1 KiB or less (flags, counts, a step's extras) alone goes by recursive doubling
  over direct connections instead (`Ring._doubling`): log2(n) rounds, each worker swapping its
  partial sum with the worker whose rank differs in one bit; with blocks to gather, it goes
  around the ring whole with them: n-1 rounds, each worker adding the n vectors in rank order.
  With a power of two of workers, a vector alone of up to 32 KiB goes by recursive halving and
  doubling over the same connections (`Ring._halving`): 2 log2(n) rounds, the ring's bytes.
  Workers in different kinds of call at once (one of these, another a ring call) wait on
  different connections: they fail by the timeout, naming the peer they wait for.
- **Workers on several hosts, several on one of them** (a host is the host part of the
  workers' ring addresses): a vector alone goes in two levels (`Ring._by_hosts`). A host's
  workers sum their vectors among themselves (two: through shared memory), each host's first
  worker all-reduces that sum with the other hosts' first workers in a ring of their own, and
  hands the result back to its host's workers, 64 MiB at a time (so they hear from it at least
  every 64 MiB's sum across, within the ring's timeout however large the vector). Each host's
  link carries 2(H-1)/H of the vector for H hosts, where one flat ring of all N workers carries 2(N-1)/N of it, and waits on H-1
  rounds' latency instead of N-1. These rings connect on the same listeners (the tfstrat
  port). `TFSTRAT_RING_FLAT=1` on any task keeps one plain ring for everything (no two levels,
  no recursive doubling): to compare, or to rule them out.

One thread does it all with non-blocking sockets (poll: send what the kernel takes, receive
what has come, sum what is complete), so no thread hand-off sits on a step's path and the sum
overlaps the transfer; a message of 4 MiB or more is sent by a second thread while the caller
receives, so the kernel's two copies run on two cores. Buffers are kept between calls: a
step's exchange allocates nothing but the gathered blocks (fresh memory would be page-faulted
in every step), and its result reaches TensorFlow without a copy (`Results`).

Every message (a streamed call: its first) carries a header (call number, how many parts and
of what kind: a vector, rows, through shared memory; their sizes), so workers that disagree on
what they exchange fail with an error naming both sides instead of mixing data. A call fails
when no byte moves for the ring's timeout, naming the peer it waits for.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import sys
import threading
import time

import numpy as np

from tfstrat.cluster import ports as _ports
from tfstrat.cluster import secret as _secret
from tfstrat.errors import RingError
from tfstrat.reduce import shared_memory

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!QI")  # call number, parts (`_count`); then one "!Q" size per part
# The parts field: their number, and what they are, so that workers exchanging different kinds
# of things (a sum against a gather, shared memory against TCP) fail even at equal sizes.
_VECTOR = 1 << 30  # the first part is the vector (summed or passed on), the rest rows
_SHARED = 1 << 29  # the parts are in shared memory; the header ends with where
_PARTS = _SHARED - 1
# A message on recursive doubling's or halving's direct connections: call number, parts, its
# bytes, the whole vector's bytes (so workers whose halves match but whose vectors do not fail).
_PAIR = struct.Struct("!QIQQ")
_SIZE = struct.Struct("!Q")
_HELLO = struct.Struct("!II")  # sender rank, group size
# A message at least this large is sent by a thread while the caller receives (measured with
# `tfstrat bench allreduce`: below it, one thread is as fast or faster).
_THREAD_BYTES = 1 << 22
# 3+ workers: a vector to sum of at most this many bytes goes around the ring whole, in n-1
# rounds instead of 2(n-1) (`Ring._ring_small`). The rounds' latency dominates below it:
# measured with `tfstrat bench cluster` (a round takes 25-500 us with 2-16 hosts on 2 CPUs), the
# extra bytes ((n-1) x the vector instead of 2(n-1)/n x) cost less up to 1 KiB at 200 Mbit/s.
_SMALL_VECTOR = 1 << 10
# Two levels (`Ring._by_hosts`): a host's first worker sums across the hosts and hands the sum
# back in pieces of at most this many bytes (one piece's sum across at a time keeps the host's
# other workers within the ring's timeout; 64 MiB take about 1 s at 1 Gbit/s).
_HAND_BACK_PIECE = 64 << 20
# A power of two of workers, 4+: a vector to sum alone larger than `_SMALL_VECTOR` and at most
# this many bytes goes by recursive halving and doubling (`Ring._halving`); larger, by the ring's
# stream. Measured with `tfstrat bench cluster` (8 hosts, 200 Mbit/s links): 1.5-2.2x quicker
# than the stream at 4-16 KiB, 1.0-1.1x at 32 KiB, 1.17x slower at 64 KiB and 1.2-1.4x at
# 1-2 MiB (its rounds start and stop; the stream keeps each link busy), though quicker there
# unshaped. Other worker counts keep the stream: halving's extra steps for them (worker P + i's
# vector to worker i and the sum back) would put 1.5-2x the ring's bytes on those links.
_HALVING_MAX = 32 << 10
# Sums are done in pieces of at least this many bytes as they arrive (fewer numpy calls).
_SUM_PIECE = 1 << 18
# 3+ workers: the reduce-scatter's received bytes are summed, and so may go on to the next
# worker, in pieces of this many bytes (`Ring._ring_stream`).
_STREAM_PIECE = 1 << 16
# Seconds a connection to the ring's listener has to prove it is the previous worker.
_ACCEPT_HANDSHAKE = 5.0
# The largest block of rows another worker may send for one gather (a sparse gradient's rows):
# its size comes from the other worker's header, so it is checked before allocating.
MAX_BLOCK_ENV = "TFSTRAT_RING_MAX_BLOCK_BYTES"
# "1": one plain ring for everything (see the module's docstring).
FLAT_ENV = "TFSTRAT_RING_FLAT"


def max_block_bytes() -> int:
    """The most bytes one gathered block may have (`TFSTRAT_RING_MAX_BLOCK_BYTES`, 4 GiB)."""

    raw = os.environ.get(MAX_BLOCK_ENV)
    try:
        value = int(raw) if raw is not None else 1 << 32
    except ValueError:
        value = 0
    if value <= 0:
        raise RingError(f"Received: {MAX_BLOCK_ENV}={raw!r}. Use a positive number of bytes.")
    return value


class Ring:
    """One worker's place in the ring: a connection from the previous worker, one to the next.

    Args:
        rank: this worker's index.
        addresses: "host:port" of every worker's ring listener, by rank.
        listener: this worker's bound, listening socket (at addresses[rank]).
        timeout: seconds a call may go without a byte moving (and any connect may take).
        names: how errors name each worker (e.g. TensorFlow's "/job:worker/replica:0/task:1").
        key: the job's secret both neighbours must prove (`tfstrat.cluster.secret`); None:
            this task's (`TFSTRAT_SECRET` / `TFSTRAT_SECRET_FILE`).
        flat: this worker wants one plain ring for everything: no two levels, no recursive
            doubling (None: `TFSTRAT_RING_FLAT=1`). They are built only if no worker wants it.
    """

    def __init__(
        self,
        rank: int,
        addresses: list[str],
        listener: socket.socket,
        timeout: float,
        names: list[str] | None = None,
        key: bytes | None = None,
        flat: bool | None = None,
    ):
        self.rank, self.size, self.timeout = rank, len(addresses), timeout
        self.addresses = addresses
        names = names or [f"worker {i}" for i in range(self.size)]
        self._task_names = names
        self.names = [f"{n} (ring at {a})" for n, a in zip(names, addresses)]
        self.calls = 0
        self.max_block = max_block_bytes()  # read now: a bad value fails at start, by name
        #: Bytes this worker has sent through the ring (headers included), for benchmarks.
        self.bytes_sent = 0
        #: Of those, the bytes handed over through shared memory (not on a socket).
        self.shared_bytes = 0
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._scratch_buf: np.ndarray | None = None
        self._results = Results()
        nxt, prev = (rank + 1) % self.size, (rank - 1) % self.size
        key = _secret.key() if key is None else key  # only the job's tasks get in
        # Connecting to the next worker and accepting the previous one run at once: each
        # side's handshake waits for the other's, all around the ring.
        connected: dict = {}

        def connect():
            try:
                sock = _connect(addresses[nxt], timeout, self.names[nxt], key)
                sock.sendall(_HELLO.pack(rank, self.size))
                connected["socket"] = sock
            except BaseException as e:  # raised by the constructor, below
                connected["error"] = e

        connector = threading.Thread(target=connect, name="tfstrat-ring-connect", daemon=True)
        connector.start()
        try:
            self._prev = _accept(listener, timeout, prev, self.size, self.names[prev], key)
        except RingError:
            connector.join(timeout + 1)  # a failed connect names the missing peer: say that
            _close(connected.get("socket"), listener)  # the next worker sees it end now
            if "error" in connected:
                raise connected["error"] from None
            raise
        connector.join(2 * timeout + _secret.HANDSHAKE_SECONDS)
        if "socket" not in connected:
            _close(self._prev, listener)
            raise connected.get("error") or RingError(
                f"connecting to {self.names[nxt]} took over {2 * timeout} s"
            )
        self._next = connected["socket"]
        #: The two-level exchange's rings (`levels`).
        self._levels: tuple[Ring | None, Ring | None] | None = None
        #: Recursive doubling's connections, by the other worker's rank (`_doubling`).
        self._pairs: dict[int, socket.socket] = {}
        self._shared = None
        try:
            # Two workers on one machine (one host in their addresses): through shared memory.
            one_host = len({_ports.split(a)[0] for a in addresses}) == 1
            self._shared = self._share_memory(timeout) if self.size == 2 and one_host else None
            for s in (self._next, self._prev):
                s.setblocking(False)
            self._poll = select.poll()
            self._sender = _Sender(self)
            if self.size > 2:
                if flat is None:
                    flat = os.environ.get(FLAT_ENV, "0").strip().lower() in ("1", "true", "yes")
                # every worker says whether it wants them: all decide alike
                if not self.all_gather(np.array([flat], np.int8)).any():
                    self._levels = self._connect_levels(listener, timeout, key)
                    if self._levels is None:
                        self._pairs = self._connect_pairs(listener, timeout, key)
                else:
                    logger.info("tfstrat ring: one plain ring (%s=1 on a worker)", FLAT_ENV)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()  # (a level's ring: its dup; the flat ring's stays open till here)

    def _share_memory(self, timeout: float):
        """(this worker's region, the other's) if both workers can open each other's memory
        (`tfstrat.reduce.shared_memory`), else None: both decide alike."""
        region = peer = None
        if shared_memory.enabled():
            try:
                region = shared_memory.Region()
            except (OSError, AttributeError) as e:  # no memfd here (a sandbox, not Linux): TCP
                logger.info("tfstrat ring: no shared memory (%s); TCP only", e)
        both = False
        try:
            offer = region.offer() if region else shared_memory.OFFER.pack(0, 0, bytes(16))
            self._next.sendall(offer)
            their_offer = _read(self._prev, shared_memory.OFFER.size, self._prev_name, timeout)
            peer = shared_memory.open_peer(their_offer) if region else None
            self._next.sendall(b"\1" if peer else b"\0")
            both = _read(self._prev, 1, self._prev_name, timeout) == b"\1" and peer is not None
        finally:
            if not both:  # TCP, or the start failed: nothing of it stays open
                for r in (region, peer):
                    if r is not None:
                        r.close()
        if not both:
            return None
        logger.info("tfstrat ring: %s shares memory with this worker", self._prev_name)
        return region, peer

    def _connect_levels(self, listener: socket.socket, timeout: float, key: bytes):
        """The two-level exchange's rings (this host's workers or None when it is alone on its
        host, the hosts' first workers or None on the others), when there are 2 or more
        hosts (the host parts of the addresses) and one of them has several workers; else None.

        They connect on the flat ring's listeners (no other port): first every host's ring,
        then, once every worker has its own (an all-reduce on the flat ring waits for all),
        the ring across, so a listener only ever sees the connection it waits for (the
        caller's all-gather before this waited for every worker's ring connections).
        """
        by_host: dict[str, list[int]] = {}
        for i, address in enumerate(self.addresses):
            by_host.setdefault(_ports.split(address)[0], []).append(i)
        hosts = list(by_host.values())  # by their first rank
        if len(hosts) < 2 or len(hosts) == self.size:
            return None
        host = next(h for h in hosts if self.rank in h)
        leaders = [h[0] for h in hosts]

        def ring_of(ranks: list[int]) -> Ring | None:
            if self.rank not in ranks or len(ranks) < 2:
                return None
            return Ring(
                ranks.index(self.rank),
                [self.addresses[j] for j in ranks],
                listener.dup(),  # closed by that ring; this one stays open for the next
                timeout,
                [self._task_names[j] for j in ranks],
                key,
                flat=False,  # every worker wants them: the levels' own rings may use doubling
            )

        local = ring_of(host)
        try:
            self.all_reduce(np.zeros(1, np.int8))  # every host's ring is made
            across = ring_of(leaders)
        except BaseException:
            _close(local)
            raise
        logger.info(
            "tfstrat ring: %d workers on %d hosts: a vector alone is summed within each host "
            "(%s), across the hosts by one worker each, and handed back within the host",
            self.size, len(hosts), local.transport if local else "alone",
        )  # fmt: skip
        return local, across

    def _connect_pairs(self, listener, timeout: float, key: bytes) -> dict[int, socket.socket]:
        """Recursive doubling's connections (`_doubling`), on this ring's listener: each
        worker accepts its partners of higher rank and connects to those of lower rank (the
        caller's all-gather before this waited for every worker's ring connections, so a
        listener sees only partners from then on)."""
        partners = _partners(self.rank, self.size)
        made: dict[int, socket.socket] = {}
        failed: list[BaseException] = []
        stop = threading.Event()  # the start failed: a socket made after it is closed at once

        def connect():
            try:
                for p in sorted(q for q in partners if q < self.rank):
                    sock = _connect(self.addresses[p], timeout, self.names[p], key)
                    sock.sendall(_HELLO.pack(self.rank, self.size))
                    made[p] = sock
                    if stop.is_set():
                        _close(sock)
                        return
            except BaseException as e:  # raised below
                failed.append(e)

        connector = threading.Thread(target=connect, name="tfstrat-ring-pairs", daemon=True)
        connector.start()
        try:
            higher = {q for q in partners if q > self.rank}
            while higher:  # each within the timeout
                conn, rank = _accept_any(listener, timeout, higher, self.size, self.names, key)
                higher.discard(rank)
                made[rank] = conn
            connector.join(2 * timeout + _secret.HANDSHAKE_SECONDS)
            if failed or len(made) < len(partners):
                raise (
                    failed[0]
                    if failed
                    else RingError(
                        f"connecting to {self.names[min(partners - set(made))]} took over "
                        f"{2 * timeout} s"
                    )
                )
        except BaseException:
            stop.set()
            _close(*made.values())
            raise
        for sock in made.values():
            _kernel_timeout(sock, self.timeout)
        return made

    @property
    def levels(self) -> tuple[Ring | None, Ring | None] | None:
        """The two-level exchange's rings (this host's workers, or None when alone on its
        host; the hosts' first workers, or None on the others), or None: one flat ring."""
        return self._levels

    @property
    def transport(self) -> str:
        """How this worker's messages travel: "shared memory" (two workers on one machine)
        or "tcp"."""
        return "shared memory" if self._shared else "tcp"

    @property
    def _next_name(self) -> str:
        return self.names[(self.rank + 1) % self.size]

    @property
    def _prev_name(self) -> str:
        return self.names[(self.rank - 1) % self.size]

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """Sum of `x` over every worker (same shape and dtype on all), as a new array."""
        return self.exchange(x, [])[0].copy()

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """Every worker's `x` concatenated along axis 0, by rank. The workers' `x` share their
        dtype and the shape of a row (`x.shape[1:]`); the row counts may differ."""
        return self.exchange(None, [x])[1][0]

    def exchange(
        self, reduce: np.ndarray | None, gathers: list[np.ndarray]
    ) -> tuple[np.ndarray | None, list[np.ndarray]]:
        """One round for a whole step: the sum of `reduce` over every worker (None: none), and
        for each of `gathers` every worker's block concatenated along axis 0 by rank (as
        `all_gather`). The summed array may be one of the ring's buffers, reused once
        nothing refers to it any more (`Results`)."""
        with self._lock:
            if self._error is not None:
                raise RingError(f"the ring failed earlier and cannot be used: {self._error}")
            self.calls += 1
            try:
                # asarray first: ascontiguousarray makes a 0-d array 1-d
                gathers = [np.ascontiguousarray(np.asarray(g)) for g in gathers]
                if reduce is not None:
                    reduce = np.asarray(reduce)
                    reduce = reduce if reduce.flags.c_contiguous else reduce.copy()
                if self.size == 1:
                    summed = None if reduce is None else np.array(reduce, copy=True)
                    return summed, [g.copy() for g in gathers]
                if self.size == 2:
                    return self._pair(reduce, gathers)
                if self._levels and reduce is not None and not gathers:
                    return self._by_hosts(reduce), []
                if self._pairs and reduce is not None and not gathers:
                    if reduce.nbytes <= _SMALL_VECTOR:
                        return self._on_pairs(self._doubling, reduce), []
                    if reduce.nbytes <= _HALVING_MAX and not self.size & (self.size - 1):
                        return self._on_pairs(self._halving, reduce), []
                return self._ring(reduce, gathers)
            except BaseException as e:
                self._error = e
                raise

    def set_timeout(self, timeout: float) -> None:
        """Every later call may go up to `timeout` seconds without a byte moving."""
        self.timeout = timeout
        for level in filter(None, self._levels or ()):
            level.set_timeout(timeout)
        for sock in self._pairs.values():
            if sock.fileno() != -1:  # (closed by a failed call)
                _kernel_timeout(sock, timeout)

    def close(self):
        for level in filter(None, getattr(self, "_levels", None) or ()):
            level.close()
        _close(*getattr(self, "_pairs", {}).values())
        if hasattr(self, "_sender"):  # (a start that failed before it)
            self._sender.stop()
        for r in self._shared or ():
            r.close()
        for s in (self._next, self._prev):
            try:
                s.close()
            except OSError:
                pass

    # -- the two algorithms ----------------------------------------------------------------

    def _pair(self, reduce, gathers):
        """Two workers: one message each way holds everything; sum as it arrives."""
        if reduce is not None and not gathers and reduce.nbytes <= _SMALL_VECTOR:
            return self._pair_small(reduce), []
        if self._shared:
            return self._pair_shared(reduce, gathers)
        r = self.rank
        parts, receive = [], []
        summed = None
        if reduce is not None:
            flat = reduce.reshape(-1)
            summed = self._results.get(flat.shape, flat.dtype)
            parts.append(_bytes_of(flat))
            scratch = self._scratch(flat.shape, flat.dtype)
            receive.append(_Summing(scratch, flat, summed))
        gathered = []
        for g in gathers:
            parts.append(_bytes_of(g))
            receive.append(_Rows(g, r, 2, self.max_block))
        self._duplex(parts, receive)
        for target in receive[1 if reduce is not None else 0 :]:
            gathered.append(target.result())
        if summed is not None:
            summed = summed.reshape(reduce.shape)
        return summed, gathered

    def _pair_small(self, reduce: np.ndarray) -> np.ndarray:
        """Two workers, a small vector alone: one message each way over TCP (shared memory
        saves nothing at this size), read whole, then summed: the fewest system calls and
        Python steps, as its latency is all there is. The message is `_duplex`'s for one
        part, so a worker that took the other path is told apart by its header."""
        flat = reduce.reshape(-1)
        payload = _bytes_of(flat)
        head = _HEADER.size + _SIZE.size
        header = _HEADER.pack(self.calls, 1 | _VECTOR) + _SIZE.pack(payload.nbytes)
        outgoing = [memoryview(header + payload)]
        self.bytes_sent += outgoing[0].nbytes
        while self._send_some(outgoing):  # at once, but for a full socket buffer
            if not _wait(self._poll, self._next, select.POLLOUT, self.timeout):
                raise self._stalled(False, True)
        message = bytearray(head + payload.nbytes)
        view, got = memoryview(message), 0
        while got < len(message):
            try:
                k = self._prev.recv_into(view[got:])
            except BlockingIOError:
                if not _wait(self._poll, self._prev, select.POLLIN, self.timeout):
                    raise self._stalled(True) from None
                continue
            except OSError as e:
                raise RingError(f"receiving from {self._prev_name} failed: {e!r}") from e
            if k == 0:
                raise self._closed()
            if got < head <= got + k:  # checked as soon as it is in
                self._check_stream_header(message, payload.nbytes)
            got += k
        theirs = np.frombuffer(message, flat.dtype, offset=head)
        return np.add(flat, theirs).reshape(reduce.shape)

    def _pair_shared(self, reduce, gathers):
        """Two workers on one machine: each copies its message into its shared memory and
        sends only the header; each sums straight from the other's memory (same bits on both:
        x0 + x1 = x1 + x0)."""
        region, peer = self._shared
        parity = self.calls & 1
        flat = None if reduce is None else reduce.reshape(-1)
        summed = None if flat is None else self._results.get(flat.shape, flat.dtype)
        parts = ([] if flat is None else [_bytes_of(flat)]) + [_bytes_of(g) for g in gathers]
        targets = [] if flat is None else [_Summing(None, flat, summed)]
        targets += [_Rows(g, self.rank, 2, self.max_block) for g in gathers]
        descriptor = region.write(self.calls, parts)
        self.shared_bytes += sum(p.nbytes for p in parts)
        incoming = self._duplex(parts, targets, descriptor)
        try:
            views = peer.parts(incoming.extra(), parity, incoming.sizes())
        except OSError as e:  # its larger memory file, gone with it
            raise RingError(f"could not open {self._prev_name}'s shared memory ({e})") from e
        for target, view in zip(targets, views):
            target.take(view)
        if summed is not None:
            summed = summed.reshape(reduce.shape)
        return summed, [t.result() for t in targets[0 if flat is None else 1 :]]

    def _by_hosts(self, reduce: np.ndarray) -> np.ndarray:
        """A vector alone, workers on several hosts: summed within each host, across the
        hosts by each host's first worker, handed back within the host. Every worker gets the
        same bits: each level's result is the same on all of its workers."""
        local, across = self._levels
        before = sum(r.bytes_sent for r in (local, across) if r)
        shared = local.shared_bytes if local else 0
        flat = reduce.reshape(-1)
        mine = local.exchange(flat, [])[0] if local else flat
        # Across and back in pieces: the host's other workers get a piece at least every
        # piece's sum across, so the ring's timeout bounds their wait however large the vector.
        step = max(1, _HAND_BACK_PIECE // max(1, flat.itemsize))
        starts = range(0, max(1, flat.size), step)
        summed = flat if len(starts) == 1 else self._results.get(flat.shape, flat.dtype)
        try:
            if across and len(starts) > 1:  # a piece's call checks its own size: the whole's
                _same_sizes(across, flat.nbytes)
            for start in starts:
                piece = mine[start : start + step]
                if across:  # this host's first worker
                    piece = across.exchange(piece, [])[0]
                if local:  # the first worker's sum, to the others (they send nothing)
                    local.max_block = max(self.max_block, piece.nbytes)  # the cap: sparse rows
                    expected = flat[start : start + step].nbytes
                    piece = local.exchange(None, [piece if across else flat[:0]])[1][0]
                    if piece.nbytes != expected:
                        raise RingError(
                            f"{local.names[0]} handed back {piece.nbytes} bytes for a sum of "
                            f"{expected}: the workers reduce different things"
                        )
                if len(starts) == 1:
                    summed = piece
                else:
                    summed[start : start + step] = piece
        except BaseException:
            if across and local:  # its host's workers, waiting for the sum, fail now naming it
                local.close()
            raise
        self.bytes_sent += sum(r.bytes_sent for r in (local, across) if r) - before
        self.shared_bytes += (local.shared_bytes if local else 0) - shared
        return summed.reshape(reduce.shape)

    def _doubling(self, reduce: np.ndarray) -> np.ndarray:
        """3+ workers, a small vector alone: recursive doubling over direct connections.

        With P the largest power of two <= n, worker P + i first hands its vector to worker
        i; workers 0..P-1 then swap partial sums with the worker whose rank differs in bit 0,
        then 1, ... (log2 P rounds) and add; worker i hands the sum back to P + i. Partners
        add the same two partial sums (a + b = b + a), so every worker gets the same bits."""
        n, r = self.size, self.rank
        big = 1 << (n.bit_length() - 1)
        total = reduce.reshape(-1).copy()
        if r >= big:  # hand it over; the sum comes back
            self._swap(r - big, total, None)
            self._swap(r - big, None, total)
            return total.reshape(reduce.shape)
        other = np.empty_like(total)
        if r + big < n:
            self._swap(r + big, None, other)
            total += other
        bit = 1
        while bit < big:
            self._swap(r ^ bit, total, other)
            total += other
            bit <<= 1
        if r + big < n:
            self._swap(r + big, total, None)
        return total.reshape(reduce.shape)

    def _on_pairs(self, algorithm, reduce: np.ndarray) -> np.ndarray:
        """`algorithm(reduce)` over the direct connections; if it fails they close, so the
        workers waiting on this one in its later rounds fail at once, naming it."""
        try:
            return algorithm(reduce)
        except BaseException:
            _close(*self._pairs.values())
            raise

    def _halving(self, reduce: np.ndarray) -> np.ndarray:
        """A power of two of workers, a mid-sized vector alone: recursive halving, then
        recursive doubling (Rabenseifner's all-reduce), over `_doubling`'s connections:
        2 log2(n) rounds instead of the ring's 2(n-1), and the ring's bytes (each worker sends
        2(n-1)/n of the vector).

        Halving: the workers whose ranks differ in bit log2(n) - 1, then the next lower bit,
        ... each keep one half of the range they share (the lower one: the worker whose bit is
        0), send the other and add the partner's half of it; each ends with one n-th, summed.
        Doubling: the same pairs in reverse order swap their summed parts. Each element is
        summed by one worker and copied to the others, so every worker gets the same bits."""
        n, r = self.size, self.rank
        flat = reduce.reshape(-1)
        whole = flat.nbytes
        total = self._results.get(flat.shape, flat.dtype)
        np.copyto(total, flat)
        other = self._scratch(flat.shape, flat.dtype)
        lo, hi, splits = 0, flat.size, []
        bit = n >> 1
        while bit:  # halving
            mid = lo + (hi - lo) // 2
            splits.append((bit, lo, mid, hi))
            low = not r & bit
            send = total[mid:hi] if low else total[lo:mid]
            lo, hi = (lo, mid) if low else (mid, hi)
            self._swap_pair(r ^ bit, send, other[lo:hi], whole)
            total[lo:hi] += other[lo:hi]
            bit >>= 1
        for bit, lo, mid, hi in reversed(splits):  # doubling: the summed parts, back up
            mine, theirs = ((lo, mid), (mid, hi)) if not r & bit else ((mid, hi), (lo, mid))
            self._swap_pair(r ^ bit, total[slice(*mine)], total[slice(*theirs)], whole)
        return total.reshape(reduce.shape)

    def _swap_pair(
        self, rank: int, send: np.ndarray | None, into: np.ndarray | None, whole: int
    ) -> None:
        """`_swap` for messages of any size, parts of a vector of `whole` bytes: sends and
        receives at once (two blocking sends of more than the sockets hold would wait for
        each other), without blocking."""
        sock, who = self._pairs[rank], self.names[rank]
        outgoing: list[memoryview] = []
        if send is not None:
            payload = _bytes_of(send)
            header = _PAIR.pack(self.calls, 1 | _VECTOR, payload.nbytes, whole)
            outgoing = [memoryview(header), payload]
            self.bytes_sent += len(header) + payload.nbytes
        head = bytearray(_PAIR.size)
        targets = [memoryview(head), _bytes_of(into)] if into is not None else []
        got = 0
        poll = self._poll
        while outgoing or targets:
            moved = False
            if outgoing:
                try:
                    sent = sock.sendmsg(outgoing, (), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    raise RingError(f"sending to {who} failed: {e!r}") from e
                moved = sent > 0
                _advance(outgoing, sent)
                outgoing = [v for v in outgoing if v.nbytes]
            while targets:
                if got == targets[0].nbytes:
                    if targets[0].obj is head:  # the header, checked before the bytes
                        self._check_pair_header(head, into.nbytes, whole, who)
                    targets.pop(0)
                    got = 0
                    continue
                try:
                    k = sock.recv_into(targets[0][got:], 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError as e:
                    raise RingError(f"receiving from {who} failed: {e!r}") from e
                if k == 0:
                    raise self._closed(who)
                got, moved = got + k, True
            if moved or not (outgoing or targets):
                continue
            events = (select.POLLOUT if outgoing else 0) | (select.POLLIN if targets else 0)
            if not _wait(poll, sock, events, self.timeout):
                raise RingError(
                    f"{who} sent nothing for {self.timeout} s"
                    if targets
                    else f"sending to {who} took over {self.timeout} s"
                )

    def _swap(self, rank: int, send: np.ndarray | None, into: np.ndarray | None) -> None:
        """Sends `send` (the whole vector) to worker `rank` and receives its message into
        `into`, each with `_PAIR`'s header, over the direct connection to it."""
        sock, who = self._pairs[rank], self.names[rank]
        whole = (send if send is not None else into).nbytes
        if send is not None:
            payload = _bytes_of(send)
            message = _PAIR.pack(self.calls, 1 | _VECTOR, payload.nbytes, whole) + payload
            self.bytes_sent += len(message)
            try:
                sock.sendall(message)
            except BlockingIOError as e:  # SO_SNDTIMEO
                raise RingError(f"sending to {who} took over {self.timeout} s") from e
            except OSError as e:
                raise RingError(f"sending to {who} failed: {e!r}") from e
        if into is not None:
            head = _PAIR.size
            buf = bytearray(head + into.nbytes)
            view, got = memoryview(buf), 0
            while got < len(buf):
                try:
                    k = sock.recv_into(view[got:])
                except BlockingIOError as e:  # SO_RCVTIMEO
                    raise RingError(f"{who} sent nothing for {self.timeout} s") from e
                except OSError as e:
                    raise RingError(f"receiving from {who} failed: {e!r}") from e
                if k == 0:
                    raise self._closed(who)
                if got < head <= got + k:  # checked as soon as it is in
                    self._check_pair_header(buf, into.nbytes, whole, who)
                got += k
            _bytes_of(into)[:] = view[head:]

    def _ring(self, reduce, gathers):
        """3+ workers: reduce-scatter then all-gather around the ring; the blocks to gather
        ride with the reduce-scatter's messages (each goes n-1 hops)."""
        if reduce is not None and reduce.nbytes <= _SMALL_VECTOR:
            return self._ring_small(reduce, gathers)
        if reduce is not None and not gathers:
            return self._ring_stream(reduce), []
        n, r = self.size, self.rank
        blocks = [[None] * n for _ in gathers]
        for b, g in zip(blocks, gathers):
            b[r] = g
        summed = chunk = None
        if reduce is not None:
            flat = reduce.reshape(-1)
            summed = self._results.get(flat.shape, flat.dtype)
            bounds = np.linspace(0, flat.size, n + 1).astype(np.int64)
            chunk = lambda a, i: a[bounds[i % n] : bounds[i % n + 1]]  # noqa: E731
            scratch = self._scratch((int(bounds[1] - bounds[0]) + 1,), flat.dtype)
        for step in range(n - 1):
            parts, receive = [], []
            if reduce is not None:  # reduce-scatter: chunk r+1 ends up summed here
                sent = chunk(flat if step == 0 else summed, r - step)
                incoming = r - step - 1
                parts.append(_bytes_of(sent))
                size = chunk(flat, incoming).size
                receive.append(
                    _Summing(scratch[:size], chunk(flat, incoming), chunk(summed, incoming))
                )
            for b, g in zip(blocks, gathers):
                parts.append(_bytes_of(b[(r - step) % n]))
                receive.append(_Rows(g, None, None, self.max_block))
            self._duplex(parts, receive)
            for b, target in zip(blocks, receive[len(receive) - len(gathers) :]):
                b[(r - step - 1) % n] = target.result()
        if reduce is not None:
            for step in range(n - 1):  # all-gather: pass the summed chunks around
                target = chunk(summed, r - step)
                self._duplex([_bytes_of(chunk(summed, r + 1 - step))], [_Into(target)])
            summed = summed.reshape(reduce.shape)
        return summed, [np.concatenate(b, axis=0) for b in blocks]

    def _ring_stream(self, reduce):
        """3+ workers, a vector alone: the ring's 2(n-1) rounds as one stream each way.

        Round t sends the chunk this worker received in round t-1 (summed with its own, in
        the reduce-scatter; the all-gather's first round sends the chunk the last sum made
        whole), so a piece of round t leaves as soon as that piece of round t-1 is in (and
        summed), instead of after the whole round: a worker the scheduler ran late holds
        its neighbours for a piece, not for a round. The sums are the same, in the same order,
        as round by round. One header a call (call number, bytes to come) checks the sides
        agree.
        """
        n, r = self.size, self.rank
        flat = reduce.reshape(-1)
        summed = self._results.get(flat.shape, flat.dtype)
        bounds = np.linspace(0, flat.size, n + 1).astype(np.int64)
        item = flat.dtype.itemsize
        rounds = 2 * (n - 1)

        def chunk(a, t):  # round t sends chunk (r - t) and receives chunk (r - t - 1)
            i = t % n
            return a[bounds[i] : bounds[i + 1]]

        scratch = self._scratch((int(bounds[1] - bounds[0]) + 1,), flat.dtype)
        total = sum(chunk(flat, r - t).nbytes for t in range(rounds))
        coming = sum(chunk(flat, r - t - 1).nbytes for t in range(rounds))
        header = _HEADER.pack(self.calls, 1 | _VECTOR) + _SIZE.pack(total)
        self.bytes_sent += len(header) + total
        pending = [memoryview(header)]  # what may go now, in order
        out_t, queued, tail = 0, 0, -1  # the round being queued, its bytes queued, pending[-1]'s
        in_t, got, done = -1, 0, 0  # the round coming in (-1: the header), bytes in, summed
        head = bytearray(len(header))
        target = memoryview(head)

        def arrived(t: int) -> int:
            """Bytes of incoming round t summed (or, in the all-gather, received)."""
            if in_t > t:
                return chunk(flat, r - t - 1).nbytes
            return done if in_t == t else 0

        def start_round(t: int) -> memoryview:
            if t < n - 1:  # reduce-scatter: into scratch, summed into `summed` piece by piece
                return _bytes_of(scratch[: chunk(flat, r - t - 1).size])
            return _bytes_of(chunk(summed, r - t - 1))  # all-gather: in place

        def settle(final: bool) -> None:
            nonlocal done
            upto = got if final or in_t >= n - 1 else got - got % _STREAM_PIECE
            if upto <= done:
                return
            if in_t < n - 1:
                c, lo, hi = r - in_t - 1, done // item, upto // item
                np.add(chunk(flat, c)[lo:hi], scratch[lo:hi], out=chunk(summed, c)[lo:hi])
            done = upto

        poll = self._poll
        registered: set = set()

        def want(sock, flag, on: bool):
            if on and sock not in registered:
                poll.register(sock, flag)
                registered.add(sock)
            elif not on and sock in registered:
                poll.unregister(sock)
                registered.discard(sock)

        try:
            while True:
                moved = False  # poll only once neither side can move
                while out_t < rounds:  # queue what the stream has made ready to send
                    source = flat if out_t == 0 else summed
                    whole = chunk(source, r - out_t)
                    ready = whole.nbytes if out_t == 0 else arrived(out_t - 1)
                    if ready > queued:  # (the all-gather's: as they come)
                        view = _bytes_of(whole)
                        if pending and tail == out_t:  # one view of the round's queued bytes
                            pending[-1] = view[queued - pending[-1].nbytes : ready]
                        else:
                            pending.append(view[queued:ready])
                        tail, queued = out_t, ready
                    if queued < whole.nbytes:
                        break
                    out_t, queued = out_t + 1, 0
                if pending:
                    left = sum(p.nbytes for p in pending)
                    self._send_some(pending)
                    moved = sum(p.nbytes for p in pending) < left
                while in_t < rounds:  # receive what has come
                    if got == len(target):  # the header or a round is complete
                        if in_t < 0:
                            self._check_stream_header(head, coming)
                        else:
                            settle(final=True)
                        in_t, got, done = in_t + 1, 0, 0
                        if in_t < rounds:
                            target = start_round(in_t)
                        continue
                    try:
                        k = self._prev.recv_into(target[got:])
                    except BlockingIOError:
                        break
                    except OSError as e:
                        raise RingError(f"receiving from {self._prev_name} failed: {e!r}") from e
                    if k == 0:
                        raise self._closed()
                    got += k
                    moved = True
                    if in_t >= 0:
                        settle(final=False)
                    elif got >= _HEADER.size:  # another kind of call has a shorter header
                        self._check_stream_header(head, coming, count_only=True)
                receiving = in_t < rounds
                if not (pending or receiving or out_t < rounds):
                    break
                if moved:  # what came in may be ready to go on
                    continue
                want(self._next, select.POLLOUT, bool(pending))
                want(self._prev, select.POLLIN, receiving)
                if not poll.poll(self.timeout * 1000):
                    raise self._stalled(receiving, bool(pending))
        finally:
            for sock in list(registered):
                poll.unregister(sock)
        return summed.reshape(reduce.shape)

    def _stalled(self, receiving: bool, sending: bool = False) -> RingError:
        """No byte moved for the timeout: names the worker(s) waited for."""
        if receiving and sending:  # either neighbour may be the one stuck
            also = "took nothing" if self.size == 2 else f"{self._next_name} took nothing"
            return RingError(f"{self._prev_name} sent nothing for {self.timeout} s, and {also}")
        return RingError(
            f"{self._prev_name} sent nothing for {self.timeout} s"
            if receiving
            else f"sending to {self._next_name} took over {self.timeout} s"
        )

    def _closed(self, who: str | None = None) -> RingError:
        return RingError(
            f"{who or self._prev_name} closed the connection: it failed or stopped early "
            "(stop_training, an exception, or the end of its data); its own output says why"
        )

    def _check_pair_header(self, head: bytes, nbytes: int, whole: int, who: str) -> None:
        """A direct connection's message header (`_PAIR`): this call, `nbytes` of a vector of
        `whole` bytes; else the error naming both sides."""
        call, count, size, total = _PAIR.unpack_from(head)
        if (call, count, size, total) != (self.calls, 1 | _VECTOR, nbytes, whole):
            raise RingError(
                f"{who} sent call {call} with {_describe(count)}: {size} bytes of a vector of "
                f"{total}; {self.names[self.rank]} expected call {self.calls} with 1 part of "
                f"{nbytes} bytes of a vector of {whole} bytes. The workers are at different "
                "places of their programs: a worker stopped early (stop_training, an exception, "
                "or the end of its data), or they run different programs or models."
            )

    def _check_stream_header(
        self, head: bytes, total: int, count_only=False, who: str | None = None
    ) -> None:
        """A one-part call's header (from the previous worker, or `who`): this call, `total`
        bytes; else the error naming both sides."""
        call, count = _HEADER.unpack_from(head)
        (nbytes,) = (total,) if count_only else _SIZE.unpack_from(head, _HEADER.size)
        if (call, count, nbytes) != (self.calls, 1 | _VECTOR, total):
            raise RingError(
                f"{who or self._prev_name} sent call {call} with {_describe(count)} of {nbytes} "
                f"bytes; {self.names[self.rank]} expected call {self.calls} with 1 part of {total} "
                "bytes (a vector). The workers are at different places of their programs: a worker "
                "stopped early (stop_training, an exception, or the end of its data), or they "
                "run different programs or models."
            )

    def _ring_small(self, reduce, gathers):
        """3+ workers, a small vector: every worker's whole vector goes around the ring with
        the blocks, in n-1 rounds instead of reduce-scatter's and all-gather's 2(n-1) (which a
        vector this small spends waiting on each round's latency), and each worker adds the n
        vectors in rank order: the same bits on every worker."""
        n, r = self.size, self.rank
        flat = reduce.reshape(-1)
        vectors = [None] * n
        vectors[r] = flat
        blocks = [[None] * n for _ in gathers]
        for b, g in zip(blocks, gathers):
            b[r] = g
        for step in range(n - 1):
            incoming = (r - step - 1) % n
            vectors[incoming] = np.empty_like(flat)
            parts = [_bytes_of(vectors[(r - step) % n])]
            parts += [_bytes_of(b[(r - step) % n]) for b in blocks]
            receive = [_Into(vectors[incoming])]
            receive += [_Rows(g, None, None, self.max_block) for g in gathers]
            self._duplex(parts, receive)
            for b, target in zip(blocks, receive[1:]):
                b[incoming] = target.result()
        summed = self._results.get(flat.shape, flat.dtype)
        np.copyto(summed, vectors[0])
        for v in vectors[1:]:
            np.add(summed, v, out=summed)
        return summed.reshape(reduce.shape), [np.concatenate(b, axis=0) for b in blocks]

    def _scratch(self, shape, dtype) -> np.ndarray:
        """The receive buffer, kept between calls (fresh memory would be page-faulted in every
        step) and grown to the largest asked for; never returned to the caller."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self._scratch_buf is None or self._scratch_buf.nbytes < nbytes:
            self._scratch_buf = np.empty(nbytes, np.uint8)
        return self._scratch_buf[:nbytes].view(dtype).reshape(shape)

    # -- one duplex round: send `parts` to the next worker, receive into `receive` ------------

    def _duplex(self, parts: list[memoryview], receive: list, shared: bytes | None = None):
        """One round. With `shared` (the descriptor of this call's parts in shared memory),
        only the header and it go over TCP; the returned `_Incoming` holds the other
        worker's header and descriptor."""
        header = _HEADER.pack(self.calls, _count(receive, shared is not None)) + b"".join(
            _SIZE.pack(p.nbytes) for p in parts
        )
        self.bytes_sent += len(header) + sum(p.nbytes for p in parts)
        if shared is not None:
            parts = [memoryview(shared)]
        outgoing = [memoryview(header)] + [p for p in parts if p.nbytes]
        incoming = _Incoming(self, receive, len(shared) if shared is not None else None)
        if shared is None and sum(p.nbytes for p in parts) >= _THREAD_BYTES:
            # Large: the kernel's copies of the send and of the receive run on two cores.
            self._sender.send(outgoing)
            try:
                self._receive(incoming)
            finally:
                self._sender.wait()
            return incoming
        poll = self._poll
        poll.register(self._next, select.POLLOUT)
        poll.register(self._prev, select.POLLIN)
        sending = receiving = True
        try:
            while True:
                if sending and not self._send_some(outgoing):
                    sending = False
                    poll.unregister(self._next)
                if receiving and incoming.receive_some():
                    receiving = False
                    poll.unregister(self._prev)
                if not (sending or receiving):
                    return incoming
                if not poll.poll(self.timeout * 1000):
                    raise self._stalled(receiving, sending)
        finally:
            for s in (self._next, self._prev):
                try:
                    poll.unregister(s)
                except KeyError:
                    pass

    def _receive(self, incoming: _Incoming):
        poll = self._poll
        poll.register(self._prev, select.POLLIN)
        try:
            while not incoming.receive_some():
                if not poll.poll(self.timeout * 1000):
                    raise RingError(f"{self._prev_name} sent nothing for {self.timeout} s")
        finally:
            poll.unregister(self._prev)

    def _send_some(self, outgoing: list[memoryview]) -> bool:
        """Sends what the kernel takes now; False once everything is sent."""
        while outgoing:
            try:
                sent = self._next.sendmsg(outgoing[:64])
            except BlockingIOError:
                return True
            except OSError as e:
                raise RingError(f"sending to {self._next_name} failed: {e!r}") from e
            _advance(outgoing, sent)
        return False


class Results:
    """Result buffers kept between calls, each reused only once nothing refers to it.

    `tf.numpy_function` does not always copy what it returns: an array aligned to 64 bytes
    becomes the output tensor's memory (TF 2.21; a misaligned one is copied), and the tensor
    keeps a reference to it until TensorFlow frees the tensor. So a buffer is handed out again
    only while its reference count is what the pool alone holds; else another one is made.
    Buffers are 64-byte aligned, so the step's result reaches TensorFlow without a copy.
    """

    _KEEP = 4  # buffers per shape; past that, one-off arrays
    _SHAPES = 16  # shapes remembered (a model's steps repeat a few)

    def __init__(self):
        self._pool: dict[tuple, list[list]] = {}  # key -> [[memory, array, count alone]]

    def get(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype))
        entries = self._pool.setdefault(key, [])
        for entry in entries:
            if _references(entry) == entry[2]:
                return entry[1]
        memory, array = _aligned(shape, dtype)
        entry = [memory, array, 0]
        del memory  # counted as the checks above count it: the entry, `array.base`
        entry[2] = _references(entry)
        if len(entries) < self._KEEP:
            entries.append(entry)
        if len(self._pool) > self._SHAPES:
            self._pool.pop(next(iter(self._pool)))
        return array


def _references(entry: list) -> int:
    return sys.getrefcount(entry[0])


def _aligned(shape, dtype, align: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(the memory, an array of `shape` on it starting at a multiple of `align`)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    memory = np.empty(nbytes + align, np.uint8)
    start = -memory.ctypes.data % align
    return memory, memory[start : start + nbytes].view(dtype).reshape(shape)


class _Sender:
    """The thread that sends a large message while the caller receives the previous
    worker's."""

    def __init__(self, ring: Ring):
        self.ring = ring
        self.poll = select.poll()
        self.work = threading.Condition()
        self.outgoing: list | None = None
        self.error: str | None = None
        self.busy = self.stopped = False
        threading.Thread(target=self._loop, name="tfstrat-ring-send", daemon=True).start()

    def stop(self):
        """Ends the thread (after the message it may be sending)."""
        with self.work:
            self.stopped = True
            self.work.notify_all()

    def send(self, outgoing: list[memoryview]):
        with self.work:
            self.outgoing, self.error, self.busy = outgoing, None, True
            self.work.notify_all()

    def wait(self):
        ring = self.ring
        with self.work:  # the sender's own poll gives up after the timeout; this is a backstop
            if not self.work.wait_for(lambda: not self.busy, 2 * ring.timeout + 1):
                self.error = f"sending to {ring._next_name} took over {ring.timeout} s"
        if self.error:
            raise RingError(self.error)

    def _loop(self):
        ring = self.ring
        while True:
            with self.work:
                self.work.wait_for(lambda: self.outgoing is not None or self.stopped)
                if self.outgoing is None:  # stopped
                    return
                outgoing, self.outgoing = self.outgoing, None
            error = None
            try:
                self.poll.register(ring._next, select.POLLOUT)
                while ring._send_some(outgoing):
                    if not self.poll.poll(ring.timeout * 1000):
                        error = f"sending to {ring._next_name} took over {ring.timeout} s"
                        break
            except (RingError, OSError, ValueError) as e:  # ValueError: closed meanwhile
                error = str(e)
            finally:
                try:
                    self.poll.unregister(ring._next)
                except (KeyError, ValueError):
                    pass
            with self.work:
                self.error, self.busy = error, False
                self.work.notify_all()


class _Incoming:
    """The receiving side of one duplex round: the header, then each part into its target."""

    def __init__(self, ring: Ring, targets: list, shared: int | None = None):
        self.ring, self.targets = ring, targets
        # With `shared`, the header ends with that many bytes describing where the parts
        # are in shared memory, and no part follows it.
        self.shared = shared
        self.sized = _HEADER.size + _SIZE.size * len(targets)  # the header up to the sizes
        self.header = bytearray(self.sized + (shared or 0))
        self.got = 0  # bytes of the header read
        self.part = -1  # index of the part being read (-1: the header)
        self.done = False

    def receive_some(self) -> bool:
        """Reads what has come; True once every part is in."""
        ring = self.ring
        while not self.done:
            if self.part >= 0:
                view = self.targets[self.part].view()
            elif self.got < _HEADER.size:  # the count first: the sizes' length depends on it
                view = memoryview(self.header)[self.got : _HEADER.size]
            elif self.got < self.sized:  # the sizes, checked before anything else is read
                view = memoryview(self.header)[self.got : self.sized]
            else:
                view = memoryview(self.header)[self.got :]
            try:
                n = ring._prev.recv_into(view)
            except BlockingIOError:
                return False
            except OSError as e:
                raise RingError(f"receiving from {ring._prev_name} failed: {e!r}") from e
            if n == 0:
                raise ring._closed()
            if self.part >= 0:
                target = self.targets[self.part]
                target.received(n)
                if target.full:
                    target.finish()
                    self._next_part()
                continue
            self.got += n
            if self.got == _HEADER.size:
                self._check_count()
            if self.got == self.sized:
                self._check_sizes()
            if self.got == len(self.header):
                if self.shared is not None:
                    self.done = True
                else:
                    self._next_part()
        return True

    def sizes(self) -> list[int]:
        """The part sizes the other worker's header gave."""
        n, at = len(self.targets), _HEADER.size
        return [_SIZE.unpack_from(self.header, at + i * _SIZE.size)[0] for i in range(n)]

    def extra(self) -> bytes:
        """What follows the sizes in the header (the shared-memory descriptor)."""
        return bytes(self.header[_HEADER.size + _SIZE.size * len(self.targets) :])

    def _next_part(self):
        self.part += 1
        while self.part < len(self.targets) and self.targets[self.part].full:
            self.targets[self.part].finish()  # an empty part
            self.part += 1
        self.done = self.part >= len(self.targets)

    def _check_count(self):
        call, count = _HEADER.unpack_from(self.header)
        expected = _count(self.targets, self.shared is not None)
        if call != self.ring.calls or count != expected:
            self._mismatch(f"call {call} with {_describe(count)}", _describe(expected))

    def _check_sizes(self):
        for i, target in enumerate(self.targets):
            (nbytes,) = _SIZE.unpack_from(self.header, _HEADER.size + i * _SIZE.size)
            if not target.accepts(nbytes):
                self._mismatch(f"call {self.ring.calls} with {nbytes} bytes", target.expected)

    def _mismatch(self, sent: str, expected: str):
        ring = self.ring
        raise RingError(
            f"{ring._prev_name} sent {sent}; {ring.names[ring.rank]} expected call "
            f"{ring.calls} with {expected}. The workers are at different places of their "
            "programs: a worker stopped early (stop_training, an exception, or the end of its "
            "data), or they run different programs or models."
        )


class _Into:
    """A part received straight into a fixed array."""

    def __init__(self, target: np.ndarray):
        self.bytes = _bytes_of(target)
        self.got = 0
        self.expected = f"{self.bytes.nbytes} bytes"

    def accepts(self, nbytes: int) -> bool:
        return nbytes == self.bytes.nbytes

    def view(self) -> memoryview:
        return self.bytes[self.got :]

    def received(self, n: int):
        self.got += n

    @property
    def full(self) -> bool:
        return self.got >= self.bytes.nbytes

    def finish(self):
        pass

    def take(self, source: memoryview):
        """The part from shared memory (its size already accepted)."""
        self.bytes[:] = source


class _Summing(_Into):
    """A part received into `scratch` and summed with `mine` into `out` as it arrives."""

    def __init__(self, scratch: np.ndarray | None, mine: np.ndarray, out: np.ndarray | None):
        # No scratch (shared memory): summed from the other worker's memory by `take`.
        super().__init__(mine if scratch is None else scratch)
        self.scratch, self.mine, self.out = scratch, mine, out
        self.item = mine.dtype.itemsize
        self.summed = 0  # elements summed so far

    def take(self, source: memoryview):
        theirs = np.frombuffer(source, self.mine.dtype)
        np.add(self.mine, theirs, out=self.out)

    def received(self, n: int):
        self.got += n
        ready = self.got // self.item
        if (ready - self.summed) * self.item >= _SUM_PIECE:
            self._sum(ready)

    def finish(self):
        self._sum(self.got // self.item)

    def _sum(self, upto: int):
        s = slice(self.summed, upto)
        np.add(self.mine[s], self.scratch[s], out=self.out[s])
        self.summed = upto


class _Rows(_Into):
    """Another worker's block of rows (any count); with `rank`/`size` (2 workers), received
    into its place of the concatenation, next to this worker's own `mine` block."""

    def __init__(self, mine: np.ndarray, rank: int | None, size: int | None, cap: int):
        self.mine, self.rank, self.size, self.cap = mine, rank, size, cap
        self.row_shape = mine.shape[1:]
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * mine.dtype.itemsize
        self.expected = f"a multiple of {self.row_bytes} bytes"
        self.out = None

    def accepts(self, nbytes: int) -> bool:
        ok = nbytes % self.row_bytes == 0 if self.row_bytes else nbytes == 0
        if ok and nbytes > self.cap:  # checked before anything is allocated
            raise RingError(
                f"the other worker announced a block of {nbytes:,} bytes to gather, over the "
                f"ring's cap of {self.cap:,} ({MAX_BLOCK_ENV}): raise it for larger sparse "
                "gradients or compressed (fp16/bf16) models, or look for a worker that runs "
                "another program"
            )
        if ok:
            rows = nbytes // self.row_bytes if self.row_bytes else 0
            if self.rank is None:
                self.block = np.empty((rows, *self.row_shape), self.mine.dtype)
            else:  # both blocks in one array, by rank: no concatenation after
                mine = self.mine.shape[0]
                self.out = np.empty((mine + rows, *self.row_shape), self.mine.dtype)
                here = slice(0, mine) if self.rank == 0 else slice(rows, rows + mine)
                self.out[here] = self.mine
                self.block = self.out[mine:] if self.rank == 0 else self.out[:rows]
            self.bytes, self.got = _bytes_of(self.block), 0
        return ok

    def result(self) -> np.ndarray:
        return self.out if self.out is not None else self.block


def _advance(outgoing: list[memoryview], sent: int) -> None:
    """Drops the first `sent` bytes of the views in `outgoing` (what a send took)."""
    while sent and outgoing:
        head = outgoing[0]
        if sent >= head.nbytes:
            sent -= head.nbytes
            outgoing.pop(0)
        else:
            outgoing[0] = head[sent:]
            sent = 0


def _bytes_of(array: np.ndarray) -> memoryview:
    """The bytes of a contiguous array as a writable-if-the-array-is view (any dtype, even
    ones the buffer protocol cannot cast, such as bfloat16)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def _close(*sockets) -> None:
    for s in sockets:
        if s is not None:
            try:
                s.close()
            except OSError:
                pass


def listen(host: str, port: int = 0, task: str = "this worker") -> socket.socket:
    """A listening socket on `host`:`port` (0: the OS picks) for `Ring`'s previous worker."""
    return _ports.listen(host, port, task, "ring")


def _tune(s: socket.socket, timeout: float) -> socket.socket:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(timeout)
    return s


def _connect(address: str, timeout: float, who: str, key: bytes) -> socket.socket:
    host, port = _ports.split(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = _tune(socket.create_connection((host, int(port)), timeout=timeout), timeout)
        except OSError as e:
            if time.monotonic() > deadline:
                raise RingError(
                    f"Could not connect to {who} within {timeout} s ({e}). Is it running?"
                ) from e
            time.sleep(0.05)
            continue
        try:
            _secret.connect(sock, key, who, timeout)
        except _secret.Refused as e:
            sock.close()
            raise RingError(f"tfstrat ring: {e}") from None
        return sock


def _accept(
    listener: socket.socket, timeout: float, rank: int, size: int, who: str, key: bytes
) -> socket.socket:
    """The previous worker's connection; anyone else who connects first (without the job's
    secret) is refused, logged and dropped, and the wait goes on."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            listener.settimeout(left)
            conn, _ = listener.accept()
        except TimeoutError as e:
            raise RingError(
                f"{who} did not connect to this worker's ring within {timeout} s"
            ) from e
        conn = _tune(conn, timeout)
        try:
            # A short budget: the previous worker answers the challenge at once, and a
            # stranger that says nothing must not hold the ring's start for long.
            budget = min(_ACCEPT_HANDSHAKE, deadline - time.monotonic())
            _secret.accept(conn, key, "this worker's ring", budget)
            break
        except _secret.Refused:
            conn.close()
    if rank is None:  # the caller reads and checks the hello
        return conn
    got_rank, got_size = _HELLO.unpack(_read(conn, _HELLO.size, who, timeout))
    if (got_rank, got_size) != (rank, size):
        raise RingError(
            f"expected worker {rank} of {size} to connect, got worker {got_rank} of {got_size}"
        )
    return conn


def _partners(rank: int, size: int) -> set[int]:
    """The workers `rank` swaps with in recursive doubling (`Ring._doubling`)."""
    big = 1 << (size.bit_length() - 1)
    if rank >= big:
        return {rank - big}
    bits = {rank ^ (1 << b) for b in range(big.bit_length() - 1)}
    return bits | ({rank + big} if rank + big < size else set())


def _accept_any(
    listener: socket.socket, timeout: float, ranks: set, size: int, names: list, key: bytes
) -> tuple[socket.socket, int]:
    """The next connection of one of `ranks` within `timeout` (each proves the job's secret,
    then says its rank and the group's size); anything else fails naming who is awaited."""
    waiting = ", ".join(names[i] for i in sorted(ranks))
    conn = _accept(listener, timeout, None, size, waiting, key)
    try:
        got_rank, got_size = _HELLO.unpack(_read(conn, _HELLO.size, waiting, timeout))
    except BaseException:
        conn.close()
        raise
    if got_rank not in ranks or got_size != size:
        conn.close()
        raise RingError(
            f"expected one of {sorted(ranks)} of {size} to connect, got worker {got_rank} of "
            f"{got_size}"
        )
    return conn, got_rank


def _same_sizes(ring: Ring, nbytes: int) -> None:
    """Every worker of `ring` has a vector of `nbytes`; else the error naming each's."""
    sizes = ring.all_gather(np.array([nbytes], np.int64))
    if (sizes != nbytes).any():
        each = ", ".join(f"{b} bytes on {w}" for b, w in zip(sizes.tolist(), ring.names))
        raise RingError(
            f"the hosts' first workers sum vectors of different sizes: {each}. They run "
            "different programs or models."
        )


def _count(targets: list, shared: bool) -> int:
    """The header's parts field for a round whose parts are received into `targets`."""
    vector = bool(targets) and not isinstance(targets[0], _Rows)
    return len(targets) | (_VECTOR if vector else 0) | (_SHARED if shared else 0)


def _describe(count: int) -> str:
    n = count & _PARTS
    what = "" if not n else " (the first a vector)" if count & _VECTOR else " (rows)"
    return f"{n} part(s){what}" + (" in shared memory" if count & _SHARED else "")


def _wait(poll: select.poll, sock: socket.socket, event: int, timeout: float) -> bool:
    """Whether `sock` became ready for `event` within `timeout` seconds."""
    poll.register(sock, event)
    try:
        return bool(poll.poll(timeout * 1000))
    finally:
        poll.unregister(sock)


def _kernel_timeout(sock: socket.socket, timeout: float) -> None:
    """`sock` blocks, and its sends and receives fail (BlockingIOError) after `timeout`
    seconds without a byte moving: the kernel's timeout, one system call per receive where
    Python's own polls first."""
    sock.settimeout(None)
    seconds = min(timeout, 2**31 - 1)
    whole, micros = int(seconds), int((seconds % 1) * 1e6)
    value = struct.pack("ll", whole, micros if whole else max(1, micros))  # {0, 0}: none
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _read(s: socket.socket, n: int, peer: str, timeout: float) -> bytes:
    """`n` bytes from `peer` during the ring's start-up."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = s.recv_into(view[got:])
        except TimeoutError as e:
            raise RingError(f"{peer} sent nothing for {timeout} s") from e
        except OSError as e:
            raise RingError(f"receiving from {peer} failed: {e!r}") from e
        if k == 0:
            raise RingError(f"{peer} closed the connection during the ring's start-up")
        got += k
    return bytes(buf)
