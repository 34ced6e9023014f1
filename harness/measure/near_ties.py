"""MoE router near-ties: where a correct engine's parity comparison stops being like for like.

On a model with experts (``expert_count`` > 0) each layer's router keeps the
``expert_used_count`` (k) experts with the largest router logits (llama.cpp ``llama-graph.cpp``
``build_moe_ffn``: ``ffn_moe_logits``, softmax, top-k). Where the k-th and (k+1)-th logits are
nearly equal, two correct engines whose float32 sums differ in their last bits keep different
experts. From that position on they compute different functions of the prompt, and in a
hybrid model the difference does not stay where it happened: the Gated DeltaNet state carries
it to every later position. Measured on ``fixture:trained-qwen35moe`` (llama.cpp at n_ubatch 7
against llama.cpp, prompt ``prose-deltanet``): the first position outside the f32 row's bounds is
336, where the reference's router gap is 3.5e-4 logits; 66 more follow over the rest of the
1,026-token prompt, most at positions whose own gap is 0.1-0.2, the worst (724) at cosine
0.99915 and KLD 0.116 nats. Every other position of the cell is within the row.

``router_cuts`` therefore ends a prompt's comparison for the calibrated tier at its first
position outside the row's bounds when, and only when, the **reference's** own router logits
(its activations ``ffn_moe_logits-N``, every MoE layer) have a k-th to (k+1)-th gap of at most
thresholds.yaml ``probes.moe_router_max_gap`` there. A fault does not choose near-tied positions:
one that shows from the first position, or wherever a near-tie is not, is judged on every
position as before. Positions before the cut and every other prompt are judged by the row as they are.

The release gate (cosine >= 0.98 at every position) is never cut, but on an MoE model it excuses
single positions (``release_excuses``): a position below 0.98 where the **reference's** router
gap is at most thresholds.yaml ``release.moe_router_tie_gap`` (0.05 logits), as long as such
positions are at most ``release.moe_router_max_excused`` of the cell (1 %, at least one). That
gap is wider than the calibrated tier's because on a quantized file llama.cpp quantizes the
activations it feeds every quantized matmul (Q8_0 / Q8_K), which moves its router logits by
about 1e-2 against exact arithmetic, more where earlier expert choices already differ. Measured
on ``trained-qwen35moe-256`` (4 experts, 2 used): the exact oracle against llama.cpp on the
IQ4_XS file has one position of 1,479 at cosine 0.9765, where llama.cpp's router gap is 0.026;
in a 4-expert model one expert swapped moves the logits far. Every excused position is named
on the release gate's line and kept in the receipt; the calibrated tier leaves them out too
(its rows are measured the same way), so a fault has to show at positions that are not near-tied
or in the KLD gates, as the mutants do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from harness.errors import HarnessError

CUT_CLASSES = ("f64", "f32")
"""Compute classes whose rows are tight enough for a flip to leave them. A bf16/f16 engine's
router logits differ from llama.cpp's by ~1e-2, so its flips are part of what its rows measured."""
UNQUANTIZED = frozenset({"F32", "F16", "BF16"})
"""Weight types llama.cpp multiplies without quantizing the activations. On a file with any other
(Q8_0, K-quants, IQ4_XS) llama.cpp's router logits move by ~1e-2 against any engine that does not
quantize its activations the same way, so every class's flips are part of what its rows measured,
as a bf16 engine's are: no prompt is cut (``cuts_apply``)."""


def cuts_apply(compute_class: str, weights_key: str) -> bool:
    """Whether the calibrated tier cuts an MoE prompt at a router near-tie (``router_cuts``) for a
    candidate of ``compute_class`` on a file whose ``GGUFModel.weights_key`` is ``weights_key``:
    a class of ``CUT_CLASSES`` on a file of ``UNQUANTIZED`` weights only. Calibration measures
    its known-good pairs by the same test (``harness.runs.calibrate.RouterFlips``)."""
    return compute_class in CUT_CLASSES and set(weights_key.split("+")) <= UNQUANTIZED


@dataclass
class RouterCuts:
    """What ``router_cuts`` decided: ``mask`` (bool [N] over the cell's concatenated positions:
    not judged by the calibrated tier), ``max_gap`` (the router gap it allowed, logits), ``cuts`` ({prompt, position, router_gap, positions_cut}
    per prompt cut) and ``notes`` (per prompt outside the bounds and not cut: why)."""

    mask: np.ndarray
    max_gap: float
    cuts: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return int(self.mask.sum())

    def to_dict(self) -> dict[str, Any]:
        return {"positions": self.count, "cuts": self.cuts, "router_max_gap": self.max_gap, "notes": self.notes}

    def line(self) -> str:
        """The tier line's clause: which prompts were cut where, and why."""
        if not self.cuts:
            return ""
        where = ", ".join(f"{c['prompt']!r} from position {c['position']} (gap {c['router_gap']:.2g})" for c in self.cuts)
        return (f"judged up to the reference's first MoE router near-tie outside the bounds (gap ≤ {self.max_gap:g}; a correct "
                f"engine may keep other experts from there on): {where}; {self.count} positions not judged by this tier")


def router_logits(acts: Mapping[str, np.ndarray], name: str, n_tokens: int) -> np.ndarray | None:
    """float64 ``[T, E]`` of activation ``name`` (e.g. ``ffn_moe_logits-3``), or None when absent.
    llama.cpp's worker returns a tensor it cannot join across ubatches (a last ubatch of one token
    loses its token axis) as ``name@ubatchK`` pieces; they are joined here in order."""
    if name in acts:
        return np.asarray(acts[name], np.float64).reshape(n_tokens, -1)
    pieces = []
    while f"{name}@ubatch{len(pieces)}" in acts:
        a = np.asarray(acts[f"{name}@ubatch{len(pieces)}"], np.float64)
        pieces.append(a.reshape(1, -1) if a.ndim == 1 else a.reshape(a.shape[0], -1))
    if not pieces:
        return None
    a = np.concatenate(pieces)
    if a.shape[0] != n_tokens:
        raise ValueError(f"{name}: {a.shape[0]} rows for {n_tokens} tokens")
    return a


def router_names(n_layer: int) -> list[str]:
    """llama.cpp's names of every layer's router logits, ``ffn_moe_logits-0`` ... ``-{n_layer-1}``."""
    return [f"ffn_moe_logits-{i}" for i in range(n_layer)]


def kept_gap(logits: np.ndarray, k: int) -> np.ndarray:
    """The k-th largest minus the (k+1)-th largest entry of each row of ``logits`` ([..., E]):
    how far the last kept expert is from the first dropped one."""
    top = -np.partition(-logits, (k - 1, k), axis=-1)
    return top[..., k - 1] - top[..., k]


def router_gaps(engine: Any, tokens: Sequence[int], n_layer: int, n_expert_used: int) -> np.ndarray:
    """float64 ``[T]``: at each position, the smallest over the MoE layers of (k-th largest minus
    (k+1)-th largest router logit), k = ``n_expert_used``, from ``engine.activations`` under
    llama.cpp's names ``ffn_moe_logits-N`` ([T, n_expert] each).

    Raises ``EngineError`` from the engine, and ``ValueError`` when it returns no router logits."""
    names = router_names(n_layer)
    acts = engine.activations(list(tokens), names=names)
    gaps = []
    for n in names:
        a = router_logits(acts, n, len(tokens))
        if a is not None and a.shape[1] > n_expert_used:
            gaps.append(kept_gap(a, n_expert_used))
    if not gaps:
        raise ValueError(f"the engine returned no router logits ({names[0]} ... {names[-1]})")
    return np.min(np.stack(gaps), axis=0)


def router_cuts(per_position: Mapping[str, np.ndarray], outside: np.ndarray, prompts: Sequence[Any], reference: Any,
                n_layer: int, n_expert_used: int, max_gap: float) -> RouterCuts:
    """Where each prompt's calibrated comparison ends (module docstring).

    Args:
        per_position: the cell's concatenated metrics (``prompt_index``, ``position``, ``finite``,
            ``ref_finite``).
        outside: bool ``[N]``, positions outside the calibrated row's bounds.
        prompts: the cell's ``PromptTokens`` (``id``, ``tokens``), in ``prompt_index`` order.
        reference: the engine whose router logits decide (``activations`` capability).
        max_gap: thresholds.yaml ``probes.moe_router_max_gap`` (logits).

    Returns ``RouterCuts``. A prompt is cut at its first outside position p when that position
    is finite and the reference's router gap at p is at most ``max_gap``; the mask then holds
    every position of that prompt from p on. Reading the router logits is an engine run on the
    prompt up to p; when it fails, the prompt is not cut (a note says why) and the tier judges it
    whole, as without this rule. Never raises.
    """
    mask = np.zeros(outside.size, bool)
    out = RouterCuts(mask, max_gap)
    if not outside.any():
        return out
    if not hasattr(reference, "activations"):
        out.notes.append("the reference gives no router logits (activations capability): no prompt cut at a near-tie")
        return out
    pidx = np.asarray(per_position["prompt_index"])
    ppos = np.asarray(per_position["position"])
    finite = np.asarray(per_position["finite"], bool) & np.asarray(per_position["ref_finite"], bool)
    for i in np.unique(pidx[outside]).tolist():
        sel = pidx == i
        first = int(ppos[sel & outside].min())
        pid = prompts[i].id
        at = np.flatnonzero(sel & (ppos == first))[0]
        if not finite[at]:
            out.notes.append(f"prompt {pid!r} position {first} is non-finite: never a near-tie")
            continue
        try:
            gap = float(router_gaps(reference, prompts[i].tokens[: first + 1], n_layer, n_expert_used)[first])
        except (HarnessError, ValueError) as e:
            out.notes.append(f"prompt {pid!r}: the reference's router logits could not be read ({str(e).splitlines()[0][:200]})")
            continue
        if not gap <= max_gap:
            out.notes.append(f"prompt {pid!r} leaves the bounds at position {first}, where the reference's router has no "
                             f"near-tie (gap {gap:.3g} > {max_gap:g})")
            continue
        cut = sel & (ppos >= first)
        mask |= cut
        out.cuts.append({"prompt": pid, "position": first, "router_gap": gap, "positions_cut": int(cut.sum())})
    return out


@dataclass
class RouterExcuses:
    """What ``release_excuses`` decided: ``mask`` (bool [N] over the cell's concatenated positions:
    below the release floor and excused), ``max_gap`` (logits) and ``max_share`` (of the cell's
    positions) it allowed, ``excused`` ({prompt, position, cosine, router_gap} per excused position)
    and ``notes`` (why a position below the floor was not excused)."""

    mask: np.ndarray
    max_gap: float
    max_share: float
    excused: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return int(self.mask.sum())

    def to_dict(self) -> dict[str, Any]:
        return {"positions": self.count, "excused": self.excused, "router_max_gap": self.max_gap,
                "max_share": self.max_share, "notes": self.notes}

    def line(self) -> str:
        """The release line's clause: the excused positions (the first five), or why none was."""
        if not self.excused:
            return "; ".join(self.notes)
        shown = ", ".join(f"{e['prompt']!r} position {e['position']} (cosine {e['cosine']:.4f}, gap {e['router_gap']:.2g})"
                          for e in self.excused[:5])
        more = f" and {len(self.excused) - 5} more" if len(self.excused) > 5 else ""
        return (f"{self.count} position{'s' if self.count != 1 else ''} below it excused at a reference MoE router near-tie "
                f"(gap ≤ {self.max_gap:g}; a correct engine may keep another expert there): {shown}{more}")


def allowed_excuses(n_positions: int, max_share: float) -> int:
    """How many positions of a cell of ``n_positions`` the release gate may excuse: ``max_share`` of
    them, rounded down, and at least one."""
    return max(1, int(math.floor(max_share * n_positions)))


def release_excuses(per_position: Mapping[str, np.ndarray], below: np.ndarray, prompts: Sequence[Any], reference: Any,
                    n_layer: int, n_expert_used: int, max_gap: float, max_share: float) -> RouterExcuses:
    """Which positions below the release floor the release gate excuses (module docstring).

    Args:
        per_position: the cell's concatenated metrics (``prompt_index``, ``position``, ``finite``,
            ``ref_finite``).
        below: bool ``[N]``, positions below the release floor (cosine < 0.98, or non-finite).
        prompts: the cell's ``PromptTokens`` (``id``, ``tokens``), in ``prompt_index`` order.
        reference: the engine whose router logits decide (``activations`` capability).
        max_gap: thresholds.yaml ``release.moe_router_tie_gap`` (logits).
        max_share: thresholds.yaml ``release.moe_router_max_excused`` (a fraction of the cell).

    Returns ``RouterExcuses``: a finite position below the floor is excused when the reference's
    router gap there (``router_gaps``, smallest over the MoE layers) is at most ``max_gap``; when
    more positions than ``allowed_excuses`` would be, none is (a fault, not a near-tie). Reading the
    router logits is a reference run on each such prompt up to its last position below the floor;
    when it fails, that prompt's positions are not excused (a note says why). Never raises.
    """
    mask = np.zeros(below.size, bool)
    out = RouterExcuses(mask, max_gap, max_share)
    if not below.any():
        return out
    if not hasattr(reference, "activations"):
        out.notes.append("the reference gives no router logits (activations capability): no position excused at a near-tie")
        return out
    pidx, ppos = np.asarray(per_position["prompt_index"]), np.asarray(per_position["position"])
    finite = np.asarray(per_position["finite"], bool) & np.asarray(per_position["ref_finite"], bool)
    cos = np.asarray(per_position["cosine"], np.float64)
    found: list[tuple[int, dict[str, Any]]] = []
    for i in np.unique(pidx[below]).tolist():
        at = np.flatnonzero((pidx == i) & below & finite)
        if not at.size:
            continue
        pid = prompts[i].id
        try:
            gaps = router_gaps(reference, prompts[i].tokens[: int(ppos[at].max()) + 1], n_layer, n_expert_used)
        except (HarnessError, ValueError) as e:
            out.notes.append(f"prompt {pid!r}: the reference's router logits could not be read ({str(e).splitlines()[0][:200]})")
            continue
        for j in at.tolist():
            g = float(gaps[ppos[j]])
            if g <= max_gap:
                found.append((j, {"prompt": pid, "position": int(ppos[j]), "cosine": float(cos[j]), "router_gap": g}))
    n_below, allowed = int(below.sum()), allowed_excuses(below.size, max_share)
    if len(found) > allowed:
        out.notes.append(f"{len(found)} of {n_below} positions below it are at a reference router near-tie (gap ≤ {max_gap:g}), "
                         f"more than the {allowed} ({max_share:.0%} of {below.size}) that may be: none excused")
        return out
    for j, e in found:
        mask[j] = True
        out.excused.append(e)
    if n_below > len(found):
        out.notes.append(f"{n_below - len(found)} position{'s' if n_below - len(found) != 1 else ''} below it not at a reference "
                         f"router near-tie (gap > {max_gap:g}, or non-finite)")
    return out


def _kept_experts(acts: Mapping[str, np.ndarray], names: Sequence[str], n_tokens: int, k: int) -> np.ndarray:
    """bool ``[T, L, E]``: which experts each MoE layer keeps at each position (its k largest router logits)."""
    layers = []
    for n in names:
        a = router_logits(acts, n, n_tokens)
        if a is None:
            raise ValueError(f"no router logits {n}")
        keep = np.zeros(a.shape, bool)
        np.put_along_axis(keep, np.argpartition(-a, k - 1, axis=1)[:, :k], True, axis=1)
        layers.append(keep)
    return np.stack(layers, axis=1)


def first_flip(reference: Any, candidate: Any, tokens: Sequence[int], n_layer: int, n_expert_used: int) -> tuple[int | None, float]:
    """``(position, reference router gap there)`` of the first position where ``candidate`` keeps
    other experts than ``reference`` in some MoE layer (both engines' ``ffn_moe_logits-N``
    activations), or ``(None, nan)`` when they agree everywhere. For calibration, where both
    engines are known-good and may be asked; a parity candidate is never trusted this way
    (``router_cuts``). Raises ``EngineError`` from an engine and ``ValueError`` when one gives
    no router logits or has no ``activations`` at all (mlx-lm exposes none)."""
    for who, engine in (("reference", reference), ("candidate", candidate)):
        if not callable(getattr(engine, "activations", None)):
            raise ValueError(f"the {who} exposes no activations")
    names = router_names(n_layer)
    toks = list(tokens)
    ra = reference.activations(toks, names=names)
    present = [n for n in names if router_logits(ra, n, len(toks)) is not None]
    if not present:
        raise ValueError("the reference gives no router logits")
    ca = candidate.activations(toks, names=present)
    r, c = _kept_experts(ra, present, len(toks), n_expert_used), _kept_experts(ca, present, len(toks), n_expert_used)
    differs = np.flatnonzero((r != c).any(axis=(1, 2)))
    if not differs.size:
        return None, float("nan")
    f = int(differs[0])
    return f, float(np.min(kept_gap(np.stack([router_logits(ra, n, len(toks))[f] for n in present]), n_expert_used)))
