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
