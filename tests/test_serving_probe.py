"""The serving probe (harness/runs/serving.py): scenarios as data, op ``serve``, the serving
oracle as the correct baseline, the serving mutants it must catch, an engine that serves one
request after another (UNMEASURED where nothing overlapped), and the near-tie continuation."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness.engines import persistent
from harness.engines.command import load_command_engine
from harness.engines.mutants import SERVING_CAUGHT_BY, SERVING_MUTANTS, load_mutant
from harness.engines.oracle import load_oracle
from harness.engines.oracle.serving import ServingScheduler
from harness.engines.serving import ServeResult, ServeScenario, check_serve_result
from harness.errors import EngineError, InvalidInput, Verdict
from harness.fixtures import synthetic as fx
from harness.measure.continuation import judge_greedy
from harness.measure.prompts import PromptTokens
from harness.measure.scenarios import load_scenarios
from harness.runs.probe_types import ProbeTolerance
from harness.runs.serving import intent_missing, probe_serving

F64 = ProbeTolerance(min_cosine=1 - 1e-8, max_kld=1e-9)
QUICK = ("shared-header", "join-running", "slot-reuse-finished", "slot-reuse-aborted", "concurrency-3")


def _prompts(n_vocab: int) -> list[PromptTokens]:
    rng = np.random.default_rng(7)
    return [PromptTokens(f"p{i}", [int(t) for t in rng.integers(0, n_vocab, 90 + 17 * i)], "ids") for i in range(6)]


def _scenarios(names=QUICK):
    return [s for s in load_scenarios() if s.name in names]


def _by_name(result):
    return {r["scenario"]: r for r in result.details["scenarios"]}


@pytest.fixture(scope="module")
def dense():
    return load_oracle(fx.build("tiny-qwen35"))


def test_the_shipped_scenarios_cover_what_the_issue_names():
    sc = {s.name: s for s in load_scenarios()}
    header = [r["prompt"][0] for r in sc["shared-header"].requests]
    assert len(header) == 6 and all(h == header[0] and h["tokens"] >= 48 for h in header)
    grid = sorted(sum(seg["tokens"] for seg in r["prompt"][:1]) for r in sc["block-grid"].requests[1:])
    assert grid == [63, 64, 65, 127, 128, 129, 255, 256, 257]
    assert sc["multi-turn"].history_tokens() >= 4096 and len(sc["multi-turn"].requests) == 4
    assert [s for s in sc if s.startswith("concurrency-")] == [f"concurrency-{n}" for n in (1, 2, 3, 5, 7)]
    assert sc["slot-reuse-aborted"].requests[0]["abort_after"] == 4


def test_the_serving_oracle_passes_and_its_step_log_shows_each_intent(dense):
    r = probe_serving(dense, _prompts(dense.n_vocab), F64, _scenarios(), context_length=4096)
    rows = _by_name(r)
    assert r.verdict is Verdict.PASS, r.reason
    assert all(rows[n]["verdict"] == "PASS" for n in QUICK)
    hits = {q["request"]: q["cached"] for q in rows["shared-header"]["requests"]}
    assert hits == {"h1": 0, "h2": 64, "h3": 64, "h4": 64, "h5": 64, "h6": 64}  # the 80-token header's grid state, never more
    join = rows["join-running"]["log"]["steps"]
    mixed = [s for s in join if {e[0] for e in s["entries"]} == {"a", "b"} and any(e[0] == "b" and e[2] > 1 for e in s["entries"])]
    assert mixed, "b's prefill chunks share steps with a's decode"
    slots = {q["request"]: q["slot"] for q in rows["slot-reuse-aborted"]["requests"]}
    assert slots == {"a": 0, "b": 0} and [q["aborted"] for q in rows["slot-reuse-aborted"]["requests"]] == [True, False]
    assert max(len(s["entries"]) for s in rows["concurrency-3"]["log"]["steps"]) == 3
    assert min(c.min_cosine for c in r.comparisons if c.min_cosine is not None) > 1 - 1e-8


SHORT_TURNS = """\
schema: harness-serving-scenarios/v1
scenarios:
  - name: multi-turn
    why: two turns continued through the engine's cache (the shipped multi-turn, to 4,096 positions, is slow on the oracle)
    requests:
      - {id: t1, prompt: [{prompt: 0, tokens: 70}], n_tokens: 8}
      - {id: t2, continues: t1, prompt: [{prompt: 1, tokens: 30}], n_tokens: 8, arrival: {after: t1, tokens: 8}}
    expect: {cache_hit: [t2]}
"""


def _caught_by(name, tmp_path):
    first = SERVING_CAUGHT_BY[name]
    if first == "multi-turn":
        p = tmp_path / "turns.yaml"
        p.write_text(SHORT_TURNS)
        return load_scenarios(p) + _scenarios(("concurrency-2",))
    return _scenarios((first, "concurrency-2"))


@pytest.mark.parametrize("name", list(SERVING_MUTANTS))
def test_each_serving_mutant_fails_naming_scenario_request_and_step(name, tmp_path):
    eng = load_mutant(name, fx.build("tiny-qwen35"))
    r = probe_serving(eng, _prompts(eng.n_vocab), F64, _caught_by(name, tmp_path), context_length=4096)
    assert r.verdict is Verdict.FAIL
    first = SERVING_CAUGHT_BY[name]
    assert f"scenario {first!r}" in r.reason and "request " in r.reason and "step " in r.reason and "slot " in r.reason
    assert _by_name(r)[first]["verdict"] == "FAIL"
    assert _by_name(r)["concurrency-2"]["verdict"] == "PASS"  # no reuse, no hit, no padding: the fault stays out of its way


def test_the_short_two_turn_scenario_passes_on_the_oracle(dense, tmp_path):
    p = tmp_path / "turns.yaml"
    p.write_text(SHORT_TURNS)
    r = probe_serving(dense, _prompts(dense.n_vocab), F64, load_scenarios(p), context_length=4096)
    assert r.verdict is Verdict.PASS and [q["cached"] for q in _by_name(r)["multi-turn"]["requests"]] == [0, 77]


@pytest.mark.parametrize("name", list(SERVING_MUTANTS))
def test_a_serving_mutant_is_the_oracle_outside_its_scheduler(dense, name):
    """Parity and every other probe use the plain ops (logits, generate), which a serving mutant
    leaves as the oracle's, bit for bit: only the serving probe can see it."""
    from harness.engines.base import gather

    eng = load_mutant(name, fx.build("tiny-qwen35"))
    toks = _prompts(eng.n_vocab)[2].tokens
    assert np.array_equal(gather(eng.logits(toks, chunks=[7, len(toks) - 7])), gather(dense.logits(toks)))
    assert eng.generate(toks, 6) == dense.generate(toks, 6) and "serve" in eng.info.capabilities


def test_a_header_keyed_cache_also_claims_more_than_was_ever_fed():
    eng = load_mutant("serve-prefix-header-key", fx.build("tiny-qwen35"))
    r = probe_serving(eng, _prompts(eng.n_vocab), F64, _scenarios(("shared-header",)), context_length=4096)
    claims = [c for c in r.comparisons if "cache hit of" in c.label]
    assert claims and all(not c.ok for c in claims) and claims[0].label.endswith("80 shared with earlier requests")


class _OneAtATime:
    """The oracle serving one request after another (a correct engine that never batches)."""

    def __init__(self, oracle):
        self.oracle = oracle

    def __getattr__(self, attr):
        return getattr(self.oracle, attr)

    def serve(self, scenario):
        return ServingScheduler(self.oracle, max_running=1).run(scenario)


def test_an_engine_that_serves_one_request_at_a_time_is_unmeasured_where_nothing_overlapped(dense):
    r = probe_serving(_OneAtATime(dense), _prompts(dense.n_vocab), F64, _scenarios(), context_length=4096)
    rows = _by_name(r)
    assert r.verdict is Verdict.UNMEASURED and "join-running" in r.reason and "concurrency-3" in r.reason
    assert rows["join-running"]["verdict"] == "UNMEASURED" and "never shared a step" in rows["join-running"]["reason"]
    assert rows["concurrency-3"]["verdict"] == "UNMEASURED" and "at most 1 request shared a step" in rows["concurrency-3"]["reason"]
    assert rows["slot-reuse-finished"]["verdict"] == "PASS"  # what it did do is judged


def test_a_scenario_longer_than_the_context_is_unmeasured(dense):
    r = probe_serving(dense, _prompts(dense.n_vocab), F64, _scenarios(("multi-turn",)), context_length=2048)
    assert r.verdict is Verdict.UNMEASURED and "needs 4096 positions; the model declares context_length 2048" in r.reason


def test_no_serve_capability_is_unmeasured(dense):
    class Plain(_OneAtATime):
        info = property(lambda self: type(self.oracle.info)(**{**self.oracle.info.__dict__, "capabilities": ["chunks", "generate"]}))

    r = probe_serving(Plain(dense), _prompts(dense.n_vocab), F64, _scenarios())
    assert r.verdict is Verdict.UNMEASURED and "capability 'serve'" in r.reason


def test_rows_past_the_tolerance_span_are_held_to_the_release_floor():
    """The class's probe tolerance applies within the positions it was measured over (the decode
    probe's); past them a row is held to the release floor, so a correct engine's long-history
    drift (llama.cpp: 1 - cosine 6.9e-5 at position 3,036) is not called a fault, and a state fault
    (cosine below 0.8) still is."""
    from harness.runs.probes import DECODE_TOKENS
    from harness.runs.serving import TOLERANCE_SPAN, _comparison

    assert TOLERANCE_SPAN == DECODE_TOKENS
    pm = {"cosine": np.array([1.0, 1 - 6.9e-5]), "kld": np.array([0.0, 1e-4]), "finite": np.array([True, True]),
          "ref_argmax": np.array([1, 2]), "cand_argmax": np.array([1, 2])}
    assert _comparison("near", pm, 100, F64).first_bad_position == 101
    assert _comparison("far", pm, 3035, F64).ok
    pm["cosine"][1] = 0.77
    assert _comparison("far", pm, 3035, F64).first_bad_position == 3036


# -- the near-tie continuation ---------------------------------------------------------------


def test_a_near_tie_is_excused_and_the_comparison_goes_on_by_teacher_forcing():
    solo = [5, 6, 7, 8, 9]
    margins = [1.0, 1e-5, 1.0, 1.0, 1.0]
    asked = []
    ok = judge_greedy(solo, [5, 3, 4, 4, 4], margins.__getitem__, 1e-3, lambda: asked.append(1) or [5, 6, 7, 8, 9])
    assert ok.hard is None and [d.index for d in ok.near_ties] == [1] and ok.forced and asked == [1]
    bad = judge_greedy(solo, [5, 3], margins.__getitem__, 1e-3, lambda: [5, 6, 7, 2, 9])  # a fault after the near-tie
    assert bad.hard is not None and bad.hard.index == 3 and not bad.hard.near_tie
    hard = judge_greedy(solo, [5, 6, 1], margins.__getitem__, 1e-3, lambda: pytest.fail("not asked"))
    assert hard.hard.index == 2 and not hard.forced


# -- scenario files --------------------------------------------------------------------------


@pytest.mark.parametrize("text, where", [
    ("schema: harness-serving-scenarios/v1\nscenarios:\n  - {name: a, why: x, expect: {in_flight: 1}, requests: "
     "[{id: r, prompt: [{prompt: 0, tokens: 0}], n_tokens: 2}]}\n", "scenarios.0.requests.0.prompt.0.tokens"),
    ("schema: harness-serving-scenarios/v1\nscenarios:\n  - {name: a, why: x, expect: {in_flight: 1}, requests: "
     "[{id: r, prompt: [{prompt: 0, tokens: 3}], n_tokens: 2, arrival: {after: q, tokens: 1}}]}\n", "arrival.after 'q' is not an earlier request"),
    ("schema: harness-serving-scenarios/v1\nscenarios:\n  - {name: a, why: x, expect: {overlap: [r, z]}, requests: "
     "[{id: r, prompt: [{prompt: 0, tokens: 3}], n_tokens: 2}]}\n", "expect names request 'z'"),
    ("schema: harness-serving-scenarios/v1\nscenarios: []\n", "scenarios"),
    ("schema: harness-serving-scenarios/v1\n", "'scenarios' is a required property"),
])
def test_a_malformed_scenario_file_is_one_line_naming_file_and_field(tmp_path, text, where):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(InvalidInput) as e:
        load_scenarios(p)
    assert str(p) in str(e.value) and where in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_a_malformed_scenario_file_with_exit_2(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("schema: harness-serving-scenarios/v1\nscenarios: [{name: a}]\n")
    run = subprocess.run([sys.executable, "-m", "harness", "probe", "--model", "fixture:tiny-qwen35", "--only", "serving",
                          "--scenarios", str(p), "--ledger", str(tmp_path / "l.jsonl")], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and str(p) in run.stderr and "Traceback" not in run.stderr


def test_the_cli_serving_probe_fails_a_mutant_with_its_reproducer(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent("""\
        schema: harness-serving-scenarios/v1
        scenarios:
          - name: reuse
            why: a slot reused after a finished request
            requests:
              - {id: a, prompt: [{prompt: 0, tokens: 40}], n_tokens: 4}
              - {id: b, prompt: [{prompt: 1, tokens: 40}], n_tokens: 4, arrival: {after: a, tokens: 4}}
            expect: {slot_reuse: [a, b]}
        """))
    run = subprocess.run([sys.executable, "-m", "harness", "probe", "--candidate", "mutant:serve-slot-not-reset", "--model",
                          "fixture:tiny-qwen35", "--only", "serving", "--scenarios", str(p), "--ledger", str(tmp_path / "l.jsonl")],
                         capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    out = " ".join((run.stdout + run.stderr).split())
    assert "scenario 'reuse', request 'b'" in out and "--only serving" in out
    assert f"--scenarios {p.resolve()}" in out  # the reproducer runs the same scenarios
    receipt = json.loads(next((tmp_path / "receipts").rglob("*.json")).read_text())
    serving = next(x for x in receipt["probes"] if x["name"] == "serving")
    assert serving["details"]["scenario_file"]["path"] == str(p.resolve()) and len(serving["details"]["scenario_file"]["sha256"]) == 64


# -- op serve over protocol 2 ----------------------------------------------------------------

FAKE = """
import json, sys
import numpy as np
from harness.engines.oracle import load_oracle
from harness.engines.oracle.serving import ServingScheduler
from harness.engines.serving import Arrival, ServeRequest, ServeScenario
MODE = sys.argv[1]
oracle = None
for line in sys.stdin:
    req = json.loads(line)
    out = req["out_dir"]
    oracle = oracle or load_oracle(req["model"])
    if req["op"] == "generate":
        json.dump(oracle.generate(req["tokens"], req["n_tokens"]), open(out + "/tokens.json", "w"))
        files = ["tokens.json"]
    elif req["op"] == "logits":
        np.save(out + "/logits.npy", np.concatenate([b for _, b in oracle.logits(req["tokens"])]))
        files = ["logits.npy"]
    else:
        sc = ServeScenario(req["name"], [ServeRequest(r["id"], r["tokens"], r["n_tokens"], Arrival(**r["arrival"]), r["abort_after"],
                                                      r["continues"], r["force"]) for r in req["requests"]])
        res = ServingScheduler(oracle).run(sc)
        rows, doc, at = [], {"requests": [], "steps": []}, 0
        for r in res.requests.values():
            n = r.n_rows()
            rows.append(r.rows(0, n))
            doc["requests"].append({"id": r.id, "prompt": r.prompt, "tokens": r.tokens, "slot": r.slot, "cached": r.cached,
                                    "aborted": r.aborted, "logits": {"start": r.logits_start, "row": at, "rows": n}})
            at += n
        doc["steps"] = [{"index": s.index, "entries": [{"request": e.request, "slot": e.slot, "fed": e.fed, "emitted": e.emitted}
                                                       for e in s.entries]} for s in res.steps]
        if MODE == "missing-request":
            doc["requests"].pop(); rows.pop()
        elif MODE == "steps-out-of-order":
            doc["steps"][0]["index"], doc["steps"][1]["index"] = 1, 0
        elif MODE == "arrival-not-honoured":
            doc["steps"][0]["entries"].append({"request": doc["requests"][-1]["id"], "slot": doc["requests"][-1]["slot"], "fed": 0, "emitted": 0})
        elif MODE == "token-out-of-vocab":
            doc["requests"][0]["tokens"][0] = 10 ** 6
        elif MODE == "slot-not-integer":
            doc["requests"][0]["slot"] = "zero"
        json.dump(doc, open(out + "/serve.json", "w"))
        np.save(out + "/serve_logits.npy", np.concatenate(rows).astype(np.float32))
        files = ["serve.json", "serve_logits.npy"]
    print(json.dumps({"id": req["id"], "ok": True, "files": files}), flush=True)
"""
MODES = ("good", "missing-request", "steps-out-of-order", "arrival-not-honoured", "token-out-of-vocab", "slot-not-integer")


@pytest.fixture()
def fakes(tmp_path, monkeypatch):
    persistent.close_all()
    script = tmp_path / "fake_serve_engine.py"
    script.write_text(textwrap.dedent(FAKE))
    tables = [f'[engines.{m}]\ncommand = ["{{python}}", "{script}", "{m}"]\nprotocol = 2\ntimeout_s = 120\n'
              'capabilities = ["serve", "generate", "chunks"]\n' for m in MODES]
    cfg = tmp_path / "harness.toml"
    cfg.write_text("\n".join(tables))
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    yield
    persistent.close_all()


def test_op_serve_over_protocol_2_passes_a_correct_engine(fakes):
    eng = load_command_engine("good", fx.build("tiny-qwen35"))
    r = probe_serving(eng, _prompts(eng.n_vocab), F64, _scenarios(("slot-reuse-finished", "concurrency-3")), context_length=4096)
    assert r.verdict is Verdict.PASS, r.reason
    assert persistent.STARTS and max(persistent.STARTS.values()) >= 2  # the solo runs ran on the engine started afresh


@pytest.mark.parametrize("mode, message", [
    ("missing-request", "serve reply has no request 'c3'"),
    ("steps-out-of-order", "serve step log out of order"),
    ("arrival-not-honoured", "before request 'c2' had emitted"),
    ("token-out-of-vocab", "generated tokens outside the vocabulary"),
    ("slot-not-integer", "has slot 'zero', not a non-negative integer"),
])
def test_each_malformed_serve_reply_is_one_engine_error(fakes, mode, message):
    sc = _scenarios(("concurrency-3",))[0]
    if mode == "arrival-not-honoured":  # c3 arrives after c2 has emitted 2 tokens, but the log runs it at step 0
        sc.requests[2]["arrival"] = {"after": "c2", "tokens": 2}
    eng = load_command_engine(mode, fx.build("tiny-qwen35"))
    with pytest.raises(EngineError) as e:
        check_serve_result(sc.resolve(_prompts(eng.n_vocab)), eng.serve(sc.resolve(_prompts(eng.n_vocab))), eng.n_vocab, eng.info.name)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_intent_reads_the_step_log():
    sc = _scenarios(("slot-reuse-finished",))[0]
    oracle = load_oracle(fx.build("tiny-qwen35"))
    res = ServingScheduler(oracle).run(sc.resolve(_prompts(oracle.n_vocab)))
    assert intent_missing(sc, res) is None
    moved = ServeResult({k: v for k, v in res.requests.items()}, res.steps)
    moved.requests["b"].slot = 3
    assert "did not reuse the slot" in intent_missing(sc, moved)
    assert isinstance(ServeScenario("x", []).requests, list) and json.dumps(sc.resolve(_prompts(oracle.n_vocab)).to_json())


@pytest.mark.slow
@pytest.mark.parametrize("model", ["trained-qwen35", "trained-qwen35moe"])
def test_the_serving_oracle_passes_every_shipped_scenario(model):
    """Acceptance: every shipped scenario, multi-turn to 4,096 positions included, on a dense and
    an MoE fixture (pytest -m slow tests/test_serving_probe.py; minutes)."""
    eng = load_oracle(fx.build(model))  # fx.build resolves a committed trained fixture too
    r = probe_serving(eng, _prompts(eng.n_vocab), F64, load_scenarios(), context_length=eng.hp.context_length)
    assert r.verdict is Verdict.PASS, r.reason
    assert all(row["verdict"] == "PASS" for row in r.details["scenarios"])
