"""Release sign-off, sweeps, ledger merges and parallel parity runs (docs/release.md).

Each test builds a project in a temporary folder (a pyproject.toml naming the example engine as
``command:example``, a one-prompt prompt file, a copy of thresholds.yaml) and a release manifest
over the smallest fixtures (``tiny-qwen35``, ``tiny-qwen35moe``) with the three required probes,
so every cell is real (oracle or llama-cpp-python against llama.cpp) and as cheap as a real cell
can be. The 2-model x 2-candidate acceptance run and the Ray run are slow-marked
(``make test-release-slow``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main
from harness.engines.persistent import close_all
from harness.evidence.ledger import TIMING_FIELDS, append_row, read_rows, verify_ledger
from harness.fixtures.synthetic import build
from harness.paths import SOURCE_ROOT
from harness.provenance import sha256_file
from harness.release.manifest import load_manifest

PROMPT = {"id": "numbers", "text": "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35"}
PROBES = "[split, decode, determinism]"


def make_project(root: Path, candidates: list[str], models: list[str], release: str = "demo-1") -> Path:
    """A project folder with the example engine (copied: a test may edit it), a one-prompt file,
    thresholds.yaml and a release manifest over ``candidates`` ({engine: class}) x ``models``."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(SOURCE_ROOT / "examples" / "llamacpp_engine.py", root / "engine.py")
    shutil.copy(SOURCE_ROOT / "thresholds.yaml", root / "thresholds.yaml")
    (root / "prompts.jsonl").write_text(json.dumps(PROMPT) + "\n")
    (root / "pyproject.toml").write_text('[tool.harness.engines.example]\ncommand = ["{python}", "engine.py", "{request}", "{out_dir}"]\n'
                                         'timeout_s = 300\ncapabilities = ["chunks"]\n')
    classes = {"oracle": "f64", "command:example": "f32", "oracle-f16": "f16"}
    lines = ["schema: harness-release/v1", f"release: {release}", "prompts: prompts.jsonl",
             f"thresholds: {{path: thresholds.yaml, sha256: \"{sha256_file(root / 'thresholds.yaml')}\"}}", f"probes: {PROBES}", "candidates:"]
    lines += [f'  - {{engine: "{c}", compute_class: {classes[c]}}}' for c in candidates]
    lines += ["models:"] + [f'  - {{model: "fixture:{m}", sha256: "{sha256_file(build(m))}"}}' for m in models]
    (root / "release.yaml").write_text("\n".join(lines) + "\n")
    return root


def harness(root: Path, *args: str, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.chdir(root)
    return main(list(args))


def signoff_json(root: Path, capsys, monkeypatch, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = harness(root, "signoff", "release.yaml", "--json", *extra, monkeypatch=monkeypatch)
    return rc, json.loads(capsys.readouterr().out)


def blocking(doc: dict) -> list[tuple[str, str, str]]:
    return sorted((i["status"], i["label"], i["command"] or "") for i in doc["items"] if i["status"] not in ("ok", "n/a"))


def ledger_of(root: Path) -> Path:
    return root / "evidence" / "parity" / "ledger.jsonl"


# ------------------------------------------------------------------------------ the manifest


def test_the_manifest_schema_names_every_probe():
    """The schema's probe names are the probes ``harness probe`` runs (one list, checked)."""
    from harness.runs.probes import PROBE_NAMES
    from harness.paths import SCHEMA_DIR
    from harness.release.manifest import SCHEMA_FILE

    schema = json.loads((SCHEMA_DIR / SCHEMA_FILE).read_text())
    assert set(schema["properties"]["probes"]["items"]["enum"]) == set(PROBE_NAMES)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace("schema: harness-release/v1", "schema: harness-release/v9"), "schema: 'harness-release/v1' was expected"),
    (lambda s: s.replace("compute_class: f64", "compute_class: f65"), "candidates.0.compute_class"),
    (lambda s: s.replace('engine: "oracle"', 'engine: "nope"'), "unknown engine 'nope'"),
    (lambda s: s.replace("probes: [split", "probes: [spilt"), "probes.0"),
    (lambda s: s.replace("probes: [split, decode, determinism]", "probes: [split, determinism]"), "missing decode"),
    (lambda s: s + "contracts: [no-such-contract-v1]\n", "'no-such-contract-v1' is neither"),
    (lambda s: s.replace("prompts: prompts.jsonl", "prompts: gone.jsonl"), "gone.jsonl does not exist"),
    (lambda s: s.replace("release: demo-1", "release: demo-1\nrelease: again"), "duplicate key release"),
    (lambda s: "- just\n- a list\n", "a release manifest is a YAML mapping"),
])
def test_an_invalid_manifest_is_exit_2_naming_the_field(tmp_path, monkeypatch, capsys, edit, message):
    root = make_project(tmp_path / "p", ["oracle"], ["tiny-qwen35"])
    path = root / "release.yaml"
    path.write_text(edit(path.read_text()))
    for command in ("signoff", "sweep"):
        assert harness(root, command, "release.yaml", monkeypatch=monkeypatch) == 2
        err = capsys.readouterr().err
        assert err.startswith("harness: INVALID: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not ledger_of(root).exists()  # nothing judged, nothing written


def test_manifest_paths_resolve_against_its_folder(tmp_path):
    root = make_project(tmp_path / "p", ["oracle", "command:example"], ["tiny-qwen35"])
    m = load_manifest(root / "release.yaml")
    assert m.prompts == root / "prompts.jsonl" and m.thresholds_path == root / "thresholds.yaml"
    assert [c.engine for c in m.candidates] == ["oracle", "command:example"] and m.candidates[1].backends == ("cpu",)
    assert m.probes == ("split", "decode", "determinism") and m.models[0].spec == "fixture:tiny-qwen35"


# ------------------------------------------------------------------------------ sign-off and sweep


def expected_missing(root: Path, cand: str, model: str) -> list[tuple[str, str, str]]:
    """The blocking lines of a cell with no receipts: its parity and probe runs and their commands."""
    out = []
    for kind in ("parity", "probe"):
        ref = " --reference llama.cpp" if kind == "parity" else ""
        only = " --only split --only decode --only determinism" if kind == "probe" else ""
        out.append(("missing", f"{cand} @ fixture:{model} [cpu] {kind}",
                    f"harness {kind} --candidate {cand} --model fixture:{model}{ref} --prompts {root / 'prompts.jsonl'} "
                    f"--thresholds {root / 'thresholds.yaml'}{only}"))
    return out


def test_blocked_then_swept_then_signed(tmp_path, monkeypatch, capsys):
    """BLOCKED with every missing cell and its command (exit 5: nothing failed), SIGNED after the
    sweep (exit 0, a signoff row relying on every receipt, its own LEDGER.md section); a second
    sweep runs nothing."""
    root = make_project(tmp_path / "p", ["oracle"], ["tiny-qwen35"])
    rc, before = signoff_json(root, capsys, monkeypatch)
    assert rc == 5 and before["verdict"] == "BLOCKED"
    assert blocking(before) == sorted(expected_missing(root, "oracle", "tiny-qwen35"))
    assert [c["status"] for c in before["cells"]] == ["missing"] and before["relied_on"] == []

    assert harness(root, "sweep", "release.yaml", monkeypatch=monkeypatch) == 0
    out = capsys.readouterr()
    assert "[2/2] probe oracle @ fixture:tiny-qwen35 [cpu]: ran PASS" in out.err
    assert "PASS: 2 runs: 2 ran, 0 current, 0 adopted, 0 error" in out.out

    rc, after = signoff_json(root, capsys, monkeypatch)
    assert rc == 0 and after["verdict"] == "SIGNED" and blocking(after) == []
    rows = read_rows(ledger_of(root))
    assert [r["kind"] for r in rows] == ["signoff", "parity", "probe", "signoff"]
    assert rows[-1]["verdict"] == "SIGNED" and [r["id"] for r in rows[-1]["relied_on"]] == [r["receipt_id"] for r in rows[1:3]]
    assert rows[-1]["cells"] == [{"model": "fixture:tiny-qwen35", "candidate": "oracle", "backend": "cpu", "status": "ok",
                                  "parity": rows[1]["receipt_id"], "probe": rows[2]["receipt_id"]}]
    assert verify_ledger(ledger_of(root), ledger_of(root).parent / "receipts") == []
    md = (root / "LEDGER.md").read_text()
    assert "## Sign-offs" in md and "| 1/1 ok | SIGNED |" in md.split("## Sign-offs")[1] and "| 0/1 ok | BLOCKED |" in md

    assert harness(root, "sweep", "release.yaml", monkeypatch=monkeypatch) == 0
    assert "2 runs: 0 ran, 2 current" in capsys.readouterr().out


def test_signoff_reads_each_receipt_once_for_its_keys_then_only_the_receipts_it_picks(tmp_path, monkeypatch, capsys):
    """A sign-off finds its cells through the query cache: on a fresh cache (deleted, as on a
    fresh clone) it reads each standing receipt once for its keys; after that only the receipts
    its runs pick (one parity, one probe), however many other receipts stand; and it judges as
    before (SIGNED, relying on the swept receipts)."""
    from harness.evidence.ledger_cache import cache_path

    root = make_project(tmp_path / "p", ["oracle"], ["tiny-qwen35"])
    assert harness(root, "sweep", "release.yaml", monkeypatch=monkeypatch) == 0
    assert harness(root, "parity", "--candidate", "oracle-f16", "--model", "fixture:tiny-qwen35", "--prompts", "prompts.jsonl",
                   "--greedy-tokens", "0", monkeypatch=monkeypatch) in (0, 1)  # a standing receipt of another cell
    receipts = ledger_of(root).parent / "receipts"
    read: list[str] = []
    for method in ("read_text", "read_bytes"):  # keys are read as text, a picked receipt as bytes (its sha256 is checked)
        real = getattr(Path, method)
        monkeypatch.setattr(Path, method, lambda self, *a, _real=real, **k: (read.append(self.stem) if receipts in self.parents else None)
                            or _real(self, *a, **k))
    cache_path(ledger_of(root)).unlink()
    standing = [r["receipt_id"] for r in read_rows(ledger_of(root)) if r["kind"] in ("parity", "probe")]
    rc, first = signoff_json(root, capsys, monkeypatch)
    assert rc == 0 and first["verdict"] == "SIGNED" and len(standing) == 3
    picked = [r["id"] for r in first["relied_on"]]
    assert sorted(read) == sorted(standing + picked)  # every standing receipt once for its keys, then the two picked
    read.clear()
    rc, again = signoff_json(root, capsys, monkeypatch)
    assert rc == 0 and sorted(read) == sorted(picked) and again["cells"] == first["cells"]


def test_after_a_signoff_the_index_lists_its_signed_row(tmp_path, monkeypatch, capsys):
    """``harness signoff`` appends its row through the evidence door, which refreshes the reports
    index under the same lock: index.md and index.html list the SIGNED row at once (before the
    door the sign-off skipped the index, so its row was missing until the next report)."""
    root = make_project(tmp_path / "p", ["oracle"], ["tiny-qwen35"])
    assert harness(root, "sweep", "release.yaml", monkeypatch=monkeypatch) == 0
    rc, doc = signoff_json(root, capsys, monkeypatch)
    row = read_rows(ledger_of(root))[-1]
    assert rc == 0 and doc["verdict"] == "SIGNED" and row["kind"] == "signoff" and row["verdict"] == "SIGNED"
    reports = ledger_of(root).parent / "reports"
    line = next(ln for ln in (reports / "index.md").read_text().splitlines() if ln.startswith(f"| {row['seq']} |"))
    assert "SIGNED" in line and "signoff" in line and "release demo-1" in line
    assert f"{len(row['cells'])}/{len(row['cells'])} cells ok; {len(row['relied_on'])} receipts" in line
    html = (reports / "index.html").read_text()
    assert "release demo-1" in html and f"{row['seq']} rows" in html and "SIGNED" in html


def test_a_changed_candidate_source_makes_its_cells_stale(tmp_path, monkeypatch, capsys):
    """command:example's parity receipt made by the exact command the sign-off names counts (its
    probe is still missing: exit 5); one changed line of the engine's program changes its build,
    and the next sign-off is BLOCKED on a stale cell (exit 1) naming the build that changed."""
    root = make_project(tmp_path / "p", ["command:example"], ["tiny-qwen35"])
    cmd = expected_missing(root, "command:example", "tiny-qwen35")[0][2].split()
    assert harness(root, *cmd[1:], "--no-calibrate", monkeypatch=monkeypatch) == 0
    rc, before = signoff_json(root, capsys, monkeypatch)
    assert rc == 5 and [lbl for s, lbl, _ in blocking(before)] == ["command:example @ fixture:tiny-qwen35 [cpu] probe"]
    engine = root / "engine.py"
    engine.write_text(engine.read_text() + "# one changed line\n")
    rc, changed = signoff_json(root, capsys, monkeypatch)
    assert rc == 1 and changed["verdict"] == "BLOCKED"
    stale = [i for i in changed["items"] if i["status"] == "stale"]
    old, new = before["builds"]["command:example"], changed["builds"]["command:example"]
    assert [i["label"] for i in stale] == ["command:example @ fixture:tiny-qwen35 [cpu] parity"]
    assert old != new and stale[0]["detail"].endswith(f"inputs: candidate_build {old[:12]} → {new[:12]}")
    assert [c["status"] for c in changed["cells"]] == ["stale"] and changed["relied_on"] == []


def test_a_failed_cell_blocks_with_exit_1_even_when_others_are_missing(tmp_path, monkeypatch, capsys):
    root = make_project(tmp_path / "p", ["oracle"], ["tiny-qwen35"])
    path = root / "release.yaml"
    path.write_text(path.read_text().replace(sha256_file(build("tiny-qwen35")), "0" * 64))
    rc, doc = signoff_json(root, capsys, monkeypatch)
    assert rc == 1 and doc["verdict"] == "BLOCKED"
    pin = next(i for i in doc["items"] if i["label"] == "model fixture:tiny-qwen35")
    assert pin["status"] == "failed" and "is not the manifest's 000000000000" in pin["detail"]
    assert {i["status"] for i in doc["items"] if i["what"] == "cell"} == {"missing"}
    assert harness(root, "sweep", "release.yaml", monkeypatch=monkeypatch) == 2  # a model that is not the pinned one is not run
    assert "not the manifest's 000000000000; not run" in capsys.readouterr().err
    assert [r["kind"] for r in read_rows(ledger_of(root))] == ["signoff"]


def test_sigkill_of_the_coordinator_mid_sweep_then_rerun_completes(tmp_path, monkeypatch, capsys):
    """SIGKILL the sweep once its first receipt is on disk; the re-run finishes, the chain
    verifies, and no run whose receipt existed is run again. Then the state a kill between a
    receipt's write and its row leaves, made exactly (receipts, no rows): the re-run appends their
    rows (``adopted``) and runs nothing."""
    root = make_project(tmp_path / "p", ["oracle"], ["tiny-qwen35"])
    receipts = ledger_of(root).parent / "receipts"
    cmd = [sys.executable, "-m", "harness", "sweep", "release.yaml"]
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 600
    while not list(receipts.glob("*/*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {p.stem for p in receipts.glob("*/*.json")}
    assert len(before) == 1, "the kill must land mid-sweep"
    rerun = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    ran = [ln for ln in rerun.stderr.splitlines() if ": ran " in ln]
    assert len(ran) == 1 and "probe oracle" in ran[0]  # only the run that had no receipt
    assert ("1 current" in rerun.stdout) != ("1 adopted" in rerun.stdout)  # the parity receipt: with its row, or given it now
    rows = read_rows(ledger_of(root))
    assert len(rows) == 2 and len({r["receipt_id"] for r in rows}) == 2 and before <= {r["receipt_id"] for r in rows}
    assert verify_ledger(ledger_of(root), receipts) == []

    other = tmp_path / "other-ledger" / "ledger.jsonl"
    shutil.copytree(receipts, other.parent / "receipts")
    capsys.readouterr()
    assert harness(root, "sweep", "release.yaml", "--ledger", str(other), monkeypatch=monkeypatch) == 0
    assert "2 runs: 0 ran, 0 current, 2 adopted" in capsys.readouterr().out
    assert [r["receipt_id"] for r in read_rows(other)] == [r["receipt_id"] for r in rows]  # in the manifest's order
    assert verify_ledger(other, other.parent / "receipts") == []


def parity_into(root: Path, model: str, ledger: Path, monkeypatch) -> None:
    """One parity cell of the oracle on ``model`` recorded into ``ledger`` (exactly the command the
    sign-off names for the cell, so its receipt counts for the manifest)."""
    assert harness(root, "parity", "--candidate", "oracle", "--model", f"fixture:{model}", "--reference", "llama.cpp",
                   "--prompts", str(root / "prompts.jsonl"), "--thresholds", str(root / "thresholds.yaml"), "--ledger", str(ledger),
                   "--no-calibrate", monkeypatch=monkeypatch) == 0


def test_two_evidence_folders_merge_and_merging_twice_adds_nothing(tmp_path, monkeypatch, capsys):
    root = make_project(tmp_path / "p", ["oracle"], ["tiny-qwen35", "tiny-qwen35moe"])
    a, b, c = (tmp_path / h / "evidence" for h in ("host-a", "host-b", "here"))
    parity_into(root, "tiny-qwen35", a / "parity" / "ledger.jsonl", monkeypatch)
    parity_into(root, "tiny-qwen35moe", b / "parity" / "ledger.jsonl", monkeypatch)
    target = c / "parity" / "ledger.jsonl"
    capsys.readouterr()
    assert harness(root, "ledger", "merge", str(b), str(a), "--ledger", str(target), monkeypatch=monkeypatch) == 0
    assert "2 receipt(s) appended, 0 already here" in capsys.readouterr().out
    rows = read_rows(target)
    src = sorted(read_rows(a / "parity" / "ledger.jsonl") + read_rows(b / "parity" / "ledger.jsonl"), key=lambda r: (r["time"], r["receipt_id"]))
    assert [r["receipt_id"] for r in rows] == [r["receipt_id"] for r in src]  # deterministic: by time, then id
    assert all(r["time"] == s["time"] and all(r.get(k) == s.get(k) for k in TIMING_FIELDS) for r, s in zip(rows, src))
    assert verify_ledger(target, target.parent / "receipts") == []
    assert harness(root, "ledger", "merge", str(a), str(b), "--ledger", str(target), monkeypatch=monkeypatch) == 0
    assert "0 receipt(s) appended, 2 already here" in capsys.readouterr().out and len(read_rows(target)) == 2
    assert verify_ledger(target, target.parent / "receipts") == []

    # host d holds a's receipt id with other bytes (another creation time): refused, naming it, nothing written
    d = tmp_path / "host-d" / "evidence" / "parity"
    (d / "receipts").mkdir(parents=True)
    first = next((a / "parity" / "receipts").glob("*/*.json"))
    rec = json.loads(first.read_text())
    rec["created"] = "2000-01-01T00:00:00Z"
    (d / "receipts" / first.name).write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    shutil.copy(first.with_suffix(".npz"), d / "receipts" / first.with_suffix(".npz").name)
    row = {k: v for k, v in read_rows(a / "parity" / "ledger.jsonl")[0].items() if k not in ("seq", "prev_hash", "row_hash", "receipt_sha256")}
    append_row(d / "ledger.jsonl", row, d / "receipts" / first.name)
    assert verify_ledger(d / "ledger.jsonl", d / "receipts") == []
    assert harness(root, "ledger", "merge", str(d.parent), "--ledger", str(target), monkeypatch=monkeypatch) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "with other bytes" in err and str(d / "receipts" / first.name) in err
    assert len(read_rows(target)) == 2
    # a source whose receipt was edited is refused with its path
    victim = d / "receipts" / first.name
    victim.write_text(victim.read_text().replace('"kind": "parity"', '"kind": "self-consistency"'))
    assert harness(root, "ledger", "merge", str(d.parent), "--ledger", str(target), monkeypatch=monkeypatch) == 2
    assert "does not verify" in capsys.readouterr().err and len(read_rows(target)) == 2


def test_ledger_verify_checks_the_receipts_a_signoff_relies_on(tmp_path, monkeypatch, capsys):
    root = make_project(tmp_path / "p", ["oracle"], ["tiny-qwen35"])
    ledger, receipts = ledger_of(root), ledger_of(root).parent / "receipts"
    parity_into(root, "tiny-qwen35", ledger, monkeypatch)
    rc, doc = signoff_json(root, capsys, monkeypatch)
    assert rc == 5 and [i["label"] for i in doc["items"] if i["status"] == "missing"] == ["oracle @ fixture:tiny-qwen35 [cpu] probe"]
    relied = doc["row"]["relied_on"]
    assert [r["id"] for r in relied] == [read_rows(ledger)[0]["receipt_id"]] and doc["cells"][0]["status"] == "missing"
    assert verify_ledger(ledger, receipts) == []
    # a sign-off naming a receipt with no row before it (forged) is caught
    append_row(ledger, {"kind": "signoff", "release_name": "forged", "verdict": "SIGNED", "builds": {}, "cells": [],
                        "relied_on": [{"id": "a" * 64, "sha256": "b" * 64}, relied[0]], "blocked": []})
    codes = [(p.code, p.seq) for p in verify_ledger(ledger, receipts)]
    assert codes == [("RECEIPT-MISSING", 3), ("SIGNOFF-ORDER", 3)]
    # and a receipt it relied on that was replaced
    path = receipts / relied[0]["id"][:2] / f"{relied[0]['id']}.json"
    path.write_bytes(path.read_bytes() + b" ")
    assert {p.code for p in verify_ledger(ledger, receipts)} >= {"RECEIPT-HASH"}
    assert harness(root, "ledger", "verify", monkeypatch=monkeypatch) == 1


def test_contract_obligations_are_judged_per_candidate_build(tmp_path, monkeypatch, capsys):
    """Obligations needing activations are n/a for a logits-only candidate (with the reason); the
    rest are missing until discharged for that candidate's build, naming the discharge command,
    and ok once a real discharge recorded them (one shapes obligation, into a temporary folder)."""
    from harness.contracts.discharge import DISCHARGED, build_dir, discharge

    root = make_project(tmp_path / "p", ["oracle", "command:example"], ["tiny-qwen35"])
    path = root / "release.yaml"
    path.write_text(path.read_text() + "contracts: [gated-delta-net-v1]\n")
    ev = tmp_path / "discharge"
    rc, doc = signoff_json(root, capsys, monkeypatch, "--no-record", "--evidence-dir", str(ev))
    assert rc == 5
    items = {i["label"]: i for i in doc["items"] if i["what"] == "contract"}
    gdn = [lbl for lbl in items if lbl.startswith("gated-delta-net-v1 GDN-")]
    na = [lbl for lbl in gdn if items[lbl]["status"] == "n/a"]
    assert na and all(lbl.endswith("for command:example") and "does not expose them" in items[lbl]["detail"] for lbl in na)
    missing = [lbl for lbl in gdn if items[lbl]["status"] == "missing"]
    # every obligation of the DeltaNet layer contract reads activations: all n/a for the logits-only engine
    assert {lbl.rsplit(" for ", 1)[1] for lbl in missing} == {"oracle"} and len(na) == len(missing) > 0
    assert all(items[lbl]["command"] == "harness discharge gated-delta-net-v1 --candidate " + lbl.rsplit(" for ", 1)[1] for lbl in missing)
    # a real discharge of one obligation for the oracle's build makes exactly that item ok
    ob = next(lbl.split()[1] for lbl in missing if lbl.endswith("for oracle"))
    monkeypatch.chdir(root)
    assert [r.result for r in discharge("gated-delta-net-v1", "oracle", [ob], ev)] == [DISCHARGED]
    assert (ev / "gated-delta-net-v1" / build_dir("oracle") / f"{ob}.json").is_file()
    rc, doc = signoff_json(root, capsys, monkeypatch, "--no-record", "--evidence-dir", str(ev))
    after = {i["label"]: i["status"] for i in doc["items"] if i["what"] == "contract"}
    assert after[f"gated-delta-net-v1 {ob} for oracle"] == "ok" and after[f"gated-delta-net-v1 {ob} for command:example"] == "n/a"
    assert sum(v == "ok" for v in after.values()) == 1


def test_status_reads_records_per_subject_build(tmp_path):
    """Discharge records live under NAME@BUILD: another build's record is STALE for the build now,
    a flat-layout record is still read for the subject its GREEN run names."""
    from harness.contracts import discharge as dis
    from harness.contracts.loader import load_contract

    contract = load_contract("qwen35-shapes-v1", check_tests=False)
    ob = next(o for o in contract.obligations if o.tests)
    ev = tmp_path / "discharge"
    assert dis.obligation_status(contract, ob, ev, "oracle").status == dis.BOUND
    other = ev / contract.id / "oracle@000000000000" / f"{ob.id}.json"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps({"schema": dis.SCHEMA_ID, "green": {"shown_by": "oracle"}}))
    row = dis.obligation_status(contract, ob, ev, "oracle")
    assert row.status == dis.STALE and "other builds of oracle (000000000000)" in row.detail
    assert dis.obligation_status(contract, ob, ev, "command:example").status == dis.BOUND
    assert dis.recorded_subjects(ev, contract.id) == ["oracle"]
    assert dis.build_dir("command:mine", "f" * 64) == "command-mine@ffffffffffff"


# ------------------------------------------------------------------------------ pytest -n 4


def test_pytest_n_4_records_one_row_per_test_with_a_valid_chain(tmp_path):
    root = tmp_path / "xd"
    root.mkdir()
    (root / "prompts.jsonl").write_text(json.dumps(PROMPT) + "\n")
    (root / "pyproject.toml").write_text('[tool.harness]\npytest = true\ncandidate = ["oracle", "oracle-f16"]\n'
                                         'models = ["fixture:tiny-qwen35", "fixture:tiny-qwen35moe"]\nprompts = "prompts.jsonl"\n')
    ledger = tmp_path / "out" / "ledger.jsonl"
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "parity", "-n", "4", "-k", "test_parity", "-p", "no:cacheprovider", "-q",
                        "--harness-record", "--harness-ledger", str(ledger)], cwd=root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read_rows(ledger)
    assert len(rows) == 4 and [r["seq"] for r in rows] == [1, 2, 3, 4]
    assert sorted((r["candidate"].split()[0], r["model"]) for r in rows) == sorted(
        (c, f"fixture:{m}") for c in ("oracle", "oracle-f16") for m in ("tiny-qwen35", "tiny-qwen35moe"))
    assert verify_ledger(ledger, ledger.parent / "receipts") == []


# ------------------------------------------------------------------------------ slow: 2 x 2 and Ray


def _comparable(root: Path, ledger: Path) -> tuple[list[dict], list[dict]]:
    """Receipts (by ledger order) and rows of a sweep without creation times, timings and host."""
    rows = read_rows(ledger)
    receipts = []
    for r in rows:
        rec = json.loads((ledger.parent / "receipts" / r["receipt_id"][:2] / f"{r['receipt_id']}.json").read_text())
        receipts.append({k: v for k, v in rec.items() if k not in ("created", "timings", "host")})
    drop = {"time", "receipt_sha256", "prev_hash", "row_hash", *TIMING_FIELDS}
    return receipts, [{k: v for k, v in r.items() if k not in drop} for r in rows]


@pytest.mark.slow
def test_acceptance_2_models_x_2_candidates_local_and_ray_agree(tmp_path, monkeypatch, capsys):
    """The issue's acceptance run: 2 models x (oracle, command:example) BLOCKED before the sweep and
    SIGNED after; a changed candidate source BLOCKS; the same sweep through a local Ray instance
    (``--ray``) gives the same receipts and rows once creation times, timings and host are removed."""
    pytest.importorskip("ray")
    root = make_project(tmp_path / "p", ["oracle", "command:example"], ["tiny-qwen35", "tiny-qwen35moe"])
    rc, before = signoff_json(root, capsys, monkeypatch, "--no-record")
    assert rc == 5 and len(blocking(before)) == 8 and {s for s, _, _ in blocking(before)} == {"missing"}
    local = tmp_path / "local" / "ledger.jsonl"
    ray = tmp_path / "ray" / "ledger.jsonl"
    assert harness(root, "sweep", "release.yaml", "--jobs", "2", "--ledger", str(local), monkeypatch=monkeypatch) == 0
    assert harness(root, "sweep", "release.yaml", "--jobs", "2", "--ray", "--ledger", str(ray), monkeypatch=monkeypatch) == 0
    assert "8 runs: 8 ran" in capsys.readouterr().out
    assert _comparable(root, local) == _comparable(root, ray)
    for ledger in (local, ray):
        assert verify_ledger(ledger, ledger.parent / "receipts") == []
        rc, after = signoff_json(root, capsys, monkeypatch, "--ledger", str(ledger))
        assert rc == 0 and after["verdict"] == "SIGNED"
    (root / "engine.py").write_text((root / "engine.py").read_text() + "# changed\n")
    rc, changed = signoff_json(root, capsys, monkeypatch, "--ledger", str(local))
    assert rc == 1 and sum(c["status"] == "stale" for c in changed["cells"]) == 2


# ------------------------------------------------------------------------------ the tokenizer check


def test_signoff_requires_the_tokenizer_check_per_model_and_build(tmp_path, monkeypatch, capsys):
    """``tokenizer: true``: each model x candidate build needs its newest standing tokenizer row to
    PASS. No row: missing (naming the command); a PASS: ok and relied on; the engine's program
    changed: stale (another build's row); the changed program's FAIL: failed, exit 1."""
    root = make_project(tmp_path / "p", ["oracle"], ["trained-qwen35"])
    shutil.copy(SOURCE_ROOT / "examples" / "bpe_tokenizer_engine.py", root / "bpe.py")
    (root / "pyproject.toml").write_text('[tool.harness.engines.bpe]\ncommand = ["{python}", "bpe.py", "--serve"]\n'
                                         'protocol = 2\ntimeout_s = 60\ncapabilities = ["tokenize"]\n')
    manifest = root / "release.yaml"
    manifest.write_text(manifest.read_text().replace('engine: "oracle", compute_class: f64', 'engine: "command:bpe", compute_class: f32'))

    def tokenizer_items(*extra):
        rc, doc = signoff_json(root, capsys, monkeypatch, *extra)
        return rc, doc, [i for i in doc["items"] if i["what"] == "tokenizer"]

    rc, doc, items = tokenizer_items()
    assert items == []  # not asked for: no item
    manifest.write_text(manifest.read_text() + "tokenizer: true\n")
    assert load_manifest(manifest).tokenizer is True
    rc, doc, items = tokenizer_items()
    assert [(i["status"], i["label"], i["command"]) for i in items] == [
        ("missing", "command:bpe @ fixture:trained-qwen35", "harness tokenizer --candidate command:bpe --model fixture:trained-qwen35")]
    assert rc == 5  # the parity/probe cells are missing too; nothing failed

    assert harness(root, "tokenizer", "--candidate", "command:bpe", "--model", "fixture:trained-qwen35", monkeypatch=monkeypatch) == 0
    passed = [r for r in read_rows(ledger_of(root)) if r["kind"] == "tokenizer"][-1]
    rc, doc, items = tokenizer_items()
    assert [(i["status"], i["command"]) for i in items] == [("ok", None)] and passed["receipt_id"][:12] in items[0]["detail"]
    assert passed["receipt_id"] in {r["id"] for r in [x for x in read_rows(ledger_of(root)) if x["kind"] == "signoff"][-1]["relied_on"]}

    src = (root / "bpe.py").read_text()  # a new build: the merge of rank 0 forgotten whatever the flags say
    assert 'Tokenizer(req["model"], args.pre, args.drop_merge)' in src
    (root / "bpe.py").write_text(src.replace('Tokenizer(req["model"], args.pre, args.drop_merge)', 'Tokenizer(req["model"], args.pre, 0)'))
    close_all()  # the engine process started above still runs the old program (each CLI call starts its own)
    rc, doc, items = tokenizer_items()
    assert [i["status"] for i in items] == ["stale"] and f"was made by build {doc['builds']['command:bpe'][:12]}" not in items[0]["detail"]
    assert rc == 1
    assert harness(root, "tokenizer", "--candidate", "command:bpe", "--model", "fixture:trained-qwen35", monkeypatch=monkeypatch) == 1
    rc, doc, items = tokenizer_items()
    assert [i["status"] for i in items] == ["failed"] and "tokenizer FAIL: prompt " in items[0]["detail"] and rc == 1


def _tokenizer_fail_project(tmp_path: Path, monkeypatch) -> Path:
    """A project whose manifest asks for the tokenizer check and whose only tokenizer row is a
    FAIL (the BPE example engine with merge rank 0 forgotten)."""
    root = make_project(tmp_path / "p", ["oracle"], ["trained-qwen35"])
    src = (SOURCE_ROOT / "examples" / "bpe_tokenizer_engine.py").read_text()
    (root / "bpe.py").write_text(src.replace('Tokenizer(req["model"], args.pre, args.drop_merge)', 'Tokenizer(req["model"], args.pre, 0)'))
    (root / "pyproject.toml").write_text('[tool.harness.engines.bpe]\ncommand = ["{python}", "bpe.py", "--serve"]\n'
                                         'protocol = 2\ntimeout_s = 60\ncapabilities = ["tokenize"]\n')
    manifest = root / "release.yaml"
    manifest.write_text(manifest.read_text().replace('engine: "oracle", compute_class: f64', 'engine: "command:bpe", compute_class: f32')
                        + "tokenizer: true\n")
    assert harness(root, "tokenizer", "--candidate", "command:bpe", "--model", "fixture:trained-qwen35", monkeypatch=monkeypatch) == 1
    return root


def test_an_edited_query_cache_cannot_flip_a_tokenizer_fail(tmp_path, monkeypatch, capsys):
    """Issue 44, route 1: one UPDATE in the git-ignored query cache set the FAIL tokenizer row's
    verdict to PASS and the sign-off took it. Verdicts now come from the receipt the row binds,
    the cache is compared with the ledger and rebuilt: the tokenizer item stays failed, and an
    evidence item names the cache row and column that disagreed."""
    import sqlite3

    from harness.evidence.ledger_cache import cache_path

    root = _tokenizer_fail_project(tmp_path, monkeypatch)
    con = sqlite3.connect(cache_path(ledger_of(root)))
    assert con.execute("UPDATE rows SET verdict='PASS' WHERE kind='tokenizer'").rowcount == 1
    con.commit()
    con.close()
    rc, doc = signoff_json(root, capsys, monkeypatch)
    items = {i["what"]: i for i in doc["items"] if i["what"] in ("tokenizer", "evidence")}
    assert rc == 1 and doc["verdict"] == "BLOCKED"
    assert items["tokenizer"]["status"] == "failed" and "tokenizer FAIL: prompt " in items["tokenizer"]["detail"]
    assert items["evidence"]["status"] == "failed"
    assert "verdict is 'PASS' in the cache but 'FAIL' in the ledger; rebuilt from the ledger" in items["evidence"]["detail"]
    rc, again = signoff_json(root, capsys, monkeypatch)  # the cache was rebuilt: only the tokenizer FAIL blocks now
    assert rc == 1 and [i["what"] for i in again["items"] if i["status"] == "failed"] == ["tokenizer"]


def test_a_rehashed_last_row_cannot_flip_a_tokenizer_fail(tmp_path, monkeypatch, capsys):
    """Issue 44, route 2: the last row's verdict flipped to PASS and its row_hash recomputed (the
    chain verifies) signed the release. The sign-off reads the verdict from the receipt: the
    tokenizer item fails, naming the row's PASS and the receipt's FAIL."""
    from harness.evidence.ledger import render_pages, row_hash
    from harness.evidence.receipts import canonical_json

    root = _tokenizer_fail_project(tmp_path, monkeypatch)
    lines = ledger_of(root).read_bytes().splitlines(keepends=True)
    last = json.loads(lines[-1])
    assert last["kind"] == "tokenizer" and last["verdict"] == "FAIL"
    last["verdict"] = "PASS"
    last["row_hash"] = row_hash(last)
    ledger_of(root).write_bytes(b"".join(lines[:-1]) + canonical_json(last) + b"\n")
    render_pages(ledger_of(root), full=True)  # LEDGER.md re-rendered to the forged head
    assert verify_ledger(ledger_of(root), deep=False) == []  # the forgery holds against the chain (and the rendering)
    rc, doc = signoff_json(root, capsys, monkeypatch)
    item = next(i for i in doc["items"] if i["what"] == "tokenizer")
    assert rc == 1 and doc["verdict"] == "BLOCKED" and item["status"] == "failed"
    assert item["detail"] == f"row {last['seq']} says 'PASS' but its receipt {last['receipt_id'][:12]} says 'FAIL'"
    assert item["command"] == "harness ledger verify --deep"
