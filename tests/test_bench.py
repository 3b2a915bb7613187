"""Smoke test of the benchmarks: they run and write their files. Never a speed."""

import json

import pytest

from tfstrat.cli import main

pytestmark = pytest.mark.cluster


def test_scaling_quick_writes_the_table(tmp_path, capsys):
    code = main(["bench", "scaling", "--quick", "--workers", "2", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr()
    for ext in ("md", "json", "png"):
        assert (tmp_path / f"scaling.{ext}").stat().st_size > 0
    rows = json.loads((tmp_path / "scaling.json").read_text())
    ids = ["P-1", "P-all", "A-1", "A-2", "B-2", "PS-S-2", "PS-A-2"]
    assert [r["row"] for r in rows] == ids
    for r in rows:
        assert "error" not in r, r
        assert r["examples_per_s"] > 0 and r["machine"]["cpus"] >= 1
        assert r["global_batch"] == 8 * r["total_devices"]
    assert rows[ids.index("B-2")]["efficiency"] > 0
    table = (tmp_path / "scaling.md").read_text()
    assert "| B-2 | CollectiveAllReduce | 2 | 1 | 2 |" in table


def test_allreduce_quick_writes_the_table(tmp_path, capsys):
    code = main(
        ["bench", "allreduce", "--quick", "--peer", "--workers", "2", "--out", str(tmp_path)]
    )
    assert code == 0, capsys.readouterr()
    rows = json.loads((tmp_path / "allreduce.json").read_text())
    assert [r["bytes"] for r in rows] == [4, 64, 1024, 16384]
    for r in rows:
        assert r["workers"] == 2 and r["tcp_GBps"] > 0
        for impl in ("tfstrat", "tfstrat-grpc", "stock"):
            assert r[f"{impl}_ms"] > 0
            assert r[f"{impl}_busbw_GBps"] == pytest.approx(r[f"{impl}_algbw_GBps"])  # 2(n-1)/n = 1
    assert (tmp_path / "allreduce.png").stat().st_size > 0


def test_sparse_quick_writes_the_table(tmp_path, capsys):
    code = main(["bench", "sparse", "--quick", "--workers", "2", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr()
    rows = json.loads((tmp_path / "sparse.json").read_text())
    assert [r["row"] for r in rows] == ["P-1", "P-all", "C-2", "PS-S-2", "PS-A-2", "H-2"]
    for r in rows:
        assert "error" not in r, r
        assert r["examples_per_s"] > 0 and r["final_loss"] > 0 and r["peak_rss_mb"] > 0
    # Measured from what the strategy handed its collectives (a packed sparse gather was
    # there), and for ParameterServer and Hybrid on the sockets to the ps.
    assert all(r["bytes_sent_per_step"] > 0 for r in rows[2:])
    assert (tmp_path / "sparse.png").stat().st_size > 0
