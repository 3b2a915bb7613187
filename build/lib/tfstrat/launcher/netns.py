"""Enters a private network, then runs a command in it: `tfstrat launch --private-network`.

`python -I -S netns.py PARENT_PID COMMAND...` moves itself into a new network namespace whose
only interface is loopback, brings `lo` up, and execs COMMAND (the inner `tfstrat launch`), so
every task it starts shares that namespace: they reach each other on 127.0.0.1, and nothing
outside the namespace (other machines, other processes of this one) reaches them. As root it
creates a network namespace alone (unshare(2) with CLONE_NEWNET); otherwise, or where root may
not (a container without CAP_SYS_ADMIN), a user namespace with it, mapping this user to itself,
so the tasks keep their user and files. The capabilities that the new user namespace gives are
used to bring `lo` up only; the exec drops them.

It imports only the standard library: unshare(CLONE_NEWUSER) fails with EINVAL in a process
that has threads, and importing tfstrat or TensorFlow could start some.
"""

import ctypes
import errno
import fcntl
import os
import signal
import socket
import struct
import sys

_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_PR_SET_PDEATHSIG = 1
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: name, then ifr_flags in the union
EXIT_REFUSED = 125  # the launcher itself failed (as `timeout` and `env` use it)
_PREFIX = "tfstrat launch --private-network"

_FIXES = {
    errno.EPERM: (
        "the kernel or a security policy refuses user namespaces to this user. Allow them "
        "(Debian kernels: sysctl -w kernel.unprivileged_userns_clone=1; Ubuntu 23.10+: sysctl "
        "-w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile that allows "
        "userns for this python), or in a container allow unshare(2) (its seccomp profile, or "
        "run as root with CAP_SYS_ADMIN); or run without --private-network behind a firewall"
    ),
    errno.ENOSPC: (
        "a namespace limit is reached or 0: raise sysctl user.max_user_namespaces and "
        "user.max_net_namespaces (e.g. sysctl -w user.max_net_namespaces=10000)"
    ),
    errno.EINVAL: "this kernel lacks user or network namespaces (CONFIG_USER_NS, CONFIG_NET_NS)",
}
_FIXES[errno.EUSERS] = _FIXES[errno.ENOSPC]
_FIXES[errno.EACCES] = _FIXES[errno.EPERM]
_FIXES[errno.ENOSYS] = _FIXES[errno.EINVAL]


class Refused(Exception):
    """The kernel refused a step; the message names it and the fix."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> int:
    """0, or the errno of unshare(2)."""
    try:
        if _libc().unshare(flags) == 0:
            return 0
        return ctypes.get_errno()
    except (AttributeError, OSError):  # no unshare(2): not Linux
        return errno.ENOSYS


def _why(err: int) -> str:
    return f"{os.strerror(err)} ({errno.errorcode.get(err, err)})"


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise Refused(
            f"writing {text!r} to {path} in the new user namespace failed: "
            f"{_why(e.errno or 0)}. The kernel created the namespace without the rights to set "
            f"it up (AppArmor's userns restriction on Ubuntu 23.10+: sysctl -w "
            f"kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for python)"
        ) from None


def _loopback_up() -> None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = _IFREQ.unpack(fcntl.ioctl(s, _SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0)))[1]
            fcntl.ioctl(s, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))
    except OSError as e:
        raise Refused(
            f"bringing up `lo` in the new network namespace failed: {_why(e.errno or 0)}. The "
            "namespace lacks CAP_NET_ADMIN (a security module?); run without --private-network "
            "behind a firewall"
        ) from None


def enter() -> str:
    """Moves this process into a new network namespace with `lo` up; returns what it made.

    Raises:
        Refused: the kernel refused every way, with what failed and the fix.
    """
    tried = []
    if os.geteuid() == 0:
        err = _unshare(_CLONE_NEWNET)
        if not err:
            _loopback_up()
            return "a new network namespace"
        tried.append(f"unshare(CLONE_NEWNET) as root: {_why(err)}")
    uid, gid = os.geteuid(), os.getegid()
    err = _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    if err:
        tried.append(f"unshare(CLONE_NEWUSER|CLONE_NEWNET) as uid {uid}: {_why(err)}")
        fix = _FIXES.get(err, "see unshare(2) for this error")
        raise Refused(f"{'; then '.join(tried)}. Fix: {fix}")
    _write("/proc/self/setgroups", "deny")  # required before gid_map without CAP_SETGID outside
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _loopback_up()
    return "a new user and network namespace (unprivileged)"


def main(argv: list[str]) -> None:
    parent, command = int(argv[1]), argv[2:]
    try:
        made = enter()
    except Refused as e:
        print(f"{_PREFIX}: could not create the private network: {e}. Nothing was started.")
        sys.stdout.flush()
        os._exit(EXIT_REFUSED)
    # Set after unshare: this process dies with the launcher that started it.
    try:
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (AttributeError, OSError):
        pass
    if os.getppid() != parent:  # the launcher died before the prctl
        os._exit(EXIT_REFUSED)
    print(
        f"{_PREFIX}: every task runs in {made} with only loopback (lo) up; nothing of the job "
        "is reachable from outside it.",
        flush=True,
    )
    try:
        os.execv(command[0], command)
    except OSError as e:
        print(f"{_PREFIX}: cannot run {command[0]!r}: {e.strerror}", flush=True)
        os._exit(EXIT_REFUSED)


if __name__ == "__main__":
    main(sys.argv)
