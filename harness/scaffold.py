"""``harness init``: the files an engine's repository needs to run the harness in its own CI.

Written into the repository root (``root``):

* ``pyproject.toml``: a ``[tool.harness]`` table (``candidate = "command:NAME"``, the optional
  keys commented) and ``[tool.harness.engines.NAME]``, the engine entry to fill in
  (docs/engine-protocol.md). An existing pyproject.toml keeps every byte; the table is appended;
* ``tests/test_qwen35_parity.py``: runs the shipped parity and probe cells
  (``from harness.conformance import *``);
* ``.github/workflows/qwen35-harness.yml``: a GitHub Actions job that installs this harness
  (``harness_requirement``: the repository at the commit ``harness init`` ran from, until a
  release is on the package index), caches the fixtures (``$HARNESS_CACHE_DIR``) and pip's cache (where the compiled
  llama-cpp-python wheel, the llama.cpp build, is kept), runs ``pytest -m parity
  --harness-record`` and ``harness status --check``, and keeps the evidence as an artifact;
* an empty ledger: ``evidence/parity/ledger.jsonl`` and its rendering ``LEDGER.md``.

Nothing existing is overwritten: ``init_project`` checks every target first and refuses
(``InvalidInput``, exit 2, listing them) before writing anything, unless ``force``; with
``force`` an existing ``[tool.harness]`` is replaced only when it is written as tables
(``[tool.harness]``, ``[tool.harness.*]``) and the rest of the file parses to the same data after
the edit; otherwise it refuses and asks for a hand edit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.errors import InvalidInput
from harness.paths import IS_CHECKOUT, SOURCE_ROOT
from harness.provenance import git_state

ENGINE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
PYPROJECT = "pyproject.toml"
TEST_MODULE = Path("tests") / "test_qwen35_parity.py"
WORKFLOW = Path(".github") / "workflows" / "qwen35-harness.yml"
LEDGER = Path("evidence") / "parity" / "ledger.jsonl"
LEDGER_MD = Path("LEDGER.md")
_HARNESS_HEADER = re.compile(r"^\s*\[\[?\s*tool\s*\.\s*harness\s*(\.[^\]]*)?\]\]?\s*(#.*)?$")
_ANY_HEADER = re.compile(r"^\s*\[")


MARKER = "# qwen35-harness (written by `harness init`): verification of this repository's Qwen3.5 engine."


def harness_table(engine: str) -> str:
    """The ``[tool.harness]`` TOML text ``harness init`` appends, for an engine called ``engine``."""
    return f'''
{MARKER}
[tool.harness]
candidate = "command:{engine}"
# models = ["fixture:trained-qwen35", "path/to/model-Q8_0.gguf"]  # default: the harness's trained model
# reference = "llama.cpp"             # or "llama.cpp-repack": llama.cpp's extra buffer types on (README)
# prompts = "prompts.jsonl"          # JSONL, id + text or tokens; default: the shipped set
# thresholds = "thresholds.yaml"     # default: ./thresholds.yaml, else the shipped one
# probes = ["split", "decode", "determinism", "long"]  # default: every probe
# evidence = "evidence"              # receipts, ledger and discharge records
# contracts = ["qwen35-e2e-verification-v1"]  # shipped contracts `harness status` requires
# pytest = true                      # collect the shipped cells without tests/test_qwen35_parity.py

# FILL IN: how the harness runs your engine, one request at a time (the command protocol,
# docs/engine-protocol.md of qwen35-harness). The engine reads {{request}} (JSON: model path,
# token ids, chunks) and writes {{out_dir}}/logits.npy (float32 [T, n_vocab]) and info.json.
[tool.harness.engines.{engine}]
command = ["{{python}}", "path/to/your_engine.py", "{{request}}", "{{out_dir}}"]
timeout_s = 600
capabilities = ["chunks"]  # "chunks": fed in pieces with state carried; "activations": named tensors
'''


TEST_MODULE_TEXT = '''"""Qwen3.5 conformance of this repository's engine (written by `harness init`).

The parity and probe cells shipped with qwen35-harness, one test per candidate x model from
[tool.harness] in pyproject.toml. Run: pytest -m parity (add --harness-record to write receipts
and ledger rows). A failure names the prompt and position and the command that reproduces it.
"""

from harness.conformance import *  # noqa: F401,F403
'''


DISTRIBUTION = "qwen35-harness"


def _origin_url(root: Path) -> str | None:
    """``git remote get-url origin`` of the checkout at ``root``; None without one."""
    try:
        p = subprocess.run(["git", "-C", str(root), "remote", "get-url", "origin"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (p.stdout.strip() or None) if p.returncode == 0 else None


def _vcs_install() -> tuple[str, str] | None:
    """``(url, commit)`` when this harness was installed from a git repository (pip's
    ``direct_url.json``, PEP 610); None otherwise."""
    try:
        text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
        d = json.loads(text) if text else {}
    except (metadata.PackageNotFoundError, ValueError, OSError):
        return None
    vcs = d.get("vcs_info") if isinstance(d, dict) else None
    if isinstance(vcs, dict) and vcs.get("vcs") == "git" and vcs.get("commit_id") and d.get("url"):
        return str(d["url"]), str(vcs["commit_id"])
    return None


def harness_requirement(source: str | None = None, version: str = "0+unknown") -> str:
    """The pip requirement the workflow installs: this harness exactly, because the committed
    evidence (receipts, discharge records) names the suite's sha256 and a CI run on another
    harness would find it STALE; and no release is on the package index yet, so
    ``qwen35-harness==VERSION`` would not install.

    - run from a git checkout: ``qwen35-harness @ git+URL@COMMIT``, the commit it is at (commit
      your harness changes first: uncommitted ones are not in it), URL ``source`` or the
      checkout's ``origin`` remote, else the checkout's own folder (``file://``: a CI runner
      cannot reach it; pass ``--harness-source``);
    - installed from a git repository (pip's ``direct_url.json``): that URL (or ``source``) at
      that commit;
    - installed from an index: ``qwen35-harness==VERSION``.
    """
    if IS_CHECKOUT and (commit := git_state(SOURCE_ROOT)["commit"]):
        url = source or _origin_url(SOURCE_ROOT) or SOURCE_ROOT.resolve().as_uri()
        return f"{DISTRIBUTION} @ git+{url.removeprefix('git+')}@{commit}"
    if vcs := _vcs_install():
        return f"{DISTRIBUTION} @ git+{(source or vcs[0]).removeprefix('git+')}@{vcs[1]}"
    return f"{DISTRIBUTION}=={version}"


def workflow_text(version: str, requirement: str | None = None) -> str:
    """The GitHub Actions workflow, installing ``requirement`` (``harness_requirement``; default
    ``qwen35-harness==version``) and keyed on it in the cache."""
    requirement = requirement or f"{DISTRIBUTION}=={version}"
    pin = requirement.rsplit("@", 1)[-1][:12] if " @ " in requirement else version
    return f'''# Written by `harness init` (qwen35-harness {version}): the Qwen3.5 conformance cells on this
# repository's engine, and a check that the committed contract evidence is current.
name: qwen35-harness

on:
  push:
  pull_request:

jobs:
  qwen35:
    runs-on: ubuntu-latest
    timeout-minutes: 90
    env:
      HARNESS_CACHE_DIR: ${{{{ github.workspace }}}}/.harness-cache
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.11"
      # Fixtures the harness builds, and pip's cache, which keeps the llama-cpp-python wheel
      # compiled on the first run (the llama.cpp build: tens of minutes from source).
      - name: Cache harness fixtures and the llama.cpp build
        uses: actions/cache@v4
        with:
          path: |
            .harness-cache
            ~/.cache/pip
          key: qwen35-harness-${{{{ runner.os }}}}-py3.11-{pin}
      # The harness exactly as `harness init` ran (the commit the committed evidence was made
      # with; no release of qwen35-harness is on the package index yet).
      - name: Install the harness (and this repository's engine)
        run: |
          python -m pip install "{requirement}"
          # python -m pip install -e .   # when the engine is this repository's Python package
      - name: Parity and probe cells
        run: pytest -m parity --harness-record
      - name: Contract evidence is current (STALE after a harness upgrade changed a contract)
        run: harness status --check
      - name: Keep the evidence
        if: always()
        uses: actions/upload-artifact@v4
        with:
          name: qwen35-harness-evidence
          path: |
            evidence/
            LEDGER.md
'''


@dataclass
class Planned:
    """One file ``harness init`` writes: its path (relative to the root) and full new content."""

    path: Path
    text: str
    exists: bool


def _without_harness_tables(text: str) -> str:
    """``text`` with every ``[tool.harness]`` / ``[tool.harness.*]`` table (header to the next
    header) and the comment line ``harness init`` puts above them removed."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line.rstrip("\r\n") == MARKER:
            continue
        if _HARNESS_HEADER.match(line):
            skipping = True
            continue
        if skipping and _ANY_HEADER.match(line):
            skipping = False
        if not skipping:
            out.append(line)
    return "".join(out)


def _parse(path: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(f"{path}: invalid TOML ({e}); fix it before harness init") from None


def _pyproject(root: Path, engine: str, force: bool) -> tuple[Planned, bool]:
    """The planned pyproject.toml and whether it conflicts (already has ``[tool.harness]``)."""
    path = root / PYPROJECT
    table = harness_table(engine)
    if not path.exists():
        return Planned(Path(PYPROJECT), table.lstrip("\n"), False), False
    text = path.read_text(encoding="utf-8")
    data = _parse(path, text)
    has = "harness" in data.get("tool", {})
    if has and not force:
        return Planned(Path(PYPROJECT), text, True), True
    if has:
        stripped = _without_harness_tables(text)
        after = _parse(path, stripped)
        want = {**data, "tool": {k: v for k, v in data["tool"].items() if k != "harness"}}
        if not want["tool"]:
            del want["tool"]
        if after != want:
            raise InvalidInput(f"{path}: [tool.harness] is not written as [tool.harness] tables alone; edit it by hand")
        text = stripped.rstrip() + "\n" if stripped.strip() else ""
    new = text + ("" if text.endswith("\n") or not text else "\n") + table
    if _parse(path, new).get("tool", {}).get("harness", {}).get("candidate") != f"command:{engine}":
        raise InvalidInput(f"{path}: appending [tool.harness] would not parse as intended; edit it by hand")
    return Planned(Path(PYPROJECT), new, True), has


def plan(root: Path, engine: str, version: str, force: bool = False, requirement: str | None = None) -> tuple[list[Planned], list[str]]:
    """The files ``harness init`` would write and the conflicts (existing files, or an existing
    ``[tool.harness]``) it would refuse on without ``force``. Raises ``InvalidInput`` for a bad
    engine name or an unreadable pyproject.toml."""
    from harness.evidence.ledger import render_markdown

    if not ENGINE_NAME_RE.match(engine):
        raise InvalidInput(f"engine name {engine!r}: use letters, digits, '_', '.', '-' (at most 64)")
    py, py_conflict = _pyproject(root, engine, force)
    files = [py]
    for rel, text in ((TEST_MODULE, TEST_MODULE_TEXT), (WORKFLOW, workflow_text(version, requirement)), (LEDGER, ""),
                      (LEDGER_MD, render_markdown([], root / LEDGER, root / LEDGER_MD))):
        files.append(Planned(rel, text, (root / rel).exists()))
    conflicts = [f"{PYPROJECT} [tool.harness]"] if py_conflict else []
    conflicts += [f.path.as_posix() for f in files[1:] if f.exists]
    return files, conflicts


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def init_project(root: Path, engine: str = "mine", version: str = "0+unknown", force: bool = False,
                 requirement: str | None = None) -> list[Path]:
    """Write the files of ``plan`` into ``root`` (the workflow installing ``requirement``:
    ``harness_requirement``); returns their paths.

    Raises ``InvalidInput`` (exit 2) listing every existing file (and an existing
    ``[tool.harness]``) before anything is written, unless ``force``.
    """
    files, conflicts = plan(root, engine, version, force, requirement)
    if conflicts and not force:
        raise InvalidInput(f"refusing to overwrite: {', '.join(conflicts)} (pass --force to replace them)")
    for f in files:
        _write(root / f.path, f.text)
    return [root / f.path for f in files]
