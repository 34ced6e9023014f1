"""Self-consistency probes: clean engines pass, a state bug fails naming the split point."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from harness.runs.probes import (
    ProbeTolerance,
    overall_verdict,
    probe_decode,
    probe_determinism,
    probe_multiseq,
    probe_split,
    probe_ubatch,
    split_points,
)
from harness.engines.base import EngineInfo
from harness.engines.registry import resolve_engine
from harness.errors import Verdict
from harness.fixtures import synthetic as fx

TOL = ProbeTolerance(min_cosine=0.9999, max_kld=1e-3)


@pytest.fixture(scope="module")
def tokens():
    eng = resolve_engine("llama.cpp", fx.build("tiny-qwen35"))
    from harness.measure.prompts import load_prompts

    return eng.tokenize(load_prompts(None)[0].text)[:130]


class StateDropped:
    """Feeds every piece as a fresh prompt: recurrent and conv state lost between calls."""

    def __init__(self, base):
        self.base = base

    @property
    def info(self):
        return EngineInfo("planted:state-dropped", "test", capabilities=["chunks"])

    @property
    def n_vocab(self):
        return self.base.n_vocab

    def logits(self, tokens, chunks=None):
        start = 0
        for c in chunks or [len(tokens)]:
            for s, b in self.base.logits(tokens[start : start + c]):
                yield start + s, b
            start += c


def test_split_points_cover_conv_and_chunk_boundaries():
    pts = split_points(130, seed=0)
    assert {1, 2, 3, 4, 5, 63, 64, 65} <= set(pts) and len(pts) == 11
    assert split_points(130, seed=0) == pts  # seeded
    assert all(0 < p < 10 for p in split_points(10, seed=1))


def test_oracle_passes_split_decode_determinism(tokens):
    eng = resolve_engine("oracle", fx.build("tiny-qwen35"))
    for r in (probe_split(eng, tokens, TOL), probe_decode(eng, tokens[:40], TOL), probe_determinism(eng, tokens)):
        assert r.verdict is Verdict.PASS, r.summary()
        assert all(c.min_cosine > 0.999999999 for c in r.comparisons)
    assert probe_ubatch(eng, tokens, TOL).verdict is Verdict.UNMEASURED


def test_llamacpp_passes_ubatch_and_multiseq(tokens):
    eng = resolve_engine("llama.cpp", fx.build("tiny-qwen35"))
    r = probe_ubatch(eng, tokens[:100], TOL, sizes=(1, 7, 512))
    assert r.verdict is Verdict.PASS and len(r.comparisons) == 3, r.summary()
    m = probe_multiseq(eng, [tokens[:40], tokens[40:80], tokens[80:120]], TOL)
    assert m.verdict is Verdict.PASS and len(m.comparisons) == 6, m.summary()


def test_state_dropped_fails_split_naming_the_point(tokens):
    eng = StateDropped(resolve_engine("oracle", fx.build("tiny-qwen35")))
    r = probe_split(eng, tokens, TOL)
    assert r.verdict is Verdict.FAIL
    first = r.first_failure
    assert first.label == "split at 1" and first.first_bad_position == 1
    assert "split at 1" in r.summary() and "first differing position 1" in r.summary()
    assert first.max_kld > 1e-2
    d = probe_decode(eng, tokens[:30], TOL)
    assert d.verdict is Verdict.FAIL


def test_nondeterministic_engine_fails_determinism(tokens):
    base = resolve_engine("oracle", fx.build("tiny-qwen35"))
    calls = {"n": 0}

    class Flaky(StateDropped):
        def logits(self, toks, chunks=None):
            calls["n"] += 1
            for s, b in base.logits(toks):
                if calls["n"] == 2 and s == 0:
                    b = b.copy()
                    b[3, 0] = np.nextafter(b[3, 0], np.inf)  # one ulp
                yield s, b

    r = probe_determinism(Flaky(base), tokens[:20])
    assert r.verdict is Verdict.FAIL and r.first_failure.first_bad_position == 3


def test_overall_verdict_rules():
    from harness.runs.probes import ProbeResult

    ok = lambda n: ProbeResult(n, Verdict.PASS)
    un = lambda n: ProbeResult(n, Verdict.UNMEASURED, reason="x")
    assert overall_verdict([ok("split"), ok("decode"), ok("determinism"), un("ubatch")])[0] is Verdict.PASS
    assert overall_verdict([ok("split"), un("decode"), ok("determinism")])[0] is Verdict.UNMEASURED
    assert overall_verdict([ok("split"), ProbeResult("decode", Verdict.FAIL), ok("determinism")])[0] is Verdict.FAIL
    # --only judges what it names: each named probe required, the others not
    assert overall_verdict([ok("decode")], ["decode"])[0] is Verdict.PASS
    assert overall_verdict([ok("decode")])[0] is Verdict.UNMEASURED  # without --only: split, determinism missing
    v, msg = overall_verdict([ok("decode"), un("ubatch")], ["decode", "ubatch"])
    assert v is Verdict.UNMEASURED and msg == "named probes not measured: ubatch"
    assert overall_verdict([ProbeResult("decode", Verdict.FAIL)], ["decode"])[0] is Verdict.FAIL


def test_a_subset_receipt_passes_but_never_signs_off():
    """``covers_required`` names the required probes a receipt did not measure; the sign-off
    reads a PASS on a subset as UNMEASURED."""
    from harness.release import signoff
    from harness.runs.probes import covers_required

    sub = {"verdict": "PASS", "only": ["decode"], "message": "x", "probes": [{"name": "decode", "verdict": "PASS"}]}
    assert covers_required(sub) == ["split", "determinism"]
    full = {"verdict": "PASS", "only": [], "message": "x",
            "probes": [{"name": n, "verdict": "PASS"} for n in ("split", "decode", "determinism")] + [{"name": "ubatch", "verdict": "UNMEASURED"}]}
    assert covers_required(full) == []

    class R:
        kind = "probe"

    status, why = signoff._receipt_status(R(), sub)
    assert status == signoff.UNMEASURED and "needs split, determinism" in why
    assert signoff._receipt_status(R(), full)[0] == signoff.OK


def test_cli_probe_oracle_exits_0_and_writes_probe_receipt(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    r = subprocess.run([sys.executable, "-m", "harness", "probe", "--candidate", "oracle", "--model", "fixture:tiny-qwen35",
                        "--ledger", str(ledger), "--only", "split", "--only", "decode", "--only", "determinism", "--decode-tokens", "64"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS: all 3 named probes pass (--only split decode determinism)" in r.stdout
    rows = [json.loads(l) for l in ledger.read_text().splitlines()]
    assert rows[-1]["kind"] == "probe" and rows[-1]["verdict"] == "PASS"
    assert rows[-1]["candidate_tokens_per_s"] > 0 and rows[-1]["candidate_wall_s"] > 0  # the probe run's speed
    v = subprocess.run([sys.executable, "-m", "harness", "ledger", "verify", "--ledger", str(ledger)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout


def test_cli_probe_prints_its_ledger_line_and_takes_no_evidence(tmp_path):
    """Issue 48 (4): ``probe`` printed no ``ledger:`` line (parity does) and had no ``--no-evidence``."""
    ledger = tmp_path / "ev" / "ledger.jsonl"
    base = [sys.executable, "-m", "harness", "probe", "--candidate", "oracle", "--model", "fixture:tiny-qwen35", "--ledger", str(ledger),
            "--only", "decode", "--decode-tokens", "16"]
    dry = subprocess.run([*base, "--no-evidence"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "receipt:" not in dry.stdout and "ledger:" not in dry.stdout and not (tmp_path / "ev").exists()
    r = subprocess.run(base, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(ledger.read_text().splitlines()[-1])
    assert f"ledger:  {ledger} (row {row['seq']}, {row['row_hash'][:12]})" in r.stdout.splitlines()


def test_cli_probe_only_judges_what_it_names(tmp_path):
    """``--only decode`` on the oracle exits 0 and its receipt records the subset; ``--only
    ubatch`` on an engine without ``n_ubatch`` (the oracle) stays UNMEASURED, exit 5."""
    ledger = tmp_path / "ledger.jsonl"
    base = [sys.executable, "-m", "harness", "probe", "--candidate", "oracle", "--model", "fixture:tiny-qwen35", "--ledger", str(ledger)]
    r = subprocess.run([*base, "--only", "decode", "--decode-tokens", "64"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS: all 1 named probes pass (--only decode); a sign-off also needs split, determinism" in r.stdout
    receipt = json.loads(next((ledger.parent / "receipts").rglob("*.json")).read_text())
    assert receipt["only"] == ["decode"] and [p["name"] for p in receipt["probes"]] == ["decode"] and receipt["verdict"] == "PASS"
    r = subprocess.run([*base, "--only", "ubatch"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 5, r.stdout + r.stderr
    assert "UNMEASURED: named probes not measured: ubatch" in r.stdout


def test_probe_help_names_every_probe():
    """``harness probe --help`` lists every name ``--only`` accepts (the state probe was once missing)."""
    from click.testing import CliRunner

    from harness.cli import cli
    from harness.runs.probes import PROBE_NAMES

    r = CliRunner().invoke(cli, ["probe", "--help"], terminal_width=400)
    assert r.exit_code == 0, r.output
    listed = " ".join(r.output.split()).split("Run only these probes (")[1].split(")")[0]
    assert [n.strip() for n in listed.split(",")] == list(PROBE_NAMES)


def test_cli_probe_failure_is_a_reproducer(tmp_path):
    """A real state bug fails the split probe with what test-backend-ops would print: candidate,
    model sha256, prompt, n_tokens, the chunks of the failing split, the numbers and their bounds,
    the mutant table's bug classes for the split obligation, and the command that reruns it; the
    probe receipt keeps the same line."""
    from harness.runs.probes import MAIN_TOKENS, PROBES
    from harness.measure.prompts import load_prompt_set, tokenize_prompts
    from harness.engines.mutants import MUTANTS
    from harness.model.gguf_model import GGUFModel

    ledger = tmp_path / "ledger.jsonl"
    r = subprocess.run([sys.executable, "-m", "harness", "probe", "--candidate", "mutant:conv-state-dropped", "--model", "fixture:tiny-qwen35",
                        "--ledger", str(ledger), "--only", "split"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("probe split FAIL"))
    sha = GGUFModel(fx.build("tiny-qwen35")).sha256[:12]
    longest = max(tokenize_prompts(load_prompt_set(None), resolve_engine("llama.cpp", fx.build("tiny-qwen35"))), key=lambda p: len(p.tokens))
    assert line.startswith("probe split FAIL: split at 1: first differing position 1, min cosine ")
    assert f"(candidate mutant:conv-state-dropped, model fixture:tiny-qwen35 sha256 {sha}, prompt {longest.id!r}, n_tokens {MAIN_TOKENS}, chunks [1, {MAIN_TOKENS - 1}])" in line
    # the numbers are over their bounds
    min_cos = float(line.split("min cosine ")[1].split(",")[0])
    kld = float(line.split("max KLD ")[1].split(" ")[0])
    bound_cos = float(line.split("bounds: cosine >= ")[1].split(",")[0])
    assert min_cos < bound_cos and kld > float(line.split("KLD <= ")[1].split(")")[0])
    causes = [f"{MUTANTS[n].bug_class} (as mutant:{n})" for n in MUTANTS if PROBES["split"].obligation in MUTANTS[n].breaks]
    assert "conv state dropped between chunks (as mutant:conv-state-dropped)" in causes
    assert f"likely cause: {' or '.join(causes)}; reproduce: harness probe --candidate mutant:conv-state-dropped --model fixture:tiny-qwen35 --only split" in line
    receipt = json.loads(next((ledger.parent / "receipts").glob("*/*.json")).read_text())
    assert receipt["probes"][0]["reproducer"] == line


def test_probe_obligations_are_contract_obligations():
    """Each probe's likely causes come from the mutants that break its obligation: the obligation
    exists in the e2e contract, and the mutants it shows RED with are among those causes."""
    from pathlib import Path

    from harness.runs.probes import PROBES
    from harness.contracts.loader import load_contracts
    from harness.engines.mutants import ALL_MUTANTS as MUTANTS

    obligations = {ob.id: ob for c in load_contracts([Path(__file__).parents[1] / "contracts"], check_tests=False) for ob in c.obligations}
    for name, kind in PROBES.items():
        if kind.obligation is None:
            continue
        assert kind.obligation in obligations, (name, kind.obligation)
        breaking = {n for n, m in MUTANTS.items() if kind.obligation in m.breaks}
        reds = {r.name for r in obligations[kind.obligation].reds if r.kind == "mutant"}
        assert reds <= breaking, (name, reds - breaking)


def test_a_failing_pieces_probe_names_localize_at_its_boundary_which_finds_what_whole_misses(tmp_path):
    """The next step printed by a failing split probe is a ``harness localize --chunks`` command
    that, run as printed, FAILs at the conv state's first op in the mixer sub-block, where
    ``harness localize`` with its defaults (the prompt fed whole) reports clean."""
    import shlex

    from harness.runs.probes import ProbeRequest, run_probes

    run = run_probes(ProbeRequest(model="fixture:tiny-qwen35", candidate="mutant:conv-state-dropped", only=["split"], write_evidence=False))
    rep = run.results[0].reproducer
    assert "; next: harness localize " in rep
    argv = shlex.split(rep.split("; next: ", 1)[1])
    assert argv[argv.index("--chunks") + 1] == "1,1" and argv[argv.index("--max-tokens") + 1] == "2"  # split at 1, first differing position 1
    hinted = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)
    assert hinted.returncode == 1, hinted.stdout + hinted.stderr
    assert "FAIL: first divergence: layer 0 (recurrent), mixer sub-block, tensor conv_output_raw-0 at position 1" in hinted.stdout
    whole = [a for i, a in enumerate(argv) if a != "--chunks" and argv[i - 1] != "--chunks"]
    clean = subprocess.run([sys.executable, "-m", *whole], capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0 and "no tensor over the bounds" in clean.stdout, clean.stdout + clean.stderr


def test_chunks_arg_round_trips():
    from harness.judge.reproducer import chunks_arg, chunks_up_to, parse_chunks_arg

    pieces = [16] + [1] * 40 + [3, 3]
    assert chunks_arg(pieces) == "16,1x40,3,3" and parse_chunks_arg("16,1x40,3,3") == pieces == parse_chunks_arg("16,1×40,3,3")
    assert chunks_up_to([16, 1, 1, 1], 17) == [16, 1] and chunks_up_to([64, 66], 10) == [10]


def _burst(n=640, v=64, at=(), drift_from=None, seed=0):
    """Logits ``[n, v]`` and a copy perturbed at the positions ``at`` (a router near-tie: a burst
    that recovers) or on every position from ``drift_from`` on (a state fault)."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, v)).astype(np.float32)
    other = base.copy()
    for p in at:
        other[p] += rng.normal(scale=0.5, size=v).astype(np.float32)
    if drift_from is not None:
        other[drift_from:] += rng.normal(scale=0.05, size=(n - drift_from, v)).astype(np.float32)
    return base, other


def test_moe_excursions_forgive_a_router_burst_but_not_a_drift():
    """An MoE tolerance (``excursions``) lets a short burst of positions that ends leave the bounds,
    and says how many; a state fault that drifts on every later position fails all the same, and
    so do a few bad positions that last to the end; the dense tolerance (no excursions) fails the
    burst."""
    from harness.runs.probes import compare

    dense = ProbeTolerance(min_cosine=0.99999, max_kld=1e-5)
    moe = ProbeTolerance(min_cosine=0.99999, max_kld=1e-5, excursions=8)
    base, burst = _burst(at=(123, 124, 125, 126, 127))
    c = compare("burst", base, burst, moe)
    assert c.ok and c.excursions == 5 and c.first_bad_position is None
    d = compare("burst", base, burst, dense)
    assert not d.ok and d.first_bad_position == 123 and d.excursions == 0
    base, drift = _burst(drift_from=300)
    f = compare("drift", base, drift, moe)
    assert not f.ok and f.first_bad_position == 300
    base, many = _burst(at=range(100, 109))  # one more than allowed
    assert not compare("nine", base, many, moe).ok
    base, tail = _burst(at=range(635, 640))  # few positions, but lasting to the last one: a state fault after a late split
    t = compare("tail", base, tail, moe)
    assert not t.ok and t.first_bad_position == 635


def test_a_non_finite_position_is_never_an_excursion():
    from harness.runs.probes import compare

    base, burst = _burst(at=(10,))
    burst[10, 3] = np.nan
    assert not compare("nan", base, burst, ProbeTolerance(min_cosine=0.99999, max_kld=1e-5, excursions=8)).ok


def test_probe_tolerance_applies_moe_excursions_only_to_moe_models():
    from harness.runs.probes import probe_tolerance
    from harness.runs.inputs import subject_of
    from harness.judge.thresholds import load_thresholds
    from harness.model.gguf_model import GGUFModel

    th = load_thresholds("thresholds.yaml")
    allowance = th.data["probes"]["moe_excursions"]
    assert allowance["basis"]["kind"] == "measured" and allowance["value"] >= allowance["basis"]["known_good_floor"]
    for name, moe in (("tiny-qwen35", False), ("tiny-qwen35moe", True)):
        m = GGUFModel(fx.build(name))
        tol = probe_tolerance(th.resolve(subject_of(m, {"compute_class": "f32"}), f"fixture:{name}"), moe=m.hparams.n_expert > 0)
        assert tol is not None and tol.excursions == (allowance["value"] if moe else 0)
