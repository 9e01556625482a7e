"""The benchmark plumbing: table, JSON shape, ratios computed from the measured numbers."""

import json

from recsys import bench


def test_comparison_ratio_and_table():
    c = bench.comparison("x", 30.0, 60.0, "rows/s")
    assert c["ratio"] == 0.5
    table = bench.format_table({"comparisons": [c]})
    assert "x" in table and "0.500" in table


def test_hashing_bench_quick_writes_json(tmp_path, capsys):
    out = tmp_path / "h.json"
    result = bench.run("hashing", json_out=out, quick=True)
    saved = json.loads(out.read_text())
    assert saved["target"] == "hashing" and saved["quick"] is True
    assert [c["name"] for c in saved["comparisons"]] == [c["name"] for c in result["comparisons"]]
    for c in saved["comparisons"]:
        assert c["ours"] > 0 and c["baseline"] > 0
        assert abs(c["ratio"] - c["ours"] / c["baseline"]) < 1e-9
    assert saved["peak_rss_mb"]["self"] > 0
    assert "ratio" in capsys.readouterr().out


def test_reader_bench_costs_count_the_work_of_finished_child_processes():
    """``recsys bench reader`` charges a run the CPU and page faults of its worker processes
    (reaped children): a child writing one byte in each 4 KiB page of 64 MiB (from malloc, which
    does not ask for huge pages) shows at least those 16 k page faults."""
    import subprocess
    import sys

    from recsys.bench.reader import _usage

    before = _usage()
    subprocess.run([sys.executable, "-c", "b = bytearray(64 << 20); b[::4096] = b'x' * (16 << 10)"], check=True)
    after = _usage()
    assert after["minor_faults"] - before["minor_faults"] >= (64 << 20) // 4096
    assert after["user_s"] + after["sys_s"] > before["user_s"] + before["sys_s"]
