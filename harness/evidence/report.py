"""Reports people can look at: a Markdown page and PNG plots (matplotlib) for one parity receipt.

Plots: per-position cosine (with the gate line) and KLD along each prompt; the reference's
top-1/top-2 margin against argmax flips (near-tie vs hard); and, when a localization is given,
the per-layer error profile (max NMSE and min cosine per layer against the bounds).

Every string from the receipt (prompt ids, engine and model names, messages) is escaped for
where it goes: ``display.mathtext`` in plot text, ``display.md_text`` in the Markdown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from harness.display import mathtext as _tx
from harness.display import md_text as _md
from harness.evidence.receipts import load_receipt, per_prompt_rows
from harness.fschecks import require_writable_dir


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_positions(receipt: dict[str, Any], arrays: dict[str, np.ndarray], out: Path) -> Path:
    """Per-position cosine (gate line dashed) and KLD, one panel pair per prompt."""
    plt = _plt()
    prompts = receipt["prompts"]["items"]
    gate = receipt["thresholds"]["gates"]["min_cosine"]["value"]
    n = len(prompts)
    fig, axes = plt.subplots(n, 2, figsize=(12, 2.2 * n + 0.8), squeeze=False)
    pidx, pos = arrays["prompt_index"], arrays["position"]
    for i, p in enumerate(prompts):
        sel = pidx == i
        x = pos[sel]
        cos = arrays["cosine"][sel]
        kld = arrays["kld"][sel]
        ax = axes[i, 0]
        ax.plot(x, cos, lw=0.8, color="tab:blue", label="cosine")
        ax.axhline(gate, ls="--", color="tab:red", lw=1, label=f"gate {gate}")
        bad = ~np.isfinite(cos) | (cos < gate)
        if bad.any():
            ax.scatter(x[bad], np.where(np.isfinite(cos[bad]), cos[bad], gate), color="tab:red", s=12, zorder=3, label="failing")
        ax.set_ylabel("cosine")
        ax.set_title(f"{_tx(p['id'])}: per-position logit cosine", fontsize=9)
        lo = np.nanmin(np.concatenate([cos[np.isfinite(cos)], [gate]])) if np.isfinite(cos).any() else gate
        ax.set_ylim(min(lo, gate) - 0.002, 1.0005)
        ax.legend(fontsize=7, loc="lower left")
        ax2 = axes[i, 1]
        ax2.semilogy(x, np.maximum(kld, 1e-16), lw=0.8, color="tab:green")
        ax2.set_ylabel("KLD (nats)")
        ax2.set_title(f"{_tx(p['id'])}: KL(P_ref || P_cand) per position", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("position (tokens)")
    fig.suptitle(_tx(f"{receipt['engines']['candidate']['name']} vs {receipt['engines']['reference']['name']} on {receipt['model']['name']} — {receipt['gated']['verdict']}"))
    fig.tight_layout()
    path = out / "positions.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_margins(receipt: dict[str, Any], arrays: dict[str, np.ndarray], out: Path) -> Path:
    """Reference top-1/top-2 margin per position, agreeing vs near-tie vs hard flips."""
    plt = _plt()
    margin = arrays["ref_margin"]
    agree = arrays["argmax_agree"].astype(bool)
    ok = np.isfinite(margin)
    thr = receipt["report_only"]["flips"]["near_tie_margin"]
    near = ~agree & (margin < thr) & ok
    hard = ~agree & (margin >= thr) & ok
    x = np.arange(margin.size)
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.scatter(x[agree & ok], margin[agree & ok], s=4, color="tab:gray", alpha=0.5, label=f"argmax agrees ({int((agree & ok).sum())})")
    ax.scatter(x[near], margin[near], s=18, color="tab:orange", label=f"near-tie flip ({int(near.sum())})")
    ax.scatter(x[hard], margin[hard], s=18, color="tab:red", marker="x", label=f"hard flip ({int(hard.sum())})")
    ax.axhline(thr, ls="--", color="tab:orange", lw=1, label=f"near-tie margin {thr}")
    ax.set_yscale("symlog", linthresh=1e-2)
    ax.set_ylim(0, max(float(np.nanmax(margin[ok])) * 1.5 if ok.any() else 1.0, thr * 2))
    ax.set_xlabel("position over the whole prompt set")
    ax.set_ylabel("reference top-1 − top-2 (logits)")
    ax.set_title("reference margin and argmax flips (report-only)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "margins.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layers(localization: dict[str, Any], out: Path) -> Path:
    """Per-layer max NMSE and min cosine of a localization run against its bounds."""
    plt = _plt()
    rows = localization["per_layer"]
    labels = [f"{e['layer']}\n{e['type'][:4]}" if e["layer"] >= 0 else "out" for e in rows]
    nm = [max(e["max_nmse"], 1e-18) for e in rows]
    cos = [1 - e["min_cosine"] for e in rows]
    b = localization["bounds"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    x = np.arange(len(rows))
    a1.bar(x, nm, color="tab:purple")
    a1.axhline(b["max_nmse"], ls="--", color="tab:red", label=f"bound {b['max_nmse']:g}")
    a1.set_yscale("log")
    a1.set_ylabel("max NMSE over the layer's tensors")
    a2.bar(x, np.maximum(cos, 1e-18), color="tab:cyan")
    a2.axhline(1 - b["min_cosine"], ls="--", color="tab:red", label=f"bound 1 − {b['min_cosine']}")
    a2.set_yscale("log")
    a2.set_ylabel("1 − min cosine")
    for a in (a1, a2):
        a.set_xticks(x, labels, fontsize=7)
        a.set_xlabel("layer")
        a.legend(fontsize=8)
    first = localization.get("first_divergence")
    fig.suptitle("per-layer error vs the oracle" + (_tx(f" — first divergence {first['name']} (layer {first['layer']})") if first else ""))
    fig.tight_layout()
    path = out / "layers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_plots(rec: dict[str, Any], arrays: dict[str, np.ndarray], out: Path, localization: dict[str, Any] | None) -> list[Path]:
    """The report's PNGs (and ``localization.json``) in ``out``, checked writable first
    (``InvalidInput``); a folder this call created is removed again when drawing fails."""
    require_writable_dir(out, "report folder")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        pngs = [plot_positions(rec, arrays, out), plot_margins(rec, arrays, out)]
        if localization:
            pngs.append(plot_layers(localization, out))
            (out / "localization.json").write_text(json.dumps(localization, indent=1, default=str))
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # no empty report folder left behind
        raise
    return pngs


def write_report(receipt_path: str | Path, out_dir: str | Path | None = None, localization: dict[str, Any] | None = None) -> Path:
    """Write ``report.md`` and its PNGs for a receipt; return the Markdown path.

    ``out_dir`` defaults to ``reports/<receipt id>/`` beside the receipts directory. Raises
    ``InvalidInput`` for an unreadable or invalid receipt, or an ``out_dir`` that cannot be
    written (checked before any plot is drawn; a folder this call created is removed again when
    it fails).
    """
    loaded = load_receipt(receipt_path)
    rec, arrays = loaded.receipt, loaded.arrays
    out = Path(out_dir) if out_dir else loaded.json_path.parent.parent / "reports" / rec["id"][:16]
    pngs = _draw_plots(rec, arrays, out, localization)
    g, ro = rec["gated"], rec["report_only"]
    th = rec["thresholds"]["gates"]["min_cosine"]
    lines = [
        f"# Parity report: {_md(rec['engines']['candidate']['name'])} vs {_md(rec['engines']['reference']['name'])}",
        "",
        f"**Verdict: {g['verdict']}** — {_md(g.get('message', ''))}",
        "",
        "| | |",
        "|---|---|",
        f"| model | {_md(rec['model']['name'])} ({_md(rec['model']['arch'])}, {_md(rec['model']['file_type'])}), sha256 `{rec['model']['sha256'][:16]}…` |",
        f"| kind | {rec['kind']} |",
        f"| positions | {g['positions']} over {rec['prompts']['count']} prompts (gate needs ≥ {g['min_positions']}) |",
        f"| gate | per-position cosine ≥ {th['value']} (basis: {th['basis']['kind']}) |",
        f"| min cosine | {g['min_cosine_observed']} at {_md(g['min_cosine_where'])} |",
        f"| failing positions | {g['failing_positions']} (first: {_md(g.get('first_failing'))}) |",
        f"| argmax agreement (report-only) | {ro['argmax_agreement']['rate']} [{ro['argmax_agreement']['ci_low']}, {ro['argmax_agreement']['ci_high']}] |",
        f"| flips (report-only) | {ro['flips']['near_tie']} near-tie, {ro['flips']['hard']} hard (margin < {ro['flips']['near_tie_margin']}) |",
        f"| KLD mean (report-only) | {(ro.get('kld') or {}).get('mean')} |",
        f"| receipt | `{rec['id']}` |",
        "",
        "## Per prompt",
        "",
        "| prompt | positions | min cos | mean cos | argmax agr | flips near/hard | KLD mean | failing |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in per_prompt_rows(rec):
        lines.append(f"| {_md(p['id'])} | {p['positions']} | {p.get('min_cosine')} | {p.get('mean_cosine')} | {p.get('argmax_agreement')} | "
                     f"{p.get('near_tie_flips')}/{p.get('hard_flips')} | {p.get('kld_mean')} | {p.get('failing_positions')} |")
    lines += ["", "## Plots", ""]
    for png in pngs:
        lines.append(f"![{png.stem}]({png.name})")
        lines.append("")
    if localization and localization.get("first_divergence"):
        f = localization["first_divergence"]
        lines += ["## First divergence", "", f"Layer {f['layer']} ({_md(f['layer_type'])}), tensor {_md(f['name'])}, position {f['position']}: "
                  f"NMSE {f['nmse']}, cosine {f['cosine']}.", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n")
    return md
