"""``harness mutants list``, ``contracts validate``, ``discharge`` and ``status``: adapters over
``harness.engines.mutants`` and ``harness.contracts``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from harness.display import plain as _p
from harness.errors import Unmeasured
from harness.cli.app import cli
from harness.cli.render import _echo_json, _render_table, _short, STATUS_STYLES


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
                 [(r["name"], r["bug_class"], ",".join(r["archs"]), " ".join(r["breaks"]), r["description"]) for r in rows],
                  fold=("bug class", "breaks", "fault"))


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
                 [(r["id"], r["version"], r["subject"], str(r["equations"]), str(r["obligations"]), str(r["bound"]), str(r["tests"])) for r in rows],
                      fold=("subject",), right=("equations", "obligations", "bound", "tests"))


@cli.command()
@click.argument("contract", type=click.Path())
@click.option("--candidate", default="oracle", show_default=True, help="The GREEN subject (any engine name, e.g. command:NAME).")
@click.option("--obligation", "obligation_ids", multiple=True, metavar="ID", help="Discharge only these obligations (repeatable).")
@click.option("--evidence-dir", default=None, type=click.Path(), help="Where records go (default: the project's <evidence>/discharge).")
@click.option("--jobs", default=None, type=int, help="Parallel pytest processes (default: CPU count).")
@click.option("--no-write", is_flag=True, help="Do not write evidence records.")
@click.option("--ledger", default=None, type=click.Path(), help="Ledger for the discharge receipt's row (default: the project's).")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
def discharge(contract, candidate, obligation_ids, evidence_dir, jobs, no_write, ledger, as_json) -> None:
    """Run each obligation's tests on its RED subject (must fail by assertion) then on the
    candidate (must pass), write the evidence (the records, a receipt binding them, its ledger
    row), exit 0 only if every selected one is DISCHARGED. CONTRACT is a file or an id (the
    project's contracts/ID.yaml, else the shipped contract)."""
    # deferred: startup
    from harness.contracts import discharge as dis

    results = dis.discharge(contract, candidate, obligation_ids, evidence_dir, jobs, write=not no_write, ledger=ledger,
                            argv=["harness", *sys.argv[1:]])
    if as_json:
        _echo_json([r.record for r in results])
    else:
        rows = []
        for r in results:
            red = "; ".join(f"{x['shown_by']}: {x['outcome']}" for x in r.red) or "-"
            msg = _short(next((x["message"] for x in r.red if x["outcome"] != dis.RED), r.red[0]["message"] if r.red else ""))
            rows.append((r.obligation, red, msg, r.green.get("outcome", "-") if r.green else "-", r.result))
        _render_table(f"discharge {results[0].contract if results else ''}",
                      ("obligation", "RED subject: outcome", "RED message", "GREEN", "result"), rows, STATUS_STYLES,
                      fold=("RED subject: outcome", "RED message"))
        done = sum(r.result == dis.DISCHARGED for r in results)
        na = [r for r in results if r.result == dis.NOT_APPLICABLE]
        click.echo(f"{done}/{len(results)} obligations DISCHARGED" + (f", {len(na)} NOT-APPLICABLE ({na[0].green['message']})" if na else ""))
        if results and results[0].receipt is not None:
            click.echo(_p(f"receipt: {results[0].receipt}"))
    sys.exit(dis.discharge_exit(results))



def _page_notice() -> None:
    """The release flow's word on docs/engines.md: a line when a thresholds row it cites changed
    since it was rendered (``engines_refresh.stale_notice``), naming the refresh command."""
    from harness.release import engines_refresh

    line = engines_refresh.stale_notice()
    if line:
        click.echo(_p(line), err=True)

def _signed_cells_moved(ledger, thresholds, as_json: bool) -> list:
    """The cells of each release's newest SIGNED sign-off judged by thresholds bounds that moved
    since (``harness.release.rejudge.signed_cells_moved``), one escaped line each unless ``as_json``."""
    from harness.evidence.record import evidence_paths
    from harness.release.rejudge import signed_cells_moved
    from harness.runs.inputs import resolve_thresholds_path

    moved = signed_cells_moved(evidence_paths(ledger).ledger, resolve_thresholds_path(thresholds), ledger_opt=ledger is not None)
    if not as_json:
        for cell in moved:
            click.echo(_p(f"STALE sign-off: {cell.line()}"))
    return moved


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--check", is_flag=True, help="Exit 1 unless every obligation is DISCHARGED or NOT-APPLICABLE (5 when none is DISCHARGED) "
              "and no signed cell was judged by thresholds bounds that moved since.")
@click.option("--evidence-dir", default=None, type=click.Path(), help="Where records are (default: the project's <evidence>/discharge).")
@click.option("--candidate", "candidates", multiple=True, metavar="NAME",
              help="The GREEN subject whose current build is judged (repeatable; default: every subject with records).")
@click.option("--ledger", default=None, type=click.Path(), help="Ledger whose sign-offs are checked (default: the project's).")
@click.option("--thresholds", default=None, type=click.Path(),
              help="Thresholds file the signed cells' bounds are compared with (default: ./thresholds.yaml, else the shipped one).")
@click.option("--json", "as_json", is_flag=True)
def status(paths, check, evidence_dir, candidates, ledger, thresholds, as_json) -> None:
    """Computed status of every obligation (UNBOUND, BOUND, RED-SEEN, DISCHARGED, NOT-APPLICABLE, STALE) per GREEN
    subject, and coverage per contract. PATHS: files, folders or ids; default: the project's
    contracts/ and the shipped contracts it uses ([tool.harness] contracts, else those discharged
    here). Records are kept per subject build (evidence/discharge/CONTRACT/NAME@BUILD/). Also
    names each cell of a release's newest SIGNED sign-off whose receipt was judged by
    thresholds bounds that moved since, with the command that judges it again."""
    # deferred: startup
    from harness.contracts import discharge as dis
    from harness.contracts import suite

    moved = _signed_cells_moved(ledger, thresholds, as_json)
    targets = list(paths) or suite.default_contract_paths()
    if not targets:
        msg = ("no contracts to report: this project has no contracts/ and has discharged no shipped contract "
               f"(shipped: {', '.join(suite.shipped_contracts())}); run e.g. harness discharge qwen35-e2e-verification-v1 "
               "--candidate command:NAME, or list them in [tool.harness] contracts")
        if as_json:  # JSON on stdout, the message too
            _echo_json({"obligations": [], "coverage": [], "signoff_cells_moved": [c.to_dict() for c in moved], "message": msg})
        if check and moved:
            sys.exit(1)
        if check:
            raise Unmeasured(msg)
        if not as_json:
            click.echo(msg)
        return
    rows, coverage = dis.status(targets, evidence_dir, candidates)
    if as_json:
        _echo_json({"obligations": [vars(r) for r in rows], "coverage": coverage, "signoff_cells_moved": [c.to_dict() for c in moved]})
    else:
        _render_table("obligation status", ("contract", "obligation", "candidate", "status", "detail"),
                      [(r.contract, r.obligation, r.candidate or "-", r.status, _short(r.detail, 160)) for r in rows], STATUS_STYLES,
                      keys=2, fold=("detail",))
        _render_table("coverage", ("contract", "version", "obligations", *dis.STATUSES),
                      [(c["contract"], c["version"], str(c["obligations"]), *(str(c[s]) for s in dis.STATUSES)) for c in coverage],
                      fold=(), right=("obligations", *dis.STATUSES))
    _page_notice()
    if check and moved:
        sys.exit(1)
    if check and dis.check_exit(rows):
        if dis.check_exit(rows) == 5:
            raise Unmeasured(f"no obligation of {', '.join(c['contract'] for c in coverage)} is DISCHARGED: every one is NOT-APPLICABLE to "
                             f"{', '.join(sorted({r.candidate or '-' for r in rows}))} (discharge a contract it can be asked, e.g. "
                             "qwen35-e2e-verification-v1)")
        sys.exit(1)
