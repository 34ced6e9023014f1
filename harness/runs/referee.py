"""The oracle as referee where the reference is the noisy one (issue 59, docs/gates.md "Where the
reference is off the oracle").

On low-bit i-quant files llama.cpp rounds each matmul's activations to 8 bits for the quantized
dot product (``ggml_vec_dot_iq2_s_q8_K`` and kin), and on an unlucky position that rounding,
amplified downstream, moves the reference's logits below the release floor against any exact
engine: the harness's float64 oracle and mlx at float32 both measure cosine 0.962 at IQ2_M,
prompt ``non-ascii``, position 82. A candidate compared with the reference alone cannot PASS there,
however correct.

The rule: at a position where the candidate is below the release floor against the reference
(or non-finite there), the oracle is run on the same prompt prefix. Where the oracle is below the
floor against the reference too, the reference is off the exact forward there, and the candidate
is judged at that position against the oracle instead, with the same floor: at or above it, the
position is judged against the oracle (neither tier counts it against the reference; the release
line names it and the receipt counts it); below it, it stays a failure. Where the oracle agrees with
the reference (at or above the floor), the fault is the candidate's. A planted fault still FAILs:
against the oracle it is as far off as against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from harness.errors import HarnessError


@dataclass
class OracleReferee:
    """What ``referee`` decided: ``mask`` (bool [N] over the cell's positions judged against the
    oracle instead of the reference), ``floor`` (the release floor used both ways), ``judged``
    ({prompt, position, cosine, oracle_vs_reference, candidate_vs_oracle} each) and ``notes``."""

    mask: np.ndarray
    floor: float
    judged: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reference_off: list[dict[str, Any]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return int(self.mask.sum())

    def to_dict(self) -> dict[str, Any]:
        return {"positions": self.count, "judged": self.judged, "reference_off_oracle": self.reference_off,
                "floor": self.floor, "notes": self.notes}

    def line(self) -> str:
        """The release line's clause: the positions judged against the oracle (the first five)."""
        if not self.judged:
            return "; ".join(self.notes)
        shown = ", ".join(f"{e['prompt']!r} position {e['position']} (reference off the oracle: cosine "
                          f"{e['oracle_vs_reference']:.4f}; candidate vs oracle {e['candidate_vs_oracle']:.5f})"
                          for e in self.judged[:5])
        more = f" and {len(self.judged) - 5} more" if len(self.judged) > 5 else ""
        n = self.count
        return (f"{n} position{'s' if n != 1 else ''} below it where the reference is off the exact oracle, judged against "
                f"the oracle instead (≥ {self.floor:g}): {shown}{more}")


Compare = Callable[[Any, Any, Sequence[int], int], Mapping[str, np.ndarray]]


def referee(per_position: Mapping[str, np.ndarray], floor: float, prompts: Sequence[Any], reference: Any,
            candidate: Any, oracle: Any | None, candidate_is_oracle: bool, n_vocab: int, compare: Compare) -> OracleReferee:
    """Which positions below ``floor`` (candidate vs reference) are judged against the oracle
    (module docstring).

    Args:
        per_position: the cell's concatenated metrics (``prompt_index``, ``position``, ``cosine``,
            ``finite``, ``ref_finite``).
        floor: the release floor (thresholds.yaml ``release.min_cosine``).
        prompts: the cell's ``PromptTokens`` in ``prompt_index`` order.
        reference, candidate: the cell's engines; oracle: the float64 oracle (None: not loadable,
            nothing judged against it, a note says so).
        candidate_is_oracle: the candidate is the oracle itself (its cosine against the oracle is 1).
        compare: ``harness.runs.parity.compare_prompt`` (reference, candidate, tokens, n_vocab).

    Returns ``OracleReferee``. An engine failure on a prompt leaves its positions failing, with a
    note. Never raises.
    """
    cos = np.asarray(per_position["cosine"], np.float64)
    out = OracleReferee(np.zeros(cos.size, bool), float(floor))
    with np.errstate(invalid="ignore"):
        # a non-finite candidate row is the candidate's own fault: never refereed
        below = ~(cos >= floor) & np.asarray(per_position["ref_finite"], bool) & np.isfinite(cos)
    if not below.any():
        return out
    if oracle is None:
        out.notes.append("the oracle could not be loaded: no position judged against it")
        return out
    pidx, ppos = np.asarray(per_position["prompt_index"]), np.asarray(per_position["position"])
    for i in np.unique(pidx[below]).tolist():
        at = np.flatnonzero((pidx == i) & below)
        p = prompts[i]
        prefix = list(p.tokens[: int(ppos[at].max()) + 1])
        try:
            ro = np.asarray(compare(reference, oracle, prefix, n_vocab)["cosine"], np.float64)
            co = np.ones(len(prefix)) if candidate_is_oracle else np.asarray(compare(oracle, candidate, prefix, n_vocab)["cosine"], np.float64)
        except (HarnessError, ValueError) as e:
            out.notes.append(f"prompt {p.id!r}: the oracle could not referee ({str(e).splitlines()[0][:200]})")
            continue
        for j in at.tolist():
            k = int(ppos[j])
            if not ro[k] < floor:
                continue
            e = {"prompt": p.id, "position": k, "cosine": _finite(cos[j]), "oracle_vs_reference": _finite(ro[k]),
                 "candidate_vs_oracle": _finite(co[k])}
            out.reference_off.append(e)
            if co[k] >= floor:
                out.mask[j] = True
                out.judged.append(e)
    n_other = int(below.sum()) - out.count
    if n_other:
        out.notes.append(f"{n_other} position{'s' if n_other != 1 else ''} below it where the reference agrees with the oracle "
                         f"or the candidate is off the oracle too: the candidate's")
    return out


def _finite(x: float) -> float | None:
    """``x`` as a float, or None where it is not finite (evidence records undefined values as null)."""
    v = float(x)
    return v if np.isfinite(v) else None
