"""TF_CONFIG as a typed, validated value: build it, parse it, check it, hand it to TensorFlow.

`TFConfig` reads what Kubeflow's TFJob, Ray Train and hand-written scripts put in `TF_CONFIG`,
builds one from host lists, SLURM or a Horovod hostfile, and writes JSON that TensorFlow's
`TFConfigClusterResolver` accepts unchanged. Bad input raises `TFConfigError` with one line that
names the value and the fix. Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tfstrat.cluster import hosts as _hosts
from tfstrat.cluster import ports
from tfstrat.cluster.hosts import check_address, show, to_int
from tfstrat.cluster.nodes import plan
from tfstrat.errors import TFConfigError

if TYPE_CHECKING:
    from tensorflow.distribute.cluster_resolver import ClusterResolver

logger = logging.getLogger(__name__)

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
_RPC_RE = re.compile(r"[A-Za-z0-9+._-]+")
_EXAMPLE = "e.g. {'worker': ['host-0:2222', 'host-1:2222']}"


def _check_job(job: str, addresses: object) -> tuple[str, ...]:
    where = f"TF_CONFIG['cluster'][{job!r}]"
    if isinstance(addresses, (str, bytes, bytearray)) or not isinstance(addresses, Sequence):
        raise TFConfigError(
            f"Received: {where}={show(addresses)}. Use a list of 'host:port' strings (sparse "
            f"{{index: address}} clusters are not supported), {_EXAMPLE}."
        )
    if len(addresses) > 1 and job in ("chief", "evaluator"):
        raise TFConfigError(
            f"Received: {where}={show(list(addresses))}. A cluster has at most one {job}; "
            f"keep one{' and make the others workers' if job == 'chief' else ''}."
        )
    for i, address in enumerate(addresses):
        check_address(f"{where}[{i}]", address)
    return tuple(addresses)


def _check_cluster(cluster: object) -> Mapping[str, tuple[str, ...]]:
    """Validates a cluster; returns it read-only, in TASK_TYPES order, without empty jobs."""
    if not isinstance(cluster, Mapping):
        raise TFConfigError(
            f"Received: TF_CONFIG['cluster']={show(cluster)}. Map task types to lists of "
            f"'host:port', {_EXAMPLE}."
        )
    for job in cluster:
        if not isinstance(job, str) or job not in TASK_TYPES:
            raise TFConfigError(
                f"Received: task type {show(job)} in TF_CONFIG['cluster']. Rename it to one of "
                f"{', '.join(TASK_TYPES)} (Kubeflow's 'master' is 'chief')."
            )
    jobs: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for job in (job for job in TASK_TYPES if job in cluster):
        jobs[job] = _check_job(job, cluster[job])
        for i, address in enumerate(jobs[job]):
            if address in seen:
                raise TFConfigError(
                    f"Received: TF_CONFIG['cluster'][{job!r}][{i}]={address!r}, also used by "
                    f"{seen[address]}. Give every task its own address, e.g. another port."
                )
            seen[address] = f"TF_CONFIG['cluster'][{job!r}][{i}]"
    return types.MappingProxyType({job: tasks for job, tasks in jobs.items() if tasks})


def _check_task(cluster: Mapping[str, tuple[str, ...]], task_type: object, index: object) -> None:
    """Checks that the task (type and already-parsed int index) is one of the cluster's tasks."""
    if task_type is None and index is None:
        return
    if task_type is None or index is None:
        raise TFConfigError(
            f"Received: task_type={show(task_type)}, task_index={index}. Give both or neither, "
            "e.g. TF_CONFIG['task'] = {'type': 'worker', 'index': 0}."
        )
    if not isinstance(task_type, str) or task_type not in TASK_TYPES:
        raise TFConfigError(
            f"Received: task_type={show(task_type)}. Use one of {', '.join(TASK_TYPES)} "
            "(Kubeflow's 'master' is 'chief')."
        )
    task, size = f"task={task_type}:{index}", len(cluster.get(task_type, ()))
    if not cluster:
        raise TFConfigError(f"Received: {task} with an empty cluster. Add addresses, {_EXAMPLE}.")
    if task_type == "evaluator" and size == 0:
        # Kubeflow's TFJob leaves the evaluator out of `cluster`: it serves no gRPC endpoint.
        if index != 0:
            raise TFConfigError(f"Received: {task}. There is one evaluator; use index 0.")
    elif size == 0:
        raise TFConfigError(
            f"Received: {task}. TF_CONFIG['cluster'] has no {task_type!r} tasks (it has "
            f"{', '.join(cluster)}); pick one of those or add TF_CONFIG['cluster'][{task_type!r}]."
        )
    elif not 0 <= index < size:
        raise TFConfigError(
            f"Received: {task}. TF_CONFIG['cluster'][{task_type!r}] has {size} tasks "
            f"(0..{size - 1}); pick an index in range or add the address."
        )


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """A validated TF_CONFIG: the cluster's addresses and, optionally, this process's task.

    Construction validates everything (task types, addresses, duplicates, the task's place in the
    cluster) and raises `TFConfigError` otherwise. `cluster` is stored as a read-only mapping of
    tuples in the order chief, worker, ps, evaluator, with empty jobs dropped.

    Attributes:
        cluster: task type ('chief', 'worker', 'ps', 'evaluator') to its 'host:port' addresses.
        task_type: this process's task type, or None for a cluster description only.
        task_index: this process's index within `task_type` (a digit string is converted).
        rpc_layer: the protocol TensorFlow servers use.
        environment: TF_CONFIG's 'environment' (Kubeflow writes 'cloud'), or None.

    Example:
        >>> config = TFConfig.from_hosts(worker=["a:2222", "b:2222"], ps=["c:2222"])
        >>> config.num_workers, config.addresses("ps"), config.for_task("worker", 1).task_address
        (2, ('c:2222',), 'b:2222')
        >>> TFConfig.from_hosts(["a:1"], task_type="worker", task_index=0).to_json()
        '{"cluster":{"worker":["a:1"]},"task":{"type":"worker","index":0},"rpc_layer":"grpc"}'
    """

    cluster: Mapping[str, Sequence[str]]
    task_type: str | None = None
    task_index: int | None = None
    rpc_layer: str = "grpc"
    environment: str | None = None

    def __post_init__(self) -> None:
        cluster = _check_cluster(self.cluster)
        index = None if self.task_index is None else to_int("task_index", self.task_index, None)
        _check_task(cluster, self.task_type, index)
        # Frozen dataclass: normalized values can only be stored through object.__setattr__.
        object.__setattr__(self, "cluster", cluster)
        object.__setattr__(self, "task_index", index)
        if not isinstance(self.rpc_layer, str) or not _RPC_RE.fullmatch(self.rpc_layer):
            raise TFConfigError(f"Received: rpc_layer={show(self.rpc_layer)}. Use e.g. 'grpc'.")
        if self.environment is not None and not isinstance(self.environment, str):
            raise TFConfigError(f"Received: environment={show(self.environment)}. Use a string.")

    def __reduce__(self) -> tuple[Any, ...]:
        # A mappingproxy cannot be pickled; rebuild from a dict (for copy.deepcopy and pickle).
        args = (self.task_type, self.task_index, self.rpc_layer, self.environment)
        return (type(self), (dict(self.cluster), *args))

    @classmethod
    def local(
        cls, workers: int = 2, ps: int = 0, chief: bool = False, evaluator: bool = False
    ) -> TFConfig:
        """A cluster on 127.0.0.1, on distinct ports that were free when checked; no task.

        Raises:
            TFConfigError: negative counts, no worker and no chief, or ports could not be bound.

        Example:
            >>> config = TFConfig.local(workers=2, ps=1)
            >>> config.task_types, len(set(config.addresses("worker") + config.addresses("ps")))
            (('worker', 'ps'), 3)
        """
        args = {"chief": chief, "worker": workers, "ps": ps, "evaluator": evaluator}
        counts = {
            job: to_int("workers" if job == "worker" else job, int(n) if isinstance(n, bool) else n)
            for job, n in args.items()
        }
        if counts["worker"] + counts["chief"] == 0:
            raise TFConfigError(
                f"Received: workers={workers}, chief={chief}. Ask for at least one worker."
            )
        # Every task listens on its port and on its tfstrat port (port + 1).
        pairs = iter(ports.free_port_pairs(sum(counts.values())))
        return cls(
            {job: [f"127.0.0.1:{next(pairs)}" for _ in range(n)] for job, n in counts.items()}
        )

    @classmethod
    def from_hosts(
        cls,
        worker: Sequence[str] = (),
        ps: Sequence[str] | None = None,
        chief: str | None = None,
        evaluator: str | None = None,
        task_type: str | None = None,
        task_index: int | None = None,
    ) -> TFConfig:
        """A cluster from 'host:port' lists (in index order), optionally with this task.

        Example:
            >>> config = TFConfig.from_hosts(["a:2222"], chief="b:2222")
            >>> config.for_task("chief", 0).is_chief, config.for_task("worker", 0).is_chief
            (True, False)
        """
        cluster: dict[str, object] = {"worker": worker, "ps": () if ps is None else ps}
        if chief is not None:
            cluster["chief"] = [chief]
        if evaluator is not None:
            cluster["evaluator"] = [evaluator]
        return cls(cluster, task_type, task_index)

    @classmethod
    def from_dict(cls, data: object) -> TFConfig:
        """A TFConfig from decoded TF_CONFIG data; unknown top-level keys are ignored."""
        task = data.get("task") if isinstance(data, Mapping) else None
        if not isinstance(data, Mapping) or "cluster" not in data:
            raise TFConfigError(
                f"Received: TF_CONFIG={show(data)}. Use an object with a 'cluster' key, e.g. "
                "{'cluster': {'worker': ['a:2222']}, 'task': {'type': 'worker', 'index': 0}}."
            )
        if not isinstance(task, Mapping | None):
            raise TFConfigError(
                f"Received: TF_CONFIG['task']={show(task)}. Use {{'type': 'worker', 'index': 0}}"
                " or leave it out."
            )
        task, rpc_layer = task or {}, data.get("rpc_layer")
        return cls(
            cluster=data["cluster"],
            task_type=task.get("type"),
            task_index=task.get("index"),
            rpc_layer="grpc" if rpc_layer is None else rpc_layer,
            environment=data.get("environment"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TFConfig:
        """Parses TF_CONFIG's JSON (Kubeflow TFJob, Ray Train and TensorFlow's own format)."""
        try:
            data = json.loads(text)
        except (ValueError, TypeError, RecursionError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise TFConfigError(
                f"Received: TF_CONFIG={show(text)}. It is not valid JSON ({reason}); "
                "write it with json.dumps or `tfstrat tf-config`."
            ) from err
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TFConfig:
        """Reads the `TF_CONFIG` environment variable from `environ` (default `os.environ`)."""
        environ = os.environ if environ is None else environ
        text = environ.get("TF_CONFIG") if isinstance(environ, Mapping) else None
        if text is None or text == "":
            raise TFConfigError(
                "Received: TF_CONFIG unset or empty. Export it (`tfstrat tf-config --export`) or "
                "build a TFConfig with from_hosts, from_slurm or from_hostfile."
            )
        return cls.from_json(text)

    @classmethod
    def from_slurm(
        cls, environ: Mapping[str, str] | None = None, port: int = 12345, ps: int = 0
    ) -> TFConfig:
        """One task per SLURM task; this process's task is the one at SLURM_PROCID.

        Task `k` on a node (its local rank) listens on `host:port+2k` (and on the port above
        it, its tfstrat port). Tasks are numbered in
        SLURM's block order (the first node's tasks first, `srun --distribution=block`). The
        first `ps` tasks by SLURM_PROCID become ps tasks and the rest workers, so this process
        is `ps:PROCID` or `worker:PROCID-ps`. Unlike TensorFlow's SlurmClusterResolver, this needs
        no GPU or `nvidia-smi`.

        Args:
            environ: the environment to read (default `os.environ`): SLURM_PROCID,
                SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST, e.g. `node[01-03,07]`),
                SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE, e.g. `2(x3),1`; one task
                per node if both are unset) and SLURM_LOCALID (if set, checked against the order).
            port: the base port on every node.
            ps: how many of the first tasks are parameter servers.

        Example:
            >>> env = {"SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "n[1-2]",
            ...        "SLURM_TASKS_PER_NODE": "2(x2)"}
            >>> config = TFConfig.from_slurm(env, port=2222)
            >>> config.addresses("worker"), config.task_address
            (('n1:2222', 'n1:2224', 'n2:2222', 'n2:2224'), 'n2:2222')
        """
        environ = os.environ if environ is None else environ
        port = to_int("port", port, 1, 65535)
        proc_id = to_int(*_hosts.slurm_var(environ, "SLURM_PROCID"))
        hosts = _hosts.expand_nodelist(
            *_hosts.slurm_var(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        )
        counts = _hosts.slurm_tasks_per_node(environ, len(hosts))
        tasks = [(host, k) for host, n in zip(hosts, counts, strict=True) for k in range(n)]
        if proc_id >= len(tasks):
            raise TFConfigError(
                f"Received: SLURM_PROCID={proc_id} for {len(tasks)} tasks. Run it under srun."
            )
        local_id = environ.get("SLURM_LOCALID")
        if local_id is not None and local_id != str(tasks[proc_id][1]):
            raise TFConfigError(
                f"Received: SLURM_LOCALID={show(local_id)} for SLURM_PROCID={proc_id}; block "
                f"order gives local rank {tasks[proc_id][1]}. Use srun --distribution=block."
            )
        ps = to_int("ps", ps, 0, len(tasks) - 1, f" ({len(tasks)} tasks, one must be a worker)")
        step = ports.offset() + 1  # each task's port and its tfstrat port
        addresses = [ports.join(host, port + step * k) for host, k in tasks]
        task = ("ps", proc_id) if proc_id < ps else ("worker", proc_id - ps)
        return cls({"worker": addresses[ps:], "ps": addresses[:ps]}, *task)

    @classmethod
    def from_hostfile(
        cls,
        path: str | os.PathLike[str],
        port: int = 12345,
        task_type: str | None = None,
        task_index: int | None = None,
    ) -> TFConfig:
        """Workers from a Horovod hostfile: N workers per host at port, port+2, ..., port+2N-2
        (each worker also listens on the port above its own, its tfstrat port).

        Lines are `host slots=N` or a bare `host` (one slot); `#` starts a comment.

        Example:
            >>> import pathlib, tempfile
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     path = pathlib.Path(tmp, "hosts")
            ...     _ = path.write_text("# rack 1\\na slots=2\\nb\\n")
            ...     TFConfig.from_hostfile(path, port=2222).addresses("worker")
            ('a:2222', 'a:2224', 'b:2222')
        """
        port = to_int("port", port, 1, 65535)
        try:
            if not isinstance(path, str | os.PathLike):
                raise TypeError("not a path")  # open(3) would read file descriptor 3
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, ValueError, TypeError) as err:
            raise TFConfigError(
                f"Received: path={show(path)}. Cannot read it as a UTF-8 hostfile ({err})."
            ) from err
        workers: list[str] = []
        for number, line in enumerate(lines, 1):
            host, slots = _hosts.parse_hostfile_line(line, f"{os.fspath(path)}:{number}", port)
            step = ports.offset() + 1
            workers += [ports.join(host, port + step * k) for k in range(slots)]
            if len(workers) > _hosts.MAX_TASKS:
                break
        if not 0 < len(workers) <= _hosts.MAX_TASKS:
            raise TFConfigError(
                f"Received: hostfile {os.fspath(path)!r} with {len(workers)} slots. List 1.."
                f"{_hosts.MAX_TASKS} slots in lines like 'node1 slots=2'."
            )
        return cls({"worker": workers}, task_type, task_index)

    @classmethod
    def from_nodes(
        cls,
        nodes: str | Sequence[str],
        workers_per_node: int | str | Sequence[int] = 1,
        ps_per_node: int | str | Sequence[int] = 0,
        port: int = 12345,
        task_type: str | None = None,
        task_index: int | None = None,
    ) -> TFConfig:
        """The cluster `tfstrat launch --nodes` builds, the same on every node.

        On each node its workers, then its ps tasks, listen on port, port+2, port+4, ... (each
        task's tfstrat port is the one above its own); workers and ps tasks are numbered node
        by node. A node written `host:port` starts at its own port.

        Args:
            nodes: `"a,b"`, `"node[01-04]"`, `"10.0.0.1:2222,[fd00::2]"`, or a list of those.
            workers_per_node: workers on every node, or one count per node (`"2,2,0"`).
            ps_per_node: ps tasks on every node, or one count per node (`"0,0,1"`).
            port: the first task's port on a node that gives none.
            task_type: this process's task type, or None.
            task_index: this process's index within `task_type`, or None.

        Example:
            >>> config = TFConfig.from_nodes("a,b", workers_per_node=2, ps_per_node="1,0", port=2222)
            >>> config.addresses("worker"), config.addresses("ps")
            (('a:2222', 'a:2224', 'b:2222', 'b:2224'), ('a:2226',))
        """
        cluster: dict[str, list[str]] = {"worker": [], "ps": []}
        for node in plan(nodes, workers_per_node, ps_per_node, port):
            for job, _, address in node.tasks:
                cluster[job].append(address)
        return cls(cluster, task_type, task_index)

    def for_task(self, task_type: str | None, task_index: int | None) -> TFConfig:
        """A copy of this config for another task (validated)."""
        return dataclasses.replace(self, task_type=task_type, task_index=task_index)

    def require_task(self, who: str) -> None:
        """Raises TFConfigError unless this config names this process's task (`who`, e.g.
        "CollectiveAllReduce", says what needs it): TensorFlow's own error for a cluster with
        no task names neither the variable nor the fix.

        Example:
            >>> TFConfig.from_hosts(["a:1", "b:1"]).require_task("CollectiveAllReduce")
            Traceback (most recent call last):
            ...
            tfstrat.errors.TFConfigError: Received: TF_CONFIG with a cluster ...
        """
        if self.task_type is None:
            raise TFConfigError(
                f"Received: TF_CONFIG with a cluster ({', '.join(f'{len(a)} {job}' for job, a in self.cluster.items())}) "
                f"but no 'task'. {who} needs this process's own task: TF_CONFIG['task'] = "
                "{'type': 'worker', 'index': N}, different on every process (`tfstrat launch` "
                "sets it; by hand: `tfstrat tf-config --task worker:N`)."
            )

    def to_dict(self) -> dict[str, Any]:
        """TF_CONFIG as JSON-ready data; 'task' only with a task, 'environment' only if set."""
        data: dict[str, Any] = {"cluster": {job: list(a) for job, a in self.cluster.items()}}
        if self.task_type is not None:
            data["task"] = {"type": self.task_type, "index": self.task_index}
        data["rpc_layer"] = self.rpc_layer
        if self.environment is not None:
            data["environment"] = self.environment
        return data

    def to_json(self) -> str:
        """Compact TF_CONFIG JSON, accepted unchanged by TensorFlow's TFConfigClusterResolver."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """`{"TF_CONFIG": json}`, or a copy of `environ` with TF_CONFIG set."""
        return {**(environ or {}), "TF_CONFIG": self.to_json()}

    @property
    def num_workers(self) -> int:
        """Tasks that train: workers plus the chief."""
        return len(self.addresses("worker")) + len(self.addresses("chief"))

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief, or worker 0 when the cluster has no chief."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def task_name(self) -> str | None:
        """This task as "type:index" ("worker:1", "ps:0"), or None without a task."""
        return None if self.task_type is None else f"{self.task_type}:{self.task_index}"

    def trainer_name(self, worker: int | None = None) -> str:
        """A training task's name for messages: "chief", "worker:N", and "worker:0 (the chief)"
        in a cluster without a chief task. `worker` counts the chief first, as TensorFlow ranks
        the workers; None names this task.

        Example:
            >>> config = TFConfig.from_hosts(["a:1", "b:1"])
            >>> [config.trainer_name(w) for w in range(config.num_workers)]
            ['worker:0 (the chief)', 'worker:1']
        """
        has_chief = bool(self.cluster.get("chief"))
        if worker is None:
            if self.task_type == "chief":
                return "chief"
            worker = self.task_index + has_chief
        if has_chief:
            return "chief" if worker == 0 else f"worker:{worker - 1}"
        return f"worker:{worker}" + (" (the chief)" if worker == 0 else "")

    @property
    def task_types(self) -> tuple[str, ...]:
        """The task types in `cluster`, in the order chief, worker, ps, evaluator."""
        return tuple(self.cluster)

    @property
    def task_address(self) -> str | None:
        """This task's 'host:port'; None without a task or for an evaluator outside `cluster`."""
        if self.task_type not in self.cluster:
            return None
        return self.cluster[self.task_type][self.task_index]

    def addresses(self, task_type: str) -> tuple[str, ...]:
        """The addresses of `task_type`; empty if the cluster has none of that type."""
        if task_type not in TASK_TYPES:
            raise TFConfigError(
                f"Received: task_type={show(task_type)}. Use one of {', '.join(TASK_TYPES)}."
            )
        return tuple(self.cluster.get(task_type, ()))

    def resolver(self) -> ClusterResolver:
        """A TensorFlow cluster resolver for this config (imports TensorFlow)."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({job: list(a) for job, a in self.cluster.items()}),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer=self.rpc_layer,
            environment=self.environment or "",
        )
