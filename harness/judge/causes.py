"""Likely causes of a first divergence, for verdict pages: what the op computes and which known
bug classes first diverge there.

The bug classes come from the mutant table (``harness.engines.mutants.SHOWS_FIRST_AT``: the layer
type and op where localization first finds each mutant, checked against real runs by
``tests/test_localize.py``), as ``harness.judge.reproducer.causes_first_at`` reads it for the
one-line failure messages; here each comes with its mutant and description. ``OPS`` says in a
line what each op of the Qwen3.5 forward computes (names as in llama.cpp's ``src/models/qwen35.cpp`` and
``delta-net-base.cpp``, weights as the GGUF tensor names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.engines.mutants import MUTANTS, SHOWS_FIRST_AT

OPS: dict[str, str] = {
    "model.input_embed": "token embedding lookup (token_embd)",
    "result_norm": "final RMSNorm before the output head (output_norm, with Qwen3.5's +1 weight shift)",
    "attn_norm": "the layer's input RMSNorm (attn_norm, +1 weight shift, rms_eps)",
    "attn_residual": "residual add after the mixer (mixer output + layer input)",
    "attn_post_norm": "RMSNorm before the FFN (post_attention_norm)",
    "ffn_out": "the feed-forward block's output (dense SwiGLU or MoE)",
    "l_out": "the layer's output (residual stream after the FFN)",
    "linear_attn_qkv_mixed": "DeltaNet input projection to q, k, v (attn_qkv)",
    "z": "DeltaNet output-gate projection (attn_gate)",
    "beta": "DeltaNet beta projection (ssm_beta)",
    "beta_sigmoid": "sigmoid(beta), the delta rule's write strength",
    "alpha": "DeltaNet decay projection (ssm_alpha)",
    "a_softplus": "softplus(alpha + ssm_dt.bias)",
    "gate": "the decay gate g = −exp(ssm_a)·softplus(alpha + ssm_dt.bias)",
    "conv_output_raw": "causal depthwise conv1d over q, k, v (ssm_conv1d, conv state carried between calls)",
    "conv_output_silu": "SiLU after the causal conv",
    "q_conv": "q heads split from the conv output", "k_conv": "k heads split from the conv output",
    "v_conv": "v heads split from the conv output",
    "q_conv_predelta": "L2-normalized q entering the delta rule", "k_conv_predelta": "L2-normalized k entering the delta rule",
    "v_conv_predelta": "v entering the delta rule",
    "attn_output": "the mixer's output: for DeltaNet the gated delta rule's read-out (recurrent state S carried "
                   "between calls); for attention the output projection (attn_output)",
    "final_output": "DeltaNet output after the gated RMSNorm (ssm_norm · SiLU(z))",
    "linear_attn_out": "DeltaNet output projection (ssm_out)",
    "Qcur_full": "attention Q projection with its gate half (attn_q, 2 × head_dim per head)",
    "Qcur_normed": "Q after the per-head RMSNorm (attn_q_norm)", "Kcur_normed": "K after the per-head RMSNorm (attn_k_norm)",
    "gate_reshaped": "the attention output gate taken from the Q projection",
    "Qcur": "Q after partial NeoX RoPE (rope.dimension_count of head_dim)", "Kcur": "K after partial NeoX RoPE",
    "Vcur": "V projection (attn_v)",
    "attn_pregate": "softmax attention over the KV cache (grouped-query heads)",
    "gate_sigmoid": "sigmoid of the output gate", "attn_gated": "attention output times sigmoid(gate)",
    "ffn_moe_out": "the routed experts' weighted sum (top-k weights renormalized)",
    "ffn_shexp_gated": "the shared expert's output times sigmoid(ffn_gate_inp_shexp)",
}


@dataclass(frozen=True)
class Cause:
    """A known bug class that first diverges at the same layer type and op."""

    mutant: str
    bug_class: str
    description: str


def likely_causes(layer_type: str | None, op: str | None) -> list[Cause]:
    """Known bug classes (mutants) whose first divergence is at ``layer_type`` / ``op``."""
    out = []
    for name, site in SHOWS_FIRST_AT.items():
        if site is not None and site == (layer_type, op) and name in MUTANTS:
            m = MUTANTS[name]
            out.append(Cause(name, m.bug_class, m.description))
    return out


def explain(first: dict[str, Any] | None) -> dict[str, Any]:
    """What a reviewer needs about a first divergence (``Localization.to_dict()['first_divergence']``):
    ``op_meaning`` (or None), ``causes`` (list of ``Cause``) and ``summary``, one sentence naming
    the bug classes, or saying that none of the known ones first diverges there."""
    if not first:
        return {"op_meaning": None, "causes": [], "summary": "no divergence found"}
    op = first.get("op")
    causes = likely_causes(first.get("layer_type"), op)
    if causes:
        summary = "; ".join(f"{c.bug_class} (as mutant:{c.mutant})" for c in causes)
    else:
        summary = f"no known bug class first diverges at {first.get('layer_type')} {op}: inspect that op's inputs and weights"
    return {"op_meaning": OPS.get(op or ""), "causes": causes, "summary": summary}
