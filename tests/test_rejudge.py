"""Cells judged by an older thresholds file (docs/release.md, "Cells judged by an older thresholds
file"; ``harness.release.rejudge``).

The first tests compare a receipt's own copy of its bounds with a moved copy of thresholds.yaml
(no engine runs). The others sign off a small release (the oracle on ``tiny-qwen35``, judged by
``calibrated[0]``, and on ``tiny-qwen35moe``, judged by ``calibrated[5]``), move one bound of
``calibrated[0]`` in a copy of the file (the manifest's ``thresholds.path`` and ``harness status
--thresholds`` point at it), and follow the cell through ``harness status --check``, ``harness
signoff``, the re-judge command and the next sign-off.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from harness.evidence.ledger import read_rows, verify_ledger
from harness.evidence.receipts import PROBE_SCHEMA_ID, SCHEMA_ID
from harness.judge.thresholds import load_thresholds
from harness.judge.tiers import Subject, find_row
from harness.paths import SOURCE_ROOT
from harness.provenance import sha256_file
from harness.release.rejudge import Moved, moved_bounds
from harness.runs import exact_check
from test_release import blocking, harness, ledger_of, make_project, signoff_json

TINY = Subject("F32", "ALL_F32", "f64", True, 8, 64, "", "qwen35")
"""The oracle on fixture:tiny-qwen35: judged by calibrated[0] (weights F32, class f64, qwen35)."""


def moved_copy(src: Path, dst: Path, edit) -> Path:
    """``src`` loaded, changed by ``edit(data)`` and written to ``dst`` (a valid thresholds file)."""
    data = yaml.safe_load(src.read_text())
    edit(data)
    dst.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    load_thresholds(dst)  # still a valid file
    return dst


def set_gate(row: int, gate: str, value, part: str = "gates"):
    def edit(data):
        data["calibrated"][row][part][gate]["value"] = value
    return edit


def receipt_judged_by(path: Path, schema: str = SCHEMA_ID) -> dict:
    """A receipt's ``thresholds`` as a run on ``TINY`` with the file at ``path`` records them."""
    return {"schema": schema, "model": {"sha256": ""}, "thresholds": load_thresholds(path).resolve(TINY).to_receipt()}


# ------------------------------------------------------------------------------ bounds compared


def test_a_moved_gate_is_named_with_its_row_and_both_bounds_for_the_cells_it_judges(tmp_path):
    old = SOURCE_ROOT / "thresholds.yaml"
    new = moved_copy(old, tmp_path / "t.yaml", set_gate(0, "max_kld_mean", 2e-06))
    parity, probe = receipt_judged_by(old), receipt_judged_by(old, PROBE_SCHEMA_ID)
    assert parity["thresholds"]["calibrated"]["gates"]["max_kld_mean"]["value"] == 1e-06
    got = moved_bounds(parity, load_thresholds(new))
    assert got == [Moved("calibrated[0]", "max_kld_mean", 1e-06, 2e-06)]
    assert got[0].text() == "calibrated[0] max_kld_mean 1e-06 → 2e-06"
    assert moved_bounds(probe, load_thresholds(new)) == []  # a parity gate does not judge a probe cell
    assert moved_bounds(parity, load_thresholds(old)) == []


def test_a_moved_probe_tolerance_names_the_probe_cell_only(tmp_path):
    old = SOURCE_ROOT / "thresholds.yaml"
    new = load_thresholds(moved_copy(old, tmp_path / "t.yaml", set_gate(0, "min_cosine", 0.9999999, part="probes")))
    assert moved_bounds(receipt_judged_by(old, PROBE_SCHEMA_ID), new) == [Moved("calibrated[0]", "probes.min_cosine", 0.99999999, 0.9999999)]
    assert moved_bounds(receipt_judged_by(old), new) == []


def test_a_renumbered_row_with_the_same_bounds_moves_nothing_and_a_changed_one_says_where_it_is_now(tmp_path):
    old = SOURCE_ROOT / "thresholds.yaml"

    def swap(data):
        data["calibrated"][0], data["calibrated"][1] = data["calibrated"][1], data["calibrated"][0]

    assert moved_bounds(receipt_judged_by(old), load_thresholds(moved_copy(old, tmp_path / "a.yaml", swap))) == []
    both = moved_copy(old, tmp_path / "b.yaml", lambda d: (set_gate(0, "min_cosine", 0.999999)(d), swap(d)))
    got = moved_bounds(receipt_judged_by(old), load_thresholds(both))
    assert got == [Moved("calibrated[0]", "min_cosine", 0.99999, 0.999999, "calibrated[1]")]
    assert got[0].text() == "calibrated[0] min_cosine 0.99999 → 0.999999 (now calibrated[1])"


def test_the_release_gate_judges_both_kinds_and_a_row_that_no_longer_fits_moves_to_none(tmp_path):
    old = SOURCE_ROOT / "thresholds.yaml"
    rel = load_thresholds(moved_copy(old, tmp_path / "r.yaml", lambda d: d["release"]["min_positions"].update(value=32)))
    for schema in (SCHEMA_ID, PROBE_SCHEMA_ID):
        assert moved_bounds(receipt_judged_by(old, schema), rel) == [Moved("release", "min_positions", 64, 32)]
    gone = load_thresholds(moved_copy(old, tmp_path / "g.yaml", lambda d: d["calibrated"].pop(0)))
    got = moved_bounds(receipt_judged_by(old), gone)
    assert [(m.row, m.gate, m.new) for m in got] == [("calibrated[0]", g, None) for g in ("min_cosine", "max_kld_mean", "max_kld_p99")]


LOWBIT = Subject("F32+IQ2_XXS+Q2_K+Q5_K", "IQ2_XXS", "f32", True, 4, 256, "", "qwen35")
"""A cell on a low-bit i-quant file (fixture:trained-qwen35-256-IQ2_XXS's weights key, class f32)."""


def lowbit_receipt(path: Path, status: str = "pass") -> dict:
    """A parity receipt on ``LOWBIT`` judged with the file at ``path``, whose exact check ran
    (``status``) and recorded the F32 f32 row that judged it, as ``harness.runs.parity`` does."""
    th = load_thresholds(path)
    row, _ = find_row(th.rows, exact_check.float_subject(LOWBIT))
    check = exact_check.ExactCheck(status, "exact check …", exact_check.row_record(row)).to_dict()
    return {"schema": SCHEMA_ID, "model": {"sha256": ""}, "thresholds": th.resolve(LOWBIT).to_receipt(), "gated": {"exact_check": check}}


def test_the_exact_checks_row_is_one_of_the_cells_bounds(tmp_path):
    """A low-bit cell is judged twice: by its own row against llama.cpp and, in its exact check, by
    the F32 row of its class against the oracle. Moving the F32 row names the cell, with that
    row labelled as the exact check's; moving its own row names it as before; a cell whose check
    did not run (the candidate does not dequantize) is not named for the F32 row."""
    old = SOURCE_ROOT / "thresholds.yaml"
    receipt = lowbit_receipt(old)
    f32 = receipt["gated"]["exact_check"]["row"]
    own = receipt["thresholds"]["calibrated"]
    assert f32["source"].endswith("calibrated[1]") and f32["weights"] == "F32" and f32["gates"]["max_kld_mean"] == 3.4e-06
    assert own["source"].endswith("calibrated[131]") and own["weights"] == LOWBIT.weights
    assert moved_bounds(receipt, load_thresholds(old)) == []

    new = load_thresholds(moved_copy(old, tmp_path / "t.yaml", set_gate(1, "max_kld_mean", 5e-06)))
    got = moved_bounds(receipt, new)
    assert got == [Moved("calibrated[1] (exact check)", "max_kld_mean", 3.4e-06, 5e-06)]
    assert got[0].text() == "calibrated[1] (exact check) max_kld_mean 3.4e-06 → 5e-06"
    not_run = {**receipt, "gated": {"exact_check": {"status": "not-run", "line": "exact check: not run …", "row": None}}}
    assert moved_bounds(not_run, new) == []
    assert moved_bounds(lowbit_receipt(old, "fail"), new) == got  # a FAILed check was judged by the row too

    own_moved = load_thresholds(moved_copy(old, tmp_path / "u.yaml", set_gate(131, "max_kld_mean", 0.004)))
    assert moved_bounds(receipt, own_moved) == [Moved("calibrated[131]", "max_kld_mean", 0.0036, 0.004)]


def test_the_exact_checks_row_renumbered_moves_nothing_and_gone_moves_to_none(tmp_path):
    old = SOURCE_ROOT / "thresholds.yaml"
    receipt = lowbit_receipt(old)

    def first_two_swapped(data):
        data["calibrated"][0], data["calibrated"][1] = data["calibrated"][1], data["calibrated"][0]

    assert moved_bounds(receipt, load_thresholds(moved_copy(old, tmp_path / "t.yaml", first_two_swapped))) == []

    def f32_rows_dropped(data):
        data["calibrated"] = [r for r in data["calibrated"] if not (r["weights"] == "F32" and r["class"] == "f32")]

    got = moved_bounds(receipt, load_thresholds(moved_copy(old, tmp_path / "u.yaml", f32_rows_dropped)))
    assert [(m.row, m.gate, m.new) for m in got] == [("calibrated[1] (exact check)", g, None)
                                                     for g in ("min_cosine", "max_kld_mean", "max_kld_p99")]


def test_a_receipt_without_a_subject_cannot_be_compared():
    th = load_thresholds(SOURCE_ROOT / "thresholds.yaml")
    assert moved_bounds({"schema": SCHEMA_ID, "thresholds": {"sha256": "0" * 64}}, th) is None


# ------------------------------------------------------------------------------ a signed release


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A release of the oracle on tiny-qwen35 and tiny-qwen35moe, swept and SIGNED (its folder)."""
    mp = pytest.MonkeyPatch()
    try:
        root = make_project(tmp_path_factory.mktemp("signed") / "p", ["oracle"], ["tiny-qwen35", "tiny-qwen35moe"])
        assert harness(root, "sweep", "release.yaml", monkeypatch=mp) == 0
        assert harness(root, "signoff", "release.yaml", monkeypatch=mp) == 0
    finally:
        mp.undo()
    return root


def project_from(signed: Path, tmp_path: Path) -> Path:
    root = tmp_path / "p"
    shutil.copytree(signed, root)
    return root


def repin(root: Path, thresholds: str) -> None:
    """Point the manifest at ``thresholds`` (in the project folder) and pin its sha256."""
    path = root / "release.yaml"
    lines = [f"thresholds: {{path: {thresholds}, sha256: \"{sha256_file(root / thresholds)}\"}}" if ln.startswith("thresholds:") else ln
             for ln in path.read_text().splitlines()]
    path.write_text("\n".join(lines) + "\n")


def status_lines(root: Path, capsys, monkeypatch, *extra: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = harness(root, "status", "--check", "--ledger", str(ledger_of(root)), *extra, monkeypatch=monkeypatch)
    return rc, [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("STALE sign-off:")]


def test_a_moved_row_names_its_cell_and_rejudging_signs_again(signed, tmp_path, monkeypatch, capsys):
    """The acceptance: a sign-off made before the re-calibration names the one cell whose row
    moved (status --check and signoff: the row, the old and new bound, the command); the cell whose
    row did not move is not named and stays signed on its old receipt; the re-judge command's
    receipt supersedes the old row (kept, never rewritten) and the release is SIGNED again."""
    root = project_from(signed, tmp_path)
    before = read_rows(ledger_of(root))
    parity_row = next(r for r in before if r["kind"] == "parity" and r["model"] == "fixture:tiny-qwen35")
    moved_copy(root / "thresholds.yaml", root / "thresholds-new.yaml", set_gate(0, "max_kld_mean", 2e-06))
    assert harness(root, "status", "--check", "--ledger", str(ledger_of(root)), monkeypatch=monkeypatch) == 5  # the old file: nothing moved
    rc, lines = status_lines(root, capsys, monkeypatch, "--thresholds", "thresholds-new.yaml")
    command = (f"harness parity --model fixture:tiny-qwen35 --candidate oracle --reference llama.cpp --prompts {signed / 'prompts.jsonl'} "
               f"--thresholds thresholds-new.yaml --ledger {ledger_of(root)}")
    assert rc == 1 and lines == [f"STALE sign-off: release demo-1 (sign-off row {before[-1]['seq']}): oracle @ fixture:tiny-qwen35 [cpu] parity "
                                 f"receipt {parity_row['receipt_id'][:12]} was judged by rows that moved since: calibrated[0] max_kld_mean "
                                 f"1e-06 → 2e-06; re-judge: {command}; then sign off again"]
    capsys.readouterr()
    harness(root, "status", "--json", "--ledger", str(ledger_of(root)), "--thresholds", "thresholds-new.yaml", monkeypatch=monkeypatch)
    doc = json.loads(capsys.readouterr().out)
    assert [(c["kind"], c["receipt_id"], c["moved"], c["command"]) for c in doc["signoff_cells_moved"]] == [
        ("parity", parity_row["receipt_id"], [{"row": "calibrated[0]", "gate": "max_kld_mean", "old": 1e-06, "new": 2e-06, "now_row": None}], command)]

    repin(root, "thresholds-new.yaml")
    rc, blocked = signoff_json(root, capsys, monkeypatch)
    again = command.replace("thresholds-new.yaml", str(root / "thresholds-new.yaml")).replace(f" --ledger {ledger_of(root)}", "")
    assert rc == 1 and blocking(blocked) == [("stale", "oracle @ fixture:tiny-qwen35 [cpu] parity", again)]
    assert [(m["cell"], m["what"]) for m in blocked["moved"]] == [("oracle @ fixture:tiny-qwen35 [cpu] parity", "calibrated[0] max_kld_mean 1e-06 → 2e-06")]
    assert [c["status"] for c in blocked["cells"]] == ["stale", "ok"]  # the MoE cell's calibrated[5] did not move: its old receipts count
    assert blocked["cells"][1]["parity"] == before[-1]["cells"][1]["parity"]

    assert harness(root, *shlex.split(again)[1:], monkeypatch=monkeypatch) == 0
    rc, signed_again = signoff_json(root, capsys, monkeypatch)
    rows = read_rows(ledger_of(root))
    new_parity = next(r for r in rows[len(before):] if r["kind"] == "parity")
    assert rc == 0 and signed_again["verdict"] == "SIGNED" and signed_again["cells"][0]["parity"] == new_parity["receipt_id"]
    assert rows[:len(before)] == before  # nothing rewritten
    sup = [r for r in rows if r["kind"] == "supersede"]
    assert [(r["supersedes"], r["reason"]) for r in sup] == [
        (parity_row["seq"], f"re-judged by receipt {new_parity['receipt_id'][:12]} (row {new_parity['seq']}) under thresholds sha256 "
                            f"{sha256_file(root / 'thresholds-new.yaml')[:12]}: calibrated[0] max_kld_mean 1e-06 → 2e-06")]
    assert verify_ledger(ledger_of(root), ledger_of(root).parent / "receipts") == []
    rc, lines = status_lines(root, capsys, monkeypatch, "--thresholds", "thresholds-new.yaml")
    assert rc == 5 and lines == []  # no contracts in this project (5); no signed cell judged by a moved row
    rc, third = signoff_json(root, capsys, monkeypatch)
    assert rc == 0 and third["supersedes"] == [] and [r["kind"] for r in read_rows(ledger_of(root))].count("supersede") == 1


def test_a_rejudged_cell_that_now_fails_says_why_not(signed, tmp_path, monkeypatch, capsys):
    """Moved below what the cell measured (KLD mean 1e-12), the re-judged receipt FAILs: the
    sign-off stays BLOCKED naming the failed gate and the row it superseded."""
    root = project_from(signed, tmp_path)
    parity_row = next(r for r in read_rows(ledger_of(root)) if r["kind"] == "parity" and r["model"] == "fixture:tiny-qwen35")
    moved_copy(root / "thresholds.yaml", root / "thresholds-new.yaml", set_gate(0, "max_kld_mean", 1e-12))
    repin(root, "thresholds-new.yaml")
    rc, blocked = signoff_json(root, capsys, monkeypatch)
    (_, _, command), = blocking(blocked)
    assert rc == 1 and "calibrated[0] max_kld_mean 1e-06 → 1e-12" in blocked["moved"][0]["what"]
    assert harness(root, *shlex.split(command)[1:], monkeypatch=monkeypatch) == 1  # the re-judged cell FAILs
    rc, after = signoff_json(root, capsys, monkeypatch)
    item = next(i for i in after["items"] if i["label"] == "oracle @ fixture:tiny-qwen35 [cpu] parity")
    assert rc == 1 and after["verdict"] == "BLOCKED" and item["status"] == "failed"
    assert "parity FAIL" in item["detail"] and "KLD mean ≤ 1e-12: FAIL" in item["detail"]
    assert item["detail"].endswith(f"re-judged: supersedes receipt {parity_row['receipt_id'][:12]} (row {parity_row['seq']}: "
                                   "calibrated[0] max_kld_mean 1e-06 → 1e-12)")
    assert [r["supersedes"] for r in read_rows(ledger_of(root)) if r["kind"] == "supersede"] == [parity_row["seq"]]
