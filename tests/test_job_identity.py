"""Only the job's own tasks get into tfstrat's listeners (`tfstrat.cluster.secret`): the ps
tasks' table servers and the workers' ring (tests/test_ring.py) refuse anyone who cannot prove
the job's secret, and `tfstrat launch` gives each attempt its own."""

import io
import json
import re
import socket
import struct
import sys
import time

import pytest
from cluster import start_task

from tfstrat import LaunchConfig, TFConfig, launch
from tfstrat.cluster import ports, secret
from tfstrat.errors import TableServerError, UsageError
from tfstrat.ps import wire


def _stats_frame() -> bytes:
    head = json.dumps({"method": "stats", "arrays": []}).encode()
    return struct.pack("<I", len(head)) + head


@pytest.mark.timeout(120)
def test_a_stranger_gets_nothing_from_a_ps_table_server(monkeypatch):
    """Was: a plain client on the ps's TF_CONFIG port + 1 sent a `stats` frame and got its
    answer (and could read or push any table's rows)."""
    monkeypatch.setenv(secret.ENV, "the job's secret")
    config = TFConfig.local(workers=1, ps=1)
    host, port = config.addresses("ps")[0].rsplit(":", 1)
    table = f"{host}:{int(port) + 1}"
    ps = start_task(config, "ps", 0, "-m", "tfstrat", "server")
    try:
        deadline = time.monotonic() + 60
        while not ports.accepts(table):
            assert ps.poll() is None and time.monotonic() < deadline, "the ps did not start"
            time.sleep(0.2)
        # 1. A plain client: its frame is never read; it gets the challenge, then the end.
        with socket.create_connection((host, int(port) + 1), timeout=15) as plain:
            plain.sendall(_stats_frame())
            got = b""
            try:
                while chunk := plain.recv(4096):
                    got += chunk
            except ConnectionResetError:  # closed with the frame unread
                pass
        # The challenge at most (the reset for the unread frame may discard even that).
        assert got == b"" or (got.startswith(secret.MAGIC) and len(got) == len(secret.MAGIC) + 16)
        # 2. A tfstrat task of another job (or attempt): refused, by name.
        monkeypatch.setenv(secret.ENV, "another job's secret")
        other = wire.Connection(table, 15, "ps:0")
        with pytest.raises(TableServerError, match="refused this task: its job secret differs"):
            other.send("stats")
        # 3. The job's own task: served.
        monkeypatch.setenv(secret.ENV, "the job's secret")
        own = wire.Connection(table, 15, "ps:0")
        own.send("stats")
        (stats,) = own.receive("stats")
        assert stats.size >= 1
        own.close()
    finally:
        ps.kill()
        out = ps.communicate(timeout=30)[0]
    # Each refusal logged, with the address; once per address (a scanner cannot flood it).
    refusals = re.findall(r"table server .*refused a connection from (\S+): (.*)", out)
    assert len(refusals) == 1, out[-3000:]
    assert refusals[0][0].startswith(host), refusals
    assert refusals[0][1] == "it does not speak tfstrat's handshake", refusals


_PRINT_SECRET = (
    "import hashlib, os, sys; r = os.environ['TFSTRAT_RESTART']; "
    "print('SECRET', r, hashlib.sha256(os.environ['TFSTRAT_SECRET'].encode()).hexdigest(), "
    "flush=True); sys.exit(1 if r == '0' and {fail} else 0)"
)


def _secrets(out: str) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for attempt, digest in re.findall(r"SECRET (\d+) ([0-9a-f]+)", out):
        seen.setdefault(attempt, set()).add(digest)
    return seen


@pytest.mark.timeout(120)
def test_every_attempt_of_a_launch_has_its_own_secret():
    out = io.StringIO()
    command = [sys.executable, "-c", _PRINT_SECRET.format(fail=True)]
    code = launch(LaunchConfig(command, workers=2, restarts=1, threads_per_task=1), out)
    assert code == 0, out.getvalue()[-3000:]
    seen = _secrets(out.getvalue())
    assert set(seen) == {"0", "1"}, out.getvalue()[-3000:]
    assert len(seen["0"]) == len(seen["1"]) == 1  # both workers of an attempt share it
    assert seen["0"] != seen["1"]  # a task of the failed attempt is refused by the next


_SAME_AS_BY_HAND = (
    "import os; from tfstrat.cluster import secret; given = os.environ.pop('TFSTRAT_SECRET'); "
    "os.environ['TFSTRAT_SECRET_FILE'] = {path!r}; "
    "print('SAME', given == secret.key().decode(), given != open({path!r}).read().strip())"
)


@pytest.mark.timeout(120)
def test_a_secret_file_gives_launched_and_hand_started_tasks_one_secret(tmp_path):
    """Across nodes every launcher derives the secret from the same file, this cluster and the
    attempt; a task started by hand with TFSTRAT_SECRET_FILE (a ps under Kubernetes, say)
    derives the same one. The file's own content never travels as the secret."""
    path = tmp_path / "secret"
    path.write_text("shared by every node\n")
    out = io.StringIO()
    command = [sys.executable, "-c", _SAME_AS_BY_HAND.format(path=str(path))]
    code = launch(LaunchConfig(command, workers=2, ps=0, secret_file=str(path)), out)
    assert code == 0, out.getvalue()[-3000:]
    assert out.getvalue().count("SAME True True") == 2, out.getvalue()[-3000:]
    other = secret.derive(b"shared by every node", 0, {"worker": ["10.0.0.1:2222"]})
    assert other != secret.derive(b"shared by every node", 0, {"worker": ["10.0.0.2:2222"]})
    assert other != secret.derive(b"shared by every node", 1, {"worker": ["10.0.0.1:2222"]})
    for bad, words in ((tmp_path / "missing", "cannot be read"), (tmp_path / "empty", "empty")):
        if "empty" in str(bad):
            bad.write_text("  \n")
        with pytest.raises(UsageError, match=words):
            LaunchConfig(command, secret_file=str(bad))


def test_refusals_are_logged_once_per_address_and_stop_at_the_cap(monkeypatch):
    """A scanner must not flood the log: one line per address, and past the cap one last
    line, then nothing (the cap once stopped guarding: every new address logged again)."""
    import logging

    class Peer:
        def __init__(self, host):
            self.host = host

        def getpeername(self):
            return (self.host, 4242)

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("tfstrat.cluster.secret")
    log.addHandler(handler)
    monkeypatch.setattr(secret, "REFUSALS_LOGGED", 3)
    monkeypatch.setattr(secret, "_refused", set())
    try:
        for i in range(10):
            secret._log_refusal(Peer(f"10.9.0.{i}"), "the ring", "no proof")
            secret._log_refusal(Peer(f"10.9.0.{i}"), "the ring", "no proof")  # again: no line
    finally:
        log.removeHandler(handler)
    assert len(lines) == 4, lines
    assert all("refused a connection from 10.9.0." in line for line in lines[:3])
    assert "refused connections from 3 addresses; further refusals are not logged" in lines[3]


def _handshake(server_side, client_side):
    """Runs `server_side(sock)` in a thread and `client_side(sock)` here, on the two ends of
    a loopback TCP connection; returns (the server's exception or None, the client's)."""
    import threading

    with socket.create_server(("127.0.0.1", 0)) as listener:
        b = socket.create_connection(listener.getsockname()[:2], timeout=10)
        a, _ = listener.accept()
    outcome = {}

    def serve():
        try:
            server_side(a)
        except Exception as e:  # noqa: BLE001 (compared by the test)
            outcome["server"] = e
        finally:
            a.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client_side(b)
    except Exception as e:  # noqa: BLE001
        outcome["client"] = e
    finally:
        b.close()
    thread.join(15)
    return outcome.get("server"), outcome.get("client")


def test_a_task_of_the_failed_attempt_cannot_join_the_next(monkeypatch):
    """Attempt 0's secret against attempt 1's listener (a straggler of a failed attempt):
    refused on both sides, each naming why, within the handshake's deadline."""
    monkeypatch.setattr(secret, "_refused", set())
    base = b"the job's base secret"
    old, new = (secret.derive(base, k).encode() for k in (0, 1))
    start = time.monotonic()
    server, client = _handshake(
        lambda s: secret.accept(s, new, "worker 0's ring", 5),
        lambda s: secret.connect(s, old, "worker 0", 5),
    )
    assert isinstance(server, secret.Refused), server
    assert "does not know this job's secret" in str(server)
    assert isinstance(client, secret.Refused), client
    assert "refused this task: its job secret differs" in str(client)
    assert time.monotonic() - start < 10
    # The same attempt's secret gets in.
    assert _handshake(
        lambda s: secret.accept(s, new, "worker 0's ring", 5),
        lambda s: secret.connect(s, new, "worker 0", 5),
    ) == (None, None)


def test_a_listener_that_cannot_prove_the_secret_is_refused():
    """A server that speaks the handshake but answers with a wrong proof (it does not know
    the job's secret: an impostor on the port) is refused by the connecting task."""
    import os

    def impostor(sock):
        sock.sendall(secret.MAGIC + os.urandom(16))
        got = b""
        while len(got) < len(secret.MAGIC) + 16 + 32:
            got += sock.recv(100)
        sock.sendall(os.urandom(32))  # not HMAC(secret, "server" + ...)

    _, client = _handshake(impostor, lambda s: secret.connect(s, b"job A", "ps:0", 5))
    assert isinstance(client, secret.Refused), client
    assert "ps:0 does not know this job's secret: it is not a task of this job" in str(client)
