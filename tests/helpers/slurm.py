"""A real SLURM cluster on this machine, for the `slurm` test tier: one node per Linux network
namespace (`netns.Network`), each with its own address and name.

Layout of `SlurmCluster(nodes=2)`:

    host 0   slurmctld, at 10.77.0.1 (`SlurmctldHost=<this machine's name>(10.77.0.1)`: the
             controller recognizes itself by the machine's name)
    host i   node<i> (i >= 1): slurmd -N node<i>, `NodeName=node<i> NodeAddr=10.77.0.<i+1>`

Each slurmd is started with `nsenter --net=...` (under `ip netns exec`, which remounts /sys,
slurmd finds no cgroup file system and exits) in a mount namespace of its own, where a bind
mount shows an /etc/hosts that names every node: jobs resolve `node1`, `node2` as on a real
cluster, and the machine's /etc/hosts is never touched. One munged serves every node (its
socket is a file; the namespaces share the file system). Its key, the configuration, the
state and the logs live in one temporary directory. `close()` (or leaving the `with` block)
kills every daemon and removes the directory and the namespaces, also after a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import procs
from netns import Network, Unavailable

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "sinfo", "nsenter", "unshare")


def check_available() -> None:
    """Raises netns.Unavailable naming what is missing (root, SLURM's or munge's binaries)."""
    if os.geteuid() != 0:
        raise Unavailable("the slurm tier needs root (it starts SLURM's daemons in namespaces)")
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        raise Unavailable(
            f"the slurm tier needs {', '.join(missing)} "
            "(apt-get install -y slurm-wlm munge; scripts/test does it as root)"
        )


class SlurmCluster:
    """`nodes` SLURM compute nodes and a controller, each in its own network namespace."""

    def __init__(self, nodes: int = 2, cpus: int = 8):
        self.nodes = nodes
        self.cpus = cpus  # per node, as declared (SlurmdParameters=config_overrides)
        self.net = Network(hosts=nodes + 1)
        self.dir = ""
        self.daemons: list[subprocess.Popen] = []
        self.munged_pid: int | None = None

    # -- paths and environment ------------------------------------------------------------------

    @property
    def conf(self) -> str:
        return os.path.join(self.dir, "slurm.conf")

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": self.conf, **extra}

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def _in(self, host: int) -> list[str]:
        return ["nsenter", f"--net=/var/run/netns/{self.net.namespaces[host]}"]

    # -- building and tearing down --------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        check_available()
        self.net.__enter__()
        try:
            self.dir = tempfile.mkdtemp(prefix="tfstrat-slurm-")
            os.chmod(self.dir, 0o755)  # slurmd's job steps read the configuration
            self._configure()
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _configure(self) -> None:
        d, a = self.dir, [self.net.ipv4(i) for i in range(self.nodes + 1)]
        nodes = "\n".join(
            f"NodeName=node{i} NodeAddr={a[i]} CPUs={self.cpus} State=UNKNOWN"
            for i in range(1, self.nodes + 1)
        )
        with open(self.conf, "w") as f:
            f.write(
                f"""ClusterName=tfstrat
SlurmctldHost={socket.gethostname().split(".")[0]}({a[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes={",".join(self.node_names())} Default=YES MaxTime=INFINITE State=UP
"""
            )
        os.makedirs(f"{d}/state")
        with open(f"{d}/hosts", "w") as f:  # what every node's /etc/hosts shows
            f.write("127.0.0.1\tlocalhost\n")
            f.write("".join(f"{a[i]}\tnode{i}\n" for i in range(self.nodes + 1)))
        key = f"{d}/munge.key"
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)

    def _daemon(self, argv: list[str], log: str) -> None:
        with open(os.path.join(self.dir, log), "w") as out:
            self.daemons.append(
                subprocess.Popen(
                    argv,
                    env=self.env(),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killed whole by close()
                )
            )

    def _start(self, timeout: float = 60) -> None:
        d = self.dir
        munge = subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={d}/munge.socket",
                f"--key-file={d}/munge.key",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=30,
        )
        if munge.returncode:
            raise RuntimeError(f"munged did not start: {munge.stderr.strip()}")
        with open(f"{d}/munged.pid") as f:
            self.munged_pid = int(f.read().split()[0])
        self._daemon([*self._in(0), "slurmctld", "-D", "-i"], "slurmctld.out")
        for i in range(1, self.nodes + 1):
            start = f"mount --bind {d}/hosts /etc/hosts && exec slurmd -D -N node{i}"
            self._daemon(
                [*self._in(i), "unshare", "--mount", "--propagation", "private", "sh", "-c", start],
                f"slurmd-node{i}.out",
            )
        deadline = time.monotonic() + timeout
        while True:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            if states.count("idle") == self.nodes:
                return
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.daemons):
                raise RuntimeError(
                    f"the SLURM nodes did not come up within {timeout:g} s (sinfo: {states})\n"
                    + self.logs()
                )
            time.sleep(0.5)

    def leftovers(self, directory: str, namespaces: list[str]) -> list[str]:
        """What a closed cluster left behind: processes of its configuration, its munged, its
        directory, its namespaces (empty after `close`)."""
        left = [f"pid {p}" for p in procs.find(env=[f"SLURM_CONF={directory}/slurm.conf"])]
        left += [f"pid {p} (munged)" for p in procs.find(arg=f"--socket={directory}/munge.socket")]
        left += [directory] if os.path.exists(directory) else []
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        left += [ns for ns in namespaces if ns in names.split()]
        return left

    def close(self) -> None:
        """Kills every daemon and job step, removes the directory and the namespaces."""
        for proc in self.daemons:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.daemons.clear()
        # Job steps run under slurmstepd, which slurmd started in its own session: find them by
        # the configuration file in their environment, and kill them with their children.
        if self.dir:
            for pid in procs.find(env=[f"SLURM_CONF={self.conf}"]):
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self.munged_pid:
            try:
                os.kill(self.munged_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.munged_pid = None
        self.net.close()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    # -- using it -------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command (sinfo, squeue, scancel ...) on the controller's host."""
        proc = subprocess.run(
            [*self._in(0), *argv], env=self.env(), capture_output=True, text=True, timeout=30, **kw
        )
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def submit(self, script: str, *args: str, env: dict | None = None, cwd: str | None = None):
        """`sbatch --wait SCRIPT ARGS` from the controller's host, started in the background;
        returns (the sbatch process, the path of the job's output file)."""
        output = os.path.join(self.dir, "job-%j.out")
        proc = subprocess.Popen(
            [*self._in(0), "sbatch", "--wait", f"--output={output}", script, *args],
            env=self.env(**(env or {})),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        return proc, output

    def job_output(self, pattern: str) -> str:
        """The job's output file (`pattern` as `submit` returned it), or "" before it exists."""
        directory = os.path.dirname(pattern)
        prefix = os.path.basename(pattern).split("%j")[0]
        for name in sorted(os.listdir(directory)):
            if name.startswith(prefix) and name.endswith(".out"):
                with open(os.path.join(directory, name), errors="replace") as f:
                    return f.read()
        return ""

    def logs(self, limit: int = 3000) -> str:
        """The daemons' logs, last lines first in each, for an assertion's message."""
        parts = []
        for name in sorted(os.listdir(self.dir)) if self.dir else ():
            if name.endswith((".log", ".out")) and not name.startswith("job-"):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    parts.append(f"== {name}\n{f.read()[-limit:]}")
        return "\n".join(parts)
