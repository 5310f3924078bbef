"""mha_client heads against the real mha_server: the per-head statistics table ranked by contribution (pretty, JSON,
CSV), the ablation's measured change against the bound the contributions predict, usage errors; and plot's
per-head annotations.
"""

import csv
import io
import json
import xml.etree.ElementTree as ET

import pytest

SVG = "{http://www.w3.org/2000/svg}"
DEMO_HEADS = 8
STATS = ("contribution", "entropy", "normalized_entropy", "confidence", "distance", "sink_mass")


def heads(run_cli, server, *args):
    r = run_cli("heads", "--target", server.target, "--seq", "12", *args)
    assert r.returncode == 0, r.stderr
    return r


def test_pretty_table_lists_every_head_once_ranked_by_contribution(server, run_cli):
    out = heads(run_cli, server, "--batch", "2").stdout
    lines = out.splitlines()
    assert lines[0].startswith("heads: layer demo, B=2 Tq=12 Tk=12")
    assert "means over 2 batch items, ranked by contribution" in lines[0]
    assert lines[1].split() == ["rank", "head", "kv_group", "contribution", "entropy", "norm_entropy", "confidence",
                                "distance", "sink_mass"]
    rows = [line.split() for line in lines[2:2 + DEMO_HEADS]]
    assert [int(r[0]) for r in rows] == list(range(1, DEMO_HEADS + 1))
    assert sorted(int(r[1]) for r in rows) == list(range(DEMO_HEADS))
    contributions = [float(r[3]) for r in rows]
    assert contributions == sorted(contributions, reverse=True) and contributions[-1] > 0
    assert "ablated" not in out


def test_json_holds_the_six_statistics_per_head(server, run_cli):
    report = json.loads(heads(run_cli, server, "-O", "json").stdout)
    assert report["weights"] == "layer demo" and report["batch"] == 1 and report["ablation"] is None
    assert sorted(h["head"] for h in report["heads"]) == list(range(DEMO_HEADS))
    for rank, head in enumerate(report["heads"], start=1):
        assert head["rank"] == rank
        for name in STATS:
            assert isinstance(head[name], float), (name, head)
        assert 0 <= head["normalized_entropy"] <= 1 and 0 < head["confidence"] <= 1
    contributions = [h["contribution"] for h in report["heads"]]
    assert contributions == sorted(contributions, reverse=True)


def test_csv_has_a_header_and_one_row_per_head(server, run_cli):
    rows = list(csv.reader(io.StringIO(heads(run_cli, server, "-O", "csv").stdout)))
    assert rows[0] == ["rank", "head", "kv_group", *STATS]
    assert len(rows) == 1 + DEMO_HEADS
    assert sorted(int(r[1]) for r in rows[1:]) == list(range(DEMO_HEADS))


def test_ablating_the_least_contributing_head_stays_within_the_predicted_bound(server, run_cli):
    report = json.loads(heads(run_cli, server, "-O", "json", "--ablate", "1").stdout)
    ablation = report["ablation"]
    assert ablation["heads"] == [report["heads"][-1]["head"]]
    assert ablation["predicted_bound"] == pytest.approx(report["heads"][-1]["contribution"], rel=1e-12)
    assert ablation["relative_change"] > 0 and ablation["mean_row_change"] > 0
    # Per row the change is at most the sum of the ablated heads' contributions (the triangle inequality; one head:
    # equal), so the mean over rows is too.
    assert ablation["mean_row_change"] <= ablation["predicted_bound"] * (1 + 1e-3) + 1e-6
    assert "upper bound" in ablation["bound"]


def test_ablation_in_the_pretty_and_csv_reports(server, run_cli):
    out = heads(run_cli, server, "--ablate", "2").stdout
    assert "ablated 2 heads (" in out and "predicted upper bound (sum of their contributions)" in out
    r = heads(run_cli, server, "-O", "csv", "--ablate", "2")
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [row["ablated"] for row in rows] == ["0"] * (DEMO_HEADS - 2) + ["1", "1"]
    assert r.stderr.startswith("ablated 2 heads (")


@pytest.mark.parametrize("k, message", [
    ("-1", "--ablate must be >= 0; got -1"),
    ("8", "--ablate 8 must be below H = 8 (at least one head stays)"),
    ("9", "--ablate 9 must be below H = 8 (at least one head stays)"),
])
def test_ablate_out_of_range_is_a_usage_error(server, run_cli, k, message):
    r = run_cli("heads", "--target", server.target, "--ablate", k)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("usage error: " + message + "\n"), r.stderr


def test_bad_format_is_a_usage_error(run_cli):
    r = run_cli("heads", "-O", "xml", "--target", "127.0.0.1:1")
    assert r.returncode == 2
    assert r.stderr.startswith("usage error: -O must be pretty, json or csv; got 'xml'\n"), r.stderr


def test_plot_annotates_each_panel_with_the_shown_items_statistics(tmp_path, server, run_cli):
    # Random inputs are drawn in order, so batch item 0 of --batch 2 is the query --batch 1 draws from that seed.
    item0 = json.loads(heads(run_cli, server, "-O", "json", "--seed", "5").stdout)
    r = run_cli("plot", "--target", server.target, "--seq", "12", "--batch", "2", "--seed", "5", "--output",
                tmp_path / "d.svg")
    assert r.returncode == 0, r.stderr
    panels = ET.parse(tmp_path / "d.svg").getroot().findall(SVG + "g[@class='head']")
    assert len(panels) == DEMO_HEADS
    by_head = {h["head"]: h for h in item0["heads"]}
    for i, panel in enumerate(panels):
        stats = panel.find(SVG + "text[@class='stats']")
        assert stats.text.startswith("entropy ") and ", distance " in stats.text and ", contribution " in stats.text
        for name in ("entropy", "distance", "contribution"):
            assert float(stats.get("data-" + name)) == pytest.approx(by_head[i][name], rel=1e-4), (i, name)
