"""``recsys bench convert --quick`` on a given Criteo-format file."""

from __future__ import annotations

import gzip

from test_convert import criteo  # noqa: F401  (the fixture: a small Criteo-format set)


def test_bench_convert_quick_on_a_given_file(criteo, tmp_path, capsys):
    from recsys import bench

    tsv = tmp_path / "train.txt"
    tsv.write_bytes(gzip.decompress((criteo / "train.txt.gz").read_bytes()))
    result = bench.run("convert", json_out=tmp_path / "b.json", quick=True, data=tsv)
    assert [c["name"] for c in result["comparisons"]] == ["convert vs read_csv + write_table",
                                                           "convert vs open_csv + ParquetWriter"]
    for c in result["comparisons"]:
        assert c["ours"] > 0 and c["baseline"] > 0 and c["spread"][0] <= c["median_paired_ratio"] <= c["spread"][1]
    assert result["settings"]["rows"] == 6000
    assert "convert vs read_csv" in capsys.readouterr().out
