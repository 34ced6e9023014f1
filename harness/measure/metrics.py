"""Per-position parity metrics over two logit blocks, and their summaries.

Every function takes ``ref`` and ``cand``: float32 logit blocks ``[B, V]`` for the same B
positions (row t = the next-token logits after ``tokens[:t+1]``), reference first. Definitions
(docs/design.md, "Evidence formats"):

- cosine: cosine similarity of the raw logit rows (the gate), block sums accumulated in float64
  (absolute error below 1e-8, ~1e-10 typical at Qwen3.5's vocab; for near-identical rows
  1 - cosine keeps ~3 significant digits);
- KLD: KL(P_ref || P_cand) in nats over the full vocabulary, P = softmax(logits);
- argmax agreement; reference margin (top-1 minus top-2 reference logit); candidate rank of the
  reference's top token (0 = the candidate's top token too);
- top-k overlap |top_k(ref) ∩ top_k(cand)| / k for k = 5 and 10;
- NMSE: sum((cand - ref)^2) / sum(ref^2).
- next-token NLL, perplexity and Δp (``next_token_metrics``, ``perplexity_summary``,
  ``delta_p_summary``): as llama.cpp's ``llama-perplexity`` defines them, over the scored
  positions; report-only.

Top-k sets and argmax break ties by the lower token id, as ``np.argmax`` does.

Non-finite rows never raise: ``finite`` (candidate row all finite) and ``ref_finite`` flag them,
and every metric of such a position is NaN (float arrays) or -1 (integer arrays). Well-formed
candidate logits holding NaN/Inf are a FAIL at that position; the caller decides, using
``cosine_failures``, which treats a flagged row as failing.

Speed (Qwen3.5's V = 248,320, 1 MB per float32 row): rows are processed one at a time so each
row's working set stays in cache. Two paths compute the same fields:

- the compiled path (``harness.measure.rowkernel``, ``rowkernel.c``), taken whenever the kernel
  builds on this machine (a C compiler; ``harness doctor`` says which path runs and why): two
  fused passes per row pair. Pass 1 reads both rows once for |r|², |c|², |r − c|², the KLD's
  Σ exp r and Σ exp(r)·(r − c), min/max of r − c and each 256-entry sub-block's maximum (the
  top-k bound), and writes exp r; pass 2 reads r, c and exp r (still in cache) for the KLD's
  Σ exp(r)·g(m − d). Top-k then scans only the sub-blocks whose maximum reaches the k-th largest
  sub-block maximum. About 2.4× faster than the numpy path here (``benchmarks/bench_metrics.py``).
- the numpy path, one numpy call per pass: the reference row 4 times (|r|², top-k, r − c, exp r),
  the candidate row 3 times (|c|², top-k, r − c), and ten passes over three row-sized float32
  scratch buffers (d = r − c, e = exp r, y = expm1(x) − x). Top-k never sorts the vocabulary (a
  column-maximum bound over a ``[V / W, W]`` view picks the few candidates, then a partition/sort
  over those alone).

Both read a bounded number of times per row, independent of the position count; the per-metric
functions (``cosine``, ``kl_divergence`` ...) take the same path as ``position_metrics``, so they
give its values. ``tests/test_rowkernel.py`` checks the two paths against each other (integer
fields exactly, float fields within the numpy path's error) and against float64.

Where float64 is kept, because the result would be wrong without it:

- every sum: on the numpy path each block of ~2,048 float32 products (BLAS ``sdot``) is added in
  float64 (``_Scratch.dot64``); the compiled path sums runs of 4 terms per vector lane in float32
  and those partials in float64 (rowkernel.c): a float32 sum over 248,320 terms would lose the
  1e-7 differences that separate an F32 engine from a broken one;
- r·c is derived in float64 from |r|², |c|² and |r − c|² while the rows are close (1 − cosine keeps
  relative precision), else computed as a float64 dot (``_fast_pair``);
- the KLD's log-partition terms: the form ``log1p(E_p[expm1(x) - x])`` with float64 sums makes the
  error relative to the KLD rather than to log Z (about 12): about 1e-8 relative at the F32 floor
  on the compiled path (g(x) = expm1(x) − x by its Taylor series while |x| < 0.5, so no
  cancellation), about 3e-5 on the numpy path (float32 ``expm1(x) − x``), both far inside any gate;
  rows whose logits differ by more than ~30 take a float64 log-softmax (``_kld_row_f64``);
- rows with non-finite values or sums of squares outside [1e-30, 1e30] (``_row_f64``).

float32 is kept where it changes nothing: exp/expm1 of single entries (relative 1e-7 per term,
averaging out in the sums) and the top-k/argmax selection, which compares float32 values exactly.
``tests/test_metrics_fused.py`` checks every field against a plain float64 computation at
Qwen3.5's vocab at the F32 floor (KLD ~ 1e-8).
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
from typing import Any, Mapping

import numpy as np

from harness.errors import InvalidInput, NotComparable
from harness.measure import rowkernel

TOPK = (5, 10)
"""The top-k overlaps reported; the largest k also bounds the candidate-rank shortcut."""

NEAR_TIE_MARGIN = 0.25
"""Default report-only margin (logits): a flip is a near-tie when the reference's top-1/top-2
gap is below it (docs/design.md, "Evidence formats")."""

KLD_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p99_9": 0.999}

# float32 fast path of the KLD is taken while max(x) stays below this (x defined in _kld_row):
# p_i * expm1(x_i) then cannot overflow, and mass lost to exp underflow of p_i is below
# V * exp(-87 + 30) ~ 1e-19. Rows beyond it (wildly different logits) use the float64 path.
_KLD_FAST_XMAX = 30.0

# Range of max(r) in which the KLD takes exp(r) unshifted (see _kld_row).
_EXP_UNSHIFTED = (-20.0, 40.0)

# Rows are viewed as [V / W, W] blocks: dot64 sums float32 products within a block and the
# blocks in float64; _topk_row takes column maxima over them. W divides V where it can (Qwen3.5:
# 248,320 = 97 x 2,560), else the leftover tail is handled on its own. Shorter rows than
# _TOPK_DIRECT_V are partitioned directly.
_WIDTH_DEFAULT = 2048
_TOPK_DIRECT_V = 8192


@functools.lru_cache(maxsize=None)
def _block_width(n_vocab: int) -> int:
    """A multiple of 64 in [1024, 8192] dividing ``n_vocab``, nearest 2,048; else 2,048."""
    fits = [w for w in range(1024, 8193, 64) if n_vocab % w == 0]
    return min(fits, key=lambda w: abs(w - _WIDTH_DEFAULT)) if fits else _WIDTH_DEFAULT


# Largest |r - c|^2 / (2 |r| |c|) (about 1 - cosine) for which _fast_pair derives r·c from it.
_RC_FROM_DD = 0.25

# Fast-path range of a row's sum of squares; outside it (tiny, huge or non-finite logits) the
# row takes the float64 path, so float32 block sums can neither overflow nor underflow.
_RR_RANGE = (1e-30, 1e30)

PER_POSITION_KEYS = (
    "finite",
    "ref_finite",
    "cosine",
    "kld",
    "argmax_agree",
    "ref_argmax",
    "cand_argmax",
    "ref_margin",
    "cand_rank",
    "top5_overlap",
    "top10_overlap",
    "nmse",
)
"""Keys of ``position_metrics``'s result, each an array of length B."""


# --------------------------------------------------------------------------------------------
# Per-row kernels. Each takes 1-D float32 rows of length V and scratch buffers it may overwrite.
# --------------------------------------------------------------------------------------------


class _Scratch:
    """Reusable per-row buffers: allocating 1 MB per row costs page faults on every call.

    One set per thread and vocab size is kept (``_scratch``), so successive blocks reuse it.
    """

    def __init__(self, n_vocab: int):
        self.width = _block_width(n_vocab)
        self.n_full = (n_vocab // self.width) * self.width
        self.d = np.empty(n_vocab, dtype=np.float32)
        self.e = np.empty(n_vocab, dtype=np.float32)
        self.y = np.empty(n_vocab, dtype=np.float32)
        self.ones = np.ones(n_vocab, dtype=np.float32)  # sum(a) = dot64(a, ones): BLAS beats a reduction

    def dot64(self, a: np.ndarray, b: np.ndarray) -> float:
        """sum(a * b) of float32 rows: products summed in float32 within blocks of ``width``
        entries (BLAS ``sdot``), the block sums in float64.

        Relative error ~1e-9 for same-signed terms, set by rounding each block sum to float32;
        a full float64 dot would need float64 copies of both rows (+1.5 plain passes per row).
        """
        n, w = self.n_full, self.width
        total = float(np.vecdot(a[:n].reshape(-1, w), b[:n].reshape(-1, w)).sum(dtype=np.float64))
        if n < a.shape[0]:
            total += float(np.dot(a[n:].astype(np.float64), b[n:].astype(np.float64)))
        return total


_SCRATCH = threading.local()


def _scratch(n_vocab: int) -> _Scratch:
    s = getattr(_SCRATCH, "s", None)
    if s is None or s.d.shape[0] != n_vocab:
        s = _SCRATCH.s = _Scratch(n_vocab)
    return s


def _as_block(name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise InvalidInput(f"{name} must be a [B, V] logit block, got shape {a.shape}")
    if a.shape[1] < 2:
        raise InvalidInput(f"{name}: logit rows need at least 2 entries, got V={a.shape[1]}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _check_pair(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref = _as_block("ref", ref)
    cand = _as_block("cand", cand)
    if ref.shape != cand.shape:
        raise NotComparable(f"reference logits {ref.shape} and candidate logits {cand.shape} differ in shape")
    return ref, cand


def _cosine_from_dots(rr: float, cc: float, rc: float) -> float:
    """cos = r·c / (|r| |c|); two zero rows count as identical (1.0), one zero row as 0.0."""
    if rr == 0.0 or cc == 0.0:
        return 1.0 if rr == cc else 0.0
    return max(-1.0, min(1.0, rc / math.sqrt(rr * cc)))


def _nmse_from_dots(rr: float, dd: float) -> float:
    if rr > 0.0:
        return dd / rr
    return 0.0 if dd == 0.0 else math.inf


def _in_fast_range(v: float) -> bool:
    return _RR_RANGE[0] < v < _RR_RANGE[1]


def _topk_row(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k token ids of a finite row, sorted by (logit descending, id ascending), and their logits.

    The row's first ``L * W`` entries are viewed as ``[L, W]`` (W from ``_block_width``). The k-th
    largest of any k distinct entries (here: maxima of groups of columns, and the leftover tail)
    is a lower bound on the row's k-th largest value, so only columns whose maximum reaches it,
    and tail entries that do, can hold the top k; the selection then runs over those few entries.
    """
    n = row.shape[0]
    k = min(k, n)
    if n <= _TOPK_DIRECT_V or k > 64:  # the bound below draws on 64 group maxima
        ids = np.arange(n)
        vals = row
    else:
        w = _block_width(n)
        n_full = (n // w) * w
        grid = row[:n_full].reshape(-1, w)
        tail = row[n_full:]
        colmax = grid.max(axis=0)
        # Maxima of 64 groups of column maxima: still distinct entries, and a 64-entry
        # partition is several times cheaper than a 2,048-entry one.
        pool = colmax.reshape(-1, 64).max(axis=0)
        if tail.size:
            pool = np.concatenate([pool, tail])
        bound = np.partition(pool, pool.size - k)[pool.size - k]
        cols = np.flatnonzero(colmax >= bound)
        sub = np.take(grid, cols, axis=1)  # [L, n_cols]
        rows, at = np.nonzero(sub >= bound)
        ids = rows * w + cols[at]
        if tail.size:
            ids = np.concatenate([ids, n_full + np.flatnonzero(tail >= bound)])
        vals = row[ids]
    if vals.size > 8 * k:
        # Keep every entry tied with the k-th value so ties resolve by token id, not by the
        # partition's internal order.
        keep = np.flatnonzero(vals >= np.partition(vals, vals.size - k)[vals.size - k])
        ids, vals = ids[keep], vals[keep]
    top = ids[np.lexsort((ids, -vals))[:k]]
    return top, row[top]


def _rank_of(c: np.ndarray, token: int, cand_top: np.ndarray) -> int:
    """Rank of ``token`` in row ``c`` (0 = top), ties broken by token id."""
    hit = np.flatnonzero(cand_top == token)
    if hit.size:
        return int(hit[0])
    v = c[token]
    return int(np.count_nonzero(c > v)) + int(np.count_nonzero(c[:token] == v))


def _kld_row_f64(r: np.ndarray, c: np.ndarray) -> float:
    """KL(softmax(r) || softmax(c)) with float64 log-softmax: the reference and fallback path."""
    r = r.astype(np.float64)
    c = c.astype(np.float64)
    lr = r - r.max()
    lr -= math.log(np.exp(lr).sum())
    lc = c - c.max()
    lc -= math.log(np.exp(lc).sum())
    p = np.exp(lr)
    return max(0.0, float(p @ (lr - lc)))


def _kld_row(r: np.ndarray, c: np.ndarray, r_max: float, s: _Scratch) -> tuple[float, float, float, float | None]:
    """(KL(softmax(r) || softmax(c)) in nats, |r - c|^2, log Σ exp(r), log Σ exp(c) or None) for
    finite float32 fast-range rows. The reference's log-partition is the one
    ``_log_partition(r, r_max, s)`` returns, bit for bit (the same float32 exps and float64 sums),
    so ``position_metrics`` gives it to the next-token metrics without another pass.

    The candidate's follows from the same sums: E_p[exp(x)] = exp(m) Σ exp(c) / Σ exp(r), so
    log Σ exp(c) = log Σ exp(r) − m + KL, exact in real arithmetic and as precise as a pass of its
    own (its error is log Σ exp(r)'s plus m's, both ~1e-8 absolute at Qwen3.5's vocab), which it
    saves: a float32 ``exp`` and a sum over the candidate row (issue 47). None on the float64
    path, whose KL the float32 sums did not give.

    With d = r - c and m = E_p[d], log p_i - log q_i = d_i - m + log E_p[exp(m - d)], so
    KL = log E_p[exp(x)] with x = m - d and E_p[x] = 0, i.e.

        KL = log1p(E_p[expm1(x) - x]),

    a sum of non-negative terms. A float32 error eps in p_i (the float32 exp) changes KL by
    ~eps * KL, not by eps * |log Z|, so near-identical rows keep their small KLD; an error in m
    changes it only at second order. p = exp(r - shift) / Z with shift = 0 while max r lies in
    [-20, 40] (float32 sums cannot overflow, and mass lost to underflow stays below
    V * exp(-84 + 30)), else shift = max r; sums via ``_Scratch.dot64``.
    Rows with max(x) > 30 (logits differing wildly) use the float64 path instead, where
    float32 expm1 could overflow or underflowed p_i could hide candidate mass.
    """
    d, e, y = s.d, s.e, s.y
    np.subtract(r, c, out=d)
    unshifted = _EXP_UNSHIFTED[0] <= r_max <= _EXP_UNSHIFTED[1]
    if unshifted:
        np.exp(r, out=e)  # p ∝ exp(r): no rounding of r - max r, and one pass fewer
    else:
        np.subtract(r, np.float32(r_max), out=e)
        np.exp(e, out=e)
    z = s.dot64(e, s.ones)
    log_z = math.log(z) if unshifted else r_max + math.log(z)
    m = s.dot64(e, d) / z
    dd = s.dot64(d, d)
    if m - float(d.min()) > _KLD_FAST_XMAX:
        return _kld_row_f64(r, c), dd, log_z, None
    x = np.subtract(np.float32(m), d, out=d)  # x = m - d overwrites d: a smaller working set
    np.expm1(x, out=y)
    np.subtract(y, x, out=y)
    kld = math.log1p(s.dot64(e, y) / z)
    return max(0.0, kld), dd, log_z, log_z - m + kld


def _row_f64(r: np.ndarray, c: np.ndarray) -> tuple[bool, bool, float, float, float]:
    """(ref_finite, cand_finite, cosine, kld, nmse) in float64, for rows outside the fast range."""
    r64 = r.astype(np.float64)
    c64 = c.astype(np.float64)
    rf = bool(np.isfinite(r64).all())
    cf = bool(np.isfinite(c64).all())
    if not (rf and cf):
        return rf, cf, math.nan, math.nan, math.nan
    # Scale by the largest magnitude so the squares neither overflow nor underflow; cosine and
    # NMSE are invariant to a common positive scale.
    scale = max(float(np.abs(r64).max()), float(np.abs(c64).max())) or 1.0
    rs, cs = r64 / scale, c64 / scale
    rr, cc, rc = float(rs @ rs), float(cs @ cs), float(rs @ cs)
    dd = float((rs - cs) @ (rs - cs))
    return True, True, _cosine_from_dots(rr, cc, rc), _kld_row_f64(r, c), _nmse_from_dots(rr, dd)


def _fast_pair(r, c, rr: float, cc: float, s: _Scratch, r_max: float | None) -> tuple[float, float, float, float, float | None]:
    """(cosine, kld, nmse, log Σ exp(r), log Σ exp(c) or None) of a fast-range row pair
    (``_kld_row``); kld and the log-partitions are NaN / None when ``r_max`` is None (skipped)."""
    if r_max is None:
        kld = log_z = math.nan
        log_zc = None
        np.subtract(r, c, out=s.d)
        dd = s.dot64(s.d, s.d)
    else:
        kld, dd, log_z, log_zc = _kld_row(r, c, r_max, s)
    # While the rows are close, r·c = (|r|^2 + |c|^2 - |r - c|^2) / 2 costs no pass and keeps
    # 1 - cos to relative precision. Its error, from rounding r - c to float32, is at most
    # 1.2e-7 * dd / (2|r||c|) (random-signed, so far less in practice); rows where that bound
    # passes 3e-8 (cosine below ~0.75, or norms far apart) take an exact float64 dot instead.
    if dd <= _RC_FROM_DD * 2.0 * math.sqrt(rr * cc):
        rc = 0.5 * (rr + cc - dd)
    else:
        rc = float(r.astype(np.float64) @ c.astype(np.float64))
    return _cosine_from_dots(rr, cc, rc), kld, _nmse_from_dots(rr, dd), log_z, log_zc


def _pair_stats(r, c, s: _Scratch, with_kld: bool) -> tuple[bool, bool, float, float, float]:
    """(ref_finite, cand_finite, cosine, kld, nmse) of one row pair, by whichever path fits."""
    rr, cc = s.dot64(r, r), s.dot64(c, c)
    if _in_fast_range(rr) and _in_fast_range(cc):
        return (True, True, *_fast_pair(r, c, rr, cc, s, float(r.max()) if with_kld else None)[:3])
    return _row_f64(r, c)


# --------------------------------------------------------------------------------------------
# Public per-position metrics
# --------------------------------------------------------------------------------------------


def _empty_result(n: int) -> dict[str, np.ndarray]:
    nan = np.full(n, np.nan)
    return {
        "finite": np.zeros(n, dtype=bool),
        "ref_finite": np.zeros(n, dtype=bool),
        "cosine": nan.copy(),
        "kld": nan.copy(),
        "argmax_agree": np.zeros(n, dtype=bool),
        "ref_argmax": np.full(n, -1, dtype=np.int64),
        "cand_argmax": np.full(n, -1, dtype=np.int64),
        "ref_margin": nan.copy(),
        "cand_rank": np.full(n, -1, dtype=np.int64),
        "top5_overlap": nan.copy(),
        "top10_overlap": nan.copy(),
        "nmse": nan.copy(),
    }


def position_metrics(ref: np.ndarray, cand: np.ndarray, next_tokens: np.ndarray | None = None,
                     scored: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """All per-position metrics of two logit blocks, computed in one pass over the rows.

    Args:
        ref, cand: float32 ``[B, V]`` (a 1-D row is taken as ``B = 1``); other float dtypes are
            converted to float32.
        next_tokens, scored: when given (both), the ``next_token_metrics`` keys are added,
            computed in the same pass: both log-partitions come from the KLD's own sums
            (``_kld_row``) and both argmaxes from the top-k, so a scored row pair costs no
            further pass over either row. Equal to ``next_token_metrics``'s values bit for
            bit (tests/test_metrics_fused.py).

    Returns:
        ``{key: array [B]}`` for the keys in ``PER_POSITION_KEYS``:
        ``finite`` / ``ref_finite`` (bool: candidate / reference row has no NaN/Inf),
        ``cosine`` (float64, raw logits), ``kld`` (float64, nats, KL(P_ref || P_cand)),
        ``argmax_agree`` (bool), ``ref_argmax`` / ``cand_argmax`` (int64 token ids),
        ``ref_margin`` (float64, logits: reference top-1 minus top-2), ``cand_rank`` (int64, rank
        of the reference's top token in the candidate row, 0 = top), ``top5_overlap`` /
        ``top10_overlap`` (float64 in [0, 1]), ``nmse`` (float64).
        Where either row is non-finite, floats are NaN, ints -1, ``argmax_agree`` False.

    Raises:
        NotComparable: the blocks differ in shape (positions or vocab size).
        InvalidInput: a block is not 2-D (or 1-D), or V < 2; ``next_tokens``/``scored`` as
            ``next_token_metrics`` raises.
    """
    ref, cand = _check_pair(ref, cand)
    n, v = ref.shape
    out = _empty_result(n)
    s = _scratch(v)
    nt = None if next_tokens is None else _next_token_result(n, v, next_tokens, scored)
    if nt is not None:
        out.update(nt[0])
    _fill_rows(out, ref, cand, s, nt)
    return out


def _fill_rows(out: dict[str, np.ndarray], ref: np.ndarray, cand: np.ndarray, s: _Scratch,
               nt: tuple[dict[str, np.ndarray], np.ndarray, np.ndarray] | None) -> None:
    """Every row of ``position_metrics``'s ``out`` (and the next-token keys when ``nt`` is
    ``_next_token_result``'s triple): through the compiled kernel (``rowkernel``) when it is
    available, else one row pair at a time with numpy and the scratch buffers ``s``. Rows the kernel flags (outside the fast range,
    or logits so far apart that the KLD needs float64) finish on the numpy path's float64 code."""
    if ref.shape[0] and rowkernel.available():
        _fill_rows_kernel(out, ref, cand, s, nt)
        return
    for i in range(ref.shape[0]):
        _fill_row_numpy(out, i, ref[i], cand[i], s, nt)


def _fill_row_numpy(out: dict[str, np.ndarray], i: int, r: np.ndarray, c: np.ndarray, s: _Scratch,
                    nt: tuple[dict[str, np.ndarray], np.ndarray, np.ndarray] | None) -> None:
    """Row ``i`` of ``_fill_rows`` on the numpy path."""
    rr, cc = s.dot64(r, r), s.dot64(c, c)
    fast = _in_fast_range(rr) and _in_fast_range(cc)
    if not fast:
        rf, cf, cos_i, kld_i, nmse_i = _row_f64(r, c)
        out["ref_finite"][i], out["finite"][i] = rf, cf
        if not (rf and cf):
            return
    out["ref_finite"][i] = out["finite"][i] = True
    r_top, r_vals = _topk_row(r, max(TOPK))
    c_top, _ = _topk_row(c, max(TOPK))
    log_z = log_zc = None
    if fast:
        cos_i, kld_i, nmse_i, log_z, log_zc = _fast_pair(r, c, rr, cc, s, float(r_vals[0]))
    out["cosine"][i], out["kld"][i], out["nmse"][i] = cos_i, kld_i, nmse_i
    a, b = int(r_top[0]), int(c_top[0])
    if nt is not None and nt[1][i]:
        _next_token_row(out, i, r, c, a, b, int(nt[2][i]), log_z, s, log_zc)
    out["ref_argmax"][i], out["cand_argmax"][i], out["argmax_agree"][i] = a, b, a == b
    out["ref_margin"][i] = float(r_vals[0]) - float(r_vals[1])
    out["cand_rank"][i] = _rank_of(c, a, c_top)
    rl, cl = r_top.tolist(), c_top.tolist()
    for k in TOPK:
        kk = min(k, r.shape[0])
        out[f"top{k}_overlap"][i] = len(set(rl[:kk]) & set(cl[:kk])) / kk


def _kernel_pairs(ref: np.ndarray, cand: np.ndarray, stats: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """(cosine, kld, nmse, log Σ exp(r), log Σ exp(c)), float64 arrays over ``rows`` (indices into
    the block, kernel flag 0 or 2), from the kernel's ``stats`` by the rules of ``_fast_pair`` and
    ``_kld_row``; log Σ exp(c) is NaN where the KLD took the float64 path (flag 2: its sums did not
    give it). Elementwise, so a row's values never depend on the rest of its block."""
    st = stats[rows]
    rr, cc, dd = st[:, rowkernel.S_RR], st[:, rowkernel.S_CC], st[:, rowkernel.S_DD]
    log_z = st[:, rowkernel.S_LOGZ].copy()
    fast = st[:, rowkernel.S_FLAG] == 0
    kld = np.where(fast, np.maximum(0.0, np.log1p(np.where(fast, st[:, rowkernel.S_T], 0.0))), np.nan)
    log_zc = np.where(fast, log_z - st[:, rowkernel.S_M] + kld, np.nan)
    for j in np.flatnonzero(~fast):
        kld[j] = _kld_row_f64(ref[rows[j]], cand[rows[j]])
    norm = np.sqrt(rr * cc)
    near = dd <= _RC_FROM_DD * 2.0 * norm
    rc = np.where(near, 0.5 * (rr + cc - dd), 0.0)
    for j in np.flatnonzero(~near):
        rc[j] = float(ref[rows[j]].astype(np.float64) @ cand[rows[j]].astype(np.float64))
    cos = np.clip(rc / norm, -1.0, 1.0)  # rr, cc > 1e-30 here: no zero row
    return cos, kld, dd / rr, log_z, log_zc


def _kernel_block(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rowkernel.rows`` over a block with top-k size ``max(TOPK)`` (at most V)."""
    return rowkernel.rows(ref, cand, min(max(TOPK), ref.shape[1]))


def _fill_rows_kernel(out: dict[str, np.ndarray], ref: np.ndarray, cand: np.ndarray, s: _Scratch,
                      nt: tuple[dict[str, np.ndarray], np.ndarray, np.ndarray] | None) -> None:
    """``_fill_rows`` through the compiled kernel: one call per block, then array operations over
    its rows; flag-1 rows (non-finite, or sums of squares outside the fast range) go to
    ``_fill_row_numpy``, whose float64 path handles them."""
    stats, ids, vals = _kernel_block(ref, cand)
    flag = stats[:, rowkernel.S_FLAG]
    for i in np.flatnonzero(flag == 1):
        _fill_row_numpy(out, int(i), ref[i], cand[i], s, nt)
    ok = np.flatnonzero(flag != 1)
    if not ok.size:
        return
    out["ref_finite"][ok] = out["finite"][ok] = True
    out["cosine"][ok], out["kld"][ok], out["nmse"][ok], log_z, log_zc = _kernel_pairs(ref, cand, stats, ok)
    r_ids, c_ids = ids[ok, 0], ids[ok, 1]
    a, b = r_ids[:, 0], c_ids[:, 0]
    out["ref_argmax"][ok], out["cand_argmax"][ok], out["argmax_agree"][ok] = a, b, a == b
    out["ref_margin"][ok] = vals[ok, 0, 0].astype(np.float64) - vals[ok, 0, 1].astype(np.float64)
    hit = c_ids == a[:, None]
    rank = np.argmax(hit, axis=1)
    for j in np.flatnonzero(~hit.any(axis=1)):  # beyond the candidate's top k: count
        rank[j] = _rank_of(cand[ok[j]], int(a[j]), c_ids[j])
    out["cand_rank"][ok] = rank
    for k in TOPK:
        kk = min(k, ref.shape[1])
        out[f"top{k}_overlap"][ok] = (r_ids[:, :kk, None] == c_ids[:, None, :kk]).any(axis=2).sum(axis=1) / kk
    if nt is not None:
        sel = nt[1][ok]
        _next_token_rows(out, ok[sel], ref, cand, a[sel], b[sel], nt[2][ok[sel]], log_z[sel], log_zc[sel], s)


NEXT_TOKEN_KEYS = ("scored", "ref_nll", "cand_nll", "delta_p", "delta_p_next")
"""Keys of ``next_token_metrics``'s result, each an array of length B."""


def _log_partition(row: np.ndarray, m: float, s: _Scratch) -> float:
    """log Σ_i exp(row_i) of a finite float32 row whose maximum is ``m``: the exps in float32
    (``s.e`` overwritten), their sum in float64 (``_Scratch.dot64``); exp(row) unshifted while
    ``m`` lies in [-20, 40] (as ``_kld_row``: one pass fewer, no overflow), else exp(row - m)."""
    if _EXP_UNSHIFTED[0] <= m <= _EXP_UNSHIFTED[1]:
        np.exp(row, out=s.e)
        return math.log(s.dot64(s.e, s.ones))
    np.subtract(row, np.float32(m), out=s.e)
    np.exp(s.e, out=s.e)
    return m + math.log(s.dot64(s.e, s.ones))


def next_token_metrics(ref: np.ndarray, cand: np.ndarray, next_tokens: np.ndarray, scored: np.ndarray,
                       finite: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-position probabilities of two logit blocks: what perplexity and Δp are made of.

    llama.cpp's ``llama-perplexity`` (``tools/perplexity/perplexity.cpp``) scores each position by
    the negative log-likelihood of the token that actually follows, ``nll = log Σ exp(row) -
    row[next]`` (natural log, nats), and in its KL-divergence mode reports Δp, the candidate's
    probability of that next token minus the reference's. The harness records that Δp as
    ``delta_p_next`` and, as ``delta_p``, the change in the probability of the reference's top
    token, p_cand(argmax ref) − p_ref(argmax ref) (argmax ties: the lower token id, as
    ``np.argmax``), which needs no text.

    Args:
        ref, cand: float32 logit blocks ``[B, V]`` of the same positions (row t predicts token t+1).
        next_tokens: int ``[B]``, the token id that follows each position; -1 where none does (the
            last position of a prompt): ``ref_nll``, ``cand_nll`` and ``delta_p_next`` are NaN there.
        scored: bool ``[B]``, the positions to measure (a text window's second half, as
            ``llama-perplexity`` scores; every position with a next token for a prompt); every value
            of an unscored position is NaN.
        finite: bool ``[B]``, both rows hold no NaN/Inf, when the caller knows it already
            (``position_metrics``'s ``finite & ref_finite``); else ``finite_rows`` of each block.

    Returns:
        ``{key: array [B]}`` for ``NEXT_TOKEN_KEYS``: ``scored`` (bool, as given), ``ref_nll`` /
        ``cand_nll`` (float64, nats), ``delta_p`` / ``delta_p_next`` (float64 in [-1, 1]). A
        position where either row holds NaN/Inf gives NaN everywhere (a candidate FAIL the cosine
        gate counts, never a probability). The log-partitions come from ``_kld_row``'s sums, as
        ``position_metrics`` takes them (equal bit for bit); nothing of size ``[B, V]`` is allocated.

    Raises ``NotComparable`` (the blocks differ in shape) and ``InvalidInput`` (a block not 2-D,
    V < 2, ``next_tokens``/``scored`` not of length B, a next token id outside [-1, V)).
    """
    ref, cand = _check_pair(ref, cand)
    n, v = ref.shape
    out, sc, nxt = _next_token_result(n, v, next_tokens, scored)
    if not sc.any():
        return out
    both = np.asarray(finite, bool).reshape(-1) if finite is not None else None
    if both is None or both.shape[0] != n:
        both = finite_rows(ref) & finite_rows(cand)
    s = _scratch(v)
    rows = np.flatnonzero(sc & both)
    if rows.size and rowkernel.available():  # as position_metrics takes them
        _next_token_kernel(out, ref, cand, rows, nxt, s)
        return out
    for i in rows:
        r, c = ref[i], cand[i]
        top = int(np.argmax(r))
        log_z = log_zc = None
        if _in_fast_range(s.dot64(r, r)) and _in_fast_range(s.dot64(c, c)):  # as position_metrics takes them
            _, _, log_z, log_zc = _kld_row(r, c, float(r[top]), s)
        _next_token_row(out, i, r, c, top, int(np.argmax(c)), int(nxt[i]), log_z, s, log_zc)
    return out


def _next_token_kernel(out: dict[str, np.ndarray], ref: np.ndarray, cand: np.ndarray, rows: np.ndarray, nxt: np.ndarray,
                       s: _Scratch) -> None:
    """``next_token_metrics``'s positions ``rows`` through the compiled kernel, as
    ``position_metrics`` takes them (the same log-partitions, bit for bit); flag-1 rows row by row."""
    r_sel, c_sel = np.ascontiguousarray(ref[rows]), np.ascontiguousarray(cand[rows])
    stats, ids, _ = _kernel_block(r_sel, c_sel)
    flag = stats[:, rowkernel.S_FLAG]
    for j in np.flatnonzero(flag == 1):
        i = int(rows[j])
        _next_token_row(out, i, ref[i], cand[i], int(np.argmax(ref[i])), int(np.argmax(cand[i])), int(nxt[i]), None, s)
    ok = np.flatnonzero(flag != 1)
    if ok.size:
        _, _, _, log_z, log_zc = _kernel_pairs(r_sel, c_sel, stats, ok)
        _next_token_rows(out, rows[ok], ref, cand, ids[ok, 0, 0], ids[ok, 1, 0], nxt[rows[ok]], log_z, log_zc, s)


def _next_token_result(n: int, v: int, next_tokens: np.ndarray, scored: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(``next_token_metrics``'s result filled with NaN, ``scored`` as bool [n], ``next_tokens``
    as int64 [n]), after checking both; ``InvalidInput`` as ``next_token_metrics`` raises it."""
    nxt = np.asarray(next_tokens, dtype=np.int64).reshape(-1)
    sc = np.asarray(scored, dtype=bool).reshape(-1)
    if nxt.shape[0] != n or sc.shape[0] != n:
        raise InvalidInput(f"next_tokens ({nxt.shape[0]}) and scored ({sc.shape[0]}) must have one entry per position ({n})")
    if nxt.size and (nxt.min() < -1 or nxt.max() >= v):
        raise InvalidInput(f"next token ids must lie in [-1, {v}); got {int(nxt.min())}..{int(nxt.max())}")
    return {"scored": sc.copy(), **{k: np.full(n, np.nan) for k in NEXT_TOKEN_KEYS[1:]}}, sc, nxt


def _next_token_row(out: dict[str, np.ndarray], i: int, r: np.ndarray, c: np.ndarray, top: int, c_top: int, t: int,
                    log_z_ref: float | None, s: _Scratch, log_z_cand: float | None = None) -> None:
    """Fill position ``i`` of ``next_token_metrics``'s ``out`` from the finite rows ``r`` and ``c``,
    their argmaxes ``top``/``c_top``, the next token ``t`` (-1: none) and, when known, the
    reference's and the candidate's log-partitions (``_kld_row``'s; else computed here, and
    ``s.e`` is overwritten)."""
    lr = _log_partition(r, float(r[top]), s) if log_z_ref is None else log_z_ref
    lc = _log_partition(c, float(c[c_top]), s) if log_z_cand is None else log_z_cand
    out["delta_p"][i] = math.exp(float(c[top]) - lc) - math.exp(float(r[top]) - lr)
    if t >= 0:
        out["ref_nll"][i] = lr - float(r[t])
        out["cand_nll"][i] = lc - float(c[t])
        out["delta_p_next"][i] = math.exp(-out["cand_nll"][i]) - math.exp(-out["ref_nll"][i])


def _next_token_rows(out: dict[str, np.ndarray], idx: np.ndarray, ref: np.ndarray, cand: np.ndarray, top: np.ndarray,
                     c_top: np.ndarray, t: np.ndarray, log_z_ref: np.ndarray, log_z_cand: np.ndarray, s: _Scratch) -> None:
    """``_next_token_row`` over the positions ``idx`` at once (arrays aligned with ``idx``): the
    reference's log-partitions given, the candidate's given or NaN (then computed here, row by
    row, with ``_log_partition``)."""
    if not idx.size:
        return
    lc = log_z_cand.copy()
    for j in np.flatnonzero(np.isnan(lc)):
        lc[j] = _log_partition(cand[idx[j]], float(cand[idx[j], c_top[j]]), s)
    lr = log_z_ref
    out["delta_p"][idx] = np.exp(cand[idx, top].astype(np.float64) - lc) - np.exp(ref[idx, top].astype(np.float64) - lr)
    has = t >= 0
    at, tt = idx[has], t[has]
    out["ref_nll"][at] = lr[has] - ref[at, tt].astype(np.float64)
    out["cand_nll"][at] = lc[has] - cand[at, tt].astype(np.float64)
    out["delta_p_next"][at] = np.exp(-out["cand_nll"][at]) - np.exp(-out["ref_nll"][at])


def _pairwise(ref: np.ndarray, cand: np.ndarray, which: int, with_kld: bool = False) -> np.ndarray:
    """Field ``which`` of ``_pair_stats`` (2 cosine, 3 kld, 4 nmse) for every row pair, float64 [B]."""
    ref, cand = _check_pair(ref, cand)
    s = _scratch(ref.shape[1])
    if ref.shape[0] and rowkernel.available():  # the path position_metrics takes: the same values
        stats, _, _ = _kernel_block(ref, cand)
        flag = stats[:, rowkernel.S_FLAG]
        res = np.empty(ref.shape[0], dtype=np.float64)
        for i in np.flatnonzero(flag == 1):
            res[i] = _pair_stats(ref[i], cand[i], s, with_kld)[which]
        ok = np.flatnonzero(flag != 1)
        if ok.size:
            res[ok] = _kernel_pairs(ref, cand, stats, ok)[which - 2]
        return res
    return np.array([_pair_stats(r, c, s, with_kld)[which] for r, c in zip(ref, cand)], dtype=np.float64)


def finite_rows(block: np.ndarray) -> np.ndarray:
    """bool ``[B]``: row t of the ``[B, V]`` block holds no NaN or Inf.

    One read of the block: each row's float32 sum (BLAS ``sgemv`` against ones) is NaN or ±Inf
    when the row holds a NaN or an Inf (IEEE propagation); a row whose sum is not finite is then
    checked element by element, since finite logits beyond ~1e33 can overflow the sum.
    """
    block = _as_block("block", block)
    with np.errstate(over="ignore", invalid="ignore"):
        ok = np.isfinite(block @ _scratch(block.shape[1]).ones)
    for i in np.flatnonzero(~ok):
        ok[i] = bool(np.isfinite(block[i]).all())
    return ok


def cosine(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Per-position cosine similarity of raw logits, float64 ``[B]`` in [-1, 1].

    |r|^2, |c|^2 and |r - c|^2 are float32 products summed per block of ~2,048 entries and the
    blocks in float64 (``_Scratch.dot64``); r·c = (|r|^2 + |c|^2 - |r - c|^2) / 2 for close rows,
    an exact float64 dot for distant ones (``_fast_pair``). Absolute error below 1e-8; 1 - cos of
    near-identical rows keeps ~3 significant digits. Two all-zero rows give 1.0, one all-zero
    row 0.0, a non-finite row NaN (see ``finite_rows``); rows with |r|^2 outside [1e-30, 1e30]
    are computed in float64 throughout. Raises NotComparable on mismatched shapes.
    """
    return _pairwise(ref, cand, 2)


def kl_divergence(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Per-position KL(P_ref || P_cand) in nats over the full vocabulary, float64 ``[B]``, ≥ 0.

    P = softmax(logits). float32 exp/expm1 with float64 block sums (see ``_kld_row``; relative
    error bounded against float64 in tests/test_metrics.py); rows whose logits differ by more than
    ~30 use float64 log-softmax. NaN for non-finite rows. Raises NotComparable on mismatched shapes.
    """
    return _pairwise(ref, cand, 3, with_kld=True)


def nmse(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Per-position normalised squared error sum((cand - ref)^2) / sum(ref^2), float64 ``[B]``.

    0 when both rows are zero, +inf when only ref is zero, NaN for non-finite rows.
    """
    return _pairwise(ref, cand, 4)


def argmax_agreement(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """bool ``[B]``: the two rows' top tokens (lowest id among ties) are equal; False if non-finite."""
    ref, cand = _check_pair(ref, cand)
    ok = finite_rows(ref) & finite_rows(cand)
    return ok & (np.argmax(ref, axis=1) == np.argmax(cand, axis=1))


def reference_margin(ref: np.ndarray) -> np.ndarray:
    """float64 ``[B]``: top-1 minus top-2 logit of each reference row (≥ 0); NaN if non-finite."""
    ref = _as_block("ref", ref)
    out = np.full(ref.shape[0], np.nan)
    for i, r in enumerate(ref):
        if np.isfinite(r).all():
            _, vals = _topk_row(r, 2)
            out[i] = float(vals[0]) - float(vals[1])
    return out


def top_k(block: np.ndarray, k: int) -> np.ndarray:
    """int64 ``[B, k]``: each finite row's k largest token ids, logit descending then id ascending.

    Never sorts the vocabulary. Rows with NaN/Inf give -1. Raises InvalidInput if k < 1.
    """
    if k < 1:
        raise InvalidInput(f"k must be ≥ 1, got {k}")
    block = _as_block("block", block)
    k = min(k, block.shape[1])
    out = np.full((block.shape[0], k), -1, dtype=np.int64)
    for i, r in enumerate(block):
        if np.isfinite(r).all():
            out[i] = _topk_row(r, k)[0]
    return out


def candidate_rank(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """int64 ``[B]``: rank (0 = top) of the reference's top token in the candidate row; -1 if non-finite.

    Ties in the candidate row rank the lower token id first.
    """
    ref, cand = _check_pair(ref, cand)
    out = np.full(ref.shape[0], -1, dtype=np.int64)
    r_top, c_top = top_k(ref, 1)[:, 0], top_k(cand, max(TOPK))
    for i in range(ref.shape[0]):
        if r_top[i] >= 0 and c_top[i, 0] >= 0:
            out[i] = _rank_of(cand[i], int(r_top[i]), c_top[i])
    return out


def topk_overlap(ref: np.ndarray, cand: np.ndarray, k: int = 5) -> np.ndarray:
    """float64 ``[B]``: |top_k(ref) ∩ top_k(cand)| / k; NaN for non-finite rows. Symmetric in its arguments."""
    ref, cand = _check_pair(ref, cand)
    tr, tc = top_k(ref, k), top_k(cand, k)
    kk = tr.shape[1]
    out = np.full(ref.shape[0], np.nan)
    for i in range(ref.shape[0]):
        if tr[i, 0] >= 0 and tc[i, 0] >= 0:
            out[i] = np.intersect1d(tr[i], tc[i]).size / kk
    return out


def concat_metrics(parts: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate per-block ``position_metrics`` results (in position order) into one dict."""
    if not parts:
        return {k: v[:0] for k, v in _empty_result(0).items()}
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def cosine_failures(per_position: Mapping[str, np.ndarray], min_cosine: float) -> np.ndarray:
    """int64 indices of positions that fail the cosine gate: a non-finite row or cosine < min_cosine.

    NaN-safe: a position passes only if ``cosine >= min_cosine`` holds, so NaN fails.
    """
    cos = np.asarray(per_position["cosine"], dtype=np.float64)
    ok = np.asarray(per_position["finite"], bool) & np.asarray(per_position["ref_finite"], bool)
    with np.errstate(invalid="ignore"):
        ok &= cos >= min_cosine
    return np.flatnonzero(~ok)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float] | None:
    """Wilson score interval (without continuity correction) for a binomial proportion; None when n = 0.

    E. B. Wilson, "Probable inference, the law of succession, and statistical inference", JASA
    22 (1927): (p + z²/2n ± z·sqrt(p(1 − p)/n + z²/4n²)) / (1 + z²/n), z the two-sided normal
    quantile; the formula of scipy's ``binomtest(...).proportion_ci(method="wilson")``
    (``scipy/stats/_binomtest.py``), which ``tests/test_metrics.py`` checks it against. Written out
    so a parity run does not import ``scipy.stats`` (about a second) for four lines of arithmetic; the
    normal quantile is the standard library's ``statistics.NormalDist``.
    """
    if n == 0:
        return None
    k, n = int(successes), int(n)
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)  # Wichura's AS 241, as scipy's ndtri
    p, z2 = k / n, z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def _f(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _distribution_summary(per_position: Mapping[str, np.ndarray], idx: np.ndarray) -> dict[str, Any]:
    """Cosine, KLD, margin, rank, top-k and NMSE summaries over the positions ``idx`` (both rows
    finite); every value None when ``idx`` is empty."""
    if not idx.size:
        return dict(min_cosine=None, min_cosine_index=None, mean_cosine=None, kld=None, ref_margin=None,
                    cand_rank=None, top5_overlap_mean=None, top10_overlap_mean=None, nmse=None)
    m = idx.size
    cos = np.asarray(per_position["cosine"], np.float64)[idx]
    kld = np.asarray(per_position["kld"], np.float64)[idx]
    margin = np.asarray(per_position["ref_margin"], np.float64)[idx]
    rank = np.asarray(per_position["cand_rank"])[idx]
    out: dict[str, Any] = {}
    j = int(np.argmin(cos))
    out.update(min_cosine=_f(cos[j]), min_cosine_index=int(idx[j]), mean_cosine=_f(cos.mean()))
    sem = kld.std(ddof=1) / math.sqrt(m) if m > 1 else None
    q = np.quantile(kld, list(KLD_QUANTILES.values()))
    out["kld"] = {
        "mean": _f(kld.mean()),
        "sem": _f(sem) if sem is not None else None,
        **{name: _f(v) for name, v in zip(KLD_QUANTILES, q)},
        "max": _f(kld.max()),
    }
    mq = np.quantile(margin, (0.01, 0.05, 0.5))
    out["ref_margin"] = {"min": _f(margin.min()), "p1": _f(mq[0]), "p5": _f(mq[1]), "p50": _f(mq[2])}
    out["cand_rank"] = {"p99": _f(np.quantile(rank, 0.99)), "max": int(rank.max())}
    out["top5_overlap_mean"] = _f(np.asarray(per_position["top5_overlap"])[idx].mean())
    out["top10_overlap_mean"] = _f(np.asarray(per_position["top10_overlap"])[idx].mean())
    nm = np.asarray(per_position["nmse"], np.float64)[idx]
    out["nmse"] = {"mean": _f(nm.mean()), "max": _f(nm.max())}
    return out


DELTA_P_QUANTILES = {"p0_1": 0.001, "p1": 0.01, "p5": 0.05, "p10": 0.1, "p25": 0.25, "p50": 0.5, "p75": 0.75,
                     "p90": 0.9, "p95": 0.95, "p99": 0.99, "p99_9": 0.999}
"""The Δp percentiles ``llama-perplexity --kl-divergence`` prints (0.1% to 99.9%, beside min and max)."""


def delta_p_summary(delta_p: np.ndarray) -> dict[str, Any] | None:
    """Summary of per-position Δp values (``next_token_metrics``), JSON-ready; None when no value
    is finite (nothing was scored).

    Returns ``positions``, ``mean``, ``sem`` (standard error of the mean, None for one value),
    ``rms`` (root mean square), ``min``, the ``DELTA_P_QUANTILES`` (NumPy's linear interpolation
    between order statistics) and ``max``: probabilities, so in [-1, 1]; ``llama-perplexity``
    prints them as percentages.
    """
    d = np.asarray(delta_p, np.float64)
    d = d[np.isfinite(d)]
    if not d.size:
        return None
    q = np.quantile(d, list(DELTA_P_QUANTILES.values()))
    sem = d.std(ddof=1) / math.sqrt(d.size) if d.size > 1 else None
    return {"positions": int(d.size), "mean": _f(d.mean()), "sem": None if sem is None else _f(sem),
            "rms": _f(math.sqrt(float(np.mean(d * d)))), "min": _f(d.min()),
            **{name: _f(v) for name, v in zip(DELTA_P_QUANTILES, q)}, "max": _f(d.max())}


def perplexity_summary(ref_nll: np.ndarray, cand_nll: np.ndarray) -> dict[str, Any] | None:
    """Perplexity of each engine and their ratio over the positions where both NLLs are finite
    (``next_token_metrics``: the scored positions); None when there is none.

    PPL = exp(mean NLL) (``llama-perplexity``'s ``Mean PPL``); ``ratio`` = PPL(candidate) /
    PPL(reference) = exp(mean(nll_cand − nll_ref)) (its ``Mean PPL(Q)/PPL(base)``), ``ln_ratio`` its
    log and ``ln_ratio_sem`` the standard error of that mean of paired differences (None for one
    position). Report-only: never a gate.
    """
    r = np.asarray(ref_nll, np.float64)
    c = np.asarray(cand_nll, np.float64)
    ok = np.isfinite(r) & np.isfinite(c)
    if not ok.any():
        return None
    r, c = r[ok], c[ok]
    d = c - r
    ln_ratio = float(d.mean())
    sem = d.std(ddof=1) / math.sqrt(d.size) if d.size > 1 else None
    return {"positions": int(d.size), "reference": _f(math.exp(r.mean())), "candidate": _f(math.exp(c.mean())),
            "ratio": _f(math.exp(ln_ratio)), "ln_ratio": _f(ln_ratio), "ln_ratio_sem": None if sem is None else _f(sem)}


def next_token_summary(per_position: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """``perplexity`` (``perplexity_summary``), ``delta_p`` and ``delta_p_next``
    (``delta_p_summary``) of concatenated per-position metrics that hold ``NEXT_TOKEN_KEYS``;
    empty when they do not (a top-k cell, an MTP cell)."""
    if "ref_nll" not in per_position:
        return {}
    return {"perplexity": perplexity_summary(per_position["ref_nll"], per_position["cand_nll"]),
            "delta_p": delta_p_summary(per_position["delta_p"]),
            "delta_p_next": delta_p_summary(per_position["delta_p_next"])}


def _greedy_summary(per_position: Mapping[str, np.ndarray], idx: np.ndarray, near_tie_margin: float) -> dict[str, Any]:
    """Argmax agreement (Wilson 95% interval) and flips split into near-ties and hard flips, over
    the positions ``idx``."""
    agree = np.asarray(per_position["argmax_agree"], bool)[idx]
    margin = np.asarray(per_position["ref_margin"], np.float64)[idx]
    m = idx.size
    n_agree = int(agree.sum())
    ci = wilson_interval(n_agree, m)
    flips = ~agree
    near = flips & (margin < near_tie_margin)
    return {
        "argmax_agreement": {
            "rate": n_agree / m if m else None,
            "agree": n_agree,
            "n": m,
            "ci_low": ci[0] if ci else None,
            "ci_high": ci[1] if ci else None,
            "method": "wilson",
            "confidence": 0.95,
        },
        "flips": {
            "total": int(flips.sum()),
            "near_tie": int(near.sum()),
            "hard": int((flips & ~near).sum()),
            "near_tie_margin": float(near_tie_margin),
        },
    }


def summarize(per_position: Mapping[str, np.ndarray], near_tie_margin: float = NEAR_TIE_MARGIN) -> dict[str, Any]:
    """Summary of concatenated per-position metrics, JSON-ready (plain ints/floats/None).

    Metric summaries cover the positions where both rows are finite; ``nonfinite_positions``
    counts the others (a FAIL of the candidate; see ``cosine_failures``). Undefined values
    (no such positions) are None. Indices are into the concatenated arrays.

    Returns keys: ``positions``, ``compared_positions``, ``nonfinite_positions``,
    ``first_nonfinite_index``, ``ref_nonfinite_positions``, ``min_cosine``,
    ``min_cosine_index``, ``mean_cosine``, ``kld`` {mean, sem, p50, p90, p99, p99_9, max},
    ``argmax_agreement`` {rate, agree, n, ci_low, ci_high, method, confidence},
    ``flips`` {total, near_tie, hard, near_tie_margin}, ``ref_margin`` {min, p1, p5, p50},
    ``cand_rank`` {p99, max}, ``top5_overlap_mean``, ``top10_overlap_mean``, ``nmse`` {mean, max};
    where ``per_position`` holds ``NEXT_TOKEN_KEYS`` also ``perplexity``, ``delta_p`` and
    ``delta_p_next`` (``next_token_summary``; None when nothing was scored).
    """
    n = int(np.asarray(per_position["cosine"]).shape[0])
    finite = np.asarray(per_position["finite"], bool)
    ref_finite = np.asarray(per_position["ref_finite"], bool)
    idx = np.flatnonzero(finite & ref_finite)
    nonfinite = np.flatnonzero(~finite)
    return {
        "positions": n,
        "compared_positions": idx.size,
        "nonfinite_positions": int(nonfinite.size),
        "first_nonfinite_index": int(nonfinite[0]) if nonfinite.size else None,
        "ref_nonfinite_positions": int(np.count_nonzero(~ref_finite)),
        **_distribution_summary(per_position, idx),
        **_greedy_summary(per_position, idx, near_tie_margin),
        **next_token_summary(per_position),
    }


# --------------------------------------------------------------------------------------------
# Named activations: per-tensor agreement (per-layer checks and first-divergence localization)
# --------------------------------------------------------------------------------------------


def _activation_site(name: str) -> tuple[str, int]:
    """``attn_norm-3`` → (``attn_norm``, 3); names without a layer suffix get layer -1."""
    op, _, layer = name.rpartition("-")
    return (op, int(layer)) if op and layer.isdigit() else (name, -1)


def compare_activations(ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    """Per-tensor agreement of two engines' named activations, in the reference's order.

    Args:
        ref, cand: ``{name: array [T, ...]}`` under llama.cpp's graph names (``attn_norm-3``,
            ``linear_attn_out-0``, ``result_norm`` ...), position-major, as the engines'
            ``activations()`` return them. Each tensor is compared as float64 ``[T, -1]``.

    Returns:
        One dict per name of ``ref``: ``name``, ``op``, ``layer`` (-1 for model-level tensors),
        ``status`` (``ok``; ``missing`` when ``cand`` lacks it; ``shape`` when the element counts
        or positions differ; ``nonfinite`` when either side holds NaN/Inf), ``shape_ref``,
        ``shape_cand``, and for ``ok`` rows ``nmse`` = Σ(c − r)² / Σr² (0 when both are zero,
        inf when only ``ref`` is), ``cosine`` of the flattened tensors (1 when both are zero),
        ``max_abs`` = max |c − r|, ``rel_max`` = max |c − r| / max |r| and ``worst_position``
        (the position with the largest squared error); these are None otherwise. The first row
        whose numbers exceed a tolerance is the first divergence.
    """
    rows: list[dict[str, Any]] = []
    for name, r in ref.items():
        op, layer = _activation_site(name)
        row: dict[str, Any] = {"name": name, "op": op, "layer": layer, "status": "ok", "shape_ref": list(np.shape(r)),
                               "shape_cand": None, "nmse": None, "cosine": None, "max_abs": None, "rel_max": None,
                               "worst_position": None}
        rows.append(row)
        if name not in cand:
            row["status"] = "missing"
            continue
        c = cand[name]
        row["shape_cand"] = list(np.shape(c))
        r2 = np.asarray(r, dtype=np.float64).reshape(np.shape(r)[0] if np.ndim(r) else 1, -1)
        c2 = np.asarray(c, dtype=np.float64).reshape(np.shape(c)[0] if np.ndim(c) else 1, -1)
        if r2.shape != c2.shape:
            row["status"] = "shape"
            continue
        if not (np.isfinite(r2).all() and np.isfinite(c2).all()):
            row["status"] = "nonfinite"
            continue
        d = c2 - r2
        rr, cc, dd = float(np.sum(r2 * r2)), float(np.sum(c2 * c2)), float(np.sum(d * d))
        row["nmse"] = (0.0 if dd == 0 else math.inf) if rr == 0 else dd / rr
        row["cosine"] = (1.0 if rr == cc == 0 else 0.0) if rr == 0 or cc == 0 else float(np.sum(r2 * c2) / math.sqrt(rr * cc))
        row["max_abs"] = float(np.max(np.abs(d))) if d.size else 0.0
        ref_max = float(np.max(np.abs(r2))) if r2.size else 0.0
        row["rel_max"] = row["max_abs"] / ref_max if ref_max > 0 else (0.0 if row["max_abs"] == 0 else math.inf)
        row["worst_position"] = int(np.argmax(np.sum(d * d, axis=1))) if d.size else None
    return rows
