"""Mutant engines (``mutant:NAME``): the float64 oracle with one small, documented fault planted.

Each mutant models a real bug class seen in Qwen3.5 / Qwen3-Next ports. It subclasses the oracle of
the model's arch (``harness.engines.oracle.ORACLES``) and overrides exactly one step, in one of
three ways the oracle allows (every step is called through ``self``):

* a pure step replaced (``tile_k_heads``, ``gdn_gate``, ``rope``, ``causal_conv1d`` ...);
* one named op's output replaced inside a layer method (the ``emit`` callback of
  ``gated_attention`` / ``gated_delta_net`` / ``block`` is wrapped, so the mutant's activations
  record what the faulty engine computed under llama.cpp's graph names);
* one of ``block``'s hooks (``mixer``, ``residual_input``);
* the weights the engine reads (``read_tensor`` edits a tensor as it is loaded).

``MUTANTS[name].breaks`` lists the contract obligations the fault violates, the one statement of
the mutant × obligation matrix: the bound tests of those obligations must fail on the mutant by
assertion (RED) and every other bound test must pass (GREEN). ``tests/test_contracts.py`` checks
it twice: against the contracts (ids exist, each contract's RED witness declares its obligation)
and against the matrix the bound tests observe. ``harness mutants list`` prints the table.

Planted faults at the protocol boundary (``PLANTS``) corrupt what any engine returns (a NaN, a
dropped row); the pytest plugin applies one with ``--plant NAME`` to show RED for obligations that
no runnable in-engine fault can break (finite values, shapes, recorded fields).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Sequence

import numpy as np

from harness.engines.base import Drafts, EngineInfo, LogitBlock, gather, iter_blocks, validate_chunks
from harness.engines.oracle import ORACLES
from harness.engines.oracle.qwen35 import (
    ATTENTION_SCORE_BYTES,
    Qwen35Oracle,
    _Recorder,
    causal_attention,
    causal_conv1d,
    gated_delta_rule_chunked,
    rope_neox_partial,
    softplus,
)
from harness.engines.oracle.qwen35moe import moe
from harness.config import did_you_mean
from harness.errors import EngineError, InvalidInput
from harness.model.gguf_model import (
    ATTENTION,
    GLOBAL,
    MOE,
    RECURRENT,
    GGUFModel,
    Override,
)


@dataclass(frozen=True)
class Mutant:
    """One planted fault. ``breaks``: the obligation ids it must turn RED; ``archs``: the GGUF
    archs on which the fault changes anything (an MoE fault is a no-op on a dense model)."""

    name: str
    bug_class: str
    description: str
    breaks: tuple[str, ...]
    mixin: type
    archs: tuple[str, ...] = ("qwen35", "qwen35moe")


# ---------------------------------------------------------------------------------------------
# Plumbing shared by the mutants
# ---------------------------------------------------------------------------------------------


class _Intercept:
    """Wraps an ``emit`` callback: ``fault(name, il, x, seen)`` may replace an op's output before
    it is recorded and returned; ``seen`` holds this call's earlier outputs by op name."""

    def __init__(self, emit: Callable, fault: Callable):
        self.emit, self.fault, self.seen = emit, fault, {}

    def __call__(self, name: str, il: int, x: np.ndarray) -> np.ndarray:
        x = self.fault(name, il, x, self.seen)
        self.seen[name] = x
        return self.emit(name, il, x)


class _MutantBase:
    """Common to every mutant: the engine name ``mutant:NAME`` and the fault in ``info``."""

    mutant_name = "?"

    @property
    def info(self) -> EngineInfo:
        base = super().info  # type: ignore[misc]
        m = any_mutant(self.mutant_name)
        return EngineInfo(
            name=f"mutant:{m.name}",
            version=base.version,
            settings=base.settings,
            capabilities=base.capabilities,
            build={**base.build, "mutant": m.name, "bug_class": m.bug_class, "fault": m.description},
            compute_class=base.compute_class,
        )


_OVERFLOW_MARKS = ("oracle: floating-point", "oracle: non-finite")
"""How the oracle's ``EngineError`` begins when its arithmetic overflowed or went non-finite
(``OracleEngine._forward``, the ``_Recorder`` checks, ``lm_head``)."""


class _NonFiniteLogits:
    """A mutant whose fault makes the float64 arithmetic overflow (``gdn-l2norm-skipped`` on the
    real-head fixtures: un-normalised q·k products of 128-wide heads) yields NaN logits from
    ``logits`` instead of the oracle's ``EngineError``, as a broken engine emits inf/NaN rather than
    refusing. A verification harness must then FAIL it (its non-finite positions), not report an
    ENGINE-ERROR about the oracle. Only plain ``logits`` requests; every other path (pieces
    through sessions, MTP, serving) keeps the error. Rows: float32 NaN ``[B, V]`` blocks of
    ``logit_block`` rows from ``first_row`` on."""

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, first_row: int = 0) -> Iterator[LogitBlock]:
        it = super().logits(tokens, chunks, first_row)  # type: ignore[misc]
        start = max(0, int(first_row))
        try:
            for block in it:
                yield block
                start = block[0] + block[1].shape[0]
        except EngineError as e:
            if not str(e).startswith(_OVERFLOW_MARKS):
                raise
            for s in range(start, len(tokens), self.logit_block):  # type: ignore[attr-defined]
                yield s, np.full((min(self.logit_block, len(tokens) - s), self.n_vocab), np.nan, np.float32)  # type: ignore[attr-defined]


class _WeightFault(_MutantBase):
    """The engine reads some weights wrongly: ``edit_weight(name, w)`` returns what it uses.

    Applied in ``read_tensor``, the oracle's one path for weights; ``w`` is what was read (the
    whole tensor, or the rows asked for), so an edit must be elementwise."""

    def read_tensor(self, name: str, rows: np.ndarray | slice | None = None, dtype: Any = np.float64) -> np.ndarray:
        return self.edit_weight(name, super().read_tensor(name, rows, dtype))  # type: ignore[misc]

    def edit_weight(self, name: str, w: np.ndarray) -> np.ndarray:
        return w


# ---------------------------------------------------------------------------------------------
# Gated attention faults
# ---------------------------------------------------------------------------------------------


class AttnOutputGateDropped(_MutantBase):
    """``attn_gated`` = ``attn_pregate``: the sigmoid output gate is never applied (ports of
    plain Qwen3 attention that ignore the gate half of ``attn_q``)."""

    def gated_attention(self, il, w, x, state, pos, emit):
        def fault(name, il_, v, seen):
            return seen["attn_pregate"] if name == "attn_gated" else v

        return super().gated_attention(il, w, x, state, pos, _Intercept(emit, fault))


class QKNormSkipped(_MutantBase):
    """``Qcur_normed`` / ``Kcur_normed`` are the raw query and key: the per-head RMSNorm with
    ``attn_q_norm`` / ``attn_k_norm`` is skipped."""

    def gated_attention(self, il, w, x, state, pos, emit):
        hp = self.hp

        def fault(name, il_, v, seen):
            if name == "Qcur_normed":
                return self.split_query_gate(seen["Qcur_full"], hp.n_head, hp.head_dim)[0]
            if name == "Kcur_normed":
                if "attn_qkv" in w:
                    k = (x @ w["attn_qkv"].T)[:, 2 * hp.n_head * hp.head_dim :][:, : hp.n_head_kv * hp.head_dim]
                else:
                    k = x @ w["attn_k"].T + w.get("attn_k.bias", 0.0)
                return k.reshape(x.shape[0], hp.n_head_kv, hp.head_dim)
            return v

        return super().gated_attention(il, w, x, state, pos, _Intercept(emit, fault))


def _rope_full_head(x: np.ndarray, pair_pos: np.ndarray, n_rot: int, freq_base: float) -> np.ndarray:
    """NeoX rope over all head_dim dims (n_rot ignored); positions from the first pair."""
    pos = pair_pos[:, 0] if np.ndim(pair_pos) == 2 else pair_pos
    return rope_neox_partial(x, pos, x.shape[-1], freq_base)


class RopeFullHead(_MutantBase):
    """RoPE rotates all head_dim dims instead of the first ``rope.dimension_count`` (partial
    rotary factor 0.25 ignored)."""

    rope = staticmethod(_rope_full_head)


def _split_halves(q_full: np.ndarray, n_head: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Query = first half of ``attn_q``'s output, gate = second half (wrong: they interleave)."""
    t = q_full.shape[0]
    half = n_head * head_dim
    return q_full[:, :half].reshape(t, n_head, head_dim), q_full[:, half:].reshape(t, n_head, head_dim)


class QGateSplitHalves(_MutantBase):
    """The joint ``attn_q`` output is split first-half/second-half instead of per head
    [query | gate]."""

    split_query_gate = staticmethod(_split_halves)


def _attention_kv_tiled(q, k, v, q_pos, k_pos, scale):
    """GQA with query head i reading KV head i % n_kv (tiled) instead of i // (n_head / n_kv)."""
    reps = q.shape[1] // k.shape[1]
    return causal_attention(q, np.tile(k, (1, reps, 1)), np.tile(v, (1, reps, 1)), q_pos, k_pos, scale)


class GqaKvTiled(_MutantBase):
    """Attention head i uses KV head i % n_kv instead of i // (n_head / n_kv)."""

    causal_attention = staticmethod(_attention_kv_tiled)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet faults
# ---------------------------------------------------------------------------------------------


def _repeat_grouped(x: np.ndarray, n_v: int) -> np.ndarray:
    """Key heads repeated grouped: v-head h reads k-head h // (n_v / n_k) (the HF order)."""
    return np.repeat(x, n_v // x.shape[1], axis=1)


class GdnHeadsGrouped(_MutantBase):
    """v-head h reads k-head h // (n_v/n_k) (HF / qwen3next order) instead of h % n_k, the tiled
    order the qwen35 converter writes."""

    tile_k_heads = staticmethod(_repeat_grouped)


def _gate_ssm_a_as_a_log(alpha, dt_bias, ssm_a):
    """g = −exp(ssm_a) · softplus(alpha + dt_bias): ssm_a taken for A_log."""
    return softplus(alpha + dt_bias) * -np.exp(ssm_a)


class SsmAAsALog(_MutantBase):
    """The decay uses −exp(ssm_a), as if the GGUF stored A_log; it stores −exp(A_log)."""

    gdn_gate = staticmethod(_gate_ssm_a_as_a_log)


def _gate_no_dt_bias(alpha, dt_bias, ssm_a):
    """g = ssm_a · softplus(alpha): ``ssm_dt.bias`` not added."""
    return softplus(alpha) * ssm_a


class DtBiasDropped(_MutantBase):
    """``ssm_dt.bias`` is not added before the softplus of the decay."""

    gdn_gate = staticmethod(_gate_no_dt_bias)


class GdnL2NormSkipped(_NonFiniteLogits, _MutantBase):  # where it overflows: NaN logits (_NonFiniteLogits)
    """q and k enter the delta rule without L2 normalisation."""

    l2norm = staticmethod(lambda x, eps: x)


class BetaSigmoidDropped(_MutantBase):
    """The write strength is the raw ``ssm_beta`` projection, not its sigmoid."""

    def gated_delta_net(self, il, w, x, state, emit):
        def fault(name, il_, v, seen):
            return seen["beta"] if name == "beta_sigmoid" else v

        return super().gated_delta_net(il, w, x, state, _Intercept(emit, fault))


class ConvKernelFlipped(_MutantBase):
    """The depthwise conv taps are applied in reverse: ``ssm_conv1d[:, 0]`` multiplies the
    current token instead of ``[:, K-1]``."""

    causal_conv1d = staticmethod(lambda x, weight, conv_state: causal_conv1d(x, weight[:, ::-1], conv_state))


class ConvStateDropped(_MutantBase):
    """Each call starts the causal conv from zeros: the last K−1 inputs of the previous piece are
    lost (the prompt fed in pieces differs from the prompt fed whole)."""

    causal_conv1d = staticmethod(lambda x, weight, conv_state: causal_conv1d(x, weight, np.zeros_like(conv_state)))


class SsmStateReset(_MutantBase):
    """The delta-rule state S is zeroed at the start of every call instead of carried."""

    def gated_delta_rule(self, q, k, v, g, beta, s):
        return super().gated_delta_rule(q, k, v, g, beta, np.zeros_like(s))


def _chunked_state_not_carried(q, k, v, g, beta, state, scale=None, chunk_size=64):
    """The chunked form with each chunk after the first starting from a zero state."""
    outs, s = [], state
    for start in range(0, q.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        o, s = gated_delta_rule_chunked(q[sl], k[sl], v[sl], g[sl], beta[sl], state if start == 0 else np.zeros_like(state), scale, chunk_size)
        outs.append(o)
    return np.concatenate(outs, axis=0), s


class GdnChunkStateNotCarried(_MutantBase):
    """The chunk-parallel kernel does not pass the state from one 64-token chunk to the next
    (prompts under one chunk, fed by the recurrent form, are unaffected)."""

    gated_delta_rule_chunked = staticmethod(_chunked_state_not_carried)


def _delta_rule_read_before_decay(q, k, v, g, beta, state, scale=None):
    """Delta rule that reads Sᵀk before the decay: δ = β(v − Sᵀk); S ← exp(g)S + kδᵀ."""
    t_len, _, d_k = q.shape
    scale = 1.0 / np.sqrt(d_k) if scale is None else scale
    s = state.copy()
    o = np.empty(v.shape, dtype=np.float64)
    for t in range(t_len):
        delta = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], s))
        s = np.exp(g[t])[:, None, None] * s + k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q[t] * scale, s)
    return o, s


class GdnReadBeforeDecay(_MutantBase):
    """The delta rule reads the state's prediction Sᵀk before decaying S (llama.cpp and
    transformers decay first), in both the token-by-token and the chunked path."""

    def gated_delta_rule(self, q, k, v, g, beta, s):
        return _delta_rule_read_before_decay(q, k, v, g, beta, s)


class GdnStatePerKHead(_MutantBase):
    """One state per key head ([n_k, d_k, d_v]) shared by the value heads that read that key
    head, instead of one per value head ([n_v, d_k, d_v])."""

    def init_state(self, il, w):
        st = super().init_state(il, w)
        if "ssm" in st:
            st["ssm"] = np.zeros((self.hp.ssm_n_group, self.hp.ssm_d_state, self.hp.head_v_dim))
        return st

    def gated_delta_rule(self, q, k, v, g, beta, s):
        n_k, d_k = s.shape[0], q.shape[2]
        s = s.copy()
        o = np.empty(v.shape, dtype=np.float64)
        for t in range(q.shape[0]):
            for h in range(v.shape[1]):
                j = h % n_k
                s[j] *= np.exp(g[t, h])
                delta = beta[t, h] * (v[t, h] - k[t, h] @ s[j])
                s[j] += np.outer(k[t, h], delta)
                o[t, h] = (q[t, h] / np.sqrt(d_k)) @ s[j]
        return o, s


class SsmNormShifted(_WeightFault):
    """The gated output norm uses 1 + ``ssm_norm`` (the converter does not shift ssm_norm)."""

    def edit_weight(self, name, w):
        return w + 1.0 if name.endswith(".ssm_norm.weight") else w


# ---------------------------------------------------------------------------------------------
# Layer schedule, norms, residual stream
# ---------------------------------------------------------------------------------------------


class ScheduleOffByOne(_MutantBase):
    """Full attention where il % interval == 0 instead of (il + 1) % interval == 0. A layer whose
    file tensors do not fit the kind it dispatches to runs no mixer (an engine that treats missing
    tensors as optional: llama.cpp marks attn_qkv / attn_gate TENSOR_NOT_REQUIRED)."""

    def mixer_kind(self, il, w):
        interval = self.hp.full_attention_interval or 4
        kind = ATTENTION if il % interval == 0 else RECURRENT
        needs = "attn_q" if kind == ATTENTION else "ssm_a"
        return kind if needs in w else "none"

    def mixer(self, il, w, x, state, pos, emit):
        if self.mixer_kind(il, w) == "none":
            return np.zeros_like(x)
        return super().mixer(il, w, x, state, pos, emit)


class ResidualAfterNorm(_MutantBase):
    """The attention residual adds the mixer output to the normed input ``attn_norm`` instead of
    the block input (residual taken after the pre-norm)."""

    def residual_input(self, x, normed):
        return normed


_SHIFTED_NORMS = (".attn_norm.weight", ".post_attention_norm.weight", ".attn_q_norm.weight", ".attn_k_norm.weight")


class NormShiftTwice(_WeightFault):
    """Every shifted RMSNorm applies 1 + w to a weight the converter already stored as 1 + w
    (``attn_norm``, ``post_attention_norm``, ``attn_q_norm``, ``attn_k_norm``, ``output_norm``)."""

    def edit_weight(self, name, w):
        return w + 1.0 if name.endswith(_SHIFTED_NORMS) or name == "output_norm.weight" else w


class FinalNormShiftMissing(_WeightFault):
    """The final ``output_norm`` is applied without its +1 (w − 1 of the stored 1 + w)."""

    def edit_weight(self, name, w):
        return w - 1.0 if name == "output_norm.weight" else w


class Nondeterministic(_MutantBase):
    """Run-to-run nondeterministic reductions (thread-count or atomic-order dependent sums),
    modelled as relative noise of 1e-6 on ``linear_attn_out``. The generator is seeded once per
    process, so two runs in one process differ (what the determinism probe sees) while a process's
    sequence of draws, and so what the other probes measure, is reproducible."""

    _rng = np.random.default_rng(20261202)

    def gated_delta_net(self, il, w, x, state, emit):
        def fault(name, il_, v, seen):
            return v * (1.0 + 1e-6 * self._rng.standard_normal(v.shape)) if name == "linear_attn_out" else v

        return super().gated_delta_net(il, w, x, state, _Intercept(emit, fault))


# ---------------------------------------------------------------------------------------------
# MoE faults (qwen35moe)
# ---------------------------------------------------------------------------------------------


class MoeWeightsUnnormalized(_MutantBase):
    """The top-k router weights are used as softmax probabilities without renormalising them to
    sum 1 (llama.cpp's qwen35moe graph passes norm_w = true)."""

    moe_norm_w = False


def _moe_shexp_ungated(x, router, gate_exps, up_exps, down_exps, n_expert_used, shared=None, norm_w=True):
    """``moe`` with the shared expert added without its sigmoid gate."""
    out, parts = moe(x, router, gate_exps, up_exps, down_exps, n_expert_used, shared, norm_w)
    if shared is not None:
        out = out - parts["ffn_shexp_gated"] + parts["ffn_shexp"]
        parts["ffn_shexp_gated"] = parts["ffn_shexp"]
    return out, parts


class ShexpGateIgnored(_MutantBase):
    """The shared expert's output is added ungated: sigmoid(``ffn_gate_inp_shexp`` · x) ignored."""

    moe = staticmethod(_moe_shexp_ungated)


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

_DENSE_AND_MOE = ("qwen35", "qwen35moe")
# name, bug class, the fault (the mixin's docstring), the obligations it turns RED (GREEN on
# every other; tests/test_contracts.py compares this with the observed matrix), the mixin, the archs it affects
_M = [
    Mutant("attn-output-gate-dropped", "attention output gate dropped", AttnOutputGateDropped.__doc__,
           ("QHF-EQ-005", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           AttnOutputGateDropped),
    Mutant("qk-norm-skipped", "QK-norm skipped", QKNormSkipped.__doc__,
           ("QHF-EQ-006", "QHF-EQ-009", "QE2E-PAR-001", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           QKNormSkipped),
    Mutant("rope-full-head", "rope over the full head instead of n_rot", RopeFullHead.__doc__,
           # not QE2E-REL-007: on the peaked tiny-qwen35 its cosine stays above the release floor; the
           # calibrated tier catches it
           ("QHF-EQ-007", "QHF-EQ-009", "QE2E-PAR-001", "QMTP-DRAFT-001", "QMTP-CHAIN-012", "QMTP-ACCEPT-011"),
           RopeFullHead),
    Mutant("q-gate-split-halves", "query/gate split as halves instead of interleaved per head", QGateSplitHalves.__doc__,
           ("QHF-EQ-005", "QHF-EQ-006", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           QGateSplitHalves),
    Mutant("gqa-kv-tiled", "GQA head map tiled instead of grouped", GqaKvTiled.__doc__,
           ("QHF-EQ-008", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           GqaKvTiled),
    Mutant("gdn-heads-grouped", "v→k head mapping grouped instead of tiled", GdnHeadsGrouped.__doc__,
           ("GDN-EQ-001", "GDN-EQV-008", "GDN-EQV-009", "GDN-INV-005", "GDN-INV-011", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012", "QMTP-ACCEPT-011"),
           GdnHeadsGrouped),
    Mutant("ssm-a-as-a-log", "decay computed from ssm_a as if it were A_log", SsmAAsALog.__doc__,
           ("GDN-EQ-002", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012", "QMTP-ACCEPT-011"),
           SsmAAsALog),
    Mutant("dt-bias-dropped", "DeltaNet dt bias dropped", DtBiasDropped.__doc__,
           ("GDN-EQ-002", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           DtBiasDropped),
    Mutant("gdn-l2norm-skipped", "L2 norm of q/k skipped", GdnL2NormSkipped.__doc__,
           # QMTP-GIVEN-009: its q/k overflow float64 in the 1,020-token given-draft case (a non-finite engine fails it)
           ("GDN-INV-007", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012", "QMTP-GIVEN-009"),
           GdnL2NormSkipped),
    Mutant("beta-sigmoid-dropped", "DeltaNet beta sigmoid dropped", BetaSigmoidDropped.__doc__,
           ("GDN-BND-004", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           BetaSigmoidDropped),
    Mutant("conv-kernel-flipped", "causal conv taps reversed", ConvKernelFlipped.__doc__,
           ("GDN-EQV-010", "GDN-INV-006", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           ConvKernelFlipped),
    Mutant("conv-state-dropped", "conv state dropped between chunks", ConvStateDropped.__doc__,
           ("GDN-EQV-010", "QE2E-EQV-003", "QE2E-PRB-005", "QE2E-PRB-006", "QE2E-STATE-009", "QMTP-CHUNK-003", "QMTP-PREFIX-008",
            "QMTP-GIVEN-009", "QMTP-SERVE-010", "QSRV-SLOT-001", "QSRV-ABORT-002", "QSRV-HDR-003", "QSRV-GRID-004", "QSRV-JOIN-005",
            "QSRV-PAD-006", "QSRV-TURN-007", "QMTP-ACCEPT-011"),
           ConvStateDropped),
    Mutant("ssm-state-reset", "recurrent state reset between chunks", SsmStateReset.__doc__,
           ("GDN-EQV-009", "QE2E-EQV-003", "QE2E-PRB-005", "QE2E-PRB-006", "QE2E-STATE-009", "QMTP-CHUNK-003", "QMTP-SPEC-005",
            "QMTP-ROLL-006", "QMTP-PREFIX-008", "QMTP-GIVEN-009", "QMTP-SERVE-010", "QSRV-SLOT-001", "QSRV-ABORT-002", "QSRV-HDR-003", "QSRV-GRID-004", "QSRV-JOIN-005",
            "QSRV-PAD-006", "QSRV-TURN-007"),
           SsmStateReset),
    Mutant("gdn-chunk-state-not-carried", "chunked delta rule drops the state between chunks", GdnChunkStateNotCarried.__doc__,
           ("GDN-EQV-008", "QE2E-EQV-003", "QE2E-PAR-001", "QE2E-REL-007", "QE2E-PRB-005", "QE2E-STATE-009", "QMTP-SPEC-005",
            "QMTP-GIVEN-009", "QMTP-SERVE-010", "QSRV-SLOT-001", "QSRV-ABORT-002", "QSRV-HDR-003", "QSRV-GRID-004", "QSRV-JOIN-005",
            "QSRV-TURN-007"),
           GdnChunkStateNotCarried),
    Mutant("gdn-read-before-decay", "delta rule reads the state before decaying it", GdnReadBeforeDecay.__doc__,
           # not QE2E-REL-007: above the release floor on the peaked tiny-qwen35, caught by the calibrated tier
           ("GDN-EQ-001", "GDN-EQV-008", "GDN-EQV-009", "GDN-INV-005", "QHF-EQ-009", "QE2E-PAR-001", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           GdnReadBeforeDecay),
    Mutant("gdn-state-per-k-head", "DeltaNet state kept per key head instead of per value head", GdnStatePerKHead.__doc__,
           ("GDN-EQ-001", "GDN-EQV-008", "GDN-EQV-009", "GDN-INV-005", "GDN-INV-011", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           GdnStatePerKHead),
    Mutant("ssm-norm-shifted", "ssm_norm given a +1 it does not have", SsmNormShifted.__doc__,
           ("GDN-EQ-012", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           SsmNormShifted),
    Mutant("schedule-off-by-one", "layer schedule off by one", ScheduleOffByOne.__doc__,
           ("QHF-EQ-005", "QHF-EQ-006", "QHF-EQ-007", "QHF-EQ-008", "QHF-EQ-009", "QHF-INV-001", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           ScheduleOffByOne),
    Mutant("norm-shift-twice", "norm +1 applied twice", NormShiftTwice.__doc__,
           ("QHF-EQ-006", "QHF-EQ-009", "QHF-EQ-013", "QHF-INV-003", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012", "QMTP-ACCEPT-011"),
           NormShiftTwice),
    Mutant("final-norm-shift-missing", "final norm's +1 missing", FinalNormShiftMissing.__doc__,
           ("QHF-EQ-009", "QHF-EQ-013", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012"),
           FinalNormShiftMissing),
    Mutant("residual-after-norm", "residual taken after the pre-norm", ResidualAfterNorm.__doc__,
           ("QHF-CON-004", "QHF-EQ-009", "QE2E-PAR-001", "QE2E-REL-007", "QMTP-DRAFT-001", "QMTP-CHAIN-012", "QMTP-ACCEPT-011"),
           ResidualAfterNorm),
    Mutant("nondeterministic", "run-to-run nondeterministic reduction", Nondeterministic.__doc__,
           # the determinism probe's to catch: on the peaked tiny-qwen35 the split and decode probes see
           # KLD 2e-10 to 5e-10 from it, below the f64 step (PROBE_MIN_STEP, 1e-9). QMTP-SERVE-010 compares
           # served rows against solo rows of the same request under the f64 KLD 1e-9: RED in the mutant
           # matrix's session (its draws there); the noise is a real run-to-run fault. QMTP-GIVEN-009 (verify
           # rows against plain rows, histories to 1,036 tokens) was RED there by its draws too, and is GREEN
           # since QMTP-CHAIN-012's bound test runs before it in that session and takes draws first (measured)
           ("QE2E-DET-002", "QMTP-SERVE-010"),
           Nondeterministic),
    Mutant("moe-weights-unnormalized", "MoE top-k weights not renormalized", MoeWeightsUnnormalized.__doc__,
           ("QHF-MOE-010",),
           MoeWeightsUnnormalized, ("qwen35moe",)),
    Mutant("shexp-gate-ignored", "shared-expert gate ignored", ShexpGateIgnored.__doc__,
           ("QHF-MOE-011",),
           ShexpGateIgnored, ("qwen35moe",)),
]
MUTANTS: dict[str, Mutant] = {m.name: m for m in _M}
"""Mutant name → ``Mutant``; the engine ``mutant:NAME`` (``harness.engines.registry``)."""
del _M

SHOWS_FIRST_AT: dict[str, tuple[str, str] | None] = {
    "attn-output-gate-dropped": (ATTENTION, "attn_gated"),
    "qk-norm-skipped": (ATTENTION, "Qcur_normed"),
    "rope-full-head": (ATTENTION, "Qcur"),
    "q-gate-split-halves": (ATTENTION, "Qcur_normed"),
    "gqa-kv-tiled": (ATTENTION, "attn_pregate"),
    "gdn-heads-grouped": (RECURRENT, "attn_output"),
    "ssm-a-as-a-log": (RECURRENT, "gate"),
    "dt-bias-dropped": (RECURRENT, "gate"),
    "gdn-l2norm-skipped": (RECURRENT, "q_conv_predelta"),
    "beta-sigmoid-dropped": (RECURRENT, "beta_sigmoid"),
    "conv-kernel-flipped": (RECURRENT, "conv_output_raw"),
    "conv-state-dropped": (RECURRENT, "conv_output_raw"),
    "ssm-state-reset": (RECURRENT, "attn_output"),
    "gdn-chunk-state-not-carried": (RECURRENT, "attn_output"),
    "gdn-read-before-decay": (RECURRENT, "attn_output"),
    "gdn-state-per-k-head": (RECURRENT, "attn_output"),
    "ssm-norm-shifted": (RECURRENT, "final_output"),
    "schedule-off-by-one": (RECURRENT, "attn_residual"),
    "norm-shift-twice": (RECURRENT, "attn_norm"),
    "final-norm-shift-missing": (GLOBAL, "result_norm"),
    "residual-after-norm": (RECURRENT, "attn_residual"),
    "nondeterministic": None,
    "moe-weights-unnormalized": (MOE, "ffn_moe_out"),
    "shexp-gate-ignored": (MOE, "ffn_shexp_gated"),
}
"""Mutant name → (layer type, op) of the first activation, in the oracle's forward order, at which
the fault shows: what ``harness localize`` names for it (faults in carried state with the prompt
fed in pieces); None for a fault that is not in the forward pass (the determinism probe catches
it). Layer types are ``harness.runs.localize.layer_type``'s (the layer kinds of
``harness.model.gguf_model``, and ``MOE`` for an MoE FFN op). The likely cause a localize
failure prints is looked up here (``harness.judge.reproducer``); tests/test_localize.py localizes
every mutant and checks this table."""


# ---------------------------------------------------------------------------------------------
# MTP (nextn) draft-head faults: the trunk is untouched, so trunk parity and the probes pass them;
# only the MTP cell (harness parity --mtp, harness.runs.mtp) sees them. Kept apart from MUTANTS,
# whose every entry trunk calibration must catch.
# ---------------------------------------------------------------------------------------------


class MtpPrenormHidden(_MutantBase):
    """The head is fed the trunk's last layer output before ``output_norm`` instead of the normed
    state the LM head scores (LightLLM PR #1402, llama.cpp PR #24025, ik_llama #2322)."""

    def mtp_hidden(self, h_prenorm: np.ndarray, h_normed: np.ndarray) -> np.ndarray:
        return h_prenorm


class MtpConcatSwapped(_MutantBase):
    """The fusion input concatenated hidden first, embedding second (mlx-lm #1469)."""

    def mtp_concat(self, e_norm: np.ndarray, h_norm: np.ndarray) -> np.ndarray:
        return np.concatenate([h_norm, e_norm], axis=1)


class MtpHeadNormSkipped(_MutantBase):
    """The head norm (``nextn.shared_head_norm``, else ``output_norm``) skipped before the LM head."""

    def mtp_head_norm(self, x: np.ndarray, il: int, w: dict[str, np.ndarray]) -> np.ndarray:
        return x


class MtpKvNotPrimed(_MutantBase):
    """The MTP layer's KV not filled by a chunked prefill: each piece's rows attend only to that
    piece (the head's KV starts empty at every call) (ik_llama #1979, mlx-vlm #2096)."""

    def mtp_state(self, il: int, w: dict[str, np.ndarray], state: dict[str, Any] | None) -> dict[str, Any]:
        return self.init_state(il, w)


class MtpSlotCrossed(_MutantBase):
    """With sequences decoded together, every sequence after the first drafts from the first
    sequence's hidden states (its own tokens, slot 0's h_t) (buun-llama-cpp PR #110)."""

    def draft_multi(self, sequences: Sequence[Sequence[int]]) -> list[Drafts]:
        first = super().draft(sequences[0])  # type: ignore[misc]
        out = [first]
        for q in sequences[1:]:
            own = super().draft(q)  # type: ignore[misc]
            n = min(len(q), first.hidden.shape[0])
            h = own.hidden.astype(np.float64)
            h[:n] = first.hidden[:n]
            g, lead = self.mtp_forward(h, np.asarray(q, np.int64), [len(q)], self.mtp_convention, _Recorder(None))
            out.append(Drafts(self.mtp_logits(g[lead:], self.mtp_layer()), h.astype(np.float32)))
        return out


class MtpRowsOffByOne(_MutantBase):
    """Draft rows one position late against the declared ``mtp_convention``: row t holds the
    draft made from (h_{t−1}, x_t), the sentinel row kept and the last row dropped (a driver that
    mixes up llama.cpp's and vLLM's row conventions)."""

    def draft(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, names: Any = None) -> Drafts:
        d = super().draft(tokens, chunks, names)  # type: ignore[misc]
        toks = np.asarray(tokens, np.int64)
        g, _ = self.mtp_forward(d.hidden.astype(np.float64), toks, validate_chunks(len(toks), chunks), "llama.cpp", _Recorder(None))
        return Drafts(self.mtp_logits(g[:-1], self.mtp_layer()), d.hidden, d.activations)  # the sentinel row kept, the last dropped


class MtpChainTargetHidden(_MutantBase):
    """Chained drafts whose second step is fed the target's hidden state (h_t, the trunk's state
    step 1 took: the only target state a drafting engine holds) instead of step 1's own output
    hidden state g_t (vLLM PR #36531: chained MTP steps fed the target's hidden state, and the
    acceptance regressed). Depth 1 is untouched; the oracle's speculative decoder too (its
    acceptance probe counts first drafts)."""

    def mtp_chain_hidden(self, g: np.ndarray, h_step1: np.ndarray) -> np.ndarray:
        return h_step1


_MTP = [
    Mutant("mtp-prenorm-hidden", "MTP head fed the pre-norm hidden state", MtpPrenormHidden.__doc__,
           ("QMTP-DRAFT-001", "QMTP-CHAIN-012", "QMTP-HID-002"), MtpPrenormHidden),
    Mutant("mtp-concat-swapped", "MTP fusion concat order swapped (hidden first)", MtpConcatSwapped.__doc__,
           ("QMTP-DRAFT-001", "QMTP-CHAIN-012"), MtpConcatSwapped),
    Mutant("mtp-head-norm-skipped", "MTP head norm skipped", MtpHeadNormSkipped.__doc__,
           ("QMTP-DRAFT-001", "QMTP-CHAIN-012"), MtpHeadNormSkipped),
    Mutant("mtp-kv-not-primed", "MTP layer KV not filled at chunked prefill", MtpKvNotPrimed.__doc__,
           ("QMTP-CHUNK-003",), MtpKvNotPrimed),
    Mutant("mtp-slot-crossed", "a sequence drafting from another slot's state", MtpSlotCrossed.__doc__,
           ("QMTP-SEQ-004",), MtpSlotCrossed),
    Mutant("mtp-rows-off-by-one", "MTP draft rows off by one against the declared convention", MtpRowsOffByOne.__doc__,
           ("QMTP-DRAFT-001",), MtpRowsOffByOne),
    Mutant("mtp-chain-target-hidden", "a chained draft fed the target's hidden state, not step 1's output", MtpChainTargetHidden.__doc__,
           ("QMTP-CHAIN-012",), MtpChainTargetHidden),
]
MTP_MUTANTS: dict[str, Mutant] = {m.name: m for m in _MTP}
"""MTP draft-head mutant name → ``Mutant`` (engine ``mutant:NAME`` too); each is caught by the
check of ``harness parity --mtp`` that ``MTP_CAUGHT_BY`` names, and by nothing in the trunk."""
del _MTP

MTP_CAUGHT_BY: dict[str, str] = {
    "mtp-prenorm-hidden": "whole",
    "mtp-concat-swapped": "whole",
    "mtp-head-norm-skipped": "whole",
    "mtp-kv-not-primed": "chunked",
    "mtp-slot-crossed": "sequences",
    "mtp-rows-off-by-one": "whole",
    "mtp-chain-target-hidden": "depth2",
}
"""MTP mutant → the MTP cell's check that fails on it (``harness.runs.mtp.CHECKS``)."""


# ---------------------------------------------------------------------------------------------
# Speculative-decoding faults (harness.engines.oracle.speculative): the trunk's logits, the MTP
# head's teacher-forced drafts and plain greedy generation are untouched, so every other check
# passes them; only the speculative probe (speculative greedy vs plain greedy) sees them. Kept
# apart from MUTANTS (trunk calibration) and MTP_MUTANTS (the MTP cell).
# ---------------------------------------------------------------------------------------------


def _recurrent(states: list[dict[str, Any]]) -> list[int]:
    return [i for i, st in enumerate(states) if "ssm" in st]


def _spec_decoder(name: str, body: dict[str, Any]) -> type:
    from harness.engines.oracle.speculative import SpecDecoder

    return type(name, (SpecDecoder,), body)


def _rollback_keep(key: str) -> Callable:
    def rollback(self, before, after, n_past, keep):
        super(type(self), self).rollback(before, after, n_past, keep)
        for i in _recurrent(after):
            self.session.states[i][key] = after[i][key].copy()
    return rollback


def _draftless_first_draft(self) -> None:
    last = self.last_step
    if last is None or len(last.batch) < 2 or last.accepted == 1:
        return
    probe = self.session.fork()
    probe.states = [dict(st) for st in copy_states(last.before)]
    probe.n_past = self.session.n_past  # positions are unused by the recurrent layers
    probe.feed_hidden(last.batch[:2])  # the state column of the first draft
    for i in _recurrent(probe.states):
        self.session.states[i]["conv"] = probe.states[i]["conv"].copy()
        self.session.states[i]["ssm"] = probe.states[i]["ssm"].copy()


def copy_states(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import copy

    return copy.deepcopy(states)


def _prompt_as_decode(self, n_prompt: int, draft_max: int) -> None:
    if n_prompt != 1 + draft_max:
        return
    fresh = [self.oracle.init_state(il, w) for il, w in enumerate(self.session.weights)]
    for i in _recurrent(self.session.states):
        self.session.states[i] = fresh[i]


def _session_spoiled(self) -> list[dict[str, Any]]:
    states = copy_states(self.session.states)
    if self.spoiled is not None:
        for i in _recurrent(states):
            states[i] = copy_states([self.spoiled[i]])[0]
    return states


def _step_position_gap(self, t, k, given=None):
    from harness.engines.oracle.speculative import SpecDecoder

    new, a, r = SpecDecoder.step(self, t, k, given)
    self.session.n_past += r  # the position advanced by k + 1, not a + 1: a gap of r after the rejection
    return new, a, r


def _step_early_commit(self, t, k, given=None):
    from harness.engines.oracle.speculative import SpecDecoder

    new, a, r = SpecDecoder.step(self, t, k, given)
    if a >= 4:  # the recurrent and conv state of [t, d_1 … d_{a-1}]: one step before the last accepted token
        probe = self.session.fork()
        probe.states = copy_states(self.last_step.before)
        probe.feed_hidden(self.last_step.batch[:a])
        for i in _recurrent(probe.states):
            self.session.states[i]["conv"] = probe.states[i]["conv"].copy()
            self.session.states[i]["ssm"] = probe.states[i]["ssm"].copy()
    return new, a, r


def _crosses_block(first: int, n: int, cell: int = 256) -> bool:
    return first // cell != (first + n - 1) // cell


def _step_drop_last_row(self, t, k, given=None):
    from harness.engines.oracle.speculative import SpecDecoder

    self.drop_next = k > 0 and _crosses_block(self.session.n_past, 1 + k)
    try:
        return SpecDecoder.step(self, t, k, given)
    finally:
        self.drop_next = False


def _feed_drop_last_row(self, toks, chunks=None):
    from harness.engines.oracle.speculative import SpecDecoder

    if not getattr(self, "drop_next", False) or len(toks) < 2:
        return SpecDecoder.feed(self, toks, chunks)
    self.drop_next = False  # the verify batch: its last row is never computed, its cell never written
    logits = SpecDecoder.feed(self, list(toks)[:-1])
    self.history.append(int(toks[-1]))
    self.session.n_past += 1
    return np.vstack([logits, logits[-1:]])


class _SpecFault(_MutantBase):
    """A speculative-decoding fault: the decoder class the oracle's ``speculative`` uses."""

    spec_body: dict[str, Any] = {}

    @property
    def spec_decoder(self) -> type:  # type: ignore[override]
        cls = type(self)
        if "_spec_cls" not in cls.__dict__:
            cls._spec_cls = _spec_decoder(f"{cls.__name__}Decoder", dict(self.spec_body))
        return cls._spec_cls


class SpecRejectedKeptSsm(_SpecFault):
    """Rejected drafts left in the recurrent state: the rollback cuts the KV cache and rewinds
    the conv state but keeps the Gated DeltaNet state S the whole verification batch left
    (ik_llama #1639: any speculative mode corrupts Qwen3.5-27B)."""

    spec_body = {"rollback": _rollback_keep("ssm")}


class SpecConvNotRolledBack(_SpecFault):
    """The conv state (the last conv_kernel − 1 inputs) not rolled back after rejected drafts:
    it keeps the rejected drafts' inputs while S and the KV cache are rewound."""

    spec_body = {"rollback": _rollback_keep("conv")}


class SpecDraftlessFirstDraft(_SpecFault):
    """A draft-less step after a verification step reads the state column of the first draft
    (the state after [t, d_1]) instead of the last accepted token's (vLLM #39273)."""

    spec_body = {"draftless_state": _draftless_first_draft}


class SpecPromptAsDecode(_SpecFault):
    """A prompt of 1 + draft_max tokens is taken for a verification batch (a decode) and its
    conv and recurrent state writes are skipped: generation continues from a fresh state
    (vLLM #53051)."""

    spec_body = {"after_prompt": _prompt_as_decode}


class SpecPrefixSpoiled(_SpecFault):
    """A reused prefix (a session) restores the recurrent and conv state the last batch with
    rejected drafts left, not the rolled-back one (vLLM #43559, #53912: prefix caching with MTP)."""

    spec_body = {"session_state": _session_spoiled}


class SpecPositionGap(_SpecFault):
    """After a rejection the position advances by k + 1 (the whole batch) instead of a + 1: the
    tokens after it are fed with a gap of the rejected drafts' count in their positions (llama.cpp
    logs only ``find_slot: non-consecutive token position``). After a gap of one step's rejected
    drafts the rope moves the trunk's logits by 1 − cosine 4e-5 to 8e-5 on ``fixture:tiny-qwen35-mtp``:
    the verify rows see it where no token flips (the head there drafts nothing right, so the
    head-drafted cases' gaps grow every step and flip tokens too)."""

    spec_body = {"step": _step_position_gap}


class SpecEarlyCommit(_SpecFault):
    """With 4 or more drafts accepted, the Gated DeltaNet and conv state committed is the one a
    step early (after [t, d_1 … d_{a−1}]), the KV cache right (xLLM #2247: accepting 4 or more
    drafts committed the wrong GDN state)."""

    spec_body = {"step": _step_early_commit}


class SpecVerifyDropsLastRow(_SpecFault):
    """A verification batch whose positions cross a 256-cell KV block drops its last row: the last
    draft's cell and state update are never written, and the choice after it is read from the row
    before (ROCmFPX PR #54: a verify batch crossing a 256-cell block flipped greedy tokens). Shows
    when every draft of that batch is accepted (a rejection re-feeds the accepted tokens)."""

    spec_body = {"step": _step_drop_last_row, "feed": _feed_drop_last_row}


def _draft_crossed(self, t: int, k: int) -> list[int]:
    from harness.engines.oracle.speculative import SpecDecoder

    own = SpecDecoder.draft(self, t, k)  # the head's rows stay in its K/V as a correct step leaves them
    if self.foreign is None:  # sequence 0 (or a sequence alone): its own drafts, recorded per step
        if self.seen is not None:
            self.seen.append(own)
        return own
    theirs = self.foreign[min(len(self.seen), len(self.foreign) - 1)] if self.foreign else []
    self.seen.append(theirs)
    return (list(theirs) + own)[:k]


class SpecDraftsCrossed(_SpecFault):
    """With sequences generated together, every sequence after the first takes the first
    sequence's head output: at its step s it proposes the drafts sequence 0's head made at its step
    s (from sequence 0's hidden state, token and head K/V; its own where sequence 0 drafted fewer).
    The trunk verifies every draft, so the output stays plain greedy: only the acceptance collapses
    (the symptom of xLLM PR #1887, acceptance down to about 40 %, and of vllm-mlx #471 and MTPLX
    #176, 0 % acceptance from a broken head).
    Measured with llama.cpp's MTP context in issue 54: sequence 1's acceptance fell from 3/21 to 0/27."""

    spec_body = {"draft": _draft_crossed, "foreign": None, "seen": None}

    def speculative_multi(self, sequences: Sequence[Sequence[int]], n_tokens: int, *, draft_max: int) -> list[Any]:
        from harness.engines.oracle.speculative import new_decoder, speculate

        outs, first = [], None
        for q in sequences:
            dec = new_decoder(self, self.spec_decoder)
            dec.seen, dec.foreign = [], first
            outs.append(speculate(dec, [int(t) for t in q], int(n_tokens), int(draft_max)))
            first = dec.seen if first is None else first
        return outs


_SPEC = [
    Mutant("spec-rejected-kept-ssm", "rejected drafts kept in the recurrent state", SpecRejectedKeptSsm.__doc__,
           ("QMTP-SPEC-005", "QMTP-ROLL-006", "QMTP-PROMPT-007", "QMTP-PREFIX-008"), SpecRejectedKeptSsm),
    Mutant("spec-conv-not-rolled-back", "conv state not rolled back after rejected drafts", SpecConvNotRolledBack.__doc__,
           ("QMTP-SPEC-005", "QMTP-ROLL-006", "QMTP-PROMPT-007", "QMTP-PREFIX-008"), SpecConvNotRolledBack),
    Mutant("spec-draftless-first-draft", "a draft-less step reading the first draft's state column", SpecDraftlessFirstDraft.__doc__,
           ("QMTP-SPEC-005", "QMTP-ROLL-006", "QMTP-PROMPT-007", "QMTP-PREFIX-008"), SpecDraftlessFirstDraft),
    Mutant("spec-prompt-as-decode", "a 1+k-token prompt run as a decode, state writes skipped", SpecPromptAsDecode.__doc__,
           ("QMTP-PROMPT-007",), SpecPromptAsDecode),
    Mutant("spec-prefix-spoiled", "prefix reuse restoring the state after rejected drafts", SpecPrefixSpoiled.__doc__,
           ("QMTP-PREFIX-008",), SpecPrefixSpoiled),
    Mutant("spec-position-gap", "a position gap after a rejection", SpecPositionGap.__doc__,
           ("QMTP-SPEC-005", "QMTP-ROLL-006", "QMTP-PROMPT-007", "QMTP-GIVEN-009"), SpecPositionGap),
    Mutant("spec-early-commit", "the state of one step early committed when 4 or more drafts are accepted", SpecEarlyCommit.__doc__,
           ("QMTP-GIVEN-009",), SpecEarlyCommit),
    Mutant("spec-verify-drops-last-row", "a verify batch across a 256-cell block dropping its last row", SpecVerifyDropsLastRow.__doc__,
           ("QMTP-GIVEN-009",), SpecVerifyDropsLastRow),
    Mutant("spec-drafts-crossed", "a sequence drafting from another sequence's hidden state (acceptance collapses, output lossless)",
           SpecDraftsCrossed.__doc__, ("QMTP-ACCEPT-011",), SpecDraftsCrossed),
]
SPEC_MUTANTS: dict[str, Mutant] = {m.name: m for m in _SPEC}
"""Speculative-decoding mutant name → ``Mutant`` (engine ``mutant:NAME``); each FAILs the
``speculative`` probe (``harness.runs.probes.probe_speculative``) and nothing else; kept apart
from ``MUTANTS`` and ``MTP_MUTANTS``, like them."""
ALL_MUTANTS: dict[str, Mutant] = {**MUTANTS, **MTP_MUTANTS, **SPEC_MUTANTS}
"""Every planted fault of the oracle: the trunk's (``MUTANTS``, which calibration must catch),
the MTP draft head's and speculative decoding's; ``mutant:NAME`` resolves each."""
del _SPEC

SPEC_CAUGHT_BY: dict[str, str] = {
    "spec-rejected-kept-ssm": "chunked prompt",
    "spec-conv-not-rolled-back": "chunked prompt",
    "spec-draftless-first-draft": "chunked prompt",
    "spec-prompt-as-decode": "3-token prompt",
    "spec-prefix-spoiled": "reused prefix",
    "spec-position-gap": "chunked prompt",
    "spec-early-commit": "given drafts, runs",
    "spec-verify-drops-last-row": "given drafts across cell 256",
    "spec-drafts-crossed": "two sequences together, sequence 1 (acceptance against the reference head)",
}
"""Speculative mutant → the first case of the speculative probe that fails on it (``SPEC_CASES``)."""


# ---------------------------------------------------------------------------------------------
# Precision faults: the arithmetic is the oracle's, but one buffer is kept in too narrow a format
# while the engine declares class f32 (as a real f32 engine with the bug would). On a small model
# they move the logits less than a correct f32 engine's own drift does; only the state probe
# (harness.runs.state_probe, on the harness's state-sensitive fixture) sees them. Kept apart from
# MUTANTS (trunk calibration, which cannot separate them at the small models' sizes).
# ---------------------------------------------------------------------------------------------

BF16 = "bf16"


class _PrecisionFault(_MutantBase):
    """A precision fault: the engine declares class ``f32`` whatever it computes in."""

    @property
    def info(self) -> EngineInfo:
        i = super().info
        return EngineInfo(name=i.name, version=i.version, settings=i.settings, capabilities=i.capabilities,
                          build=i.build, compute_class="f32")


class StateBf16BetweenCalls(_PrecisionFault):
    """The Gated DeltaNet state S is rounded to bf16 (round-to-nearest-even) at the end of every
    call, i.e. kept in bf16 between decode calls, while everything else is computed exactly
    (ollama #15865: the MLX runner stored the Gated DeltaNet state in bf16; Qwen3.5 35B gave one or
    two good tokens, then repetition). A prompt fed whole is unaffected."""

    def gated_delta_rule(self, q, k, v, g, beta, s):
        from harness.engines.oracle.lowp import FORMATS, round_to

        o, s_new = super().gated_delta_rule(q, k, v, g, beta, s)  # type: ignore[misc]
        return o, round_to(s_new, FORMATS[BF16]).astype(np.float64)


def _attention_bf16(q, k, v, q_pos, k_pos, scale):
    """Causal attention as a bf16 kernel computes it: q, k, v rounded to bf16, scores and softmax
    accumulated wide, the probabilities rounded to bf16 before the product with v, the output
    rounded to bf16. Shapes as ``causal_attention``; the queries are taken in chunks of at most
    ``ATTENTION_SCORE_BYTES`` of scores, as the oracle's are, so a long prompt never holds
    ``[T, T]`` (each query row's softmax is its own: the same values as one chunk)."""
    from harness.engines.oracle.lowp import FORMATS, round_to

    def r(x):
        return round_to(x, FORMATS[BF16]).astype(np.float64)

    t_q, n_head, d = q.shape
    n_kv = k.shape[1]
    kb, vb = r(k), r(v)
    out = np.empty((t_q, n_head, v.shape[2]), np.float64)
    rows = max(1, ATTENTION_SCORE_BYTES // (8 * n_head * max(1, k.shape[0])))
    for a in range(0, t_q, rows):
        qg = r(q[a:a + rows]).reshape(-1, n_kv, n_head // n_kv, d)
        scores = np.einsum("tkgd,skd->kgts", qg, kb) * scale
        scores = np.where(k_pos[None, :] <= q_pos[a:a + rows, None], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p = r(p / p.sum(axis=-1, keepdims=True))
        out[a:a + rows] = r(np.einsum("kgts,skd->tkgd", p, vb).reshape(-1, n_head, v.shape[2]))
    return out


class AttnBf16MultiToken(_PrecisionFault):
    """Attention computed in bf16 only in calls of more than one token (a prefill kernel in bf16,
    the one-token decode kernel in f32): a prompt fed one token per call is unaffected, a prompt
    fed whole is not."""

    def causal_attention(self, q, k, v, q_pos, k_pos, scale):
        if q.shape[0] > 1:
            return _attention_bf16(q, k, v, q_pos, k_pos, scale)
        return causal_attention(q, k, v, q_pos, k_pos, scale)


_PRECISION = [
    Mutant("state-bf16-between-calls", "recurrent state kept in bf16 between calls", StateBf16BetweenCalls.__doc__,
           ("QE2E-STATE-009",), StateBf16BetweenCalls),
    Mutant("attn-bf16-multi-token", "attention in bf16 in multi-token calls only", AttnBf16MultiToken.__doc__,
           ("QE2E-STATE-009",), AttnBf16MultiToken),
]
PRECISION_MUTANTS: dict[str, Mutant] = {m.name: m for m in _PRECISION}
"""Precision mutant name → ``Mutant`` (engine ``mutant:NAME``, declared class f32); each FAILs the
``state`` probe at class f32 and is too small for the other checks on the small models."""
del _PRECISION
ALL_MUTANTS.update(PRECISION_MUTANTS)


# ---------------------------------------------------------------------------------------------
# Serving faults: the oracle's arithmetic and its plain ops are untouched, so parity and every
# probe but the serving probe pass them; one rule of the serving scheduler's state handling
# (harness.engines.oracle.serving) is wrong. The serving probe (harness.runs.serving) must FAIL
# each, naming scenario, request and step; each breaks obligations of contracts/qwen35-serving-v1.yaml.
# Kept apart from MUTANTS (trunk calibration, which they cannot fail: their logits are the oracle's).
# ---------------------------------------------------------------------------------------------


class ServeSlotNotReset(_MutantBase):
    """A reused slot keeps its previous request's recurrent state: a request that gets a slot
    without a prefix-cache hit starts with an empty KV cache but with the conv and Gated DeltaNet
    state the slot's last request left (llama.cpp #29092: a GDN state carried across requests on a
    reused server slot; warpfront/hipfire #462; Luce-Org/lucebox PR #210)."""

    serve_faults = {"slot_reset": False}


class ServePrefixHeaderKey(_MutantBase):
    """The prefix cache matches a kept state on the first 48 tokens (the chat template's header)
    alone, so a prompt that shares only the header restores another prompt's state from further on
    and skips those tokens (kekzl/imp PR #1463)."""

    serve_faults = {"header_key": 48}


class ServeAbortLeavesState(_MutantBase):
    """Abort code that does nothing: after an aborted request, the next request in its slot starts
    with the conv and DeltaNet state the aborted one left (a finished request's slot is reset)
    (warpfront/hipfire #462: reset, abort and prefix-cache code reading always-empty fields)."""

    serve_faults = {"abort_reset": False}


class ServeCheckpointGrid(_MutantBase):
    """States kept every 64 tokens, looked up on a 128-token page grid: a hit on 128·i tokens
    restores the state kept at index i of the 64 grid (after 64·i tokens) and skips 128·i
    (sglang PR #33515 / #35086: token 29,056 took h[99], not h[198])."""

    serve_faults = {"read_grid": 128}


class ServeJoinNeighbourConv(_MutantBase):
    """A sequence joining a running batch gets the conv state of the first running sequence
    instead of a fresh one (mlx-lm PR #1169: fresh sequences joining a populated cache got another
    sequence's state with the right shape)."""

    serve_faults = {"join_conv": True}


class ServePadAliasesSlot0(_MutantBase):
    """A step of 3, 5, 6 or 7 requests is padded to the next power of two, and the padded rows'
    recurrent-state writes land in slot 0 (vLLM PR #34077: state_indices ignored padded entries;
    sglang PR #27202: padded rows aliased request 0's slot)."""

    serve_faults = {"pad_alias": True}


class ServeTurnStateDropped(_MutantBase):
    """At a request's end the prompt cache keeps its KV of the whole turn but the recurrent state
    as the prompt left it, without the generated tokens' updates: a conversation continued from the
    cache misses the last turn's state update (llama.cpp #21681 is of this family: a long chat through
    the prompt cache)."""

    serve_faults = {"turn_dropped": True}


SERVING_MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("serve-slot-not-reset", "slot state not reset on reuse", ServeSlotNotReset.__doc__,
           ("QSRV-SLOT-001", "QSRV-ABORT-002", "QSRV-GRID-004"), ServeSlotNotReset),
    Mutant("serve-prefix-header-key", "prefix-cache hit keyed on the header alone", ServePrefixHeaderKey.__doc__, ("QSRV-HDR-003", "QSRV-GRID-004"),
           ServePrefixHeaderKey),
    Mutant("serve-abort-leaves-state", "an abort that leaves the state behind", ServeAbortLeavesState.__doc__, ("QSRV-ABORT-002",), ServeAbortLeavesState),
    Mutant("serve-checkpoint-grid", "checkpoints on a 64-token grid read on a 128-token grid", ServeCheckpointGrid.__doc__, ("QSRV-GRID-004",),
           ServeCheckpointGrid),
    Mutant("serve-join-neighbour-conv", "a joining sequence reads a neighbour's conv state", ServeJoinNeighbourConv.__doc__, ("QSRV-JOIN-005",),
           ServeJoinNeighbourConv),
    Mutant("serve-pad-aliases-slot0", "a padded row that aliases slot 0", ServePadAliasesSlot0.__doc__, ("QSRV-PAD-006",), ServePadAliasesSlot0),
    Mutant("serve-turn-state-dropped", "a continued conversation that drops the last turn's state update", ServeTurnStateDropped.__doc__,
           ("QSRV-TURN-007",), ServeTurnStateDropped),
]}
"""Serving mutant name → ``Mutant`` (engine ``mutant:NAME``); each FAILs the ``serving`` probe and
PASSes parity and every other probe."""
ALL_MUTANTS.update(SERVING_MUTANTS)
SERVING_CAUGHT_BY: dict[str, str] = {
    "serve-slot-not-reset": "slot-reuse-finished", "serve-prefix-header-key": "shared-header",
    "serve-abort-leaves-state": "slot-reuse-aborted", "serve-checkpoint-grid": "block-grid",
    "serve-join-neighbour-conv": "join-running", "serve-pad-aliases-slot0": "concurrency-3",
    "serve-turn-state-dropped": "multi-turn",
}
"""Serving mutant → the first shipped scenario (``harness/data/scenarios/serving.yaml``) that fails on it."""


class ServeSpecPadScratch(_MutantBase):
    """Padded verification rows alias request 0's scratch slot: in a step of 3, 5 or 7 requests
    (padded to a power of two), the snapshot the request in slot 0 rolls back to after rejected
    drafts has had a pad row's token written into its conv and Gated DeltaNet state (sglang PR
    #27202: ``ssm_state_indices`` covered only the unpadded rows, the padded tail zero-filled, so
    the post-verify restore read corrupted data; vLLM PR #34077)."""

    serve_faults = {"spec_pad_scratch": True}


class ServeSpecAcceptedRow0(_MutantBase):
    """In a step where several requests verify drafts, each one's conv and recurrent state is
    committed for the accepted count of the batch's first verifying request, its KV cache and tokens
    right (vLLM PR #30632 / issue #30631: redundant, repeated tokens with MTP when 4 prompts were
    batched)."""

    serve_faults = {"spec_accepted_row0": True}


class ServeSpecCacheSpoiled(_MutantBase):
    """The prefix cache keeps a finished speculating request's conv and recurrent state as its last
    batch with rejected drafts left it, before the rollback, so a conversation continued from the
    cache starts from rejected drafts (vllm-ascend #14339: MTP together with a prefix cache gives
    wrong accuracy; vLLM #43559)."""

    serve_faults = {"spec_cache_spoiled": True}


SERVE_SPEC_MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("serve-spec-pad-scratch", "padded verify rows aliasing request 0's scratch slot", ServeSpecPadScratch.__doc__,
           ("QMTP-SERVE-010",), ServeSpecPadScratch),
    Mutant("serve-spec-accepted-row0", "a batched verify committing another row's accepted count", ServeSpecAcceptedRow0.__doc__,
           ("QMTP-SERVE-010",), ServeSpecAcceptedRow0),
    Mutant("serve-spec-cache-spoiled", "a prefix cache keeping a speculating request's state before the rollback",
           ServeSpecCacheSpoiled.__doc__, ("QMTP-SERVE-010",), ServeSpecCacheSpoiled),
]}
"""Speculation-under-traffic mutants (engine ``mutant:NAME``): serving faults that act only on a
speculating request's verification steps, so they FAIL the serving probe on the speculative
scenarios (``harness/data/scenarios/serving-speculative.yaml``, a model with an MTP block) and
PASS parity, the speculative probe and the plain serving scenarios."""
ALL_MUTANTS.update(SERVE_SPEC_MUTANTS)
SERVE_SPEC_CAUGHT_BY: dict[str, str] = {
    "serve-spec-pad-scratch": "spec-join-odd", "serve-spec-accepted-row0": "spec-batched-4",
    "serve-spec-cache-spoiled": "spec-prefix-hit",
}
"""Speculation-under-traffic mutant → the speculative scenario that fails on it."""


def any_mutant(name: str) -> Mutant:
    """The ``Mutant`` called ``name`` (``ALL_MUTANTS``, the serving ones included); ``KeyError`` if none."""
    return ALL_MUTANTS[name]


def _clean_doc(doc: str | None) -> str:
    return " ".join((doc or "").replace("``", "").split())


for _m in ALL_MUTANTS.values():
    object.__setattr__(_m, "description", _clean_doc(_m.description))
del _m

_CLASSES: dict[tuple[str, str], type] = {}


def mutant_class(name: str, arch: str) -> type:
    """The engine class of mutant ``name`` for ``arch``: ``(fault mixin, ORACLES[arch])``.

    Raises ``InvalidInput`` for an unknown mutant or arch.
    """
    if name not in ALL_MUTANTS:
        raise InvalidInput(f"unknown mutant {name!r}{did_you_mean(name, list(ALL_MUTANTS))}; known: {', '.join(ALL_MUTANTS)}")
    if arch not in ORACLES:
        raise InvalidInput(f"mutant:{name}: no oracle for arch {arch!r}")
    key = (name, arch)
    if key not in _CLASSES:
        m = any_mutant(name)
        _CLASSES[key] = type(f"{m.mixin.__name__}_{arch}", (m.mixin, ORACLES[arch]), {"mutant_name": name, "__doc__": m.mixin.__doc__})
    return _CLASSES[key]


def load_mutant(name: str, path: str | os.PathLike | GGUFModel, overrides: Sequence[Override] = ()) -> Qwen35Oracle:
    """The engine ``mutant:NAME`` bound to the GGUF at ``path`` (info name ``mutant:NAME``).

    Raises ``InvalidInput`` (exit 2) for an unknown mutant, an unreadable file or an unsupported
    arch. A mutant whose ``archs`` exclude the model's arch loads and equals the oracle.
    """
    model = path if isinstance(path, GGUFModel) else GGUFModel(path, overrides)
    return mutant_class(name, model.require_supported())(model)


# ---------------------------------------------------------------------------------------------
# Planted faults at the protocol boundary
# ---------------------------------------------------------------------------------------------

PLANT_POSITION = 5
"""The position (clipped to the prompt) at which value plants corrupt an engine's output."""


@dataclass(frozen=True)
class Plant:
    """A fault planted in what an engine returns: ``logits(array [T, V]) -> array`` and
    ``activations(dict) -> dict`` (identity where None). ``breaks``: obligation ids."""

    name: str
    description: str
    breaks: tuple[str, ...]
    logits: Callable[[np.ndarray], np.ndarray] | None = None
    activations: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None


def _nan_row(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a[min(PLANT_POSITION, a.shape[0] - 1)] = np.nan
    return a


def _nan_activation(acts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(acts)
    for name in [n for n in out if n.startswith("l_out-")][:1]:
        out[name] = _nan_row(out[name].astype(np.float64))
    return out


def _drop_last_row(acts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: (a[:-1] if n.startswith(("attn_residual-", "l_out-", "ffn_out-")) else a) for n, a in acts.items()}


PLANTS: dict[str, Plant] = {
    p.name: p
    for p in [
        Plant("nan-logits", f"logit row {PLANT_POSITION} is NaN", ("QE2E-PAR-001", "QE2E-REL-007", "QE2E-REP-004"), logits=_nan_row),
        Plant("nan-activation", f"row {PLANT_POSITION} of the first l_out-N activation is NaN", ("QHF-BND-012",), activations=_nan_activation),
        Plant("drop-last-row", "residual-stream activations (attn_residual, ffn_out, l_out) lose their last position", ("QHF-INV-002",), activations=_drop_last_row),
    ]
}
"""Plant name → ``Plant``; applied to the candidate by the pytest plugin's ``--plant NAME``."""


class PlantedEngine:
    """``engine`` with ``plant`` applied to its logits and activations; info name
    ``NAME+planted:PLANT``. Everything else is delegated."""

    def __init__(self, engine: Any, plant: str):
        if plant not in PLANTS:
            raise InvalidInput(f"unknown plant {plant!r}; known: {', '.join(PLANTS)}")
        self.engine, self.plant = engine, PLANTS[plant]

    @property
    def info(self) -> EngineInfo:
        i = self.engine.info
        return EngineInfo(f"{i.name}+planted:{self.plant.name}", i.version, i.settings, i.capabilities,
                          {**i.build, "plant": self.plant.description}, i.compute_class)

    @property
    def n_vocab(self) -> int:
        return self.engine.n_vocab

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]:
        """The engine's ``(start, float32 [B, V])`` blocks with the plant applied (gathered first
        when the plant edits logits)."""
        if self.plant.logits is None:
            yield from self.engine.logits(tokens, chunks)
            return
        yield from iter_blocks(self.plant.logits(gather(self.engine.logits(tokens, chunks), len(tokens))))

    def activations(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, names: Collection[str] | None = None) -> dict[str, np.ndarray]:
        """The engine's named activations ``{name: [T, ...]}`` with the plant applied."""
        acts = self.engine.activations(tokens, chunks, names) if names is not None else self.engine.activations(tokens, chunks)
        return acts if self.plant.activations is None else self.plant.activations(acts)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.engine, attr)


def mutant_rows() -> list[dict[str, Any]]:
    """One row per mutant ``resolve_engine`` accepts (``ALL_MUTANTS``: the trunk's, the MTP
    head's, speculative decoding's, precision and serving) and per plant, for ``harness mutants
    list``: name, kind, bug class, archs, breaks, description."""
    rows = [
        {"name": f"mutant:{m.name}", "kind": "mutant", "bug_class": m.bug_class, "archs": list(m.archs),
         "breaks": list(m.breaks), "description": m.description}
        for m in ALL_MUTANTS.values()
    ]
    rows += [
        {"name": f"planted:{p.name}", "kind": "plant", "bug_class": "planted output fault", "archs": list(_DENSE_AND_MOE),
         "breaks": list(p.breaks), "description": p.description}
        for p in PLANTS.values()
    ]
    return rows
