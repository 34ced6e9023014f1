"""Fixtures with Qwen3.5's real head sizes (issue 56): attention heads of 256 with 64 rotary dims,
DeltaNet key and value heads of 128, conv 4; one with as many value heads as key heads, one with
twice as many, and an MoE one. They lint clean, the oracle and llama.cpp agree on them, and trunk
mutants that touch those shapes still FAIL there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.fixtures import synthetic as fx
from harness.model.gguf_model import GGUFModel
from harness.model.lint import lint_path

REPO = Path(__file__).resolve().parents[1]

SHAPES = {  # name: (arch, n_k heads = ssm_n_group, n_v heads = ssm_dt_rank)
    "real-heads-qwen35": ("qwen35", 2, 4),
    "real-heads-qwen35-kv1": ("qwen35", 2, 2),
    "real-heads-qwen35moe": ("qwen35moe", 2, 4),
}


def test_the_real_head_fixtures_are_the_three_named():
    assert set(fx.REAL_HEAD_FIXTURES) == set(SHAPES) and all(n in fx.SPECS for n in SHAPES)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_real_head_fixture_reads_back_qwen35s_head_sizes_and_lints_clean(name):
    path = fx.build(name)
    hp = GGUFModel(path).hparams
    arch, n_k, n_v = SHAPES[name]
    assert (hp.arch, hp.head_dim, hp.n_rot, hp.ssm_d_state, hp.ssm_d_conv) == (arch, 256, 64, 128, 4)
    assert (hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_inner // hp.ssm_dt_rank) == (n_k, n_v, 128)
    assert tuple(hp.rope_sections)[:3] == (11, 11, 10) and hp.n_embd == 128
    assert GGUFModel(path).metadata(f"{arch}.context_length") == 32_768  # a long-context file lint accepts
    report = lint_path(path)
    assert not report.errors, [f.code for f in report.errors]


def _parity(model: str, candidate: str, prompts: Path, reference: str = "llama.cpp") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "parity", "--model", f"fixture:{model}", "--candidate", candidate,
                           "--reference", reference, "--prompts", str(prompts), "--greedy-tokens", "0", "--no-evidence"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("rh") / "p.jsonl"
    p.write_text(json.dumps({"id": "p", "tokens": [(37 * i + 11) % 500 for i in range(160)]}) + "\n")
    return p


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_oracle_passes_against_llama_cpp_on_real_heads(name, prompts):
    r = _parity(name, "oracle", prompts)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "PASS" in r.stdout


def test_llama_cpp_passes_against_the_oracle_on_real_heads(prompts):
    r = _parity("real-heads-qwen35moe", "llama.cpp", prompts, reference="oracle")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("name, mutant", [
    ("real-heads-qwen35", "rope-full-head"),        # 64 of 256 dims rotated: all 256 is wrong
    ("real-heads-qwen35", "gdn-state-per-k-head"),  # n_v 4 > n_k 2: a state per key head is wrong
    ("real-heads-qwen35", "gqa-kv-tiled"),
    ("real-heads-qwen35-kv1", "gdn-l2norm-skipped"),
    ("real-heads-qwen35moe", "moe-weights-unnormalized"),
])
def test_trunk_mutants_fail_on_real_heads(name, mutant, prompts):
    r = _parity(name, f"mutant:{mutant}", prompts)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_mutant_whose_arithmetic_overflows_fails_with_non_finite_logits_not_an_engine_error():
    """gdn-l2norm-skipped overflows float64 on real-heads-qwen35's 1,026-token shipped prompt: a
    broken engine emits inf/NaN there, so parity FAILs it (exit 1) instead of an ENGINE-ERROR
    about the oracle (exit 3, before)."""
    r = subprocess.run([sys.executable, "-m", "harness", "parity", "--model", "fixture:real-heads-qwen35",
                        "--candidate", "mutant:gdn-l2norm-skipped", "--greedy-tokens", "0", "--no-evidence", "--no-localize",
                        "--json"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    gated = json.loads(r.stdout)["gated"]
    assert gated["verdict"] == "FAIL" and gated["nonfinite_positions"] >= 1026


class _Overflowing:
    """Stands in for the oracle: its first block, then the overflow error (or another one)."""

    logit_block, n_vocab = 4, 3

    def __init__(self, message: str, blocks: int = 0):
        self.message, self.blocks = message, blocks

    def logits(self, tokens, chunks=None, first_row=0):
        import numpy as np
        for b in range(self.blocks):
            yield first_row + 4 * b, np.zeros((4, 3), np.float32)
        from harness.errors import EngineError
        raise EngineError(self.message)


def test_non_finite_logits_stand_for_the_rows_after_an_overflow_and_other_errors_pass_through():
    import numpy as np
    from harness.engines.mutants import _NonFiniteLogits
    from harness.errors import EngineError

    class M(_NonFiniteLogits, _Overflowing):
        pass

    blocks = list(M("oracle: floating-point overflow encountered in multiply in layer 2", blocks=1).logits(list(range(10)), first_row=1))
    assert [(s, b.shape) for s, b in blocks] == [(1, (4, 3)), (5, (4, 3)), (9, (1, 3))]
    assert np.isfinite(blocks[0][1]).all() and np.isnan(blocks[1][1]).all() and np.isnan(blocks[2][1]).all()
    with pytest.raises(EngineError, match="outside the vocabulary"):
        list(M("oracle: token id 9 is outside the vocabulary [0, 3)").logits([9]))
