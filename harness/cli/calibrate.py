"""``harness calibrate``: adapters over ``harness.runs.calibrate`` and ``harness.runs.subject``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from harness.display import plain as _p
from harness.display import print_table
from harness.errors import HarnessError
from harness.fschecks import require_writable_file
from harness.cli.app import cli
from harness.cli.render import _console, _echo_json
from harness.cli.runs import _parity_defaults


@cli.command()
@click.option("--model", "subject", default=None, metavar="SPEC",
              help="Measure the calibrated tier on this model itself (with --class) and record it; without it, calibrate every row.")
@click.option("--class", "compute_class", default="f32", show_default=True, type=click.Choice(["f64", "f32", "bf16", "f16", "mixed"]),
              help="With --model: the compute class to measure.")
@click.option("--base-model", default="fixture:trained-qwen35", show_default=True, help="F32 trained model: the mutants run on it.")
@click.option("--moe-model", default="fixture:trained-qwen35moe", show_default=True)
@click.option("--ladder", multiple=True, help="Models for the file-type rows (default: every shipped file type of the 256-wide trained bases).")
@click.option("--classes", multiple=True, type=click.Choice(["f64", "f32", "bf16", "f16", "mixed"]), help="Classes to measure (default: all).")
@click.option("--max-tokens", default=None, type=int,
              help="Tokens per prompt (default: whole prompts on the F32 trained models, as parity judges them; 128 with --model; 256 with --topk).")
@click.option("--ladder-max-tokens", default=None, type=int, help="Tokens per prompt on the file-type ladder (default: whole prompts).")
@click.option("--mutant", "mutants", multiple=True, help="Only these mutants (default: all).")
@click.option("--ledger", default=None, type=click.Path(), help="With --model: the ledger the calibration receipt and row go to.")
@click.option("--out", default="thresholds.yaml", show_default=True, type=click.Path(), help="Where to write the measured thresholds.")
@click.option("--matrix-out", default="docs/gates-matrix.md", show_default=True, type=click.Path(), help="Where to write the per-class mutant matrix.")
@click.option("--dry-run", is_flag=True, help="Measure and print; do not write.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--topk", "topk_k", default=None, type=click.IntRange(1, 1000), metavar="K",
              help="Measure only the top-k rows (http:NAME candidates) for K logprobs per position, on the F32 trained models, "
                   "for --classes (default f64, f32), and merge them into --out.")
@click.option("--probes", "probes_only", is_flag=True,
              help="Measure only the probe tolerances (each class's own split/decode floor on --base-model, llama.cpp's own on a "
                   "file of each quantized weights key in --out, the MoE excursion allowance on --moe-model) for --classes (default: all) and merge them into --out, keeping every other number.")
@click.option("--mtp", "mtp_only", is_flag=True,
              help="Measure only the MTP rows (the calibrated tier of `harness parity --mtp`) for --classes (default f64, f32) "
                   "on the MTP fixtures, every MTP mutant as known-bad, and merge them into --out, keeping every other number.")
@click.option("--state", "state_only", is_flag=True,
              help="Measure only the state probe's rows (each class's known-good engines against themselves on fixture:state-qwen35, "
                   "the precision mutants as known-bad) for --classes (default: f64, f32, bf16, f16) and merge them into --out.")
@click.option("--speculative", "spec_only", is_flag=True,
              help="Measure only the speculative probe's acceptance gate (probes.spec_max_acceptance_drop and its declared "
                   "probes.spec_min_reference_accepted) on the trained MTP fixtures' calibration code prompts, and merge it into --out.")
@click.option("--mtp-model", "mtp_models", multiple=True, metavar="SPEC", help="With --mtp: the models (default: the MTP fixtures).")
def calibrate(subject, compute_class, base_model, moe_model, ladder, classes, max_tokens, ladder_max_tokens, mutants, ledger, out, matrix_out,
              dry_run, as_json, topk_k, probes_only, mtp_only, mtp_models, state_only, spec_only) -> None:
    """Measure known-good and known-bad pairs and write thresholds.yaml (one row per weights key x
    compute class, exit 1 writing nothing when a good pair spreads past its row or a mutant passes
    every gate); with --model, measure one row on that model and record it as evidence; with
    --topk K, measure only the top-k rows and merge them into thresholds.yaml; with --probes, only
    the probe tolerances; with --mtp, only the MTP draft head's rows; with --state, only the state
    probe's rows; with --speculative, only the speculative probe's acceptance gate. Long because it
    is the full calibration's steps after the dispatch to each partial mode."""
    if spec_only:
        _calibrate_spec(out, dry_run, as_json)
        return
    if state_only:
        _calibrate_state(tuple(classes) or None, out, dry_run, as_json)
        return
    if mtp_only:
        _calibrate_mtp(tuple(mtp_models) or None, tuple(classes) or None, tuple(mutants) or None, max_tokens, out, dry_run, as_json)
        return
    if probes_only:
        _calibrate_probes(tuple(classes) or None, base_model, moe_model, out, dry_run, as_json)
        return
    if topk_k:
        _calibrate_topk(topk_k, tuple(classes) or None, (base_model, moe_model), tuple(mutants) or None, max_tokens or 256, out, dry_run, as_json)
        return
    if subject:
        _calibrate_subject(subject, compute_class, max_tokens or 128, ledger, as_json)
        return
    # deferred: startup
    from harness.evidence.receipts import harness_info
    from harness.runs.calibrate import CalibrationPlan, CalibrationRefused, write_calibration
    from harness.runs.calibrate import calibrate as run

    if not dry_run:
        require_writable_file(out, "thresholds file", replace=True)  # before the measurements are spent
    plan = CalibrationPlan(base_model=base_model, moe_model=moe_model, mutants=tuple(mutants) or None,
                           ladder=tuple(ladder) or None, classes=tuple(classes) or CalibrationPlan.classes,
                           max_tokens=max_tokens, ladder_max_tokens=ladder_max_tokens)
    con = _console(stderr=True)
    res = run(plan, log=lambda m: con.print(_p(m), markup=False))
    if as_json:
        _echo_json({"goods": [g.to_dict() for g in res.goods], "bads": [b.to_dict() for b in res.bads],
                    "rows": [{k: v for k, v in r.items() if k != "goods"} for r in res.rows], "probes": res.probes,
                    "localization": res.localization, "matrix": res.matrix, "class_matrix": res.class_matrix,
                    "moe_excursions": res.moe_excursions, "skipped": res.skipped, "problems": res.problems})
    else:
        _render_calibration(res)
    if res.problems:
        raise CalibrationRefused("calibration refused: " + "; ".join(res.problems))
    if not dry_run:
        written, matrix = write_calibration(res, out, matrix_out, "harness " + " ".join(sys.argv[1:]), harness_info().get("git_commit"))
        click.echo(_p(f"wrote {written}"))
        click.echo(_p(f"wrote {matrix}"))


def _calibrate_topk(k, classes, models, mutants, max_tokens, out, dry_run, as_json) -> None:
    """``harness calibrate --topk K``: the top-k rows only (``gates.calibrate.calibrate_topk``)."""
    # deferred: startup
    from harness.evidence.receipts import harness_info
    from harness.runs.calibrate import TOPK_CLASSES, calibrate_topk, merge_topk_rows

    if not dry_run:
        require_writable_file(out, "thresholds file", replace=True)
    con = _console(stderr=True)
    command = "harness " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else f"harness calibrate --topk {k}"
    rows = calibrate_topk(k, classes or TOPK_CLASSES, [m for m in models if m], mutants, max_tokens,
                          log=lambda m: con.print(_p(m), markup=False), command=command, commit=harness_info().get("git_commit"))
    if as_json:
        _echo_json(rows)
    if not dry_run:
        merge_topk_rows(out, rows)
        click.echo(f"wrote {len(rows)} top-k row(s) to {out}")


def _calibrate_mtp(models, classes, mutants, max_tokens, out, dry_run, as_json) -> None:
    """``harness calibrate --mtp``: the ``mtp:`` rows only (``harness.runs.calibrate.mtp.calibrate_mtp``)."""
    # deferred: startup
    from harness.evidence.receipts import harness_info
    from harness.runs.calibrate.mtp import MTP_KNOWN_GOOD, MTP_MAX_TOKENS, MTP_MODELS, calibrate_mtp, merge_mtp_rows, refuse

    if not dry_run:
        require_writable_file(out, "thresholds file", replace=True)  # before the measurements are spent
    con = _console(stderr=True)
    command = "harness " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else "harness calibrate --mtp"
    res = calibrate_mtp(models or MTP_MODELS, classes or tuple(MTP_KNOWN_GOOD), mutants, max_tokens or MTP_MAX_TOKENS, command,
                        harness_info().get("git_commit"), log=lambda m: con.print(_p(m), markup=False))
    if as_json:
        _echo_json({"goods": [g.to_dict() for g in res.goods], "bads": [b.to_dict() for b in res.bads], "rows": res.rows,
                    "caught": res.caught, "problems": res.problems})
    else:
        for label, c in res.caught.items():
            by = [g for g, hit in c.items() if hit]
            click.echo(_p(f"{label}: " + (f"caught by {', '.join(by)}" if by else "NOT caught")))
    refuse(res)
    if not dry_run:
        merge_mtp_rows(out, res.rows)
        click.echo(f"wrote {len(res.rows)} MTP row(s) to {out}")


def _calibrate_state(classes, out, dry_run, as_json) -> None:
    """``harness calibrate --state``: the ``state:`` rows only (``harness.runs.calibrate.state.calibrate_state``)."""
    # deferred: startup
    from harness.evidence.receipts import harness_info
    from harness.runs.calibrate.state import STATE_KNOWN_GOOD, calibrate_state, merge_state_rows, refuse

    if not dry_run:
        require_writable_file(out, "thresholds file", replace=True)  # before the measurements are spent
    con = _console(stderr=True)
    command = "harness " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else "harness calibrate --state"
    res = calibrate_state(classes or tuple(STATE_KNOWN_GOOD), command=command, commit=harness_info().get("git_commit"),
                          log=lambda m: con.print(_p(m), markup=False))
    if as_json:
        _echo_json({"goods": {c: [g.to_dict() for g in gs] for c, gs in res.goods.items()}, "bads": [b.to_dict() for b in res.bads],
                    "rows": res.rows, "skipped": res.skipped, "problems": res.problems})
    else:
        for b in res.bads:
            click.echo(_p(f"{b.label}: min cosine {b.min_cosine:.10f}, max KLD {b.max_kld:.3g}"))
    refuse(res)
    if not dry_run:
        merge_state_rows(out, res.rows)
        click.echo(f"wrote {len(res.rows)} state row(s) to {out}")


def _calibrate_spec(out, dry_run, as_json) -> None:
    """``harness calibrate --speculative``: the acceptance gate's rows only (``harness.runs.calibrate.spec``)."""
    # deferred: startup
    from harness.evidence.receipts import harness_info
    from harness.runs.calibrate.spec import calibrate_speculative, merge_spec_rows, refuse

    if not dry_run:
        require_writable_file(out, "thresholds file", replace=True)  # before the measurements are spent
    con = _console(stderr=True)
    command = "harness " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else "harness calibrate --speculative"
    res = calibrate_speculative(command=command, commit=harness_info().get("git_commit"), log=lambda m: con.print(_p(m), markup=False))
    if as_json:
        _echo_json({"goods": res.goods, "bads": res.bads, "rows": res.rows, "problems": res.problems})
    refuse(res)
    if not dry_run:
        merge_spec_rows(out, res.rows)
        click.echo(f"wrote probes.spec_max_acceptance_drop = {res.rows['spec_max_acceptance_drop']['value']:g} and "
                   f"probes.spec_min_reference_accepted = {res.rows['spec_min_reference_accepted']['value']} to {out}")


def _calibrate_probes(classes, base_model, moe_model, out, dry_run, as_json) -> None:
    """``harness calibrate --probes``: the probe tolerances only (``gates.calibrate.calibrate_probes``)."""
    # deferred: startup
    from harness.evidence.receipts import harness_info
    from harness.runs.calibrate import calibrate_probes, merge_probe_rows, section_rows

    if not dry_run:
        require_writable_file(out, "thresholds file", replace=True)
    con = _console(stderr=True)
    classes = classes or ("f64", "f32", "bf16", "f16", "mixed")
    probes, ex, by_weights = calibrate_probes(base_model, moe_model or None, classes, log=lambda m: con.print(_p(m), markup=False),
                                              rows=section_rows(out, "calibrated"))
    if as_json:
        _echo_json({"probes": probes, "moe_excursions": ex, "by_weights": by_weights})
    else:
        for cls, p in probes.items():
            click.echo(f"class {cls}: probe min cosine {p['min_cosine']['value']} (floor {p['min_cosine']['floor']:.10f}), "
                       f"max KLD {p['max_kld']['value']:g} (floor {p['max_kld']['floor']:.3g})")
        for weights, per in by_weights.items():
            for cls, p in per.items():
                click.echo(f"weights {_p(weights)}, class {cls}: probe min cosine {p['min_cosine']['value']} "
                           f"(floor {p['min_cosine']['floor']:.10f}), max KLD {p['max_kld']['value']:g} (floor {p['max_kld']['floor']:.3g})")
        if ex:
            click.echo(f"MoE excursions: {ex['value']} positions (known-good worst {ex['floor']} on {_p(str(ex['model']))})")
    if not dry_run:
        command = "harness " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else "harness calibrate --probes"
        merge_probe_rows(out, probes, ex, command, base_model, harness_info().get("git_commit"), by_weights)
        click.echo(f"wrote the probe tolerances of {len(probes)} class(es) to {out}")


def _render_calibration(res) -> None:
    from harness.runs.calibrate import GATES  # deferred: startup

    print_table(_console(), "known-bad pairs x gates at f64 (X = caught)", ("known-bad pair", *GATES),
                [(label, *("X" if row[g] else "." for g in GATES)) for label, row in res.matrix.items()])
    print_table(_console(), "calibrated rows (weights x class)", ("weights", "class", "file types", "min cosine", "KLD mean", "KLD p99", "pairs"),
                [(r["weights"], r["class"], ", ".join(r["file_types"]), r["gates"]["min_cosine"]["value"], f"{r['gates']['max_kld_mean']['value']:.2g}",
                  f"{r['gates']['max_kld_p99']['value']:.2g}", len(r["goods"])) for r in res.rows],
                keys=2, fold=("file types",), right=("min cosine", "KLD mean", "KLD p99", "pairs"))
    for cls, col in res.class_matrix.items():
        below = [m for m, v in col.items() if v.startswith("below")]
        click.echo(f"class {cls}: {len(col) - len(below)} of {len(col)} mutants caught" + (f"; below the class floor: {', '.join(below)}" if below else ""))
    for s_ in res.skipped:
        click.echo(f"skipped: {s_}")


def _calibrate_subject(spec: str, compute_class: str, max_tokens: int, ledger: str | None, as_json: bool) -> None:
    # deferred: startup
    from harness.runs.subject import describe_row, measure_and_record

    con = _console(stderr=True)
    row, rid, path = measure_and_record(spec, compute_class, ledger or _parity_defaults()["ledger"], ["harness", *sys.argv[1:]],
                                        max_tokens, log=lambda m: con.print(m, markup=False))
    if as_json:
        _echo_json({"receipt": str(path), "id": rid, "row": row.to_receipt()})
        return
    click.echo(f"calibrated tier for {spec} ({row.weights}, class {compute_class}): {describe_row(row)}")
    click.echo(f"receipt: {path}")


@cli.group()
def thresholds() -> None:
    """Thresholds files: what a re-calibration moved."""


@thresholds.command("diff")
@click.argument("old", type=click.Path())
@click.argument("new", type=click.Path())
@click.option("--min-change", default=0.10, show_default=True, type=click.FloatRange(0.0, None),
              help="List the gates whose change is above this share (on 1 - value for a cosine bound).")
@click.option("--json", "as_json", is_flag=True, help="Every moved gate, every added and removed row, as JSON.")
def thresholds_diff(old, new, min_change, as_json) -> None:
    """Compare two thresholds files row by row (rows matched by section, weights, class, architectures
    and k, not by position): the gates that moved by more than --min-change, with the calibration that
    measured each, and the rows only one file has. A report: exit 0 unless a file cannot be read (2)."""
    # deferred: startup
    from harness.judge.thresholds import load_thresholds
    from harness.judge.thresholds_diff import diff_thresholds, key_text

    d = diff_thresholds(load_thresholds(old), load_thresholds(new))
    past = d.past(min_change)
    if as_json:
        _echo_json({"old": str(old), "new": str(new), "min_change": min_change, "rows_compared": d.rows_compared,
                    "moved": [m.to_dict() for m in d.moved], "past_min_change": len(past), "added": d.added, "removed": d.removed})
        return
    click.echo(_p(f"{d.rows_compared} rows in both files; {len(d.moved)} gate(s) moved, {len(past)} by more than "
                  f"{min_change:.0%}; {len(d.added)} row(s) added, {len(d.removed)} removed"))
    if past:
        print_table(_console(), f"gates moved by more than {min_change:.0%}",
                    ("row", "weights x class (archs)", "gate", "old", "new", "change", "measured by"),
                    [(m.new_label + (f" (was {m.old_label})" if m.old_label != m.new_label else ""), key_text(m.key).split(" ", 1)[-1],
                      m.gate, str(m.old), str(m.new), "new" if m.change == float("inf") else f"{m.change:.0%}",
                      f"{m.command or 'declared'} ({m.date or '?'})") for m in past],
                    right=("old", "new", "change"), fold=("weights x class (archs)", "measured by"))
    for what, names in (("added", d.added), ("removed", d.removed)):
        for name in names:
            click.echo(_p(f"{what}: {name}"))

