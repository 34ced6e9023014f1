"""The documented flows, followed as a new user would (issue 45): a bf16 sign-off through
``harness sweep``, reproduce lines that reproduce, ``harness report`` on every receipt kind.

Each test runs the commands the docs give (README, docs/release.md) in a temporary project on
the smallest fixtures, through ``harness.cli.main``. The mlx flows need the ``mlx`` extra and are
skipped without it; what they check that the default suite can check without mlx (the command a
sweep runs and suggests, the reproduce line rebuilt from a receipt) is checked beside them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from harness.cli import main
from harness.evidence.receipts import iter_receipt_files
from harness.fixtures.synthetic import build
from harness.paths import SOURCE_ROOT
from harness.provenance import sha256_file
from harness.release import sweep
from harness.release.cells import plan_context, plan_runs, run_command
from harness.release.manifest import load_manifest
from harness.runs.inputs import engine_record

PROMPT = {"id": "numbers", "text": " ".join(str(i) for i in range(36))}


def project(root: Path, engine: str = "mlx", compute_class: str = "bf16") -> Path:
    """A project folder: pyproject.toml, a one-prompt file, thresholds.yaml and a release manifest
    of one candidate (``engine`` pinned to ``compute_class``) on fixture:tiny-qwen35."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(SOURCE_ROOT / "thresholds.yaml", root / "thresholds.yaml")
    (root / "prompts.jsonl").write_text(json.dumps(PROMPT) + "\n")
    (root / "pyproject.toml").write_text('[project]\nname = "mine"\n[tool.harness]\n')
    (root / "release.yaml").write_text("\n".join([
        "schema: harness-release/v1", "release: bf16-demo", "prompts: prompts.jsonl",
        f"thresholds: {{path: thresholds.yaml, sha256: \"{sha256_file(root / 'thresholds.yaml')}\"}}",
        "probes: [split, decode, determinism]", "candidates:", f'  - {{engine: "{engine}", compute_class: {compute_class}}}',
        "models:", f'  - {{model: "fixture:tiny-qwen35", sha256: "{sha256_file(build("tiny-qwen35"))}"}}']) + "\n")
    return root


def harness(root: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.chdir(root)
    return main(list(args))


def receipts(root: Path) -> dict[str, dict]:
    """The project's receipts by schema (the newest of each)."""
    out = {}
    for p in iter_receipt_files(root / "evidence" / "parity" / "receipts"):
        rec = json.loads(p.read_text())
        out[rec["schema"]] = rec | {"_path": str(p)}
    return out


def reproduce_line(report_md: Path) -> str:
    """The ``reproduce`` field of a verdict page (its first screen)."""
    m = re.search(r"^\| reproduce \| `(.+?)` \|$", report_md.read_text(), re.M)
    assert m, report_md.read_text()[:2000]
    return m.group(1)


def run_line(root: Path, monkeypatch, line: str) -> int:
    """Run a printed ``harness ...`` line as a user would paste it (no config assignments here)."""
    argv = shlex.split(line)
    assert argv[0] == "harness", line
    return harness(root, monkeypatch, *argv[1:])


# ------------------------------------------------------------------------------ 1. a bf16 sign-off


def test_a_bf16_mlx_cell_is_run_and_suggested_with_its_dtype(tmp_path, monkeypatch):
    """A manifest pinning mlx to bf16: the command sign-off suggests and the sweep records asks
    for ``--dtype bfloat16``, and the sweep's task makes the engine with that dtype (mlx computes
    in float32 when given none, so without it the cell was measured at f32 and never current)."""
    root = project(tmp_path / "p")
    m = load_manifest(root / "release.yaml")
    ctx = plan_context(m)
    runs = plan_runs(m, ctx)
    assert [r.inputs["compute_class"] for r in runs] == ["bf16", "bf16"]
    cmds = [run_command(m, r) for r in runs]
    assert cmds[0].startswith("harness parity --candidate mlx --dtype bfloat16 --model fixture:tiny-qwen35 --reference llama.cpp")
    assert cmds[1].startswith("harness probe --candidate mlx --dtype bfloat16 --model fixture:tiny-qwen35 ")
    seen = []

    def fake(req):
        seen.append((type(req).__name__, req.candidate, dict(req.candidate_settings)))
        raise sweep.InvalidInput("measured nothing")

    monkeypatch.setattr("harness.runs.parity.run_parity", fake)
    monkeypatch.setattr("harness.runs.probes.run_probes", fake)
    for r in runs:
        task = sweep.task_of(m, ctx, r, 1, root / "evidence" / "parity" / "ledger.jsonl")
        assert "--dtype" in task["argv"] and task["argv"][task["argv"].index("--dtype") + 1] == "bfloat16"
        assert sweep.run_task(task)["error"]["message"] == "measured nothing"
    assert seen == [("ParityRequest", "mlx", {"dtype": "bfloat16"}), ("ProbeRequest", "mlx", {"dtype": "bfloat16"})]


def test_an_engine_whose_class_is_its_own_gets_no_dtype(tmp_path):
    """oracle-f16 computes in f16 by itself: its commands carry no ``--dtype`` (the CLI refuses
    ``--dtype`` for any engine but transformers and mlx)."""
    root = project(tmp_path / "p", "oracle-f16", "f16")
    m = load_manifest(root / "release.yaml")
    assert all("--dtype" not in run_command(m, r) for r in plan_runs(m, plan_context(m)))


def test_the_bf16_mlx_release_goes_from_blocked_through_sweep_to_signed(tmp_path, monkeypatch, capsys):
    """docs/release.md followed for ``{engine: mlx, compute_class: bf16}``: BLOCKED (exit 5) naming
    commands with ``--dtype bfloat16``, ``harness sweep`` runs both cells at bf16, then SIGNED."""
    pytest.importorskip("mlx_lm")
    root = project(tmp_path / "p")
    capsys.readouterr()
    assert harness(root, monkeypatch, "signoff", "release.yaml", "--json", "--no-record") == 5
    missing = [i["command"] for i in json.loads(capsys.readouterr().out)["items"] if i["status"] == "missing"]
    assert len(missing) == 2 and all(c.startswith(("harness parity --candidate mlx --dtype bfloat16 ",
                                                   "harness probe --candidate mlx --dtype bfloat16 ")) for c in missing)
    assert harness(root, monkeypatch, "sweep", "release.yaml") == 0
    assert {r["engines"]["candidate"]["settings"]["dtype"] for r in receipts(root).values()} == {"bfloat16"}
    capsys.readouterr()
    assert harness(root, monkeypatch, "signoff", "release.yaml", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "SIGNED" and [c["status"] for c in doc["cells"]] == ["ok"]


# ------------------------------------------------------------------------------ 2. reproduce lines


def test_a_receipts_reproduce_line_asks_for_the_dtype_and_folder_it_was_run_with():
    """The settings a run asked of its candidate are recorded (``engines.candidate.requested``) and
    come back as the options that asked for them; a run without them records none."""
    from harness.evidence.report import reproduce_command

    info = {"name": "mlx", "version": "x", "settings": {"dtype": "bfloat16", "folder": "user"}, "capabilities": []}
    cand = engine_record(info, "mlx", {"dtype": "bfloat16", "folder": "/data/my folder"})
    assert cand["requested"] == {"dtype": "bfloat16", "folder": "/data/my folder"}
    assert "requested" not in engine_record(info, "mlx", {})
    rec = {"schema": "harness-parity-receipt/v1", "engines": {"candidate": cand, "reference": {"name": "llama.cpp"}},
           "model": {"name": "fixture:tiny-qwen35", "path": "/x.gguf", "overrides": []}, "prompts": {}, "thresholds": {}}
    assert reproduce_command(rec) == ("harness parity --model fixture:tiny-qwen35 --candidate mlx --dtype bfloat16 "
                                      "--mlx-folder '/data/my folder' --reference llama.cpp")


def test_a_probe_that_passed_without_only_reproduces_without_only(tmp_path, monkeypatch):
    """``harness probe`` with every probe: PASS (exit 0); its report's reproduce line has no
    ``--only`` (nine of them made a run judged as a subset: UNMEASURED, exit 5), carries the
    lengths the run was given (``--decode-tokens``, ``--long-tokens``: without them the line
    would feed the defaults), and run as printed it gives PASS again, at those lengths."""
    root = project(tmp_path / "p")
    assert harness(root, monkeypatch, "probe", "--candidate", "oracle", "--model", "fixture:tiny-qwen35", "--prompts", "prompts.jsonl",
                   "--decode-tokens", "96", "--long-tokens", "1024") == 0
    rec = receipts(root)["harness-probe-receipt/v1"]
    assert rec["verdict"] == "PASS" and rec["only"] == []
    line = reproduce_line(root / "evidence" / "parity" / "reports" / rec["id"][:16] / "report.md")
    assert "--only" not in line and line.startswith("harness probe --candidate oracle --model fixture:tiny-qwen35")
    assert "--decode-tokens 96 --long-tokens 1024" in line
    shutil.rmtree(root / "evidence")
    assert run_line(root, monkeypatch, line) == 0
    again = receipts(root)["harness-probe-receipt/v1"]
    assert again["long_decode"]["tokens"] == 96 and again["verdict"] == "PASS"
    assert next(p for p in again["probes"] if p["name"] == "long")["details"]["positions"] == 1024


def test_a_bf16_mlx_parity_on_a_folder_reproduces_with_both_options(tmp_path, monkeypatch):
    """``harness parity --candidate mlx --dtype bfloat16 --mlx-folder DIR``: the report's
    reproduce line carries both options (the folder absolute) and, run as printed, makes a
    receipt of the same verdict, class and settings."""
    pytest.importorskip("mlx_lm")
    from harness.fixtures.convert import write_transformers_folder
    from harness.model.gguf_model import GGUFModel

    root = project(tmp_path / "p")
    write_transformers_folder(GGUFModel(build("tiny-qwen35")), root / "hf")
    args = ("parity", "--candidate", "mlx", "--dtype", "bfloat16", "--mlx-folder", "hf", "--model", "fixture:tiny-qwen35",
            "--prompts", "prompts.jsonl", "--no-calibrate", "--greedy-tokens", "0")
    rc = harness(root, monkeypatch, *args)
    first = receipts(root)["harness-parity-receipt/v1"]
    line = reproduce_line(root / "evidence" / "parity" / "reports" / first["id"][:16] / "report.md")
    assert f"--dtype bfloat16 --mlx-folder {root / 'hf'}" in line
    shutil.rmtree(root / "evidence")
    assert run_line(root, monkeypatch, line) == rc
    again = receipts(root)["harness-parity-receipt/v1"]
    assert again["gated"]["verdict"] == first["gated"]["verdict"] and again["gated"]["compute_class"] == "bf16"
    assert again["engines"]["candidate"]["settings"] == first["engines"]["candidate"]["settings"]


# ------------------------------------------------------------------------------ 3. report of every kind


def test_report_renders_mtp_and_tokenizer_receipts(tmp_path, monkeypatch, capsys):
    """``harness report`` on an MTP receipt and on a tokenizer receipt (it was ``INTERNAL-ERROR:
    KeyError: 'gated'``, exit 70): a page with the receipt's verdict and a reproduce line that,
    run as printed, gives the same verdict."""
    root = project(tmp_path / "p")
    assert harness(root, monkeypatch, "parity", "--mtp", "--candidate", "oracle", "--model", "fixture:tiny-qwen35-mtp",
                   "--mtp-max-tokens", "16") == 0
    tok_rc = harness(root, monkeypatch, "tokenizer", "--candidate", "llama.cpp", "--model", "fixture:tiny-qwen35")
    found = receipts(root)
    for schema, kind, rc in (("harness-mtp-receipt/v1", "MTP draft head", 0), ("harness-tokenizer-receipt/v1", "tokenizer", tok_rc)):
        rec = found[schema]
        capsys.readouterr()
        assert harness(root, monkeypatch, "report", rec["_path"]) == 0
        assert "INTERNAL-ERROR" not in capsys.readouterr().err
        md = root / "evidence" / "parity" / "reports" / rec["id"][:16] / "report.md"
        assert md.read_text().startswith(f"# {rec['verdict']} · {kind} of {rec['engines']['candidate']['name']} on ")
        line = reproduce_line(md)
        assert run_line(root, monkeypatch, line) == rc
    assert "--mtp --model fixture:tiny-qwen35-mtp --candidate oracle --reference llama.cpp --mtp-max-tokens 16" in reproduce_line(
        root / "evidence" / "parity" / "reports" / found["harness-mtp-receipt/v1"]["id"][:16] / "report.md")


def test_report_renders_a_signoff(tmp_path, monkeypatch, capsys):
    """``harness report --signoff SEQ``: the page of a sign-off row (verdict, release, builds, cells
    with their receipts, what it relied on); a row of another kind is exit 2 in one line."""
    root = project(tmp_path / "p", "oracle", "f64")
    assert harness(root, monkeypatch, "sweep", "release.yaml") == 0
    assert harness(root, monkeypatch, "signoff", "release.yaml") == 0
    rows = [json.loads(x) for x in (root / "evidence" / "parity" / "ledger.jsonl").read_text().splitlines()]
    so = rows[-1]
    assert so["kind"] == "signoff"
    capsys.readouterr()
    assert harness(root, monkeypatch, "report", "--signoff", str(so["seq"])) == 0
    md = (root / "evidence" / "parity" / "reports" / f"signoff-{so['seq']}" / "report.md").read_text()
    assert md.startswith(f"# SIGNED · release bf16-demo (sign-off, ledger row {so['seq']})")
    cell = so["cells"][0]
    assert f"| fixture:tiny-qwen35 | oracle | cpu | ok | `{cell['parity'][:12]}` | `{cell['probe'][:12]}` |" in md
    assert all(r["id"][:12] in md.split("## Relied on")[1] for r in so["relied_on"])
    capsys.readouterr()
    assert harness(root, monkeypatch, "report", "--signoff", "1") == 2
    assert capsys.readouterr().err.strip().endswith("row 1 is a parity row, not a sign-off (harness ledger show --kind signoff)")


# ------------------------------------------------------------------------------ 4, 5. an engine repository


def logits_only_project(root: Path) -> Path:
    """``harness init`` in a fresh folder, its engine entry pointed at the example engine with the
    ``chunks`` capability only (no activations)."""
    root.mkdir(parents=True)
    assert main_in(root, "init") == 0
    shutil.copy(SOURCE_ROOT / "examples" / "llamacpp_engine.py", root / "engine.py")
    py = root / "pyproject.toml"
    text = py.read_text().replace('"path/to/your_engine.py"', '"engine.py"')
    text = re.sub(r"(?m)^capabilities = .*$", 'capabilities = ["chunks"]', text)
    assert 'capabilities = ["chunks"]' in text
    py.write_text(text)
    return root


def main_in(root: Path, *args: str) -> int:
    """``harness ARGS`` run in ``root`` (the current directory restored after)."""
    here = Path.cwd()
    os.chdir(root)
    try:
        return main(list(args))
    finally:
        os.chdir(here)


def test_a_logits_only_engine_records_activation_obligations_as_not_applicable(tmp_path, monkeypatch, capsys):
    """``harness discharge qwen35-hybrid-forward-v1 --candidate command:mine`` on an engine without
    activations: every obligation NOT-APPLICABLE (was 0/13 with eleven ``SKIPPED → GREEN-FAILED``),
    recorded per build with the capability missing; ``status --check`` over them alone is
    UNMEASURED (5: nothing shown), and one that declares activations later finds them STALE."""
    root = logits_only_project(tmp_path / "repo")
    capsys.readouterr()
    assert harness(root, monkeypatch, "discharge", "qwen35-hybrid-forward-v1", "--candidate", "command:mine") == 5
    out = capsys.readouterr().out
    assert "0/13 obligations DISCHARGED, 13 NOT-APPLICABLE (command:mine does not declare the activations capability" in out
    assert "GREEN-FAILED" not in out and "SKIPPED" not in out
    records = sorted((root / "evidence" / "discharge" / "qwen35-hybrid-forward-v1").glob("command-mine@*/*.json"))
    assert len(records) == 13
    rec = json.loads(records[0].read_text())
    assert rec["result"] == "NOT-APPLICABLE" and rec["red"] == [] and rec["not_applicable"] == {"needs": ["activations"], "capabilities": ["chunks"]}
    capsys.readouterr()
    assert harness(root, monkeypatch, "status", "--check", "--json") == 5
    assert "every one is NOT-APPLICABLE to command:mine" in capsys.readouterr().err

    from harness.contracts import discharge as dis

    monkeypatch.setattr(dis, "candidate_capabilities", lambda cand, model: ("chunks", "activations"))
    rows, _ = dis.status(["qwen35-hybrid-forward-v1"], root / "evidence" / "discharge", ["command:mine"])
    assert {r.status for r in rows} == {"STALE"} and "command:mine now declares the activations capability" in rows[0].detail


def test_status_check_is_green_when_every_obligation_is_discharged_or_not_applicable():
    """``check_exit``: 0 with one DISCHARGED beside NOT-APPLICABLE ones, 5 with none DISCHARGED,
    1 when anything else is there."""
    from harness.contracts.discharge import StatusRow, check_exit

    row = lambda s: StatusRow("c", "o", s, "", None, "command:mine")  # noqa: E731
    assert check_exit([row("DISCHARGED"), row("NOT-APPLICABLE")]) == 0
    assert check_exit([row("NOT-APPLICABLE")] * 3) == 5
    assert check_exit([row("DISCHARGED"), row("NOT-APPLICABLE"), row("BOUND")]) == 1
    assert check_exit([row("STALE")]) == 1


def test_pytest_cells_show_the_engines_stderr_without_the_exception_chain(tmp_path):
    """After ``harness init``, ``pytest -m parity`` with the engine file not yet written: each cell
    shows the engine's stderr (the missing file) and the reproduce line, not "During handling of
    the above exception"."""
    import subprocess
    import sys

    root = tmp_path / "repo"
    root.mkdir()
    assert main_in(root, "init") == 0
    p = subprocess.run([sys.executable, "-m", "pytest", "-m", "parity", "-q", "-p", "no:cacheprovider"], cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout[-3000:]
    assert "During handling of the above exception" not in p.stdout
    for kind in ("parity", "probes"):
        assert f"{kind} ENGINE-ERROR: command:mine" in p.stdout
    # Count in the FAILURES section only: on CI (the CI variable set) pytest's short summary repeats
    # each failure's whole message rather than its first line.
    failures = p.stdout.split("short test summary info")[0]
    assert failures.count("engine stderr (last lines):") == 2
    assert failures.count(f"can't open file '{root / 'path' / 'to' / 'your_engine.py'}'") == 2


# ------------------------------------------------------------------------------ 6. make run in a clone


def test_make_run_writes_only_git_ignored_files():
    """``make run`` (README step 1) records its parity run in a git-ignored folder: its ledger,
    LEDGER.md, receipts, reports and query cache are all ignored, so the tracked evidence of a
    clone is not rewritten and later receipts do not record "(uncommitted changes)"."""
    import subprocess

    from harness.evidence.ledger import default_markdown_path

    out = subprocess.run(["make", "-n", "run"], cwd=SOURCE_ROOT, capture_output=True, text=True, timeout=60).stdout
    line = next(ln for ln in out.splitlines() if "harness parity" in ln)
    argv = shlex.split(line)
    assert "--ledger" in argv, line
    ledger = Path(argv[argv.index("--ledger") + 1])
    written = [ledger, default_markdown_path(ledger), ledger.parent / "receipts" / "ab" / f"{'ab' * 32}.json",
               ledger.parent / "reports" / "index.md", ledger.parent / "reports" / "ab12" / "report.md", Path(f"{ledger}.cache.sqlite")]
    for path in written:
        assert subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=SOURCE_ROOT).returncode == 0, f"{path} is not git-ignored"
