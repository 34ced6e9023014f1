"""First-divergence localization: where, layer by layer and op by op, a candidate leaves the oracle.

The oracle (exact float64 forward) is the arbiter. Both engines' named activations (llama.cpp's
graph names: ``attn_norm-N``, ``conv_output_silu-N``, ``attn_gated-N``, ``l_out-N``, ...) are
compared in the oracle's forward order with ``metrics.compare_activations`` (the one comparison
function the hybrid-forward contract uses too). The first tensor whose NMSE exceeds
``localization.max_nmse`` or whose cosine falls below ``localization.min_cosine``
(thresholds.yaml, each with a basis) is the first divergence: layer index, layer type (the layer
kinds of ``harness.model.gguf_model``: recurrent / attention / global, or ``moe`` for the MoE
FFN of a layer), its sub-block (``sub_block``: mixer, FFN or MoE, block output, model output), tensor name, first position over the bound, and the numbers. A run that
compared no tensor is UNMEASURED, never clean. ``chunks`` feeds the prompt in pieces so faults in
state carried between calls are localized too. A divergence found by ``run_localize`` carries a
reproducer line (``divergence_message``): the numbers, the case, the bug classes of the mutants
whose first divergence is the same op (``harness.engines.mutants.SHOWS_FIRST_AT``) and the
``harness localize`` command that shows it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from harness.errors import InvalidInput, Verdict
from harness.judge.reproducer import Reproducer, causes_first_at, chunks_arg, failure_message
from harness.measure import metrics
from harness.model.gguf_model import GLOBAL, MOE, Qwen35HParams
from harness.runs.inputs import InputsRequest

DEFAULT_MAX_TOKENS = 128
"""Positions ``harness localize`` compares unless told otherwise (``--max-tokens``)."""
MOE_OPS = ("ffn_moe", "ffn_shexp", "ffn_moe_logits", "ffn_moe_probs", "ffn_moe_weights", "ffn_moe_out", "post_moe")
FFN_OPS = ("attn_post_norm", "ffn", "post_ffn", "post_moe")
"""Ops of a block's FFN sub-block (its input norm, the FFN or MoE, its residual add): llama.cpp
``qwen35.cpp`` / ``qwen35moe.cpp`` name them after ``attn_residual``."""
SUB_BLOCKS = ("input", "mixer", "ffn", "moe", "block output", "output")
"""What ``sub_block`` labels a tensor: the token embedding, a block's token mixer sub-block
(``attn_norm`` through ``attn_residual``: DeltaNet or gated attention), its FFN sub-block (dense
``ffn``, or ``moe`` in a qwen35moe layer), the block's output ``l_out``, the model output."""


@dataclass
class Divergence:
    """The first tensor over the bounds."""

    name: str
    layer: int
    layer_type: str
    op: str
    position: int | None
    nmse: float | None
    cosine: float | None
    max_abs: float | None
    status: str
    sub_block: str = ""

    def describe(self) -> str:
        where = f"layer {self.layer} ({self.layer_type})" if self.layer >= 0 else "model output"
        if self.layer >= 0 and self.sub_block:
            where += f", {self.sub_block} sub-block"
        nums = f"NMSE {self.nmse:.3g}, cosine {self.cosine:.6f}, max |Δ| {self.max_abs:.3g}" if self.nmse is not None else self.status
        pos = f" at position {self.position}" if self.position is not None else ""
        return f"first divergence: {where}, tensor {self.name}{pos}: {nums}"


@dataclass
class Localization:
    """A localization run: every comparison row (forward order), per-layer counts, the first
    divergence (None if all within bounds), and the verdict (PASS clean, FAIL divergence,
    UNMEASURED nothing compared). ``message`` is the reproducer of a divergence found by
    ``run_localize`` (``divergence_message``), else empty."""

    rows: list[dict[str, Any]]
    per_layer: list[dict[str, Any]]
    first: Divergence | None
    verdict: Verdict
    bounds: dict[str, float]
    compared: int
    candidate: str
    tokens: list[int] = field(default_factory=list)
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "message": self.message,
            "candidate": self.candidate,
            "bounds": self.bounds,
            "compared": self.compared,
            "first_divergence": None if self.first is None else dict(self.first.__dict__),
            "per_layer": self.per_layer,
            "rows": self.rows,
        }


def layer_type(hp: Qwen35HParams, layer: int, op: str | None = None) -> str:
    """The kind of ``layer`` (``hp.layer_kind``; ``GLOBAL`` for -1, the model output), or
    ``MOE`` for an MoE FFN op (``op`` in ``MOE_OPS``) of a qwen35moe layer."""
    if layer < 0:
        return GLOBAL
    if op is not None and hp.is_moe and op.startswith(MOE_OPS):
        return MOE
    return hp.layer_kind(layer)


def sub_block(hp: Qwen35HParams, layer: int, op: str) -> str:
    """Which part of the forward a tensor belongs to (``SUB_BLOCKS``): ``input`` / ``output``
    for model-level tensors (layer -1), else ``block output`` (``l_out``), ``moe`` or ``ffn``
    (``FFN_OPS`` and ``MOE_OPS``; ``moe`` in a qwen35moe model), else ``mixer``."""
    if layer < 0:
        return "input" if "embd" in op or "embed" in op else "output"
    if op == "l_out":
        return "block output"
    if op.startswith(MOE_OPS) or op.startswith(FFN_OPS):
        return "moe" if hp.is_moe else "ffn"
    return "mixer"


def _first_bad_position(ref: np.ndarray, cand: np.ndarray, max_nmse: float, min_cosine: float) -> int | None:
    r = np.asarray(ref, np.float64).reshape(ref.shape[0], -1)
    c = np.asarray(cand, np.float64).reshape(cand.shape[0], -1)
    with np.errstate(invalid="ignore", divide="ignore"):
        nm = ((c - r) ** 2).sum(1) / np.maximum((r * r).sum(1), 1e-300)
        cos = (r * c).sum(1) / np.maximum(np.linalg.norm(r, axis=1) * np.linalg.norm(c, axis=1), 1e-300)
    bad = np.flatnonzero(~np.isfinite(c).all(1) | (nm > max_nmse) | (cos < min_cosine))
    return int(bad[0]) if bad.size else None


def localize_activations(
    hp: Qwen35HParams, oracle_acts: dict[str, np.ndarray], cand_acts: dict[str, np.ndarray], max_nmse: float, min_cosine: float, candidate: str = ""
) -> Localization:
    """Compare named activations in the oracle's forward order and find the first divergence."""
    rows = metrics.compare_activations(oracle_acts, cand_acts)
    first = None
    per: dict[int, dict[str, Any]] = {}
    compared = 0
    for row in rows:
        layer = row["layer"]
        lt = layer_type(hp, layer, row["op"])
        row["layer_type"] = lt
        row["sub_block"] = sub_block(hp, layer, row["op"])
        entry = per.setdefault(layer, {"layer": layer, "type": layer_type(hp, layer),
                                       "compared": 0, "missing": 0, "over": 0, "max_nmse": 0.0, "min_cosine": 1.0})
        if row["status"] == "missing":
            entry["missing"] += 1
            continue
        if row["status"] == "shape":
            entry["missing"] += 1
            continue
        compared += 1
        entry["compared"] += 1
        over = row["status"] == "nonfinite" or (row["nmse"] is not None and (row["nmse"] > max_nmse or row["cosine"] < min_cosine))
        if row["nmse"] is not None:
            entry["max_nmse"] = max(entry["max_nmse"], float(row["nmse"]))
            entry["min_cosine"] = min(entry["min_cosine"], float(row["cosine"]))
        row["over"] = bool(over)
        if over:
            entry["over"] += 1
            if first is None:
                name = row["name"]
                pos = _first_bad_position(oracle_acts[name], cand_acts[name], max_nmse, min_cosine)
                first = Divergence(name, layer, lt, row["op"], pos, row["nmse"], row["cosine"], row["max_abs"], row["status"], row["sub_block"])
    per_layer = [per[k] for k in sorted(per, key=lambda x: (x < 0, x))]
    if compared == 0:
        verdict = Verdict.UNMEASURED
    else:
        verdict = Verdict.FAIL if first else Verdict.PASS
    return Localization(rows, per_layer, first, verdict, {"max_nmse": max_nmse, "min_cosine": min_cosine}, compared, candidate)


def divergence_message(first: Divergence, case: Reproducer) -> str:
    """The reproducer line of a first divergence (``harness.judge.reproducer``): where and how
    far it left the oracle, the case, the bug classes of the mutants that first diverge at the same
    op in the same kind of layer, and the ``harness localize`` command that shows it again."""
    chunks = ["--chunks", chunks_arg(case.chunks)] if case.chunks else []
    rerun = case.harness("localize", "--prompt", case.prompt, "--max-tokens", case.n_tokens, *chunks)
    where = f"layer {first.layer} ({first.layer_type})" if first.layer >= 0 else "the model output"
    fallback = f"the op that computes {first.op} in {where}; no mutant of harness/engines/mutants.py first diverges there"
    return failure_message(first.describe(), case, causes_first_at(first.layer_type, first.op), fallback, rerun)


@dataclass(kw_only=True)
class LocalizeRequest(InputsRequest):
    """Inputs of ``harness localize`` (``InputsRequest``): the ``candidate`` to localize, the
    prompt id (None: the first), ``chunks`` to feed it in pieces, at most ``max_tokens`` positions.
    ``tokens`` (token ids), when given, are compared instead of a prompt of the prompt set (a
    report localizes the exact ids its receipt holds; ``prompt`` then only names them)."""

    candidate: str
    prompt: str | None = None
    chunks: list[int] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    tokens: list[int] | None = None


def run_localize(req: LocalizeRequest) -> Localization:
    """Localize ``req.candidate`` against the oracle on one prompt (default: the first).

    Raises ``InvalidInput`` (unknown prompt, an engine without activations, bounds without a
    basis) and ``EngineError``.
    """
    inputs = req.resolve()
    hp = inputs.model.hparams
    resolved = inputs.thresholds_for()
    max_nmse = float(resolved.gate("localize_max_nmse", "probes").value)
    min_cos = float(resolved.gate("localize_min_cosine", "probes").value)
    if req.tokens is not None:
        prompt_id = req.prompt or "(token ids given)"
        tokens = [int(t) for t in req.tokens][: req.max_tokens]
    else:
        pset = inputs.prompt_set
        chosen = [p for p in pset if req.prompt is None or p.id == req.prompt]
        if not chosen:
            raise InvalidInput(f"no prompt {req.prompt!r} in {pset.path}; prompts: {', '.join(p.id for p in pset)}")
        pset.prompts = chosen[:1]
        prompt = inputs.tokens()[0]
        prompt_id, tokens = prompt.id, prompt.tokens[: req.max_tokens]
    if not tokens:
        raise InvalidInput("nothing to localize: no tokens")
    chunks = req.chunks
    if chunks is not None and sum(chunks) != len(tokens):
        if sum(chunks) < len(tokens):
            chunks = list(chunks) + [len(tokens) - sum(chunks)]
        else:
            raise InvalidInput(f"--chunks {chunks} sum past the prompt's {len(tokens)} tokens")
    oracle = inputs.engine("oracle")
    cand = inputs.engine(req.candidate)
    if not hasattr(cand, "activations"):
        raise InvalidInput(f"candidate {req.candidate} does not expose activations; localization needs them")
    ref_acts = oracle.activations(tokens, chunks)
    cand_acts = cand.activations(tokens, chunks)
    loc = localize_activations(hp, ref_acts, cand_acts, max_nmse, min_cos, req.candidate)
    loc.tokens = tokens
    if loc.first is not None:
        case = replace(inputs.reproducer(req.candidate), prompt=prompt_id, n_tokens=len(tokens), chunks=chunks)
        loc.message = divergence_message(loc.first, case)
    return loc
