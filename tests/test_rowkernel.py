"""The compiled row kernel (harness/measure/rowkernel.c) against the numpy path and float64.

``position_metrics`` takes the compiled kernel when it builds (issue 47: the harness's own share
of a parity run), else the numpy path. Both must give the same integer fields (argmax, ranks,
overlaps, flags: exact selections over float32 values) and float fields within the numpy path's
documented error, on every kind of row: close, far, shifted, tied, peaked, non-finite, out of the
fast range, and vocabularies that are not a multiple of the kernel's vector or sub-block width.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from harness.measure import metrics as M
from harness.measure import rowkernel

QWEN35_VOCAB = 248_320


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """The kernel state reset, built into an empty cache; restored afterwards."""
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    saved = dict(rowkernel._state)
    rowkernel._state.clear()
    yield tmp_path / "cache" / "rowkernel"
    rowkernel._state.clear()
    rowkernel._state.update(saved)


def _numpy_path(ref, cand, monkeypatch, **kw):
    """``position_metrics`` on the numpy path (the kernel disabled for one call)."""
    saved = dict(rowkernel._state)
    monkeypatch.setenv("HARNESS_ROWKERNEL", "0")
    rowkernel._state.clear()
    try:
        assert not rowkernel.available()
        return M.position_metrics(ref, cand, **kw)
    finally:
        monkeypatch.delenv("HARNESS_ROWKERNEL")
        rowkernel._state.clear()
        rowkernel._state.update(saved)


def _compiled(ref, cand, **kw):
    if not rowkernel.available():
        pytest.skip(f"no compiled row kernel on this machine ({rowkernel.kernel_status()['detail']}): the numpy path runs here")
    return M.position_metrics(ref, cand, **kw)


def _rows(v: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference and candidate rows of every kind the kernel branches on."""
    rng = np.random.default_rng(v)
    n = 12
    ref = (rng.standard_normal((n, v)) * 2.5).astype(np.float32)
    noise = np.array([1e-6, 1e-3, 0.05, 1.0, 0, 0, 0, 0, 0, 0, 0, 0], np.float32)[:, None]
    cand = (ref + rng.standard_normal(ref.shape).astype(np.float32) * noise).astype(np.float32)
    cand[4] = -ref[4]  # anti-correlated: cosine -1, the float64 dot path
    ref[5] += 100.0  # max logit above 40: the shifted exp
    cand[5] = ref[5] + rng.standard_normal(v).astype(np.float32) * 0.01
    ref[6] = np.round(ref[6])  # ties everywhere: top-k by token id
    cand[6] = np.round(cand[6] + 0.3)
    ref[7, 7] = ref[7].max() + 12.0  # peaked
    cand[7] = ref[7]
    cand[7, 7] -= 0.5
    ref[8] *= 40.0  # logits 40x apart: the KLD's float64 path (flag 2)
    cand[9, v // 2] = np.nan  # non-finite candidate (flag 1)
    ref[10] *= 1e16  # sums of squares above 1e30 (flag 1)
    cand[10] = ref[10] * np.float32(1.001)
    ref[11] = 1.0  # a constant row: every entry ties
    cand[11] = 1.0
    return ref, cand


def _f64(r: np.ndarray, c: np.ndarray) -> tuple[float, float]:
    """(KL(softmax r || softmax c), cosine) in float64."""
    r, c = r.astype(np.float64), c.astype(np.float64)
    lr = r - r.max()
    lr -= math.log(np.exp(lr).sum())
    lc = c - c.max()
    lc -= math.log(np.exp(lc).sum())
    return float(np.exp(lr) @ (lr - lc)), float(r @ c / math.sqrt((r @ r) * (c @ c)))


@pytest.mark.parametrize("v", [QWEN35_VOCAB, QWEN35_VOCAB + 3, 1000, 1003, 40])
def test_compiled_and_numpy_paths_agree_and_match_float64(v, monkeypatch):
    ref, cand = _rows(v)
    nxt = np.arange(ref.shape[0]) % v
    a = _compiled(ref, cand, next_tokens=nxt, scored=np.ones(ref.shape[0], bool))
    b = _numpy_path(ref, cand, monkeypatch, next_tokens=nxt, scored=np.ones(ref.shape[0], bool))
    for key in ("finite", "ref_finite", "argmax_agree", "ref_argmax", "cand_argmax", "ref_margin", "cand_rank",
                "top5_overlap", "top10_overlap"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert a["finite"].tolist() == [True] * 9 + [False] + [True] * 2
    for i in range(ref.shape[0]):
        if not a["finite"][i]:
            assert math.isnan(a["cosine"][i]) and math.isnan(a["kld"][i]) and a["cand_rank"][i] == -1
            continue
        kld, cos = _f64(ref[i], cand[i])
        assert a["cosine"][i] == pytest.approx(cos, abs=1e-8), i
        assert a["kld"][i] == pytest.approx(kld, rel=2e-6, abs=1e-12), i
        assert a["nmse"][i] == pytest.approx(b["nmse"][i], rel=1e-5, abs=1e-12), i
        for key, row in (("ref_nll", ref[i]), ("cand_nll", cand[i])):  # llama-perplexity's NLL, float64 log-softmax
            r64 = row.astype(np.float64)
            want = math.log(np.exp(r64 - r64.max()).sum()) + r64.max() - r64[nxt[i]]
            assert a[key][i] == pytest.approx(want, rel=1e-7, abs=2e-7), (key, i)  # float32 exps: 1e-7 relative
    # top-k is an exact selection: the constant row's top ids are the lowest ids
    assert a["ref_argmax"][11] == 0 and a["top10_overlap"][11] == 1.0
    assert a["cand_rank"][4] == v - 1 or v <= 40  # the reference's top token is the candidate's lowest


def test_the_kld_at_the_f32_floor_keeps_its_relative_precision():
    """At the F32 floor (KLD ~ 5e-7) the compiled kernel's KLD is within 1e-7 relative of float64
    (the numpy path's float32 expm1 gives ~3e-5; both far inside any gate)."""
    rng = np.random.default_rng(47)
    ref = (rng.standard_normal((4, QWEN35_VOCAB)) * 3).astype(np.float32)
    cand = (ref + rng.standard_normal(ref.shape).astype(np.float32) * np.float32(1e-3)).astype(np.float32)
    got = _compiled(ref, cand)
    for i in range(4):
        kld, _ = _f64(ref[i], cand[i])
        assert 1e-7 < kld < 1e-6
        assert got["kld"][i] == pytest.approx(kld, rel=1e-7)


def test_the_per_metric_functions_take_the_same_path():
    ref, cand = _rows(1000)
    pm = _compiled(ref, cand)
    np.testing.assert_array_equal(M.cosine(ref, cand), pm["cosine"])
    np.testing.assert_array_equal(M.kl_divergence(ref, cand), pm["kld"])
    np.testing.assert_array_equal(M.nmse(ref, cand), pm["nmse"])


def test_the_kernel_is_built_once_into_the_cache_and_reused(fresh_kernel):
    if shutil.which("cc") is None and not __import__("os").environ.get("CC"):
        pytest.skip("no C compiler on this machine: the numpy path runs here (test_without_a_kernel_*)")
    st = rowkernel.kernel_status()
    assert st["path"] == "compiled", st
    built = sorted(fresh_kernel.glob("*.so"))
    assert len(built) == 1 and st["detail"] == str(built[0])
    mtime = built[0].stat().st_mtime_ns
    rowkernel._state.clear()
    assert rowkernel.kernel_status()["detail"] == str(built[0]) and built[0].stat().st_mtime_ns == mtime
    assert not list(fresh_kernel.glob("tmp*"))  # no half-written library left behind


@pytest.mark.parametrize("how, why", [("HARNESS_ROWKERNEL=0", "disabled by HARNESS_ROWKERNEL=0"),
                                      ("CC=/nonexistent/cc", "no C compiler"),
                                      ("CC=false", "failed")])
def test_without_a_kernel_the_numpy_path_runs_and_says_why(fresh_kernel, monkeypatch, how, why):
    name, value = how.split("=")
    monkeypatch.setenv(name, value)
    st = rowkernel.kernel_status()
    assert st["path"] == "numpy" and why in st["detail"], st
    assert not rowkernel.available()
    with pytest.raises(RuntimeError, match="row kernel unavailable"):
        rowkernel.rows(np.zeros((1, 8), np.float32), np.zeros((1, 8), np.float32), 2)
    ref, cand = _rows(1000)
    m = M.position_metrics(ref, cand)  # the numpy path: same fields
    assert m["finite"].sum() == 11 and m["ref_argmax"][11] == 0


def test_splitting_a_block_over_threads_changes_no_number(monkeypatch):
    """Each row's values depend on its row pair alone: one thread, three, or a block cut in two
    give the same bits."""
    if not rowkernel.available():
        pytest.skip(f"no compiled row kernel on this machine ({rowkernel.kernel_status()['detail']})")
    ref, cand = _rows(QWEN35_VOCAB + 3)
    ref, cand = np.ascontiguousarray(ref[:9]), np.ascontiguousarray(cand[:9])  # finite rows, flags 0 and 2
    monkeypatch.setattr(rowkernel, "_threads", lambda: 1)
    one = rowkernel.rows(ref, cand, 10)
    monkeypatch.setattr(rowkernel, "_threads", lambda: 3)
    three = rowkernel.rows(ref, cand, 10)
    cut = [np.concatenate(x) for x in zip(rowkernel.rows(ref[:4], cand[:4], 10), rowkernel.rows(ref[4:], cand[4:], 10))]
    for a, b, c in zip(one, three, cut):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert one[0][:, rowkernel.S_FLAG].tolist() == [0, 0, 0, 0, 2, 0, 0, 0, 2]  # anti-correlated and 40x apart: float64 KLD
