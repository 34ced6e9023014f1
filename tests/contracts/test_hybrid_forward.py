"""Bound tests of contracts/qwen35-hybrid-forward-v1.yaml: the hybrid forward pass of the candidate.

The layer schedule, pre-norm residual blocks, gated attention (output gate, QK-norm, partial
rope, GQA), MoE routing and the shared expert, finiteness and shapes, the final norm, and
per-layer agreement with the float64 oracle (``harness.measure.metrics.compare_activations``). Each op is
recomputed from the candidate's own inputs to it and the file's weights. Subject:
``candidate_engine`` on ``harness_model_path``.
"""

from __future__ import annotations

import numpy as np
import pytest
from contract_helpers import SHORT, assert_close, attention_layers, need

from harness.measure.metrics import compare_activations
from harness.engines.oracle.qwen35 import (
    causal_attention,
    imrope_positions,
    rmsnorm,
    rope_neox_partial,
    sigmoid,
    split_query_gate,
)
from harness.engines.oracle.qwen35moe import moe_experts

pytestmark = pytest.mark.contract

RESIDUAL_STREAM = ("attn_norm", "attn_residual", "attn_post_norm", "ffn_out", "l_out")


def _rows(x: np.ndarray, t: int = SHORT) -> np.ndarray:
    return np.reshape(x, (t, -1))


def _block_input(acts, il: int) -> np.ndarray:
    return _rows(need(acts, "model.input_embed" if il == 0 else f"l_out-{il - 1}")[0])


def _mixer_name(acts, il: int) -> str | None:
    """The mixer output the candidate produced in layer il (None: it ran no mixer there, which
    QHF-INV-001 judges)."""
    return f"linear_attn_out-{il}" if f"linear_attn_out-{il}" in acts else f"attn_output-{il}" if f"attn_gated-{il}" in acts else None


def _mixer_output(acts, il: int, like: np.ndarray) -> np.ndarray:
    name = _mixer_name(acts, il)
    return np.zeros_like(like) if name is None else _rows(acts[name])


def test_layer_schedule(subject_acts, hp, where):
    """QHF-INV-001: layer il runs Gated DeltaNet iff (il + 1) % full_attention_interval != 0
    (or attention.recurrent_layers says so), full attention otherwise, and never both."""
    interval = hp.full_attention_interval
    if interval:
        want = tuple((il + 1) % interval != 0 for il in range(hp.n_layer))
        assert hp.recurrent == want, f"QHF-INV-001: the file's schedule {hp.recurrent} is not the interval-{interval} rule {want}"
    acts = subject_acts(SHORT)
    for il in range(hp.n_layer):
        gdn, attn = f"linear_attn_out-{il}" in acts, f"attn_gated-{il}" in acts
        kind = "Gated DeltaNet" if hp.is_recurrent(il) else "full attention"
        ran = {(True, False): "Gated DeltaNet", (False, True): "full attention", (True, True): "both mixers", (False, False): "no mixer"}[(gdn, attn)]
        assert ran == kind, (
            f"QHF-INV-001 layer {il}: the schedule says {kind} (full_attention_interval {interval}) but the candidate ran {ran} "
            f"({where}); likely cause: schedule computed as il % interval == 0 (off by one), or the MTP block counted as a trunk layer"
        )


def test_sublayer_shapes(subject_acts, hp, where):
    """QHF-INV-002: every sublayer preserves the residual stream's shape [T, n_embd]."""
    acts = subject_acts(SHORT)
    for il in range(hp.n_layer):
        names = [f"{op}-{il}" for op in RESIDUAL_STREAM] + [n for n in [_mixer_name(acts, il)] if n]
        for name, a in zip(names, need(acts, *names)):
            assert np.size(a) == SHORT * hp.n_embd and np.shape(a)[0] == SHORT, (
                f"QHF-INV-002 layer {il}: {name} has shape {np.shape(a)}, expected [{SHORT}, {hp.n_embd}] ({where}); "
                "likely cause: positions dropped (last-token-only path used for prefill) or a projection of the wrong width"
            )
    (rn,) = need(acts, "result_norm")
    assert np.shape(rn) == (SHORT, hp.n_embd), f"QHF-INV-002: result_norm has shape {np.shape(rn)}, expected [{SHORT}, {hp.n_embd}] ({where})"


def test_pre_norm(subject_acts, hp, weight, tolerance, where):
    """QHF-INV-003: attn_norm-N = rmsnorm(block input) · attn_norm and attn_post_norm-N =
    rmsnorm(attn_residual-N) · post_attention_norm (the file stores 1 + w; no further +1)."""
    rel = tolerance("QHF-INV-003")["rel"]
    acts = subject_acts(SHORT)
    cause = "+1 added to a norm weight the converter already shifted, or the norm applied after the sublayer"
    for il in range(hp.n_layer):
        an, resid, post = (_rows(a) for a in need(acts, f"attn_norm-{il}", f"attn_residual-{il}", f"attn_post_norm-{il}"))
        assert_close(f"QHF-INV-003 layer {il}: attn_norm-{il}", an, rmsnorm(_block_input(acts, il), weight(f"blk.{il}.attn_norm.weight"), hp.rms_eps), rel, where, cause)
        assert_close(f"QHF-INV-003 layer {il}: attn_post_norm-{il}", post, rmsnorm(resid, weight(f"blk.{il}.post_attention_norm.weight"), hp.rms_eps), rel, where, cause)


def test_residual(subject_acts, hp, tolerance, where):
    """QHF-CON-004: attn_residual-N = mixer output + block input; l_out-N = ffn_out-N +
    attn_residual-N."""
    rel = tolerance("QHF-CON-004")["rel"]
    acts = subject_acts(SHORT)
    for il in range(hp.n_layer):
        resid, ffn, out = (_rows(a) for a in need(acts, f"attn_residual-{il}", f"ffn_out-{il}", f"l_out-{il}"))
        assert_close(f"QHF-CON-004 layer {il}: attn_residual-{il} vs mixer output + block input", resid, _mixer_output(acts, il, resid) + _block_input(acts, il),
                     rel, where, "residual taken from the normed input instead of the block input, or scaled")
        assert_close(f"QHF-CON-004 layer {il}: l_out-{il} vs ffn_out + attn_residual", out, ffn + resid, rel, where,
                     "FFN residual added to the wrong tensor (e.g. the post-attention norm output)")


def test_attention_output_gate(subject_acts, hp, tolerance, where):
    """QHF-EQ-005: attn_gated-N = attn_pregate-N ⊙ sigmoid(gate), the gate being the second
    head_dim of each head's 2·head_dim slice of attn_q's output (Qcur_full)."""
    rel = tolerance("QHF-EQ-005")["rel"]
    acts = subject_acts(SHORT)
    for il in attention_layers(acts, hp):
        q_full, pregate, gated = need(acts, f"Qcur_full-{il}", f"attn_pregate-{il}", f"attn_gated-{il}")
        _, gate = split_query_gate(_rows(q_full), hp.n_head, hp.head_dim)
        want = _rows(pregate) * sigmoid(_rows(gate))
        assert_close(f"QHF-EQ-005 layer {il}: attn_gated-{il} vs attn_pregate ⊙ sigmoid(gate)", _rows(gated), want, rel, where,
                     "output gate dropped, gate taken from the second half of attn_q instead of per head, or no sigmoid")


def test_qk_norm(subject_acts, hp, weight, tolerance, where):
    """QHF-EQ-006: Qcur_normed-N = rmsnorm_per_head(query) · attn_q_norm (query = first
    head_dim of each head's slice of attn_q · x); Kcur_normed-N = rmsnorm_per_head(attn_k · x) ·
    attn_k_norm, with x = attn_norm-N."""
    rel = tolerance("QHF-EQ-006")["rel"]
    acts = subject_acts(SHORT)
    cause = "QK-norm skipped, +1 added to attn_q_norm/attn_k_norm again, or query/gate split as halves"
    for il in attention_layers(acts, hp):
        q_full, qn, kn, x = need(acts, f"Qcur_full-{il}", f"Qcur_normed-{il}", f"Kcur_normed-{il}", f"attn_norm-{il}")
        query, _ = split_query_gate(_rows(q_full), hp.n_head, hp.head_dim)
        want_q = rmsnorm(query, weight(f"blk.{il}.attn_q_norm.weight"), hp.rms_eps)
        assert_close(f"QHF-EQ-006 layer {il}: Qcur_normed-{il}", np.reshape(qn, want_q.shape), want_q, rel, where, cause)
        k = (_rows(x) @ weight(f"blk.{il}.attn_k.weight").T).reshape(SHORT, hp.n_head_kv, hp.head_dim)
        want_k = rmsnorm(k, weight(f"blk.{il}.attn_k_norm.weight"), hp.rms_eps)
        assert_close(f"QHF-EQ-006 layer {il}: Kcur_normed-{il}", np.reshape(kn, want_k.shape), want_k, rel, where, cause)


def test_partial_rope(subject_acts, hp, tolerance, where):
    """QHF-EQ-007: Qcur-N / Kcur-N = NeoX rotary on the first n_rot dims of Qcur_normed-N /
    Kcur_normed-N (pairs (i, i + n_rot/2), angle pos · θ^(−2i/n_rot)); the other dims unchanged."""
    rel = tolerance("QHF-EQ-007")["rel"]
    acts = subject_acts(SHORT)
    pair_pos = imrope_positions(np.arange(SHORT), hp.n_rot, hp.rope_sections)
    for il in attention_layers(acts, hp):
        for name, heads in (("Q", hp.n_head), ("K", hp.n_head_kv)):
            normed, roped = need(acts, f"{name}cur_normed-{il}", f"{name}cur-{il}")
            normed = np.reshape(normed, (SHORT, heads, hp.head_dim))
            want = rope_neox_partial(normed, pair_pos, hp.n_rot, hp.rope_freq_base)
            assert_close(f"QHF-EQ-007 layer {il}: {name}cur-{il} vs rope on the first {hp.n_rot} of {hp.head_dim} dims", np.reshape(roped, want.shape), want,
                         rel, where, "rope over the whole head (partial rotary factor ignored), GPT-J pairing (2i, 2i+1), or a wrong θ")


def test_gqa_attention(subject_acts, hp, tolerance, where):
    """QHF-EQ-008: attn_pregate-N = causal softmax attention of Qcur, Kcur, Vcur with scale
    1/sqrt(head_dim), query head i reading KV head i // (n_head / n_head_kv)."""
    rel = tolerance("QHF-EQ-008")["rel"]
    acts = subject_acts(SHORT)
    pos = np.arange(SHORT)
    for il in attention_layers(acts, hp):
        q, k, v, pre = need(acts, f"Qcur-{il}", f"Kcur-{il}", f"Vcur-{il}", f"attn_pregate-{il}")
        shape = (SHORT, -1, hp.head_dim)
        want = causal_attention(np.reshape(q, shape), np.reshape(k, shape), np.reshape(v, shape), pos, pos, 1.0 / np.sqrt(hp.head_dim))
        assert_close(f"QHF-EQ-008 layer {il}: attn_pregate-{il} vs causal GQA attention", _rows(pre), _rows(want), rel, where,
                     "KV heads mapped tiled (i % n_kv) instead of grouped, a non-causal mask, or a scale other than 1/sqrt(head_dim)")


AGREEMENT_OPS = ("attn_norm", "linear_attn_out", "attn_output", "attn_residual", "attn_post_norm", "ffn_out", "l_out", "result_norm", "result_output")


def test_layers_agree_with_oracle(subject_acts, harness_model_path, probe_tokens, tolerance, where):
    """QHF-EQ-009: every residual-stream activation of every layer agrees with the float64
    oracle on the same model and tokens (per tensor NMSE and cosine)."""
    from harness.engines.oracle import load_oracle

    tol = tolerance("QHF-EQ-009")
    ref = load_oracle(harness_model_path).activations(probe_tokens[:SHORT], names=set(AGREEMENT_OPS))
    rows = compare_activations(ref, subject_acts(SHORT))
    bad = [r for r in rows if r["status"] != "ok" or r["nmse"] > tol["nmse"] or r["cosine"] < tol["cosine"]]
    assert not bad, (
        f"QHF-EQ-009: {len(bad)} of {len(rows)} activations disagree with the oracle; first divergence {bad[0]['name']} "
        f"(status {bad[0]['status']}, NMSE {bad[0]['nmse']}, cosine {bad[0]['cosine']}, worst position {bad[0]['worst_position']}; "
        f"bars NMSE ≤ {tol['nmse']:g}, cosine ≥ {tol['cosine']}) ({where}); likely cause: the op that produces {bad[0]['op']} in layer {bad[0]['layer']}"
    )


def _moe_layers(hp) -> list[int]:
    if not hp.is_moe:
        pytest.skip(f"{hp.arch} has no MoE FFN; run on a MoE model: pytest tests/contracts --model fixture:trained-qwen35moe (harness discharge runs it on fixture:tiny-qwen35moe)")
    return list(range(hp.n_layer))


def test_moe_routing(subject_acts, hp, weight, tolerance, where):
    """QHF-MOE-010: router probabilities softmax(ffn_gate_inp · x), the top expert_used_count
    experts, their weights renormalized to sum 1, and ffn_moe_out = Σ weight · SwiGLU expert(x)
    with x = attn_post_norm-N."""
    rel = tolerance("QHF-MOE-010")["rel"]
    acts = subject_acts(SHORT)
    for il in _moe_layers(hp):
        x, probs, topk, out = need(acts, f"attn_post_norm-{il}", f"ffn_moe_probs-{il}", f"ffn_moe_topk-{il}", f"ffn_moe_out-{il}")
        logits = _rows(x) @ weight(f"blk.{il}.ffn_gate_inp.weight").T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        assert_close(f"QHF-MOE-010 layer {il}: ffn_moe_probs-{il} vs softmax(ffn_gate_inp · x)", _rows(probs), p, rel, where, "router not a softmax over all experts")
        topk = np.asarray(topk, dtype=np.int64).reshape(SHORT, hp.n_expert_used)
        chosen = np.sort(np.take_along_axis(p, topk, axis=1), axis=1)
        best = np.sort(np.sort(p, axis=1)[:, -hp.n_expert_used:], axis=1)
        assert_close(f"QHF-MOE-010 layer {il}: probabilities of the selected experts vs the top {hp.n_expert_used}", chosen, best, rel, where, "top-k not the most probable experts")
        w = np.take_along_axis(p, topk, axis=1)
        w /= w.sum(axis=1, keepdims=True)
        want = moe_experts(_rows(x), topk, w, weight(f"blk.{il}.ffn_gate_exps.weight"), weight(f"blk.{il}.ffn_up_exps.weight"), weight(f"blk.{il}.ffn_down_exps.weight"))
        assert_close(f"QHF-MOE-010 layer {il}: ffn_moe_out-{il} vs Σ renormalized weight · expert(x)", _rows(out), want, rel, where,
                     "top-k weights not renormalized to sum 1 (norm_w off), or softmax taken after the top-k over a different set")


def test_shared_expert_gate(subject_acts, hp, weight, tolerance, where):
    """QHF-MOE-011: ffn_shexp_gated-N = ffn_shexp-N · sigmoid(ffn_gate_inp_shexp · x) (one
    scalar per token) and ffn_out-N = ffn_moe_out-N + ffn_shexp_gated-N."""
    rel = tolerance("QHF-MOE-011")["rel"]
    acts = subject_acts(SHORT)
    for il in _moe_layers(hp):
        x, shexp, gated, moe_out, ffn = (_rows(a) for a in need(acts, f"attn_post_norm-{il}", f"ffn_shexp-{il}", f"ffn_shexp_gated-{il}", f"ffn_moe_out-{il}", f"ffn_out-{il}"))
        gate = sigmoid(x @ weight(f"blk.{il}.ffn_gate_inp_shexp.weight").reshape(-1, 1))
        assert_close(f"QHF-MOE-011 layer {il}: ffn_shexp_gated-{il} vs ffn_shexp · sigmoid(ffn_gate_inp_shexp · x)", gated, shexp * gate, rel, where,
                     "shared-expert gate ignored, applied without sigmoid, or taken per channel")
        assert_close(f"QHF-MOE-011 layer {il}: ffn_out-{il} vs ffn_moe_out + ffn_shexp_gated", ffn, moe_out + gated, rel, where, "shared expert not added")


def test_activations_finite(subject_acts, where):
    """QHF-BND-012: every named activation of every layer is finite."""
    acts = subject_acts(SHORT)
    for name, a in acts.items():
        bad = np.argwhere(~np.isfinite(a))
        assert bad.size == 0, (
            f"QHF-BND-012: {name} holds {len(bad)} non-finite values, first at index {tuple(int(i) for i in bad[0])} ({where}); "
            "likely cause: overflow in exp (decay or softmax), a division by a zero norm, or uninitialised memory"
        )


def test_final_norm(subject_acts, hp, weight, tolerance, where):
    """QHF-EQ-013: result_norm = rmsnorm(l_out of the last trunk layer) · output_norm (stored
    as 1 + w)."""
    rel = tolerance("QHF-EQ-013")["rel"]
    acts = subject_acts(SHORT)
    last, rn = need(acts, f"l_out-{hp.n_layer - 1}", "result_norm")
    assert_close("QHF-EQ-013: result_norm vs rmsnorm(l_out) · output_norm", _rows(rn), rmsnorm(_rows(last), weight("output_norm.weight"), hp.rms_eps), rel, where,
                 "output_norm's +1 missing (w − 1 applied) or applied twice, or the norm taken over an MTP block's output")
