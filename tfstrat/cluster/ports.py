"""Where tfstrat's own listeners bind, on which port, and what they tell their peers.

Every task listens on two ports, both declared by its TF_CONFIG address `host:P`:
  - P: TensorFlow's gRPC server (it binds all interfaces; TensorFlow has no option for that);
  - P + 1 (`TFSTRAT_PORT_OFFSET`, default 1): tfstrat's own listener, the TCP ring on a worker
    or chief, Hybrid's table server on a ps.
So a firewall rule or a Kubernetes Service declares P and P + 1 for every task. When another
socket holds a worker's P + 1 (Ray picks P free but cannot reserve P + 1), its ring listens on
a free port instead and says so: its peers learn the ring's port at start.

tfstrat's listener binds the task's *own* address: the local address of the route towards its
peers (what the kernel would use as the source of a connection to them), and the ring tells
its peers that address (never the TF_CONFIG name, which may be a Kubernetes ClusterIP on no
interface, or the node's own name that /etc/hosts maps to 127.0.1.1). On a one-machine
cluster the route is loopback, so nothing of tfstrat's listens beyond the machine.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Sequence

from tfstrat.errors import ListenError, TFConfigError, UsageError

PORT_OFFSET_ENV = "TFSTRAT_PORT_OFFSET"
# What listens on each kind of task's tfstrat port (P + 1), for reports.
LISTENERS = {"chief": "tfstrat ring", "worker": "tfstrat ring", "ps": "Hybrid's table server"}


def offset() -> int:
    """How far above its TF_CONFIG port a task's tfstrat listener is (`TFSTRAT_PORT_OFFSET`)."""
    text = os.environ.get(PORT_OFFSET_ENV, "1")
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1000:
        raise UsageError(
            f"Received: {PORT_OFFSET_ENV}={text!r}. Use a whole number from 1 to 1000 (the "
            "distance from each task's TF_CONFIG port to its tfstrat port), the same on every task."
        )
    return value


def split(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port" (the brackets are dropped)."""
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def join(host: str, port: int) -> str:
    """ "host:port", with brackets around an IPv6 address (else its colons would read as the
    port separator)."""
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def tfstrat_port(address: str) -> int:
    """The port of the tfstrat listener of the task at TF_CONFIG `address`."""
    port = split(address)[1] + offset()
    if port > 65535:
        raise UsageError(
            f"Received: task address {address!r}. Its tfstrat port ({port}, the TF_CONFIG port "
            f"+ {offset()}) is above 65535; give the task a lower port."
        )
    return port


def route_source(peers: Sequence[str]) -> str | None:
    """The local address the kernel would send from to reach the peers (peers are
    "host:port" or bare hosts), in order: the first that is not loopback, else (every peer
    this machine's own, or a name this host maps to 127.0.1.1) the first loopback one; None
    when no peer resolves or has a route."""
    first = None
    for peer in peers:
        host = split(peer)[0] if peer.count(":") == 1 or peer.startswith("[") else peer
        try:
            infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
        except OSError:
            continue
        for family, _, _, _, sockaddr in infos:
            try:  # connect() on UDP sends nothing: it only picks the route and source
                with socket.socket(family, socket.SOCK_DGRAM) as s:
                    s.connect(sockaddr)
                    source = s.getsockname()[0].split("%", 1)[0]
            except OSError:
                continue
            if not ipaddress.ip_address(source).is_loopback:
                return source
            first = first or source
            break
    return first


def wildcard(like: str) -> str:
    """All interfaces, in the family of the address `like` ("0.0.0.0" or "::")."""
    return "::" if is_ipv6(like) else "0.0.0.0"


def listen(host: str, port: int, task: str, what: str) -> socket.socket:
    """A listening TCP socket on (host, port), or a ListenError naming task, address and fix."""
    family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a past run's TIME_WAIT is no conflict
    try:
        s.bind((host, port))
        s.listen(16)
    except OSError as e:
        s.close()
        error = ListenError(
            f"{task}: its {what} cannot listen on {join(host, port)} ({e.strerror}). It uses "
            f"the task's TF_CONFIG port + {offset()}: free that port, or give the task another "
            f"TF_CONFIG port (every task needs its port and the next {offset()} free), or set "
            f"{PORT_OFFSET_ENV} on every task."
        )
        error.in_use = e.errno == errno.EADDRINUSE
        raise error from None
    return s


def is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on `host` that was free when checked (bound, read and released).

    Example:
        >>> 1 <= free_port() <= 65535
        True
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    # All sockets stay open until every port is read, so the kernel cannot hand out one twice.
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sockets[-1].bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    except OSError as err:
        raise TFConfigError(
            f"Received: {count} ports on {host!r}. Binding failed ({err}); ask for fewer tasks."
        ) from err
    finally:
        for sock in sockets:
            sock.close()


def free_port_pairs(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` ports p whose p + offset was free too (each task's tfstrat port)."""
    step = offset()
    found: list[int] = []
    held: list[socket.socket] = []
    try:
        for _ in range(200 * max(count, 1)):
            if len(found) == count:
                return found
            first = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            first.bind((host, 0))
            held.append(first)
            port = first.getsockname()[1]
            second = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                second.bind((host, port + step))
            except OSError:
                second.close()
                continue
            held.append(second)
            found.append(port)
        raise TFConfigError(
            f"Received: {count} tasks on {host!r}; found no ports p with p + {step} free as well."
        )
    finally:
        for sock in held:
            sock.close()


def refusal(address: str, timeout: float = 1.0) -> str | None:
    """None when something accepts a TCP connection at "host:port" `address` within `timeout`
    seconds, else why not ("no answer within 1 s", "Connection refused", ...). tfstrat's one
    reachability probe: the launcher, `tfstrat doctor` and the ps task's exit watch use it."""
    try:
        with socket.create_connection(split(address), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return e.strerror or type(e).__name__


def accepts(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at `address` within `timeout` seconds."""
    return refusal(address, timeout) is None
