"""Discharge and status (harness/contracts/discharge.py), run in a temporary copy of the repository.

A deliberately vacuous test is reported VACUOUS (not discharged, exit 1); a RED subject that
crashes is not RED; a discharged obligation becomes STALE when its bound test, its contract or
what it depends on changes; ``harness status --check`` exits 1 on anything not DISCHARGED.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import repo_copy
from test_contracts import ALL

from harness.cli import main
from harness.contracts.discharge import (
    BOUND,
    DISCHARGED,
    ERROR,
    RED,
    STALE,
    UNBOUND,
    VACUOUS,
    Session,
    Subject,
    build_dir,
    discharge,
    function_source,
    plan_sessions,
    status,
)

DEMO = """\
id: demo-v1
version: 0.1.0
description: Obligations with known discharge outcomes, for the harness's own tests.
subject: engine
model: fixture:tiny-qwen35
references: [tests/test_discharge.py]
equations:
  decay:
    formula: g = ssm_a · softplus(alpha + dt_bias)
    domain: "[T, n_v]"
    source: llama.cpp qwen35.cpp
    oracle: harness.engines.oracle.qwen35.gdn_gate
obligations:
  - id: DEMO-VAC-001
    kind: invariant
    property: A test that cannot see the fault it claims to catch.
    formal: n_vocab > 0
    source: tests/test_discharge.py
    tests: [tests/contracts/test_demo_vacuous.py::test_always_passes]
    red: {mutant: dt-bias-dropped}
    if_fails: never
  - id: DEMO-ERR-002
    kind: equivalence
    property: The decay equation, shown RED on a file the engine cannot load.
    formal: gate = ssm_a · softplus(alpha + dt_bias)
    source: tests/test_discharge.py
    tests: [tests/contracts/test_gated_delta_net.py::test_decay_equation]
    red: {fixture: tensor-missing}
    if_fails: the engine refuses the file
  - id: DEMO-UNB-003
    kind: invariant
    property: Planned, not yet bound.
    formal: "-"
    source: tests/test_discharge.py
    tests: []
    red: {mutant: dt-bias-dropped}
    if_fails: "-"
qa_gate:
  id: F-DEMO-001
  name: demo
  description: demo
  checks: [harness discharge contracts/demo-v1.yaml]
  pass_criteria: none
"""

VACUOUS_TEST = """\
import pytest

pytestmark = pytest.mark.contract


def test_always_passes(candidate_engine):
    assert candidate_engine.n_vocab > 0
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = repo_copy(tmp_path_factory.mktemp("discharge"), ALL)
    (root / "contracts" / "demo-v1.yaml").write_text(DEMO)
    (root / "tests" / "contracts" / "test_demo_vacuous.py").write_text(VACUOUS_TEST)
    return root


def test_vacuous_and_crashing_reds_are_not_discharged(repo, capsys):
    results = {r.obligation: r for r in discharge(repo / "contracts" / "demo-v1.yaml")}
    vac = results["DEMO-VAC-001"]
    assert vac.result == VACUOUS and vac.red[0]["outcome"] == VACUOUS and vac.green["outcome"] == "GREEN"
    assert "cannot see this fault" in vac.red[0]["message"]
    err = results["DEMO-ERR-002"]
    assert err.result == "NOT-RED" and err.red[0]["outcome"] == ERROR and "EngineError" in err.red[0]["message"]
    assert results["DEMO-UNB-003"].result == UNBOUND
    record = json.loads((repo / "evidence" / "discharge" / "demo-v1" / build_dir("oracle") / "DEMO-VAC-001.json").read_text())
    assert record["result"] == VACUOUS and record["red"][0]["subject"]["candidate"] == "mutant:dt-bias-dropped"
    rows = {r.obligation: r for r in status([repo / "contracts" / "demo-v1.yaml"])[0]}
    assert rows["DEMO-VAC-001"].status == BOUND and "VACUOUS" in rows["DEMO-VAC-001"].detail
    assert rows["DEMO-UNB-003"].status == UNBOUND
    assert main(["status", str(repo / "contracts" / "demo-v1.yaml"), "--check"]) == 1
    assert main(["discharge", str(repo / "contracts" / "demo-v1.yaml"), "--obligation", "DEMO-VAC-001", "--no-write"]) == 1
    assert "VACUOUS" in capsys.readouterr().out


def test_discharged_then_stale_when_a_bound_test_changes(repo, capsys):
    path = repo / "contracts" / "gated-delta-net-v1.yaml"
    assert main(["discharge", str(path), "--obligation", "GDN-EQ-002"]) == 0
    assert "1/1 obligations DISCHARGED" in capsys.readouterr().out
    record = json.loads((repo / "evidence" / "discharge" / "gated-delta-net-v1" / build_dir("oracle") / "GDN-EQ-002.json").read_text())
    assert [r["outcome"] for r in record["red"]] == [RED, RED] and record["green"]["outcome"] == "GREEN"
    assert record["red"][0]["message"].startswith("AssertionError: GDN-EQ-002")
    assert record["depends_on"]["models"]["fixture:tiny-qwen35"] and "harness/engines/mutants.py" in record["depends_on"]["engines"]["mutant:dt-bias-dropped"]
    assert record["contract"]["sha256"] and record["tests"][0]["function_sha256"] and record["red"][0]["run"]["git"].keys() == {"commit", "dirty"}
    _went_through_the_door(repo, record, capsys)

    def status_of(oid):
        return {r.obligation: r for r in status([path])[0]}[oid]

    assert status_of("GDN-EQ-002").status == DISCHARGED and status_of("GDN-EQ-001").status == BOUND
    test_file = repo / "tests" / "contracts" / "test_gated_delta_net.py"
    original = test_file.read_text()
    marker = '    rel = tolerance("GDN-EQ-002")["rel"]\n'
    test_file.write_text(original.replace(marker, marker + "    rel = rel * 1.0\n"))
    row = status_of("GDN-EQ-002")
    assert row.status == STALE and "test tests/contracts/test_gated_delta_net.py::test_decay_equation changed" in row.detail
    assert main(["status", str(path), "--check"]) == 1
    test_file.write_text(original)
    assert status_of("GDN-EQ-002").status == DISCHARGED
    path.write_text(path.read_text().replace("version: 1.0.0", "version: 1.0.1"))
    assert status_of("GDN-EQ-002").status == STALE and "contract gated-delta-net-v1.yaml changed" in status_of("GDN-EQ-002").detail


def test_plan_sessions_batches_subjects():
    reqs = [
        (Subject("mutant:a", "fixture:m"), ["t1"]),
        (Subject("mutant:b", "fixture:m"), ["t2"]),
        (Subject("oracle", "fixture:m"), ["t1", "t2"]),
        (Subject("oracle", "fixture:bad1"), ["t3"]),
        (Subject("oracle", "fixture:bad2"), ["t4"]),
        (Subject("oracle", "fixture:m", "nan-logits"), ["t5"]),
    ]
    sessions = plan_sessions(reqs)
    assert Session(["mutant:a", "mutant:b", "oracle"], ["fixture:m"], None, ["t1", "t2"]) in sessions
    assert Session(["oracle"], ["fixture:bad1", "fixture:bad2"], None, ["t3", "t4"]) in sessions
    assert Session(["oracle"], ["fixture:m"], "nan-logits", ["t5"]) in sessions
    assert len(sessions) == 3


def test_function_source_includes_decorators(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import pytest\n\n@pytest.mark.contract\ndef test_a():\n    assert 1\n\nclass TestB:\n    def test_c(self):\n        pass\n")
    assert function_source(f, "test_a") == "@pytest.mark.contract\ndef test_a():\n    assert 1\n"
    assert function_source(f, "TestB::test_c").strip() == "def test_c(self):\n        pass"
    assert function_source(f, "test_missing") is None


def _went_through_the_door(repo: Path, record: dict, capsys) -> None:
    """A discharge is evidence through the door (issue 46): the record's bytes are bound by a
    discharge receipt, whose row is chained in the project's ledger, rendered in LEDGER.md and
    listed by the reports index; ``harness ledger verify`` re-derives the row from the receipt."""
    from harness.evidence.index import INDEX_MD, reports_dir
    from harness.evidence.ledger import read_rows
    from harness.evidence.pages import markdown_path_for
    from harness.evidence.receipts import load_receipt
    from harness.provenance import sha256_file

    ledger = repo / "evidence" / "parity" / "ledger.jsonl"
    row = read_rows(ledger)[-1]
    assert row["kind"] == "discharge" and row["contract"] == "gated-delta-net-v1" and row["candidate"] == "oracle"
    assert row["verdict"] == "DISCHARGED" and row["obligations"] == {"DISCHARGED": 1}
    rec = load_receipt(next((ledger.parent / "receipts").rglob(f"{row['receipt_id']}.json"))).receipt
    (ob,) = rec["obligations"]
    path = repo / rec["evidence_dir"] / ob["record"]
    assert ob["id"] == "GDN-EQ-002" and json.loads(path.read_text()) == record
    assert ob["sha256"] == sha256_file(path)  # the receipt binds the record's bytes
    assert main(["ledger", "verify", "--ledger", str(ledger), "--deep", "--quiet"]) == 0
    md = markdown_path_for(ledger).read_text()
    assert "contract gated-delta-net-v1: 1 DISCHARGED" in md
    assert "contract gated-delta-net-v1" in (reports_dir(ledger) / INDEX_MD).read_text()
    capsys.readouterr()
