"""Multi-node restarts: how the launchers of `tfstrat launch --nodes ... --restarts K` agree on
the nodes of each attempt (torchrun's rendezvous, with no store to run beside the job).

Every node's launcher serves a small rendezvous on its node's first port - 1 for as long as it
runs. It answers four requests, a JSON line each, answered by one; every connection first
proves the job's secret, as the tasks' ports do (`tfstrat.cluster.secret`):

    hello      -> where this node stands: the last attempt it started, whether it runs it now,
                  the restarts used so far, whether its tasks are done
    restart N  -> stop the running attempt if it is older than N (a host gathers attempt N)
    done       -> the sender's tasks finished their attempt (exit 0): stop watching it
    join       -> answered when the next attempt's nodes are decided: {"round": N, "ranks":
                  [...], "restarts": R, "cause": "..."}, or {"stop": why, "code": C}, or
                  {"redirect": k} (node k hosts)

Before each attempt every launcher joins the host: the lowest-ranked node whose rendezvous
answers `hello`.
- The host keeps nothing it could not learn again, so any node can take over when the host is
  lost. It asks every node `hello`: the last attempt and the restarts used are the largest
  reported.
- It asks the nodes that still run an attempt to stop it (`restart`).
- It closes the round when every node that still answers has joined. Past the window it closes
  with whoever joined, if at least `min_nodes` did.
- A host that finds a lower-ranked node answering hands its joiners over to it, so two
  launchers that start at once end up with one host.

While an attempt runs, each launcher watches the next node of the attempt (`hello` every
WATCH_SECONDS): a node that misses WATCH_MISSES answers is lost, even when the tasks still
wait on it (a vanished machine closes no connection).

A round caused by a failure uses one of `--restarts`. A node that comes back (its launcher
started again) makes the next round grow the job and uses none, as torchrun's membership
changes do.

The backup directory carries what must outlive every launcher (`.tfstrat-nodes/`):
- Each joiner writes a file there, and the host must see them all. If it does not, the
  directory is not shared and the job stops at once: the next chief must read the backup the
  last one wrote.
- The end of the job is recorded there (`ended-<job>.json`: the chief's node finished, no
  restarts left, too few nodes, a timeout or a usage error). A launcher that joins later, such
  as a node whose launcher is started again after the end, stops instead of training alone.
  The job is named by its secret (`--secret-file`, one per job); without a secret nothing is
  recorded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
import uuid

from tfstrat.cluster import ports as _ports
from tfstrat.cluster import secret as _secret
from tfstrat.cluster.layout import NodeLayout
from tfstrat.errors import ListenError, TFConfigError, UsageError

PROBE_SECONDS = 1.0  # a node whose rendezvous does not accept within this is gone
WATCH_SECONDS, WATCH_MISSES = 2.0, 3  # a running node's successor: lost after 3 missed hellos
_LINE_BYTES = 1 << 16
_DIR = ".tfstrat-nodes"  # in the backup directory: the joiners' files, the job's end


def port_of(layout: NodeLayout, rank: int) -> int:
    """Node `rank`'s rendezvous port: the one below its first task's."""
    return layout.plan[rank].port - 1


def check_ports(layout: NodeLayout) -> None:
    """Raises TFConfigError when a node's rendezvous port is another node's task or tfstrat
    port on the same host (`--nodes h:6000,h:6002`), or below 1."""
    used: dict[tuple[str, int], str] = {}
    for node in layout.plan:
        for job, index, address in node.tasks:
            port = _ports.split(address)[1]
            used[(node.host, port)] = used[(node.host, port + _ports.offset())] = f"{job}:{index}"
    for node in layout.plan:
        port = port_of(layout, node.rank)
        if port < 1 or (node.host, port) in used:
            taken = f" ({used[(node.host, port)]}'s)" if (node.host, port) in used else ""
            raise TFConfigError(
                f"Received: {node.where} from port {node.port}. Its rendezvous listens on the "
                f"port below, {port}{taken}: give it a range whose port below is free, e.g. "
                f"--nodes {_ports.join(node.host, node.port + 100)} for it."
            )


class _Gathering:
    """One round a host gathers."""

    def __init__(self):
        self.joined: dict[int, dict] = {}
        self.closed = False  # the nodes are decided; joiners from now on wait for the next
        self.result: dict | None = None


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
    ):
        """Raises UsageError when this node's rendezvous port cannot be listened on."""
        self.layout, self.rank, self.where = layout, layout.rank, layout.node.where
        self.min_nodes, self.restarts = min_nodes, restarts
        self.first_window, self.window = first_window, window
        self.backup_dir = backup_dir
        nodes = [_ports.join(n.host, n.port) for n in layout.plan]
        self.key = (
            _secret.derive(base_secret, -1, {"rendezvous": nodes}).encode() if base_secret else b""
        )
        job = hashlib.sha256(self.key).hexdigest()[:16]
        self._end_path = os.path.join(backup_dir, _DIR, f"ended-{job}.json") if self.key else None
        # This node's own state (`hello`).
        self.round, self.used, self.running = -1, 0, False
        self._ranks: list[int] = []  # the nodes of the attempt this node runs or ran last
        self._chief = -1  # of those, the chief's node
        self._done: set[int] = set()  # those that finished it (exit 0)
        self._finished = False  # this node's tasks finished: it joins no more
        self.abort = threading.Event()  # set: stop the running attempt
        self.abort_cause, self.abort_why = "", "restart"
        self._wanted = -1  # the newest round a host gathers (`restart`)
        self._lock = threading.Lock()
        # The host's side: the round it gathers, and the last it decided.
        self._gathering: _Gathering | None = None
        self._decided = -1
        self._final: dict | None = None  # a stop this host decided
        self._gather_lock = threading.Condition()
        self._answering = 0  # requests being answered (`close` lets them finish)
        self._answering_lock = threading.Condition()
        port = port_of(layout, self.rank)
        try:
            self._listener = _ports.listen(
                _ports.wildcard(layout.node.host), port, self.where, "rendezvous"
            )
        except ListenError as e:
            why = "another socket holds it" if e.in_use else "it cannot be bound"
            raise UsageError(
                f"{self.where}: its rendezvous cannot listen on port {port}, the one below its "
                f"first task's ({why}). Free it, or start every node with another --port."
            ) from None
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tfstrat-rendezvous").start()

    # -- this launcher's side ----------------------------------------------------------------

    def join(self, why: str, cause: str = "", code: int = 1) -> dict:
        """The next attempt: {"round", "ranks", "restarts", "cause"} or {"stop", "code"}.

        `why`: "start" (this launcher's first), "failure" (its attempt failed: `cause`,
        `code`) or "restart" (a host stopped it)."""
        ended = self._ended()
        if ended is not None:
            return ended
        try:
            check = self._write_check()
        except OSError as e:
            return {
                "stop": f"--backup-dir {self.backup_dir} is not writable on {self.where} "
                f"({e.strerror or e}): give every node one shared directory it can write",
                "code": 2,
            }
        bound = self.first_window + self.window + 60
        deadline = time.monotonic() + bound
        try:
            while True:
                ended = self._ended()
                if ended is not None:
                    return ended
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
                try:
                    reply = self._request(self._find_host(), request, bound)
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
        """This node runs attempt `round_` on the nodes `ranks` now. Its abort is cleared,
        unless a host already gathers a newer attempt. It watches the next node of `ranks`
        (the last node watches the first)."""
        with self._lock:
            self.running = True
            self._ranks, self._done = list(ranks), set()
            # The chief's node: the first of the attempt with a worker (not a ps-only node).
            with_workers = [
                r for r in ranks if any(j != "ps" for j, _, _ in self.layout.plan[r].tasks)
            ]
            self._chief = with_workers[0] if with_workers else -1
            self.abort.clear()
            if self._wanted > round_:
                self._stop_attempt("a newer attempt is being gathered", "restart")
        if len(ranks) > 1:
            after = ranks[(ranks.index(self.rank) + 1) % len(ranks)]
            threading.Thread(target=self._watch, args=(round_, after), daemon=True).start()

    def stopped(self) -> None:
        with self._lock:
            self.running = False

    def superseded(self) -> bool:
        """Whether a host gathers a newer attempt than the one this node ran: its tasks may
        have failed because that host stopped the others' (not a failure of their own)."""
        with self._lock:
            return self._wanted > self.round

    def finished(self) -> None:
        """This node's tasks of the running attempt are done (exit 0): the other nodes stop
        watching it; on the chief's node, the job has ended."""
        self._finished = True
        if self._chief == self.rank:
            self.end(0, f"the chief's node, {self.where}, finished the training")
        for rank in self._ranks:
            if rank != self.rank:
                try:
                    self._request(rank, {"op": "done", "rank": self.rank, "round": self.round}, 2)
                except (OSError, ValueError):
                    pass

    def end(self, code: int, reason: str) -> None:
        """Records in the backup directory that the job ended: launchers that join later
        stop instead of training on (nothing without a job secret, which names the job)."""
        if self._end_path is None or os.path.exists(self._end_path):  # the first end stands
            return
        try:
            os.makedirs(os.path.dirname(self._end_path), exist_ok=True)
            tmp = f"{self._end_path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "w") as f:
                json.dump({"code": code, "reason": reason}, f)
            os.replace(tmp, self._end_path)
        except OSError:
            pass  # the stop still reaches every node that joins now

    def close(self) -> None:
        """Stops serving, once the joiners this host answered have their answers (a launcher
        that exits right after its own would cut theirs off)."""
        self._closed = True
        try:  # shutdown wakes the accepting thread: only then is the port free again
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._answering_lock:
            self._answering_lock.wait_for(lambda: not self._answering, timeout=5.0)

    def _ended(self) -> dict | None:
        if self._end_path is None or not os.path.exists(self._end_path):
            return None
        try:
            with open(self._end_path) as f:
                ended = json.load(f)
            return {
                "stop": f"the job has ended: {ended['reason']} (recorded in {self._end_path}; "
                "to run it again, delete that file or give a new --secret-file)",
                "code": int(ended["code"]),
            }
        except (OSError, ValueError, KeyError):
            return None

    def _write_check(self) -> str:
        """A file of this node's in its backup directory, for the host to find there."""
        name = os.path.join(_DIR, f"node-{self.rank}-{os.getpid()}-{time.time_ns()}")
        path = os.path.join(self.backup_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(self.where)
            f.flush()
            os.fsync(f.fileno())
        return name

    def _find_host(self) -> int:
        """The lowest-ranked node that answers and may still join (this one does)."""
        for rank in range(len(self.layout.plan)):
            if rank == self.rank or self._answers(rank):
                return rank
        return self.rank

    def _chief_done(self) -> bool:
        return self._chief in self._done

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

    def _stop_attempt(self, cause: str, why: str) -> None:
        """Stops the running attempt; the next join says `why` ("restart": a host asked,
        "failure": a node was lost) and `cause`."""
        if self.running and not self.abort.is_set():
            self.abort_cause, self.abort_why = cause, why
            self.abort.set()

    # -- requests ------------------------------------------------------------------------------

    def _request(self, rank: int, message: dict, timeout: float) -> dict:
        node = self.layout.plan[rank]
        address = (node.host, port_of(self.layout, rank))
        with socket.create_connection(address, timeout=PROBE_SECONDS) as s:
            _secret.connect(s, self.key, f"the rendezvous of {node.where}", 5.0)
            s.settimeout(timeout)
            s.sendall(json.dumps(message).encode() + b"\n")
            return json.loads(_read_line(s))

    def _hello(self, rank: int) -> dict | None:
        try:
            return self._request(rank, {"op": "hello"}, 5.0)
        except (OSError, ValueError):
            return None

    def _answers(self, rank: int) -> bool:
        """Whether node `rank` answers and may still join (not one whose tasks are done)."""
        state = self._hello(rank)
        return state is not None and not state.get("done")

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
                _secret.accept(conn, self.key, f"rendezvous of {self.where}")
                conn.settimeout(30)
                message = json.loads(_read_line(conn))
                with self._answering_lock:
                    self._answering += 1
                try:
                    reply = self._answer(message)
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                finally:
                    with self._answering_lock:
                        self._answering -= 1
                        self._answering_lock.notify_all()
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

    def _lower_answering(self) -> int | None:
        for rank in range(self.rank):
            if self._answers(rank):
                return rank
        return None

    def _host_join(self, message: dict) -> dict:
        if self._final is not None:  # the job ended here: a late joiner does not go on alone
            return self._final
        lower = self._lower_answering()
        if lower is not None:
            return {"redirect": lower}
        with self._gather_lock:
            while True:
                gathering = self._gathering
                if gathering is None or gathering.result is not None:
                    gathering = self._gathering = _Gathering()
                    threading.Thread(target=self._gather, args=(gathering,), daemon=True).start()
                if not gathering.closed:
                    break
                self._gather_lock.wait(1.0)  # its nodes are decided: the next round takes this
            gathering.joined[int(message["rank"])] = message
            self._gather_lock.notify_all()
            while gathering.result is None:
                self._gather_lock.wait(1.0)
            return gathering.result

    def _gather(self, g: _Gathering) -> None:
        """Closes one round: `g.result` for every joiner, whatever happens."""
        try:
            result = self._decide(g)
        except Exception as e:  # noqa: BLE001 - every joiner must get an answer
            result = {"stop": f"the rendezvous on {self.where} failed: {e!r}", "code": 1}
        with self._gather_lock:
            g.closed = True
            g.result = result
            self._gather_lock.notify_all()

    def _decide(self, g: _Gathering) -> dict:
        states = [s for s in (self._hello(r) for r in range(len(self.layout.plan))) if s]
        with self._gather_lock:
            joined = dict(g.joined)
        seen = states + list(joined.values())
        last = max(int(s["round"]) for s in seen)
        number = max(last, self._decided) + 1
        window = self.first_window if last < 0 else self.window
        joined = self._wait_for_joiners(g, number, last < 0, window)
        if isinstance(joined, int):
            return {"redirect": joined}
        # What the joiners know of where the job stands counts too.
        number = max([number] + [int(j["round"]) + 1 for j in joined.values()])
        used = max(int(s["restarts"]) for s in seen + list(joined.values()))
        result = self._verdict(joined, number, used, last, window)
        if "round" in result:
            self._decided = number
        elif "stop" in result:
            self._final = result
            # Not recorded: a directory that is not shared, and no node with workers left
            # (starting them again is the fix).
            if not result.pop("passing", False) and result["code"] != 2:
                self.end(int(result["code"]), result["stop"])
        return result

    def _wait_for_joiners(
        self, g: _Gathering, number: int, first: bool, window: float
    ) -> dict[int, dict] | int:
        """The joiners once every node that still answers has joined (the first round: every
        node), or once `window` seconds have passed; a lower-ranked host's rank instead when
        one answers. Nodes still running an attempt are asked to stop it, this node last (its
        own tasks' stop must not look like another node's failure)."""
        everyone = range(len(self.layout.plan))
        asked: set[int] = set()
        started = time.monotonic()
        while True:
            lower = self._lower_answering()
            if lower is not None:
                return lower
            with self._gather_lock:
                joined = dict(g.joined)
            answering = {r for r in everyone if r in joined or self._answers(r)}
            cause = self._cause(joined, -1 if first else number - 1)
            for r in sorted(answering - set(joined) - asked, key=lambda r: r == self.rank):
                try:
                    self._request(r, {"op": "restart", "round": number, "cause": cause}, 5.0)
                    asked.add(r)
                except (OSError, ValueError):
                    pass
            expected = set(everyone) if first else answering
            if expected <= set(joined) or time.monotonic() - started > window:
                with self._gather_lock:  # later joiners wait for the next round
                    g.closed = True
                    return dict(g.joined)
            time.sleep(0.5)

    def _verdict(
        self, joined: dict[int, dict], number: int, used: int, last: int, window: float
    ) -> dict:
        ranks = sorted(joined)
        cause = self._cause(joined, last)
        failures = [j for j in joined.values() if j["why"] == "failure"]
        code = (int(failures[0]["code"]) or 1) if failures else 1
        if any(j.get("chief_done") for j in joined.values()):
            # The chief finished training (and may have deleted its backup): a restart would
            # train again what is done.
            return {
                "stop": f"the chief's node finished the training before {cause}",
                "code": code if failures else 0,
            }
        if failures:
            used += 1
            if used > self.restarts:
                return {
                    "stop": f"no restarts left ({self.restarts} of --restarts {self.restarts} "
                    f"used) after {failures[0]['cause']}",
                    "code": code,
                }
        if len(ranks) < self.min_nodes:
            names = ", ".join(self.layout.plan[r].where for r in ranks)
            return {
                "stop": f"only {len(ranks)} node(s) joined within {window:g} s ({names}), "
                f"fewer than --min-nodes {self.min_nodes}",
                "code": code,
            }
        unshared = self._unshared(joined)
        if unshared:
            return {"stop": unshared, "code": 2}
        try:  # seen from a node of the round (this one may not be in it)
            dataclasses.replace(self.layout, rank=ranks[0]).among(ranks)
        except TFConfigError as e:
            return {"stop": str(e), "code": code, "passing": True}
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
            f"wrote {name} into its --backup-dir, which {self.where} does not "
            "see in its own. Give every node the same directory of a shared file system (NFS, "
            "a cloud bucket mount): whichever node is chief next restores the backup from it."
        )


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
