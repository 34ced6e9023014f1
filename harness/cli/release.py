"""``harness ledger …``, ``harness signoff`` and ``harness sweep``: adapters over ``harness.evidence``
and ``harness.release``."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from harness.config import load_config
from harness.display import plain as _p
from harness.errors import InvalidInput
from harness.fschecks import require_writable_file
from harness.cli.app import cli
from harness.cli.render import _console, _echo_json, _render_table, _short, SIGNOFF_STYLES


@cli.group()
def ledger() -> None:
    """The append-only sign-off ledger (evidence/parity/ledger.jsonl, rendered to LEDGER.md)."""


def _default_ledger() -> str:
    """The project's ledger (``[tool.harness] ledger``, else ``<evidence>/parity/ledger.jsonl``)."""
    return str(load_config().ledger)


@ledger.command("verify")
@click.option("--ledger", "ledger_path", default=None, type=click.Path(), help="Default: the project's ledger ([tool.harness] ledger, else <evidence>/parity/ledger.jsonl).")
@click.option("--receipts", default=None, type=click.Path(), help="Receipts dir (default: receipts/ beside the ledger).")
@click.option("--markdown", default=None, type=click.Path(), help="Rendered ledger (default: LEDGER.md of the repo).")
@click.option("--incremental", is_flag=True, help="Check only the rows after the checkpoint (its prefix re-hashed as bytes) and LEDGER.md.")
@click.option("--deep", is_flag=True, help="Also load every receipt (schema, content id, arrays) and match it to its row, ignoring the checkpoint (milliseconds a receipt).")
@click.option("--checkpoint", "checkpoint_path", default=None, type=click.Path(),
              help="Checkpoint file (default: outside the evidence, in $HARNESS_VERIFY_STATE or ~/.local/state/harness/verify/).")
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
def ledger_verify(ledger_path, receipts, markdown, incremental, deep, checkpoint_path, quiet) -> None:
    """Check the hash chain, every row against its receipt, and the rendered pages (exit 1 on any
    problem), streaming the ledger with progress and a rows/s figure. Full (default): every row
    and every receipt's JSON file re-hashed (bytes; the row's receipt_sha256 binds them; the array
    sidecars are not read), every page compared. --incremental: only the rows after the
    checkpoint, their receipts also loaded (arrays included) and matched to their rows. --deep:
    every receipt loaded with its arrays and matched. A verified run saves the
    checkpoint."""
    # deferred: startup
    from harness.evidence.ledger import Checkpoint, VerifyStats, default_checkpoint_path, verify_ledger

    lp = Path(ledger_path or _default_ledger())
    if not lp.exists():
        raise InvalidInput(f"{lp}: no such ledger")
    cp_path = Path(checkpoint_path) if checkpoint_path else default_checkpoint_path(lp)
    cp = None if deep else Checkpoint.load(cp_path)
    if cp is not None and cp.ledger != str(lp.resolve()):
        raise InvalidInput(f"{cp_path}: is the checkpoint of {_p(cp.ledger)}, not of {lp.resolve()}")
    err = _console(stderr=True)

    def progress(rows: int, done: int, total: int) -> None:
        if not quiet:
            err.print(Text(f"verify: {rows} rows, {done / max(total, 1):.0%} of {total / 1e6:.1f} MB"))

    st = VerifyStats()
    inc = incremental and cp is not None
    problems = verify_ledger(lp, Path(receipts) if receipts else lp.parent / "receipts", markdown, deep=deep or inc, checkpoint=cp,
                             incremental=inc, progress=progress, stats=st)
    rate = f"{st.rows} rows in {st.seconds:.2f} s ({st.rows_per_s:,.0f} rows/s; {st.receipts} receipts hashed, {st.deep} loaded and matched"
    rate += f"; {st.skipped} rows vouched for by the checkpoint)" if st.skipped else ")"
    if problems:
        for p in problems:
            click.echo(_p(p))
        click.echo(_p(f"ledger {lp}: {len(problems)} problem(s); {rate}"))
        sys.exit(1)
    held = Checkpoint(str(lp.resolve()), st.seq, st.row_hash, st.offset, st.prefix_sha256)
    if st.prefix_sha256:
        held.save(cp_path)
    elif inc and cp is not None:  # no row after the checkpoint: it still holds, and is what CI keeps
        held = cp
    mode = "incremental" if inc else "full"
    click.echo(_p(f"ledger {lp}: OK ({held.seq} rows, chain and receipts verified, {mode}); {rate}"))
    click.echo(_p(f"checkpoint: seq {held.seq} row_hash {held.row_hash} prefix_sha256 {held.prefix_sha256} ({held.offset} bytes) -> {cp_path}"))


@ledger.command("render")
@click.option("--ledger", "ledger_path", default=None, type=click.Path(), help="Default: the project's ledger.")
def ledger_render(ledger_path) -> None:
    """Rewrite every page of LEDGER.md and of the reports index from the ledger (after a
    migration, or to repair a rendering); appends re-render only the pages they change."""
    # deferred: startup
    from harness.evidence.index import refresh_index
    from harness.evidence.ledger import ledger_lock, markdown_path_for, render_pages

    lp = Path(ledger_path or _default_ledger())
    if not lp.exists():
        raise InvalidInput(f"{lp}: no such ledger")
    md = markdown_path_for(lp)
    require_writable_file(str(lp) + ".lock", "ledger lock file")  # a read-only evidence folder: one INVALID line, as for parity
    require_writable_file(md, "rendered ledger", replace=True)
    try:
        with ledger_lock(lp, 120):
            written = render_pages(lp, md, full=True)
        index_md, _ = refresh_index(lp, full=True)
    except OSError as e:
        raise InvalidInput(f"{lp}: cannot render the ledger: {e.strerror or e}") from None
    click.echo(_p(f"rendered {len(written)} page(s): {md}; index {index_md}"))


@ledger.command("migrate-receipts")
@click.option("--ledger", "ledger_path", default=None, type=click.Path(), help="Default: the project's ledger.")
def ledger_migrate_receipts(ledger_path) -> None:
    """Move receipts of the flat layout (receipts/ID.json) into their shards (receipts/ID[:2]/);
    the flat layout is still read, so this is optional. Rows stay valid (they hash bytes, not paths)."""
    # deferred: startup
    from harness.evidence.receipts import migrate_receipts

    lp = Path(ledger_path or _default_ledger())
    if not lp.exists():
        raise InvalidInput(f"{lp}: no such ledger")
    moved, kept = migrate_receipts(lp.parent / "receipts")
    click.echo(_p(f"receipts: {moved} moved into shards" + (f", {kept} left in place (a different file of that name is in the shard)" if kept else "")))


@ledger.command("index")
@click.option("--ledger", "ledger_path", default=None, type=click.Path(), help="Default: the project's ledger.")
def ledger_index(ledger_path) -> None:
    """Regenerate reports/index.md and index.html beside the ledger (every receipt, newest first).
    Runs after every append and report anyway; the ledger stays the record."""
    # deferred: startup
    from harness.evidence.index import refresh_index

    lp = Path(ledger_path or _default_ledger())
    if not lp.exists():
        raise InvalidInput(f"{lp}: no such ledger")
    md, html = refresh_index(lp)
    click.echo(f"index: {md}")
    click.echo(f"html:  {html}")


LEDGER_KINDS = ("parity", "self-consistency", "probe", "mtp", "calibration", "tokenizer", "chat-parsers", "discharge", "supersede", "signoff")
"""The row kinds ``ledger show --kind`` takes: ``harness.evidence.rows.KINDS`` (spelled out so that
``harness --help`` does not import the evidence package; a test keeps the two equal)."""


@ledger.command("show")
@click.option("--ledger", "ledger_path", default=None, type=click.Path(), help="Default: the project's ledger.")
@click.option("--candidate", default=None, help="Only rows whose candidate contains this (e.g. oracle, mutant:, command:NAME).")
@click.option("--model", default=None, help="Only rows whose model or quant contains this.")
@click.option("--kind", type=click.Choice(LEDGER_KINDS), default=None, help="Only rows of this kind.")
@click.option("--since", default=None, metavar="DATE", help="Only rows at or after this UTC date or ISO time.")
@click.option("--verdict", default=None, type=click.Choice(["PASS", "FAIL", "UNMEASURED"], case_sensitive=False), help="Only rows with this verdict.")
@click.option("--rows", "show_rows", is_flag=True, help="One line per ledger row (newest first) instead of trends per candidate.")
@click.option("--format", "fmt_", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="table for people (at most 120 columns; ids and numbers never cut); csv or json, unrounded, for machines.")
@click.option("--json", "as_json", is_flag=True, hidden=True, help="Same as --format json.")
def ledger_show(ledger_path, candidate, model, kind, since, verdict, show_rows, fmt_, as_json) -> None:
    """Trends per candidate (runs, last and worst results) or the rows themselves, filtered;
    prints proposed report-only thresholds once 20 records exist."""
    # deferred: startup (pandas)
    from harness.evidence.ledger_view import LedgerView

    lp = Path(ledger_path or _default_ledger())
    if not lp.exists():
        raise InvalidInput(f"{lp}: no such ledger")
    view = LedgerView.load(lp, candidate=candidate, model=model, kind=kind, since=since, verdict=verdict)
    fmt_ = "json" if as_json else fmt_
    if fmt_ != "table" and view.cache_line():  # machines read stdout; the note goes to stderr
        click.echo(_p(f"harness: {view.cache_line()}"), err=True)
    if fmt_ == "json":
        _echo_json(view.to_json())
    elif fmt_ == "csv":
        click.echo(view.to_csv(show_rows), nl=False)
    else:
        view.print(_console(width=120), show_rows)


@ledger.command("merge")
@click.argument("folders", nargs=-1, required=True, type=click.Path())
@click.option("--ledger", "ledger_path", default=None, type=click.Path(), help="The ledger to merge into (default: the project's).")
def ledger_merge(folders, ledger_path) -> None:
    """Bring receipts made on other hosts into this ledger: each FOLDER is a host's evidence
    folder (FOLDER/parity/ledger.jsonl), a ledger's folder or a ledger file. Sources are verified,
    receipts deduplicated by id (an existing id must match byte for byte, else refused) and
    appended in a deterministic order; merging twice adds nothing (exit 2, nothing written, on refusal)."""
    # deferred: startup
    from harness.evidence.merge import merge_ledgers

    res = merge_ledgers(ledger_path, list(folders))
    for row in res.appended:
        click.echo(_p(f"appended row {row['seq']}: {row['kind']} {row.get('candidate') or ''} on {row.get('model') or ''} "
                      f"{row.get('verdict') or ''} (receipt {row['receipt_id'][:12]})"))
    click.echo(_p(f"merged {len(res.sources)} ledger(s): {len(res.appended)} receipt(s) appended, {res.already} already here"))


@ledger.command("engines-page")
@click.option("--ledger", "ledger_path", default="evidence/engines/ledger.jsonl", show_default=True, type=click.Path(),
              help="The ledger of the engine conformance runs (receipts beside it).")
@click.option("--out", default="docs/engines.md", show_default=True, type=click.Path(dir_okay=False), help="Where to write the page.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 when OUT differs from the regeneration.")
@click.option("--refresh", is_flag=True, help="First make fresh rows in LEDGER for every engine of the page this machine has "
              "(a parity run per model and class, its probe runs), then write the page.")
@click.option("--engine", "engines", multiple=True, help="With --refresh: only this engine (repeatable).")
@click.option("--model", "models", multiple=True, help="With --refresh: only this model spec (repeatable).")
@click.option("--dry-run", is_flag=True, help="With --refresh: list the runs, run nothing, write nothing.")
def ledger_engines_page(ledger_path, out, check, refresh, engines, models, dry_run) -> None:
    """Regenerate docs/engines.md, the conformance page of the real engines the harness judges
    (engine x model x compute class: verdicts, numbers, serving scenarios, the thresholds rows that
    judged them, unmeasured cells with their reason, pitfalls)."""
    # deferred: startup
    from harness.evidence import engines_page

    if refresh:
        _refresh_engines_page(ledger_path, out, engines, models, dry_run)
        return
    text = engines_page.render(ledger_path, shown_ledger=ledger_path)
    if check:
        current = Path(out).read_text() if Path(out).is_file() else None
        if current != text:
            click.echo(_p(f"{out} differs from its regeneration from {ledger_path}: run harness ledger engines-page --ledger {ledger_path} --out {out}"))
            sys.exit(1)
        click.echo(_p(f"{out}: equals its regeneration from {ledger_path}"))
        return
    engines_page.write(ledger_path, out)
    click.echo(_p(f"wrote {out} from {ledger_path}"))


def _refresh_engines_page(ledger_path: str, out: str, engines: tuple[str, ...], models: tuple[str, ...], dry_run: bool) -> None:
    """``engines-page --refresh``: ``harness.release.engines_refresh.refresh``, its progress and outcome printed."""
    from harness.release import engines_refresh

    res = engines_refresh.refresh(ledger_path, out, engines, models, dry_run, log=lambda line: click.echo(_p(line)))
    for line in res.skipped:
        click.echo(_p(f"skipped {line}"))
    failed = [(r, rc) for r, rc, _ in res.runs if rc not in (0, 1, 5)]
    for r, rc in failed:
        click.echo(_p(f"no fresh row: {r.what} exited {rc}; rerun: harness {' '.join(r.argv)}"))
    total = sum(s for _, _, s in res.runs)
    if res.page is not None:
        click.echo(_p(f"{len(res.runs)} runs in {total:.0f} s ({len(failed)} without a fresh row); wrote {res.page} from {ledger_path}"))


@cli.command()
@click.argument("manifest", type=click.Path())
@click.option("--ledger", default=None, type=click.Path(), help="Ledger the cells' rows are read from and the sign-off row goes to (default: the project's).")
@click.option("--evidence-dir", "discharge_dir", default=None, type=click.Path(), help="Discharge records (default: the project's <evidence>/discharge).")
@click.option("--no-record", is_flag=True, help="Judge only; append no sign-off row.")
@click.option("--json", "as_json", is_flag=True, help="Print the sign-off as JSON.")
def signoff(manifest, ledger, discharge_dir, no_record, as_json) -> None:
    """Sign off a release: for the exact candidate builds of MANIFEST, every pin, lint on every
    model, every contract obligation the candidate's capabilities allow and every cell's parity
    and probe receipts; appends a signoff row (SIGNED, or BLOCKED naming what is missing, stale or
    failed and the command that makes it). Exit 0 signed, 1 blocked by a failure or stale
    evidence, 5 blocked only by missing or unmeasured cells, 2 invalid manifest."""
    # deferred: startup
    from harness.release.manifest import load_manifest, manifest_dict
    from harness.release.signoff import signoff as run

    m = load_manifest(manifest)
    so = run(m, ledger, discharge_dir, record=not no_record)
    if as_json:
        _echo_json({"manifest": manifest_dict(m), "verdict": so.verdict, "exit_code": so.exit_code, "builds": so.builds,
                    "items": [vars(i) for i in so.items], "cells": [vars(c) for c in so.cells], "relied_on": so.relied_on,
                    "moved": so.moved, "supersedes": so.superseding, "row": so.row})
        sys.exit(so.exit_code)
    _render_table(f"release {m.release}: cells", ("model", "candidate", "backend", "status", "parity", "probe"),
                  [(c.model, c.candidate, c.backend, c.status, (c.parity or "-")[:12], (c.probe or "-")[:12]) for c in so.cells], SIGNOFF_STYLES,
                  keys=3, fold=())
    if so.blocking:
        _render_table(f"release {m.release}: blocking", ("status", "what", "which", "detail", "command"),
                      [(i.status, i.what, i.label, _short(i.detail, 200), i.command or "-") for i in so.blocking], SIGNOFF_STYLES,
                      keys=3, fold=("what", "detail"))
    for cell in so.moved:
        click.echo(_p(f"judged by rows that moved since: {cell['cell']} receipt {cell['receipt_id'][:12]}: {cell['what']}; "
                      f"re-judge: {cell['command']}"))
    for sup in so.superseding:
        click.echo(_p(f"{'superseded' if so.row else 'would supersede'} row {sup['seq']}: {sup['reason']}"))
    na = [i for i in so.items if i.status == "n/a"]
    if na:
        click.echo(_p(f"not applicable: {len(na)} obligation(s), e.g. {na[0].label}: {na[0].detail}"))
    for name, build in so.builds.items():
        click.echo(_p(f"build {name}: {build[:12]}"))
    n_ok = sum(i.status == "ok" for i in so.items)
    click.echo(_p(f"{so.verdict}: release {m.release}: {n_ok} ok, {len(so.blocking)} blocking, {len(na)} n/a"
                  + (f"; ledger row {so.row['seq']} ({so.row['row_hash'][:12]})" if so.row else "")))
    sys.exit(so.exit_code)


@cli.command()
@click.argument("manifest", type=click.Path())
@click.option("--ledger", default=None, type=click.Path(), help="Ledger to record into (default: the project's; receipts go beside it).")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(1, 256), help="Cells run at once (local processes, or Ray's num_cpus); llama.cpp's threads are divided among them.")
@click.option("--ray", "ray_address", default=None, is_flag=False, flag_value="", metavar="[ADDRESS]",
              help="Run cells as Ray tasks (pip install qwen35-harness[dist]); without ADDRESS Ray starts locally (no dashboard, no usage stats, num_cpus = --jobs).")
def sweep(manifest, ledger, jobs, ray_address) -> None:
    """Run every cell of MANIFEST that has no current receipt (same model, builds, settings,
    class, backend, thresholds, prompts and harness numbers), recording receipts and ledger rows
    in the manifest's order. Resumable: a re-run skips what exists and adds the row of a receipt
    written before an interruption. Exit: the worst verdict of the runs."""
    # deferred: startup
    from harness.release.manifest import load_manifest
    from harness.release.sweep import LocalExecutor, RayExecutor
    from harness.release.sweep import sweep as run

    m = load_manifest(manifest)
    executor = RayExecutor(ray_address or None, jobs) if ray_address is not None else LocalExecutor(jobs)
    con = _console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=con) as bar:
        task = bar.add_task("cells", total=None)

        def done(o, n, total) -> None:
            bar.update(task, completed=n, total=total)
            rid = f" receipt {o.receipt_id[:12]}" if o.receipt_id else ""
            bar.console.print(_p(f"[{n}/{total}] {o.run.label}: {o.status} {o.verdict or ''}{rid}"
                                 + (f" ({o.seconds:.1f} s)" if o.status == "ran" else "") + (f": {_short(o.message)}" if o.status == "error" else "")),
                              markup=False, highlight=False)

        res = run(m, ledger, executor, jobs, done)
    _render_table(f"sweep {m.release}", ("run", "status", "verdict", "receipt", "seq", "seconds"),
                  [(o.run.label, o.status, o.verdict or "-", (o.receipt_id or "-")[:12], str(o.seq or "-"), f"{o.seconds:.1f}") for o in res.outcomes],
                  fold=(), right=("seq", "seconds"))
    counts = {s: sum(o.status == s for o in res.outcomes) for s in ("ran", "current", "adopted", "error")}
    click.echo(_p(f"{res.verdict.value}: {len(res.outcomes)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items())
                  + f"; ledger {res.ledger}; next: harness signoff {manifest}"))
    sys.exit(res.verdict.exit_code)
