"""The oracle as referee where the reference is off it (issue 59, harness.runs.referee)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.engines.base import EngineInfo
from harness.engines.registry import resolve_engine
from harness.errors import Verdict
from harness.fixtures import synthetic as fx
from harness.judge import tiers
from harness.measure.prompts import load_prompt_set, tokenize_prompts
from harness.model.gguf_model import GGUFModel
from harness.runs.inputs import subject_of
from harness.runs.parity import compare_prompt, judge_cell, measure_cell
from harness.runs.explain import divergent_side
from harness.runs.referee import referee

pytestmark = pytest.mark.parity

RELEASE = {"min_cosine": {"value": 0.98}, "min_positions": {"value": 64}}
TARGET_PROMPT, TARGET_POS = 1, 17


class Noisy:
    """An engine whose logits are ``base``'s, except at one position of the prompt ``tokens``,
    where a permuted row stands in for a reference that is off the exact forward there."""

    def __init__(self, base, tokens, pos, name):
        self.base, self.tokens, self.pos, self.name = base, list(tokens), pos, name

    @property
    def info(self):
        return EngineInfo(name=self.name, version="test")

    @property
    def n_vocab(self):
        return self.base.n_vocab

    def logits(self, tokens, chunks=None):
        hit = list(tokens) == self.tokens[: len(tokens)] and len(tokens) > self.pos
        for start, block in self.base.logits(tokens, chunks):
            block = block.copy()
            if hit and start <= self.pos < start + block.shape[0]:
                block[self.pos - start] = np.random.default_rng(0).permutation(block[self.pos - start])
            yield start, block


@pytest.fixture(scope="module")
def cell():
    path = fx.build("tiny-qwen35")
    llama = resolve_engine("llama.cpp", path)
    oracle = resolve_engine("oracle", path)
    prompts = tokenize_prompts(load_prompt_set(None), llama)[:3]
    return GGUFModel(path), llama, oracle, prompts


def _judge(model, reference, candidate, oracle, prompts, with_referee):
    m = measure_cell(model, reference, candidate, prompts)
    ruling = (referee(m.per_position, 0.98, prompts, reference, candidate, oracle, m.candidate_info["name"] == "oracle",
                      m.n_vocab, compare_prompt) if with_referee else None)
    return judge_cell(m, RELEASE, None, subject_of(model, m.candidate_info), referee=ruling), ruling


def test_a_correct_candidate_passes_where_the_reference_is_off_the_oracle(cell):
    model, llama, oracle, prompts = cell
    ref = Noisy(llama, prompts[TARGET_PROMPT].tokens, TARGET_POS, "llama.cpp")
    before, _ = _judge(model, ref, oracle, oracle, prompts, with_referee=False)
    assert before.verdict is Verdict.FAIL and before.gate["failing_positions"] == 1  # the reference's noise alone FAILs it
    res, ruling = _judge(model, ref, oracle, oracle, prompts, with_referee=True)
    assert res.verdict is Verdict.PASS, res.message
    assert ruling.count == 1
    assert ruling.judged[0]["prompt"] == prompts[TARGET_PROMPT].id and ruling.judged[0]["position"] == TARGET_POS
    assert ruling.judged[0]["oracle_vs_reference"] < 0.98 and ruling.judged[0]["candidate_vs_oracle"] == 1.0
    rel = res.gate["release"]
    assert rel["oracle_referee"]["positions"] == 1  # the receipt counts the positions judged so
    assert "judged against the oracle instead" in rel["line"] and f"position {TARGET_POS}" in rel["line"]
    assert f"over {sum(len(p.tokens) for p in prompts) - 1} positions" in rel["line"]


def test_a_candidate_off_the_oracle_at_the_reference_noise_still_fails(cell):
    model, llama, oracle, prompts = cell
    ref = Noisy(llama, prompts[TARGET_PROMPT].tokens, TARGET_POS, "llama.cpp")
    # the candidate is off at the very position the reference is noisy, differently: not excused
    bad = Noisy(Noisy(oracle, prompts[TARGET_PROMPT].tokens, TARGET_POS, "x"), prompts[TARGET_PROMPT].tokens, TARGET_POS, "planted:twice")
    res, ruling = _judge(model, ref, bad, oracle, prompts, with_referee=True)
    assert ruling.count == 0 and len(ruling.reference_off) == 1
    assert res.verdict is Verdict.FAIL
    # the FAIL line says whose divergence it is, and names the command that localizes the reference
    assert "that divergence is the reference's" in res.message
    assert f"harness localize --candidate llama.cpp --model MODEL --prompt {prompts[TARGET_PROMPT].id}" in res.message


def test_the_divergent_side_is_the_reference_where_the_candidate_is_the_oracle_or_the_reference_is_off():
    cand = {"engines": {"candidate": {"name": "oracle"}, "reference": {"name": "llama.cpp"}}, "gated": {"release": {}}}
    assert divergent_side(cand) == "reference"
    other = {"engines": {"candidate": {"name": "mlx"}, "reference": {"name": "llama.cpp"}}, "gated": {"release": {}}}
    assert divergent_side(other) == "candidate"
    other["gated"]["release"]["oracle_referee"] = {"reference_off_oracle": [{"prompt": "non-ascii", "position": 82}]}
    assert divergent_side(other) == "reference"


def test_a_fault_where_the_reference_agrees_with_the_oracle_is_the_candidates(cell):
    model, llama, oracle, prompts = cell
    bad = Noisy(oracle, prompts[TARGET_PROMPT].tokens, TARGET_POS, "planted:scramble")
    res, ruling = _judge(model, llama, bad, oracle, prompts, with_referee=True)
    assert res.verdict is Verdict.FAIL
    assert ruling.count == 0 and ruling.reference_off == []
    assert "where the reference agrees with the oracle" in res.gate["release"]["line"]
