"""Runs a real TensorFlow cluster: ps tasks, an optional chief, and workers.

`launch(LaunchConfig(...))` is what `tfstrat launch` calls. Every task is its own process with
its own `TF_CONFIG` on 127.0.0.1, its output prefixed with its task name, run under a watcher
that takes it and all its descendants down with the launcher (`tfstrat/launcher/watch.py`). The first
task to fail stops the run, and its last lines are printed in a box, like torchrun's root-cause
report, naming the task its error blames when that is another one. With `restarts=K`, a failed
run is started again, all tasks on fresh ports, up to K times (torchrun's `--max-restarts`).

With `nodes=NodeLayout(...)` (`--nodes`, torchrun's `--nnodes/--node-rank`), one launcher per
node, all started with the same arguments, builds the same TF_CONFIG on fixed ports
(`tfstrat/cluster/nodes.py`) and starts its node's tasks only; a ps task here keeps serving until the
other nodes' workers have ended. With `private_network=True` every task runs in one new network
namespace that has only loopback (`tfstrat/launcher/private_network.py`).

Output: by default (`show="all"`) every task's lines go to `out`, prefixed with the task.
`tfstrat launch` shows only the chief's (`show="chief"`): one progress bar, not one per worker.
Every task's whole output goes to its own file in `log_dir` (`worker-1.log`), which is named at
the start and in a failure's report; a failing task's last lines are printed whatever `show`
says. TensorFlow's start-up lines that say nothing are hidden (`tfstrat/runtime/quiet.py`) unless
`verbose`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from tfstrat.cluster import TFConfig
from tfstrat.cluster import ports as _ports
from tfstrat.cluster import secret as _secret
from tfstrat.cluster.layout import NodeLayout
from tfstrat.errors import UsageError
from tfstrat.launcher import gpus as _gpus
from tfstrat.launcher import tasks as _tasks
from tfstrat.launcher.tasks import Failure, Task
from tfstrat.runtime import allocator as _runtime
from tfstrat.runtime import quiet as _quiet

EXIT_TIMEOUT = 124
# A failure with one of these codes is the command's or its arguments' fault: a restart would
# fail the same way. 2: argparse and most CLIs; 126: not executable; 127: not found.
USAGE_EXIT_CODES = (2, 126, 127)
# A training task that exits 0 while others still run is reported after this many seconds
# (tasks that finish together exit within this of each other).
_LEFT_EARLY_AFTER = 1.0
# How often a ps-holding node checks whether the other nodes' workers still run.
_POLL_OTHER_NODES = 1.0
_TASK_NAME = re.compile(r"^(chief|worker|ps):(\d+)$")
BACKUP_DIR_ENV = "TFSTRAT_BACKUP_DIR"  # `LaunchConfig.backup_dir`, for BackupAndRestore()


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What `tfstrat launch` runs.

    Attributes:
        command: the program every chief and worker task runs, e.g. `["python", "train.py"]`.
        workers: number of worker tasks (>= 1).
        ps: number of ps tasks, each running `tfstrat server` (stopped when the workers end).
        chief: whether to add a chief task that runs `command` too.
        timeout: seconds after which every task is stopped and launch returns 124; None waits.
            It covers all restarts together.
        port_retries: how many times to restart with fresh ports when a port was taken.
        threads_per_task: threads in each of TensorFlow's pools for every task
            (`TF_NUM_INTRAOP_THREADS` and `TF_NUM_INTEROP_THREADS`). None: this host's cores
            divided among the chief and workers (at least 1), so local tasks do not fight
            over cores, except that tasks given GPUs by `gpus` keep TensorFlow's defaults;
            0: TensorFlow's defaults (every task sizes its pools to all cores).
        env: extra environment variables for every task.
        grace: seconds between SIGTERM and SIGKILL when stopping tasks.
        restarts: how many times to stop every task and start all again, on fresh ports, after
            a task fails (not after exit codes 2, 126, 127, a timeout or an interrupt). Each
            task sees the attempt number in `TFSTRAT_RESTART` (0 on the first run).
        nodes: a multi-node run (`NodeLayout`): this launcher starts its node's tasks of a
            cluster spread over several machines, on fixed ports (no port retries, no
            restarts); `workers`, `ps` and `chief` stay at their defaults (the layout has the
            counts; worker:0 on the first node is the chief). Tasks see `TFSTRAT_NODE_RANK`.
        private_network: run every task in one new network namespace with only loopback up,
            so nothing of the job is reachable from outside it (one machine only).
        show: whose output goes to `out`: "all" (the default here, for programs that read
            the tasks' lines), "chief" (the chief, else worker:0; on a node of a multi-node
            run that has neither, its first worker; `tfstrat launch`'s default), or task
            names, "worker:1" or "worker:0,ps:0". A failing task's last lines are printed
            anyway.
        log_dir: a directory that gets one file per task with all its output
            (`worker-1.log`). None: a new directory under the system's temporary directory
            when `show` hides any task, else no files.
        verbose: hide nothing: tasks keep TensorFlow's logging settings
            (`TF_CPP_MIN_LOG_LEVEL`), and its start-up lines are shown (`tfstrat/runtime/quiet.py`).
        peer_timeout: seconds a node holding only ps tasks waits for every other node's
            workers to come up (their TensorFlow ports to accept); past it, it stops its ps
            tasks and exits 1, naming the workers that never came up.
        secret_file: a file holding the job's secret (`tfstrat.cluster.secret`), the same on
            every node; None: `TFSTRAT_SECRET_FILE` or `TFSTRAT_SECRET` if set, else a random
            one (one machine) or none (nodes: the ports stay open, with a warning). Tasks get a
            secret of their attempt in `TFSTRAT_SECRET`, so tfstrat's ring and table servers
            refuse tasks of other jobs and of earlier attempts.
        backup_dir: the job's backup directory, handed to every task in `TFSTRAT_BACKUP_DIR`
            (`tfstrat.keras.callbacks.BackupAndRestore()` uses it). Required for `restarts`
            with `nodes`, where it must be one directory every node shares (checked at each
            rendezvous): whichever node is chief next restores from it.
        min_nodes: with `nodes` and `restarts`, the fewest nodes an attempt may run on after
            nodes are lost (default 1). Every attempt runs on the nodes that answer the
            rendezvous (`tfstrat/launcher/rendezvous.py`); a node that comes back joins at once
            (the job is stopped after its step and grows).
        rejoin_window: seconds a restart's rendezvous waits for nodes that still answer but
            have not joined; the first waits `peer_timeout` for every node to start.
        gpus: the GPUs to hand out ("0", "1", ... or UUIDs; [] or ["none"]: hide every GPU
            from every task); None: this launcher's CUDA_VISIBLE_DEVICES, else every GPU the
            NVIDIA driver lists. Each chief and worker task this launcher starts gets its own
            (`tfstrat.launcher.gpus`), ps tasks none; no GPU found: tasks see what the
            launcher sees; found ones that do not split evenly: as many to each as go evenly
            (said in a line), refused when there are fewer than training tasks.
        gpus_per_task: GPUs per chief and worker task; None: all of them split evenly.
    """

    command: Sequence[str]
    workers: int = 1
    ps: int = 0
    chief: bool = False
    timeout: float | None = None
    port_retries: int = 3
    threads_per_task: int | None = None
    env: Mapping[str, str] | None = None
    grace: float = 5.0
    restarts: int = 0
    nodes: NodeLayout | None = None
    private_network: bool = False
    show: str = "all"
    log_dir: str | None = None
    verbose: bool = False
    peer_timeout: float = 300.0
    secret_file: str | None = None
    backup_dir: str | None = None
    min_nodes: int = 1
    rejoin_window: float = 60.0
    gpus: Sequence[str] | None = None
    gpus_per_task: int | None = None

    def __post_init__(self):
        if not self.command:
            raise UsageError("Received: command=[]. Give the program to run after `--`.")
        if self.workers < 1:
            raise UsageError(f"Received: workers={self.workers}. A cluster needs >= 1 worker.")
        if self.ps < 0:
            raise UsageError(f"Received: ps={self.ps}. Use 0 or more ps tasks.")
        if self.secret_file is not None:
            _secret.read_file(self.secret_file)  # unreadable or empty: said now, by name
        if not self.peer_timeout > 0:
            raise UsageError(
                f"Received: peer_timeout={self.peer_timeout!r}. Use a number of seconds > 0."
            )
        if self.threads_per_task is not None and self.threads_per_task < 0:
            raise UsageError(
                f"Received: threads_per_task={self.threads_per_task}. Use >= 1, 0 for "
                "TensorFlow's defaults, or None for cores / (workers + chief)."
            )
        if self.timeout is not None and self.timeout <= 0:
            raise UsageError(f"Received: timeout={self.timeout}. Use seconds > 0, or None.")
        if self.restarts < 0:
            raise UsageError(f"Received: restarts={self.restarts}. Use 0 or more restarts.")
        if self.grace < 0:
            raise UsageError(f"Received: grace={self.grace}. Use seconds >= 0.")
        if not self.rejoin_window > 0:
            raise UsageError(
                f"Received: rejoin_window={self.rejoin_window!r}. Use a number of seconds > 0."
            )
        if self.min_nodes != 1 and self.nodes is None:
            raise UsageError(
                f"Received: min_nodes={self.min_nodes} without nodes. It is the fewest nodes "
                "a multi-node run (--nodes ... --restarts K) continues on."
            )
        if self.nodes is not None:
            self._check_nodes()
        self._check_show()
        gpu_binding(self)  # GPUs that do not split among the tasks: said now, by name

    def _check_show(self):
        names = _show_names(self.show)
        if names is None:
            return
        cluster = _local_cluster(self) if self.nodes is not None else None
        for name in names:
            job, index = name.split(":")
            if cluster is not None:
                exists = int(index) < len(cluster.addresses(job))
            else:
                exists = int(index) < {"chief": int(self.chief), "worker": self.workers}.get(
                    job, self.ps
                )
            if not exists:
                raise UsageError(
                    f"Received: show={self.show!r}, but the cluster has no {name}. Name tasks "
                    "it has, or use 'chief' or 'all'."
                )

    def _check_nodes(self):
        if not isinstance(self.nodes, NodeLayout):
            raise UsageError(
                f"Received: nodes={self.nodes!r}. Give a tfstrat.launch.NodeLayout, e.g. "
                "NodeLayout('host1,host2', rank=0, workers_per_node=2)."
            )
        if self.workers != 1 or self.ps or self.chief:
            raise UsageError(
                f"Received: workers={self.workers}, ps={self.ps}, chief={self.chief} with "
                "nodes. A multi-node run takes its counts per node (--workers-per-node, "
                "--ps-per-node); worker:0, on the first node, is the chief."
            )
        if self.restarts and not self.backup_dir:
            raise UsageError(
                f"Received: restarts={self.restarts} with nodes and no backup_dir. A restart "
                "resumes from the chief's backup on whichever nodes are left, so the nodes "
                "must share it: give --backup-dir DIR, one directory of a shared file system "
                "on every node, and train with tfstrat.keras.callbacks.BackupAndRestore() (it "
                "reads TFSTRAT_BACKUP_DIR)."
            )
        if not 1 <= self.min_nodes <= len(self.nodes.plan):
            raise UsageError(
                f"Received: min_nodes={self.min_nodes} for {len(self.nodes.plan)} nodes. Use "
                f"1..{len(self.nodes.plan)}."
            )
        if self.restarts:
            from tfstrat.launcher.rendezvous import check_ports

            check_ports(self.nodes)  # each node's rendezvous: its first port - 1
        if self.private_network:
            raise UsageError(
                "Received: private_network=True with nodes. A private network holds one "
                "machine's tasks, which other nodes could not reach. Across machines, open only "
                "the job's ports to the job's hosts (`tfstrat tf-config --nodes ... --explain`)."
            )


def _show_names(show: str) -> list[str] | None:
    """The task names in `show`, or None for "all" and "chief"; ValueError when malformed."""
    text = show.strip().lower() if isinstance(show, str) else ""
    if text in ("all", "chief"):
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or not all(_TASK_NAME.match(n) for n in names):
        raise UsageError(
            f"Received: show={show!r}. Use 'chief' (the chief, else worker:0), 'all', or "
            "task names such as 'worker:1' or 'worker:0,ps:0'."
        )
    return names


def _shown(config: LaunchConfig, roles: Sequence[tuple[str, int]]) -> set[str]:
    """The names of the tasks of `roles` whose output goes to the launcher's stream."""
    local = [f"{t}:{i}" for t, i in roles]
    names = _show_names(config.show)
    if names is not None:
        return set(names) & set(local)
    if config.show.strip().lower() == "all":
        return set(local)
    lead = "chief:0" if config.chief else "worker:0"
    if lead in local:
        return {lead}
    trainers = [n for n in local if not n.startswith("ps:")]
    return set(trainers[:1])  # a node without worker:0 shows one of its own


def _resolve_log_dir(config: LaunchConfig) -> LaunchConfig:
    """`config` with the log directory made: the one asked for, or a new temporary one when
    some task is not shown."""
    if config.log_dir is not None:
        os.makedirs(config.log_dir, exist_ok=True)
        return config
    if set(_shown(config, _roles(config))) == {f"{t}:{i}" for t, i in _roles(config)}:
        return config
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return dataclasses.replace(config, log_dir=tempfile.mkdtemp(prefix=f"tfstrat-{stamp}-"))


def _open_log(config: LaunchConfig, name: str, start: int):
    """The task's log file (None without a log directory): new at the first start, appended
    to with a header line at every later one (restarts, port retries)."""
    if config.log_dir is None:
        return None
    path = os.path.join(config.log_dir, name.replace(":", "-") + ".log")
    f = open(path, "w" if start == 0 else "a", encoding="utf-8", buffering=1)
    if start:
        f.write(f"==== tfstrat launch: start {start + 1} of {name} (fresh ports) ====\n")
    return f


def _say_output(config: LaunchConfig, out: TextIO) -> None:
    """One line at the start: whose output is shown, and where every task's whole output is."""
    roles = _roles(config)
    shown = [f"{t}:{i}" for t, i in roles if f"{t}:{i}" in _shown(config, roles)]
    if config.log_dir is None:
        return
    if len(shown) == len(roles):
        out.write(f"tfstrat launch: every task's full output goes to {config.log_dir}\n")
    else:
        who = ", ".join(shown) if shown else "no task's output (failures only)"
        out.write(
            f"tfstrat launch: showing {who} (--show all for every task); every task's full "
            f"output goes to {config.log_dir}\n"
        )
    out.flush()


def _job_secret(config: LaunchConfig) -> bytes | None:
    """The job's base secret (each attempt's is derived from it): `secret_file`, else
    `TFSTRAT_SECRET_FILE`, else `TFSTRAT_SECRET`, else a random one on one machine; None across
    nodes without one (each node would draw its own)."""
    path = config.secret_file or os.environ.get(_secret.FILE_ENV)
    if path:
        return _secret.read_file(path)
    if os.environ.get(_secret.ENV):
        return os.environ[_secret.ENV].encode()
    return None if config.nodes is not None else os.urandom(32)


def _task_env(
    config: LaunchConfig,
    tf_config: TFConfig,
    task: str,
    index: int,
    restart: int,
    secret: str | None = None,
    cuda: str | None = None,
) -> dict:
    env = dict(os.environ)
    env.update(config.env or {})
    env.update(tf_config.for_task(task, index).to_env())
    if cuda is not None:  # this task's own GPUs (`tfstrat.launcher.gpus`)
        env["CUDA_VISIBLE_DEVICES"] = cuda
    env["TFSTRAT_TASK"] = f"{task}:{index}"
    env["TFSTRAT_RESTART"] = str(restart)
    if secret is not None:  # this attempt's: tasks of other jobs and attempts are refused
        env[_secret.ENV] = secret
    if config.nodes is not None:
        env["TFSTRAT_NODE_RANK"] = str(config.nodes.rank)
    if config.backup_dir:
        env[BACKUP_DIR_ENV] = config.backup_dir
    env["PYTHONUNBUFFERED"] = "1"
    env = _quiet.task_env(env, task, config.verbose)  # TF_CPP_MIN_LOG_LEVEL=2 unless set
    threads = threads_per_task(config, gpus=bool(cuda))
    if threads:  # both pools: 2 inter-op threads alone keep ~1.4 cores of a process busy
        env["TF_NUM_INTRAOP_THREADS"] = env["TF_NUM_INTEROP_THREADS"] = str(threads)
        env["OMP_NUM_THREADS"] = str(threads)
    # TensorFlow's BFC CPU allocator, also for tasks that never create a tfstrat strategy
    # (`tfstrat.runtime.allocator`).
    return _runtime.task_env(env)


def threads_per_task(config: LaunchConfig, gpus: bool = False) -> int:
    """Threads per TensorFlow pool for a task (0: TensorFlow's defaults); `gpus`: the launch
    gave the task GPUs of its own.

    A task that computes on GPUs keeps TensorFlow's pools unless `threads_per_task` says: its
    math runs on the cards, and the host threads feed its input pipeline and launch kernels,
    which a share of the cores (2 each for 8 tasks on 16 cores) would starve. Tasks on the CPU
    share the cores, or each would size its pools to all of them and they would fight.
    """
    if config.threads_per_task is not None:
        return config.threads_per_task
    if gpus:
        return 0
    if config.nodes is not None:  # this node's share of the cores
        training_tasks = sum(1 for _, (job, _) in config.nodes.local_tasks() if job != "ps")
    else:
        training_tasks = config.workers + (1 if config.chief else 0)
    return max(1, (os.cpu_count() or 1) // max(1, training_tasks))


def _local_cluster(config: LaunchConfig) -> TFConfig:
    if config.nodes is not None:
        return config.nodes.tf_config()
    return TFConfig.local(workers=config.workers, ps=config.ps, chief=config.chief)


def gpu_binding(config: LaunchConfig) -> tuple[dict[str, str], str | None]:
    """({task name: CUDA_VISIBLE_DEVICES} for the tasks this launcher starts ({}: unbound),
    a line to print or None): `tfstrat.launcher.gpus.plan`."""
    names = [f"{t}:{i}" for t, i in _roles(config)]
    return _gpus.plan(
        [n for n in names if not n.startswith("ps:")],
        [n for n in names if n.startswith("ps:")],
        config.gpus,
        config.gpus_per_task,
    )


def _roles(config: LaunchConfig) -> list[tuple[str, int]]:
    """The tasks this launcher starts: (type, index), ps tasks first."""
    if config.nodes is not None:
        local = [task for _, task in config.nodes.local_tasks()]
        return [t for t in local if t[0] == "ps"] + [t for t in local if t[0] != "ps"]
    roles = [("ps", i) for i in range(config.ps)]
    roles += [("chief", 0)] if config.chief else []
    return roles + [("worker", i) for i in range(config.workers)]


class _OtherNodes:
    """Polls the TensorFlow ports of the other nodes' workers, for a node that holds ps tasks:
    those must serve until every worker of the cluster has ended, not only this node's."""

    def __init__(self, trainers: Mapping[str, str], places: Mapping[str, str]):
        self.trainers, self.places = dict(trainers), places
        self.seen: set[str] = set()
        self.up: set[str] = set()
        self.polled_at = -1.0  # when the last complete poll started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.is_set():
            started = time.monotonic()
            up = {name for name, address in self.trainers.items() if _ports.accepts(address, 0.5)}
            with self._lock:
                self.up, self.polled_at = up, started
                self.seen |= up
            self._stop.wait(_POLL_OTHER_NODES)

    def ended(self, since: float, assume_seen: bool) -> bool:
        """Whether every other node's worker has come up (or `assume_seen`) and gone again,
        by a poll that started after `since`."""
        with self._lock:
            if self.polled_at < since:
                return False
            return not self.up and (assume_seen or self.seen == set(self.trainers))

    def never_seen(self) -> list[str]:
        """The other nodes' workers whose port has not accepted once yet, with their places."""
        with self._lock:
            return [f"{n} at {self.trainers[n]} on {self.places[n]}" for n in self.trainers
                    if n not in self.seen]  # fmt: skip

    def waiting_for(self, assume_seen: bool) -> str:
        with self._lock:
            names = [
                n for n in self.trainers if n in self.up or not (assume_seen or n in self.seen)
            ]
        return ", ".join(f"{n} on {self.places[n]}" for n in names) or "the other nodes' workers"

    def close(self):
        self._stop.set()


@dataclasses.dataclass(frozen=True)
class _Outcome:
    code: int
    port_taken: bool = False
    failure: Failure | None = None
    stopped: str | None = None  # why a rendezvous stopped the attempt (`abort`)


class _Attempt:
    """One start of every task, watched until the chief and workers end, one fails, or the
    deadline passes."""

    def __init__(
        self,
        config: LaunchConfig,
        tf_config: TFConfig,
        out: TextIO,
        restart: int,
        start: int,
        secret: str | None = None,
        abort: threading.Event | None = None,
    ):
        self.config, self.out, self.abort = config, out, abort
        server = [sys.executable, "-m", "tfstrat", "server"]
        roles = _roles(config)
        shown = _shown(config, roles)
        cuda, note = gpu_binding(config)
        if cuda or note:
            out.write((note or _gpus.describe(cuda)) + "\n")
        self.ps: list[Task] = []
        self.train: list[Task] = []
        try:
            for t, i in roles:
                name = f"{t}:{i}"
                task = Task(
                    name,
                    server if t == "ps" else config.command,
                    _task_env(config, tf_config, t, i, restart, secret, cuda.get(name)),
                    out,
                    shown=name in shown,
                    log=_open_log(config, name, start),
                    verbose=config.verbose,
                )
                (self.ps if t == "ps" else self.train).append(task)
        except BaseException:  # an interrupt or OSError midway: none of them may outlive us
            _tasks.stop(self.ps + self.train, 0)
            raise
        self.everyone = self.ps + self.train
        self.by_name = {t.name: t for t in self.everyone}
        self.places: dict[str, str] = {}
        self.others: _OtherNodes | None = None
        if config.nodes is not None:
            self.places = config.nodes.places()
            remote = config.nodes.remote_trainers()
            if self.ps and remote:
                self.others = _OtherNodes(remote, self.places)
        self.known = set(self.places) | set(self.by_name)  # tasks an error may blame
        self.started_at = time.monotonic()
        self.done_at: float | None = None  # when this launcher's chief and workers had all ended
        self.ended_at: dict[str, float] = {}  # training tasks seen exited 0, when first seen
        self.left_early: list[str] = []  # those that exited 0 while others still ran

    def run(self, deadline: float | None) -> _Outcome:
        try:
            while True:
                outcome = self._check(deadline)
                if outcome is not None:
                    return outcome
                time.sleep(0.05)
        except BaseException:
            _tasks.stop(self.everyone, self.config.grace)
            raise
        finally:
            if self.others is not None:
                self.others.close()

    def _check(self, deadline: float | None) -> _Outcome | None:
        trained = all(t.poll() == 0 for t in self.train)
        # A node of only ps tasks has nothing trained: it stops for the next attempt too.
        if self.abort is not None and self.abort.is_set() and not (self.train and trained):
            return self._stop_for_rendezvous()
        for task in self.everyone:
            code = task.poll()
            if code:  # a ps that exits 0 is fine once the workers need it no more
                return self._fail(task, code)
        self._note_left_early()
        missing = self._never_came_up()
        if missing:
            return self._give_up(missing)
        if trained and self._others_ended():
            _tasks.stop(self.ps, self.config.grace)
            _tasks.stop(self.train, 0)  # nothing left to stop: waits for their last output
            return _Outcome(0)
        if deadline is not None and time.monotonic() > deadline:
            running = ", ".join(t.name for t in self.everyone if t.poll() is None)
            _tasks.stop(self.everyone, self.config.grace)
            self.out.write(
                f"tfstrat launch: timed out after {self.config.timeout:g} s; stopped all tasks "
                f"(still running then: {running}).\n"
            )
            if self.config.log_dir is not None:
                self.out.write(f"tfstrat launch: every task's full output: {self.config.log_dir}\n")
            return _Outcome(EXIT_TIMEOUT)
        return None

    def _stop_for_rendezvous(self) -> _Outcome:
        """Another node's launcher gathers the next attempt: SIGTERM stops the training
        tasks after their step (with a backup), then the rest."""
        live = [t.name for t in self.everyone if t.poll() is None]
        if live:
            self.out.write(
                f"tfstrat launch: {self._here()}: stopping {', '.join(live)} for the next "
                f"attempt (SIGTERM, SIGKILL after {self.config.grace:g} s).\n"
            )
            self.out.flush()
        _tasks.stop(self.train, self.config.grace)
        _tasks.stop(self.ps, self.config.grace)
        return _Outcome(0, stopped="another node")

    def _others_ended(self) -> bool:
        """Whether this node's ps tasks may stop: no other node's worker runs any more."""
        if self.others is None:
            return True
        if self.done_at is None:
            self.done_at = time.monotonic()
            # A node with workers got here by training with the others (or next to them).
            assume_seen = bool(self.train)
            ps = ", ".join(t.name for t in self.ps)
            self.out.write(
                f"tfstrat launch: {self._here()}: "
                f"{'its workers are done; ' if self.train else ''}"
                f"{ps} {'keeps' if len(self.ps) == 1 else 'keep'} serving until these have "
                f"{'' if self.train else 'come up and '}ended: "
                f"{self.others.waiting_for(assume_seen)}.\n"
            )
            self.out.flush()
        return self.others.ended(max(self.done_at, self.started_at), bool(self.train))

    def _never_came_up(self) -> list[str]:
        """On a node of only ps tasks (nothing else fails it), the other nodes' workers that
        have not come up within `peer_timeout`."""
        if self.others is None or self.train:
            return []
        if time.monotonic() - self.started_at <= self.config.peer_timeout:
            return []
        return self.others.never_seen()

    def _give_up(self, missing: list[str]) -> _Outcome:
        ps = ", ".join(t.name for t in self.ps)
        self.out.write(
            f"tfstrat launch: {self._here()}: {', '.join(missing)} never came up within "
            f"{self.config.peer_timeout:g} s (nothing listened there); stopping {ps}. Start "
            "every node's launcher (the same --nodes, its own --node-rank), or raise "
            "--peer-timeout.\n"
        )
        self.out.flush()
        _tasks.stop(self.everyone, self.config.grace)
        return _Outcome(1)

    def _here(self) -> str:
        return self.config.nodes.node.where if self.config.nodes is not None else "this node"

    def _note_left_early(self):
        now = time.monotonic()
        running = [t.name for t in self.train if t.poll() is None]
        for task in self.train:
            if task.poll() != 0 or task.name in self.left_early:
                continue
            first_seen = self.ended_at.setdefault(task.name, now)
            if running and now - first_seen >= _LEFT_EARLY_AFTER:
                self.left_early.append(task.name)
                self.out.write(
                    f"tfstrat launch: {task.name} exited 0 while {', '.join(running)} still "
                    f"{'runs' if len(running) == 1 else 'run'}.\n"
                )
                self.out.flush()

    def _fail(self, task: Task, returncode: int) -> _Outcome:
        task.finish_output(timeout=2)
        # Any task seen exited 0 before this failure left while this one still ran.
        left = self.left_early + [n for n in self.ended_at if n not in self.left_early]
        failure = _tasks.blame(task, returncode, self.known, left, self.places)
        retry = task.port_error and self.config.nodes is None  # fixed ports across nodes
        live = [t.name for t in self.everyone if t.poll() is None]
        if live and not retry:  # the box comes after the stop, up to grace s later
            self.out.write(
                f"tfstrat launch: {failure.headline()}; stopping {', '.join(live)} "
                f"(SIGTERM, SIGKILL after {self.config.grace:g} s).\n"
            )
            self.out.flush()
        _tasks.stop(self.everyone, self.config.grace)
        if retry:
            return _Outcome(failure.code, port_taken=True)
        _tasks.report(failure, self.by_name, self.out, self.config.log_dir)
        if task.port_error:
            self.out.write(
                f"tfstrat launch: a port of {task.name} was taken. A multi-node run's ports are "
                f"fixed (no retries): free every task's port and the one above it on "
                f"{self.config.nodes.node.host}, or start every node with another --port.\n"
            )
        return _Outcome(failure.code, failure=failure)


def _no_restart_reason(failure: Failure, restarts_done: int, restarts: int) -> str | None:
    if failure.code in USAGE_EXIT_CODES:
        return (
            f"exit code {failure.code} means the command or its arguments are wrong "
            "(2: usage, 126: not executable, 127: not found)"
        )
    if restarts_done >= restarts:
        return f"no restarts left ({restarts_done} of --restarts {restarts} used)"
    return None


def _attempts(config: LaunchConfig, out: TextIO, deadline: float | None) -> int:
    """Runs attempts until one succeeds, times out, or fails without a restart left."""
    restart = port_retry = 0
    base = _job_secret(config)
    if base is None:
        out.write(
            "tfstrat launch: no job secret (--secret-file or TFSTRAT_SECRET_FILE, the same file "
            "on every node): tfstrat's ring and table-server ports take connections from anyone "
            "who reaches them.\n"
        )
    if config.nodes is not None and config.restarts:
        return _node_attempts(config, out, deadline, base)
    while True:
        start = restart + port_retry
        cluster = _local_cluster(config)
        secret = None  # a new one every start, of this cluster: others are refused
        if base is not None:
            secret = _secret.derive(base, start, cluster.to_dict()["cluster"])
        outcome = _Attempt(config, cluster, out, restart, start, secret).run(deadline)
        if outcome.port_taken:
            if port_retry >= config.port_retries:
                out.write("tfstrat launch: every retry found a port taken; giving up.\n")
                return outcome.code
            port_retry += 1
            out.write(
                f"tfstrat launch: a port was taken before TensorFlow bound it; retrying with "
                f"fresh ports ({port_retry}/{config.port_retries}).\n"
            )
            continue
        if outcome.failure is None:
            return outcome.code
        reason = _no_restart_reason(outcome.failure, restart, config.restarts)
        if reason is not None:
            if config.restarts:
                out.write(f"tfstrat launch: not restarting: {reason}.\n")
            return outcome.code
        restart += 1
        out.write(
            f"tfstrat launch: restart {restart}/{config.restarts}, every task on fresh ports "
            f"(TFSTRAT_RESTART={restart}), after {outcome.failure.summary()}\n"
        )
        out.flush()


def _node_attempts(
    config: LaunchConfig, out: TextIO, deadline: float | None, base: bytes | None
) -> int:
    """A multi-node run that restarts: before every attempt the nodes' launchers meet at a
    rendezvous (`tfstrat.launcher.rendezvous`), which names the attempt and its nodes."""
    from tfstrat.launcher.rendezvous import Rendezvous

    nodes = config.nodes
    say = lambda line: (out.write(f"tfstrat launch: {nodes.node.where}: {line}\n"), out.flush())  # noqa: E731
    try:
        rendezvous = Rendezvous(
            nodes,
            base,
            min_nodes=config.min_nodes,
            restarts=config.restarts,
            first_window=config.peer_timeout,
            window=config.rejoin_window,
            backup_dir=config.backup_dir,
        )
    except UsageError as e:
        say(str(e))
        return 1
    count = len(nodes.plan)
    if config.min_nodes <= count // 2:
        say(
            f"--min-nodes {config.min_nodes} is at most half of the {count} nodes: if the "
            "network between them splits, each half can go on alone and write the same "
            f"backup. --min-nodes {count // 2 + 1} rules that out."
        )
    why, cause, code = "start", "", 1
    try:
        while True:
            result = rendezvous.join(why, cause, code)
            if "stop" in result:
                say(f"not restarting: {result['stop']}.")
                # A failed attempt keeps its code even when the job ended well elsewhere.
                return int(result["code"]) or (code if why == "failure" else 0)
            n, ranks = int(result["round"]), list(result["ranks"])
            if nodes.rank not in ranks:  # decided without this node: join the next one
                continue
            hosts = ", ".join(nodes.plan[r].where for r in ranks)
            if n:
                say(
                    f"attempt {n} (TFSTRAT_RESTART={n}, restarts used {result['restarts']} of "
                    f"{config.restarts}) on {len(ranks)} node(s): {hosts}; after "
                    f"{result['cause']}"
                )
            else:
                say(f"attempt 0 on {len(ranks)} node(s): {hosts}")
            outcome = _node_attempt(config, out, deadline, base, rendezvous, n, ranks)
            if outcome.stopped is not None:  # another node gathers the next attempt
                why, cause, code = rendezvous.abort_why, rendezvous.abort_cause, 1
                continue
            if outcome.failure is not None and rendezvous.superseded():
                why, cause, code = "restart", rendezvous.abort_cause, 1  # stopped with the others
                continue
            if outcome.failure is None or outcome.failure.code in USAGE_EXIT_CODES:
                # Done (0), timed out (124), a ps-only node that gave up (1), a usage error:
                # no restart, and the other nodes must not restart without this one.
                if outcome.code == 0:
                    rendezvous.finished()
                else:
                    rendezvous.end(outcome.code, f"{nodes.node.where} stopped with exit code "
                                   f"{outcome.code}")  # fmt: skip
                if outcome.failure is not None:
                    say(f"not restarting: {_no_restart_reason(outcome.failure, 0, 1)}.")
                return outcome.code
            why, code = "failure", outcome.failure.code
            cause = outcome.failure.summary().rstrip(": ")
    finally:
        rendezvous.close()


def _node_attempt(config, out, deadline, base, rendezvous, n: int, ranks: list[int]) -> _Outcome:
    """Attempt `n` of this node, on the nodes `ranks` (numbered anew, `NodeLayout.among`)."""
    layout = config.nodes.among(ranks)
    attempt_config = _for_layout(config, layout)
    _say_layout(attempt_config, out, config.nodes.node.where)
    cluster = layout.tf_config()
    secret = None if base is None else _secret.derive(base, n, cluster.to_dict()["cluster"])
    rendezvous.started(n, ranks)
    try:
        return _Attempt(attempt_config, cluster, out, n, n, secret, abort=rendezvous.abort).run(
            deadline
        )
    finally:
        rendezvous.stopped()


def _for_layout(config: LaunchConfig, layout: NodeLayout) -> LaunchConfig:
    """`config` for one attempt on `layout`; `show` falls back to the chief's output when it
    names a task that attempt does not have."""
    try:
        return dataclasses.replace(config, nodes=layout)
    except UsageError:
        return dataclasses.replace(config, nodes=layout, show="chief")


def _command_problem(config: LaunchConfig) -> tuple[int, str] | None:
    """(exit code, message) when the command cannot run: 127 not found, 126 not executable."""
    name = config.command[0]
    path = (config.env or {}).get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(name, path=path):
        return None
    fix = "Give a program on PATH or the path of an executable file after `--`."
    if os.sep not in name:
        return 127, f"command not found: {name!r} is not on PATH. {fix}"
    if not os.path.exists(name):
        return 127, f"command not found: {name!r} does not exist. {fix}"
    return 126, (
        f"cannot run {name!r}: not an executable file. Run `chmod +x {name}`, or name its "
        f"interpreter: `-- python {name}`."
    )


def _say_layout(config: LaunchConfig, out: TextIO, where: str | None = None) -> None:
    """One line: which node this is, what it starts, and the cluster every node builds.
    `where`: the node's name in --nodes, when an attempt on fewer nodes numbers it anew."""
    nodes = config.nodes
    tasks = ", ".join(name for name, _ in nodes.local_tasks())
    cluster = {job: list(a) for job, a in nodes.tf_config().cluster.items()}
    this = nodes.node.where
    if where is not None and where != this:
        this = f"{where}, {this} in this attempt,"
    out.write(
        f"tfstrat launch: {this} of {len(nodes.plan)} nodes starts {tasks}; "
        f"cluster {json.dumps(cluster, separators=(',', ':'))}\n"
    )
    out.flush()


class _Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise _Interrupted(signum)


def launch(config: LaunchConfig, out: TextIO | None = None) -> int:
    """Runs a cluster (on this machine, or this node's share of it) to completion; returns
    its exit code.

    Args:
        config: what to run.
        out: where prefixed task output goes (default: sys.stdout).

    Returns:
        0 when every chief and worker task exits 0; the first failing task's exit code
        otherwise (128 + N for a task killed by signal N), after `config.restarts` restarts;
        124 on timeout; 127 when the command is not found, 126 when it is not executable;
        130 on SIGINT (Ctrl-C) and 143 on SIGTERM to the launcher, after stopping every task;
        125 when `private_network` was asked for and the kernel refused a network namespace.

    Example:
        >>> from tfstrat import LaunchConfig, launch
        >>> launch(LaunchConfig(["python", "-c", "print('hi')"], workers=2))  # doctest: +SKIP
        0
    """
    out = out or sys.stdout
    problem = _command_problem(config)
    if problem is not None:
        out.write(f"tfstrat launch: {problem[1]}\n")
        return problem[0]
    deadline = time.monotonic() + config.timeout if config.timeout else None
    in_main = threading.current_thread() is threading.main_thread()
    handled = (signal.SIGINT, signal.SIGTERM) if in_main else ()
    previous = {s: signal.signal(s, _raise_interrupted) for s in handled}
    try:
        config = _resolve_log_dir(config)
        if config.private_network:  # the launcher inside says what it shows, and where
            from tfstrat.launcher import private_network as _private

            return _private.run(config, out)
        if config.nodes is not None and not config.restarts:
            _say_layout(config, out)
        _say_output(config, out)
        return _attempts(config, out, deadline)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, _Interrupted) else signal.SIGINT
        out.write(f"tfstrat launch: {signal.Signals(signum).name} received; stopped all tasks.\n")
        return 128 + signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
