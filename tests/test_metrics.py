"""harness.measure.metrics against scipy and brute force, plus the invariants the definitions imply."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from scipy.spatial.distance import cosine as scipy_cosine_distance
from scipy.special import log_softmax, rel_entr

from harness.measure import metrics as M
from harness.errors import InvalidInput, NotComparable

# Vocab sizes that exercise every path: direct top-k (< 8,192), blocked rows that a block width
# divides (Qwen3.5's 248,320 = 97 x 2,560; 20,480 = 10 x 2,048), and a prime with a tail.
V_SMALL, V_DIVIDES, V_TAIL = 1_000, 20_480, 20_011
QWEN35_VOCAB = 248_320


def lm_logits(rng: np.random.Generator, n: int, v: int, *, lead: float = 10.0) -> np.ndarray:
    """float32 [n, v] logits shaped like a language model's: Gaussian body, a few leading tokens."""
    x = (rng.standard_normal((n, v)) * 2.5).astype(np.float32)
    for i in range(n):
        x[i, rng.integers(0, v, 6)] += np.float32(lead) * rng.uniform(0.6, 1.4, 6).astype(np.float32)
    return x


def perturb(rng: np.random.Generator, x: np.ndarray, noise: float) -> np.ndarray:
    return (x + rng.standard_normal(x.shape) * noise).astype(np.float32)


def kld_scipy(r: np.ndarray, c: np.ndarray) -> float:
    p = np.exp(log_softmax(r.astype(np.float64)))
    q = np.exp(log_softmax(c.astype(np.float64)))
    return float(rel_entr(p, q).sum())


def kld_float64(r: np.ndarray, c: np.ndarray) -> float:
    """float64 log-softmax KL, written independently of the module (no cancellation-free tricks)."""
    lp = log_softmax(r.astype(np.float64))
    lq = log_softmax(c.astype(np.float64))
    return float(np.exp(lp) @ (lp - lq))


def brute_topk(row: np.ndarray, k: int) -> list[int]:
    """k largest ids, logit descending then id ascending, by a full stable sort (test-only)."""
    return np.argsort(-row.astype(np.float64), kind="stable")[:k].tolist()


# ------------------------------------------------------------------ agreement with scipy


@pytest.mark.parametrize("v", [V_SMALL, V_DIVIDES, V_TAIL])
@pytest.mark.parametrize("noise", [1e-3, 0.1, 2.0])
def test_kld_matches_scipy_rel_entr_and_entropy(v, noise):
    rng = np.random.default_rng(int(v + noise * 1000))
    ref = lm_logits(rng, 4, v)
    cand = perturb(rng, ref, noise)
    got = M.kl_divergence(ref, cand)
    for i in range(4):
        want = kld_scipy(ref[i], cand[i])
        p = np.exp(log_softmax(ref[i].astype(np.float64)))
        q = np.exp(log_softmax(cand[i].astype(np.float64)))
        assert want == pytest.approx(stats.entropy(p, q), rel=1e-9)
        assert got[i] == pytest.approx(want, rel=1e-4, abs=1e-12)
        assert got[i] > 0


def test_kld_fallback_for_wildly_different_rows_matches_scipy():
    # Candidate logits 60 above the reference on some tokens: x exceeds the float32 fast path's
    # range, so the float64 path must answer, and answer right.
    rng = np.random.default_rng(7)
    ref = lm_logits(rng, 2, V_DIVIDES)
    cand = ref.copy()
    cand[0, :50] += 60
    cand[1] = rng.standard_normal(V_DIVIDES).astype(np.float32) * 40
    got = M.kl_divergence(ref, cand)
    for i in range(2):
        assert got[i] == pytest.approx(kld_scipy(ref[i], cand[i]), rel=1e-9)
    assert got[0] > 10  # the reference's mass now sits on tokens the candidate finds unlikely


@pytest.mark.parametrize("v", [V_SMALL, V_DIVIDES, V_TAIL])
def test_cosine_matches_scipy(v):
    rng = np.random.default_rng(v)
    ref = lm_logits(rng, 3, v)
    cand = np.stack([perturb(rng, ref[0], 1e-3), perturb(rng, ref[1], 1.0), -ref[2]])
    got = M.cosine(ref, cand)
    for i in range(3):
        want = 1.0 - scipy_cosine_distance(ref[i].astype(np.float64), cand[i].astype(np.float64))
        # Block partial sums are rounded to float32 before their float64 sum (harness.measure.metrics,
        # "_Scratch.dot64"): ~1e-9 absolute, bounded here at 1e-8.
        assert got[i] == pytest.approx(want, abs=1e-8)
    assert got[2] == pytest.approx(-1.0, abs=1e-8)


def test_cosine_resolves_near_identical_rows_beyond_float32():
    # 1 - cos ~ 1e-11 here: float32 accumulation could not tell this row from identical.
    rng = np.random.default_rng(3)
    ref = lm_logits(rng, 1, QWEN35_VOCAB)
    cand = perturb(rng, ref, 1e-5)
    r, c = ref[0].astype(np.float64), cand[0].astype(np.float64)
    want = 1.0 - scipy_cosine_distance(r, c)
    got = M.cosine(ref, cand)[0]
    assert 1 - want < 1e-9
    assert abs((1 - got) - (1 - want)) <= 1e-3 * (1 - want) + 1e-14


def test_nmse_matches_float64():
    rng = np.random.default_rng(11)
    ref = lm_logits(rng, 3, V_TAIL)
    cand = perturb(rng, ref, 0.05)
    r, c = ref.astype(np.float64), cand.astype(np.float64)
    want = ((c - r) ** 2).sum(axis=1) / (r**2).sum(axis=1)
    np.testing.assert_allclose(M.nmse(ref, cand), want, rtol=1e-7)
    assert M.nmse(ref, ref).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("noise", [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.3, 3.0])
def test_kld_float32_exp_error_bound_against_float64(noise):
    """The fast path uses float32 exp/expm1: its error stays within 1e-4 relative + 1e-11 absolute
    of float64 from KLDs of ~1e-13 (same-precision engines) up to ~5 nats, at Qwen3.5's vocab.

    A plain float32 log-softmax would err by ~1e-7 absolute, swamping KLDs below ~1e-5."""
    rng = np.random.default_rng(int(noise * 1e7) + 1)
    ref = lm_logits(rng, 2, QWEN35_VOCAB)
    ref[1] += np.float32(30.0)  # max logit above the unshifted-exp range: the shifted branch
    cand = perturb(rng, ref, noise)
    got = M.kl_divergence(ref, cand)
    for i in range(2):
        want = kld_float64(ref[i], cand[i])
        assert abs(got[i] - want) <= 1e-4 * want + 1e-11, (noise, i, got[i], want)


# ------------------------------------------------------------------ top-k family vs brute force


@pytest.mark.parametrize("v", [V_SMALL, V_DIVIDES, V_TAIL, QWEN35_VOCAB])
def test_topk_rank_margin_argmax_against_full_sort(v):
    rng = np.random.default_rng(v % 1000)
    ref = lm_logits(rng, 4, v)
    cand = perturb(rng, ref, 1.5)
    cand[3] = rng.standard_normal(v).astype(np.float32)  # unrelated: a hard flip, deep rank
    m = M.position_metrics(ref, cand)
    for i in range(4):
        rt, ct = brute_topk(ref[i], 10), brute_topk(cand[i], 10)
        assert M.top_k(ref[i], 10)[0].tolist() == rt
        assert m["ref_argmax"][i] == rt[0] == int(np.argmax(ref[i]))
        assert m["cand_argmax"][i] == ct[0]
        assert m["argmax_agree"][i] == (rt[0] == ct[0])
        srt = np.sort(ref[i].astype(np.float64))
        assert m["ref_margin"][i] == pytest.approx(srt[-1] - srt[-2], abs=0)
        full_rank = np.argsort(-cand[i].astype(np.float64), kind="stable").tolist().index(rt[0])
        assert m["cand_rank"][i] == full_rank
        assert m["top5_overlap"][i] == len(set(rt[:5]) & set(ct[:5])) / 5
        assert m["top10_overlap"][i] == len(set(rt) & set(ct)) / 10
    assert m["cand_rank"][3] > 10  # exercised the full-count path, not the top-10 shortcut
    np.testing.assert_array_equal(M.candidate_rank(ref, cand), m["cand_rank"])
    np.testing.assert_array_equal(M.argmax_agreement(ref, cand), m["argmax_agree"])
    np.testing.assert_array_equal(M.reference_margin(ref), m["ref_margin"])


def test_ties_break_by_lower_token_id_like_argmax():
    v = QWEN35_VOCAB
    row = np.zeros((1, v), np.float32)
    row[0, [200_000, 7, 90_000, 123_456]] = 5.0  # four-way tie for the top
    row[0, 3] = 4.0
    assert M.top_k(row, 5)[0].tolist() == [7, 90_000, 123_456, 200_000, 3]
    cand = row.copy()
    m = M.position_metrics(row, cand)
    assert m["ref_argmax"][0] == 7 == int(np.argmax(row[0]))
    assert m["ref_margin"][0] == 0.0
    # More than the 64 group maxima the prefilter draws on: the direct path, same answer.
    rng = np.random.default_rng(1)
    wide = lm_logits(rng, 1, V_DIVIDES)
    assert M.top_k(wide, 100)[0].tolist() == brute_topk(wide[0], 100)
    # A constant row: every entry ties; the top ids are the lowest ids.
    flat = np.ones((1, 10_000), np.float32)
    assert M.top_k(flat, 4)[0].tolist() == [0, 1, 2, 3]


def test_position_metrics_agrees_with_individual_functions_and_blocks_concatenate():
    rng = np.random.default_rng(5)
    ref = lm_logits(rng, 6, V_TAIL)
    cand = perturb(rng, ref, 0.2)
    whole = M.position_metrics(ref, cand)
    parts = M.concat_metrics([M.position_metrics(ref[:4], cand[:4]), M.position_metrics(ref[4:], cand[4:])])
    assert set(whole) == set(M.PER_POSITION_KEYS)
    for k in M.PER_POSITION_KEYS:
        np.testing.assert_array_equal(whole[k], parts[k])
    np.testing.assert_allclose(whole["cosine"], M.cosine(ref, cand), rtol=0, atol=1e-15)
    np.testing.assert_allclose(whole["kld"], M.kl_divergence(ref, cand), rtol=1e-12)
    np.testing.assert_allclose(whole["nmse"], M.nmse(ref, cand), rtol=1e-12)
    np.testing.assert_array_equal(whole["top5_overlap"], M.topk_overlap(ref, cand, 5))


# ------------------------------------------------------------------ non-finite and edge rows


def test_nonfinite_candidate_rows_are_flagged_not_raised():
    rng = np.random.default_rng(9)
    ref = lm_logits(rng, 4, V_DIVIDES)
    cand = perturb(rng, ref, 0.01)
    cand[1, 17] = np.nan
    cand[3, 5] = np.inf
    m = M.position_metrics(ref, cand)
    assert m["finite"].tolist() == [True, False, True, False]
    assert m["ref_finite"].all()
    assert np.isnan(m["cosine"][[1, 3]]).all() and np.isnan(m["kld"][[1, 3]]).all()
    assert m["cand_rank"][1] == -1 and not m["argmax_agree"][1]
    assert np.isfinite(m["cosine"][[0, 2]]).all()
    assert M.finite_rows(cand).tolist() == [True, False, True, False]
    assert np.isnan(M.cosine(ref, cand)[1]) and np.isnan(M.kl_divergence(ref, cand)[3])
    # The gate helper fails flagged rows even with a threshold every finite row meets.
    assert M.cosine_failures(m, min_cosine=-1.0).tolist() == [1, 3]
    s = M.summarize(m)
    assert (s["nonfinite_positions"], s["first_nonfinite_index"], s["compared_positions"]) == (2, 1, 2)


def test_huge_tiny_and_zero_rows_take_the_float64_path():
    v = V_SMALL
    rng = np.random.default_rng(2)
    base = lm_logits(rng, 1, v)[0].astype(np.float64)
    ref = np.stack([base * 1e18, base * 1e-20, np.zeros(v), np.zeros(v)]).astype(np.float32)
    cand = np.stack([base * 2e18, base * 3e-20, np.zeros(v), base]).astype(np.float32)
    m = M.position_metrics(ref, cand)
    assert m["finite"].all() and m["ref_finite"].all()
    assert m["cosine"][:3] == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    assert m["cosine"][3] == 0.0  # one zero row: orthogonal by definition, fails any gate
    assert m["nmse"][0] == pytest.approx(1.0, rel=1e-6)
    assert m["nmse"][3] == math.inf


def test_shape_mismatch_is_not_comparable():
    with pytest.raises(NotComparable):
        M.position_metrics(np.zeros((2, 10), np.float32), np.zeros((2, 11), np.float32))
    with pytest.raises(InvalidInput):
        M.cosine(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))


# ------------------------------------------------------------------ properties (hypothesis)

finite_rows = st.tuples(
    st.integers(0, 2**32 - 1),  # seed
    st.sampled_from([2, 3, 17, 1000, V_DIVIDES, V_TAIL]),  # vocab
    st.floats(0.1, 20.0),  # logit scale
    st.floats(0.0, 3.0),  # candidate noise
)


def rows_from(seed, v, scale, noise):
    rng = np.random.default_rng(seed)
    ref = (rng.standard_normal((1, v)) * scale).astype(np.float32)
    return ref, perturb(rng, ref, noise * scale)


@settings(max_examples=40, deadline=None)
@given(finite_rows, st.floats(1e-3, 1e3))
def test_cosine_is_invariant_to_positive_scale(params, a):
    ref, cand = rows_from(*params)
    scaled = (cand.astype(np.float64) * a).astype(np.float32)
    assert M.cosine(ref, scaled)[0] == pytest.approx(M.cosine(ref, cand)[0], abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(finite_rows)
def test_kld_is_nonnegative_and_zero_for_equal_inputs(params):
    ref, cand = rows_from(*params)
    assert M.kl_divergence(ref, cand)[0] >= 0.0
    assert M.kl_divergence(ref, ref)[0] == 0.0
    assert M.position_metrics(cand, cand)["kld"][0] == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([5, 1000, V_TAIL]), st.integers(-240, 240), st.integers(-240, 240))
def test_kld_is_invariant_to_shifting_either_side(seed, v, a8, b8):
    # Logits on a 1/8 grid in [-40, 40] and shifts of k/8: float32 adds them exactly, so any
    # change in the KLD would be the metric's own.
    rng = np.random.default_rng(seed)
    ref = (rng.integers(-320, 320, (1, v)) / 8).astype(np.float32)
    cand = (ref + rng.integers(-8, 8, (1, v)) / 8).astype(np.float32)
    base = M.kl_divergence(ref, cand)[0]
    shifted = M.kl_divergence(ref + np.float32(a8 / 8), cand + np.float32(b8 / 8))[0]
    assert shifted == pytest.approx(base, rel=1e-5, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([12, 1000, V_TAIL]), st.sampled_from([1, 5, 10]), st.integers(2, 50))
def test_topk_overlap_is_symmetric_and_topk_matches_sort(seed, v, k, levels):
    # Few distinct levels force many ties.
    rng = np.random.default_rng(seed)
    a = rng.integers(0, levels, (2, v)).astype(np.float32)
    b = rng.integers(0, levels, (2, v)).astype(np.float32)
    np.testing.assert_array_equal(M.topk_overlap(a, b, k), M.topk_overlap(b, a, k))
    for row in a:
        assert M.top_k(row, k)[0].tolist() == brute_topk(row, k)


# ------------------------------------------------------------------ summaries


def wilson(k: int, n: int, z: float = stats.norm.ppf(0.975)) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def test_summarize_values():
    n = 200
    rng = np.random.default_rng(0)
    kld = rng.exponential(1e-3, n)
    cos = 1 - rng.uniform(0, 1e-3, n)
    cos[37] = 0.95
    agree = np.ones(n, bool)
    agree[[3, 4, 5, 6]] = False
    margin = np.full(n, 2.0)
    margin[[3, 4]] = 0.1  # near-ties
    margin[5] = 0.25  # exactly the margin: not below it, so a hard flip
    pp = {k: v for k, v in M._empty_result(n).items()}
    pp.update(finite=np.ones(n, bool), ref_finite=np.ones(n, bool), cosine=cos, kld=kld, argmax_agree=agree,
              ref_margin=margin, cand_rank=np.where(agree, 0, 3), top5_overlap=np.ones(n),
              top10_overlap=np.full(n, 0.9), nmse=np.full(n, 1e-4))
    s = M.summarize(pp)
    assert (s["min_cosine"], s["min_cosine_index"]) == (0.95, 37)
    assert s["mean_cosine"] == pytest.approx(cos.mean())
    assert s["kld"]["mean"] == pytest.approx(kld.mean())
    assert s["kld"]["sem"] == pytest.approx(kld.std(ddof=1) / math.sqrt(n))
    assert s["kld"]["p99_9"] == pytest.approx(np.quantile(kld, 0.999))
    assert s["kld"]["max"] == kld.max()
    a = s["argmax_agreement"]
    assert (a["agree"], a["n"], a["rate"]) == (196, 200, 0.98)
    assert (a["ci_low"], a["ci_high"]) == pytest.approx(wilson(196, 200), abs=1e-12)
    assert s["flips"] == {"total": 4, "near_tie": 2, "hard": 2, "near_tie_margin": 0.25}
    assert M.summarize(pp, near_tie_margin=0.3)["flips"]["near_tie"] == 3
    assert s["top10_overlap_mean"] == pytest.approx(0.9)
    assert s["cand_rank"]["max"] == 3
    assert M.cosine_failures(pp, 0.98).tolist() == [37]


def test_summarize_with_no_positions_is_all_none():
    s = M.summarize(M.concat_metrics([]))
    assert s["positions"] == 0 and s["min_cosine"] is None and s["argmax_agreement"]["rate"] is None
    assert s["flips"]["total"] == 0


def test_metrics_match_plain_float64_at_the_f32_floor():
    """At the float32 floor (candidate = reference plus rounding-sized noise, KLD ~ 1e-8) the
    per-position metrics (float32 exp/expm1, float64 block sums: see the module docstring) agree
    with a plain float64 computation: KLD to 1 % relative, 1 - cosine to 1 %, NMSE to 1e-3."""
    from scipy.special import log_softmax

    rng = np.random.default_rng(7)
    v = 32_768
    ref = (rng.standard_normal((16, v)) * 2.5).astype(np.float32)
    ref[:, :8] += 12.0  # a few leading tokens, as a language model has
    cand = (ref.astype(np.float64) * (1 + 3e-5 * rng.standard_normal((16, v)))).astype(np.float32)
    got = M.position_metrics(ref, cand)
    r, c = ref.astype(np.float64), cand.astype(np.float64)
    lr, lc = log_softmax(r, axis=1), log_softmax(c, axis=1)
    kld = np.sum(np.exp(lr) * (lr - lc), axis=1)
    cos = np.sum(r * c, axis=1) / np.sqrt(np.sum(r * r, axis=1) * np.sum(c * c, axis=1))
    nmse = np.sum((c - r) ** 2, axis=1) / np.sum(r * r, axis=1)
    assert 1e-9 < kld.min() and kld.max() < 3e-7  # the F32 floor
    np.testing.assert_allclose(got["kld"], kld, rtol=1e-2)
    np.testing.assert_allclose(1 - got["cosine"], 1 - cos, rtol=1e-2)
    np.testing.assert_allclose(got["nmse"], nmse, rtol=1e-3)
