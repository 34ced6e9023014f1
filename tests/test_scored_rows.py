"""``harness parity --text FILE --ctx N --score-second-half`` (issue 58): only each window's
positions from N/2 on are computed (where an engine can: the llama.cpp worker, the example engine
through capability ``first_row``, the oracle's LM head), moved and judged, as ``llama-perplexity``
asks llama.cpp for a window's second half. The rows asked for alone must be the bytes of the same
rows of a full request; an engine that cannot be asked gets the same verdict, its rows cut by the
harness; the gates count the judged positions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import fresh_engine_processes  # noqa: F401 (a fixture)

from harness.engines.base import from_row, gather, logits_each
from harness.engines.command import CommandEngine, CommandSpec
from harness.engines.llamacpp import LlamaCppEngine
from harness.engines.timing import TimedEngine
from harness.errors import EngineError
from harness.fixtures import synthetic as fx
from harness.measure.prompts import PromptTokens
from harness.model.gguf_model import GGUFModel
from harness.paths import DEFAULT_PROMPTS
from harness.runs import reference_cache
from harness.runs.parity import run_cell

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [(7919 * i + 13) % 515 for i in range(300)]  # tiny-qwen35: V = 515


def _example(capabilities: list[str]) -> CommandEngine:
    """The example engine (examples/llamacpp_engine.py) on fixture:tiny-qwen35 declaring ``capabilities``."""
    spec = CommandSpec("ex", ["{python}", str(ROOT / "examples" / "llamacpp_engine.py"), "--serve"], 120.0, capabilities, protocol=2)
    return CommandEngine(spec, fx.build("tiny-qwen35"), block_size=256)


def _rows(blocks) -> tuple[list[int], np.ndarray]:
    got = list(blocks)
    return [s for s, _ in got], np.concatenate([b for _, b in got])


def test_from_row_cuts_blocks_at_the_first_row_keeping_positions():
    blocks = [(0, np.arange(6.0).reshape(3, 2)), (3, np.arange(6.0, 12.0).reshape(3, 2)), (6, np.arange(12.0, 14.0).reshape(1, 2))]
    starts, rows = _rows(from_row(iter(blocks), 4))
    assert starts == [4, 6] and rows[:, 0].tolist() == [8.0, 10.0, 12.0]


@pytest.mark.parametrize("settings", [{}, {"n_ubatch": 7}, {"n_batch": 64, "n_ubatch": 32}])
def test_the_worker_asked_from_a_row_gives_the_bytes_of_those_rows_of_a_full_request(settings):
    eng = LlamaCppEngine(fx.build("tiny-qwen35")).with_settings(**settings)
    full = gather(eng.logits(TOKENS), len(TOKENS))
    starts, part = _rows(eng.logits(TOKENS, first_row=150))
    assert starts[0] == 150 and part.shape == (150, eng.n_vocab)
    assert part.tobytes() == full[150:].tobytes()
    # a prompt set in one worker run, each prompt from its own row, through the timing wrapper
    each = logits_each(TimedEngine(eng), [TOKENS, TOKENS[:100]], [150, 50])
    a, b = _rows(next(each)), _rows(next(each))
    assert next(each, None) is None
    assert (a[0][0], b[0][0]) == (150, 50)
    assert a[1].tobytes() == full[150:].tobytes() and b[1].tobytes() == gather(eng.logits(TOKENS[:100]))[50:].tobytes()


def test_the_example_engine_declaring_first_row_gives_those_bytes_and_one_that_does_not_is_cut(fresh_engine_processes):
    full = gather(_example(["chunks", "logits_ring"]).logits(TOKENS), len(TOKENS))
    for caps in (["logits_ring", "first_row"], ["first_row"], ["logits_ring"], []):  # ring or logits.npy; asked or cut
        eng = _example(caps)
        starts, part = _rows(logits_each(eng, [TOKENS], [200]).__next__())
        assert starts[0] == 200 and part.tobytes() == full[200:].tobytes(), caps
        if "first_row" in caps and "logits_ring" not in caps:
            assert eng._reply_files == ["logits.npy", "info.json"]


def test_the_oracle_applies_its_lm_head_to_the_rows_asked_for_alone():
    from harness.engines.registry import resolve_engine

    oracle = resolve_engine("oracle", fx.build("tiny-qwen35"))
    full = gather(oracle.logits(TOKENS[:80]))
    starts, part = _rows(oracle.logits(TOKENS[:80], first_row=40))
    assert starts[0] == 40 and part.shape[0] == 40
    np.testing.assert_allclose(part, full[40:], rtol=0, atol=1e-6)


def test_a_candidate_that_cannot_be_asked_gets_the_same_verdict_and_numbers(fresh_engine_processes):
    model = GGUFModel(fx.build("tiny-qwen35"))
    prompts = [PromptTokens(f"text:WINDOW-{i}", TOKENS[i * 100:(i + 1) * 100], "text", 50, 50) for i in range(3)]
    ref = LlamaCppEngine(model.path)
    asked = run_cell(model, ref, _example(["logits_ring", "first_row"]), prompts, min_positions=64)
    cut = run_cell(model, ref, _example(["logits_ring"]), prompts, min_positions=64)
    assert asked.verdict == cut.verdict and asked.verdict.value == "PASS"
    assert asked.gate["positions"] == cut.gate["positions"] == 150  # 3 windows × their 50 judged positions
    assert asked.per_prompt == cut.per_prompt and [p["positions"] for p in asked.per_prompt] == [50, 50, 50]
    for k, v in asked.per_position.items():
        np.testing.assert_array_equal(v, cut.per_position[k], err_msg=k)
    assert asked.per_position["position"].min() == 50 and asked.per_position["position"].max() == 99
    # too few judged positions for the release gate: UNMEASURED, never PASS
    few = run_cell(model, ref, _example(["logits_ring", "first_row"]), prompts[:1], min_positions=64)
    assert few.verdict.value == "UNMEASURED" and few.gate["positions"] == 50


def test_the_reference_cache_keeps_a_partial_entry_apart_from_the_full_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_REFERENCE_CACHE", str(tmp_path / "cache"))
    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    info = eng.info.to_dict()
    assert reference_cache.cache_key("0" * 64, TOKENS, info)[0] != reference_cache.cache_key("0" * 64, TOKENS, info, 150)[0]
    assert "first_row" not in reference_cache.cache_key("0" * 64, TOKENS, info)[1]  # the keys made before it are unchanged
    full = gather(eng.logits(TOKENS))
    cached = reference_cache.wrap(eng, "0" * 64)
    assert gather(next(logits_each(cached, [TOKENS]))).tobytes() == full.tobytes()  # a full entry first
    for hits in (0, 1):  # then the partial one: a miss (not the full entry's rows), then a hit
        starts, part = _rows(next(logits_each(cached, [TOKENS], [150])))
        assert starts[0] == 150 and part.tobytes() == full[150:].tobytes()
        assert cached._cache.hits == hits
    assert len(list((tmp_path / "cache").glob("*.f32"))) == 2


# ------------------------------------------------------------------------------ the command line


def _text(path: Path, chars: int = 800) -> Path:
    texts = [json.loads(line)["text"] for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]
    path.write_text("\n\n".join(t for t in texts if t)[:chars], encoding="utf-8")
    return path


def _cli(*args: str, tmp_path: Path, evidence: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "HARNESS_REFERENCE_CACHE": str(tmp_path / "cache")}
    where = ["--ledger", str(tmp_path / "ev" / "ledger.jsonl")] if evidence else ["--no-evidence"]
    return subprocess.run([sys.executable, "-m", "harness", "parity", "--model", "fixture:tiny-qwen35", *where,
                           "--greedy-tokens", "0", *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_score_second_half_without_text_is_one_line_invalid(tmp_path):
    r = _cli("--score-second-half", tmp_path=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        "harness: INVALID: --score-second-half: only with --text FILE (the second half of each window, as llama-perplexity scores it)")


def test_the_receipt_and_console_say_which_positions_were_judged(tmp_path, fresh_engine_processes):
    text = _text(tmp_path / "t.txt")
    r = _cli("--candidate", "command:example", "--text", str(text), "--ctx", "64", "--score-second-half", "--json", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    t = rec["prompts"]["text"]
    assert t["judged"]["from"] == 32 and t["judged"]["positions"] == t["windows"] * 32 == rec["gated"]["positions"]
    assert "llama-perplexity" in t["judged"]["why"] and rec["gated"]["verdict"] == "PASS"
    assert rec["prompts"]["positions"] == t["windows"] * 64  # the prompts' tokens, all decoded
    assert all(p["positions"] == 32 for p in rec["per_prompt"])
    assert rec["report_only"]["perplexity"]["positions"] == t["windows"] * 31  # the same positions as without the option
    plain = _cli("--candidate", "command:example", "--text", str(text), "--ctx", "64", tmp_path=tmp_path)
    assert "judged:" not in plain.stdout and "positions" in plain.stdout
    shown = _cli("--candidate", "command:example", "--text", str(text), "--ctx", "64", "--score-second-half", tmp_path=tmp_path,
                 evidence=True)
    assert shown.returncode == 0, shown.stderr
    assert f"judged: {t['windows'] * 32} positions, from position 32 of each window" in shown.stdout
    written = json.loads(next((tmp_path / "ev" / "receipts").glob("*/*.json")).read_text())  # the schema-checked receipt on disk
    assert written["prompts"]["text"]["judged"] == t["judged"] and written["gated"]["positions"] == t["windows"] * 32
    report = next((tmp_path / "ev").rglob("report.md")).read_text()
    assert f"Judged: {t['windows'] * 32} positions, from position 32 of each window" in report
    assert f"--text {text} --ctx 64 --score-second-half" in report  # the reproduce line asks for the same positions


def test_too_few_judged_positions_is_unmeasured_where_all_positions_pass(tmp_path, fresh_engine_processes):
    text = _text(tmp_path / "t.txt", 400)  # one window of 100 tokens on fixture:tiny-qwen35
    args = ("--candidate", "command:example", "--text", str(text), "--ctx", "100", "--json")
    whole, half = _cli(*args, tmp_path=tmp_path), _cli(*args, "--score-second-half", tmp_path=tmp_path)
    assert json.loads(whole.stdout)["prompts"]["text"]["windows"] == 1
    assert whole.returncode == 0 and json.loads(whole.stdout)["gated"]["verdict"] == "PASS"
    assert half.returncode == 5, half.stderr
    rec = json.loads(half.stdout)
    assert rec["gated"]["verdict"] == "UNMEASURED" and rec["gated"]["positions"] == 50


def test_an_engine_that_declares_first_row_and_returns_every_row_is_one_engine_error(tmp_path, fresh_engine_processes):
    script = tmp_path / "every_row.py"
    script.write_text("import json, sys\nimport numpy as np\nfor line in sys.stdin:\n    req = json.loads(line)\n"
                      "    np.save(req['out_dir'] + '/logits.npy', np.zeros((len(req['tokens']), 515), np.float32))\n"
                      "    print(json.dumps({'id': req['id'], 'ok': True, 'files': ['logits.npy']}), flush=True)\n")
    spec = CommandSpec("every-row", ["{python}", str(script)], 30.0, ["first_row"], protocol=2)
    eng = CommandEngine(spec, fx.build("tiny-qwen35"))
    with pytest.raises(EngineError, match=r"wrote logits of shape \(300, 515\); expected \[150, V\]"):
        list(next(logits_each(eng, [TOKENS], [150])))
    cut = CommandEngine(CommandSpec("every-row", ["{python}", str(script)], 30.0, [], protocol=2), fx.build("tiny-qwen35"))
    assert _rows(next(logits_each(cut, [TOKENS], [150])))[0][0] == 150  # not declared: sent the full request, cut here
