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


def test_reader_bench_quick_on_tiny_data(tmp_path, tiny_data):
    """``recsys bench reader --quick`` end to end: every side read the same rows; the kept
    readers' worker processes were counted while alive and are gone afterwards; the ratios
    and paired figures come from the recorded seconds. No timings asserted."""
    import multiprocessing

    out = tmp_path / "reader.json"
    result = bench.run("reader", json_out=out, quick=True, data=tiny_data)
    saved = json.loads(out.read_text())
    names = ["reader, 0 workers", "reader, 2 workers", "reader, 2 workers, first epoch"]
    assert [c["name"] for c in saved["comparisons"]] == [f"{n} vs raw iter_batches" for n in names]
    assert [c["name"] for c in result["comparisons"]] == [c["name"] for c in saved["comparisons"]]
    secs = saved["seconds_per_run"]
    rows = saved["settings"]["rows"]
    assert rows > 0 and all(len(secs[k]) == saved["settings"]["repeats"] == 3 for k in ["raw", *names])
    for c, n in zip(saved["comparisons"], names):
        assert c["ratio"] == (rows / min(secs[n])) / (rows / min(secs["raw"]))
        assert c["paired_ratios"] == [round(b / a, 4) for a, b in zip(secs[n], secs["raw"])]
        assert ("target_ratio" in c) == (n != names[2])
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("recsys-reader")]


def _touch_pages_then_wait(touched, release) -> None:
    b = bytearray(64 << 20)
    b[::4096] = b"x" * (16 << 10)
    touched.set()
    release.wait(60)


def test_reader_bench_costs_count_live_child_processes():
    """A kept reader's workers are alive when a run ends: their page faults are read from
    /proc while they run (a forked child writing one byte in each page of 64 MiB)."""
    import multiprocessing

    from recsys.bench.reader import _usage

    ctx = multiprocessing.get_context("fork")
    touched, release = ctx.Event(), ctx.Event()
    before = _usage()
    child = ctx.Process(target=_touch_pages_then_wait, args=(touched, release))
    child.start()
    try:
        assert touched.wait(60)
        after = _usage()
        assert child.is_alive()  # not reaped: RUSAGE_CHILDREN cannot hold its faults yet
    finally:
        release.set()
        child.join()
    assert after["minor_faults"] - before["minor_faults"] >= (64 << 20) // 4096
