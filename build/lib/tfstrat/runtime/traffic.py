"""Bytes this process has sent and received over TCP, per peer, read from the kernel (Linux).

Counts what really crossed the sockets (gRPC framing included), for tests and benchmarks that
show how much a strategy moves per step. Reads `TCP_INFO` (tcpi_bytes_acked, tcpi_bytes_received)
of every TCP socket this process holds.
"""

from __future__ import annotations

import os
import socket
import struct

_BYTES_ACKED, _BYTES_RECEIVED = 120, 128  # offsets in struct tcp_info (Linux >= 4.2)


def tcp_bytes(peer_ports: set[int] | None = None) -> tuple[int, int]:
    """(sent, received) bytes over this process's open TCP sockets whose peer port is in
    `peer_ports` (all sockets when None). Closed sockets no longer count."""
    sent = received = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            try:
                port = sock.getpeername()[1]
            except OSError:
                continue  # listening or unconnected
            if peer_ports is not None and port not in peer_ports:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            if len(info) >= _BYTES_RECEIVED + 8:
                sent += struct.unpack_from("Q", info, _BYTES_ACKED)[0]
                received += struct.unpack_from("Q", info, _BYTES_RECEIVED)[0]
        finally:
            sock.close()
    return sent, received
