"""Where tfstrat's own listeners bind (tfstrat/cluster/ports.py): declared ports, own addresses."""

import socket

import pytest

from tfstrat.cluster import ports as _ports
from tfstrat.errors import ListenError


def test_split_and_join_handle_ipv6():
    assert _ports.split("[fd00::10]:2222") == ("fd00::10", 2222)
    assert _ports.split("node-1:2222") == ("node-1", 2222)
    assert _ports.join("fd00::10", 2223) == "[fd00::10]:2223"
    assert _ports.join("10.0.0.2", 2223) == "10.0.0.2:2223"


def test_tfstrat_port_is_the_tf_config_port_plus_the_offset(monkeypatch):
    assert _ports.tfstrat_port("h:2222") == 2223
    monkeypatch.setenv(_ports.PORT_OFFSET_ENV, "5")
    assert _ports.tfstrat_port("[::1]:2222") == 2227
    monkeypatch.setenv(_ports.PORT_OFFSET_ENV, "zero")
    with pytest.raises(ValueError, match=r"TFSTRAT_PORT_OFFSET='zero'. Use a whole number"):
        _ports.tfstrat_port("h:2222")
    monkeypatch.delenv(_ports.PORT_OFFSET_ENV)
    with pytest.raises(ValueError, match=r"'h:65535'.*above 65535"):
        _ports.tfstrat_port("h:65535")


def test_route_source_is_loopback_for_a_local_cluster_and_none_for_no_peer():
    assert _ports.route_source(["127.0.0.1:2222"]) == "127.0.0.1"
    assert _ports.route_source(["localhost:2222"]) in ("127.0.0.1", "::1")
    # The Debian default for a host's own name: the route to it is loopback too.
    assert _ports.route_source(["127.0.1.1:2222"]).startswith("127.")
    assert _ports.route_source(["no-such-host.invalid:2222"]) is None
    assert _ports.route_source(["no-such-host.invalid:1", "127.0.0.1:2"]) == "127.0.0.1"
    assert _ports.wildcard("fd00::1") == "::" and _ports.wildcard("h") == "0.0.0.0"


def test_a_failed_bind_names_task_address_and_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as e:
            _ports.listen("127.0.0.1", port, "worker:1", "ring")
    message = str(e.value)
    assert f"worker:1: its ring cannot listen on 127.0.0.1:{port}" in message
    assert "TF_CONFIG port + 1" in message and "TFSTRAT_PORT_OFFSET" in message
    with pytest.raises(ListenError, match=r"worker:0: its ring cannot listen on 10.255"):
        _ports.listen("10.255.255.254", 0, "worker:0", "ring")  # on no interface here
