"""Several "hosts" on one machine: Linux network namespaces joined by a bridge, for
`tfstrat bench cluster`, the tests' `multihost` tier and `benchmarks/multihost`. Needs root and
iproute2; imports no TensorFlow.

Layout of one `Network(hosts=3)` (names carry a per-run prefix, `tfs<pid>`):

    tfs<pid>s   the switch: a bridge `br0` and one port `p<i>` per host
    tfs<pid>h<i> host i: `eth0` (the other end of `p<i>`), 10.77.0.<i+1>/24 and fd00:77::<i+1>/64,
                `lo` up, names from /etc/netns/<ns>/hosts (which `ip netns exec` bind-mounts
                over /etc/hosts)

A link rate (`rate="1gbit"`) is a `tc tbf` qdisc on both ends of each host's link: the host's
`eth0` (what it sends) and its switch port (what it receives), with a burst of about 1 ms at
that rate. This kernel's `tc` has no `netem`: no delay is emulated. `counters()` reads the
bytes each host's `eth0` sent and received, to check what a benchmark claims it moved.

Nothing is created in, or changed of, the root namespace: every link is created directly inside
its namespace. `close()` (or leaving the `with` block) kills every process started here (its
whole process group), deletes the namespaces and their /etc/netns directories, also after a
failure. Namespaces left by a run that was killed (`tfs<pid>` of a dead process) are removed
when the next one starts.

Example:
    with Network(hosts=3) as net:
        task = net.start(0, ["python", "-c", "print(1)"], name="worker:0")
        net.wait([task], timeout=60)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

SUBNET4 = "10.77.0"  # host i is SUBNET4.(i+1)
SUBNET6 = "fd00:77::"  # host i is SUBNET6(i+1)
SERVICES4 = "10.96.0"  # ClusterIP-style service addresses: on no interface
IP = shutil.which("ip") or "/usr/sbin/ip"
UNSHARE = shutil.which("unshare")  # util-linux: each host its own hostname
_OURS = re.compile(r"^tfs(\d+)[a-z]?(s|h\d+)$")  # prefix tfs<pid>, optional letter


class Unavailable(RuntimeError):
    """This machine cannot build the network (not root, no `ip netns`, no iptables); the
    message says why."""


def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def iptables() -> str | None:
    """The iptables binary, or None where it is not installed."""
    for path in (shutil.which("iptables"), "/usr/sbin/iptables", "/sbin/iptables"):
        if path and os.access(path, os.X_OK):
            return path
    return None


def check_available() -> None:
    """Raises Unavailable (with the reason) unless namespaces can be built here."""
    if os.geteuid() != 0:
        raise Unavailable("the multihost tier needs root (it creates network namespaces)")
    if not os.access(IP, os.X_OK):
        raise Unavailable("the multihost tier needs iproute2's `ip` (apt-get install iproute2)")
    probe = f"tfs{os.getpid()}probe"
    proc = _run(IP, "netns", "add", probe, check=False)
    if proc.returncode:
        raise Unavailable(f"`ip netns add` failed here: {proc.stderr.strip()}")
    try:
        # `ip netns exec` needs a private mount namespace (it bind-mounts /etc/netns/<ns>/*).
        proc = _run(IP, "netns", "exec", probe, "true", check=False)
        if proc.returncode:
            raise Unavailable(f"`ip netns exec` failed here: {proc.stderr.strip()}")
        proc = _run(IP, "-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if proc.returncode:
            raise Unavailable(f"no Linux bridge in a namespace: {proc.stderr.strip()}")
    finally:
        _run(IP, "netns", "del", probe, check=False)


def sweep_stale() -> list[str]:
    """Deletes namespaces (and /etc/netns dirs) named `tfs<pid>...` whose process is gone:
    the leftovers of a run that was killed before it could clean up."""
    removed = []
    names = _run(IP, "netns", "list", check=False).stdout.split()
    for name in names:
        m = _OURS.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run(IP, "netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            removed.append(name)
    return removed


@dataclass
class Task:
    """A process started in one host's namespace; its stdout+stderr go to `log`."""

    name: str
    host: int
    argv: list[str]
    proc: subprocess.Popen
    log: str
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def output(self, limit: int = 6000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                text = f.read()
        except OSError as e:
            return f"(no output: {e})"
        return text if len(text) <= limit else "...\n" + text[-limit:]


class TaskError(AssertionError):
    """A task failed or timed out; the message holds every task's output."""


class Network:
    """N host namespaces on one bridge; see the module docstring.

    Args:
        hosts: how many host namespaces.
        rate: e.g. "1gbit": every host sends and receives at most this (`tc tbf` on its
            `eth0` and on its switch port); None for none.
        prefix: namespace name prefix (default `tfs<pid>`; `tfs<pid>` and one letter for
            several networks at once, which `sweep_stale` still recognizes).
        hostnames: each started process sees its host's name (`names[i]`) as its hostname,
            in a UTS namespace of its own (util-linux's `unshare`), as on separate machines;
            False: the machine's hostname.
    """

    def __init__(
        self,
        hosts: int = 3,
        rate: str | None = None,
        prefix: str | None = None,
        hostnames: bool = False,
    ):
        if not 2 <= hosts <= 200:
            raise ValueError(f"Received: hosts={hosts}. Use 2 to 200.")
        self.hosts = hosts
        self.rate = rate
        if rate is not None:
            rate_bits(rate)  # a bad rate fails here, by name
        self.hostnames = hostnames
        self.prefix = prefix or f"tfs{os.getpid()}"
        self.switch = f"{self.prefix}s"
        self.namespaces = [f"{self.prefix}h{i}" for i in range(hosts)]
        self.names = [f"node{i}" for i in range(hosts)]  # DNS names of the hosts
        self.services = [f"svc{i}" for i in range(hosts)]  # ClusterIP-style names
        self.tasks: list[Task] = []
        self.logdir = ""  # made by __enter__
        self._created: list[str] = []

    # -- addresses ----------------------------------------------------------------------------

    def ipv4(self, i: int) -> str:
        return f"{SUBNET4}.{i + 1}"

    def ipv6(self, i: int) -> str:
        return f"{SUBNET6}{i + 1}"

    def service_ip(self, i: int) -> str:
        return f"{SERVICES4}.{i + 1}"

    # -- building and tearing down ------------------------------------------------------------

    def __enter__(self) -> Network:
        check_available()
        sweep_stale()
        try:
            self.logdir = tempfile.mkdtemp(prefix=f"{self.prefix}-logs-")
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _run(IP, "netns", "add", name)
        self._created.append(name)
        _run(IP, "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.switch)
        _run(IP, "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run(IP, "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            self._add_ns(ns)
            # Created inside the two namespaces at once: the root namespace never sees it.
            _run(IP, "-n", self.switch, "link", "add", f"p{i}", "type", "veth",
                 "peer", "name", "eth0", "netns", ns)  # fmt: skip
            _run(IP, "-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _run(IP, "-n", self.switch, "link", "set", f"p{i}", "up")
            _run(IP, "-n", ns, "addr", "add", f"{self.ipv4(i)}/24", "dev", "eth0")
            # nodad: usable at once, not after duplicate address detection's ~2 s.
            _run(IP, "-n", ns, "addr", "add", f"{self.ipv6(i)}/64", "dev", "eth0", "nodad")
            _run(IP, "-n", ns, "link", "set", "eth0", "up")
            # Service addresses are on no interface; a route sends them out of eth0, where the
            # nat OUTPUT rules (if any) rewrite them first, as kube-proxy's do.
            _run(IP, "-n", ns, "route", "add", f"{SERVICES4}.0/24", "dev", "eth0")
            if self.rate:
                # Both directions: eth0 shapes what the host sends, its switch port what it
                # receives (a ps's incoming pushes too).
                for where, dev in ((ns, "eth0"), (self.switch, f"p{i}")):
                    _run(IP, "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                         *tbf(self.rate))  # fmt: skip
        self.write_hosts()
        self._wait_ipv6_ready()

    def _wait_ipv6_ready(self, timeout: float = 10) -> None:
        # With nodad the addresses are not "tentative", but the link may still be coming up.
        deadline = time.monotonic() + timeout
        for ns in self.namespaces:
            while True:
                out = _run(IP, "-n", ns, "-6", "addr", "show", "dev", "eth0").stdout
                if (
                    "tentative" not in out
                    and "state UP" in _run(IP, "-n", ns, "link", "show", "eth0").stdout
                ):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ns}: eth0 not up after {timeout} s: {out}")
                time.sleep(0.05)

    def close(self) -> None:
        """Kills every started process group, deletes every namespace and /etc/netns dir."""
        for task in self.tasks:
            _kill(task)
        for name in reversed(self._created):
            _run(IP, "netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        self._created.clear()
        if self.logdir:
            shutil.rmtree(self.logdir, ignore_errors=True)

    # -- names --------------------------------------------------------------------------------

    def write_hosts(self, own_name_loopback: Iterable[int] = (), extra: Mapping[str, str] = {}):
        """Writes every host's /etc/hosts (as `ip netns exec` will show it).

        Args:
            own_name_loopback: hosts whose own name resolves, on themselves only, to 127.0.1.1
                (the Debian default, and how SLURM nodes are often set up); the other hosts
                resolve it to its real address.
            extra: more "name: address" lines for every host (ClusterIP-style names are always
                there).
        """
        own = set(own_name_loopback)
        for i, ns in enumerate(self.namespaces):
            lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
            for j, name in enumerate(self.names):
                address = "127.0.1.1" if (j == i and i in own) else self.ipv4(j)
                lines.append(f"{address}\t{name}")
                lines.append(f"{self.ipv6(j)}\t{name}-v6")
            for j, name in enumerate(self.services):
                lines.append(f"{self.service_ip(j)}\t{name}")
            lines += [f"{address}\t{name}" for name, address in extra.items()]
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            # A new file each time: a process that is running keeps the file it was shown.
            tmp = f"/etc/netns/{ns}/hosts.tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(lines) + "\n")
            os.replace(tmp, f"/etc/netns/{ns}/hosts")

    # -- ClusterIP-style services -------------------------------------------------------------

    def declare_services(self, ports: Mapping[int, Sequence[int]]) -> None:
        """Kubernetes ClusterIP semantics for host i's service `svc<i>` (address
        `service_ip(i)`, on no interface): in every namespace, a nat OUTPUT rule forwards each
        declared port of the service to the same port of host i's own address; any other port
        of the service goes nowhere. Replaces the rules of an earlier call.

        Args:
            ports: host index -> the ports its service declares.

        Raises:
            Unavailable: iptables is not installed, or has no nat table here.
        """
        binary = iptables()
        if binary is None:
            raise Unavailable(
                "the ClusterIP case needs iptables (apt-get install -y iptables); not found"
            )
        for ns in self.namespaces:
            proc = _run(IP, "netns", "exec", ns, binary, "-t", "nat", "-F", "OUTPUT", check=False)
            if proc.returncode:  # e.g. a kernel without nf_tables / iptable_nat
                raise Unavailable(
                    f"the ClusterIP case needs iptables' nat table in a namespace; "
                    f"`{binary} -t nat -F OUTPUT` failed: {proc.stderr.strip()}"
                )
            for i, declared in ports.items():
                for port in declared:
                    _run(IP, "netns", "exec", ns, binary, "-t", "nat", "-A", "OUTPUT",
                         "-d", self.service_ip(i), "-p", "tcp", "--dport", str(port),
                         "-j", "DNAT", "--to-destination", f"{self.ipv4(i)}:{port}")  # fmt: skip

    def clear_services(self) -> None:
        binary = iptables()
        if binary is None:
            return
        for ns in self.namespaces:
            _run(IP, "netns", "exec", ns, binary, "-t", "nat", "-F", "OUTPUT", check=False)

    # -- what moved ---------------------------------------------------------------------------

    def counters(self) -> list[dict[str, int]]:
        """Per host, the bytes its `eth0` has sent ("tx") and received ("rx") so far."""
        import json

        out = []
        for ns in self.namespaces:
            (link,) = json.loads(_run(IP, "-j", "-s", "-n", ns, "link", "show", "eth0").stdout)
            stats = link.get("stats64") or link["stats"]
            out.append({"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])})
        return out

    # -- processes ----------------------------------------------------------------------------

    def start(
        self,
        host: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        cwd: str | None = None,
    ) -> Task:
        """Starts `ip netns exec NS env K=V... ARGV` in the background, in its own process group,
        output to a file; as one would start it by hand on host `host` (with `hostnames`, it
        sees that host's name as its hostname)."""
        name = name or f"h{host}:{len(self.tasks)}"
        log = os.path.join(self.logdir, f"{len(self.tasks):03d}-{name.replace(':', '_')}.log")
        env_args = [f"{k}={v}" for k, v in (env or {}).items()]
        hostname = []
        if self.hostnames:
            if UNSHARE is None:
                raise Unavailable("hostnames=True needs util-linux's `unshare`; not found")
            script = 'hostname "$0" && exec "$@"'
            hostname = [UNSHARE, "--uts", "sh", "-c", script, self.names[host]]
        full = [IP, "netns", "exec", self.namespaces[host], *hostname, "env", *env_args, *argv]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                full,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole by close()
            )
        task = Task(name, host, list(argv), proc, log)
        self.tasks.append(task)
        return task

    def stop(self, task: Task) -> None:
        """Kills a task's process group (SIGKILL) and reaps it."""
        _kill(task)

    def run(self, host: int, argv: Sequence[str], timeout: float = 30) -> str:
        """Runs a short command in host `host`'s namespace; returns its stdout (raises on error)."""
        proc = subprocess.run(
            [IP, "netns", "exec", self.namespaces[host], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode:
            raise RuntimeError(
                f"{self.namespaces[host]}: {' '.join(argv)} exited {proc.returncode}: "
                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        return proc.stdout

    def wait(self, tasks: Sequence[Task], timeout: float, background: Sequence[Task] = ()) -> None:
        """Waits until every one of `tasks` has exited 0; kills them all (and `background`, e.g.
        ps servers) when one fails or `timeout` seconds pass, and raises TaskError with every
        task's output. `background` tasks are killed once `tasks` are done."""
        deadline = time.monotonic() + timeout
        failed: Task | None = None
        pending = list(tasks)
        while pending and failed is None:
            for task in list(pending):
                code = task.proc.poll()
                if code is None:
                    continue
                task.ended = time.monotonic()
                pending.remove(task)
                if code != 0:
                    failed = task
                    break
            for task in background:
                if failed is None and task.proc.poll() is not None:
                    task.ended = time.monotonic()
                    failed = task
            if pending and failed is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        for task in [*pending, *background]:
            _kill(task)
        if failed is not None:
            raise TaskError(
                f"{failed.name} (host {failed.host}) exited {failed.proc.returncode}\n"
                + self.report([*tasks, *background])
            )
        if pending:
            raise TaskError(
                f"timed out after {timeout:.0f} s waiting for "
                f"{', '.join(t.name for t in pending)}\n" + self.report([*tasks, *background])
            )

    def report(self, tasks: Iterable[Task] | None = None, limit: int = 6000) -> str:
        """Every task's command, exit code and (the end of its) output."""
        parts = []
        for task in self.tasks if tasks is None else tasks:
            code = task.proc.returncode
            parts.append(
                f"===== {task.name} on {self.namespaces[task.host]} ({self.names[task.host]}), "
                f"exit {code if code is not None else 'running'}: {' '.join(task.argv)}\n"
                + task.output(limit)
            )
        return "\n".join(parts)


def result(task: Task) -> dict:
    """The JSON of the last `RESULT {...}` line `task` printed (raises naming it if none)."""
    import json

    text = task.output(limit=1 << 22)
    found = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise TaskError(f"{task.name} printed no RESULT line:\n{text[-3000:]}")
    return json.loads(found[-1][len("RESULT ") :])


def rate_bits(rate: str) -> float:
    """Bits per second of a `tc` rate ("1gbit", "200mbit", "500kbit", "10gbit")."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(
            f"Received: a link rate {rate!r}. Write it as tc does: e.g. 1gbit, 200mbit."
        )
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return value * (8 if m.group(3) == "bps" else 1)


def counters_delta(before: list[dict], after: list[dict]) -> list[dict]:
    """What each host's `eth0` sent and received between two `Network.counters()` reads."""
    return [{k: a[k] - b[k] for k in ("tx", "rx")} for b, a in zip(before, after, strict=True)]


def tbf(rate: str) -> list[str]:
    """`tc qdisc add ... root` arguments of a token bucket at `rate`: a burst of about 1 ms
    at that rate (at least 16 KiB, what tbf needs at the kernel's tick), a 20 ms queue like a
    switch port's."""
    burst = max(16 * 1024, int(rate_bits(rate) / 8 / 1000))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "20ms"]


def _kill(task: Task) -> None:
    if task.proc.poll() is None:
        try:
            os.killpg(task.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        task.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
