"""The report's cheap plotting path (issue 15): the min/max envelope keeps every dip a panel can
show, the plots are written for thousands of positions with failing points marked, and a page's
token texts come from the vocabulary read one token at a time (no parse of the whole array)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.evidence import report
from harness.evidence.receipts import load_receipt, write_receipt
from harness.fixtures import synthetic as fx
from harness.model.gguf_model import GGUFModel, StringArray
from harness.model.vocab import Vocab

from test_receipts import make_receipt


def test_envelope_keeps_each_bins_min_and_max_and_short_lines_whole():
    rng = np.random.default_rng(0)
    x = np.arange(10_000)
    y = rng.standard_normal(10_000)
    y[4_321] = -50.0  # a single dip must survive
    y[777] = np.nan  # a break in the line stays a break
    ex, ey = report._envelope(x, y, columns=100)
    assert ex.size <= 3 * 100 and np.all(np.diff(ex) >= 0)
    assert np.nanmin(ey) == -50.0 and 4_321 in ex
    assert np.isnan(ey).sum() == 1 and ex[np.isnan(ey)][0] == 777
    edges = np.linspace(0, x.size, 101).astype(int)
    for a, b in zip(edges[:-1], edges[1:]):
        inside = (ex >= a) & (ex < b)
        seg = y[a:b]
        assert np.nanmin(ey[inside]) == np.nanmin(seg) and np.nanmax(ey[inside]) == np.nanmax(seg)
    sx, sy = report._envelope(x[:150], y[:150], columns=100)
    assert sx is x[:150] or np.array_equal(sx, x[:150])
    assert np.array_equal(sy, y[:150], equal_nan=True)


def test_plots_of_thousands_of_positions_are_written_with_failures_marked(tmp_path):
    rec, arrays = make_receipt(seed=3, n=3000, v=97)
    gate = rec["gated"]["min_cosine"]
    arrays["cosine"][[17, 2500]] = gate - 0.01  # failing points to mark, among thousands
    jp, _ = write_receipt(rec, arrays, tmp_path / "receipts")
    loaded = load_receipt(jp)
    out = tmp_path / "plots"
    out.mkdir()
    pos = report.plot_positions(loaded.receipt, loaded.arrays, out)
    mar = report.plot_margins(loaded.receipt, loaded.arrays, out)
    for p in (pos, mar):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_token_texts_read_one_token_at_a_time_match_the_full_parse():
    path = fx.build("tiny-qwen35-v248k")
    gm = GGUFModel(path)
    lazy = gm.token_texts
    assert isinstance(lazy, StringArray)
    full = gm.tokens  # gguf-py's own parse of every element
    assert len(lazy) == len(full) == 248_320
    for i in (0, 1, 255, 256, 1000, 123_456, 248_319):
        assert lazy[i] == full[i]
    v = Vocab(lazy, "gpt2")
    assert v.tokens is lazy  # kept as given, not copied into a list
    assert v.raw(248_320) is None and v.raw(-1) is None
    assert v.raw(1000) == Vocab(full, "gpt2").raw(1000)



def test_cosine_panel_is_one_minus_cosine_on_a_log_axis_with_the_gate_and_failures():
    """The positions plot's cosine panel (issue 32): ``1 − cosine`` on a log axis, so a passing
    engine's spread (here 1e-9 .. 1e-6) spans decades instead of a flat line on the gate; exact
    zeros sit at the floor; the gate is drawn at 1 − min_cosine; failing positions (one below the
    gate, one NaN) are marked; the KLD panel beside it stays log-scaled."""
    rec, arrays = make_receipt(seed=5, n=400, v=97)
    gate = rec["gated"]["min_cosine"]
    cos = 1.0 - np.geomspace(1e-9, 1e-6, 400)
    cos[[3, 7]] = 1.0  # identical rows: 1 − cosine is exactly 0
    cos[100] = gate - 0.01  # below the gate
    cos[200] = np.nan  # non-finite: failing, drawn at the gate
    arrays["cosine"] = cos
    fig = report.positions_figure(rec, arrays)
    ax, ax2 = fig.axes[0], fig.axes[1]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "1 − cosine"
    assert ax2.get_yscale() == "log" and ax2.get_ylabel() == "KLD (nats)"
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    y = np.asarray(lines["1 − cosine"].get_ydata(), float)
    assert np.nanmin(y) == report.COSINE_FLOOR  # the zeros, on the floor
    assert np.nanmax(y[np.arange(400) != 100]) == pytest.approx(1e-6)
    gate_line = next(ln for name, ln in lines.items() if name.startswith("gate"))
    assert np.allclose(gate_line.get_ydata(), 1.0 - gate)
    fx_, fy = lines["failing"].get_data()
    assert list(fx_) == [100, 200] and fy[0] == pytest.approx(1.0 - (gate - 0.01)) and fy[1] == pytest.approx(1.0 - gate)
    lo, hi = ax.get_ylim()
    assert lo < report.COSINE_FLOOR and hi > 1.0 - (gate - 0.01)  # every point and the gate are inside the axis


def test_positions_plot_has_two_panels_whatever_the_prompt_count_with_prompts_delimited_and_named():
    """The positions plot draws the whole prompt set on two panels (issue 47: matplotlib's cost is
    per axis, and one row per prompt made the plot the harness's largest own cost): the prompts
    side by side, a boundary line between each pair on both panels, a wide prompt's id above its
    span (escaped: a hostile id cannot start mathtext), a narrow one unnamed."""
    rec, arrays = make_receipt(seed=7, n=600, v=97)
    ids = ["first-prompt", "$x^2$ evil", "narrow-id"]
    lengths = [300, 295, 5]
    arrays["prompt_index"] = np.repeat(np.arange(3, dtype=np.int32), lengths)
    arrays["position"] = np.concatenate([np.arange(k, dtype=np.int32) for k in lengths])
    rec["prompts"]["items"] = [{"id": i, "source": "ids", "tokens": [1] * k} for i, k in zip(ids, lengths)]
    arrays["cosine"][450] = rec["gated"]["min_cosine"] - 0.01
    fig = report.positions_figure(rec, arrays)
    assert len(fig.axes) == 2
    ax, ax2 = fig.axes
    for a in (ax, ax2):
        vlines = sorted(ln.get_xdata()[0] for ln in a.get_lines() if len(set(ln.get_xdata())) == 1 and ln.get_label().startswith("_"))
        assert vlines == [299.5, 594.5]
    labels = [t.get_text() for t in ax.texts]
    assert labels == [report.plot_text("first-prompt"), report.plot_text("$x^2$ evil")]
    assert "$" not in "".join(labels).replace("\\$", "")
    fx_, _ = next(ln for ln in ax.get_lines() if ln.get_label() == "failing").get_data()
    assert list(fx_) == [450]  # x is the position over the whole set
