"""``harness thresholds diff`` (``harness.judge.thresholds_diff``): what a re-calibration moved,
row by row, rows matched by what they are for rather than by position."""

from __future__ import annotations

import json
import math

import pytest

from harness.cli import main
from harness.judge.thresholds import load_thresholds
from harness.judge.thresholds_diff import diff_thresholds, relative_change
from harness.paths import SOURCE_ROOT
from test_rejudge import moved_copy

COMMITTED = SOURCE_ROOT / "thresholds.yaml"


def test_a_file_against_itself_moves_nothing():
    th = load_thresholds(COMMITTED)
    d = diff_thresholds(th, th)
    rows = sum(len(th.data.get(s) or []) for s in ("calibrated", "topk", "mtp", "state"))
    assert (d.moved, d.added, d.removed) == ([], [], []) and d.rows_compared == rows + 3  # + release, probes, report_only


def test_a_renumbered_row_is_matched_by_what_it_is_for_and_each_change_is_measured_on_its_scale(tmp_path):
    def edit(data):
        rows = data["calibrated"]
        rows[0], rows[1] = rows[1], rows[0]  # F32 f64 and f32 swap places
        rows[1]["gates"]["max_kld_mean"]["value"] = 1.5e-06  # the f64 row, now calibrated[1]: 1e-06 -> 1.5e-06
        rows[1]["gates"]["min_cosine"]["value"] = 0.99998  # 1 - cos 1e-05 -> 2e-05
        data["release"]["min_positions"]["value"] = 70

    d = diff_thresholds(load_thresholds(COMMITTED), load_thresholds(moved_copy(COMMITTED, tmp_path / "t.yaml", edit)))
    got = {(m.old_label, m.new_label, m.gate): (m.old, m.new, round(m.change, 6)) for m in d.moved}
    assert got == {("calibrated[0]", "calibrated[1]", "min_cosine"): (0.99999, 0.99998, 1.0),
                   ("calibrated[0]", "calibrated[1]", "max_kld_mean"): (1e-06, 1.5e-06, 0.5),
                   ("release", "release", "min_positions"): (64, 70, 0.09375)}
    assert [m.gate for m in d.past(0.10)] == ["min_cosine", "max_kld_mean"]  # largest first; the release change is below 10 %
    assert d.added == d.removed == []


def test_rows_only_one_file_has_are_added_or_removed(tmp_path):
    def drop_topk(data):
        data["topk"] = data["topk"][1:]

    old, new = load_thresholds(COMMITTED), load_thresholds(moved_copy(COMMITTED, tmp_path / "t.yaml", drop_topk))
    assert diff_thresholds(old, new).removed == ["topk F32 x f64 (qwen35,qwen35moe) k=20 (topk[0])"]
    assert diff_thresholds(new, old).added == ["topk F32 x f64 (qwen35,qwen35moe) k=20 (topk[0])"]


@pytest.mark.parametrize("gate, old, new, want", [("min_cosine", 0.9999, 0.9998, 1.0), ("max_kld", 0.0016, 0.024, 14.0),
                                                   ("max_kld", 0.0, 1e-9, math.inf), ("max_kld", 0.5, 0.5, 0.0)])
def test_relative_change(gate, old, new, want):
    assert relative_change(gate, old, new) == pytest.approx(want)


def test_the_command_reports_as_json_and_refuses_an_unreadable_file(tmp_path, capsys):
    new = moved_copy(COMMITTED, tmp_path / "t.yaml", lambda d: d["calibrated"][0]["gates"]["max_kld_mean"].update(value=3e-06))
    assert main(["thresholds", "diff", str(COMMITTED), str(new), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["past_min_change"] == 1 and [(m["row"], m["gate"], m["old"], m["new"], m["change"]) for m in doc["moved"]] == [
        ("calibrated F32 x f64 (qwen35)", "max_kld_mean", 1e-06, 3e-06, pytest.approx(2.0))]
    assert main(["thresholds", "diff", str(COMMITTED), str(new)]) == 0
    out = capsys.readouterr().out
    assert "1 gate(s) moved, 1 by more than 10%" in out and "calibrated[0]" in out
    assert main(["thresholds", "diff", str(tmp_path / "missing.yaml"), str(new)]) == 2
    assert "cannot read thresholds file" in capsys.readouterr().err
