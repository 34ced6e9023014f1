"""Contracts, mutants and the per-activation comparison (harness/contracts/loader.py,
harness/engines/mutants.py, harness.measure.metrics.compare_activations).

The committed contracts validate; a contract citing a test pytest cannot collect is invalid (exit
2) naming file, line and field; schema and cross-contract errors name theirs too; every mutant is
an engine named ``mutant:NAME``; and the mutant × obligation matrix the mutants declare
(``Mutant.breaks``) agrees with the contracts and is what the bound tests observe.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import repo_copy

from harness.cli import main
from harness.measure.metrics import compare_activations
from harness.contracts.loader import ContractsInvalid, load_contracts
from harness.engines.base import gather
from harness.engines.mutants import ALL_MUTANTS, MTP_MUTANTS, MUTANTS, PLANTS, SPEC_MUTANTS, PlantedEngine, load_mutant
from harness.engines.oracle import load_oracle
from harness.engines.registry import known_engine_names, resolve_engine
from harness.errors import InvalidInput
from harness.fixtures import synthetic as fx
from harness.fixtures.resolve import resolve_model

REPO = Path(__file__).resolve().parent.parent
CONTRACTS = REPO / "contracts"
ISSUE_BUG_CLASSES = [
    "attention output gate dropped", "QK-norm skipped", "rope over the full head instead of n_rot",
    "v→k head mapping grouped instead of tiled", "decay computed from ssm_a as if it were A_log", "L2 norm of q/k skipped",
    "conv state dropped between chunks", "recurrent state reset between chunks", "layer schedule off by one",
    "norm +1 applied twice", "final norm's +1 missing", "DeltaNet dt bias dropped", "MoE top-k weights not renormalized",
    "shared-expert gate ignored",
]


ALL = sorted(p.name for p in CONTRACTS.glob("*.yaml"))


def test_committed_contracts_are_valid(capsys):
    assert main(["contracts", "validate", str(CONTRACTS), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = {c["id"] for c in out["contracts"]}
    assert {"qwen35-shapes-v1", "gated-delta-net-v1", "qwen35-hybrid-forward-v1", "qwen35-e2e-verification-v1"} <= ids
    for c in load_contracts([CONTRACTS], check_tests=False):
        assert c.obligations and all(ob.tests and ob.reds and ob.if_fails for ob in c.obligations), c.id


def test_unknown_test_id_is_invalid_exit_2(tmp_path, capsys):
    root = repo_copy(tmp_path, ALL)
    path = root / "contracts" / "gated-delta-net-v1.yaml"
    text = path.read_text()
    path.write_text(text.replace("test_gated_delta_net.py::test_decay_equation]", "test_gated_delta_net.py::test_does_not_exist]"))
    assert main(["contracts", "validate", str(root / "contracts")]) == 2
    err = capsys.readouterr().err
    line = 1 + next(i for i, s in enumerate(path.read_text().splitlines()) if "test_does_not_exist" in s)
    assert f"gated-delta-net-v1.yaml:{line}: obligations[1].tests[0]: GDN-EQ-002: pytest collects no test" in err, err


def test_unmarked_and_missing_file_tests_are_invalid(tmp_path):
    root = repo_copy(tmp_path, ALL)
    (root / "tests" / "contracts" / "test_unmarked.py").write_text("def test_plain():\n    assert True\n")
    path = root / "contracts" / "qwen35-shapes-v1.yaml"
    text = path.read_text().replace("test_qwen35_shapes.py::test_vocab_rows]", "test_unmarked.py::test_plain]")
    path.write_text(text.replace("tests/contracts/test_qwen35_shapes.py::test_storage_types]", "tests/contracts/test_gone.py::test_x]"))
    with pytest.raises(ContractsInvalid) as e:
        load_contracts([root / "contracts"])
    msgs = "\n".join(map(str, e.value.errors))
    assert "Q35S-VOC-012: tests/contracts/test_unmarked.py::test_plain is not marked @pytest.mark.contract" in msgs
    assert "Q35S-TYP-015: test file of tests/contracts/test_gone.py::test_x does not exist" in msgs


def test_schema_and_semantic_errors_name_file_line_field(tmp_path):
    root = repo_copy(tmp_path, ALL)
    path = root / "contracts" / "qwen35-e2e-verification-v1.yaml"
    lines = path.read_text().splitlines()
    lines[1] = 'version: "1.0"'  # not semver
    text = "\n".join(lines) + "\n"
    text = text.replace("red: {mutant: nondeterministic}", "red: {mutant: no-such-mutant}")
    text = text.replace("oracle: harness.measure.metrics.cosine", "oracle: harness.measure.metrics.no_such_function")
    text = text.replace("id: QE2E-EQV-003", "id: GDN-EQ-001")  # duplicate across contracts
    text = text.replace("    if_fails: \"Thread-count", "    iff_fails: \"Thread-count")
    path.write_text(text)
    with pytest.raises(ContractsInvalid) as e:
        load_contracts([root / "contracts"])
    errs = {(Path(x.file).name, x.field): (x.line, x.message) for x in e.value.errors}
    name = "qwen35-e2e-verification-v1.yaml"
    assert errs[(name, "version")][0] == 2 and "does not match" in errs[(name, "version")][1]
    assert (name, "obligations[2].if_fails") in errs and errs[(name, "obligations[2].if_fails")][1] == "required field missing"
    assert "unknown field" in errs[(name, "obligations[2]")][1]
    # the schema errors stop the semantic pass; fix them and the semantic errors show
    path.write_text(text.replace('version: "1.0"\n', "version: 1.0.1\n").replace("iff_fails:", "if_fails:"))
    with pytest.raises(ContractsInvalid) as e:
        load_contracts([root / "contracts"])
    by_field = {x.field: x for x in e.value.errors if Path(x.file).name == name}
    red_line = 1 + next(i for i, s in enumerate(path.read_text().splitlines()) if "no-such-mutant" in s)
    assert by_field["obligations[2].red.mutant"].line == red_line and "unknown mutant 'no-such-mutant'" in by_field["obligations[2].red.mutant"].message
    assert "has no attribute 'no_such_function'" in by_field["equations.cosine.oracle"].message
    assert any("obligation id GDN-EQ-001 also used in" in str(x) for x in e.value.errors)


def test_mutants_list_shows_every_bug_class(capsys):
    assert main(["mutants", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    mutants = [r for r in rows if r["kind"] == "mutant"]
    assert len(mutants) >= 14
    classes = {r["bug_class"] for r in mutants}
    assert set(ISSUE_BUG_CLASSES) <= classes, set(ISSUE_BUG_CLASSES) - classes
    assert all(r["description"] and r["breaks"] for r in rows)
    assert main(["mutants", "list"]) == 0 and f"{len(mutants)} mutants, {len(PLANTS)} plants" in capsys.readouterr().out


def test_mutants_are_engines_named_after_themselves(tiny_path, tiny_moe_path):
    tokens = list(range(10, 30))
    names = known_engine_names()
    base = {p: gather(load_oracle(p).logits(tokens)) for p in (tiny_path, tiny_moe_path)}
    for name, m in MUTANTS.items():
        assert f"mutant:{name}" in names
        for path in (tiny_path, tiny_moe_path):
            eng = resolve_engine(f"mutant:{name}", path)
            assert eng.info.name == f"mutant:{name}" and eng.info.build["bug_class"] == m.bug_class
            out = gather(eng.logits(tokens))
            assert out.shape == base[path].shape and np.isfinite(out).all()
            arch = "qwen35moe" if path == tiny_moe_path else "qwen35"
            if arch not in m.archs:
                assert np.array_equal(out, base[path]), f"{name} changed a {arch} model it does not apply to"
    assert not np.array_equal(gather(load_mutant("dt-bias-dropped", tiny_path).logits(tokens)), base[tiny_path])


def test_engine_table_names_loaders_and_hashed_sources(tiny_path):
    """One row per engine name: every accepted spelling resolves through it, an unknown name lists
    the known ones, and discharge hashes exactly the row's source files (so editing an engine's
    code makes its evidence STALE)."""
    from harness.engines.registry import ENGINES, engine_entry, engine_source_hashes

    assert resolve_engine("llamacpp", tiny_path).info.name == resolve_engine("llama.cpp", tiny_path).info.name == "llama.cpp"
    assert engine_entry("mutant:dt-bias-dropped").name == "mutant:" and engine_entry("planted:nan-logits").load is None
    with pytest.raises(InvalidInput, match=r"unknown engine 'planted:nan-logits'; known: llama\.cpp, llama\.cpp-repack, oracle, oracle-bf16, oracle-f16, llama-server, llama-cpp-python-server, transformers, mlx, mutant:"):
        resolve_engine("planted:nan-logits", tiny_path)
    oracle = engine_source_hashes("oracle")
    assert set(oracle) == {"harness/engines/base.py", "harness/model/gguf_model.py", "harness/engines/oracle/__init__.py",
                           "harness/engines/oracle/qwen35.py", "harness/engines/oracle/qwen35moe.py"} | {
                              f"harness/engines/oracle/{p.name}" for p in (REPO / "harness/engines/oracle").glob("*.py")}
    assert set(engine_source_hashes("mutant:x")) == set(oracle) | {"harness/engines/mutants.py"}
    assert engine_source_hashes("llama-cpp")["llama-cpp-python"] and engine_source_hashes("no-such") == {}
    assert all(len(e.source_files()) >= 1 for e in ENGINES)


def test_planted_engine_corrupts_only_its_output(tiny_path):
    eng = PlantedEngine(load_oracle(tiny_path), "nan-logits")
    out = gather(eng.logits(list(range(8))))
    assert np.isnan(out[5]).all() and np.isfinite(np.delete(out, 5, axis=0)).all()
    assert eng.info.name == "oracle+planted:nan-logits" and set(PLANTS) == {"nan-logits", "nan-activation", "drop-last-row"}


def test_declared_breaks_agree_with_the_contracts():
    """``Mutant.breaks`` / ``Plant.breaks`` (the one statement of which obligations a fault turns
    RED) name existing obligations, include every obligation whose contract cites that fault as its
    RED witness, and leave every obligation GREEN on some mutant (a check that fails everything
    tells nothing)."""
    contracts = load_contracts([CONTRACTS], check_tests=False)
    ids = {ob.id for c in contracts for ob in c.obligations}
    faults = {"mutant": ALL_MUTANTS, "planted": PLANTS}
    for kind, table in faults.items():
        for name, f in table.items():
            assert f.breaks and len(set(f.breaks)) == len(f.breaks), f"{kind}:{name}: breaks must list distinct obligations"
            assert set(f.breaks) <= ids, f"{kind}:{name} breaks unknown obligations {sorted(set(f.breaks) - ids)}"
    for c in contracts:
        for ob in c.obligations:
            for red in ob.reds:
                if red.kind in faults:
                    assert ob.id in faults[red.kind][red.name].breaks, f"{ob.id} cites {red} as RED, whose breaks omit it"
    for ob_id in ids:
        assert any(ob_id not in m.breaks for m in MUTANTS.values()), f"{ob_id} is RED on every mutant"


def test_mutant_matrix_matches():
    """The observed mutant × obligation matrix (every bound test run on every mutant) is RED
    exactly where ``MUTANTS[name].breaks`` says and GREEN everywhere else."""
    from harness.contracts.discharge import mutant_matrix

    contracts = load_contracts([CONTRACTS], check_tests=False)
    order = [ob.id for c in contracts for ob in c.obligations]
    observed = mutant_matrix(contracts, list(MUTANTS))
    diff = [(m, ob, observed[m][ob]) for m in MUTANTS for ob in order
            if observed[m][ob] != ("RED" if ob in MUTANTS[m].breaks else "GREEN")]
    rows = "\n".join(f"{m}: {tuple(ob for ob in order if observed[m][ob] == 'RED')}" for m in MUTANTS)
    assert not diff, f"observed matrix differs at {diff[:10]}; observed RED per mutant:\n{rows}"


def test_compare_activations_per_tensor():
    rng = np.random.default_rng(0)
    r = {"attn_norm-0": rng.normal(size=(5, 8)), "l_out-0": rng.normal(size=(5, 8)), "Qcur-3": rng.normal(size=(5, 2, 4)),
         "result_norm": rng.normal(size=(5, 8)), "gone-1": np.ones((5, 2)), "nan-1": np.ones((5, 2))}
    c = {k: v.copy() for k, v in r.items() if k != "gone-1"}
    c["l_out-0"] = 2 * r["l_out-0"]  # scaled: cosine 1, NMSE 1
    c["Qcur-3"] = r["Qcur-3"].reshape(5, 8)  # same elements, other layout: compared as [T, -1]
    c["result_norm"] = r["result_norm"][:4]
    c["nan-1"][2, 1] = np.nan
    rows = {x["name"]: x for x in compare_activations(r, c)}
    assert list(rows) == list(r)  # the reference's (forward) order
    assert rows["attn_norm-0"]["nmse"] == 0 and rows["attn_norm-0"]["cosine"] == pytest.approx(1) and rows["attn_norm-0"]["layer"] == 0
    assert rows["l_out-0"]["nmse"] == pytest.approx(1) and rows["l_out-0"]["cosine"] == pytest.approx(1)
    assert rows["l_out-0"]["rel_max"] == pytest.approx(1) and rows["l_out-0"]["op"] == "l_out"
    assert rows["Qcur-3"]["status"] == "ok" and rows["Qcur-3"]["nmse"] == 0
    assert rows["result_norm"]["status"] == "shape" and rows["result_norm"]["layer"] == -1
    assert rows["gone-1"]["status"] == "missing" and rows["nan-1"]["status"] == "nonfinite"


def test_defective_fixture_names_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path))
    p = resolve_model("fixture:ssm-a-positive")
    assert p.exists() and resolve_model("fixture:ssm-a-positive") == p
    assert resolve_model("fixture:tiny-qwen35") == fx.build("tiny-qwen35")
