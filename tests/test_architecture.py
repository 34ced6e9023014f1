"""Dependencies point down: which harness module may import which.

Every ``import`` of a harness module counts, at the top of a file or deferred inside a function
(a deferred import is still a dependency). The layers, lowest first:

* base: ``errors``, ``paths``, ``config``, ``provenance`` (sha256, git state), ``validation``
  (JSON Schema), ``yamlnodes``, ``display`` (escaping untrusted text), ``fschecks`` (can a path
  be written), ``rundir`` (the per-run temporary folder): import only each other;
* ``model`` (GGUF reading, hyperparameters, lint): base only; it knows nothing of fixtures,
  engines, comparisons, gates, evidence or contracts;
* ``engines`` (protocol, oracle, mutants, llama.cpp, command, transformers, registry): base and
  model;
* ``fixtures`` (synthetic, defects, convert, training, resolve): base and model;
* ``evidence`` (receipts, ledger, report, record): base only, so a record can be read without
  running anything;
* ``gates.thresholds`` and ``gates.tiers`` (the gate data: rows, subjects): base only;
  ``compare`` (inputs, prompts, metrics, parity, probes, localize, verdicts, calibrated):
  everything above plus thresholds and evidence; ``gates.calibrate`` and ``gates.subject``
  (measuring the calibrated tier, recording it as evidence): compare, evidence and everything
  below them;
* ``contracts`` (loader, discharge): base, model, engines, fixtures; discharge runs the bound
  tests in pytest subprocesses rather than importing them;
* ``release`` (manifests, ``harness signoff``, ``harness sweep``): everything above but the entry
  points (it judges contracts' records, runs compare's cells and writes evidence);
* ``conformance`` (the shipped parity and probe cells, pytest tests a repository collects):
  base and compare; ``scaffold`` (``harness init``'s files): base and evidence (the empty ledger);
* entry points: ``pytest_plugin`` (engines and fixtures, deferred: it loads in every pytest
  process; it names the conformance module's file but does not import it) and ``cli`` (anything
  but the plugin); nothing imports either.

Three edges cross a layer on purpose, each listed in ``CROSSINGS`` with its reason. And the
module graph has no cycle, so no import order can half-initialise a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "harness"
BASE = {"harness.errors", "harness.paths", "harness.config", "harness.provenance", "harness.validation", "harness.yamlnodes",
        "harness.display", "harness.fschecks", "harness.rundir"}

ALLOWED: dict[str, set[str]] = {
    "base": {"base"},
    "model": {"base", "model"},
    "engines": {"base", "model", "engines"},
    "fixtures": {"base", "model", "fixtures"},
    "evidence": {"base", "evidence"},
    "thresholds": {"base", "thresholds"},
    "compare": {"base", "model", "engines", "fixtures", "evidence", "thresholds", "compare"},
    "calibrate": {"base", "model", "engines", "fixtures", "thresholds", "compare", "evidence", "calibrate"},
    "contracts": {"base", "model", "engines", "fixtures", "contracts"},
    "release": {"base", "model", "engines", "fixtures", "evidence", "thresholds", "compare", "calibrate", "contracts", "release"},
    "conformance": {"base", "compare"},
    "scaffold": {"base", "evidence"},
    "pytest_plugin": {"base", "engines", "fixtures"},
    "cli": {"base", "model", "engines", "fixtures", "evidence", "thresholds", "compare", "calibrate", "contracts", "scaffold", "release"},
    "main": {"cli"},
}
"""Layer → the layers its modules may import."""

CROSSINGS: dict[tuple[str, str], str] = {
    ("harness.engines.transformers_engine", "harness.fixtures.convert"):
        "the transformers engine builds its model from the GGUF with the converter (the HF boundary)",
    ("harness.fixtures.training", "harness.engines.llamacpp"):
        "the training corpus is tokenized by llama.cpp, so a trained model sees the reference's token ids",
    ("harness.fixtures.synthetic", "harness.compare.prompts"):
        "the fixtures' BPE merges are learned from the shipped prompt texts",
}
"""(importer, imported) edges allowed across the layers, with the reason."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    """The layer of a harness module (see the module docstring)."""
    if module in BASE or module == "harness":
        return "base"
    special = {"harness.gates": "thresholds", "harness.gates.thresholds": "thresholds", "harness.gates.tiers": "thresholds",
               "harness.gates.calibrate": "calibrate", "harness.gates.subject": "calibrate",
               "harness.pytest_plugin": "pytest_plugin", "harness.cli": "cli", "harness.__main__": "main",
               "harness.conformance": "conformance", "harness.scaffold": "scaffold"}
    if module in special:
        return special[module]
    top = module.split(".")[1]
    assert top in ALLOWED, f"{module}: no layer; add it to tests/test_architecture.py"
    return top


def imports(module: str, source: str | None = None) -> set[str]:
    """Every harness module ``module`` imports, anywhere in its file (or in ``source``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in MODULES and m != module}


GRAPH = {m: imports(m) for m in MODULES}


def test_cli_imports_nothing_from_the_pytest_plugin():
    assert "harness.pytest_plugin" not in GRAPH["harness.cli"]
    assert not [m for m, deps in GRAPH.items() if "harness.pytest_plugin" in deps], "nothing imports the pytest plugin"


ABOVE_ALL = ("harness.compare", "harness.gates", "harness.evidence", "harness.contracts", "harness.conformance", "harness.scaffold",
             "harness.release", "harness.cli", "harness.pytest_plugin")


@pytest.mark.parametrize("lower, above", [("model", ABOVE_ALL + ("harness.engines", "harness.fixtures")), ("engines", ABOVE_ALL)])
def test_model_and_engines_import_nothing_above_them(lower, above):
    bad = [(m, d) for m, deps in GRAPH.items() if layer(m) == lower for d in deps if d.startswith(above)]
    assert not bad, f"{lower} imports from a layer above it: {bad}"


def test_every_import_points_down_or_is_a_listed_crossing():
    bad = [f"{m} -> {d} ({layer(m)} may import {sorted(ALLOWED[layer(m)])}, not {layer(d)})"
           for m, deps in sorted(GRAPH.items()) for d in sorted(deps)
           if layer(d) not in ALLOWED[layer(m)] and (m, d) not in CROSSINGS]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
    unused = [edge for edge in CROSSINGS if edge[1] not in GRAPH.get(edge[0], set())]
    assert not unused, f"listed crossings no module makes any more (remove them): {unused}"


def test_the_module_graph_has_no_cycle():
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_the_import_reader_sees_deferred_and_relative_imports():
    """A check that cannot fail tells nothing: an engine module importing the plugin inside a
    function, and the registry relatively, is read as importing both, and breaks the layering."""
    src = "def f():\n    from harness.pytest_plugin import candidate_names\n    from . import registry\n    import harness.compare.metrics\n"
    found = imports("harness.engines.base", src)
    assert found == {"harness.pytest_plugin", "harness.engines.registry", "harness.compare.metrics"}
    assert {layer(d) for d in found} - ALLOWED[layer("harness.engines.base")] == {"pytest_plugin", "compare"}
