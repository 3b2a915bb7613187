"""Two workers on one machine exchange a step's bytes through shared memory, not TCP.

Over loopback TCP every byte is copied twice by the kernel (into the socket, out of it) on
the two cores the workers also compute on; through shared memory a worker copies its message
once into its own region and the other reads it from there, summing straight from it. The
TCP connection still carries each call's header (call number, part sizes), so the workers'
checks of each other and the ring's timeouts stay as they are.

Each worker's region is an anonymous memory file (`memfd_create`): nothing is named in
/dev/shm, so nothing is left behind when a worker dies; the memory goes when both have
closed it. The other worker opens it as /proc/PID/fd/FD, which Linux allows to a process of
the same user in the same PID namespace. At start each worker offers its (PID, FD, a random
token written in the region); the other opens it and checks the token, and shared memory is
used only if both could (two machines, two containers or another user: plain TCP). Set
`TFSTRAT_RING_SHARED_MEMORY=0` on either worker to use TCP.

Layout: two slots, by the parity of the call number. Call k writes slot k % 2; the other
worker reads it during its call k, which ends before it sends call k+1's header, which this
worker receives before its call k+2 writes that slot again. A message larger than a slot
makes a new, larger memory file (its generation goes up by one, in the header); the other
worker keeps its mapping of the old one until it sees the new generation. This worker keeps
each file it made open until two calls after the call that introduced it, by the same
argument: by then the other worker has opened it (a file number closed sooner could be
reused by the next file and opened in its place).
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
import struct

ENV = "TFSTRAT_RING_SHARED_MEMORY"
OFFER = struct.Struct("!II16s")  # pid, fd (0, 0: no offer), token
DESCRIPTOR = struct.Struct("!IIQ")  # fd, generation, slot bytes
_ALIGN = 64  # parts start at multiples of this (the sums run on aligned memory)
_FIRST_SLOT = 1 << 16


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Region:
    """This worker's memory file: what it writes for the other worker."""

    def __init__(self, slot: int = _FIRST_SLOT):
        self.generation = 0
        self.fd = -1
        self.map: mmap.mmap | None = None
        self.made_at = 0  # the call that introduced the current file
        self.retired: list[tuple[int, mmap.mmap, int]] = []  # (fd, map, made_at)
        self._make(slot, 0)
        self.token = secrets.token_bytes(16)
        self.map[:16] = self.token  # read back by the other worker at start

    def _make(self, slot: int, call: int) -> None:
        fd = os.memfd_create("tfstrat-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 2 * slot)
            mapped = mmap.mmap(fd, 2 * slot)
        except BaseException:
            os.close(fd)
            raise
        if self.map is not None:
            self.retired.append((self.fd, self.map, self.made_at))
        self.fd, self.map, self.slot, self.made_at = fd, mapped, slot, call
        self.generation += 1

    def offer(self) -> bytes:
        return OFFER.pack(os.getpid(), self.fd, self.token)

    def write(self, call: int, parts: list[memoryview]) -> bytes:
        """Copies `parts` into slot `call % 2` (growing the file if needed); returns the
        descriptor that goes in the call's header."""
        for entry in [r for r in self.retired if r[2] + 2 <= call]:  # opened by the other
            self.retired.remove(entry)
            _close(*entry[:2])
        need = sum(_aligned(p.nbytes) for p in parts)
        if need > self.slot:
            self._make(max(need, 2 * self.slot), call)
        at = (call & 1) * self.slot
        for p in parts:
            self.map[at : at + p.nbytes] = p
            at += _aligned(p.nbytes)
        return DESCRIPTOR.pack(self.fd, self.generation, self.slot)

    def close(self) -> None:
        for fd, mapped, _ in self.retired:
            _close(fd, mapped)
        self.retired = []
        if self.map is not None:
            _close(self.fd, self.map)
            self.map = None


def _close(fd: int, mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:  # a view of it still alive: freed with the last one
        pass
    os.close(fd)


class PeerRegion:
    """The other worker's memory file, mapped here to read its parts."""

    def __init__(self, pid: int, fd: int, generation: int = 1):
        self.pid, self.generation, self.slot = pid, 0, 0
        self.map: mmap.mmap | None = None
        self._open(fd, generation, None)

    def _open(self, fd: int, generation: int, slot: int | None) -> None:
        # Non-blocking: /proc/PID/fd/FD of another machine's PID may be a pipe or a device.
        own = os.open(f"/proc/{self.pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(own)
            size = info.st_size if slot is None else 2 * slot
            if not stat.S_ISREG(info.st_mode) or info.st_size < max(size, 2 * _ALIGN):
                raise OSError(f"/proc/{self.pid}/fd/{fd} is not a ring's memory file")
            mapped = mmap.mmap(own, size, prot=mmap.PROT_READ)
        finally:
            os.close(own)
        self.close()
        self.map, self.generation, self.slot = mapped, generation, size // 2

    def token(self) -> bytes:
        return bytes(self.map[:16])

    def parts(self, descriptor: bytes, parity: int, sizes: list[int]) -> list[memoryview]:
        """The other worker's parts of this call, as views of its slot `parity`."""
        fd, generation, slot = DESCRIPTOR.unpack(descriptor)
        if generation != self.generation:
            self._open(fd, generation, slot)
        view, at, out = memoryview(self.map), parity * self.slot, []
        for n in sizes:
            if at + n > (parity + 1) * self.slot:  # a header that lies: not beyond the slot
                raise OSError(f"parts of {sizes} bytes do not fit a slot of {self.slot} bytes")
            out.append(view[at : at + n])
            at += _aligned(n)
        return out

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass
            self.map = None


def open_peer(offer: bytes) -> PeerRegion | None:
    """The other worker's region from its offer, or None if this process cannot open it or
    the token differs (another machine, container or user)."""
    pid, fd, token = OFFER.unpack(offer)
    if not pid:
        return None
    try:
        peer = PeerRegion(pid, fd)
    except (OSError, ValueError):  # not there, not ours, or not a file that maps
        return None
    if peer.token() != token:
        peer.close()
        return None
    return peer
