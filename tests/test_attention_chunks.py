"""The bf16-attention mutant's attention in query chunks (issue 56: no [T, T] at long contexts)."""

from __future__ import annotations

import numpy as np


def test_the_bf16_attention_mutant_takes_its_queries_in_chunks(monkeypatch):
    """mutant:attn-bf16-multi-token held [H_kv, G, T, T] scores (issue 56: a long prompt's
    attention must stay bounded); in chunks of queries it gives the values of one chunk."""
    from harness.engines import mutants

    rng = np.random.default_rng(5)
    t, h, h_kv, d = 300, 4, 2, 16
    q, k, v = rng.standard_normal((t, h, d)), rng.standard_normal((t, h_kv, d)), rng.standard_normal((t, h_kv, d))
    pos = np.arange(t)
    whole = mutants._attention_bf16(q, k, v, pos, pos, d ** -0.5)
    sizes = []
    real_einsum = np.einsum
    monkeypatch.setattr(mutants, "ATTENTION_SCORE_BYTES", 8 * h * t * 7)  # 7 query rows of scores a chunk
    monkeypatch.setattr(mutants.np, "einsum", lambda spec, *ops: sizes.append(ops[0].shape[0]) or real_einsum(spec, *ops))
    chunked = mutants._attention_bf16(q, k, v, pos, pos, d ** -0.5)
    assert max(sizes) <= 7 and np.array_equal(whole, chunked)
