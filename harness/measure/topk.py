"""Top-k metrics: the reference's full distribution against a candidate that gives only its top-k
logprobs per position (an ``http:NAME`` server; docs/engine-protocol.md, "HTTP engines").

Inputs per block of B positions: ``ref`` float32 logits ``[B, V]`` (row t = the distribution after
``tokens[:t+1]``), and the candidate's ``ids`` int64 ``[B, k]`` (-1 marks an empty slot: fewer
entries, or a key that could not be mapped to one token id) with ``logprobs`` float64 ``[B, k]``
(natural log, NaN in empty slots). Definitions:

- ``kld``: KL(P_ref ‖ P_cand) in nats over the partition {each candidate token} ∪ {tail}: the
  candidate's tail mass is ``1 − Σ exp(logprob)``, the reference's is the mass of every other
  token. By the data-processing inequality it is at most the full-vocabulary KLD, and it is
  exactly what top-k logprobs can show;
- ``argmax_agree``: the candidate's best entry is the reference's argmax (top-1 agreement);
  ``top1_known`` is False where an entry the server sent under an ambiguous key (one no single id
  has) is at least as likely as its best mapped entry: there the candidate's top-1 is unknown, and
  greedy agreement leaves the position out (``summarize_topk``'s ``topk.top1_unknown`` counts them);
- ``cand_rank``: the rank of the reference's argmax among the candidate's entries (0 = its top),
  ``-1`` when it is not among them;
- ``top5_overlap`` / ``top10_overlap``: |top_n(ref) ∩ top_n(cand)| / n for n = min(5 or 10, the
  candidate's entries);
- ``ref_margin``: top-1 minus top-2 reference logit (flips below the near-tie margin are near-ties);
- ``cosine``: NaN at every position, kept so a top-k receipt's arrays have the parity receipt's keys.

The cosine of raw logits (the release gate) cannot be computed from top-k logprobs: a top-k cell
says so and never reports it as passed (``judge_topk``).

Top-k rows of thresholds.yaml (``Thresholds.topk_rows``) are measured by cutting the full-logit
known-good pairs of calibration down to their top k (``cut_topk``) and measuring them with these
same functions (``harness.runs.calibrate.calibrate_topk``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.special import log_softmax

from harness.engines.base import TopK
from harness.measure import metrics

TAIL_EPS = 1e-6
"""Tail masses both below this are rounding (float32 logprobs summing to 1 ± 1e-7), not a tail:
the tail term is left out. A candidate tail of 0 against a reference tail above it counts as
1e-12 (a large, finite KLD)."""

PER_POSITION_KEYS = ("finite", "ref_finite", "cosine", "kld", "argmax_agree", "ref_argmax", "cand_argmax", "ref_margin",
                     "cand_rank", "top5_overlap", "top10_overlap", "tail_mass", "cand_k", "top1_known")


def cut_topk(logits: np.ndarray, k: int) -> TopK:
    """The top ``k`` log-softmax entries of each row of float ``[B, V]`` logits (what a server
    that returns k logprobs would send), ties broken by the lower token id."""
    lp = log_softmax(np.asarray(logits, np.float64), axis=1)
    k = min(k, lp.shape[1])
    order = np.lexsort((np.broadcast_to(np.arange(lp.shape[1]), lp.shape), -lp), axis=1)[:, :k]
    return TopK(order.astype(np.int64), np.take_along_axis(lp, order, axis=1))


def truncate(top: TopK, k: int) -> TopK:
    """The ``k`` largest valid entries of each row (a row of k' > k entries judged as a k row)."""
    lp = np.where(top.ids >= 0, np.nan_to_num(top.logprobs, nan=-np.inf), -np.inf)
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    ids = np.take_along_axis(top.ids, order, axis=1)
    lps = np.take_along_axis(top.logprobs, order, axis=1)
    return TopK(np.where(ids >= 0, ids, -1), np.where(ids >= 0, lps, np.nan), top.dropped_max)


def _row_metrics(r: np.ndarray, ids: np.ndarray, lps: np.ndarray, ref_top: np.ndarray) -> tuple[float, int, int, float, float, float, int]:
    """(kld, cand_argmax, cand_rank, top5, top10, tail_mass, n_entries) of one position; ``r``
    float64 reference logits ``[V]``, ``ref_top`` its ids by (logit descending, id ascending),
    at least the first ``max(TOPK)`` (``metrics.top_k``)."""
    ok = (ids >= 0) & np.isfinite(lps)
    ids, lps = ids[ok], lps[ok]
    ids, first = np.unique(ids, return_index=True)  # a duplicated id keeps its first entry
    lps = lps[first]
    order = np.argsort(-lps, kind="stable")
    ids, lps = ids[order], lps[order]
    n = ids.size
    logp = r - (r.max() + math.log(np.exp(r - r.max()).sum()))
    p_s = np.exp(logp[ids])
    q_s = np.exp(lps)
    p_tail = max(1.0 - float(p_s.sum()), 0.0)
    q_tail = max(1.0 - float(q_s.sum()), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        kld = float(np.sum(p_s * (logp[ids] - lps)))
    if p_tail >= TAIL_EPS or q_tail >= TAIL_EPS:  # both below it: rounding of sums near 1, no tail to judge
        kld += p_tail * (math.log(p_tail) - math.log(max(q_tail, 1e-12))) if p_tail > 0 else 0.0
    kld = max(kld, 0.0)
    hits = np.flatnonzero(ids == ref_top[0])
    rank = int(hits[0]) if hits.size else -1
    over = []
    for m in metrics.TOPK:  # the top-m of a (logit, id) ordering is the first m of its top-10
        m = min(m, n)
        over.append(float(np.intersect1d(ref_top[:m], ids[:m]).size) / m if m else math.nan)
    return kld, int(ids[0]) if n else -1, rank, over[0], over[1], q_tail, n


def topk_position_metrics(ref: np.ndarray, top: TopK) -> dict[str, np.ndarray]:
    """Per-position top-k metrics (``PER_POSITION_KEYS``, module docstring) of one block.

    ``ref`` float32 ``[B, V]``; ``top`` the candidate's ``[B, k]`` entries. A position whose
    candidate row holds no valid entry is flagged ``finite`` False (every metric NaN / -1).
    """
    ref = np.asarray(ref, np.float64)
    b = ref.shape[0]
    out = {k: np.full(b, np.nan) for k in ("cosine", "kld", "ref_margin", "top5_overlap", "top10_overlap", "tail_mass")}
    out.update({k: np.full(b, -1, np.int64) for k in ("ref_argmax", "cand_argmax", "cand_rank", "cand_k")})
    out["finite"] = np.zeros(b, bool)
    out["top1_known"] = np.ones(b, bool)
    out["ref_finite"] = np.isfinite(ref).all(axis=1)
    for i in range(b):
        r = ref[i]
        if not out["ref_finite"][i]:
            continue
        ref_top = metrics.top_k(r[None, :].astype(np.float32), max(metrics.TOPK))[0]  # one selection per row
        out["ref_margin"][i] = float(r[ref_top[0]] - r[ref_top[1]]) if ref_top.size > 1 else 0.0
        out["ref_argmax"][i] = int(ref_top[0])
        kld, ca, rank, t5, t10, tail, n = _row_metrics(r, top.ids[i], top.logprobs[i], ref_top)
        if n == 0:
            continue
        out["finite"][i] = True
        out["kld"][i], out["cand_argmax"][i], out["cand_rank"][i] = kld, ca, rank
        out["top5_overlap"][i], out["top10_overlap"][i], out["tail_mass"][i], out["cand_k"][i] = t5, t10, tail, n
        valid = top.logprobs[i][(top.ids[i] >= 0) & np.isfinite(top.logprobs[i])]
        if top.dropped_max is not None and top.dropped_max[i] >= valid.max():
            out["top1_known"][i] = False  # the candidate's best entry is one whose key maps to no single id
    out["argmax_agree"] = out["finite"] & (out["cand_argmax"] == out["ref_argmax"])
    return out


def summarize_topk(per_position: Mapping[str, np.ndarray], near_tie_margin: float = metrics.NEAR_TIE_MARGIN) -> dict[str, Any]:
    """Summary of concatenated top-k metrics in the shape of ``metrics.summarize`` (the cosine and
    NMSE fields None: not computable from top-k), plus ``topk`` {k_min, tail_mass_max,
    ref_argmax_absent}. JSON-ready."""
    finite = np.asarray(per_position["finite"], bool) & np.asarray(per_position["ref_finite"], bool)
    idx = np.flatnonzero(finite)
    n = int(finite.size)
    nonfinite = np.flatnonzero(~np.asarray(per_position["finite"], bool))
    out: dict[str, Any] = {"positions": n, "compared_positions": int(idx.size), "nonfinite_positions": int(nonfinite.size),
                           "first_nonfinite_index": int(nonfinite[0]) if nonfinite.size else None,
                           "ref_nonfinite_positions": int(np.count_nonzero(~np.asarray(per_position["ref_finite"], bool))),
                           "min_cosine": None, "min_cosine_index": None, "mean_cosine": None, "nmse": None}
    if not idx.size:
        out.update(kld=None, ref_margin=None, cand_rank=None, top5_overlap_mean=None, top10_overlap_mean=None, topk=None)
        out.update(metrics._greedy_summary(per_position, idx, near_tie_margin))
        return out
    kld = np.asarray(per_position["kld"], np.float64)[idx]
    q = np.quantile(kld, list(metrics.KLD_QUANTILES.values()))
    out["kld"] = {"mean": metrics._f(kld.mean()), "sem": metrics._f(kld.std(ddof=1) / math.sqrt(idx.size)) if idx.size > 1 else None,
                  **{name: metrics._f(v) for name, v in zip(metrics.KLD_QUANTILES, q)}, "max": metrics._f(kld.max()),
                  "max_index": int(idx[int(np.argmax(kld))])}
    margin = np.asarray(per_position["ref_margin"], np.float64)[idx]
    mq = np.quantile(margin, (0.01, 0.05, 0.5))
    out["ref_margin"] = {"min": metrics._f(margin.min()), "p1": metrics._f(mq[0]), "p5": metrics._f(mq[1]), "p50": metrics._f(mq[2])}
    rank = np.asarray(per_position["cand_rank"])[idx]
    present = rank[rank >= 0]
    out["cand_rank"] = {"p99": metrics._f(np.quantile(present, 0.99)) if present.size else None,
                        "max": int(present.max()) if present.size else None}
    out["top5_overlap_mean"] = metrics._f(np.nanmean(np.asarray(per_position["top5_overlap"])[idx]))
    out["top10_overlap_mean"] = metrics._f(np.nanmean(np.asarray(per_position["top10_overlap"])[idx]))
    known = np.asarray(per_position.get("top1_known", np.ones(n, bool)), bool)
    out["topk"] = {"k_min": int(np.asarray(per_position["cand_k"])[idx].min()),
                   "tail_mass_max": metrics._f(np.asarray(per_position["tail_mass"])[idx].max()),
                   "ref_argmax_absent": int(np.count_nonzero(rank < 0)),
                   "top1_unknown": int(np.count_nonzero(~known[idx]))}
    out.update(metrics._greedy_summary(per_position, idx[known[idx]], near_tie_margin))
    return out


def per_prompt_topk(prompt_ids: Sequence[str], lengths: Sequence[int], per_position: Mapping[str, np.ndarray],
                    near_tie_margin: float) -> list[dict[str, Any]]:
    """Per-prompt entries of a top-k receipt (the parity receipt's ``per_prompt`` fields; cosine
    fields None)."""
    out = []
    pi = np.asarray(per_position["prompt_index"])
    for i, (pid, n) in enumerate(zip(prompt_ids, lengths)):
        s = summarize_topk({k: v[pi == i] for k, v in per_position.items()}, near_tie_margin)
        out.append({"id": pid, "positions": int(n), "min_cosine": None, "min_cosine_position": None, "mean_cosine": None,
                    "argmax_agreement": s["argmax_agreement"]["rate"], "near_tie_flips": s["flips"]["near_tie"],
                    "hard_flips": s["flips"]["hard"], "kld_mean": (s.get("kld") or {}).get("mean"),
                    "kld_max": (s.get("kld") or {}).get("max"), "failing_positions": 0, "first_failing_position": None,
                    "nonfinite_positions": s["nonfinite_positions"]})
    return out


