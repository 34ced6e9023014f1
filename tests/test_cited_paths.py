"""Every repository path the documentation cites resolves, and nothing cites a file outside it.

What is scanned (the text a user reads):

- ``README.md`` and ``docs/*.md``: all of it;
- ``contracts/*.yaml``: all of it (``references``, ``source``, descriptions, tests);
- ``thresholds.yaml`` and ``harness/schemas/*.json``: all of it;
- Python under ``harness/``, ``tests/``, ``benchmarks/``, ``examples/``: docstrings (module, class,
  function) and ``#`` comments, not other string literals (tests build paths that must not exist).

What counts as a cited repository path (``cited_paths``): a run of path characters
``[A-Za-z0-9_.-/]`` that

- starts with a top-level directory of the repository (``harness/``, ``tests/``, ``docs/``,
  ``contracts/``, ``evidence/``, ``benchmarks/``, ``examples/``, ``.ci/``) and has at least one
  more component, or
- is a bare file name of the kinds the docs cite by name alone (``*.md``, ``*.yaml``,
  ``*.toml``), e.g. ``README.md``, ``thresholds.yaml``, ``engine-protocol.md`` — so a design
  document that is not in the repository is caught even when cited without a folder;

and is not a template: no ``<``, ``{``, ``*``, ``…`` or ``...`` next to it, and no component whose
stem is an upper-case placeholder (``NAME``, ``X``, ``ID``). A path preceded by another path
component (``vendor/llama.cpp/src/...``) or by ``.`` or ``/`` belongs to another tree and is not
ours, and so does one with a ``..`` component. Trailing sentence punctuation is dropped;
``file.py::test`` and ``file.py:123`` cite ``file.py``. A path with folders resolves when a file
or directory of that name exists in the checkout; a bare name resolves when it exists beside the
citing file (a relative Markdown link) or is the name of some file in the repository. Two kinds of
paths live elsewhere and are resolved where they live, each from its one statement in the code:

- in the installed wheel, ``harness/suite/...`` is a checkout folder mapped there by
  ``[tool.setuptools.package-dir]`` of pyproject.toml: it resolves when the mapped path exists;
- in an engine's repository, the files ``harness init`` writes (``harness.scaffold``:
  ``TEST_MODULE``, ``WORKFLOW``, ``LEDGER``, ``LEDGER_MD``) are cited by their path there.

A folder outside the repository that users never have (``OUTSIDE``, the sibling folder the
design notes were first written in) may not be cited anywhere in tracked text.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
import tomllib
from pathlib import Path

import pytest

from harness import scaffold

ROOT = Path(__file__).resolve().parents[1]
TOP_DIRS = ("harness", "tests", "docs", "contracts", "evidence", "benchmarks", "examples", ".ci")
BARE_SUFFIXES = (".md", ".yaml", ".toml")
OUTSIDE = "../" + "shared"  # spelled in two pieces so this file does not cite it
# Files that still cite OUTSIDE and are owned by another change; each must still cite it (so the
# exemption is removed as soon as it is fixed). The oracle is issue 15's to edit.
PENDING_OUTSIDE: dict[str, str] = {}

_PATH = re.compile(r"[A-Za-z0-9_./-]+")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
_TEMPLATE_NEIGHBOURS = ("<", "{", "*", "…")


def cited_paths(text: str) -> list[str]:
    """The repository paths ``text`` cites, in order (see the module docstring for the rules)."""
    out = []
    for m in _PATH.finditer(text):
        raw = m.group()
        near = text[max(m.start() - 1, 0) : m.start()] + text[m.end() : m.end() + 1]
        if "..." in raw or any(c in near for c in _TEMPLATE_NEIGHBOURS):
            continue
        token = raw.rstrip(".,;:").rstrip("/")
        parts = token.split("/")
        if ".." in parts:
            continue
        if len(parts) >= 2 and parts[0] in TOP_DIRS and all(parts):
            if not any(_PLACEHOLDER.match(p.split(".")[0]) for p in parts[1:]):
                out.append(token)
        elif len(parts) == 1 and token.endswith(BARE_SUFFIXES) and not token.startswith("."):
            out.append(token)
    return out


def _python_prose(path: Path) -> str:
    """Docstrings and comments of one Python file, joined by newlines."""
    src = path.read_text(encoding="utf-8")
    chunks = []
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                chunks.append(doc)
        # attribute docstrings: a string expression right after an assignment
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for prev, stmt in zip(body, body[1:]):
                if isinstance(prev, (ast.Assign, ast.AnnAssign)) and isinstance(stmt, ast.Expr) and isinstance(getattr(stmt, "value", None), ast.Constant) and isinstance(stmt.value.value, str):
                    chunks.append(stmt.value.value)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            chunks.append(tok.string)
    return "\n".join(chunks)


def documentation() -> dict[str, str]:
    """Relative path → the text of it that documents (module docstring: what is scanned)."""
    files: dict[str, str] = {}
    for p in [ROOT / "README.md", ROOT / "thresholds.yaml", *sorted((ROOT / "docs").glob("*.md")),
              *sorted((ROOT / "contracts").glob("*.yaml")), *sorted((ROOT / "harness" / "schemas").glob("*.json"))]:
        files[p.relative_to(ROOT).as_posix()] = p.read_text(encoding="utf-8")
    for top in ("harness", "tests", "benchmarks", "examples"):
        for p in sorted((ROOT / top).rglob("*.py")):
            files[p.relative_to(ROOT).as_posix()] = _python_prose(p)
    return files


def test_paths_that_live_elsewhere_resolve_where_they_live():
    assert resolves("harness/suite/thresholds.yaml", "README.md", set())  # the wheel's copy of ./thresholds.yaml
    assert resolves("harness/suite/contracts/qwen35-shapes-v1.yaml", "README.md", set())
    assert not resolves("harness/suite/contracts/no-such-v1.yaml", "README.md", set())
    assert resolves(scaffold.TEST_MODULE.as_posix(), "README.md", set())  # written by harness init
    assert not resolves("tests/test_qwen35_parity_renamed.py", "README.md", set())


def test_the_path_rules_on_examples():
    text = (
        "see harness/runs/parity.py run_cell and `docs/design.md`, tests/contracts/test_e2e.py::test_logit_parity, "
        "harness/model/lint.py:13 and thresholds.yaml. Also DESIGN.md. Templates: evidence/parity/receipts/<id>.json, "
        "contracts/X.yaml, harness/data/fixtures/NAME.recipe.json, tests/... and harness/{a,b}.py. Not ours: "
        "vendor/llama.cpp/src/models/qwen35.cpp, src/models/qwen35.cpp, ./harness/x.py, /tmp/harness/y.py, "
        "models/qwen3_5/modeling_qwen3_5.py, harness.runs.parity, the harness/ package, tests/../x.py."
    )
    assert cited_paths(text) == [
        "harness/runs/parity.py", "docs/design.md", "tests/contracts/test_e2e.py", "harness/model/lint.py",
        "thresholds.yaml", "DESIGN.md",
    ]


def test_the_scan_sees_the_citations_it_must_check():
    """Not vacuous: the scan finds the citations we know are there, in every kind of file."""
    docs = documentation()
    found = {f: set(cited_paths(t)) for f, t in docs.items()}
    assert "docs/design.md" in found["README.md"]
    assert "docs/qwen35-gguf-math.md" in found["contracts/qwen35-shapes-v1.yaml"]
    assert "harness/runs/parity.py" in found["contracts/qwen35-e2e-verification-v1.yaml"]
    assert "docs/engine-protocol.md" in found["harness/config.py"]
    assert "harness/schemas/thresholds.schema.json" in found["thresholds.yaml"]
    assert sum(len(v) for v in found.values()) > 100


def _wheel_folders() -> dict[str, str]:
    """``[tool.setuptools.package-dir]``: a package folder of the wheel → the checkout folder it is
    built from (``harness/suite`` → ``.``)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {pkg.replace(".", "/"): folder for pkg, folder in dirs.items()}


ENGINE_REPO_FILES = {Path(p).as_posix() for p in (scaffold.TEST_MODULE, scaffold.WORKFLOW, scaffold.LEDGER, scaffold.LEDGER_MD)}
"""What ``harness init`` writes into an engine's repository, cited by its path there."""


def resolves(path: str, cited_in: str, names: set[str]) -> bool:
    """Whether ``path``, cited in the file ``cited_in``, exists (module docstring: the rules)."""
    if path in ENGINE_REPO_FILES:
        return True
    if "/" not in path:
        return (ROOT / cited_in).parent.joinpath(path).exists() or path in names
    for pkg, folder in sorted(_wheel_folders().items(), key=lambda kv: -len(kv[0])):
        if path == pkg or path.startswith(pkg + "/"):
            return (ROOT / folder / path[len(pkg):].lstrip("/")).exists()
    return (ROOT / path).exists()


def _repo_file_names() -> set[str]:
    return {p.name for top in (ROOT, *(ROOT / d for d in TOP_DIRS)) if top.is_dir()
            for p in (top.iterdir() if top == ROOT else top.rglob("*")) if p.is_file()}


def test_every_cited_path_resolves():
    names = _repo_file_names()
    missing = sorted({(f, p) for f, t in documentation().items() for p in cited_paths(t) if not resolves(p, f, names)})
    assert not missing, "cited paths that do not exist in the repository: " + "; ".join(f"{f} cites {p}" for f, p in missing)


def _tracked_text_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed (run from a clone)")
    out = []
    for n in names:
        p = ROOT / n
        if p.is_file() and p.suffix not in (".gguf", ".npz", ".png", ".npy"):
            out.append(p)
    return out


def test_nothing_cites_files_outside_the_repository():
    citing = {}
    for p in _tracked_text_files():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if OUTSIDE in text:
            citing[p.relative_to(ROOT).as_posix()] = [i + 1 for i, line in enumerate(text.splitlines()) if OUTSIDE in line]
    stale_exemptions = sorted(set(PENDING_OUTSIDE) - set(citing))
    assert not stale_exemptions, f"no longer cite {OUTSIDE}: remove from PENDING_OUTSIDE: {stale_exemptions}"
    offending = {f: lines for f, lines in citing.items() if f not in PENDING_OUTSIDE}
    assert not offending, f"cite {OUTSIDE} (users' checkouts do not have it; cite docs/ instead): " + "; ".join(
        f"{f} line {', '.join(map(str, ls))}" for f, ls in sorted(offending.items()))
