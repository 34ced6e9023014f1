"""The state probe (``harness.runs.probes.probe_state``, issue 33): precision faults a small trained
model hides, made visible on the state-sensitive fixture ``fixture:state-qwen35``.

On the default model a recurrent state kept in bf16 between calls, or attention computed in bf16
in multi-token calls only, moves the logits less than a correct f32 engine's own decode drift, so
the f32 class's decode tolerance passes both (docs/engine-protocol.md). The state probe runs the
candidate again on the state fixture (slow DeltaNet decay, sharp attention), fed 16 tokens then
one per call against itself fed whole, judged by the ``state:`` row of its declared class.
Here: the known-good engines of f64 and f32 PASS it, both precision mutants (declared f32) FAIL it
naming the first position, and the probe is UNMEASURED where it cannot be judged.
"""

from __future__ import annotations

import pytest

from harness.engines.mutants import PRECISION_MUTANTS, load_mutant
from harness.errors import InvalidInput, Verdict
from harness.fixtures.resolve import default_model, resolve_model
from harness.fixtures.synthetic import STATE_FIXTURE
from harness.judge.thresholds import load_thresholds
from harness.model.gguf_model import GGUFModel
from harness.paths import SUITE_ROOT
from harness.runs.probes import ProbeRequest, run_probes

STATE = f"fixture:{STATE_FIXTURE}"


def _state(candidate: str, **settings):
    run = run_probes(ProbeRequest(model=default_model(), candidate=candidate, only=["state"], write_evidence=False,
                                  candidate_settings=settings))
    (result,) = run.results
    return run, result


def test_the_committed_state_rows_are_measured_on_the_fixture_as_built():
    """Every ``state:`` row of thresholds.yaml is measured on the fixture this code builds (same
    sha256), for f64 and f32 at least, and each names both precision mutants as known-bad."""
    th = load_thresholds(SUITE_ROOT / "thresholds.yaml")
    sha = GGUFModel(resolve_model(STATE)).sha256
    classes = {r.compute_class for r in th.state_rows}
    assert {"f64", "f32"} <= classes
    for row in th.state_rows:
        assert [m["sha256"] for m in row.basis_models] == [sha]
        bad = {b["what"] for g in row.gates.values() for b in g["basis"]["known_bad"]}
        if row.compute_class == "f32":
            assert {f"mutant:{m}" for m in PRECISION_MUTANTS} <= bad


@pytest.mark.parametrize("candidate", ["oracle", "llama.cpp"])
def test_known_good_engines_pass_the_state_probe(candidate):
    """The exact oracle (f64 row) and llama.cpp at its defaults (f32 row) pass on the fixture."""
    run, r = _state(candidate)
    assert r.verdict is Verdict.PASS, r.summary()
    assert run.verdict is Verdict.PASS
    (comp,) = r.comparisons
    assert comp.positions >= 200 and STATE in comp.label


@pytest.mark.parametrize("name", list(PRECISION_MUTANTS))
def test_precision_mutants_fail_the_state_probe_naming_the_position(name):
    """Each precision mutant declares f32 and FAILs the f32 state row, naming the first position
    outside it (past the 16-token prefill: the prefill itself is the same call both ways)."""
    assert load_mutant(name, resolve_model(STATE)).info.compute_class == "f32"
    run, r = _state(f"mutant:{name}")
    assert r.verdict is Verdict.FAIL and run.verdict is Verdict.FAIL
    (comp,) = r.comparisons
    assert comp.first_bad_position is not None and comp.first_bad_position >= 16
    assert f"first differing position {comp.first_bad_position}," in r.summary() and STATE in r.summary()
    assert "harness probe" in (r.reproducer or "")
    # the reproducer names the model the probe ran on (not the run's default model) and what it fed
    sha = GGUFModel(resolve_model(STATE)).sha256
    assert f"model {STATE} sha256 {sha[:12]}" in r.reproducer and f"n_tokens {sum(comp.chunks)}," in r.reproducer
    assert f"--model {STATE}" in r.reproducer


def test_precision_mutants_pass_the_default_decode_probe_at_f32():
    """The gap the state probe closes: on the default model the bf16 state passes the decode probe
    at the f32 class's tolerance (its drift is below llama.cpp's own)."""
    run = run_probes(ProbeRequest(model=default_model(), candidate="mutant:state-bf16-between-calls", only=["decode"],
                                  write_evidence=False, decode_tokens=160))
    assert run.results[0].verdict is Verdict.PASS, run.results[0].summary()


def test_a_class_without_a_state_row_is_unmeasured(monkeypatch, tmp_path):
    """No ``state:`` row for the candidate's class: UNMEASURED, naming the command that measures one."""
    import yaml

    doc = yaml.safe_load((SUITE_ROOT / "thresholds.yaml").read_text())
    doc["state"] = [r for r in doc["state"] if r["class"] != "f64"]
    th = tmp_path / "thresholds.yaml"
    th.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = run_probes(ProbeRequest(model=default_model(), candidate="oracle", only=["state"], write_evidence=False, thresholds=str(th)))
    r = run.results[0]
    assert r.verdict is Verdict.UNMEASURED and "harness calibrate --state" in r.reason
    assert run.verdict is Verdict.UNMEASURED


def test_a_candidate_pinned_to_its_own_model_folder_is_unmeasured():
    """A candidate made on a model folder of its own (``--mlx-folder``) cannot be loaded on the
    fixture: UNMEASURED, naming the setting, before anything is loaded."""
    from harness.runs.inputs import RunInputs
    from harness.runs.probes import plan_state

    req = ProbeRequest(model=default_model(), candidate="mlx", only=["state"], candidate_settings={"folder": "/nonexistent"})
    r = plan_state(req, RunInputs.__new__(RunInputs))()
    assert r.verdict is Verdict.UNMEASURED and "--mlx-folder" in r.reason


def test_state_rows_repeating_a_key_are_refused(tmp_path):
    """Two ``state:`` rows of one weights × class × architecture: InvalidInput naming the line."""
    import yaml

    doc = yaml.safe_load((SUITE_ROOT / "thresholds.yaml").read_text())
    doc["state"].append(doc["state"][0])
    p = tmp_path / "thresholds.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(InvalidInput, match=r"state\[\d+\].*repeats the key of state\[0\]"):
        load_thresholds(p)


def test_calibration_refuses_when_a_known_bad_engine_stays_within(monkeypatch):
    """``calibrate_state`` refuses (``problems``) when a known-bad engine stays inside the f32 row:
    here the f32 row measured on the oracle alone and, as the only known-bad engine, an MoE
    mutant, which changes nothing on the dense fixture."""
    from harness.engines import mutants
    from harness.runs.calibrate import state
    from harness.runs.calibrate.plan import _oracle

    monkeypatch.setattr(state, "STATE_KNOWN_GOOD", {"f32": [("oracle", _oracle, None)]})
    monkeypatch.setattr(state, "STATE_TRUNK_MUTANTS", ())
    monkeypatch.setattr(mutants, "PRECISION_MUTANTS", {"moe-weights-unnormalized": mutants.MUTANTS["moe-weights-unnormalized"]})
    res = state.calibrate_state(("f32",), max_tokens=40, log=lambda m: None)
    assert res.problems == [res.problems[0]] and "mutant:moe-weights-unnormalized stays within the f32 state row" in res.problems[0]
    with pytest.raises(state.CalibrationRefused):
        state.refuse(res)
