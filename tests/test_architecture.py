"""The package's layers are import-linter's contracts in pyproject.toml (``[tool.importlinter]``),
which ``make test`` runs as ``lint-imports`` before the suite; docs/design.md ("Layout") says what
each layer holds. These tests run the same check here, and show that it can fail: on a copy of
the package with an upward import, with a new cycle, and with a crossing no module makes any more.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harness"
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e .[test])")


def lint(package_parent: Path, config: Path = ROOT / "pyproject.toml") -> subprocess.CompletedProcess:
    """``lint-imports`` over the ``harness`` package found in ``package_parent``."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT), str(config), "--no-cache"], cwd=package_parent, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the package (Python files only) and of pyproject.toml, to plant faults in."""
    shutil.copytree(PACKAGE, tmp_path / "harness", ignore=shutil.ignore_patterns("data", "__pycache__", "*.json"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_its_layers_and_has_no_cycle():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"Contracts: 4 kept, 0 broken", r.stdout), r.stdout


def plant(copy: Path, module: str, line: str) -> None:
    path = copy / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")


def test_an_upward_import_breaks_the_layers(copy: Path):
    """A pure measurement module importing a run (deferred, inside a function: still a dependency)."""
    plant(copy, "harness.measure.metrics", "from harness.runs import parity")
    r = lint(copy)
    assert r.returncode == 1
    assert "harness layers: a module imports only the layers below its own BROKEN" in r.stdout, r.stdout
    assert "harness.measure.metrics -> harness.runs.parity" in r.stdout, r.stdout


def test_a_new_cycle_breaks_the_acyclic_contract(copy: Path):
    """Two modules of one layer importing each other are allowed by the layers, not by the cycle check."""
    plant(copy, "harness.judge.tiers", "from harness.judge import verdicts")
    r = lint(copy)
    assert r.returncode == 1
    assert "harness layers: a module imports only the layers below its own KEPT" in r.stdout, r.stdout
    assert "no import cycle among the modules of any harness package BROKEN" in r.stdout, r.stdout
    assert "No cycles are allowed in harness.judge" in r.stdout and ".verdicts -> .tiers" in r.stdout, r.stdout


def test_a_stale_crossing_fails(copy: Path):
    """A listed crossing that no module makes any more is an error, not a silent allowance."""
    cfg = copy / "pyproject.toml"
    cfg.write_text(cfg.read_text().replace(
        '    "harness.fixtures.synthetic -> harness.measure.prompts",\n',
        '    "harness.fixtures.synthetic -> harness.measure.prompts",\n    "harness.model.lint -> harness.engines.registry",\n'))
    r = lint(copy, cfg)
    assert r.returncode == 1
    assert "harness.model.lint -> harness.engines.registry" in r.stdout + r.stderr


def numbers_sha256(package_parent: Path) -> str:
    code = "from harness import provenance; print(provenance.numbers_sha256())"
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    out = subprocess.run([sys.executable, "-c", code], cwd=package_parent, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("module, counts", [("harness/runs/calibrate/fit.py", True), ("harness/runs/topk.py", True),
                                            ("harness/judge/verdicts.py", True), ("harness/measure/metrics.py", True),
                                            ("harness/measure/rowkernel.c", True),
                                            ("harness/cli/runs.py", False)])
def test_the_numbers_hash_follows_the_runs_into_their_folders(copy: Path, module: str, counts: bool):
    """``provenance.numbers_sha256`` decides when a sweep re-runs a cell, so an edit to any run,
    measurement or judgement module changes it (``harness/runs/calibrate/`` is a package, read
    recursively), and so does the metrics' C row kernel; a CLI edit does not."""
    before = numbers_sha256(copy)
    (copy / module).write_text((copy / module).read_text() + "\n# edited\n")
    assert (numbers_sha256(copy) != before) is counts


def test_the_old_import_paths_still_import_the_moved_modules():
    """Release 0.1's ``harness.compare.*`` / ``harness.gates.*`` import as the new modules, with a
    DeprecationWarning (``harness.moved``)."""
    import importlib
    import warnings

    from harness.judge import thresholds
    from harness.measure import metrics

    for name in [n for n in list(sys.modules) if n.startswith(("harness.compare", "harness.gates"))]:
        del sys.modules[name]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        old_metrics = importlib.import_module("harness.compare.metrics")
        old_thresholds = importlib.import_module("harness.gates.thresholds")
    assert old_metrics is metrics and old_thresholds is thresholds
    assert any("harness.compare.metrics moved to harness.measure.metrics" in str(x.message) for x in w)
    from harness.compare.parity import run_parity
    from harness.runs.parity import run_parity as new

    assert run_parity is new


def test_design_md_names_every_module_in_its_layer():
    """docs/design.md's layout block names every module of the package (the picture cannot drift
    from the code): a new module without its line fails here."""
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("## Layout: one folder per layer")
    block = text[start:text.index("```", text.index("```", start) + 3)]
    missing = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
               if "suite" not in p.parts and not (p.name == "__init__.py" and p.parent.name != "calibrate") and p.name not in block]
    assert not missing, f"modules docs/design.md's layout does not name: {missing}"


def test_evidence_enters_through_one_door():
    """Only the evidence door (``harness/evidence/record.py``) writes a receipt or appends a row:
    every run, the sweep, the sign-off and ``ledger merge`` call ``record_evidence`` or
    ``record_row``, so each gets the row, the query cache, LEDGER.md and the index refreshed once
    under one lock (a sign-off that appended its row itself left the index without it)."""
    door = {PACKAGE / "evidence" / "record.py", PACKAGE / "evidence" / "receipts.py", PACKAGE / "evidence" / "chain.py"}
    calls = re.compile(r"\b(write_receipt|append_row|append_locked|chain\.append)\(")
    found = [f"{p.relative_to(ROOT)}:{i}: {ln.strip()}" for p in sorted(PACKAGE.rglob("*.py")) if p not in door
             for i, ln in enumerate(p.read_text().splitlines(), 1)
             if calls.search(ln) and not ln.lstrip().startswith(("def ", "#", '"', "``"))]
    assert not found, "evidence written outside the door:\n" + "\n".join(found)


def test_the_cli_writes_no_file_itself():
    """The CLI is a thin layer (docs/design.md, "Layout"): options in, a run of the library out, its
    outcome printed. Every file is written by the library (the evidence door, the calibration's
    ``write_calibration``, ``engines_page.write``), never by a verb's module: a file write in
    ``harness/cli/`` is run logic left behind (issue 47: the full calibration's thresholds
    document was assembled and written there)."""
    writes = re.compile(r"\.(write_text|write_bytes)\(|\bopen\(|os\.replace\(|\bwrite_thresholds\(|\bthresholds_document\(")
    found = [f"{p.relative_to(ROOT)}:{i}: {ln.strip()}" for p in sorted((PACKAGE / "cli").glob("*.py"))
             for i, ln in enumerate(p.read_text().splitlines(), 1) if writes.search(ln) and not ln.lstrip().startswith("#")]
    assert not found, "files written by the CLI itself:\n" + "\n".join(found)
