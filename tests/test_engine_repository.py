"""The harness as a dependency of an engine's own repository (harness/contracts/suite.py,
harness/scaffold.py, harness/conformance.py, the pytest plugin's cells).

Fast tests: the wheel's package list covers every harness package; contracts are found by id;
a project's own contract may depend on a shipped one; evidence, ledger and status defaults
belong to the project; ``harness init`` writes, refuses and forces; the shipped cells are
collected once per candidate × model (and once only when both a test module and ``--harness``
bring them), run, record receipts and ledger rows, and fail naming prompt and position.

Slow (``make test-slow``, or ``pytest -m slow tests/test_engine_repository.py``): the wheel built
and installed into a fresh virtual environment, used from an empty repository made by
``harness init`` with the example engine, as a new user would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from setuptools import find_packages

from harness.cli import main
from harness.config import load_config
from harness.contracts import suite
from harness.contracts.discharge import default_evidence_dir
from harness.contracts.loader import (
    ContractsInvalid,
    contract_files,
    load_contract,
    load_contracts,
)
from harness.errors import InvalidInput
from harness.evidence.ledger import read_rows
from harness.paths import SUITE_ROOT
from harness.provenance import git_state
from harness.scaffold import TEST_MODULE_TEXT

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p.stem for p in (REPO / "contracts").glob("*.yaml"))


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """An empty project folder (its own pyproject.toml), made the current directory."""
    monkeypatch.delenv("HARNESS_CONFIG", raising=False)
    root = tmp_path / "engine-repo"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "my-engine"\nversion = "0.1"\n')
    monkeypatch.chdir(root)
    return root


# -- packaging -----------------------------------------------------------------------------------
def test_wheel_package_list_covers_every_harness_package():
    """pyproject.toml lists the packages explicitly (a package-dir mapping cannot be combined with
    packages.find): a new harness subpackage missing from the list would be missing from the wheel."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set(find_packages(where=str(REPO), include=["harness", "harness.*"]))
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert tool["package-dir"] == {"harness.suite": ".", "harness.suite.contracts": "contracts",
                                   "harness.suite.tests.contracts": "tests/contracts"}
    assert {"harness.suite", "harness.suite.contracts", "harness.suite.tests.contracts"} <= listed
    assert SUITE_ROOT == REPO  # run from the checkout: the suite is this repository's top level


def test_every_importable_folder_is_a_listed_package():
    """Issue 48 (4): setuptools prints a 30-line BuildBackendWarning for every folder Python can
    import (a namespace package: harness.schemas, harness.data.*) that ``packages`` leaves out,
    about 250 lines at install; each is listed, so building the wheel warns about none."""
    from setuptools import find_namespace_packages

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {p for p in find_namespace_packages(where=str(REPO), include=["harness", "harness.*"]) if "__pycache__" not in p}
    assert found - set(tool["packages"]) == set(), f"add to [tool.setuptools] packages: {sorted(found - set(tool['packages']))}"
    assert {"harness.schemas", "harness.data.chat", "harness.data.fixtures", "harness.data.prompts", "harness.data.scenarios"} <= found


# -- contracts by id, dependencies, evidence location ------------------------------------------
def test_contracts_are_addressable_by_id(project):
    assert contract_files(["qwen35-hybrid-forward-v1"]) == [SUITE_ROOT / "contracts" / "qwen35-hybrid-forward-v1.yaml"]
    with pytest.raises(InvalidInput, match="no such contract file, folder or id; shipped contracts: gated-delta-net-v1, "):
        contract_files(["qwen35-nope-v1"])
    with pytest.raises(InvalidInput, match="no such contract file, folder or id"):
        contract_files(["contracts/qwen35-hybrid-forward-v1.yaml"])  # a path is never read as an id
    own = project / "contracts" / "qwen35-shapes-v1.yaml"  # the project's own file of that id comes first
    own.parent.mkdir()
    shutil.copy(SUITE_ROOT / "contracts" / "qwen35-shapes-v1.yaml", own)
    assert contract_files(["qwen35-shapes-v1"]) == [own]


def _own_contract(depends_on: str, obligation_id: str = "MINE-INV-001") -> str:
    return f"""\
id: my-engine-v1
version: 0.1.0
description: The engine's own obligations, on top of the shipped suite.
subject: engine
model: fixture:tiny-qwen35
references: [my engine's docs]
depends_on: [{depends_on}]
equations:
  decay:
    formula: g = ssm_a · softplus(alpha + dt_bias)
    domain: "[T, n_v]"
    source: llama.cpp qwen35.cpp
    oracle: harness.engines.oracle.qwen35.gdn_gate
obligations:
  - id: {obligation_id}
    kind: invariant
    property: Planned.
    formal: "-"
    source: my engine
    tests: []
    red: {{mutant: dt-bias-dropped}}
    if_fails: "-"
qa_gate:
  id: F-MINE-001
  name: mine
  description: mine
  checks: [harness discharge my-engine-v1]
  pass_criteria: none
"""


def test_own_contract_may_depend_on_a_shipped_one(project):
    path = project / "contracts" / "my-engine-v1.yaml"
    path.parent.mkdir()
    path.write_text(_own_contract("qwen35-hybrid-forward-v1"))
    (c,) = load_contracts([path], check_tests=False)
    assert c.id == "my-engine-v1" and c.data["depends_on"] == ["qwen35-hybrid-forward-v1"]
    assert [x.id for x in load_contracts(["my-engine-v1"], check_tests=False)] == ["my-engine-v1"]  # by id, from contracts/
    path.write_text(_own_contract("qwen35-nope-v1"))
    with pytest.raises(ContractsInvalid, match=r"depends_on\[0\]: unknown contract 'qwen35-nope-v1'"):
        load_contracts([path], check_tests=False)
    path.write_text(_own_contract("qwen35-hybrid-forward-v1", "QHF-INV-001"))  # ids stay unique across the suite
    with pytest.raises(ContractsInvalid, match="obligation id QHF-INV-001 also used in"):
        load_contracts([path], check_tests=False)


def test_evidence_ledger_and_status_belong_to_the_project(project, capsys):
    shipped = load_contract("qwen35-hybrid-forward-v1", check_tests=False)
    assert default_evidence_dir(shipped) == project / "evidence" / "discharge"
    assert load_config().ledger == project / "evidence" / "parity" / "ledger.jsonl"
    assert main(["status", "--check"]) == 5  # nothing discharged here: nothing to judge is not a pass
    assert "UNMEASURED: no contracts to report" in capsys.readouterr().err
    assert suite.default_contract_paths() == []
    records = project / "evidence" / "discharge" / "qwen35-hybrid-forward-v1"
    records.mkdir(parents=True)
    (records / "QHF-INV-001.json").write_text("{}")
    assert suite.default_contract_paths() == [SUITE_ROOT / "contracts" / "qwen35-hybrid-forward-v1.yaml"]
    with (project / "pyproject.toml").open("a") as f:
        f.write('\n[tool.harness]\nevidence = "qa/evidence"\ncontracts = ["qwen35-shapes-v1"]\n')
    assert default_evidence_dir(shipped) == project / "qa" / "evidence" / "discharge"
    assert load_config().ledger == project / "qa" / "evidence" / "parity" / "ledger.jsonl"
    assert suite.default_contract_paths() == [SUITE_ROOT / "contracts" / "qwen35-shapes-v1.yaml"]
    (project / "pyproject.toml").write_text('[tool.harness]\ncontracts = ["qwen35-nope-v1"]\n')
    assert main(["status"]) == 2
    assert "unknown shipped contract 'qwen35-nope-v1'" in capsys.readouterr().err


# -- harness init ----------------------------------------------------------------------------------
INIT_FILES = ["pyproject.toml", "tests/test_qwen35_parity.py", ".github/workflows/qwen35-harness.yml",
              "evidence/parity/ledger.jsonl", "LEDGER.md"]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {f: (root / f).read_bytes() for f in INIT_FILES if (root / f).exists()}


def test_init_writes_refuses_and_forces(project, capsys):
    (project / "pyproject.toml").write_text('[project]\nname = "my-engine"\nversion = "0.1"\n\n[tool.ruff]\nline-length = 100\n')
    before = tomllib.loads((project / "pyproject.toml").read_text())
    assert main(["init"]) == 0
    assert all((project / f).is_file() for f in INIT_FILES)
    cfg = tomllib.loads((project / "pyproject.toml").read_text())
    assert cfg["project"] == before["project"] and cfg["tool"]["ruff"] == before["tool"]["ruff"]  # kept as it was
    assert cfg["tool"]["harness"]["candidate"] == "command:mine"
    assert cfg["tool"]["harness"]["engines"]["mine"]["command"][-2:] == ["{request}", "{out_dir}"]
    assert (project / "tests" / "test_qwen35_parity.py").read_text() == TEST_MODULE_TEXT
    flow = yaml.safe_load((project / ".github" / "workflows" / "qwen35-harness.yml").read_text())
    steps = flow["jobs"]["qwen35"]["steps"]
    runs = [s.get("run", "") for s in steps]
    assert "pytest -m parity --harness-record" in runs and "harness status --check" in runs
    # no release is on the package index: the workflow installs this harness's repository at the
    # commit init ran from (the suite the committed evidence names), never "qwen35-harness==0.1.0"
    commit = git_state(REPO)["commit"]
    assert any(re.search(rf'pip install "qwen35-harness @ git\+\S+@{commit}"', r) for r in runs), runs
    assert not any("qwen35-harness==" in r for r in runs)
    assert flow["jobs"]["qwen35"]["steps"][2]["with"]["key"].endswith(commit[:12])
    cache = next(s for s in steps if s.get("uses", "").startswith("actions/cache"))["with"]["path"]
    assert ".harness-cache" in cache and "~/.cache/pip" in cache and flow["jobs"]["qwen35"]["env"]["HARNESS_CACHE_DIR"].endswith(".harness-cache")
    assert (project / "evidence" / "parity" / "ledger.jsonl").read_bytes() == b""
    assert main(["ledger", "verify"]) == 0 and "OK (0 rows" in capsys.readouterr().out

    (project / "tests" / "test_qwen35_parity.py").write_text("# mine\n")
    written = _snapshot(project)
    assert main(["init"]) == 2  # refuses, lists every existing file, writes nothing
    err = capsys.readouterr().err
    assert err.startswith("harness: INVALID: refusing to overwrite: pyproject.toml [tool.harness], ") and "--force" in err
    assert all(f in err for f in INIT_FILES[1:])
    assert _snapshot(project) == written

    assert main(["init", "--force", "--engine", "fast-engine"]) == 0
    cfg = tomllib.loads((project / "pyproject.toml").read_text())
    assert cfg["tool"]["harness"]["candidate"] == "command:fast-engine" and list(cfg["tool"]["harness"]["engines"]) == ["fast-engine"]
    assert cfg["project"] == before["project"] and cfg["tool"]["ruff"] == before["tool"]["ruff"]
    assert (project / "tests" / "test_qwen35_parity.py").read_text() == TEST_MODULE_TEXT


def test_init_pins_the_harness_source_it_is_given(project, capsys):
    """``harness init --harness-source URL``: the workflow installs the harness from that URL at
    the commit init ran from, and init says so."""
    assert main(["init", "--harness-source", "https://example.org/qwen35-harness.git"]) == 0
    req = f"qwen35-harness @ git+https://example.org/qwen35-harness.git@{git_state(REPO)['commit']}"
    assert f'python -m pip install "{req}"' in (project / ".github" / "workflows" / "qwen35-harness.yml").read_text()
    assert f"the workflow installs: {req}" in capsys.readouterr().out


def test_init_refuses_what_it_cannot_edit_safely(project, capsys):
    (project / "pyproject.toml").write_text('[tool]\nharness = { candidate = "oracle" }\n')
    assert main(["init", "--force"]) == 2
    assert "edit it by hand" in capsys.readouterr().err
    (project / "pyproject.toml").write_text('[tool.harness\n')
    assert main(["init"]) == 2
    assert "invalid TOML" in capsys.readouterr().err
    assert main(["init", "--engine", "../x"]) == 2
    assert not (project / "tests").exists()


# -- the shipped cells through the pytest plugin ---------------------------------------------------
def _pytest(root: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HARNESS_CONFIG", "PYTEST_ADDOPTS")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _cell_project(root: Path, test_module: bool = True, extra: str = "") -> None:
    tokens = [(7 * i + 3) % 500 for i in range(80)]
    (root / "prompts.jsonl").write_text(json.dumps({"id": "ids-80", "tokens": tokens}) + "\n")
    (root / "pyproject.toml").write_text(
        '[tool.harness]\ncandidate = ["oracle", "mutant:qk-norm-skipped"]\nmodels = ["fixture:tiny-qwen35"]\n'
        f'prompts = "prompts.jsonl"\n{extra}')
    if test_module:
        (root / "tests").mkdir(exist_ok=True)
        (root / "tests" / "test_qwen35_parity.py").write_text(TEST_MODULE_TEXT)


def test_cells_are_collected_once_per_candidate_and_model(tmp_path):
    _cell_project(tmp_path)
    ids = [f"{c}@fixture:tiny-qwen35" for c in ("oracle", "mutant:qk-norm-skipped")]
    want = [f"tests/test_qwen35_parity.py::test_{t}[{i}]" for t in ("parity", "probes") for i in ids]
    r = _pytest(tmp_path, "--collect-only", "-q", "-m", "parity")
    assert [ln for ln in r.stdout.splitlines() if "::" in ln] == want, r.stdout + r.stderr
    r = _pytest(tmp_path, "--collect-only", "-q", "-m", "parity", "--harness")  # module and --harness: each cell once
    assert [ln for ln in r.stdout.splitlines() if "::" in ln] == want and "4 deselected" in r.stdout, r.stdout + r.stderr
    shutil.rmtree(tmp_path / "tests")
    _cell_project(tmp_path, test_module=False, extra="pytest = true\n")  # no test module: the plugin brings them
    r = _pytest(tmp_path, "--collect-only", "-q", "-m", "parity")
    got = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert got == [w.replace("tests/test_qwen35_parity.py", "harness/conformance.py") for w in want], r.stdout + r.stderr
    assert "no tests" in _pytest(tmp_path, "--collect-only", "-q", "-m", "parity", "--no-harness").stdout


def test_cells_record_evidence_and_fail_naming_prompt_and_position(tmp_path):
    _cell_project(tmp_path)
    r = _pytest(tmp_path, "-q", "-m", "parity", "-k", "test_parity", "--harness-record")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "1 failed, 1 passed" in out, out
    assert "FAILED tests/test_qwen35_parity.py::test_parity[mutant:qk-norm-skipped@fixture:tiny-qwen35]" in out
    assert re.search(r"parity FAIL: mutant:qk-norm-skipped vs llama\.cpp on fixture:tiny-qwen35 \(sha256 [0-9a-f]{12}\): "
                     r".*FAIL.*first failing: prompt 'ids-80' position \d+", out), out
    prompts = tmp_path / "prompts.jsonl"
    assert f"reproduce: harness parity --candidate mutant:qk-norm-skipped --model fixture:tiny-qwen35 --prompts {prompts}" in out
    ledger = tmp_path / "evidence" / "parity" / "ledger.jsonl"
    rows = read_rows(ledger)
    assert [(row["candidate"].split()[0], row["verdict"]) for row in rows] == [("oracle", "PASS"), ("mutant:qk-norm-skipped", "FAIL")]
    receipt = json.loads(next((ledger.parent / "receipts").glob(f"*/{rows[0]['receipt_id']}.json")).read_text())
    assert sorted(receipt["harness"]["suite"]["contracts"]) == SHIPPED and receipt["harness"]["suite"]["source"] == "checkout"
    assert receipt["command"][:2] == ["pytest", "tests/test_qwen35_parity.py::test_parity[oracle@fixture:tiny-qwen35]"]
    assert main(["ledger", "verify", "--ledger", str(ledger)]) == 0


def test_probe_cell_failure_prints_each_failed_probe_as_a_reproducer(tmp_path):
    """The probe cell of an engine's repository fails with the reproducer line of each failed probe
    (harness.judge.reproducer): the case, the chunks, the likely cause and the rerun command."""
    (tmp_path / "pyproject.toml").write_text('[tool.harness]\ncandidate = "mutant:conv-state-dropped"\n'
                                             'models = ["fixture:tiny-qwen35"]\nprobes = ["split"]\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_qwen35_parity.py").write_text(TEST_MODULE_TEXT)
    r = _pytest(tmp_path, "-q", "-m", "parity", "-k", "test_probes")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "1 failed" in out, out
    assert re.search(r"probe split FAIL: split at 1: first differing position 1, .*\(candidate mutant:conv-state-dropped, "
                     r"model fixture:tiny-qwen35 sha256 [0-9a-f]{12}, prompt '[^']+', n_tokens \d+, chunks \[1, \d+\]\); "
                     r"likely cause: conv state dropped between chunks \(as mutant:conv-state-dropped\)", out), out


# -- slow: the wheel in a fresh virtual environment, used from an engine's repository --------------
def _run(argv, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HARNESS_CONFIG", "PYTEST_ADDOPTS", "PYTHONPATH")}
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(r: subprocess.CompletedProcess, code: int = 0) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == code, f"exit {r.returncode} (expected {code}):\n{out[-6000:]}"
    return out


def _build_wheel(src: Path, out: Path, version: str | None = None, edit: tuple[str, str] | None = None) -> Path:
    """A wheel built from a clean copy of this working tree (tracked and untracked, not ignored,
    files: no stale build/ folder can leak into it), optionally with another version and one
    file's text appended to."""
    files = _ok(_run(["git", "ls-files", "-co", "--exclude-standard", "-z"], REPO)).split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    if version:
        py = src / "pyproject.toml"
        py.write_text(py.read_text().replace('version = "0.1.0"', f'version = "{version}"', 1))
    if edit:
        (src / edit[0]).write_text((src / edit[0]).read_text() + edit[1])
    _ok(_run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, src], src))
    (wheel,) = out.glob(f"qwen35_harness-{version or '0.1.0'}-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_in_an_engine_repository(tmp_path):
    """The acceptance of issue 18, as a new user would meet the harness.

    The virtual environment is fresh and holds only the harness wheel (installed with
    ``--no-deps``); its third-party dependencies (numpy, scipy, pandas, matplotlib,
    llama-cpp-python, ...) come from this checkout's environment through a ``.pth`` line, because
    installing them again costs minutes and hundreds of MB on a shared machine and is pip's
    job, not the harness's. A ``.pth`` line adds a folder to ``sys.path`` without running that
    folder's own ``.pth`` files, so the checkout's editable install of the harness is not
    activated: the test asserts that ``harness`` and its suite are imported from the wheel.
    """
    wheel = _build_wheel(tmp_path / "src", tmp_path / "dist")
    names = __import__("zipfile").ZipFile(wheel).namelist()
    assert {f"harness/suite/contracts/{c}.yaml" for c in SHIPPED} <= set(names)
    assert {"harness/suite/thresholds.yaml", "harness/suite/tests/contracts/conftest.py", "harness/conformance.py"} <= set(names)
    assert not [n for n in names if n.startswith("harness/suite/tests/test_")]  # the harness's own tests stay out

    venv = tmp_path / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path))
    site = next(venv.glob("lib/python*/site-packages"))
    deps = [p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir()]
    (site / "deps-from-checkout.pth").write_text("".join(f"{p}\n" for p in deps))
    py, harness = venv / "bin" / "python", venv / "bin" / "harness"
    _ok(_run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel], tmp_path))
    where = _ok(_run([py, "-c", "import harness.paths as p; print(p.IS_CHECKOUT, p.SUITE_ROOT)"], tmp_path)).split()
    assert where == ["False", str(site / "harness" / "suite")]

    repo = tmp_path / "engine-repo"
    repo.mkdir()
    _ok(_run(["git", "init", "-q"], repo))
    out = _ok(_run([harness, "init"], repo))
    assert all(f"wrote {f}" in out for f in INIT_FILES)
    assert "refusing to overwrite" in _ok(_run([harness, "init"], repo), 2)
    shutil.copy(REPO / "examples" / "llamacpp_engine.py", repo / "engine.py")
    pyproject = repo / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"path/to/your_engine.py"', '"engine.py"'))

    out = _ok(_run([py, "-m", "pytest", "-m", "parity", "-q", "--harness-record"], repo))
    n = int(re.search(r"(\d+) passed", out).group(1))
    assert n == 2 and "failed" not in out  # one parity cell and one probe cell: command:mine on the default model
    assert "OK (2 rows" in _ok(_run([harness, "ledger", "verify"], repo))

    out = _ok(_run([harness, "discharge", "qwen35-hybrid-forward-v1"], repo))
    assert "13/13 obligations DISCHARGED" in out
    records = sorted((repo / "evidence" / "discharge" / "qwen35-hybrid-forward-v1").glob("oracle@*/*.json"))
    assert len(records) == 13
    rec = json.loads(records[0].read_text())
    assert rec["harness"]["version"] == "0.1.0" and rec["harness"]["source"] == "installed" and rec["harness"]["git_commit"] is None
    assert rec["harness"]["contracts"]["qwen35-hybrid-forward-v1"] == rec["contract"]["version"] and rec["contract"]["shipped"]
    assert not [p for p in site.rglob("*") if p.is_dir() and p.name in ("discharge", "receipts")]  # nothing written into the venv
    assert "DISCHARGED" in _ok(_run([harness, "status", "--check"], repo))
    # the engine itself (logits only) discharges the end-to-end contract
    assert "8/8 obligations DISCHARGED" in _ok(_run([harness, "discharge", "qwen35-e2e-verification-v1", "--candidate", "command:mine"], repo))
    r = _run([harness, "status", "--check", "--json"], repo)
    _ok(r)
    assert {c["contract"]: c["DISCHARGED"] for c in json.loads(r.stdout)["coverage"]} == {
        "qwen35-e2e-verification-v1": 8, "qwen35-hybrid-forward-v1": 13}
    # ... and the activations contract is not applicable to it: recorded so, and CI stays green
    na = _ok(_run([harness, "discharge", "qwen35-hybrid-forward-v1", "--candidate", "command:mine"], repo), 5)
    assert "0/13 obligations DISCHARGED, 13 NOT-APPLICABLE (command:mine does not declare the activations capability" in na
    r = _run([harness, "status", "--check", "--json", "--candidate", "command:mine"], repo)
    _ok(r)
    assert {(c["contract"], c["DISCHARGED"], c["NOT-APPLICABLE"]) for c in json.loads(r.stdout)["coverage"]} == {
        ("qwen35-e2e-verification-v1", 8, 0), ("qwen35-hybrid-forward-v1", 0, 13)}

    bad = (repo / "engine.py").read_text().replace("return np.ctypeslib.as_array(ptr", "return 1.5 * np.ctypeslib.as_array(ptr")
    assert bad != (repo / "engine.py").read_text()
    (repo / "engine_bad.py").write_text(bad)
    pyproject.write_text(pyproject.read_text().replace('"engine.py"', '"engine_bad.py"'))
    out = _ok(_run([py, "-m", "pytest", "-m", "parity", "-q"], repo), 1)
    assert "FAILED tests/test_qwen35_parity.py::test_parity[command:mine@fixture:trained-qwen35]" in out
    assert re.search(r"largest KLD [0-9.e+-]+ at prompt '[^']+' position \d+", out), out
    assert "reproduce: harness parity --candidate command:mine --model fixture:trained-qwen35" in out

    # an upgrade whose contract changed: the project's evidence is STALE, and says why
    pyproject.write_text(pyproject.read_text().replace('"engine_bad.py"', '"engine.py"'))  # the engine as discharged
    edited = _build_wheel(tmp_path / "src2", tmp_path / "dist2", "0.1.1", ("contracts/qwen35-hybrid-forward-v1.yaml", "# upgraded\n"))
    _ok(_run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", "--force-reinstall", edited], tmp_path))
    r = _run([harness, "status", "--check", "--json"], repo)
    _ok(r, 1)
    rows = json.loads(r.stdout)["obligations"]
    stale = [r for r in rows if r["contract"] == "qwen35-hybrid-forward-v1"]  # the oracle's 13 and command:mine's 13 NOT-APPLICABLE
    assert sorted({r["candidate"] for r in stale}) == ["command:mine", "oracle"]
    assert len(stale) == 26 and {r["status"] for r in stale} == {"STALE"}
    assert all("contract qwen35-hybrid-forward-v1.yaml changed" in r["detail"] for r in stale)
    assert {r["status"] for r in rows if r["contract"] == "qwen35-e2e-verification-v1"} == {"DISCHARGED"}  # unchanged by the upgrade


def test_readme_states_the_python_that_pyproject_requires():
    """Issue 48 (4): the README said Python ≥ 3.10 where pyproject.toml requires ≥ 3.11 (tomllib)."""
    import re

    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    stated = re.findall(r"Python ≥ (3\.\d+)", (REPO / "README.md").read_text())
    assert stated and {f">={v}" for v in stated} == {requires}, (stated, requires)


def test_docs_give_the_per_build_discharge_layout(tmp_path):
    """Issue 48 (4): docs/engine-repository.md described discharge records as they were before
    the per-build folders (``<contract>/<obligation>.json``); the layout the code writes is
    ``<contract>/<NAME@BUILD>/<obligation>.json`` (``discharge.build_dir``)."""
    import re

    from harness.contracts.discharge import build_dir

    assert re.fullmatch(r"command-mine@[0-9a-f]{12}", build_dir("command:mine", "0123456789abcdef0123"))
    for doc in ("README.md", "docs/engine-repository.md", "docs/design.md", "docs/release.md"):
        text = (REPO / doc).read_text()
        assert not re.search(r"discharge/<contract>/<obligation>\.json", text), doc
    assert "<evidence>/discharge/<contract>/<NAME@BUILD>/<obligation>.json" in (REPO / "docs/engine-repository.md").read_text()
