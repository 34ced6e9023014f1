"""``harness parity`` (and ``--mtp``), ``probe``, ``tokenizer``, ``chat-parsers``, ``localize`` and ``report``: options in,
a run of ``harness.runs`` out, its outcome rendered."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.text import Text

from harness.config import DEFAULT_CANDIDATE, DEFAULT_REFERENCE, load_config
from harness.display import markup as _m
from harness.display import plain as _p
from harness.display import print_table
from harness.errors import InvalidInput, Verdict
from harness.fschecks import require_writable_dir, require_writable_file
from harness.cli.app import override_option, cli
from harness.cli.render import _console, _echo_json, _stderr_log, _with_progress


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


def parity_title(rec: dict[str, Any]) -> str:
    """The parity table's title: ``parity: CANDIDATE vs REFERENCE on MODEL (F32 weights, bf16
    compute)``: the GGUF's file type and the candidate's compute class (``gated.compute_class``,
    "class not recorded" in receipts of one tier), so an f32 run and a bf16 run read apart."""
    from harness.engines.options import engine_label  # deferred: startup

    cls = rec.get("gated", {}).get("compute_class")
    return (f"parity: {engine_label(rec['engines']['candidate'])} vs {engine_label(rec['engines']['reference'])} on {rec['model']['name']} "
            f"({rec['model']['file_type']} weights, {cls + ' compute' if cls else 'class not recorded'})")


def verdict_tail(verdict: Verdict, message: str, gated: dict[str, Any]) -> str:
    """What the verdict line adds to the two tier lines printed above it: for a PASS, only each
    tier's status (``release gate ok, calibrated tier ok``; the message is those two lines
    again; a top-k cell's: the top-k tier's status, which judged it), else the message itself (a
    FAIL's is its reproducer, an UNMEASURED's its reason)."""
    rel, cal, topk = gated.get("release"), gated.get("calibrated"), gated.get("topk")
    if verdict is not Verdict.PASS or not rel or not cal:
        return message
    if topk:  # a top-k cell (a server's logprobs): its tier judged, the other two cannot
        return f"top-k tier {topk['status']} (release gate {rel['status']}, calibrated tier {cal['status']}: they need logits)"
    tail = f"release gate {rel['status']}, calibrated tier {cal['status']}"
    ex = gated.get("exact_check")
    tail += f", exact check {ex['status']}" if ex else ""
    return tail + ("; verdict is the release gate's" if cal["status"] == "unmeasured" else "")


def _render_parity(outcome) -> None:
    r, rec = outcome.result, outcome.receipt
    con = _console()
    g = rec["gated"]
    # the count per prompt is of the tier that judged (the calibrated row's cosine where it applied):
    # the header names it, so it is not read as the release line's "(N below)"
    tier = "calibrated" if g.get("calibrated", {}).get("status", "unmeasured") != "unmeasured" else "release"
    cols = ("prompt", "positions", "min cos", "mean cos", "argmax agr", "flips near/hard", "KLD mean", f"below {g['min_cosine']:g} ({tier})")
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print_table(con, parity_title(rec), cols,
                [(p["id"], p["positions"], f(p["min_cosine"], ".6f"), f(p["mean_cosine"], ".6f"), f(p["argmax_agreement"], ".4f"),
                  f"{p['near_tie_flips']}/{p['hard_flips']}", f(p["kld_mean"], ".3g"), p["failing_positions"]) for p in r.per_prompt],
                right=cols[1:])
    # the gate lines end in the command that measures a missing row: never broken (soft wrap)
    con.print(_p(g["release"]["line"]), markup=False, soft_wrap=True)
    con.print(_p(g["calibrated"]["line"]), markup=False, soft_wrap=True)
    if g.get("topk"):
        con.print(_p(g["topk"]["line"]), markup=False, soft_wrap=True)
    if g.get("exact_check"):
        con.print(_p(g["exact_check"]["line"]), markup=False, soft_wrap=True)
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
    text = rec["prompts"].get("text")
    if text:
        con.print(_p(f"text: {text['path']}: {text['n_tokens']} tokens, {text['windows']} windows of --ctx {text['n_ctx']} "
                     f"({text['unused_tokens']} tokens after the last), scored from position {text['score_from']} of each"), markup=False)
        if text.get("judged"):
            j = text["judged"]
            con.print(_p(f"judged: {j['positions']} positions, from position {j['from']} of each window ({j['why']})"), markup=False)
    if "perplexity" in ro:
        from harness.evidence import fmt

        con.print(_p(f"report-only: {fmt.perplexity_text(ro['perplexity'])}"), markup=False)
        con.print(_p(f"report-only: Δp (reference's top token) {fmt.delta_p_text(ro.get('delta_p'))}"), markup=False)
        con.print(_p(f"report-only: Δp (next token, llama-perplexity's) {fmt.delta_p_text(ro.get('delta_p_next'))}"), markup=False)
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
    con.print(f"[bold]{r.verdict.value}[/bold]: {_m(verdict_tail(r.verdict, r.message, g))}", soft_wrap=True)  # a reproducer line is never broken
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
@click.option("--no-reference-cache", is_flag=True, help="Run the reference even where its logits are in the cache "
              "($HARNESS_REFERENCE_CACHE, default ~/.cache/qwen35-harness/reference; docs/design.md).")
@click.option("--cache-type-k", default=None, metavar="TYPE", help="llama.cpp-based candidate: KV-cache K type (f32, f16, bf16, q8_0, q4_0; default f16).")
@click.option("--cache-type-v", default=None, metavar="TYPE", help="llama.cpp-based candidate: KV-cache V type (same types; quantized needs flash attention).")
@click.option("--flash-attn", default=None, metavar="auto|on|off", help="llama.cpp-based candidate: flash attention (default auto).")
@click.option("--reference-cache-type-k", default=None, metavar="TYPE", help="llama.cpp reference: KV-cache K type (default f16).")
@click.option("--reference-cache-type-v", default=None, metavar="TYPE", help="llama.cpp reference: KV-cache V type (default f16).")
@click.option("--reference-flash-attn", default=None, metavar="auto|on|off", help="llama.cpp reference: flash attention (default auto).")
@click.option("--text", "text", default=None, type=click.Path(), metavar="FILE",
              help="Prompts: this UTF-8 text cut into windows of --ctx tokens, as llama-perplexity cuts it; perplexity and its ratio are reported.")
@click.option("--ctx", default=None, type=int, metavar="N", help="With --text: tokens per window (llama-perplexity's n_ctx; default 512).")
@click.option("--score-second-half", is_flag=True,
              help="With --text: compare and judge only each window's positions from --ctx/2 on, the rows llama-perplexity "
              "asks llama.cpp for; engines that can are asked for those rows alone.")
@click.option("--summary-md", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="Write a Markdown summary for a CI step (also appended to $GITHUB_STEP_SUMMARY when set).")
@click.option("--junit-xml", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="Write JUnit XML: a testcase per gated tier and per prompt, failure on FAIL.")
def parity(models, candidate, reference, prompts, thresholds, ledger, overrides, as_json, no_evidence, localize_, dtype, mlx_folder,
           no_calibrate, require_calibrated, greedy_tokens, mtp, mtp_max_tokens, no_reference_cache, cache_type_k, cache_type_v,
           flash_attn, reference_cache_type_k, reference_cache_type_v, reference_flash_attn, text, ctx, score_second_half, summary_md,
           junit_xml) -> None:
    """Run a candidate and the reference on the same token ids; judge the release gate (cosine
    >= 0.98 over >= 64 positions) and the calibrated tier for the file's weights and the
    candidate's compute class. With --text: over a text's windows of --ctx tokens. With --mtp: the
    MTP draft head instead."""
    # deferred: startup
    from harness.engines.options import kv_settings
    from harness.measure.text_windows import DEFAULT_CTX
    from harness.runs.inputs import run_each
    from harness.runs.parity import ParityRequest, run_parity

    d = _parity_defaults()
    specs = list(models) or d["models"]
    _check_text_options(text, ctx, prompts, mtp, summary_md, junit_xml, score_second_half)
    if mtp:
        kv = {"--cache-type-k": cache_type_k, "--cache-type-v": cache_type_v, "--flash-attn": flash_attn,
              "--reference-cache-type-k": reference_cache_type_k, "--reference-cache-type-v": reference_cache_type_v,
              "--reference-flash-attn": reference_flash_attn}
        if given := [k for k, v in kv.items() if v is not None]:
            raise InvalidInput(f"{', '.join(given)}: not with --mtp (the MTP cells run llama.cpp's MTP context at its default KV settings)")
        _mtp_cells(specs, candidate or d["candidate"], reference or d["reference"], prompts or d["prompts"],
                   thresholds or d["thresholds"], ledger or d["ledger"], overrides, as_json, no_evidence, dtype, mtp_max_tokens)
        return
    settings = {**_dtype_settings(dtype, candidate or d["candidate"], mlx_folder),
                **kv_settings(candidate or d["candidate"], cache_type_k, cache_type_v, flash_attn)}
    reference_settings = kv_settings(reference or d["reference"], reference_cache_type_k, reference_cache_type_v,
                                     reference_flash_attn, prefix="--reference-")
    tier = _measure_tier(no_calibrate)

    def request(spec: str) -> ParityRequest:
        return ParityRequest(
            model=spec, candidate=candidate or d["candidate"], reference=reference or d["reference"],
            prompts=prompts or d["prompts"], thresholds=thresholds or d["thresholds"], ledger=ledger or d["ledger"],
            overrides=list(overrides), argv=["harness", *sys.argv[1:]], write_evidence=not no_evidence,
            measure_tier=tier, require_calibrated=require_calibrated, candidate_settings=settings, greedy_tokens=greedy_tokens,
            reference_settings=reference_settings, reference_cache=not no_reference_cache,
            report=True, localize="auto" if localize_ is None else localize_,
            text=text, ctx=ctx if ctx is not None else DEFAULT_CTX, score_second_half=score_second_half,
        )

    verdicts = []
    ci = _CiOutput(summary_md, junit_xml, specs[0] if len(specs) == 1 else None)
    each = run_each(specs, lambda spec: _with_progress(lambda cb: run_parity(request(spec), cb, log=_stderr_log(as_json)), quiet=as_json))
    with ci:
        for spec, outcome, e in each:
            if e is not None:
                click.echo(f"harness: {e.verdict.value}: {_p(spec)}: {_p(e)}", err=True)
                verdicts.append(e.verdict)
                ci.add(spec, None, e)
                continue
            ci.add(spec, outcome.receipt, None)
            verdicts.append(outcome.result.verdict)
            _show_parity(outcome, spec, candidate or d["candidate"], as_json, localize_)
    worst = Verdict.worst(verdicts)
    if len(specs) > 1:
        click.echo(_p(f"{len(specs)} models: " + ", ".join(f"{s}={v.value}" for s, v in zip(specs, verdicts)) + f" -> {worst.value}"))
    sys.exit(worst.exit_code)


def _show_parity(outcome, spec: str, candidate: str, as_json: bool, localize_: bool | None) -> None:
    """One model's parity outcome: the receipt (``--json``) or the table, the path of the verdict
    page the evidence door wrote with the receipt, or on a FAIL without a page the localize command."""
    report_path = outcome.report_path
    if as_json:
        _echo_json(outcome.receipt)
        return
    _render_parity(outcome)
    if report_path:
        click.echo(_p(f"report:  {report_path} (and report.html; index: {report_path.parent.parent / 'index.html'})"))
    elif outcome.result.verdict.value == "FAIL":
        click.echo(_p(f"next: localize the first divergence with: harness localize --candidate {candidate} --model {spec}"))


def _check_text_options(text: str | None, ctx: int | None, prompts: str | None, mtp: bool, summary_md: str | None,
                        junit_xml: str | None, second_half: bool = False) -> None:
    """``--text``/``--ctx``/``--score-second-half`` make sense together, alone of ``--prompts``
    and ``--mtp``, and the CI files can be written (``InvalidInput`` otherwise); the text file and
    ``--ctx``'s range are checked by the run (``harness.measure.text_windows``) before any engine
    starts."""
    for path, what in ((summary_md, "--summary-md file"), (junit_xml, "--junit-xml file")):
        if path:
            require_writable_file(path, what)
    if ctx is not None and text is None:
        raise InvalidInput("--ctx: only with --text FILE (the window length of the text's windows)")
    if second_half and text is None:
        raise InvalidInput("--score-second-half: only with --text FILE (the second half of each window, as llama-perplexity scores it)")
    if text is not None and prompts is not None:
        raise InvalidInput("--text and --prompts: one of them (the text's windows are the prompts)")
    if text is not None and mtp:
        raise InvalidInput("--text: not with --mtp (the MTP cells run over the prompt set)")


class _CiOutput:
    """``--summary-md`` / ``--junit-xml`` / ``$GITHUB_STEP_SUMMARY`` of a parity run
    (``harness.evidence.ci``): entries are added as the models finish; on leaving, even through a
    ``HarnessError`` of a one-model run (``single``: its spec), the files are written and the
    Markdown is appended to ``$GITHUB_STEP_SUMMARY`` when that variable is set."""

    def __init__(self, summary_md: str | None, junit_xml: str | None, single: str | None):
        self.summary_md, self.junit_xml, self.single = summary_md, junit_xml, single
        self.entries: list[Any] = []

    def add(self, spec: str, receipt: dict[str, Any] | None, error: Any) -> None:
        from harness.evidence.ci import CiEntry  # deferred: startup

        self.entries.append(CiEntry(spec, receipt) if error is None else CiEntry(spec, None, error.verdict.value, str(error).splitlines()[0]))

    def __enter__(self) -> "_CiOutput":
        return self

    def __exit__(self, kind, error, tb) -> None:
        from harness.errors import HarnessError

        if isinstance(error, HarnessError) and self.single is not None:
            self.add(self.single, None, error)
        elif error is not None:
            return
        self.write()

    def write(self) -> None:
        import os

        from harness.evidence.ci import write_summaries

        write_summaries(self.entries, self.summary_md, self.junit_xml, os.environ.get("GITHUB_STEP_SUMMARY"))


def _mtp_cells(specs, candidate, reference, prompts, thresholds, ledger, overrides, as_json, no_evidence, dtype, max_tokens) -> None:
    """``harness parity --mtp``: one MTP cell per model (``harness.runs.mtp``), a table of its
    checks, the implied acceptance, the receipt's path; exit code the worst verdict."""
    # deferred: startup
    from harness.runs.inputs import run_each
    from harness.runs.mtp import MtpRequest, run_mtp

    settings = _dtype_settings(dtype, candidate)

    def one(spec: str):
        req = MtpRequest(model=spec, candidate=candidate, reference=reference, prompts=prompts, thresholds=thresholds, ledger=ledger,
                         overrides=list(overrides), argv=["harness", *sys.argv[1:]], write_evidence=not no_evidence,
                         candidate_settings=settings, max_tokens=max_tokens)
        return run_mtp(req, None if as_json else (lambda m: click.echo(_p(f"mtp: {m}"), err=True)))

    verdicts = []
    for spec, run, e in run_each(specs, one):
        if e is not None:
            click.echo(f"harness: {e.verdict.value}: {_p(spec)}: {_p(e)}", err=True)
            verdicts.append(e.verdict)
            continue
        verdicts.append(run.verdict)
        if as_json:
            _echo_json(run.receipt)
            continue
        rows = [(c.name, c.verdict.value, c.positions, "—" if c.min_cosine is None else f"{c.min_cosine:.8f}",
                 "—" if c.max_kld is None else f"{c.max_kld:.3g}", "—" if not c.calibrated else c.calibrated["status"],
                 "—" if not c.first_failing else f"{c.first_failing['prompt']} row {c.first_failing['row']}"
                 + (f" depth {c.first_failing['depth']}" if c.first_failing.get("depth") else "")
                 + (f" (worst, {c.first_failing['bound']})" if c.first_failing.get("bound") else "")) for c in run.checks]
        print_table(_console(), f"MTP draft head: {candidate} vs {reference} on {spec} ({run.receipt['mtp_convention']} rows)",
                    ("check", "verdict", "rows", "min cosine", "max KLD", "calibrated tier", "first failing"), rows,
                    right=("rows", "min cosine", "max KLD"))
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


@cli.command()
@click.option("--candidate", default=None, help="Engine to probe (default oracle).")
@click.option("--model", default=None, metavar="SPEC", help="GGUF path or fixture:NAME (default: the default model).")
@click.option("--reference", default=None, help="Reference for the long and serving probes (default llama.cpp; llama.cpp-repack: extra buffer types on).")
@click.option("--only", multiple=True, metavar="NAME", help="Run only these probes (split, decode, ubatch, multiseq, prefix, determinism, long, state, serving, speculative).")
@click.option("--decode-tokens", default=None, type=click.IntRange(min=2),
              help="Tokens the decode probe feeds one per call (default: probes.DECODE_TOKENS, 640; a state drifting between calls shows only after hundreds).")
@click.option("--long-tokens", default=None, type=click.IntRange(min=1024),
              help="Positions the long probe feeds (default: probes.LONG_TOKENS, 8,192; 32768 on request), capped at the model's context_length.")
@click.option("--prompts", default=None, type=click.Path())
@click.option("--thresholds", default=None, type=click.Path())
@click.option("--ledger", default=None, type=click.Path())
@override_option
@click.option("--json", "as_json", is_flag=True, help="Print the probe receipt (JSON).")
@click.option("--no-evidence", is_flag=True, help="Do not write a receipt, ledger row or report (a dry run).")
@click.option("--localize/--no-localize", "localize_", default=None,
              help="Localize a failing probe in the report: default on a FAIL whose candidate exposes activations.")
@click.option("--dtype", default=None, type=click.Choice(["float64", "float32", "bfloat16", "float16"]),
              help="transformers or mlx candidate: the dtype it runs in (its compute class follows; mlx: not float64).")
@click.option("--mlx-folder", default=None, type=click.Path(file_okay=False),
              help="mlx candidate: load this transformers folder instead of converting the GGUF.")
@click.option("--no-calibrate", is_flag=True, help="Where no calibrated row fits, do not measure the tolerances on the model.")
@click.option("--scenarios", default=None, type=click.Path(),
              help="Serving probe: a scenario file (harness-serving-scenarios/v1; default: the shipped set, docs/engine-protocol.md \"Op serve\").")
def probe(candidate, model, reference, only, decode_tokens, long_tokens, prompts, thresholds, ledger, overrides, as_json, no_evidence, localize_, dtype,
          mlx_folder, no_calibrate, scenarios) -> None:
    """Self-consistency probes of one engine (exit 0: every measured probe passes and split,
    decode and determinism were measured, or with --only every named probe passes; 1: a probe
    failed; 5: a required or named probe unmeasured)."""
    # deferred: startup
    from harness.runs.probe_types import acceptance_lines
    from harness.runs.probes import ProbeRequest, run_probes

    d = _parity_defaults()
    req = ProbeRequest(model=model or d["model"], candidate=candidate or d["candidate"], reference=reference or d["reference"],
                       only=list(only), prompts=prompts or d["prompts"], thresholds=thresholds or d["thresholds"],
                       ledger=ledger or d["ledger"], overrides=list(overrides), argv=["harness", *sys.argv[1:]],
                       measure_tier=_measure_tier(no_calibrate), candidate_settings=_dtype_settings(dtype, candidate or d["candidate"], mlx_folder),
                       scenarios=scenarios, write_evidence=not no_evidence, report=True, localize="auto" if localize_ is None else localize_,
                       **({} if decode_tokens is None else {"decode_tokens": decode_tokens}),
                       **({} if long_tokens is None else {"long_tokens": long_tokens}))
    con = _console(stderr=True)
    run = run_probes(req, None if as_json else (lambda name: con.print(f"probe {_m(name)} ...")))
    report_path = run.report_path  # written by the evidence door with the receipt
    if as_json:
        _echo_json(run.receipt)
    else:
        print_table(_console(), f"probes: {run.receipt['engines']['candidate']['name']} on {run.receipt['model']['name']}",
                    ("probe", "verdict", "comparisons", "detail"), [(r.name, r.verdict.value, len(r.comparisons), r.summary()) for r in run.results],
                    fold=("detail",), right=("comparisons",))
        for r in run.results:
            for line in acceptance_lines(r.details):
                click.echo(_p(line))
        for r in run.results:
            if r.reproducer:
                click.echo(_p(r.reproducer))
        click.echo(_p(f"{run.verdict.value}: {run.message}"))
        if run.receipt_path:
            click.echo(_p(f"receipt: {run.receipt_path}"))
        if run.ledger_row:
            click.echo(_p(f"ledger:  {req.ledger} (row {run.ledger_row['seq']}, {run.ledger_row['row_hash'][:12]})"))
        if report_path:
            click.echo(_p(f"report:  {report_path}"))
    sys.exit(run.verdict.exit_code)


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
        print_table(_console(), f"tokenizer: {run.receipt['engines']['candidate']['name']} on {run.receipt['model']['name']}",
                    ("prompt", "llama.cpp", "candidate", "first difference"),
                    [(c.prompt, len(c.reference), len(c.candidate), "—" if c.ok else c.first_diff) for c in run.comparisons],
                    right=("llama.cpp", "candidate", "first difference"))
        for f in run.receipt["second_opinion"]["findings"]:
            click.echo(_p(second_opinion.finding_line(f)))
        click.echo(_p(f"{run.verdict.value}: {run.message}"))
        if run.receipt_path:
            click.echo(_p(f"receipt: {run.receipt_path}"))
    sys.exit(run.verdict.exit_code)


CHAT_SERVERS = ("llama-server", "llama-cpp-python")
"""``harness.runs.chat_parsers.SERVERS``, spelled out so that ``harness --help`` imports no run (a test keeps them equal)."""
REASONING_FORMATS = ("deepseek", "deepseek-legacy", "none", "auto")
"""``harness.runs.chat_parsers.REASONING_FORMATS`` (spelled out as ``CHAT_SERVERS``)."""
CHAT_FIELDS = ("reasoning_content", "content", "tool_calls")


@cli.command("chat-parsers")
@click.option("--server", "servers", multiple=True, type=click.Choice(CHAT_SERVERS),
              help="Server to start and judge; repeatable (default: both). One receipt and ledger row each.")
@click.option("--reasoning-format", default="deepseek", show_default=True, type=click.Choice(REASONING_FORMATS),
              help="llama-server's --reasoning-format (it is started with --jinja).")
@click.option("--chat-format", default=None, metavar="NAME",
              help="llama-cpp-python's chat handler (its --chat_format; default: the one it picks from the GGUF, recorded).")
@click.option("--model", default="fixture:scripted-qwen35", show_default=True, metavar="SPEC",
              help="The scripted fixture the servers run (its harness.scripted key must match the scripts).")
@click.option("--scripts", default=None, type=click.Path(file_okay=False), help="Folder of script files (default: the shipped scripts).")
@click.option("--ledger", default=None, type=click.Path())
@click.option("--no-evidence", is_flag=True, help="Do not write a receipt or ledger row (a dry run).")
@click.option("--json", "as_json", is_flag=True, help="Print the receipts (a JSON list).")
def chat_parsers(servers, reasoning_format, chat_format, model, scripts, ledger, no_evidence, as_json) -> None:
    """Servers' reasoning and tool-call parsers on the scripted fixture's texts: each script asked on
    /v1/chat/completions, not streamed and streamed, temperature 0; each field against the
    template grammar's (exit 0: all equal; 1: a field differs, naming script, mode, field and
    first differing character; 3: a server failed; 5: a server could not be started here)."""
    # deferred: startup
    from harness.runs.chat_parsers import ChatParsersRequest, run_chat_parsers

    req = ChatParsersRequest(servers=tuple(servers) or CHAT_SERVERS, reasoning_format=reasoning_format, chat_format=chat_format,
                             model=model, scripts=scripts, ledger=ledger or _parity_defaults()["ledger"],
                             argv=["harness", *sys.argv[1:]], write_evidence=not no_evidence)
    runs = run_chat_parsers(req, _stderr_log(as_json))
    if as_json:
        _echo_json([r.receipt for r in runs])
    for run in [] if as_json else runs:
        cand = run.receipt["engines"]["candidate"]
        if run.results:
            print_table(_console(), f"chat-parsers: {cand['name']} {cand['version']} on {run.receipt['model']['name']}",
                        ("script", "mode", *CHAT_FIELDS),
                        [(r["script"], "streamed" if r["stream"] else "not streamed", *(r["fields"][f] for f in CHAT_FIELDS))
                         for r in run.receipt["results"]])
        for r in run.receipt["results"]:
            for d in r["diffs"]:
                click.echo(_p(f"FAIL {r['script']} ({'streamed' if r['stream'] else 'not streamed'}) {d['field']}: first difference "
                              f"at character {d['at']}: expected {d['expected']!r} | got {d['got']!r}"))
        click.echo(_p(f"{run.server}: {run.verdict.value}: {run.message}"))
        if run.receipt_path:
            click.echo(_p(f"receipt: {run.receipt_path}"))
    sys.exit(Verdict.worst(r.verdict for r in runs).exit_code)


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
        cols = ("layer", "type", "tensors compared", "not comparable", "over bounds", "max NMSE", "min cosine")
        print_table(_console(), f"localize {candidate} against the oracle ({len(loc.tokens)} positions; bounds NMSE <= {loc.bounds['max_nmse']:g}, "
                    f"cosine >= {loc.bounds['min_cosine']})", cols,
                    [(e["layer"] if e["layer"] >= 0 else "output", e["type"], e["compared"], e["missing"], e["over"], f"{e['max_nmse']:.3g}",
                      f"{e['min_cosine']:.6f}") for e in loc.per_layer], right=cols)
        click.echo(f"{loc.compared} tensors compared")
        if loc.first:
            click.echo(_p(f"{loc.verdict.value}: {loc.message}"))
        elif loc.verdict.value == "UNMEASURED":
            click.echo("UNMEASURED: no tensor of the candidate could be compared with the oracle")
        else:
            click.echo("no tensor over the bounds")
    sys.exit(loc.verdict.exit_code)


@cli.command()
@click.argument("receipt", type=click.Path(), required=False)
@click.option("--out", "out_dir", default=None, type=click.Path(), help="Output directory (default: reports/<id>/ beside the receipts).")
@click.option("--localize/--no-localize", "localize_", default=None,
              help="Localize the candidate against the oracle and plot the per-layer profile "
                   "(default: on a FAIL whose candidate exposes activations).")
@click.option("--signoff", "signoff_seq", default=None, type=click.IntRange(min=1), metavar="SEQ",
              help="The page of the sign-off at ledger row SEQ instead of a receipt's (harness ledger show --kind signoff).")
@click.option("--ledger", default=None, type=click.Path(), help="With --signoff: the ledger (default: the project's).")
@click.option("--format", "format_", default="page", show_default=True, type=click.Choice(["page", "markdown", "junit"]),
              help="page: write the verdict page; markdown, junit: print a parity receipt's CI summary or JUnit XML.")
def report(receipt, out_dir, localize_, signoff_seq, ledger, format_) -> None:
    """Write the verdict page of a parity, probe, MTP, tokenizer or chat-parsers receipt (report.md, report.html,
    PNG plots; the reports index beside the ledger is regenerated), or with --signoff SEQ the page
    of a sign-off row; --format markdown|junit prints a parity receipt's CI summary instead."""
    # deferred: startup
    from harness.runs.explain import write_explained_report

    if (receipt is None) == (signoff_seq is None):
        raise InvalidInput("harness report takes a RECEIPT or --signoff SEQ (one of them)")
    if format_ != "page":
        _print_ci(receipt, format_)
        return
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


def _print_ci(receipt: str | None, format_: str) -> None:
    """``harness report RECEIPT --format markdown|junit``: the parity receipt's CI summary
    (``harness.evidence.ci``) on stdout. Raises ``InvalidInput`` for a sign-off or a receipt that
    is not a parity receipt."""
    from harness.evidence.ci import CiEntry, junit_xml, markdown_summary
    from harness.evidence.receipts import SCHEMA_ID, load_receipt

    if receipt is None:
        raise InvalidInput(f"--format {format_}: a parity RECEIPT, not --signoff")
    rec = load_receipt(receipt).receipt
    if rec.get("schema") != SCHEMA_ID:
        raise InvalidInput(f"--format {format_}: {_p(receipt)} is a {_p(rec.get('schema'))} receipt; only parity receipts ({SCHEMA_ID}) have a CI summary")
    entry = CiEntry(rec["model"]["name"], rec)
    click.echo(markdown_summary([entry]) if format_ == "markdown" else junit_xml([entry]), nl=False)
