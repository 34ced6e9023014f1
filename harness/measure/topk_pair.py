"""Two top-k rows of the same history compared: a served request's against the same request alone,
both from a server (``http:NAME``), neither with full logits (docs/engine-protocol.md, "Traffic
from concurrent clients").

``pair_kld(a, b)``: KL(P_a ‖ P_b) in nats over the partition {each id in both rows' entries} ∪
{tail}: each side's tail is 1 − Σ exp(logprob) of those ids. It is a coarsening of the full
distributions, so by the data-processing inequality it is at most the full-vocabulary KLD, and it
is what two top-k rows can show (as ``harness.measure.topk`` does against full logits).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from harness.measure.topk import TAIL_EPS


def pair_kld(a_ids: Sequence[int], a_lps: Sequence[float], b_ids: Sequence[int], b_lps: Sequence[float]) -> float:
    """KL(P_a ‖ P_b) of one position (module docstring); ``*_ids`` int token ids (-1 ignored),
    ``*_lps`` their natural-log probabilities. NaN when the rows share no id."""
    a = {int(i): float(lp) for i, lp in zip(a_ids, a_lps) if int(i) >= 0 and math.isfinite(lp)}
    b = {int(i): float(lp) for i, lp in zip(b_ids, b_lps) if int(i) >= 0 and math.isfinite(lp)}
    common = sorted(set(a) & set(b))
    if not common:
        return math.nan
    p = np.exp([a[i] for i in common])
    q = np.exp([b[i] for i in common])
    kld = float(np.sum(p * (np.log(p) - np.log(q))))
    pt, qt = max(1.0 - float(p.sum()), 0.0), max(1.0 - float(q.sum()), 0.0)
    if pt >= TAIL_EPS or qt >= TAIL_EPS:
        kld += pt * (math.log(pt) - math.log(max(qt, 1e-12))) if pt > 0 else 0.0
    return max(kld, 0.0)
