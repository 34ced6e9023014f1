"""Verdict pages a release reviewer reads: one per receipt (parity or probe), Markdown and HTML.

``write_report(receipt)`` writes ``report.md``, ``report.html`` (the same page, static, opens
from disk) and its PNG plots into ``reports/<id[:16]>/`` beside the receipts folder. The first
screen states the verdict, the worst position (with its token's text from the model's
vocabulary), and on a FAIL the first divergent layer and op with the likely cause, and the
commands that reproduce the run and localize it. Then the gates as a table (threshold,
observed, basis, ok), the report-only fields marked as such, per-prompt numbers, plots,
provenance, and every command again.

A FAIL explains itself: when the candidate declares the ``activations`` capability (oracle,
``mutant:*``, llama.cpp, transformers, command engines that declare it) the caller
(``harness.runs.explain``, which may run engines; this module only reads and renders)
localizes the first divergence against the oracle on the receipt's own token ids
(``localization_plan``) and the page shows the per-layer error profile and the likely cause;
otherwise it says which capability would allow it.

Numbers are rounded by ``harness.evidence.fmt``; every untrusted string is escaped by
``harness.evidence.page``. Plots (matplotlib's object API on Agg, fixed layout: see ``_figure``): per-position 1 − cosine (log axis) with its gate and KLD
with the KLD gates; the reference's top-1/top-2 margin against argmax flips; the per-layer error
profile of a localization.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from harness.config import reproduce_env
from harness.engines.options import candidate_flags
from harness.errors import HarnessError, InvalidInput
from harness.evidence import fmt
from harness.evidence.page import Badge, Bold, Code, Inline, Link, Page, untrusted
from harness.evidence.receipts import (CHAT_PARSERS_SCHEMA_ID, MTP_SCHEMA_ID, PROBE_SCHEMA_ID, SCHEMA_ID, TOKENIZER_SCHEMA_ID, acceptance_rows,
                                       load_receipt, per_prompt_rows, receipts_root)
from harness.paths import DATA_DIR, DEFAULT_PROMPTS
from harness.provenance import sha256_file

REPORT_MD, REPORT_HTML = "report.md", "report.html"
LOCALIZE_MIN_TOKENS = 32
"""A report localizes at least this many tokens of the failing prompt (or the whole prompt)."""


def _plt():
    """matplotlib's object API on the Agg canvas (no pyplot: no GUI backend lookup, no global
    figure registry); returns ``matplotlib.figure.Figure``. Imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure


_PREWARM: list[threading.Thread] = []


def prewarm_plots() -> None:
    """Import matplotlib and its Agg canvas (about 0.4 s on the reference machine) on a daemon
    thread, once per process, so that a run which will write a report does so while it waits for
    its engines to start (a llama.cpp worker loading its model) instead of after they finished
    (issue 47). An import that fails here is left to fail again, with its message, where the
    report imports it; nothing is rendered and nothing is written."""
    if _PREWARM:
        return

    def load() -> None:
        try:
            _plt()
            from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        except Exception:  # noqa: BLE001 - the report's own import reports it
            pass

    t = threading.Thread(target=load, name="report-prewarm", daemon=True)
    _PREWARM.append(t)
    t.start()


def plot_text(s: Any) -> str:
    """An untrusted string made safe for a matplotlib title or label (no mathtext)."""
    return untrusted(s).replace("$", r"\$")


# Plots cost what their text layout and PNG encoding cost, not what their data cost: no
# tight_layout (it draws every tick label to measure it, then the figure is drawn again): margins
# are fixed in inches, titles at a fixed height (``y=1``: no overlap search over the tick labels); log axes label their ticks as plain text (``1e-08``) rather than mathtext;
# lines of more positions than a panel has pixel columns are drawn as a per-column min/max
# envelope (``_envelope``: every dip and spike stays visible); uniform markers are Line2D
# markers, not a scatter collection; PNGs are zlib level 1.
_DPI = 110
_PNG = {"compress_level": 1}
_ENVELOPE_COLUMNS = 800
"""A line with more points than this many per panel is drawn as its per-bin min/max envelope."""


def _figure(width: float, height: float, nrows: int, ncols: int, top: float, bottom: float = 0.5,
            left: float = 0.75, right: float = 0.2, hspace: float = 0.55, wspace: float = 0.75) -> tuple[Any, np.ndarray]:
    """A Figure of ``width`` × ``height`` inches on an Agg canvas with an ``nrows`` × ``ncols``
    grid of axes (2-D object array) and fixed margins in inches (``top``: room for the title;
    ``hspace``/``wspace``: the gaps between panels, inches)."""
    Figure = _plt()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    panel_h = (height - top - bottom - hspace * (nrows - 1)) / nrows
    panel_w = (width - left - right - wspace * (ncols - 1)) / ncols
    axes = fig.subplots(nrows, ncols, squeeze=False)
    fig.subplots_adjust(left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height,
                        hspace=hspace / panel_h, wspace=wspace / panel_w)
    return fig, axes


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI, pil_kwargs=_PNG)
    return path


def _plain_log(ax: Any) -> None:
    """Label a log-scaled y axis with plain-text powers of ten (no mathtext), no minor ticks."""
    from matplotlib import ticker

    ax.yaxis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=True))
    ax.yaxis.set_minor_locator(ticker.NullLocator())  # ~9 unlabelled ticks per decade: objects, not data


def _envelope(x: np.ndarray, y: np.ndarray, columns: int = _ENVELOPE_COLUMNS) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` when it has at most ``2 * columns`` points, else per bin of consecutive points
    its minimum, its maximum and its first NaN (a break in the line), in position order, so the
    line drawn covers the same pixels at a panel's resolution."""
    n = x.size
    if n <= 2 * columns:
        return x, y
    starts = np.linspace(0, n, columns + 1).astype(np.int64)[:-1]
    bin_of = np.repeat(np.arange(columns), np.diff(np.append(starts, n)))
    idx = np.arange(n)
    nan = np.isnan(y)
    picks = [np.minimum.reduceat(np.where(nan, idx, n), starts)]  # each bin's first NaN (n: none)
    for fill, reduce in ((np.inf, np.minimum), (-np.inf, np.maximum)):
        filled = np.where(nan, fill, y)
        extreme = reduce.reduceat(filled, starts)
        hit = (filled == extreme[bin_of]) & ~nan  # the first such index per bin, as nanargmin/nanargmax pick
        picks.append(np.minimum.reduceat(np.where(hit, idx, n), starts))
    keep = np.unique(np.concatenate(picks))
    keep = keep[keep < n]
    return x[keep], y[keep]


# ----------------------------------------------------------------------------- plots
COSINE_FLOOR = 1e-16
"""Where the positions plot draws 1 − cosine of exactly 0 (identical rows) or below (float64
rounding can give a cosine a hair above 1): the log axis has no zero; float64's epsilon is 2.2e-16."""
KLD_FLOOR = 1e-16
"""Where the positions plot draws a KLD of exactly 0."""


_PROMPT_LABELS_MAX = 16
"""The positions plot names each prompt above its span when the set has at most this many."""
_LABEL_WIDTH_PER_CHAR = 0.0055
"""Fraction of the panel's width one character of a prompt label takes (6-point text, 12 in wide)."""


def positions_figure(receipt: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
    """The matplotlib Figure of ``plot_positions``: two panels over the whole prompt set, the
    prompts side by side in receipt order (x: position over the set; thin gray lines at the
    prompt boundaries, each prompt's id above its span when there are at most
    ``_PROMPT_LABELS_MAX``). Top: ``1 − cosine`` per position on a log axis (exact zeros at
    ``COSINE_FLOOR``), the gate drawn at ``1 − min_cosine`` (dashed), failing positions (below
    the gate, or non-finite, drawn at the gate) as red points above it. Bottom: the KLD per
    position on a log axis (zeros at ``KLD_FLOOR``) with the KLD gates (mean: dashed, p99:
    dotted). Lines longer than a panel's width are drawn as their min/max envelope
    (``_envelope``). Two panels whatever the number of prompts: matplotlib's cost is per axis
    (ticks, labels), and one row of panels per prompt made the plot the largest part of the
    harness's own time in a run (issue 47)."""
    prompts = receipt["prompts"]["items"]
    gate = receipt["gated"]["min_cosine"]  # the cosine threshold that judged the cell
    gates = {d["name"]: {"value": d["threshold"]} for d in receipt["gated"].get("distribution_gates") or []}
    fig, axes = _figure(12, 6.2, 2, 1, top=0.75, bottom=0.55, left=0.85, hspace=0.75)
    ax, ax2 = axes[0, 0], axes[1, 0]
    cos, kld = arrays["cosine"], arrays["kld"]
    x = np.arange(cos.size)
    gate_err = max(1.0 - gate, COSINE_FLOOR)
    err = np.where(np.isfinite(cos), np.maximum(1.0 - cos.astype(np.float64), COSINE_FLOOR), np.nan)
    ax.semilogy(*_envelope(x, err), lw=0.8, color="tab:blue", label="1 − cosine")
    ax.axhline(gate_err, ls="--", color="tab:red", lw=1, label=f"gate 1 − {gate:g} = {gate_err:.2g}")
    bad = ~np.isfinite(cos) | (cos < gate)
    if bad.any():
        ax.plot(x[bad], np.where(np.isfinite(err[bad]), err[bad], gate_err), ls="", marker="o", ms=3.5, color="tab:red", zorder=3,
                label="failing")
    seen = np.concatenate([err[np.isfinite(err)], [gate_err]])
    low = float(seen.min())  # down to the floor only when a row was exact
    ax.set_ylim(COSINE_FLOOR / 3 if low <= COSINE_FLOOR else low / 10, min(float(seen.max()) * 10, 3.0))
    ax.set_ylabel("1 − cosine")
    ax.set_title(f"per-position 1 − logit cosine (log; exact at {COSINE_FLOOR:g})", fontsize=9, y=1.0, pad=12)
    ax2.semilogy(*_envelope(x, np.maximum(kld, KLD_FLOOR)), lw=0.8, color="tab:green", label="KLD")
    for name, style in (("max_kld_mean", "--"), ("max_kld_p99", ":")):
        if name in gates:
            v = gates[name]["value"]
            ax2.axhline(v, ls=style, color="tab:red", lw=1, label=f"KLD {name.removeprefix('max_kld_')} gate {v:g}")
    ax2.set_ylabel("KLD (nats)")
    ax2.set_title("KL(P_ref || P_cand) per position", fontsize=9, y=1.0)
    ax2.set_xlabel("position over the prompt set (prompts in receipt order)")
    _prompt_spans(ax, ax2, arrays["prompt_index"], [p["id"] for p in prompts])
    for a in (ax, ax2):
        _plain_log(a)
        a.set_xlim(-0.5, max(cos.size - 0.5, 0.5))
    ax.legend(fontsize=7, loc="upper left")
    ax2.legend(fontsize=7, loc="lower right")
    eng = receipt["engines"]
    fig.suptitle(plot_text(f"{eng['candidate']['name']} vs {eng['reference']['name']} on {_model_name(receipt)} — {receipt['gated']['verdict']}"))
    return fig


def _prompt_spans(ax: Any, ax2: Any, prompt_index: np.ndarray, ids: list[str]) -> None:
    """Thin gray lines at the prompt boundaries on both panels; each prompt's id (escaped by
    ``plot_text``) above its span on ``ax`` when there are at most ``_PROMPT_LABELS_MAX`` and the
    span is wide enough for the text (a narrower prompt is still delimited; the page's per-prompt
    table gives its positions)."""
    pidx = np.asarray(prompt_index)
    starts = np.flatnonzero(np.diff(pidx) != 0) + 1
    for a in (ax, ax2):
        for b in starts:
            a.axvline(b - 0.5, color="0.75", lw=0.6, zorder=0)
    if 0 < len(ids) <= _PROMPT_LABELS_MAX:
        edges = np.concatenate([[0], starts, [pidx.size]])
        for lo, hi in zip(edges[:-1], edges[1:]):
            i = int(pidx[lo]) if lo < pidx.size else -1
            if 0 <= i < len(ids) and (hi - lo) / pidx.size >= _LABEL_WIDTH_PER_CHAR * min(len(ids[i]), 40):
                ax.text((lo + hi - 1) / 2, 1.0, plot_text(ids[i]), transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                        fontsize=6, color="0.35")


def plot_positions(receipt: dict[str, Any], arrays: dict[str, np.ndarray], out: Path) -> Path:
    """Write ``positions.png`` (``positions_figure``: 1 − cosine and KLD per position, both on
    log axes with their gates, failing positions marked) into ``out``; returns its path."""
    return _save(positions_figure(receipt, arrays), out / "positions.png")


def plot_margins(receipt: dict[str, Any], arrays: dict[str, np.ndarray], out: Path) -> Path:
    """Reference top-1/top-2 margin per position, agreeing vs near-tie vs hard flips; writes
    ``margins.png``."""
    margin = arrays["ref_margin"]
    agree = arrays["argmax_agree"].astype(bool)
    ok = np.isfinite(margin)
    thr = receipt["report_only"]["flips"]["near_tie_margin"]
    near = ~agree & (margin < thr) & ok
    hard = ~agree & (margin >= thr) & ok
    x = np.arange(margin.size)
    fig, axes = _figure(10, 3.6, 1, 1, top=0.4, bottom=0.55, left=0.9)
    ax = axes[0, 0]
    ax.plot(x[agree & ok], margin[agree & ok], ls="", marker="o", ms=1.6, mew=0, color="tab:gray", alpha=0.5,
            label=f"argmax agrees ({int((agree & ok).sum())})")
    ax.plot(x[near], margin[near], ls="", marker="o", ms=4, mew=0, color="tab:orange", label=f"near-tie flip ({int(near.sum())})")
    ax.plot(x[hard], margin[hard], ls="", marker="x", ms=4.5, color="tab:red", label=f"hard flip ({int(hard.sum())})")
    ax.axhline(thr, ls="--", color="tab:orange", lw=1, label=f"near-tie margin {thr:g}")
    ax.set_yscale("symlog", linthresh=1e-2)
    ax.set_ylim(0, max(float(np.nanmax(margin[ok])) * 1.5 if ok.any() else 1.0, thr * 2))
    ax.set_xlabel("position over the whole prompt set")
    ax.set_ylabel("reference top-1 − top-2 (logits)")
    ax.set_title("reference margin and argmax flips (report-only)", y=1.0)
    ax.legend(fontsize=8)
    return _save(fig, out / "margins.png")


def plot_layers(localization: dict[str, Any], out: Path) -> Path:
    """Per-layer max NMSE and 1 − min cosine of a localization run against its bounds; writes
    ``layers.png``."""
    rows = localization["per_layer"]
    short = {"recurrent": "rec", "attention": "attn", "moe": "MoE", "mtp": "MTP"}
    labels = [f"{e['layer']}\n{short.get(e['type'], e['type'][:4])}" if e["layer"] >= 0 else "out" for e in rows]
    b = localization["bounds"]
    fig, axes = _figure(11, 3.6, 1, 2, top=0.45, bottom=0.85, left=0.85, wspace=0.95)
    a1, a2 = axes[0]
    x = np.arange(len(rows))
    first = localization.get("first_divergence")
    hit = [bool(first) and e["layer"] == first["layer"] for e in rows]
    for a, vals, bound, ylabel, color in (
        (a1, [e["max_nmse"] for e in rows], b["max_nmse"], "max NMSE over the layer's tensors", "tab:purple"),
        (a2, [1 - e["min_cosine"] for e in rows], 1 - b["min_cosine"], "1 − min cosine", "tab:cyan"),
    ):
        v = np.asarray(vals, dtype=np.float64)
        pos = v[np.isfinite(v) & (v > 0)]
        floor = min(float(pos.min()) if pos.size else bound, bound) / 100
        a.bar(x, np.where(v > 0, v, floor), bottom=0, color=["tab:red" if h else color for h in hit])
        for xi in np.flatnonzero(v <= 0):  # an exact zero has no log-scale bar: say so
            a.text(xi, floor * 1.5, "0", ha="center", va="bottom", fontsize=7, color="tab:gray")
        a.axhline(bound, ls="--", color="tab:red", label=f"bound {bound:.2g}")
        a.set_yscale("log")
        _plain_log(a)
        a.set_ylim(bottom=floor)
        a.set_ylabel(ylabel)
        a.set_xticks(x, labels, fontsize=7)
        a.set_xlabel("layer (rec: recurrent Gated DeltaNet, attn: attention)")
        a.legend(fontsize=8)
    title = "per-layer error vs the oracle"
    if first:
        title += f" — first divergence {first['name']} (layer {first['layer']})"
    fig.suptitle(plot_text(title))
    return _save(fig, out / "layers.png")


# ----------------------------------------------------------------------------- shared pieces


def _model_name(rec: dict[str, Any]) -> str:
    return rec["model"].get("name") or Path(rec["model"]["path"]).name


def _model_spec(rec: dict[str, Any]) -> str:
    """What ``--model`` takes to reproduce: ``fixture:NAME`` as recorded, else the file path."""
    name = rec["model"].get("name") or ""
    return name if name.startswith("fixture:") else rec["model"]["path"]


def _shown_path(p: Path) -> str:
    """``p`` relative to the current directory when it lies below it, else absolute."""
    try:
        rel = os.path.relpath(p.resolve(), Path.cwd())
    except ValueError:
        return str(p.resolve())
    return rel if not rel.startswith("..") else str(p.resolve())


def _cmd(*argv: Any) -> str:
    """A shell command line with every argument quoted for a POSIX shell."""
    return " ".join(shlex.quote(str(a)) for a in argv)


def _shipped_prompts(prompts: dict[str, Any]) -> bool:
    """Whether a receipt's prompt set is the shipped default (same bytes)."""
    try:
        default_sha = sha256_file(DEFAULT_PROMPTS)
        if prompts.get("sha256"):
            return prompts["sha256"] == default_sha
        p = Path(prompts.get("path") or "")
        return p.is_file() and sha256_file(p) == default_sha
    except (HarnessError, OSError):
        return False


def _probe_lengths(rec: dict[str, Any]) -> list[str]:
    """A probe run's ``--decode-tokens`` (``long_decode.tokens``) and ``--long-tokens`` (the long
    probe's ``details.requested_positions``) where they differ from the defaults the receipt
    records beside them (``default_tokens``, ``default_positions``): run without them, the line
    would feed the defaults instead. A receipt without the defaults (older) carries neither."""
    out: list[str] = []
    ld = rec.get("long_decode") or {}
    if ld.get("default_tokens") is not None and ld.get("tokens") not in (None, ld["default_tokens"]):
        out += ["--decode-tokens", str(int(ld["tokens"]))]
    long = next((p for p in rec.get("probes") or [] if p.get("name") == "long"), {})
    d = long.get("details") or {}
    if d.get("default_positions") is not None and d.get("requested_positions") not in (None, d["default_positions"]):
        out += ["--long-tokens", str(int(d["requested_positions"]))]
    return out


def _opts(rec: dict[str, Any]) -> list[str]:
    """``--prompts`` (or ``--text``/``--ctx``)/``--thresholds``/``--override-kv`` as the run had
    them (the shipped prompt set omitted)."""
    out: list[str] = []
    prompts = rec.get("prompts") or {}
    if prompts.get("text"):  # harness parity --text FILE --ctx N
        out += ["--text", prompts["text"]["path"], "--ctx", str(prompts["text"]["n_ctx"])]
        if prompts["text"].get("judged"):
            out.append("--score-second-half")
    elif prompts.get("path") and not _shipped_prompts(prompts):
        out += ["--prompts", prompts["path"]]
    th = (rec.get("thresholds") or {}).get("file")
    if th:
        out += ["--thresholds", th]
    for o in rec["model"].get("overrides") or []:
        out += ["--override-kv", o]
    return out


def _basis(gate: dict[str, Any]) -> str:
    """A threshold's basis in a line: measured (where, how, when) or declared (by whom)."""
    b = gate.get("basis") or {}
    if b.get("kind") == "measured":
        s = f"measured on {b.get('model') or gate.get('basis_model') or 'n/a'}"
        extra = [x for x in (b.get("command"), b.get("date"), f"n {b['n']}" if b.get("n") is not None else None) if x]
        if b.get("known_bad"):
            extra.append(f"{len(b['known_bad'])} known-bad")
        s += f" ({', '.join(str(x) for x in extra)})" if extra else ""
        if gate.get("basis_model_differs"):
            s += "; measured on another model than this one"
        return s
    if b.get("kind") == "declared":
        return f"declared by {b.get('who') or 'n/a'}" + (f" ({b['date']})" if b.get("date") else "")
    return "no basis"


def _ok(flag: bool | None) -> Inline:
    return "not measured" if flag is None else ("ok" if flag else Badge("FAILED"))


def _engine_line(info: dict[str, Any] | None) -> Inline:
    if not info:
        return fmt.NA
    settings = ", ".join(f"{k}={fmt.number(v) if isinstance(v, float) else v}" for k, v in sorted((info.get("settings") or {}).items())
                         if not isinstance(v, (dict, list)) and k != "model_sha256")
    caps = ", ".join(info.get("capabilities") or []) or "none"
    return [Code(f"{info['name']}"), f" {info.get('version') or ''}; capabilities: {caps}" + (f"; settings: {settings}" if settings else "")]


def _provenance(page: Page, rec: dict[str, Any], receipt_link: str | None) -> None:
    m, h, host = rec["model"], rec.get("harness") or {}, rec.get("host") or {}
    commit = (h.get("git_commit") or "")[:12] or fmt.NA
    rows: list[tuple[Inline, Inline]] = [
        ("receipt", Link(Code(rec["id"]), receipt_link) if receipt_link else Code(rec["id"])),
        ("written", fmt.when(rec.get("created"))),
        ("model", [Code(_model_name(rec)), f" ({m['arch']}, {m['file_type']}), sha256 ", Code(m["sha256"][:16]),
                   f", overrides: {', '.join(m.get('overrides') or []) or 'none'}"]),
        ("candidate", _engine_line(rec["engines"].get("candidate"))),
        ("reference", _engine_line(rec["engines"].get("reference"))),
        ("thresholds", [Code(str(rec["thresholds"].get("file") or fmt.NA)), " sha256 ", Code(str(rec["thresholds"].get("sha256") or "")[:16])]),
        ("harness", f"{h.get('version', fmt.NA)}, commit {commit}" + (" (uncommitted changes)" if h.get("git_dirty") else "")),
        ("host", f"{host.get('hostname', fmt.NA)}, {host.get('platform', fmt.NA)}, Python {host.get('python', fmt.NA)}, {host.get('cpu_count', fmt.NA)} CPUs"),
        ("command recorded", Code(_cmd(*rec.get("command") or []))),
    ]
    if rec.get("prompts", {}).get("sha256"):
        p = rec["prompts"]
        what, where = p.get("units") or ("prompts", "positions")  # a chat-parsers page counts scripts and fields compared
        rows.insert(5, (what, [Code(str(p.get("id", ""))), f", {p.get('count', fmt.NA)} {what}, {p.get('positions', fmt.NA)} {where}, sha256 ",
                               Code(p["sha256"][:16])]))
    page.h(2, "Provenance").fields(rows)
    _timings_table(page, rec)


def _seconds(v: Any) -> str:
    return fmt.NA if v is None else f"{float(v):.3g} s"


def _timings_table(page: Page, rec: dict[str, Any]) -> None:
    """The run's speed per engine (``timings``, harness/engines/timing.py), when recorded:
    three significant digits, the resolution a shared machine's timing supports."""
    t = rec.get("timings") or {}
    rows = []
    for role in ("candidate", "reference"):
        e = t.get(role)
        if not e:
            continue
        name = (rec["engines"].get(role) or {}).get("name", role)
        tps = e.get("prefill_tokens_per_s")
        rows.append([role, Code(name), _seconds(e.get("wall_s")), _seconds(e.get("load_s")), _seconds(e.get("prefill_s")),
                     str(e.get("tokens", fmt.NA)), fmt.NA if tps is None else f"{float(tps):.3g}", str(e.get("source", fmt.NA))])
    if rows:
        page.h(2, "Timings (report-only)")
        page.table(["role", "engine", "wall", "load", "prefill", "tokens", "prefill tokens/s", "measured by"], rows, "llrrrrrl")


def _receipt_link(receipt_json: Path, out: Path) -> str | None:
    try:
        return os.path.relpath(receipt_json.resolve(), out.resolve()).replace(os.sep, "/")
    except ValueError:
        return None


# ----------------------------------------------------------------------------- localization


@dataclass
class Explanation:
    """What a page shows beyond its receipt, looked up by the caller (``harness.runs.explain``
    runs the engines and reads the model; this module only renders):

    - ``vocab``: the model's vocabulary (``fmt.TokenTexts``) for token texts, or None and
      ``vocab_note`` saying why;
    - ``localization``: ``Localization.to_dict()`` with ``plan`` (``localization_plan``), or None
      and ``loc_note`` saying why;
    - ``op_meaning`` and ``causes`` (``{mutant, bug_class, description}``): what the first
      divergent op computes and the known bug classes that first diverge there.
    """

    vocab: fmt.TokenTexts | None = None
    vocab_note: str = "token texts were not looked up for this rendering (harness report RECEIPT looks them up)"
    localization: dict[str, Any] | None = None
    loc_note: str = "Not localized in this rendering; localize with the command below."
    op_meaning: str | None = None
    causes: list[dict[str, str]] = field(default_factory=list)


def has_activations(rec: dict[str, Any]) -> bool:
    """Whether the receipt's candidate declares the ``activations`` capability."""
    return "activations" in (rec["engines"]["candidate"].get("capabilities") or [])


def _parity_site(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The position a FAIL is localized at: the first failing one, else the worst-cosine one."""
    g = rec["gated"]
    return g.get("first_failing") or g.get("worst") or g.get("min_cosine_where")


def localization_plan(rec: dict[str, Any]) -> dict[str, Any] | None:
    """How to localize a receipt's failure: ``{tokens, n_tokens, chunks, prompt, position, why}``
    (token ids from the receipt itself: for parity the failing prompt up to its first failing
    position, at least ``LOCALIZE_MIN_TOKENS``; for probes the probe's tokens in the failing
    comparison's pieces), or None when nothing locates it."""
    if rec.get("schema") == PROBE_SCHEMA_ID:
        main = list((rec.get("prompts") or {}).get("main_tokens") or [])
        if not main:
            return None
        for pr in rec["probes"]:
            bad = next((c for c in pr["comparisons"] if not c.get("ok")), None)
            if pr["verdict"] != "FAIL" or bad is None:
                continue
            label = bad["label"]
            if m := re.fullmatch(r"split at (\d+)", label):
                k = int(m.group(1))
                return {"tokens": main, "n_tokens": len(main), "chunks": [k, len(main) - k] if 0 < k < len(main) else None, "prompt": None,
                        "position": bad.get("first_bad_position"), "why": f"probe {pr['name']}, {label}"}
            if m := re.fullmatch(r"prefill (\d+) then 1 token per call", label):
                short = list(rec["prompts"].get("decode_tokens") or main[:80])  # receipts before --decode-tokens fed main[:80]
                if bad.get("first_bad_position") is not None:
                    short = short[: max(bad["first_bad_position"] + 1, int(m.group(1)) + 1, LOCALIZE_MIN_TOKENS)]  # to the failing position
                k = int(m.group(1))
                return {"tokens": short, "n_tokens": len(short), "chunks": [k] + [1] * (len(short) - k) if 0 < k < len(short) else None, "prompt": None,
                        "position": bad.get("first_bad_position"), "why": f"probe {pr['name']}, {label}"}
            return {"tokens": main, "n_tokens": len(main), "chunks": None, "prompt": None, "position": bad.get("first_bad_position"),
                    "why": f"probe {pr['name']}, {label} (whole prompt in one call)"}
        return None
    site = _parity_site(rec)
    if not site:
        return None
    item = next((p for p in rec["prompts"]["items"] if p["id"] == site["prompt"]), None)
    if item is None:
        return None
    n = min(len(item["tokens"]), max(site["position"] + 1, LOCALIZE_MIN_TOKENS))
    return {"tokens": list(item["tokens"][:n]), "n_tokens": n, "chunks": None, "prompt": site["prompt"], "position": site["position"],
            "why": f"prompt {fmt.quoted(site['prompt'])}, positions 0–{n - 1}"}


def localize_command(rec: dict[str, Any], plan: dict[str, Any] | None, receipt_shown: str = "RECEIPT") -> str:
    """The command that localizes a receipt's failure: ``harness localize`` on the failing prompt
    (parity), or ``harness report RECEIPT --localize`` where only the receipt holds the exact token
    ids and pieces (probes)."""
    if rec.get("schema") == PROBE_SCHEMA_ID:
        return _cmd("harness", "report", receipt_shown, "--localize")
    argv: list[Any] = ["harness", "localize", "--candidate", rec["engines"]["candidate"]["name"], "--model", _model_spec(rec)]
    if plan and plan.get("prompt") is not None:
        argv += ["--prompt", plan["prompt"], "--max-tokens", plan.get("n_tokens") or len(plan["tokens"])]
        o = _opts(rec)
        if "--prompts" in o:
            argv += ["--prompts", o[o.index("--prompts") + 1]]
    if plan and plan.get("chunks"):
        argv += ["--chunks", ",".join(str(c) for c in plan["chunks"])]
    for ov in rec["model"].get("overrides") or []:
        argv += ["--override-kv", ov]
    return " ".join([*reproduce_env(rec["engines"]["candidate"].get("config")), _cmd(*argv)])


def _localize_cell(rec: dict[str, Any], loc_cmd: str) -> Inline:
    if not has_activations(rec):
        return "not available: the candidate does not declare the activations capability (docs/engine-protocol.md)"
    if rec.get("schema") == PROBE_SCHEMA_ID and localization_plan(rec) is None:
        return "nothing to localize: no probe failed"
    return Code(loc_cmd)


def _first_div_inline(loc: dict[str, Any] | None, why_not: str, meaning: str | None) -> Inline:
    if loc is None:
        return why_not
    f = loc.get("first_divergence")
    if not f:
        if loc.get("verdict") == "UNMEASURED":
            return "not measured: no activation of the candidate could be compared with the oracle's"
        return f"none: every one of {loc.get('compared')} tensors is within the bounds on these tokens (see Localization)"
    where = f"layer {f['layer']} ({f['layer_type']})" if f["layer"] >= 0 else "model output"
    nums = (f"NMSE {fmt.sig2(f.get('nmse'))}, cosine {fmt.cosine(f.get('cosine'))}" if f.get("nmse") is not None else str(f.get("status")))
    pos = f" from position {f['position']}" if f.get("position") is not None else ""
    return [Bold([where, ", op ", Code(f["op"])]), f" — {meaning}" if meaning else "", "; tensor ", Code(f["name"]), f"{pos}: {nums}"]


def _cause_inline(rec: dict[str, Any], ex: Explanation) -> Inline:
    loc = ex.localization
    build = rec["engines"]["candidate"].get("build") or {}
    planted: Inline = ""
    if build.get("bug_class"):
        planted = [" — this candidate is ", Code(rec["engines"]["candidate"]["name"]), f", planted fault: {build['bug_class']}"]
    if loc is None or not loc.get("first_divergence"):
        return [fmt.NA, planted] if planted else fmt.NA
    if ex.causes:
        return [Bold("; ".join(c["bug_class"] for c in ex.causes)), " (known bug classes that first diverge at this op: ",
                ", ".join(f"mutant:{c['mutant']}" for c in ex.causes), ")", planted]
    f = loc["first_divergence"]
    return [f"no known bug class first diverges at {f.get('layer_type')} {f.get('op')}: inspect that op's inputs and weights", planted]


def _localization_section(page: Page, rec: dict[str, Any], ex: Explanation, cmd: str, png: str | None) -> None:
    loc, loc_note = ex.localization, ex.loc_note
    page.h(2, "Localization (first divergence against the oracle)")
    if loc is None:
        page.p(loc_note)
        page.p("To localize by hand:" if has_activations(rec) else "Once the engine returns its activations, localize with:")
        page.code(cmd)
        return
    plan = loc.get("plan") or {}
    b = loc["bounds"]
    page.p(f"Compared {loc.get('compared', fmt.NA)} tensors of the candidate with the float64 oracle's, in forward order, on "
           f"{plan.get('n_tokens', fmt.NA)} tokens ({plan.get('why', 'the failing prompt')})"
           + (f", fed in pieces of {', '.join(str(c) for c in plan['chunks'][:6])}{' …' if len(plan['chunks']) > 6 else ''}" if plan.get("chunks") else "")
           + f". Bounds: NMSE ≤ {fmt.number(b['max_nmse'])}, cosine ≥ {fmt.cosine_threshold(b['min_cosine'])} (thresholds.yaml probes.localize_*).")
    f = loc.get("first_divergence")
    if f:
        page.fields([("first divergent layer and op", _first_div_inline(loc, "", ex.op_meaning)), ("what the op computes", ex.op_meaning or fmt.NA),
                     ("likely cause", _cause_inline(rec, ex))])
        if ex.causes:
            page.bullets([[Code(f"mutant:{c['mutant']}"), f" — {c['bug_class']}: {c['description']}"] for c in ex.causes])
    else:
        page.p(_first_div_inline(loc, "", None))
    rows = []
    for e in loc["per_layer"]:
        first = bool(f) and e["layer"] == f["layer"]
        label = (str(e["layer"]) if e["layer"] >= 0 else "output") + (" ← first divergence" if first else "")
        rows.append([Bold(label) if first else label, e["type"], str(e["compared"]), str(e["missing"]), str(e["over"]),
                     fmt.sig2(e["max_nmse"]), fmt.cosine(e["min_cosine"])])
    page.h(3, "Per-layer error profile")
    page.table(["layer", "type", "tensors compared", "not comparable", "over the bounds", "max NMSE", "min cosine"], rows, "llrrrrr")
    if png:
        page.image(png, "per-layer error profile")
    page.p("Localization data: ", Link(Code("localization.json"), "localization.json"), ". Again by hand:")
    page.code(cmd)


# ----------------------------------------------------------------------------- parity page


def _where_kld(rec: dict[str, Any], arrays: dict[str, np.ndarray], where: dict[str, Any] | None) -> tuple[Any, Any]:
    """(cosine, KLD) at a receipt position, from the arrays."""
    if not where:
        return None, None
    ids = [p["id"] for p in rec["prompts"]["items"]]
    if where["prompt"] not in ids:
        return None, None
    sel = np.flatnonzero((arrays["prompt_index"] == ids.index(where["prompt"])) & (arrays["position"] == where["position"]))
    if not sel.size:
        return None, None
    c, k = float(arrays["cosine"][sel[0]]), float(arrays["kld"][sel[0]])
    return (c if np.isfinite(c) else None), (k if np.isfinite(k) else None)


def _parity_headline(rec: dict[str, Any]) -> str:
    g = rec["gated"]
    v = g["verdict"]
    th = g["min_cosine"]
    if v == "PASS":
        return f"all {g['positions']} positions have logit cosine ≥ {fmt.cosine_threshold(th)} (lowest {fmt.cosine(g['min_cosine_observed'])}) and every KLD gate holds."
    if v == "UNMEASURED":
        return (f"only {g['positions']} positions were compared; the gate needs at least {g['min_positions']}. "
                "Nothing was judged: this is not a PASS. Run with a prompt set of more positions.")
    parts = []
    if g["failing_positions"]:
        parts.append(f"{fmt.count(g['failing_positions'], g['positions'])} positions below the cosine gate {fmt.cosine_threshold(th)}")
    if g.get("nonfinite_positions"):
        parts.append(f"{g['nonfinite_positions']} positions with non-finite logits")
    failed = [d for d in g.get("distribution_gates") or [] if not d["ok"] and d["observed"] is not None]
    if failed:
        parts.append(" and ".join(d["label"] for d in failed) + " over " + ("their gates" if len(failed) > 1 else "its gate"))
    return "; ".join(parts) + "." if parts else "the gates failed."


def _tier_table(page: Page, rec: dict[str, Any]) -> None:
    """The gates of a receipt judged by two tiers (``harness-thresholds/v2``): the release gate's
    rows, then the calibrated tier's (or why it is unmeasured and the command that measures it)."""
    g, th = rec["gated"], rec["thresholds"]
    judged = g["verdict"] != "UNMEASURED"
    rel, cal = g["release"], g["calibrated"]
    rows: list[list[Inline]] = []
    for c in rel["checks"]:
        shown = ("not computed: the candidate gives top-k logprobs" if g.get("cosine_computed") is False
                 else f"lowest {fmt.cosine(c['observed'])}; {fmt.count(rel['failing_positions'], g['positions'])} below")
        rows.append([f"release gate: {c['label']} (every position)", f"≥ {fmt.cosine_threshold(c['threshold'])}", shown,
                     _basis(th["release"]["min_cosine"]), _ok(c["ok"]) if judged else "not judged"])
    mp = th["release"]["min_positions"]
    rows.append(["release gate: positions compared", f"≥ {fmt.number(mp['value'])}", str(g["positions"]), _basis(mp),
                 "ok" if g["positions"] >= g["min_positions"] else Bold("too few: UNMEASURED")])
    row_gates = (th.get("calibrated") or {}).get("gates", {})
    for c in cal["checks"]:
        shown = (f"lowest {fmt.cosine(c['observed'])}; {fmt.count(cal['failing_positions'], g['positions'])} below"
                 if c["name"] == "min_cosine" else fmt.kld(c["observed"]))
        op = "≥" if c["name"] == "min_cosine" else "≤"
        value = fmt.cosine_threshold(c["threshold"]) if c["name"] == "min_cosine" else fmt.number(c["threshold"])
        rows.append([f"calibrated tier: {c['label']}", f"{op} {value}", shown, _basis(row_gates.get(c["name"], {})), _ok(c["ok"])])
    if cal["status"] == "unmeasured":
        rows.append(["calibrated tier", "UNMEASURED", untrusted(cal.get("reason") or ""), untrusted(cal.get("command") or ""), "not judged"])
    top = g.get("topk")  # a top-k candidate (an http:NAME server): its tier judged the cell
    top_gates = (th.get("topk") or {}).get("gates", {})
    for c in (top or {}).get("checks", []):
        rows.append([f"top-k tier: {c['label']}", f"≤ {fmt.number(c['threshold'])}", fmt.kld(c["observed"]),
                     _basis(top_gates.get(c["name"], {})), _ok(c["ok"])])
    if top and top["status"] == "unmeasured":
        rows.append(["top-k tier", "UNMEASURED", untrusted(top.get("reason") or ""), untrusted(top.get("command") or ""), "not judged"])
    page.h(2, "Gates").table(["gate", "threshold", "observed", "basis", "ok"], rows, "llllc")
    page.p(untrusted(rel["line"]))
    page.p(untrusted(cal["line"]))
    if top:
        page.p(untrusted(top["line"]))


def _gates_table(page: Page, rec: dict[str, Any]) -> None:
    if "release" in rec["gated"]:
        _tier_table(page, rec)
        return
    g, gates = rec["gated"], rec["thresholds"]["gates"]
    cos, mp = gates["min_cosine"], gates["min_positions"]
    judged = g["verdict"] != "UNMEASURED"

    def ok(flag: bool | None) -> Inline:
        return _ok(flag) if judged else "not judged"

    rows: list[list[Inline]] = [
        ["per-position logit cosine (every position)", f"≥ {fmt.cosine_threshold(cos['value'])}",
         f"lowest {fmt.cosine(g['min_cosine_observed'])}; {fmt.count(g['failing_positions'], g['positions'])} below"
         + (f"; {g['nonfinite_positions']} non-finite" if g.get("nonfinite_positions") else ""),
         _basis(cos), ok(g["failing_positions"] == 0 and not g.get("nonfinite_positions"))],
        ["positions compared", f"≥ {fmt.number(mp['value'])}", str(g["positions"]), _basis(mp),
         "ok" if g["positions"] >= g["min_positions"] else Bold("too few: UNMEASURED")],
    ]
    for d in g.get("distribution_gates") or []:
        rows.append([d["label"], f"≤ {fmt.number(d['threshold'])}", fmt.kld(d["observed"]), _basis(gates.get(d["name"], {})),
                     ok(None if d["observed"] is None else d["ok"])])
    page.h(2, "Gates").table(["gate", "threshold", "observed", "basis", "ok"], rows, "llllc")


def _report_only_table(page: Page, rec: dict[str, Any]) -> None:
    ro = rec["report_only"]
    aa, fl, kl = ro["argmax_agreement"], ro["flips"], ro.get("kld") or {}
    rows: list[list[Inline]] = [
        ["argmax agreement", fmt.rate(aa.get("rate"), aa.get("ci_low"), aa.get("ci_high")),
         f"{aa.get('agree', fmt.NA)} of {aa.get('n', fmt.NA)} positions; Wilson {fmt.number(100 * aa.get('confidence', 0.95))}% interval"],
        ["argmax flips", f"{fl['near_tie']} near-tie, {fl['hard']} hard", f"near-tie: reference top-1 − top-2 < {fmt.number(fl['near_tie_margin'])} logits"],
        ["KLD mean", f"{fmt.kld(kl.get('mean'))} ± {fmt.kld(kl.get('sem'))}" if kl else fmt.NA, "nats, ± standard error"],
        ["KLD p50 / p99 / p99.9 / max", " / ".join(fmt.kld(kl.get(k)) for k in ("p50", "p99", "p99_9", "max")) if kl else fmt.NA, "nats"],
        ["mean cosine", fmt.cosine(ro.get("mean_cosine")), "over all positions"],
        ["top-5 / top-10 overlap", f"{fmt.percent(ro.get('top5_overlap_mean'))} / {fmt.percent(ro.get('top10_overlap_mean'))}", "mean share of the reference's top-k in the candidate's"],
        ["NMSE mean / max", f"{fmt.sig2((ro.get('nmse') or {}).get('mean'))} / {fmt.sig2((ro.get('nmse') or {}).get('max'))}", "Σ(c − r)² / Σr² per position"],
        ["reference margin p1 / p5 / p50", " / ".join(fmt.sig2((ro.get("ref_margin") or {}).get(k)) for k in ("p1", "p5", "p50")), "logits, top-1 − top-2"],
        ["rank of the reference's top-1 in the candidate", f"max {fmt.number((ro.get('cand_rank') or {}).get('max'))}, p99 {fmt.number((ro.get('cand_rank') or {}).get('p99'))}", "0 = also the candidate's top-1"],
    ]
    if "perplexity" in ro:  # harness.measure.metrics.next_token_summary
        text = (rec.get("prompts") or {}).get("text")
        where = (f"the second half of each --ctx {text['n_ctx']} window (positions {text['score_from']} to {text['n_ctx'] - 2}), as llama-perplexity scores"
                 if text else "every position with a next token")
        rows += [
            ["perplexity", fmt.perplexity_text(ro.get("perplexity")), f"exp(mean NLL of the next token) of each engine, ratio candidate / reference; over {where}"],
            ["Δp, reference's top token", fmt.delta_p_text(ro.get("delta_p")), "p_candidate(top_ref) − p_reference(top_ref), same positions"],
            ["Δp, next token", fmt.delta_p_text(ro.get("delta_p_next")), "p_candidate(next) − p_reference(next): llama-perplexity --kl-divergence's Δp"],
        ]
    page.h(2, "Report-only fields (not gated)")
    page.p("Recorded for trends; none of these decides the verdict until a reviewer adds it to thresholds.yaml with a measured basis.")
    text = (rec.get("prompts") or {}).get("text")
    if text:
        page.p(f"Prompts: the text file {untrusted(text['path'])} ({text['n_tokens']} tokens) cut into {text['windows']} windows of "
               f"{text['n_ctx']} tokens as llama-perplexity cuts it ({text['unused_tokens']} tokens after the last window unused"
               + (f"; each window starts with BOS {text['bos_id']}" if text["add_bos"] else "") + ")."
               + (f" Judged: {text['judged']['positions']} positions, from position {text['judged']['from']} of each window "
                  f"({untrusted(text['judged']['why'])})." if text.get("judged") else ""))
    page.table(["field (report-only)", "value", "how to read it"], rows)


def _per_prompt_table(page: Page, rec: dict[str, Any]) -> None:
    rows = []
    for p in per_prompt_rows(rec):
        first = p.get("first_failing_position")
        rows.append([fmt.quoted(p["id"]), str(p["positions"]), f"{fmt.cosine(p.get('min_cosine'))} at {p.get('min_cosine_position', fmt.NA)}",
                     fmt.cosine(p.get("mean_cosine")), fmt.percent(p.get("argmax_agreement")), f"{p.get('near_tie_flips')} / {p.get('hard_flips')}",
                     fmt.kld(p.get("kld_mean")), f"{p.get('failing_positions')}" + (f" (first at {first})" if first is not None else "")])
    page.h(2, "Per prompt").table(["prompt", "positions", "lowest cosine at", "mean cosine", "argmax agreement",
                                   "flips near-tie / hard", "KLD mean", "failing"], rows, "lrrrrrrr")


def free_running_section(page: Page, rec: dict[str, Any]) -> None:
    """The free-running greedy table of a parity receipt (``report_only.free_running``,
    ``harness.runs.greedy``): per prompt the steps compared and why they stopped (N tokens or
    the reference's EOS), the identical steps, and at the first divergence both tokens and the
    reference's margin, near-tie or hard. Nothing when the receipt has none."""
    fr = rec["report_only"].get("free_running")
    if not fr:
        return
    page.h(2, "Free-running greedy (report-only)")
    if "unmeasured" in fr:
        page.p(f"Unmeasured: {fr['unmeasured']}.")
        return
    page.p(f"Each engine continued each prompt greedily on its own for up to {fr['n_tokens']} tokens; "
           f"a divergence is a near-tie when the reference's top-1 − top-2 margin there is below {fmt.number(fr['near_tie_margin'])} logits.")
    rows = []
    for p in fr["prompts"]:
        d = p["diverged_at"]
        kind = fmt.NA if d is None else ("near-tie" if p["near_tie"] else "hard" if p["near_tie"] is False else fmt.NA)
        rows.append([fmt.quoted(p["prompt"]), f"{p['steps']} ({'EOS' if p['stop'] == 'eos' else 'N'})", str(p["identical"]),
                     "identical" if d is None else str(d), fmt.NA if d is None else f"{p['reference_token']} / {p['candidate_token']}",
                     fmt.NA if d is None else fmt.sig2(p["margin"]), kind])
    page.table(["prompt", "steps (stop)", "identical steps", "first divergence", "tokens ref / cand", "ref margin", "kind"], rows, "lrrrrrl")


def reproduce_command(rec: dict[str, Any], ledger_opt: Sequence[str] = ()) -> str:
    """The command that runs a parity or probe receipt's run again as it was run: its candidate
    with the options that made it (``engines.candidate.requested``: ``--dtype``,
    ``--mlx-folder``; ``harness.judge.reproducer.candidate_flags``), its model, prompts,
    thresholds and overrides, and for a probe run the probes it was asked for (``only``: none
    when every probe ran, so the line is judged as that run was), behind the config assignments
    of an engine a config file defines."""
    eng = rec["engines"]
    cand = eng["candidate"]
    flags = candidate_flags(cand.get("requested"))
    if rec.get("schema") == PROBE_SCHEMA_ID:
        argv: list[Any] = ["harness", "probe", "--candidate", cand["name"], *flags, "--model", _model_spec(rec)]
        for name in rec.get("only") or []:
            argv += ["--only", name]
        argv += _probe_lengths(rec)
        if eng.get("reference"):
            argv += ["--reference", eng["reference"]["name"]]
        run = _cmd(*argv, *_opts(rec), *ledger_opt)
    else:
        run = _cmd("harness", "parity", "--model", _model_spec(rec), "--candidate", cand["name"], *flags, "--reference", eng["reference"]["name"],
                   *_opts(rec), *ledger_opt)
    env = reproduce_env(cand.get("config"), (eng.get("reference") or {}).get("config"))
    return " ".join([*env, run])


def _commands(rec: dict[str, Any], receipt_shown: str, loc_cmd: str, ledger_opt: list[str]) -> dict[str, str]:
    run = reproduce_command(rec, ledger_opt)
    cmds = {"reproduce the run": run, "localize the first divergence": loc_cmd}
    if not has_activations(rec) or (rec.get("schema") == PROBE_SCHEMA_ID and localization_plan(rec) is None):
        del cmds["localize the first divergence"]
    return cmds | {"re-render this report": _cmd("harness", "report", receipt_shown), "check the ledger": _cmd("harness", "ledger", "verify", *ledger_opt)}


@dataclass
class _Ctx:
    """What a page shows beside its receipt: the explanation, plots and paths."""

    ex: Explanation
    plan: dict[str, Any] | None
    pngs: dict[str, str]
    receipt_link: str | None
    receipt_shown: str
    ledger_opt: list[str]


def _parity_page(rec: dict[str, Any], arrays: dict[str, np.ndarray], c: _Ctx) -> Page:
    """The verdict page of a parity receipt (first screen: verdict, worst position, first
    divergence, likely cause, commands)."""
    ex, plan, pngs = c.ex, c.plan, c.pngs
    vocab, vocab_note, loc, loc_note = ex.vocab, ex.vocab_note, ex.localization, ex.loc_note
    g, eng = rec["gated"], rec["engines"]
    v = g["verdict"]
    title = f"{v} · {eng['candidate']['name']} vs {eng['reference']['name']} on {_model_name(rec)} ({rec['model']['file_type']})"
    page = Page(title, f"verdict-{v}").h(1, title)
    page.p(Badge(v), f" ({rec['kind']}): {_parity_headline(rec)}")
    if rec["kind"] == "self-consistency":
        page.note("Self-consistency: reference and candidate are the same engine build and settings. This is not parity evidence.")
    worst = g.get("worst") or g.get("min_cosine_where")
    wc, wk = _where_kld(rec, arrays, worst)
    loc_cmd = localize_command(rec, plan or localization_plan(rec), c.receipt_shown)
    cmds = _commands(rec, c.receipt_shown, loc_cmd, c.ledger_opt)
    rows: list[tuple[Inline, Inline]] = [("verdict", [Badge(v), f" — {rec['kind']}, {g['positions']} positions over {rec['prompts']['count']} prompts"])]
    rows.append(("worst position" if v == "FAIL" else "lowest-cosine position", fmt.position(worst, vocab) + [f": cosine {fmt.cosine(wc)}, KLD {fmt.kld(wk)}"]))
    if v == "FAIL":
        if g.get("first_failing") and g["first_failing"] != worst:
            rows.append(("first failing position", fmt.position(g["first_failing"], vocab)))
        rows.append(("first divergent layer and op", _first_div_inline(loc, loc_note.split(";")[0].split(". ")[0] + ".", ex.op_meaning)))
        rows.append(("likely cause", _cause_inline(rec, ex)))
    rows += [("reproduce", Code(cmds["reproduce the run"])), ("localize", _localize_cell(rec, loc_cmd))]
    page.fields(rows)
    if vocab is None:
        page.note(f"Token texts not shown: {vocab_note}.")
    _gates_table(page, rec)
    if v == "FAIL":
        _localization_section(page, rec, ex, loc_cmd, pngs.get("layers"))
    _report_only_table(page, rec)
    _per_prompt_table(page, rec)
    free_running_section(page, rec)
    page.h(2, "Plots")
    for key, alt in (("positions", "per-position cosine (gate dashed) and KLD (KLD gates dashed and dotted)"), ("margins", "reference margin and argmax flips")):
        if key in pngs:
            page.image(pngs[key], alt)
    if v != "FAIL" and loc is not None:
        _localization_section(page, rec, ex, loc_cmd, pngs.get("layers"))
    _provenance(page, rec, c.receipt_link)
    page.h(2, "Commands").table(["to", "run"], [[k, Code(c)] for k, c in cmds.items()])
    return page


# ----------------------------------------------------------------------------- probe page


def _probe_position(rec: dict[str, Any], probe: str, pos: int | None, vocab: fmt.TokenTexts | None) -> Inline:
    """A probe's position with its token (probes fed the receipt's main tokens) when known."""
    main = list((rec.get("prompts") or {}).get("main_tokens") or [])
    if probe == "decode" and (rec.get("prompts") or {}).get("decode_tokens"):
        main = list(rec["prompts"]["decode_tokens"])
    if pos is None:
        return fmt.NA
    if probe not in ("split", "decode", "ubatch", "determinism") or pos >= len(main):
        return str(pos)
    text = fmt.token_text(vocab, main[pos])
    return [f"{pos} (token {main[pos]} ", Code(text), ")"] if text else f"{pos} (token {main[pos]})"


TOLERANCED_PROBES = ("split", "decode", "ubatch", "multiseq", "prefix", "serving")
"""Probes judged by the class's per-position cosine and KLD (``harness.runs.probes.TOLERANCED``);
the speculative probe uses them for its verify rows only."""


def _probe_tolerance_rows(rec: dict[str, Any]) -> list[list[Inline]]:
    """The tolerances the receipt's measured probes used, each once: the class's cosine and KLD
    (naming which probes compared under them), determinism's bit-identity, the speculative probe's
    near-tie δ; none that no probe of the receipt used."""
    measured = {p["name"]: p for p in rec["probes"] if p["verdict"] != "UNMEASURED"}
    users = [n for n in TOLERANCED_PROBES if n in measured]
    spec = measured.get("speculative")
    if spec is not None and any(str(c.get("label", "")).endswith("verify logits") or "verify logits (" in str(c.get("label", ""))
                                for c in spec.get("comparisons") or []):
        users.append("speculative (verify rows)")
    probes_th = rec["thresholds"].get("probes") or {}
    trows: list[list[Inline]] = []
    for name, label, rel in (("min_cosine", "per-position cosine", "≥"), ("max_kld", "per-position KLD", "≤")):
        if name in probes_th and users:
            t = probes_th[name]
            val = fmt.cosine_threshold(t["value"]) if name == "min_cosine" else fmt.number(t["value"])
            trows.append([f"{label} (each comparison of {', '.join(users)})", f"{rel} {val}", _basis(t)])
    if "determinism" in measured:
        trows.append(["determinism", "bit-identical logits", "declared by the probe (no tolerance)"])
    tie = ((spec or {}).get("details") or {}).get("near_tie") or {}
    if spec is not None and tie.get("delta") is not None:
        trows.append(["speculative near-tie δ (a differing token excused only below this plain-path top-1/top-2 margin)",
                      f"< {fmt.number(tie['delta'])} logits", _basis({"basis": tie.get("basis")}) if tie.get("basis") else "given on the command line"])
    return trows or [["none", "no measured probe compared under a tolerance", ""]]


def _acceptance_table(page: Page, rec: dict[str, Any]) -> None:
    """The speculative probe's acceptance, one row per case with what it counts: every draft
    (report-only) and, for a head-drafted case, the acceptance gate (first drafts against the
    reference head's at the same steps, ``harness.runs.spec_acceptance``)."""
    spec = next((p for p in rec["probes"] if p["name"] == "speculative"), None)
    rows = acceptance_rows((spec or {}).get("details") or {})
    if not rows:
        return
    body = []
    for r in rows:
        g = r["gate"] or {}
        first = f"{g['candidate_accepted']}/{g['steps']}" if "candidate_accepted" in g else fmt.NA
        refh = f"{g['reference_accepted']}/{g['steps']}" if "reference_accepted" in g else fmt.NA
        verdict = (f"{g['verdict']} (drop {g['drop']:.2f} ≤ {g['max_drop']:g})" if g.get("verdict") == "PASS" else
                   f"{g['verdict']} (drop {g['drop']:.2f} > {g['max_drop']:g})" if g.get("verdict") == "FAIL" else
                   f"UNMEASURED ({g.get('reason', '')})" if g else fmt.NA)
        body.append([untrusted(r["case"]), f"{r['accepted']}/{r['proposed']}", fmt.NA if r["acceptance"] is None else f"{r['acceptance']:.3f}",
                     first, refh, untrusted(verdict), untrusted(r["counts"])])
    page.h(2, "Speculative acceptance per case").p(
        "Every draft (accepted / proposed, rate) is report-only: each case counts its own drafts (last column), and a sum over cases of "
        "different draft_max would count different things, so none is shown. The gate judges the first drafts: at the candidate's own "
        "verification steps, its first drafts accepted beside the reference head's teacher-forced first drafts right at the same steps "
        "(thresholds.yaml probes.spec_max_acceptance_drop, probes.spec_min_reference_accepted).")
    page.table(["case", "accepted / proposed", "rate", "first drafts", "reference head", "gate", "what it counts"], body, "lrrrrll")


PROBE_FAIL_MEANING = {
    "determinism": "the same call twice gives different logits",
    "long": "the candidate leaves the reference over a long prompt",
    "serving": "requests served together change what a request gets alone",
    "speculative": "speculative greedy differs from the engine's own plain greedy (its tokens, its draft counts or its verify rows)",
    "state": "a state carried between calls changes the logits",
}
"""What a failed probe found, for the verdict page's first line; a probe not named here feeds the
same tokens another way (in pieces, one at a time, side by side, from a cached prefix)."""


def probe_fail_sentence(failed: Sequence[str]) -> str:
    """The verdict page's sentence for the failed probes ``failed``: each probe's finding
    (``PROBE_FAIL_MEANING``), the probes feeding the same tokens another way grouped."""
    other = [n for n in failed if n not in PROBE_FAIL_MEANING]
    parts = [f"{n}: {PROBE_FAIL_MEANING[n]}" for n in failed if n in PROBE_FAIL_MEANING]
    if other:
        parts.insert(0, f"{', '.join(other)}: feeding the same tokens another way changes the logits")
    return "; ".join(parts) + "."


def _probe_tables(page: Page, rec: dict[str, Any], vocab: fmt.TokenTexts | None) -> None:
    rows = []
    for pr in rec["probes"]:
        cs = pr["comparisons"]
        cos = [c["min_cosine"] for c in cs if c.get("min_cosine") is not None]
        kl = [c["max_kld"] for c in cs if c.get("max_kld") is not None]
        bad = next((c for c in cs if not c.get("ok")), None)
        detail = pr.get("reason") if pr["verdict"] == "UNMEASURED" else (f"{bad['label']}: first differing position {bad.get('first_bad_position', fmt.NA)}" if bad else "")
        rows.append([pr["name"], Badge(pr["verdict"]), str(len(cs)),
                     fmt.cosine(min(cos)) if cos else fmt.NA, fmt.kld(max(kl)) if kl else fmt.NA, detail or ""])
    page.h(2, "Probes").table(["probe", "verdict", "comparisons", "lowest cosine", "max KLD", "detail"], rows, "llrrrl")
    page.h(2, "Tolerances").table(["gate", "threshold", "basis"], _probe_tolerance_rows(rec))
    _acceptance_table(page, rec)
    for pr in rec["probes"]:
        if pr["verdict"] != "FAIL":
            continue
        crow = []
        for c in pr["comparisons"]:
            tok = _probe_position(rec, pr["name"], c.get("first_bad_position"), vocab)
            crow.append([c["label"], "ok" if c.get("ok") else Badge("FAILED"), str(c.get("positions", fmt.NA)), fmt.cosine(c.get("min_cosine")),
                         fmt.kld(c.get("max_kld")), fmt.sig2(c.get("max_abs_diff")), tok])
        page.h(3, f"Probe {pr['name']}: every comparison")
        page.table(["comparison", "ok", "positions", "lowest cosine", "max KLD", "max |Δ logit|", "first differing position"], crow, "lcrrrrl")


def _probe_page(rec: dict[str, Any], c: _Ctx) -> Page:
    """The verdict page of a probe receipt."""
    ex, plan, pngs = c.ex, c.plan, c.pngs
    vocab, vocab_note, loc, loc_note = ex.vocab, ex.vocab_note, ex.localization, ex.loc_note
    v = rec["verdict"]
    cand = rec["engines"]["candidate"]["name"]
    title = f"{v} · probes of {cand} on {_model_name(rec)} ({rec['model']['file_type']})"
    page = Page(title, f"verdict-{v}").h(1, title)
    failed = [p["name"] for p in rec["probes"] if p["verdict"] == "FAIL"]
    unmeasured = rec.get("unmeasured") or []
    head = {"PASS": f"every measured probe agrees with the engine's own whole-prompt run ({rec['positions']} positions compared).",
            "FAIL": f"probes failed: {', '.join(failed)}. " + probe_fail_sentence(failed),
            "ENGINE-ERROR": "the engine failed partway: " + "; ".join(f"{p['name']}: {untrusted(p.get('reason') or 'n/a')}" for p in rec["probes"]
                                                                     if p["verdict"] == "ENGINE-ERROR")
                            + ". The comparisons made before it are below; this is not a PASS.",
            "UNMEASURED": "a required probe could not be measured (the engine lacks a capability); this is not a PASS."}[v]
    page.p(Badge(v), " (self-consistency probes): ", head)
    loc_cmd = localize_command(rec, plan or localization_plan(rec), c.receipt_shown)
    cmds = _commands(rec, c.receipt_shown, loc_cmd, c.ledger_opt)
    rows: list[tuple[Inline, Inline]] = [("verdict", [Badge(v), f" — {len(rec['probes'])} probes, {rec['positions']} positions compared"])]
    if unmeasured:
        reasons = {p["name"]: p.get("reason") for p in rec["probes"]}
        rows.append(("not measured", "; ".join(f"{n}: {reasons.get(n) or 'n/a'}" for n in unmeasured)))
    if v == "FAIL":
        pr = next(p for p in rec["probes"] if p["verdict"] == "FAIL")
        bad = next((c for c in pr["comparisons"] if not c.get("ok")), None)
        if bad:
            rows.append(("first failing comparison", [f"probe {pr['name']}, {bad['label']}: first differing position ",
                                                      _probe_position(rec, pr["name"], bad.get("first_bad_position"), vocab),
                                                      f"; lowest cosine {fmt.cosine(bad.get('min_cosine'))}, max KLD {fmt.kld(bad.get('max_kld'))}"]))
        rows.append(("first divergent layer and op", _first_div_inline(loc, loc_note.split(". ")[0] + ".", ex.op_meaning)))
        rows.append(("likely cause", _cause_inline(rec, ex)))
    rows += [("reproduce", Code(cmds["reproduce the run"])), ("localize", _localize_cell(rec, loc_cmd))]
    page.fields(rows)
    if vocab is None:
        page.note(f"Token texts not shown: {vocab_note}.")
    _probe_tables(page, rec, vocab)
    if v == "FAIL" or loc is not None:
        _localization_section(page, rec, ex, loc_cmd, pngs.get("layers"))
    _provenance(page, rec, c.receipt_link)
    page.h(2, "Commands").table(["to", "run"], [[k, Code(c)] for k, c in cmds.items()])
    return page


# ----------------------------------------------------------------------------- MTP and tokenizer pages


def _mtp_command(rec: dict[str, Any], ledger_opt: Sequence[str]) -> str:
    """``harness parity --mtp ...`` as the MTP receipt's run was made (its ``--mtp-max-tokens``)."""
    eng = rec["engines"]
    cand = eng["candidate"]
    max_tokens = (rec.get("prompts") or {}).get("max_tokens")
    run = _cmd("harness", "parity", "--mtp", "--model", _model_spec(rec), "--candidate", cand["name"], *candidate_flags(cand.get("requested"), ("dtype",)),
               "--reference", eng["reference"]["name"], *_opts(rec), *(["--mtp-max-tokens", max_tokens] if max_tokens else []), *ledger_opt)
    return " ".join([*reproduce_env(cand.get("config"), (eng.get("reference") or {}).get("config")), run])


def _tokenizer_command(rec: dict[str, Any], ledger_opt: Sequence[str]) -> str:
    """``harness tokenizer ...`` as the tokenizer receipt's run was made."""
    cand = rec["engines"]["candidate"]
    prompts = rec.get("prompts") or {}
    run = _cmd("harness", "tokenizer", "--candidate", cand.get("engine") or cand["name"], "--model", _model_spec(rec),
               *candidate_flags(cand.get("requested"), ("folder", "tokenizer_dir")), *(["--prompts", prompts["path"]] if prompts.get("path") else []),
               *(["--add-special"] if rec.get("add_special") else []), *[x for o in rec["model"].get("overrides") or [] for x in ("--override-kv", o)],
               *ledger_opt)
    return " ".join([*reproduce_env(cand.get("config")), run])


def _mtp_tables(page: Page, rec: dict[str, Any]) -> None:
    """One row per MTP check (whole, chunked, sequences, hidden, depth2: depth 2 beside depth 1) and each failing check's line."""
    rows = [[c["name"], Badge(c["verdict"]), str(c.get("positions", fmt.NA)), fmt.cosine(c.get("min_cosine")), fmt.kld(c.get("max_kld")),
             untrusted(c.get("reason") or "")] for c in rec.get("checks") or []]
    page.h(2, "MTP checks").table(["check", "verdict", "positions", "lowest cosine", "max KLD", "detail"], rows, "llrrrl")
    for c in rec.get("checks") or []:
        if c["verdict"] == "FAIL":
            page.h(3, f"Check {c['name']}").p(Code(untrusted(c.get("line") or "")))


def _tokenizer_tables(page: Page, rec: dict[str, Any]) -> None:
    """One row per prompt compared (token counts, first differing position) and the chat template."""
    rows = []
    for c in rec.get("comparisons") or []:
        first = c.get("first_diff")
        texts = "" if first is None else " / ".join(
            ", ".join(f"{t['id']} {fmt.quoted(t['text']) if t.get('text') is not None else ''}".strip() for t in c.get(side) or [])
            for side in ("reference", "candidate"))
        rows.append([fmt.quoted(c["prompt"]), "ok" if c.get("ok") else Badge("FAILED"), str(c.get("n_reference", fmt.NA)),
                     str(c.get("n_candidate", fmt.NA)), "identical" if first is None else str(first), texts])
    page.h(2, "Token ids").table(["prompt", "ok", "llama.cpp ids", "candidate ids", "first difference", "ids from there (llama.cpp / candidate)"], rows,
                                 "lcrrrl")
    chat = rec.get("chat_template") or {}
    if chat:
        page.h(2, "Chat template").p(Badge(chat.get("verdict") or "UNMEASURED"), " ", untrusted(chat.get("message") or ""))


def _chat_parsers_command(rec: dict[str, Any], ledger_opt: Sequence[str]) -> str:
    """``harness chat-parsers ...`` as the chat-parsers receipt's run was made (its server and that
    server's setting: llama-server's reasoning format, llama-cpp-python's chat format if named)."""
    cand = rec["engines"]["candidate"]
    settings = cand.get("settings") or {}
    server = cand.get("engine") or cand["name"]
    opt = (["--reasoning-format", settings.get("reasoning_format")] if server == "llama-server"
           else (["--chat-format", settings["chat_format"]] if settings.get("chat_format") else []))
    path = str((rec.get("scripts") or {}).get("path") or "")
    scripts = [] if Path(path) == (DATA_DIR / "chat" / "scripts").resolve() else ["--scripts", path]
    return _cmd("harness", "chat-parsers", "--server", server, "--model", _model_spec(rec), *opt, *scripts, *ledger_opt)


def _chat_parsers_tables(page: Page, rec: dict[str, Any]) -> None:
    """One row per script and mode (each field PASS or FAIL) and each differing field's first
    differing character, both sides escaped."""
    fields = ("reasoning_content", "content", "tool_calls")
    rows = [[fmt.quoted(r["script"]), "streamed" if r["stream"] else "not streamed", Badge(r["verdict"]),
             *[Badge(r["fields"][f]) for f in fields]] for r in rec.get("results") or []]
    page.h(2, "Scripts").table(["script", "mode", "verdict", *fields], rows, "llcccc")
    diffs = [[fmt.quoted(r["script"]), "streamed" if r["stream"] else "not streamed", d["field"], str(d["at"]),
              Code(untrusted(repr(d["expected"]))), Code(untrusted(repr(d["got"])))] for r in rec.get("results") or [] for d in r["diffs"]]
    if diffs:
        page.h(2, "Differences").table(["script", "mode", "field", "first differing character", "expected (from a few characters before)",
                                        "server"], diffs, "lllrll")


_SUMMARY_KINDS = {MTP_SCHEMA_ID: ("MTP draft head", _mtp_command, _mtp_tables),
                  TOKENIZER_SCHEMA_ID: ("tokenizer", _tokenizer_command, _tokenizer_tables),
                  CHAT_PARSERS_SCHEMA_ID: ("chat parsers", _chat_parsers_command, _chat_parsers_tables)}
"""Per receipt schema with a summary page: what is judged, its reproduce command's and tables' functions."""


def _summary_page(rec: dict[str, Any], c: _Ctx) -> Page:
    """The verdict page of an MTP receipt (``harness parity --mtp``), a tokenizer receipt
    (``harness tokenizer``) or a chat-parsers receipt (``harness chat-parsers``): verdict and
    message, the reproduce command, one table of what was compared, provenance and commands. No
    plots and no localization (no kind of them has per-position logit arrays of the trunk)."""
    v, eng = rec["verdict"], rec["engines"]
    mtp = rec.get("schema") == MTP_SCHEMA_ID
    what, cmd_fn, tables_fn = _SUMMARY_KINDS[rec["schema"]]
    title = f"{v} · {what} of {eng['candidate']['name']} on {_model_name(rec)} ({rec['model']['file_type']})"
    page = Page(title, f"verdict-{v}").h(1, title)
    page.p(Badge(v), f" ({rec['kind']}): ", untrusted(rec.get("message") or ""))
    run = cmd_fn(rec, c.ledger_opt)
    counted = "fields compared" if rec["schema"] == CHAT_PARSERS_SCHEMA_ID else "positions compared"
    rows: list[tuple[Inline, Inline]] = [("verdict", [Badge(v), f" — {rec.get('positions', 0)} {counted}"])]
    if rec.get("unmeasured"):
        rows.append(("not measured", untrusted(rec["unmeasured"])))
    if mtp:
        rows.append(("MTP convention", Code(str(rec.get("mtp_convention") or fmt.NA))))
    rows.append(("reproduce", Code(run)))
    page.fields(rows)
    tables_fn(page, rec)
    prompts, th = rec.get("prompts") or rec.get("scripts") or {}, rec.get("thresholds") or {}
    items = prompts.get("items") or rec.get("comparisons") or prompts.get("ids") or []
    units = ("scripts", "fields compared") if rec.get("scripts") and not rec.get("prompts") else ("prompts", "positions")
    shown = {**rec, "prompts": {"id": Path(str(prompts.get("path") or "")).name, "count": len(items), "positions": rec.get("positions"),
                                "sha256": prompts.get("sha256"), "units": units},
             "thresholds": {"file": th.get("file") or (th.get("calibrated") or {}).get("source"), "sha256": th.get("sha256")}}
    _provenance(page, shown, c.receipt_link)
    cmds = {"reproduce the run": run, "re-render this report": _cmd("harness", "report", c.receipt_shown),
            "check the ledger": _cmd("harness", "ledger", "verify", *c.ledger_opt)}
    page.h(2, "Commands").table(["to", "run"], [[k, Code(x)] for k, x in cmds.items()])
    return page


def signoff_row(ledger: str | Path, seq: int) -> dict[str, Any]:
    """Row ``seq`` of ``ledger``, which must be a ``signoff`` row (rows are appended in seq order,
    so row ``seq`` is line ``seq``: only that line is parsed). Raises ``InvalidInput`` naming the
    ledger for a missing ledger or row, or a row of another kind."""
    path = Path(ledger)
    try:
        with path.open(encoding="utf-8") as f:
            line = next((ln for i, ln in enumerate(f, 1) if i == seq), None)
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read the ledger: {e.strerror or e}") from e
    try:
        row = json.loads(line) if line else None
    except ValueError as e:
        raise InvalidInput(f"{path}: line {seq} is not a JSON row: {e}") from e
    if not isinstance(row, dict) or row.get("seq") != seq:
        raise InvalidInput(f"{path}: no row {seq} (harness ledger show --kind signoff lists the sign-offs)")
    if row.get("kind") != "signoff":
        raise InvalidInput(f"{path}: row {seq} is a {untrusted(row.get('kind'))} row, not a sign-off (harness ledger show --kind signoff)")
    return row


def write_signoff_report(ledger: str | Path, seq: int, out_dir: str | Path | None = None) -> Path:
    """The page of sign-off row ``seq`` of ``ledger`` (``harness report --signoff SEQ``):
    ``report.md`` and ``report.html`` in ``out_dir`` (default ``reports/signoff-SEQ/`` beside the
    ledger): the verdict, release, time and chain position, each candidate's build, every cell's
    status with its receipts (linked to their pages), the blocking lines with their commands and
    every receipt relied on. Returns the Markdown path. Raises ``InvalidInput`` (``signoff_row``,
    an unwritable folder)."""
    row = signoff_row(ledger, seq)
    reports = Path(ledger).parent / "reports"
    out = Path(out_dir) if out_dir else reports / f"signoff-{seq}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidInput(f"{out}: cannot create the report folder: {e.strerror or e}") from e
    v = str(row.get("verdict"))
    title = f"{v} · release {untrusted(row.get('release_name'))} (sign-off, ledger row {seq})"
    page = Page(title, f"verdict-{'PASS' if v == 'SIGNED' else 'FAIL'}").h(1, title)
    cells = row.get("cells") or []
    page.fields([("verdict", [Badge(v), f" — {sum(c.get('status') == 'ok' for c in cells)}/{len(cells)} cells ok, "
                                        f"{len(row.get('blocked') or [])} blocking"]),
                 ("signed at", [fmt.when(row.get("time")), " — row ", Code(str(row.get("row_hash") or "")[:12]), ", after ",
                                Code(str(row.get("prev_hash") or "")[:12])])])

    def receipt(rid: Any) -> Inline:
        if not rid:
            return fmt.NA
        md = reports / str(rid)[:16] / REPORT_MD
        return Link(Code(str(rid)[:12]), os.path.relpath(md, out).replace(os.sep, "/")) if md.is_file() else Code(str(rid)[:12])

    page.h(2, "Builds").table(["candidate", "build"], [[Code(untrusted(k)), Code(str(b)[:12])] for k, b in (row.get("builds") or {}).items()])
    page.h(2, "Cells").table(["model", "candidate", "backend", "status", "parity", "probe"],
                             [[untrusted(c.get("model")), untrusted(c.get("candidate")), untrusted(c.get("backend")),
                               "ok" if c.get("status") == "ok" else Badge(str(c.get("status")).upper()), receipt(c.get("parity")), receipt(c.get("probe"))]
                              for c in cells])
    if row.get("blocked"):
        page.h(2, "Blocking").table(["item"], [[untrusted(b)] for b in row["blocked"]])
    page.h(2, "Relied on").table(["receipt", "sha256"], [[receipt(r.get("id")), Code(str(r.get("sha256"))[:16])] for r in row.get("relied_on") or []])
    page.h(2, "Commands").table(["to", "run"], [["check the ledger and every receipt this sign-off names",
                                                 Code(_cmd("harness", "ledger", "verify", *_ledger_opt_for(Path(ledger))))]])
    try:
        md, _ = page.write(out / REPORT_MD, out / REPORT_HTML)
    except OSError as e:
        raise InvalidInput(f"{out}: cannot write the report: {e.strerror or e}") from e
    return md


def _ledger_opt_for(ledger: Path) -> list[str]:
    """``--ledger PATH`` for ``ledger`` unless it is the project's default one."""
    from harness.config import load_config

    try:
        default = Path(load_config().ledger)
    except HarnessError:
        default = None
    return [] if default is not None and ledger.resolve() == default.resolve() else ["--ledger", _shown_path(ledger)]


PAGES = (SCHEMA_ID, PROBE_SCHEMA_ID, MTP_SCHEMA_ID, TOKENIZER_SCHEMA_ID, CHAT_PARSERS_SCHEMA_ID)
"""The receipt schemas ``write_report`` renders (a calibration receipt has no verdict page)."""


# ----------------------------------------------------------------------------- entry point


def _ledger_opt(receipt_json: Path) -> list[str]:
    """``--ledger PATH`` for the ledger beside the receipts, unless it is the default one."""
    from harness.config import load_config

    ledger = receipts_root(receipt_json).parent / "ledger.jsonl"
    try:
        default = Path(load_config().ledger)
    except HarnessError:
        default = None
    if not ledger.exists() or (default is not None and ledger.resolve() == default.resolve()):
        return []
    return ["--ledger", _shown_path(ledger)]


def default_report_dir(receipt_json: Path, receipt_id: str) -> Path:
    """``reports/<id[:16]>/`` beside the receipts folder (either layout: ``receipts_root``)."""
    return receipts_root(receipt_json).parent / "reports" / receipt_id[:16]


def write_report(receipt_path: str | Path, out_dir: str | Path | None = None, localization: dict[str, Any] | None = None, *,
                 explanation: Explanation | None = None) -> Path:
    """Load the receipt at ``receipt_path`` (``load_receipt``) and ``render_report`` it: what
    ``harness report RECEIPT`` writes (a run's own page is written by the evidence door, from the
    receipt it holds). ``explanation`` carries what the caller looked up (vocabulary, localization,
    likely causes: ``harness.runs.explain.explain``); without it the page is rendered from the
    receipt alone, with ``localization`` (a ``Localization.to_dict()``) if given. The reports index
    is the caller's to regenerate (``harness.evidence.index.refresh_index``;
    ``harness.runs.explain.write_explained_report`` does). Raises ``InvalidInput`` for an
    unreadable or invalid receipt or an unwritable folder."""
    loaded = load_receipt(receipt_path)
    return render_report(loaded.receipt, loaded.arrays, loaded.json_path, out_dir,
                         explanation or Explanation(localization=localization))


def render_report(rec: Mapping[str, Any], arrays: Mapping[str, np.ndarray], json_path: Path, out_dir: str | Path | None,
                  ex: Explanation) -> Path:
    """Write ``report.md`` and ``report.html`` (and PNGs, ``localization.json``) for the parity,
    probe, MTP or tokenizer receipt ``rec`` (as written at ``json_path``, with its per-position
    ``arrays``) into ``out_dir`` (default: ``default_report_dir``); return the Markdown path. No
    file is read: the evidence door renders the receipt it has just written. Raises
    ``InvalidInput`` for a receipt kind without a verdict page or an unwritable folder; a folder
    this call created is removed again when nothing could be written into it."""
    rec, arrays = dict(rec), dict(arrays)
    out = Path(out_dir) if out_dir else default_report_dir(json_path, rec["id"])
    if rec.get("schema") not in PAGES:
        raise InvalidInput(f"{json_path}: a {rec.get('schema')} receipt has no verdict page; harness report renders parity, probe, MTP, "
                           "tokenizer and chat-parsers receipts (harness ledger show lists the rows)")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidInput(f"{out}: cannot create the report folder: {e.strerror or e}") from e
    is_probe = rec.get("schema") == PROBE_SCHEMA_ID
    summary = rec.get("schema") in (MTP_SCHEMA_ID, TOKENIZER_SCHEMA_ID, CHAT_PARSERS_SCHEMA_ID)
    loc = ex.localization
    plan = None if summary else (loc or {}).get("plan") or localization_plan(rec)
    try:
        pngs = {} if is_probe or summary else {"positions": plot_positions(rec, arrays, out).name, "margins": plot_margins(rec, arrays, out).name}
        if loc is not None:
            if loc.get("per_layer"):
                pngs["layers"] = plot_layers(loc, out).name
            (out / "localization.json").write_text(json.dumps(loc, indent=1, default=str, allow_nan=False) + "\n", encoding="utf-8")
        ctx = _Ctx(ex, plan, pngs, _receipt_link(json_path, out), _shown_path(json_path), _ledger_opt(json_path))
        page = _summary_page(rec, ctx) if summary else _probe_page(rec, ctx) if is_probe else _parity_page(rec, arrays, ctx)
        md, _ = page.write(out / REPORT_MD, out / REPORT_HTML)
    except BaseException as e:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # no empty report folder left behind
        if isinstance(e, OSError):
            raise InvalidInput(f"{out}: cannot write the report: {e.strerror or e}") from e
        raise
    return md
