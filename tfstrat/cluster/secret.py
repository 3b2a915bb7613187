"""Job identity on tfstrat's own listeners: a per-job, per-attempt secret, proven both ways.

tfstrat's TCP ring (between the workers) and the ps tasks' table servers (Hybrid's tables,
ParameterServer's step state) accept only tasks of the same job and attempt. At connect, before
any other byte, each side proves that it knows the job's secret by an HMAC-SHA256
challenge-response: the secret never crosses the wire, and a recorded handshake cannot be
replayed (each side's challenge is fresh). A task of another job, of an earlier attempt, or
anyone else who reaches the port is refused, and the refusal is logged once per address.
Nothing is encrypted: the bytes after the handshake travel in clear, so a link others can read
still needs a private network. TensorFlow's own gRPC port (the TF_CONFIG port) has no such
check (TensorFlow offers none): `--private-network` or a firewall is the answer there.

Where a task finds the secret, first found:
- `TFSTRAT_SECRET`: the secret itself. `tfstrat launch` sets it for its tasks: a new random
  one for every attempt on one machine, or derived from `--secret-file` across nodes.
- `TFSTRAT_SECRET_FILE`: a file, the same on every node (a file in a directory the nodes share,
  readable by the job's user only; a Kubernetes Secret mounted as a file). The secret is
  derived from its content, the cluster (TF_CONFIG's) and the attempt (`TFSTRAT_RESTART`), as
  `tfstrat launch --secret-file` derives it: jobs of other clusters and other attempts differ
  even with one file. Two runs of one cluster from one file share it, so give each job its
  own file (or write a new secret into it for each run).
Without either, tasks prove the empty secret, so hand-made clusters still work, and tfstrat
warns once that its ports are open.

The handshake (server: the side that accepted):
    server -> client: MAGIC, 16 random bytes (its challenge)
    client -> server: MAGIC, 16 random bytes, HMAC(secret, "client" + both challenges)
    server -> client: HMAC(secret, "server" + both challenges)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time

from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)

ENV = "TFSTRAT_SECRET"
FILE_ENV = "TFSTRAT_SECRET_FILE"
MAGIC = b"TFSJ1"  # "tfstrat job", version 1
_NONCE = 16
_MAC = 32
# A connection has this long to prove itself (and never longer than its caller's deadline):
# a stranger that sends nothing cannot hold a listener for long.
HANDSHAKE_SECONDS = 10.0

_warned_open = False
_refused: set[str] = set()  # addresses whose refusal was logged ("": the cap's last line)
REFUSALS_LOGGED = 4096


class Refused(ConnectionError):
    """The other side does not know this job's secret (or is not a tfstrat task at all)."""


class _Closed(Refused):
    """Closed before sending a byte: a check that the port is open, not logged."""


def key() -> bytes:
    """This task's job secret (b"" without one: tasks without one still find each other)."""
    value = os.environ.get(ENV)
    if value:
        return value.encode()
    path = os.environ.get(FILE_ENV)
    if path:
        cluster = None
        raw = os.environ.get("TF_CONFIG")
        if raw:
            try:
                cluster = json.loads(raw).get("cluster")
            except (ValueError, AttributeError):
                cluster = None  # a malformed TF_CONFIG: the strategy says so, by name
        attempt = os.environ.get("TFSTRAT_RESTART", "0")
        return derive(read_file(path), int(attempt) if attempt.isdigit() else 0, cluster).encode()
    _warn_open()
    return b""


def read_file(path: str) -> bytes:
    """The secret in `path` (surrounding whitespace dropped); a clear error if unusable."""
    try:
        with open(path, "rb") as f:
            value = f.read().strip()
    except OSError as e:
        raise UsageError(
            f"Received: a job secret file {path!r} ({FILE_ENV} or --secret-file) that cannot "
            f"be read ({e.strerror}). Create it on every node with the same content, e.g. "
            f"`python -c 'import secrets; print(secrets.token_hex(32))' > {path}; chmod 600 "
            f"{path}`."
        ) from None
    if not value:
        raise UsageError(
            f"Received: an empty job secret file {path!r}. Write a random secret into it, e.g. "
            f"`python -c 'import secrets; print(secrets.token_hex(32))' > {path}`."
        )
    return value


def new() -> str:
    """A fresh random secret (hex)."""
    return secrets.token_hex(32)


def derive(base: bytes, attempt: int, cluster: dict | None = None) -> str:
    """The secret of one attempt of one cluster from a job's `base` secret: tasks of another
    attempt (a straggler of a failed one) or of another cluster are refused."""
    text = f"attempt {attempt}; cluster {json.dumps(cluster or {}, sort_keys=True)}"
    return hmac.new(base, text.encode(), hashlib.sha256).hexdigest()


def _warn_open():
    global _warned_open
    if not _warned_open:
        _warned_open = True
        logger.warning(
            "tfstrat: no job secret (%s or %s): tfstrat's ports (the workers' ring, the ps "
            "tasks' table servers) take connections from anyone who reaches them. `tfstrat "
            "launch` sets one; across nodes give every node the same --secret-file (README, "
            "Security).",
            ENV,
            FILE_ENV,
        )


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _read(sock: socket.socket, n: int, deadline: float, first: bool = False) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Refused("it did not finish the handshake in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise Refused("it did not finish the handshake in time") from None
        except (ConnectionResetError, BrokenPipeError):
            if first and not buf:  # a port check that closed as our challenge arrived
                raise _Closed("it closed the connection without a word") from None
            raise
        if not chunk:
            if not buf:
                raise _Closed("it closed the connection without a word")
            raise Refused("it closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


def accept(sock: socket.socket, secret: bytes, what: str, timeout: float = HANDSHAKE_SECONDS):
    """The accepting side's handshake; `Refused` (logged once per address) if the peer does
    not prove `secret`. Restores the socket's timeout."""
    saved = sock.gettimeout()
    deadline = time.monotonic() + min(timeout, HANDSHAKE_SECONDS)
    mine = secrets.token_bytes(_NONCE)
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            sock.sendall(MAGIC + mine)
        except (ConnectionResetError, BrokenPipeError):  # a port check, gone already
            raise _Closed("it closed the connection without a word") from None
        if _read(sock, len(MAGIC), deadline, first=True) != MAGIC:  # a stranger: at once
            raise Refused("it does not speak tfstrat's handshake")
        reply = _read(sock, _NONCE + _MAC, deadline)
        theirs = reply[:_NONCE]
        if not hmac.compare_digest(reply[-_MAC:], _mac(secret, b"client", mine, theirs)):
            raise Refused(
                "it does not know this job's secret (a task of another job or of an earlier "
                "attempt)"
            )
        sock.sendall(_mac(secret, b"server", theirs, mine))
    except Refused as e:
        if not isinstance(e, _Closed):
            _log_refusal(sock, what, str(e))
        raise
    except OSError as e:
        _log_refusal(sock, what, f"the handshake failed ({e})")
        raise Refused(str(e)) from None
    finally:
        try:
            sock.settimeout(saved)
        except OSError:
            pass


def connect(sock: socket.socket, secret: bytes, who: str, timeout: float):
    """The connecting side's handshake with `who`; `Refused` names what went wrong."""
    saved = sock.gettimeout()
    deadline = time.monotonic() + timeout
    try:
        challenge = _read(sock, len(MAGIC) + _NONCE, deadline)
        if challenge[: len(MAGIC)] != MAGIC:
            raise Refused(f"{who} does not speak tfstrat's handshake: is it a tfstrat task?")
        theirs = challenge[len(MAGIC) :]
        mine = secrets.token_bytes(_NONCE)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.sendall(MAGIC + mine + _mac(secret, b"client", theirs, mine))
        try:
            proof = _read(sock, _MAC, deadline)
        except Refused:
            raise Refused(
                f"{who} refused this task: its job secret differs from this task's "
                f"({ENV} / {FILE_ENV} must be the same on every task of a job; `tfstrat launch` "
                "makes a new one for every attempt)"
            ) from None
        if not hmac.compare_digest(proof, _mac(secret, b"server", mine, theirs)):
            raise Refused(f"{who} does not know this job's secret: it is not a task of this job")
    except OSError as e:
        if isinstance(e, Refused):
            raise
        raise Refused(f"the handshake with {who} failed ({e})") from None
    finally:
        try:
            sock.settimeout(saved)
        except OSError:
            pass


def _log_refusal(sock: socket.socket, what: str, why: str):
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        host, port = "a closed peer", ""
    if host in _refused:  # once per address: a scanner must not flood the log
        return
    if len(_refused) >= REFUSALS_LOGGED:  # nor one of many addresses: one last line
        if "" not in _refused:
            _refused.add("")
            logger.warning(
                "tfstrat: %s refused connections from %d addresses; further refusals are not "
                "logged",
                what,
                REFUSALS_LOGGED,
            )
        return
    _refused.add(host)
    logger.warning("tfstrat: %s refused a connection from %s:%s: %s", what, host, port, why)
