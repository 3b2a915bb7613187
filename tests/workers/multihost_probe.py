"""Probes of the multihost test network, run inside one host's namespace (no TensorFlow).

Usage:
    python multihost_probe.py listen PORT...     accepts on every port (all interfaces, v4 and
                                                 v6) until killed; prints "listening" when ready
    python multihost_probe.py connect HOST PORT  prints "ok LOCAL_ADDRESS" or "error ERRNO_NAME"
    python multihost_probe.py bind HOST          prints "ok" or "error ERRNO_NAME"
"""

import errno
import socket
import sys
import threading

mode = sys.argv[1]
if mode == "listen":
    sockets = []
    for port in map(int, sys.argv[2:]):
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::", port))
        s.listen(16)
        sockets.append(s)

    def serve(s):
        while True:
            s.accept()[0].close()

    for s in sockets:
        threading.Thread(target=serve, args=(s,), daemon=True).start()
    print("listening", flush=True)
    threading.Event().wait()
elif mode == "connect":
    host, port = sys.argv[2], int(sys.argv[3])
    try:
        with socket.create_connection((host, port), timeout=1) as c:
            print("ok", c.getsockname()[0])
    except OSError as e:
        print("error", errno.errorcode.get(e.errno, "timeout") if e.errno else "timeout")
elif mode == "bind":
    host = sys.argv[2]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        print("ok")
    except OSError as e:
        print("error", errno.errorcode.get(e.errno, str(e.errno)))
