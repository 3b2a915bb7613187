"""Multi-node restarts: how the launchers of `tfstrat launch --nodes ... --restarts K` agree on
the nodes of each attempt (torchrun's rendezvous, with no store to run beside the job).

Every node's launcher serves a small rendezvous on its node's first port - 1 for as long as it
runs, and answers three requests (a JSON line each, answered by one; every connection proves
the job's secret first, as the tasks' ports do, `tfstrat.cluster.secret`):

    hello      -> where this node stands: the last attempt it started, whether it runs it now,
                  the restarts used so far
    restart N  -> stop the running attempt, if older than N (a host gathers attempt N)
    join       -> answered when the next attempt's nodes are decided: {"round": N, "ranks":
                  [...], "restarts": R, "cause": "..."}, or {"stop": why, "code": C}, or
                  {"redirect": k} (node k hosts)

Before each attempt every launcher joins the host: the lowest-ranked node whose rendezvous
answers `hello`. The host needs no state of its own, so any node can take over when the host
is lost: it asks every node `hello` (the last attempt and restarts used are the largest
reported), asks the nodes that still run an attempt to stop it (`restart`), and closes the
round when every node that still answers has joined, or when the window has passed with at
least `min_nodes` joined. A host that finds a lower-ranked node answering hands its joiners to
it, so two launchers started at once end with one host.

A round caused by a failure uses one of `--restarts`; a node that comes back (its launcher
started again) makes the next round grow the job and uses none, as torchrun's membership
changes. Each joiner writes a file into its `--backup-dir`; the host must see all of them,
else the directory is not shared and the job stops at once: the next chief must read the
backup the last one wrote.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable

from tfstrat.cluster import ports as _ports
from tfstrat.cluster import secret as _secret
from tfstrat.cluster.layout import NodeLayout
from tfstrat.errors import TFConfigError

PROBE_SECONDS = 1.0  # a node whose rendezvous does not answer `hello` within this is gone
WATCH_SECONDS, WATCH_MISSES = 2.0, 3  # a running node's successor: lost after 3 missed hellos
_LINE_BYTES = 1 << 16
_CHECKS = ".tfstrat-nodes"  # each joiner's file in its backup directory


def port_of(layout: NodeLayout, rank: int) -> int:
    """Node `rank`'s rendezvous port: the one below its first task's."""
    return layout.plan[rank].port - 1


class Rendezvous:
    """This node's rendezvous server (started at once) and its client calls (`join`)."""

    def __init__(
        self,
        layout: NodeLayout,
        base_secret: bytes | None,
        *,
        min_nodes: int,
        restarts: int,
        first_window: float,
        window: float,
        backup_dir: str,
        say: Callable[[str], None],
    ):
        self.layout, self.rank = layout, layout.rank
        self.min_nodes, self.restarts = min_nodes, restarts
        self.first_window, self.window = first_window, window
        self.backup_dir, self.say = backup_dir, say
        nodes = [_ports.join(n.host, n.port) for n in layout.plan]
        self.key = (
            _secret.derive(base_secret, -1, {"rendezvous": nodes}).encode() if base_secret else b""
        )
        # This node's own state (`hello`).
        self.round, self.used, self.running = -1, 0, False
        self._ranks: list[int] = []  # the nodes of the attempt this node runs or ran last
        self._done: set[int] = set()  # those that finished it (exit 0)
        self._finished = False  # this node's tasks finished (it joins no more)
        self.abort = threading.Event()  # set: stop the running attempt
        self.abort_cause, self.abort_why = "", "restart"
        self._wanted = -1  # the newest round a host gathers (`restart`)
        self._lock = threading.Lock()
        # The host's: the round it gathers, if any.
        self._gathering: _Gathering | None = None
        self._host_lock = threading.Condition()
        self._answering = 0  # requests being answered (`close` lets them finish)
        node = layout.node
        self._listener = _ports.listen(
            _ports.wildcard(node.host), port_of(layout, self.rank), node.where, "rendezvous"
        )
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tfstrat-rendezvous").start()

    # -- this launcher's side ----------------------------------------------------------------

    def join(self, why: str, cause: str = "", code: int = 1) -> dict:
        """The next attempt: {"round", "ranks", "restarts", "cause"} or {"stop", "code"}.

        `why`: "start" (this launcher's first), "failure" (its attempt failed: `cause`,
        `code`) or "restart" (a host stopped it)."""
        check = self._write_check()
        request = {
            "op": "join",
            "rank": self.rank,
            "round": self.round,
            "restarts": self.used,
            "why": why,
            "cause": cause,
            "code": code,
            "check": check,
            "chief_done": self._chief_done(),
        }
        bound = self.first_window + self.window + 60
        deadline = time.monotonic() + bound
        try:
            while True:
                host = self._find_host()
                try:
                    reply = self._request(host, request, self.first_window + self.window + 30)
                except (OSError, ValueError):
                    reply = None  # the host went away: find the next one
                if reply is not None and "redirect" not in reply:
                    if "round" in reply:
                        self.round, self.used = reply["round"], reply["restarts"]
                    return reply
                if time.monotonic() > deadline:
                    return {"stop": f"no rendezvous host answered within {bound:.0f} s", "code": 1}
                time.sleep(0.2)
        finally:
            _remove(os.path.join(self.backup_dir, check))

    def started(self, round_: int, ranks: list[int]) -> None:
        """This node runs attempt `round_` on the nodes `ranks` now (its abort is cleared,
        unless a host already gathers a newer one). It watches the next node of `ranks` (the
        last one the first): a node that stops answering is lost, even while the tasks still
        wait on it (a vanished machine closes no connection)."""
        with self._lock:
            self.running = True
            self.abort.clear()
            if self._wanted > round_:
                self._stop_attempt("a newer attempt is being gathered", "restart")
        self._ranks, self._done = list(ranks), set()
        if len(ranks) > 1:
            after = ranks[(ranks.index(self.rank) + 1) % len(ranks)]
            threading.Thread(target=self._watch, args=(round_, after), daemon=True).start()

    def finished(self) -> None:
        """This node's tasks of the running attempt are done (exit 0): the other nodes stop
        watching it, and do not restart the job if the chief's node is done."""
        self._finished = True
        for rank in self._ranks:
            if rank != self.rank:
                try:
                    self._request(rank, {"op": "done", "rank": self.rank, "round": self.round}, 2)
                except (OSError, ValueError):
                    pass

    def superseded(self) -> bool:
        """Whether a host gathers a newer attempt than the one this node ran: its tasks may
        have failed because that host stopped the others' (not a failure of their own)."""
        with self._lock:
            return self._wanted > self.round

    def _chief_done(self) -> bool:
        return bool(self._ranks) and self._ranks[0] in self._done

    def _watch(self, round_: int, rank: int) -> None:
        missed = 0
        while self.running and self.round == round_ and not self.abort.is_set():
            time.sleep(WATCH_SECONDS)
            if rank in self._done:  # it finished: nothing to watch
                return
            missed = 0 if self._hello(rank) is not None else missed + 1
            if missed >= WATCH_MISSES:
                with self._lock:
                    if self.round == round_:
                        where = self.layout.plan[rank].where
                        self._stop_attempt(f"{where} stopped answering its rendezvous", "failure")
                return

    def stopped(self) -> None:
        with self._lock:
            self.running = False

    def close(self) -> None:
        """Stops serving, once the joiners this host answered have their answers (a launcher
        that exits right after its own would cut theirs off)."""
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._host_lock:
            self._host_lock.wait_for(lambda: not self._answering, timeout=5.0)

    def _write_check(self) -> str:
        """A file of this node's in its backup directory, for the host to find there."""
        name = os.path.join(_CHECKS, f"node-{self.rank}-{os.getpid()}-{time.time_ns()}")
        path = os.path.join(self.backup_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(self.layout.node.where)
            f.flush()
            os.fsync(f.fileno())
        return name

    def _find_host(self) -> int:
        """The lowest-ranked node whose rendezvous answers (this one answers)."""
        for rank in range(len(self.layout.plan)):
            if rank == self.rank or self._hello(rank) is not None:
                return rank
        return self.rank

    def _stop_attempt(self, cause: str, why: str) -> None:
        """Stops the running attempt; the next join says `why` ("restart": a host asked,
        "failure": a node was lost) and `cause`."""
        if self.running and not self.abort.is_set():
            self.abort_cause, self.abort_why = cause, why
            self.abort.set()

    # -- requests ------------------------------------------------------------------------------

    def _address(self, rank: int) -> tuple[str, int]:
        return self.layout.plan[rank].host, port_of(self.layout, rank)

    def _request(self, rank: int, message: dict, timeout: float) -> dict:
        who = self.layout.plan[rank].where
        with socket.create_connection(self._address(rank), timeout=PROBE_SECONDS) as s:
            _secret.connect(s, self.key, f"the rendezvous of {who}", max(PROBE_SECONDS, 5.0))
            s.settimeout(timeout)
            s.sendall(json.dumps(message).encode() + b"\n")
            return json.loads(_read_line(s))

    def _hello(self, rank: int) -> dict | None:
        try:
            return self._request(rank, {"op": "hello"}, 5.0)
        except (OSError, ValueError):
            return None

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                _secret.accept(conn, self.key, f"rendezvous of {self.layout.node.where}")
                conn.settimeout(30)
                message = json.loads(_read_line(conn))
                with self._host_lock:
                    self._answering += 1
                try:
                    reply = self._answer(message)
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                finally:
                    with self._host_lock:
                        self._answering -= 1
                        self._host_lock.notify_all()
            except (OSError, ValueError, KeyError, TypeError):
                return  # a refused or broken peer: the caller retries or moves on

    def _answer(self, message: dict) -> dict:
        op = message["op"]
        if op == "hello":
            with self._lock:
                return {
                    "round": self.round,
                    "running": self.running,
                    "restarts": self.used,
                    "done": self._finished,
                }
        if op == "restart":
            with self._lock:
                self._wanted = max(self._wanted, int(message["round"]))
                if self.round < self._wanted:
                    self._stop_attempt(str(message["cause"]), "restart")
            return {"ok": True}
        if op == "done":
            with self._lock:
                if int(message["round"]) == self.round:
                    self._done.add(int(message["rank"]))
            return {"ok": True}
        if op == "join":
            return self._host_join(message)
        raise ValueError(op)

    # -- the host's side ---------------------------------------------------------------------

    def _answers(self, rank: int) -> bool:
        """Whether node `rank` answers and may still join (not a node whose tasks are done)."""
        state = self._hello(rank)
        return state is not None and not state.get("done")

    def _lower_answering(self) -> int | None:
        for rank in range(self.rank):
            if self._hello(rank) is not None:
                return rank
        return None

    def _host_join(self, message: dict) -> dict:
        lower = self._lower_answering()
        if lower is not None:
            return {"redirect": lower}
        with self._host_lock:
            while True:
                gathering = self._gathering
                if gathering is None or gathering.result is not None:
                    gathering = self._gathering = _Gathering()
                    threading.Thread(target=self._gather, args=(gathering,), daemon=True).start()
                if not gathering.closed:
                    break
                self._host_lock.wait(1.0)  # its nodes are decided: the next round takes this one
            gathering.joined[int(message["rank"])] = message
            self._host_lock.notify_all()
            while gathering.result is None:
                self._host_lock.wait(1.0)
            return gathering.result

    def _gather(self, g: _Gathering) -> None:
        """Closes one round: `g.result` for every joiner."""
        result = self._decide(g)
        with self._host_lock:
            g.result = result
            self._host_lock.notify_all()

    def _decide(self, g: _Gathering) -> dict:
        everyone = range(len(self.layout.plan))
        states = {r: self._hello(r) for r in everyone}
        with self._host_lock:
            joined = dict(g.joined)
        seen = [s for s in states.values() if s] + list(joined.values())
        last = max(int(s["round"]) for s in seen)
        used = max(int(s["restarts"]) for s in seen)
        number = last + 1
        cause = self._cause(joined, last)
        window = self.first_window if last < 0 else self.window
        started = time.monotonic()
        asked: set[int] = set()
        while True:
            lower = self._lower_answering()
            if lower is not None:
                return {"redirect": lower}
            with self._host_lock:
                joined = dict(g.joined)
            answering = {r for r in everyone if r in joined or self._answers(r)}
            for r in answering - set(joined) - asked:  # stop what they run; join us
                try:
                    self._request(r, {"op": "restart", "round": number, "cause": cause}, 5.0)
                    asked.add(r)
                except (OSError, ValueError):
                    pass
            # The first attempt waits for every node (launchers start at different times);
            # later ones for the nodes that still answer.
            if (set(everyone) if last < 0 else answering) <= set(joined):
                break
            if time.monotonic() - started > window:
                break
            time.sleep(0.5)
        with self._host_lock:  # later joiners wait for the next round
            g.closed = True
            joined = dict(g.joined)
        ranks = sorted(joined)
        cause = self._cause(joined, last)
        failures = [j for j in joined.values() if j["why"] == "failure"]
        if any(j.get("chief_done") for j in joined.values()):
            # The chief finished training (and may have deleted its backup): a restart would
            # train again what is done.
            return {
                "stop": f"the chief's node finished the training before {cause}",
                "code": int(failures[0]["code"]) if failures else 1,
            }
        if failures:
            used += 1
            if used > self.restarts:
                return {
                    "stop": f"no restarts left ({self.restarts} of --restarts "
                    f"{self.restarts} used) after {failures[0]['cause']}",
                    "code": int(failures[0]["code"]) or 1,
                }
        if len(ranks) < self.min_nodes:
            names = ", ".join(self.layout.plan[r].where for r in ranks)
            return {
                "stop": f"only {len(ranks)} node(s) joined within {window:g} s ({names}), "
                f"fewer than --min-nodes {self.min_nodes}",
                "code": 1,
            }
        unshared = self._unshared(joined)
        if unshared:
            return {"stop": unshared, "code": 2}
        try:
            self.layout.among(ranks)
        except TFConfigError as e:
            return {"stop": str(e), "code": 1}
        return {"round": number, "ranks": ranks, "restarts": used, "cause": cause}

    def _cause(self, joined: dict[int, dict], last: int) -> str:
        """Why the round is gathered: a joiner's failure, else a node that (re)joins."""
        failures = [j["cause"] for j in joined.values() if j["why"] == "failure"]
        if failures:
            return failures[0]
        if last < 0:
            return "start"
        back = [self.layout.plan[r].where for r, j in sorted(joined.items()) if j["why"] == "start"]
        return f"{', '.join(back)} joined" if back else "a node stopped"

    def _unshared(self, joined: dict[int, dict]) -> str | None:
        """Why the backup directory is not shared (a joiner's file is not seen here), or
        None. A network file system may show a new file late: a few seconds of grace."""
        deadline = time.monotonic() + 5
        while True:
            missing = [
                (r, j["check"])
                for r, j in sorted(joined.items())
                if not os.path.exists(os.path.join(self.backup_dir, j["check"]))
            ]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if not missing:
            return None
        rank, name = missing[0]
        return (
            f"--backup-dir {self.backup_dir} is not shared: {self.layout.plan[rank].where} "
            f"wrote {name} into its --backup-dir, which {self.layout.node.where} does not "
            "see in its own. Give every node the same directory of a shared file system (NFS, "
            "a cloud bucket mount): whichever node is chief next restores the backup from it."
        )


class _Gathering:
    def __init__(self):
        self.joined: dict[int, dict] = {}
        self.closed = False  # the nodes are decided; joiners from now on wait for the next
        self.result: dict | None = None


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("the rendezvous closed the connection")
        data += chunk
        if len(data) > _LINE_BYTES:
            raise ValueError("a rendezvous message over 64 KiB")
    return data


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
