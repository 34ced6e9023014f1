"""The seeded family of state faults (tests/state_faults.py) each FAILs the default probes.

Rounding the recurrent state to bf16 or f16 every k ∈ {1, 2, 4, 8} calls drifts slowly: the decode
probe at its default length (``probes.DECODE_TOKENS``) catches every k at the f64 class's
tolerance, and ``test_bf16_every_8_calls_fails_at_the_9th_decode_token`` pins how soon. Slot faults (the state slot index swapped
between sequences decoded together, a slot's state not cleared when reused) fail multiseq; a
prompt-cache checkpoint taken at the wrong position fails the prefix probe. The same engine
without a fault passes every probe, so each FAIL is the fault's. f16 rounding of S alone is
smaller (max KLD 1.7e-8 to 3.2e-7 over 1,024 decode calls): it fails because the f64 class's
probe tolerance steps down to KLD 1e-9 (``calibrate.PROBE_MIN_STEP``: an f64 engine's own floor
is exact), where a 1e-6 step let it pass.

The probes run as ``harness probe`` runs them (``run_probes``: the default model, prompts and the
calibrated tolerance of the engine's class), with the test engine put where the registry's would be.
"""

from __future__ import annotations

import pytest
from state_faults import SlotEngine

from harness.runs import probes
from harness.runs.inputs import RunInputs
from harness.runs.probes import ProbeRequest, run_probes
from harness.engines.registry import resolve_engine
from harness.errors import Verdict
from harness.fixtures.resolve import default_model, resolve_model

NAME = "test:slots"


@pytest.fixture(scope="module")
def oracle():
    return resolve_engine("oracle", resolve_model(default_model()))


@pytest.fixture()
def probe(monkeypatch):
    """``probe(engine, only=(), **request)``: ``run_probes`` with ``engine`` as the candidate."""
    made = {}
    original = RunInputs.engine
    monkeypatch.setattr(RunInputs, "engine", lambda self, name, **s: made["engine"] if name == NAME else original(self, name, **s))

    def run(engine, only=(), **kw):
        made["engine"] = engine
        return run_probes(ProbeRequest(model=default_model(), candidate=NAME, only=list(only), write_evidence=False, **kw))

    return run


def _failed(run):
    return {r.name for r in run.results if r.verdict is Verdict.FAIL}


def test_the_engine_without_a_fault_passes_every_default_probe(oracle, probe):
    run = probe(SlotEngine(oracle))
    assert run.verdict is Verdict.PASS, run.message
    measured = {r.name for r in run.results if r.verdict is Verdict.PASS}
    assert {"split", "decode", "multiseq", "prefix", "determinism", "long"} <= measured
    assert run.receipt["long_decode"]["tokens"] == probes.DECODE_TOKENS and run.receipt["long_decode"]["verdict"] == "PASS"


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
@pytest.mark.parametrize("k", [1, 2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_recurrent_state_rounded_every_k_calls_fails_decode(oracle, probe, fmt, k):
    run = probe(SlotEngine(oracle, round_state=(fmt, k)), only=["split", "decode", "determinism"])
    assert run.verdict is Verdict.FAIL and "decode" in _failed(run), run.message
    assert run.receipt["long_decode"]["verdict"] == "FAIL"
    decode = next(r for r in run.results if r.name == "decode")
    at = decode.first_failure.first_bad_position + 1
    assert "next: harness localize --candidate test:slots" in decode.reproducer  # the pieces up to the failing boundary:
    assert f"--chunks {decode.first_failure.chunks[0]}" in decode.reproducer and f"--max-tokens {at}" in decode.reproducer


@pytest.mark.slow
def test_recurrent_and_conv_state_rounded_to_f16_every_call_fails_decode(oracle, probe):
    run = probe(SlotEngine(oracle, round_state=("f16", 1), round_conv=True), only=["decode"])
    assert run.verdict is Verdict.FAIL and run.receipt["long_decode"]["verdict"] == "FAIL", run.message


@pytest.mark.slow
def test_bf16_every_8_calls_fails_at_the_9th_decode_token(oracle, probe):
    """At the f64 class's tolerance the slowest bf16 fault shows within 9 decode tokens: it passes
    at 8 and fails at 9 (``DECODE_TOKENS`` keeps the margin a looser tolerance needs)."""
    eng = SlotEngine(oracle, round_state=("bf16", 8))
    assert probe(eng, only=["decode"], decode_tokens=8).receipt["long_decode"]["verdict"] == "PASS"
    row = probe(eng, only=["decode"], decode_tokens=9).receipt["long_decode"]
    assert (row["tokens"], row["verdict"], row["first_bad_position"]) == (9, "FAIL", 8)


@pytest.mark.parametrize("fault", ["swap_slots", "stale_slots"])
def test_slot_faults_fail_multiseq(oracle, probe, fault):
    run = probe(SlotEngine(oracle, **{fault: True}), only=["multiseq", "split", "decode", "determinism"], decode_tokens=64)
    assert _failed(run) == {"multiseq"}, run.message
    first = next(r for r in run.results if r.name == "multiseq").first_failure
    assert first.label.startswith("distinct prompt")  # identical copies cannot show a slot mix-up


def test_a_checkpoint_from_the_wrong_position_fails_prefix(oracle, probe):
    run = probe(SlotEngine(oracle, late_checkpoint=True), only=["prefix", "multiseq"])
    assert _failed(run) == {"prefix"}, run.message
    assert "forked from the checkpoint" in next(r for r in run.results if r.name == "prefix").first_failure.label
