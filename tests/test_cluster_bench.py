"""`tfstrat bench cluster`'s ring on two emulated hosts: network namespaces on a bridge, each
link shaped both ways, no TensorFlow in the hosts' processes. What it checks is that the bytes
really cross the links: the hosts' interface counters against what the ring says it sent (no
timing is asserted: speed is the benchmark's, run by hand)."""

from __future__ import annotations

import json

import netns
import pytest

pytestmark = [pytest.mark.multihost]


@pytest.mark.timeout(120)
def test_two_host_ring_moves_its_bytes_over_the_shaped_link(tmp_path):
    from tfstrat.bench import cluster

    try:
        netns.check_available()
    except netns.Unavailable as e:
        netns.skip_or_fail(str(e))
    sizes = (4, 1 << 16, 1 << 20)
    config = cluster.ClusterConfig(
        hosts=(2,), link="1gbit", sizes=sizes, iters=4, seconds=1.0, peers=False, parts=("ring",),
        out=str(tmp_path),
    )  # fmt: skip
    rows = cluster.run(config)
    assert [(r["hosts"], r["link"]) for r in rows] == [(2, None), (2, "1gbit")]
    for row in rows:
        # each host sends its whole vector once a call (2 warm-ups, then the timed ones)
        payload = sum((2 + s["calls"]) * size for s, size in zip(row["sizes"], sizes))
        assert [s["bytes"] for s in row["sizes"]] == list(sizes)
        assert all(s["calls"] >= 3 and s["seconds"] > 0 for s in row["sizes"]), row["sizes"]
        for host, (claimed, wire) in enumerate(zip(row["ring_bytes_sent"], row["interface_bytes"])):
            # headers: a few dozen bytes a call; the interface adds TCP/IP's per packet
            assert payload <= claimed <= payload + 200 * sum(s["calls"] + 3 for s in row["sizes"])
            assert claimed <= wire["tx"] <= 1.1 * claimed + 100_000, (host, claimed, wire)
            assert claimed <= wire["rx"] <= 1.1 * claimed + 100_000, (host, claimed, wire)
        model = row["model"]
        assert model["hosts"] == 2 and model["beta_s_per_byte"] > 0
    saved = json.loads((tmp_path / "cluster.json").read_text())
    assert len(saved) == 2
    text = (tmp_path / "cluster.md").read_text()
    assert "| 2 | 1gbit | 1 MiB |" in text and "interfaces sent" in text, text


@pytest.mark.timeout(150)
def test_two_workers_per_host_sum_within_the_host_and_send_less_over_the_links(tmp_path):
    """2 hosts x 2 workers: the two-level exchange (sum within the host, then one ring per
    worker across the hosts on half the vector) against the same four in one flat ring, side
    by side. Each host's interface carries what the rings say crossed it, and the two levels
    send each host's vector once a call where the flat ring sends 2(4-1)/4 = 1.5 times it."""
    from tfstrat.bench import cluster

    try:
        netns.check_available()
    except netns.Unavailable as e:
        netns.skip_or_fail(str(e))
    size = 1 << 20
    config = cluster.ClusterConfig(
        hosts=(2,), link="1gbit", sizes=(size,), iters=4, seconds=1.0, peers=False,
        parts=("ring",), unshaped=False, workers_per_host=2, out=str(tmp_path),
    )  # fmt: skip
    rows = cluster.run(config)
    assert [(r["impl"], r["workers"]) for r in rows] == [
        ("tfstrat ring", 4), ("tfstrat ring (flat)", 4)
    ], rows  # fmt: skip
    per_call = {}
    for row in rows:
        calls = 2 + row["sizes"][0]["calls"]
        between = row["between_hosts_bytes"]
        for host, wire in enumerate(row["interface_bytes"]):
            claimed = between[2 * host] + between[2 * host + 1]
            assert claimed <= wire["tx"] <= 1.1 * claimed + 100_000, (row["impl"], host, wire)
            per_call.setdefault(row["impl"], []).append(claimed / calls)
    for host_bytes in per_call["tfstrat ring"]:  # the vector, and its headers
        assert size <= host_bytes < size + 2_000, per_call
    for host_bytes in per_call["tfstrat ring (flat)"]:  # last worker of the host: 1.5x
        assert 1.5 * size <= host_bytes < 1.5 * size + 2_000, per_call
    assert "| 2 x 2 flat | 1gbit | 1 MiB |" in (tmp_path / "cluster.md").read_text()


@pytest.mark.timeout(120)
def test_the_ps_rows_serve_every_row_over_the_ps_hosts_link(tmp_path):
    """The ps rows (one table server, 1 and 2 clients in lockstep, no TensorFlow): every
    client's lookups and pushes crossed the ps host's interface (its rows out, their
    gradients in), and the ps's CPU seconds were read over the timed steps."""
    from tfstrat.bench import cluster

    try:
        netns.check_available()
    except netns.Unavailable as e:
        netns.skip_or_fail(str(e))
    config = cluster.ClusterConfig(hosts=(2,), parts=("ps",), ps_clients=2, ps_steps=20,
                                   out=str(tmp_path))  # fmt: skip
    rows = cluster.run(config)
    assert [(r["impl"], r["clients"]) for r in rows] == [("ps capacity", 1), ("ps capacity", 2)]
    for r in rows:
        # warm-up and timed steps: each client's rows out and their gradients in
        payload = r["clients"] * (50 + 20) * r["ids"] * r["dim"] * 4
        wire = r["ps_interface_bytes"]
        assert payload <= wire["tx"] <= 1.2 * payload + 200_000, (payload, wire)
        assert payload <= wire["rx"] <= 1.2 * payload + 200_000, (payload, wire)
        assert r["rows_per_s"] > 0 and 0 < r["ps_cpu_share"] and r["rows_per_ps_cpu_s"] > 0, r
    assert "| 2 | " in (tmp_path / "cluster.md").read_text()


@pytest.mark.timeout(180)
def test_two_launchers_on_two_hosts_agree_on_the_restart_after_a_failure(tmp_path):
    """The launcher row: `tfstrat launch --nodes` on each emulated host, the last node's toy
    task fails in attempt 0, and both launchers run attempts 0 and 1 on both nodes."""
    from tfstrat.bench import cluster

    try:
        netns.check_available()
    except netns.Unavailable as e:
        netns.skip_or_fail(str(e))
    config = cluster.ClusterConfig(hosts=(2,), link="1gbit", parts=("launchers",),
                                   out=str(tmp_path))  # fmt: skip
    (row,) = cluster.run(config)
    assert "error" not in row, row
    assert row["hosts"] == 2 and row["agreement_s"] > 0 and row["launch_s"] > 0, row
    assert "| 2 | 1gbit |" in (tmp_path / "cluster.md").read_text()


@pytest.mark.timeout(300)
def test_a_two_host_training_row_counts_its_all_reduce_on_the_interfaces(tmp_path):
    """The dense training row (CollectiveAllReduce, 2 hosts, Keras fit of the 1.84M-weight
    MLP): each host's interface moved about the all-reduce's bytes a step (2 hosts exchange
    whole vectors: 7.4 MB each way a step), counted in the timed epochs only (the counters are
    read within about 20 ms of the worker's marks: a few percent of 8 steps)."""
    from tfstrat.bench import _cluster_train, cluster

    try:
        netns.check_available()
    except netns.Unavailable as e:
        netns.skip_or_fail(str(e))
    config = cluster.ClusterConfig(hosts=(2,), link="1gbit", parts=("dense",), unshaped=False,
                                   train_rows=("D-CAR-2",), train_steps=8, train_repeats=1,
                                   out=str(tmp_path))  # fmt: skip
    (row,) = cluster.run(config)
    assert "error" not in row, row
    assert row["id"] == "D-CAR-2" and row["workers"] == 2 and row["global_batch"] == 128, row
    per_step = row["busiest_bytes_per_example"] * row["global_batch"]
    vector = _cluster_train.DENSE_BYTES
    assert 0.9 * vector <= per_step <= 1.1 * vector + 200_000, (per_step, vector)
    for host in row["interface_bytes"]:
        assert 8 * 0.9 * vector <= host["tx"] <= 8 * (1.1 * vector + 200_000), host
    assert row["startup_s"] > 0 and row["examples_per_s"] > 0, row
