"""Contracts: YAML files of equations and obligations, validated and bound to pytest tests.

A contract (``contracts/<id>.yaml``, schema ``harness/schemas/contract.schema.json``) states the
math of one concern as equations, each tied to the oracle function that implements it, and a list
of obligations. An obligation has a stable id, a kind, the property in words, a formal statement,
an optional tolerance, its source, the pytest tests that check it (``tests/...py::test_name``),
how RED is shown (``red``: ``mutant: NAME``, ``fixture: NAME`` or ``planted: NAME``) and the
likely cause when it fails (``if_fails``).

Validation (``load_contracts`` / ``validate``) is fail-closed; every error names the file, the
line and the field (lines come from the YAML node marks of ``yaml.compose``):

* YAML syntax, duplicate keys, the JSON Schema;
* ``id`` equals the file name; contract ids and obligation ids are unique across all contracts;
  ``depends_on`` names existing contracts, without cycles; an obligation's ``equation`` names one of its
  contract's equations;
* every equation's ``oracle`` resolves to an attribute (``harness.engines.oracle.qwen35.gdn_gate``);
* every ``red`` names a known mutant (``harness.engines.mutants.MUTANTS``), plant (``PLANTS``) or
  fixture (``harness.fixtures.synthetic`` or the defective fixtures of ``harness.fixtures.defects``);
* every test exists: pytest collects the cited files in a subprocess (once per process and file
  set) and each cited ``file::function`` must be a collected test marked ``contract``.

Tests read an obligation's tolerance from its contract with ``obligation_tolerance``, so a
contract's numbers and its tests cannot drift apart.
"""

from __future__ import annotations

import graphlib
import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import yaml

from harness.contracts import suite
from harness.engines.mutants import ALL_MUTANTS, PLANTS
from harness.errors import InvalidInput
from harness.fixtures.resolve import fixture_names
from harness.paths import SCHEMA_DIR
from harness.provenance import sha256_bytes
from harness.rundir import scratch_dir
from harness.validation import schema_validator
from harness.yamlnodes import duplicate_keys, line_of, load_bounded

if TYPE_CHECKING:
    import jsonschema

SCHEMA_PATH = SCHEMA_DIR / "contract.schema.json"
CONTRACT_MARKER = "contract"


@dataclass(frozen=True)
class Red:
    """How RED is shown: ``kind`` is ``mutant``, ``fixture`` or ``planted``; ``name`` its name."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class Obligation:
    """One obligation of a contract (fields as in the schema); ``model`` is resolved (the
    obligation's own or the contract's); ``line`` is where it starts in the file."""

    id: str
    kind: str
    property: str
    formal: str
    source: str
    tests: tuple[str, ...]
    reds: tuple[Red, ...]
    if_fails: str
    model: str
    contract_id: str
    line: int
    tolerance: dict[str, Any] | None = None
    equation: str | None = None
    data: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def sha256(self) -> str:
        """sha256 of the obligation's canonical JSON (its text, tests, red and tolerance)."""
        return sha256_bytes(json.dumps(self.data, sort_keys=True).encode())


@dataclass(frozen=True)
class Contract:
    """A loaded, schema-valid contract file."""

    id: str
    version: str
    path: Path
    sha256: str
    subject: str
    model: str
    data: dict[str, Any] = field(repr=False)
    obligations: tuple[Obligation, ...] = ()

    @property
    def root(self) -> Path:
        """The repository the contract lives in (the parent of its ``contracts/`` folder); test
        node ids are relative to it."""
        return self.path.resolve().parent.parent

    def obligation(self, oid: str) -> Obligation:
        """The obligation ``oid``; raises ``InvalidInput`` naming the known ids."""
        for ob in self.obligations:
            if ob.id == oid:
                return ob
        raise InvalidInput(f"{self.path}: no obligation {oid!r}; known: {', '.join(o.id for o in self.obligations)}")


@dataclass
class ContractError:
    """One validation error: file, 1-based line, dotted field path, message."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.message}"


class ContractsInvalid(InvalidInput):
    """One or more contracts are invalid (exit 2); ``errors`` lists every ``ContractError``."""

    def __init__(self, errors: list[ContractError]):
        self.errors = errors
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"{errors[0]}{more}")


# ---------------------------------------------------------------------------------------------
# YAML with line numbers
# ---------------------------------------------------------------------------------------------


def _dotted(keys: Sequence[Any]) -> str:
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "(top level)"


def _schema_message(e: jsonschema.ValidationError) -> str:
    if e.validator == "oneOf" and list(e.absolute_path)[-1:] == ["red"]:
        return "red must be one of {mutant: NAME}, {fixture: NAME}, {planted: NAME}, or a list of them"
    if e.validator == "additionalProperties":
        return e.message.replace("Additional properties are not allowed", "unknown field(s)")
    return e.message


def _read(path: Path) -> tuple[dict[str, Any] | None, yaml.Node | None, bytes, list[ContractError]]:
    """Parse one file; returns (data, node tree, raw bytes, errors)."""
    p = str(path)
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return None, None, b"", [ContractError(p, 1, "(file)", f"cannot read contract: {e}")]
    try:
        root, data = load_bounded(path, text, "a contract")  # alias bombs, recursive aliases, deep nesting: refused before any walk
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        return None, None, raw, [ContractError(p, (mark.line + 1) if mark else 1, "(yaml)", f"YAML syntax error: {getattr(e, 'problem', None) or e}")]
    except InvalidInput as e:
        return None, None, raw, [ContractError(p, 1, "(yaml)", str(e).split(": ", 1)[-1])]
    errors = [ContractError(p, line, _dotted(keys), f"duplicate key (first at line {first}); YAML would keep only the last")
              for keys, line, first in duplicate_keys(root)]
    if not isinstance(data, dict):
        errors.append(ContractError(p, 1, "(top level)", "a contract is a YAML mapping"))
        return None, root, raw, errors
    for e in sorted(schema_validator(SCHEMA_PATH.name).iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        keys = list(e.absolute_path)
        if e.validator == "required":  # point at the object, name the missing field
            missing = e.message.split("'")[1] if "'" in e.message else "?"
            errors.append(ContractError(p, line_of(root, keys), _dotted(keys + [missing]), "required field missing"))
        else:
            errors.append(ContractError(p, line_of(root, keys), _dotted(keys), _schema_message(e)))
    return data, root, raw, errors


def _as_reds(red: Any) -> tuple[Red, ...]:
    items = red if isinstance(red, list) else [red]
    return tuple(Red(k, v) for item in items for k, v in item.items())


def _build(path: Path, data: dict[str, Any], root: yaml.Node | None, raw: bytes) -> Contract:
    obligations = []
    for i, ob in enumerate(data["obligations"]):
        obligations.append(
            Obligation(
                id=ob["id"], kind=ob["kind"], property=ob["property"], formal=ob["formal"], source=ob["source"],
                tests=tuple(ob["tests"]), reds=_as_reds(ob["red"]), if_fails=ob["if_fails"],
                model=ob.get("model", data["model"]), contract_id=data["id"], line=line_of(root, ["obligations", i]),
                tolerance=ob.get("tolerance"), equation=ob.get("equation"), data=ob,
            )
        )
    return Contract(
        id=data["id"], version=data["version"], path=path, sha256=sha256_bytes(raw),
        subject=data["subject"], model=data["model"], data=data, obligations=tuple(obligations),
    )


# ---------------------------------------------------------------------------------------------
# Semantic checks
# ---------------------------------------------------------------------------------------------


def resolve_attribute(dotted: str) -> Any:
    """Import the longest module prefix of ``dotted`` and follow the rest as attributes.

    Raises ``LookupError`` naming the missing part.
    """
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                raise LookupError(f"{'.'.join(parts[:j])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"no module of {dotted!r} can be imported")


def known_red_names() -> dict[str, set[str]]:
    """The names each kind of ``red`` accepts: mutants, plants, fixtures (incl. defects)."""
    return {"mutant": set(ALL_MUTANTS), "planted": set(PLANTS), "fixture": set(fixture_names())}


def _semantic_errors(c: Contract, root: yaml.Node | None, names: dict[str, set[str]]) -> list[ContractError]:
    p, errors = str(c.path), []
    if c.id != c.path.stem:
        errors.append(ContractError(p, line_of(root, ["id"]), "id", f"contract id {c.id!r} must equal the file name {c.path.stem!r}"))
    for name, eq in c.data["equations"].items():
        try:
            obj = resolve_attribute(eq["oracle"])
            if not callable(obj) and not isinstance(obj, property):
                raise LookupError(f"{eq['oracle']} is not a function")
        except LookupError as e:
            errors.append(ContractError(p, line_of(root, ["equations", name, "oracle"]), f"equations.{name}.oracle", f"{e}"))
    models = [(["model"], c.data["model"])]
    models += [(["obligations", i, "model"], ob["model"]) for i, ob in enumerate(c.data["obligations"]) if "model" in ob]
    for keys, spec in models:
        if spec.removeprefix("fixture:") not in names["fixture"]:
            errors.append(ContractError(p, line_of(root, keys), _dotted(keys), f"unknown model {spec!r}"))
    seen: dict[str, int] = {}
    for i, ob in enumerate(c.obligations):
        if ob.id in seen:
            errors.append(ContractError(p, ob.line, f"obligations[{i}].id", f"duplicate obligation id {ob.id} (first at line {seen[ob.id]})"))
        seen[ob.id] = ob.line
        if ob.equation is not None and ob.equation not in c.data["equations"]:
            errors.append(ContractError(p, line_of(root, ["obligations", i, "equation"]), f"obligations[{i}].equation",
                                        f"unknown equation {ob.equation!r}; this contract defines {', '.join(c.data['equations'])}"))
        for j, red in enumerate(ob.reds):
            if red.name not in names[red.kind]:
                keys = ["obligations", i, "red"] + ([j] if isinstance(ob.data["red"], list) else []) + [red.kind]
                errors.append(ContractError(p, line_of(root, keys), _dotted(keys),
                                            f"unknown {red.kind} {red.name!r}; known: {', '.join(sorted(names[red.kind]))}"))
    return errors


# ---------------------------------------------------------------------------------------------
# Test binding: pytest collection in a subprocess
# ---------------------------------------------------------------------------------------------

_COLLECTED: dict[tuple, dict[str, list[str]]] = {}


PYTEST_CONFIG_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def pytest_command(root: Path, args: Sequence[str], config: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The ``python -m pytest`` command and environment the harness runs tests with: only this
    harness's plugin (``-p harness.pytest_plugin``, autoload off, its shipped parity cells off),
    no cache, the project's ``addopts`` cleared so marker selections do not hide tests, run from
    ``root``. A ``root`` without a pytest configuration of its own (the suite installed in
    site-packages) runs with none (``-c os.devnull``) and no conftest above it, so the settings of
    whatever repository the virtual environment sits in (``filterwarnings = error``, conftests)
    cannot change the suite's outcomes. ``config``: the project's harness configuration file,
    passed as ``$HARNESS_CONFIG`` (its command engines, relative to its folder). NumPy's BLAS
    runs single-threaded unless the caller says otherwise: the oracle's matrices are small, and
    threaded OpenBLAS made them 5× slower (its partitioning does not change the sums)."""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    if config is not None and "HARNESS_CONFIG" not in os.environ:
        env["HARNESS_CONFIG"] = str(config)
    isolate = [] if any((root / f).is_file() for f in PYTEST_CONFIG_FILES) else ["-c", os.devnull, "--confcutdir", str(root)]
    cmd = [sys.executable, "-m", "pytest", "-p", "harness.pytest_plugin", "-p", "no:cacheprovider", "-o", "addopts=", *isolate,
           "--rootdir", str(root), "--no-harness", *args]
    return cmd, env


def collect_tests(root: Path, files: Iterable[str]) -> dict[str, list[str]]:
    """``{file::function: markers}`` of every test pytest collects from ``files`` (paths
    relative to ``root``), parametrizations folded into their function. Cached per process for
    the same files and modification times. Raises ``InvalidInput`` when collection fails."""
    files = sorted(set(files))
    stamps = tuple((f, (root / f).stat().st_mtime_ns if (root / f).exists() else None) for f in files)
    key = (str(root.resolve()), stamps)
    if key in _COLLECTED:
        return _COLLECTED[key]
    existing = [f for f in files if (root / f).exists()]
    found: dict[str, list[str]] = {}
    if existing:
        with scratch_dir("collect-") as d:
            out = d / "collected.json"
            cmd, env = pytest_command(root, ["--collect-only", "-q", "--harness-outcomes", str(out), *existing])
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
            if not out.exists():
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
                raise InvalidInput(f"pytest could not collect {', '.join(existing)} (exit {proc.returncode}):\n{tail}")
            for item in json.loads(out.read_text())["collected"]:
                found.setdefault(item["function"], sorted(set(found.get(item["function"], [])) | set(item["markers"])))
            if proc.returncode not in (0, 5):
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
                raise InvalidInput(f"pytest collection errors in {', '.join(existing)} (exit {proc.returncode}):\n{tail}")
    _COLLECTED[key] = found
    return found


def _binding_errors(contracts: Sequence[Contract], roots: dict[str, yaml.Node | None]) -> list[ContractError]:
    errors = []
    by_root: dict[Path, list[Contract]] = {}
    for c in contracts:
        by_root.setdefault(c.root, []).append(c)
    for root, cs in by_root.items():
        files = {f for c in cs for ob in c.obligations for t in ob.tests
                 if (root / (f := t.split("::", 1)[0])).resolve().is_relative_to(root.resolve())}  # never collect outside the repo
        try:
            found = collect_tests(root, files)
        except InvalidInput as e:
            c = cs[0]
            return [ContractError(str(c.path), 1, "obligations.tests", str(e))]
        for c in cs:
            for i, ob in enumerate(c.obligations):
                for j, t in enumerate(ob.tests):
                    line = line_of(roots[str(c.path)], ["obligations", i, "tests", j])
                    where = f"obligations[{i}].tests[{j}]"
                    target = (root / t.split("::", 1)[0]).resolve()
                    if not target.is_relative_to(root.resolve()):
                        errors.append(ContractError(str(c.path), line, where, f"{ob.id}: test path {t} points outside the repository"))
                    elif not (root / t.split("::", 1)[0]).exists():
                        errors.append(ContractError(str(c.path), line, where, f"{ob.id}: test file of {t} does not exist"))
                    elif t not in found:
                        errors.append(ContractError(str(c.path), line, where, f"{ob.id}: pytest collects no test {t}"))
                    elif CONTRACT_MARKER not in found[t]:
                        errors.append(ContractError(str(c.path), line, where, f"{ob.id}: {t} is not marked @pytest.mark.{CONTRACT_MARKER}"))
    return errors


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def contract_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Contract files named by ``paths``: files, folders whose ``*.yaml`` are taken, or contract
    ids (the project's ``contracts/<id>.yaml``, else the shipped one: ``harness.contracts.suite``).

    Raises ``InvalidInput`` for a path that does not exist and is no id, or a folder with no contracts.
    """
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.yaml")) + sorted(p.glob("*.yml"))
            if not found:
                raise InvalidInput(f"{p}: no contract files (*.yaml)")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            found = suite.resolve_contract(p)
            if found is None:
                raise InvalidInput(suite.unknown_contract_message(p))
            out.append(found)
    return out


def _cycle_errors(contracts: Sequence[Contract], roots: dict[str, yaml.Node | None]) -> list[ContractError]:
    """One error for a ``depends_on`` cycle (``graphlib``), at the first contract of the cycle:
    a contract cannot rest on itself, directly or through others."""
    graph = {c.id: [d for d in c.data.get("depends_on", []) if isinstance(d, str)] for c in contracts}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        cycle = list(reversed(e.args[1]))  # graphlib lists predecessors first; a -> b here: a depends on b
        first = next(c for c in contracts if c.id == cycle[0])
        deps = first.data.get("depends_on", [])
        i = deps.index(cycle[1]) if cycle[1] in deps else 0
        return [ContractError(str(first.path), line_of(roots[str(first.path)], ["depends_on", i]), f"depends_on[{i}]",
                              f"depends_on cycle: {' -> '.join(cycle)}")]
    return []


def load_contracts(paths: Iterable[str | os.PathLike], check_tests: bool = True) -> list[Contract]:
    """Load and validate contracts (files or folders).

    Sibling contracts in the same folder are loaded too, so ids are checked unique across all
    of them and ``depends_on`` can be resolved, but only the named ones are returned; a
    ``depends_on`` none of them satisfies is looked up among the shipped contracts (a project's
    own contracts may depend on the suite's). With
    ``check_tests`` every cited test must be collected by pytest and marked ``contract``.
    Raises ``ContractsInvalid`` (exit 2) listing every error with file, line and field.
    """
    named = [p.resolve() for p in contract_files(paths)]
    universe = list(dict.fromkeys(named + [s.resolve() for p in named for s in sorted(p.parent.glob("*.yaml"))]))
    errors: list[ContractError] = []
    contracts: list[Contract] = []
    roots: dict[str, yaml.Node | None] = {}
    names = known_red_names()
    shipped = suite.shipped_contracts()
    attempted: set[Path] = set()
    while universe:
        attempted.update(universe)
        for path in universe:
            data, root, raw, errs = _read(path)
            errors += errs
            if data is None or errs:
                continue
            c = _build(path, data, root, raw)
            roots[str(path)] = root
            errors += _semantic_errors(c, root, names)
            contracts.append(c)
        # a dependency that is none of these is looked up in the shipped suite (and its own, in turn)
        have = {c.id for c in contracts}
        universe = sorted({shipped[d].resolve() for c in contracts for d in c.data.get("depends_on", [])
                           if d not in have and d in shipped and shipped[d].resolve() not in attempted})
    ids: dict[str, Path] = {}
    ob_ids: dict[str, tuple[Path, int]] = {}
    for c in contracts:
        if c.id in ids and ids[c.id] != c.path:
            errors.append(ContractError(str(c.path), line_of(roots[str(c.path)], ["id"]), "id", f"contract id {c.id} also used by {ids[c.id]}"))
        ids[c.id] = c.path
        for ob in c.obligations:
            if ob.id in ob_ids and ob_ids[ob.id][0] != c.path:
                other = ob_ids[ob.id]
                errors.append(ContractError(str(c.path), ob.line, "obligations.id", f"obligation id {ob.id} also used in {other[0]}:{other[1]}"))
            ob_ids.setdefault(ob.id, (c.path, ob.line))
    for c in contracts:
        for i, dep in enumerate(c.data.get("depends_on", [])):
            if dep not in ids:
                errors.append(ContractError(str(c.path), line_of(roots[str(c.path)], ["depends_on", i]), f"depends_on[{i}]", f"unknown contract {dep!r}"))
    errors += _cycle_errors(contracts, roots)
    selected = [c for c in contracts if c.path in named]
    if check_tests and not errors:
        errors += _binding_errors(selected, roots)
    if errors:
        raise ContractsInvalid(errors)
    return selected


def load_contract(path: str | os.PathLike, check_tests: bool = True) -> Contract:
    """One contract file (validated with its siblings; see ``load_contracts``)."""
    return load_contracts([path], check_tests)[0]


def obligation_tolerance(root: str | os.PathLike, oid: str) -> dict[str, Any]:
    """The ``tolerance`` of obligation ``oid`` in ``root/contracts/*.yaml`` (schema-validated,
    tests not re-collected). Raises ``InvalidInput`` when the obligation does not exist or has
    no tolerance: a bound test never runs on a made-up number."""
    for c in load_contracts([Path(root) / "contracts"], check_tests=False):
        for ob in c.obligations:
            if ob.id == oid:
                if not ob.tolerance:
                    raise InvalidInput(f"{c.path}:{ob.line}: obligation {oid} has no tolerance")
                return dict(ob.tolerance)
    raise InvalidInput(f"no obligation {oid} in {Path(root) / 'contracts'}")


def summary_rows(contracts: Sequence[Contract]) -> list[dict[str, Any]]:
    """One row per contract for ``harness contracts validate``: id, version, file, equations,
    obligations, bound (with tests), tests cited."""
    return [
        {"id": c.id, "version": c.version, "file": str(c.path), "subject": c.subject, "equations": len(c.data["equations"]),
         "obligations": len(c.obligations), "bound": sum(1 for o in c.obligations if o.tests),
         "tests": len({t for o in c.obligations for t in o.tests})}
        for c in contracts
    ]
