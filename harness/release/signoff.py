"""``harness signoff MANIFEST``: is this release of these candidate builds signed, and if not, what
is missing?

For the exact candidate builds (``harness.engines.registry.engine_build_id``) the sign-off checks,
each as an ``Item`` with a status (``ok``, ``missing``, ``unmeasured``, ``stale``, ``failed``,
``n/a``) and, unless ok, the command that would produce it:

* the pins: each model's sha256, the thresholds file's sha256, each candidate's build id (when
  pinned) and reported version (when pinned);
* lint on every model (run here: lint writes no evidence): an error finding fails, and so does a
  scripted fixture (QL601: its greedy output is a given text, not a model);
* every obligation of the contracts the candidate must hold, for its current build
  (``harness.contracts.discharge.obligation_status``): DISCHARGED is ok, STALE (also: only another
  build was discharged) is stale, never discharged is missing, anything else failed. Obligations
  whose bound tests need activations (the ``subject_acts`` fixture) are ``n/a`` for a candidate
  without the ``activations`` capability, with that reason;
* every cell (model × candidate × backend, the backend as the engine reports it): the newest
  standing ledger row of a parity receipt and of a probe receipt made from the planned inputs
  (``harness.release.cells``). Parity must PASS with a measured calibrated tier; the probe run must
  PASS. A receipt of the same cell made from other inputs is stale (naming the fields); one that
  differs only in the thresholds file is current while none of the bounds that judged it moved,
  else stale naming each row, its old and new bound and the command that judges it again
  (``harness.release.rejudge``; ``_older_file``), and once a receipt made with the file now is
  found, the earlier rows it re-judged are superseded (``_superseded_by``); a receipt
  that exists without a ledger row is missing;
* with ``tokenizer: true`` in the manifest, every model × candidate: the newest standing
  ``tokenizer`` row (``harness tokenizer``) of that model's current sha256 whose receipt was made
  by the candidate's current build. PASS is ok, FAIL failed, UNMEASURED unmeasured; none is
  missing, or stale when only another build of the candidate was checked.

Every verdict comes from the receipt the row binds, never from the row or the query cache: the
receipt's bytes must hash to the row's ``receipt_sha256`` and the row's verdict must be the
receipt's (``_Found.problem``), the keys the cache files a picked receipt under are re-derived
from it, and the cache is compared with the ledger before it is read (``LedgerCache.open(...,
check=True)``): an edited cache is rebuilt and blocks this sign-off once (an ``evidence`` item
naming the row and column), a mismatch between row and receipt fails its item, naming both.

The verdict is SIGNED (exit 0) when every item is ok or n/a; else BLOCKED: exit 1 when anything
failed or is stale (even if other things are missing), exit 5 when nothing failed but something is
missing or unmeasured. Invalid manifests are exit 2 before anything is judged. The sign-off is
recorded as one ``signoff`` ledger row (``harness.evidence.ledger``) listing every receipt it
relied on with its sha256, each cell's status and each blocking line, after the ``supersede`` rows
of the cells it found re-judged.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from harness.contracts import discharge as dis
from harness.contracts.loader import Contract, Obligation, load_contract
from harness.engines.registry import resolve_engine
from harness.errors import HarnessError, Verdict
from harness.evidence.rows import CACHE_COLUMNS, supersede_row
from harness.evidence.ledger_cache import LedgerCache
from harness.evidence.receipts import receipt_file
from harness.evidence.record import EvidencePaths, evidence_paths, preflight_evidence, record_row
from harness.fixtures.resolve import resolve_model
from harness.model.lint import lint_path
from harness.provenance import sha256_bytes
from harness.judge.thresholds import Thresholds, load_thresholds
from harness.release.cells import (PlanContext, Run, differences, keys_of_receipt, known_receipt_keys, plan_context, plan_runs,
                                   receipt_inputs, receipt_verdict, run_command, same_cell_key)
from harness.release.manifest import Manifest
from harness.release.rejudge import moved_bounds, rejudge_command
from harness.runs.probes import covers_required

OK, MISSING, UNMEASURED, STALE, FAILED, NA = "ok", "missing", "unmeasured", "stale", "failed", "n/a"
BLOCKING_EXIT = {FAILED: 1, STALE: 1, MISSING: 5, UNMEASURED: 5}


@dataclass
class Item:
    """One thing a sign-off judged: ``what`` (pin, lint, contract, cell), ``label`` (which),
    ``status``, ``detail`` (why) and ``command`` (what would produce it; None when ok)."""

    what: str
    label: str
    status: str
    detail: str = ""
    command: str | None = None

    def line(self) -> str:
        """``STATUS what label: detail; run: command`` (the row's ``blocked`` lines)."""
        return f"{self.status.upper()} {self.what} {self.label}: {self.detail}" + (f"; run: {self.command}" if self.command else "")


@dataclass
class CellStatus:
    """A cell's verdict and the receipts it used (``parity``/``probe``: receipt ids or None)."""

    model: str
    candidate: str
    backend: str
    status: str
    parity: str | None = None
    probe: str | None = None


@dataclass
class Signoff:
    """A finished sign-off: every item, the cells, the receipts relied on (``{id, sha256}``), the
    builds, the verdict (SIGNED or BLOCKED), its exit code and the ledger row written (if any)."""

    manifest: Manifest
    items: list[Item] = field(default_factory=list)
    cells: list[CellStatus] = field(default_factory=list)
    relied_on: list[dict[str, str]] = field(default_factory=list)
    builds: dict[str, str] = field(default_factory=dict)
    row: dict[str, Any] | None = None
    moved: list[dict[str, Any]] = field(default_factory=list)
    """The cells whose receipt was judged by bounds that moved since (``_older_file``): cell label,
    receipt id, row seq, each ``Moved`` and the re-judge command."""
    superseding: list[dict[str, Any]] = field(default_factory=list)
    """``supersede`` rows to append before the sign-off row (``_superseded_by``): a re-judged cell's
    earlier rows, withdrawn naming the receipt that judged it again."""

    @property
    def blocking(self) -> list[Item]:
        return [i for i in self.items if i.status in BLOCKING_EXIT]

    @property
    def exit_code(self) -> int:
        """0 signed; 1 any failed or stale item; 5 nothing failed but something missing or unmeasured."""
        codes = {BLOCKING_EXIT[i.status] for i in self.blocking}
        return 1 if 1 in codes else 5 if codes else 0

    @property
    def verdict(self) -> str:
        return "SIGNED" if self.exit_code == 0 else "BLOCKED"


# ---------------------------------------------------------------------------------------------
# Pins and lint
# ---------------------------------------------------------------------------------------------


def _pins(m: Manifest, ctx: PlanContext, so: Signoff) -> None:
    for pin in m.models:
        now = ctx.model_sha256.get(pin.spec)
        ok = now == pin.sha256
        so.items.append(Item("pin", f"model {pin.spec}", OK if ok else FAILED,
                             "sha256 as pinned" if ok else f"sha256 {str(now)[:12]} is not the manifest's {pin.sha256[:12]}",
                             None if ok else f"sha256sum {shlex.quote(pin.spec)}  # then pin it in {m.path}"))
    ok = ctx.thresholds_sha256 == m.thresholds_sha256
    so.items.append(Item("pin", f"thresholds {ctx.thresholds}", OK if ok else FAILED,
                         "sha256 as pinned" if ok else f"sha256 {ctx.thresholds_sha256[:12]} is not the manifest's {m.thresholds_sha256[:12]}",
                         None if ok else f"sha256sum {shlex.quote(str(ctx.thresholds))}  # then pin it in {m.path}"))
    for cand in m.candidates:
        build = ctx.builds[cand.engine]
        if cand.build is not None:
            ok = build.startswith(cand.build)
            so.items.append(Item("pin", f"build of {cand.engine}", OK if ok else FAILED,
                                 f"build {build[:12]}" + ("" if ok else f" is not the manifest's {cand.build[:12]}")))


def _lint(m: Manifest, ctx: PlanContext, so: Signoff) -> None:
    for pin in m.models:
        if ctx.model_sha256.get(pin.spec) is None:
            so.items.append(Item("lint", pin.spec, FAILED, "the model cannot be read", f"harness lint {shlex.quote(pin.spec)}"))
            continue
        report = lint_path(resolve_model(pin.spec))
        errors = report.errors
        if any(f.code == "QL601" for f in report.findings):  # a test input, never a release model
            so.items.append(Item("lint", pin.spec, FAILED, "a scripted fixture (lint QL601: its output is a given text), not a release model",
                                 f"harness lint {shlex.quote(pin.spec)}"))
            continue
        so.items.append(Item("lint", pin.spec, FAILED if errors else OK,
                             f"{len(errors)} error finding(s): {', '.join(sorted({f.code for f in errors}))}" if errors else "clean",
                             f"harness lint {shlex.quote(pin.spec)}" if errors else None))


# ---------------------------------------------------------------------------------------------
# Contracts
# ---------------------------------------------------------------------------------------------


def _capabilities(engine: str, model_spec: str) -> list[str]:
    try:
        return list(resolve_engine(engine, resolve_model(model_spec)).info.capabilities)
    except HarnessError:
        return []


def _contracts(m: Manifest, so: Signoff, discharge_dir: Path | None) -> None:
    for cand in m.candidates:
        caps = _capabilities(cand.engine, m.models[0].spec)
        for cid in m.contracts_for(cand):
            contract = load_contract(cid, check_tests=False)
            ev = discharge_dir or dis.default_evidence_dir(contract)
            again = f"harness discharge {cid} --candidate {shlex.quote(cand.engine)}"
            for ob in contract.obligations:
                label = f"{cid} {ob.id} for {cand.engine}"
                if not ob.tests:
                    so.items.append(Item("contract", label, NA, "no tests bound (UNBOUND)"))
                    continue
                if dis.needs_activations(contract, ob) and "activations" not in caps:
                    so.items.append(Item("contract", label, NA, f"its bound tests need activations; {cand.engine} does not expose them"))
                    continue
                row = dis.obligation_status(contract, ob, ev, cand.engine)
                status = {dis.DISCHARGED: OK, dis.NOT_APPLICABLE: NA, dis.STALE: STALE}.get(row.status, MISSING if row.status == dis.BOUND and row.evidence is None else FAILED)
                so.items.append(Item("contract", label, status, f"{row.status}: {row.detail}", None if status == OK else again))


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------


@dataclass
class _Found:
    """A standing row and its receipt: ``row`` holds the ledger columns a sign-off reads
    (``_ROW_COLUMNS``), ``keys`` the receipt's typed keys (``cells.receipt_keys_of``: ``input``,
    ``cell``, ``same``), ``receipts`` the folder it is in; its file (``path``) is looked up and the
    receipt read only when a run picks it (``receipt``; None when it can no longer be read)."""

    row: dict[str, Any]
    receipts: Path
    keys: dict[str, str] = field(default_factory=dict)

    @cached_property
    def path(self) -> Path:
        """The receipt's ``.json`` (either layout, ``receipt_file``)."""
        return receipt_file(self.receipts, self.row["receipt_id"])

    @cached_property
    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """(the receipt's JSON, its bytes' sha256), read once; (None, None) when the file cannot be
        read or parsed."""
        try:
            data = self.path.read_bytes()
            rec = json.loads(data.decode("utf-8"))
        except (OSError, ValueError):
            return None, None
        return (rec, sha256_bytes(data)) if isinstance(rec, dict) else (None, None)

    @property
    def receipt(self) -> dict[str, Any] | None:
        """The receipt's JSON, read once; None when the file cannot be read or parsed."""
        return self._read[0]

    @cached_property
    def problem(self) -> str | None:
        """What disagrees between the row and the receipt it binds, in words, else None: the
        receipt's bytes are not the sha256 the row names, or the row's verdict is not the one its
        receipt holds (a row re-hashed after its verdict was edited). A sign-off takes every
        verdict from the receipt (``receipt_verdict``), never from the row."""
        rec, sha = self._read
        if rec is None:
            return None
        rid, seq = str(self.row["receipt_id"])[:12], self.row["seq"]
        if sha != self.row.get("receipt_sha256"):
            return f"receipt {rid} has sha256 {sha[:12]}, not the {str(self.row.get('receipt_sha256'))[:12]} row {seq} binds"
        got = receipt_verdict(rec)
        if self.row.get("verdict") != got:
            return f"row {seq} says {self.row.get('verdict')!r} but its receipt {rid} says {got!r}"
        return None

    @cached_property
    def inputs(self) -> dict[str, Any]:
        """``receipt_inputs`` of the receipt (worked out once: every run of a sign-off asks)."""
        return receipt_inputs(self.receipt or {})


_ROW_COLUMNS = ("kind", "receipt_id", "receipt_sha256", "model_sha256", "verdict")
"""The ledger columns a sign-off reads of each standing row (from the query cache, checked against
the ledger: ``LedgerCache.open(..., check=True)``); ``verdict`` only to compare with the receipt's."""


class _Standing:
    """The standing rows of some kinds with their receipts (``ledger_receipts``), indexed by each
    typed key, oldest first: ``by(kind, key)``."""

    def __init__(self, found: list[_Found], rebuilt: str | None = None):
        self.found = found
        self.rebuilt = rebuilt
        """Why the query cache was rebuilt before it was read (``LedgerCache.rebuilt``), else None."""
        self.index: dict[tuple[str, str], list[_Found]] = {}
        for f in found:
            for kind, key in f.keys.items():
                self.index.setdefault((kind, key), []).append(f)

    def by(self, kind: str, key: str | None) -> list[_Found]:
        """The receipts whose ``kind`` key is ``key``, oldest row first."""
        return self.index.get((kind, key), []) if key else []

    def of_receipt(self, rid: str | None) -> _Found | None:
        """The newest standing row naming receipt ``rid``."""
        return next((f for f in reversed(self.found) if f.row["receipt_id"] == rid), None)


def _newest_readable(fs: list[_Found]) -> _Found | None:
    """The newest of ``fs`` whose receipt can still be read (``harness ledger verify`` reports the
    others)."""
    return next((f for f in reversed(fs) if f.receipt is not None), None)


def ledger_receipts(paths: EvidencePaths, kinds: tuple[str, ...] = ("parity", "self-consistency", "probe")) -> _Standing:
    """The standing rows of ``kinds`` with their receipts' keys (oldest first), from the ledger's
    query cache (``LedgerCache.standing_rows``): no row's JSON is parsed, and each receipt is read
    once for its keys (``cells.known_receipt_keys``) and again only when a run picks it. A row
    whose receipt cannot be read is left out (``harness ledger verify`` reports it).

    Cost: the cache's columns of every standing row (SQLite, no JSON), plus one read of each
    receipt the cache has not seen (about a millisecond each, once; a fresh clone, whose cache is
    rebuilt, reads every standing receipt once), plus the receipts the runs pick."""
    with LedgerCache.open(paths.ledger, CACHE_COLUMNS, check=True) as cache:
        rows = cache.standing_rows(kinds, _ROW_COLUMNS)
        known = known_receipt_keys(cache, [r["receipt_id"] for r in rows], lambda rid: receipt_file(paths.receipts, rid))
        rebuilt = cache.rebuilt
    out = []
    for r in rows:
        typed = known.get(r["receipt_id"])
        if typed is None:
            continue
        keys = {}
        for t, _ in typed:
            kind, _, key = t.partition(":")
            keys[kind] = key
        out.append(_Found(r, paths.receipts, keys))
    return _Standing(out, rebuilt)


def _judge_run(m: Manifest, run: Run, found: _Standing, so: Signoff, older: "_Older | None" = None) -> tuple[str, str | None]:
    """The status of one run and the receipt id it used (module docstring); ``older``: the
    thresholds file now, to judge a receipt made with another one (``_older_file``)."""
    cmd = f"harness sweep {shlex.quote(str(m.path))}"
    label = f"{run.cell.candidate.engine} @ {run.cell.model.spec} [{run.cell.backend}] {run.kind}"
    exact = _newest_readable(found.by("input", run.key))
    swept = None if exact else _newest_readable(found.by("cell", run.key))
    if exact or swept:
        f = exact or swept
        so.relied_on.append({"id": f.row["receipt_id"], "sha256": f.row["receipt_sha256"]})
        held = {k for k, _ in keys_of_receipt(f.receipt)}
        why = f.problem or (None if f"{'input' if exact else 'cell'}:{run.key}" in held else
                            f"the query cache files receipt {f.row['receipt_id'][:12]} under this run, but the receipt was made from other inputs")
        if why:
            so.items.append(Item("cell", label, FAILED, why, _VERIFY))
            return FAILED, f.row["receipt_id"]
        if not exact:  # made for this cell, but the engine reported other inputs (class, backend)
            diff = differences(run.inputs, f.inputs)
            so.items.append(Item("cell", label, FAILED, f"receipt {f.row['receipt_id'][:12]} (row {f.row['seq']}) was made for this cell "
                                 f"but the engine reported: {'; '.join(diff)}", run_command(m, run)))
            return FAILED, f.row["receipt_id"]
        status, why = _receipt_status(run, f.receipt)
        again = _superseded_by(run, f, found, so, older) if exact and older is not None else ""
        fix = {OK: None, FAILED: run_command(m, run), UNMEASURED: _measure_command(run)}.get(status, cmd)
        so.items.append(Item("cell", label, status, f"receipt {f.row['receipt_id'][:12]} (row {f.row['seq']}): {why}{again}", fix))
        return status, f.row["receipt_id"]
    same = [f for sha in dict.fromkeys((run.inputs.get("model_sha256"), run.cell.model.sha256))
            for f in found.by("same", same_cell_key(run.inputs, sha))]
    f = _newest_readable(sorted(same, key=lambda f: f.row["seq"]))
    if f is not None:
        diff = differences(run.inputs, f.inputs)
        if [d.split()[0] for d in diff] == ["thresholds_sha256"] and older is not None:
            return _older_file(run, f, so, older, label)
        so.items.append(Item("cell", label, STALE, f"newest receipt {f.row['receipt_id'][:12]} (row {f.row['seq']}) was made from other "
                             f"inputs: {'; '.join(diff)}", run_command(m, run)))
        return STALE, None
    so.items.append(Item("cell", label, MISSING, f"no receipt in the ledger (all missing cells: {cmd})", run_command(m, run)))
    return MISSING, None


@dataclass(frozen=True)
class _Older:
    """What judging a receipt made with another thresholds file needs: the file now (loaded), its
    path and the ``--ledger`` its re-judge commands name (None: the project's)."""

    thresholds: Thresholds
    path: Path
    ledger: Path | None


def _older_file(run: Run, f: _Found, so: Signoff, older: _Older, label: str) -> tuple[str, str | None]:
    """A cell's newest receipt made from the planned inputs but another thresholds file: current
    when none of the bounds that judged it moved (``rejudge.moved_bounds``), judged from the
    receipt as any other; else STALE naming each row, its old and new bound and the command that
    judges it again (the receipt's reproduce line with the file now), and listed in ``so.moved``."""
    rid, seq = f.row["receipt_id"], f.row["seq"]
    was = str(f.inputs.get("thresholds_sha256"))[:12]
    moved = moved_bounds(f.receipt, older.thresholds)
    if f.problem:
        so.relied_on.append({"id": rid, "sha256": f.row["receipt_sha256"]})
        so.items.append(Item("cell", label, FAILED, f.problem, _VERIFY))
        return FAILED, rid
    if moved is None:  # a receipt made before receipts recorded their subject: nothing to compare
        so.items.append(Item("cell", label, STALE, f"newest receipt {rid[:12]} (row {seq}) was judged by thresholds sha256 {was} and "
                             "records no subject to compare its bounds with the file now", rejudge_command(f.receipt, older.path, older.ledger)))
        return STALE, None
    if moved:
        command, what = rejudge_command(f.receipt, older.path, older.ledger), "; ".join(x.text() for x in moved)
        so.moved.append({"cell": label, "receipt_id": rid, "row": seq, "moved": [x.to_dict() for x in moved], "what": what, "command": command})
        so.items.append(Item("cell", label, STALE, f"receipt {rid[:12]} (row {seq}) was judged by thresholds sha256 {was}; rows that moved since: "
                             f"{what}", command))
        return STALE, None
    so.relied_on.append({"id": rid, "sha256": f.row["receipt_sha256"]})
    status, why = _receipt_status(run, f.receipt)
    so.items.append(Item("cell", label, status, f"receipt {rid[:12]} (row {seq}), judged by thresholds sha256 {was}, none of whose "
                         f"bounds moved since: {why}", None if status == OK else rejudge_command(f.receipt, older.path, older.ledger)))
    return status, rid


def _superseded_by(run: Run, new: _Found, found: _Standing, so: Signoff, older: _Older) -> str:
    """Queue a ``supersede`` row for the standing earlier rows of ``run``'s cell, newest first, as
    long as each one's receipt differs from the plan only in its thresholds file and was judged by
    bounds that moved: the cell was judged again by ``new``. The first earlier row that is not such
    a row ends the walk, so a later sign-off reads one earlier receipt per cell at most. Returns the
    words the cell's item adds (empty when none)."""
    rid = new.row["receipt_id"]
    named = []
    earlier = [f for f in found.by("same", same_cell_key(run.inputs)) if f.row["seq"] < new.row["seq"] and f.row["receipt_id"] != rid]
    for f in sorted(earlier, key=lambda f: -f.row["seq"]):
        if f.receipt is None or [d.split()[0] for d in differences(run.inputs, f.inputs)] != ["thresholds_sha256"]:
            break
        moved = moved_bounds(f.receipt, older.thresholds)
        if not moved:
            break
        what = "; ".join(x.text() for x in moved)
        so.superseding.append({"seq": f.row["seq"], "reason": f"re-judged by receipt {rid[:12]} (row {new.row['seq']}) under thresholds "
                               f"sha256 {str(run.inputs['thresholds_sha256'])[:12]}: {what}"})
        named.append(f"{f.row['receipt_id'][:12]} (row {f.row['seq']}: {what})")
    return f"; re-judged: supersedes receipt {', '.join(named)}" if named else ""


_VERIFY = "harness ledger verify --deep"
"""What a sign-off names when a row and its receipt, or the cache and the ledger, disagree."""


def _measure_command(run: Run) -> str:
    """What measures an unmeasured calibrated tier on the model (then sweep again)."""
    return (f"harness calibrate --model {shlex.quote(run.cell.model.spec)} --class {run.cell.candidate.compute_class}; "
            f"then harness sweep again")


def _receipt_status(run: Run, receipt: dict[str, Any]) -> tuple[str, str]:
    """ok / failed / unmeasured of a current receipt, and why."""
    if run.kind == "probe":
        v = receipt.get("verdict")
        lacking = covers_required(receipt)
        if v == "PASS" and lacking:  # a receipt of `harness probe --only` judged a subset
            return UNMEASURED, f"probes PASS on a subset only (--only {' '.join(receipt.get('only') or [])}); a sign-off needs {', '.join(lacking)} measured too"
        return ({"PASS": OK, "UNMEASURED": UNMEASURED}.get(v, FAILED), f"probes {v}: {receipt.get('message', '')}")
    g = receipt.get("gated") or {}
    v, cal = g.get("verdict"), (g.get("calibrated") or {}).get("status")
    if v == "PASS" and cal == "ok":
        return OK, "parity PASS, calibrated tier measured"
    if v == "PASS":
        return UNMEASURED, f"parity PASS but the calibrated tier is {cal}: {(g.get('calibrated') or {}).get('line', '')}"
    return (UNMEASURED if v == "UNMEASURED" else FAILED), f"parity {v}: {str(g.get('message', ''))[:300]}"


def _cells(m: Manifest, ctx: PlanContext, runs: list[Run], paths: EvidencePaths, so: Signoff, ledger_given: bool = False) -> None:
    found = ledger_receipts(paths)
    older = _Older(load_thresholds(ctx.thresholds), ctx.thresholds, paths.ledger if ledger_given else None)
    if found.rebuilt:  # judged from the rebuilt cache; blocked once so that someone looks at the edit
        so.items.append(Item("evidence", "query cache", FAILED, f"{found.rebuilt}; rebuilt from the ledger before judging", _VERIFY))
    order = [OK, NA, UNMEASURED, MISSING, STALE, FAILED]
    for i in range(0, len(runs), 2):
        parity, probe = runs[i], runs[i + 1]
        ps, pid = _judge_run(m, parity, found, so, older)
        qs, qid = _judge_run(m, probe, found, so, older)
        for pin_version in [parity.cell.candidate.version] if parity.cell.candidate.version else []:
            picked = found.of_receipt(pid)
            rec = picked.receipt if picked else None
            got = ((rec or {}).get("engines") or {}).get("candidate", {}).get("version")
            if rec is not None and got != pin_version:
                so.items.append(Item("pin", f"version of {parity.cell.candidate.engine}", FAILED, f"reports version {got!r}, not {pin_version!r}"))
                ps = FAILED
        cell = parity.cell
        so.cells.append(CellStatus(cell.model.spec, cell.candidate.engine, cell.backend, max(ps, qs, key=order.index), pid, qid))


# ---------------------------------------------------------------------------------------------
# The tokenizer check
# ---------------------------------------------------------------------------------------------


def tokenizer_rows(paths: EvidencePaths) -> list[_Found]:
    """The standing ``tokenizer`` rows of the ledger with their receipts (oldest first), from the
    query cache; a row whose receipt cannot be read is left out (``harness ledger verify``
    reports it). Every standing tokenizer receipt is read (a sign-off compares their builds)."""
    with LedgerCache.open(paths.ledger, CACHE_COLUMNS, check=True) as cache:
        rows = cache.standing_rows(("tokenizer",), _ROW_COLUMNS)
    found = [_Found(r, paths.receipts) for r in rows]
    return [f for f in found if f.receipt is not None]


def _tokenizer(m: Manifest, ctx: PlanContext, paths: EvidencePaths, so: Signoff) -> None:
    """With ``m.tokenizer``: one item per model × candidate (module docstring)."""
    if not m.tokenizer:
        return
    found = tokenizer_rows(paths)
    for pin in m.models:
        sha = ctx.model_sha256.get(pin.spec)
        for cand in m.candidates:
            build = ctx.builds[cand.engine]
            label = f"{cand.engine} @ {pin.spec}"
            again = f"harness tokenizer --candidate {shlex.quote(cand.engine)} --model {shlex.quote(pin.spec)}"
            of_model = [f for f in found if f.row.get("model_sha256") == sha]
            mine = [f for f in of_model if ((f.receipt.get("engines") or {}).get("candidate", {}).get("build") or {}).get("id") == build]
            if not mine:
                other = [f for f in of_model if (f.receipt.get("engines") or {}).get("candidate", {}).get("engine") == cand.engine]
                if other:
                    got = ((other[-1].receipt["engines"]["candidate"].get("build") or {}).get("id") or "?")[:12]
                    so.items.append(Item("tokenizer", label, STALE, f"newest tokenizer receipt {other[-1].row['receipt_id'][:12]} "
                                         f"(row {other[-1].row['seq']}) was made by build {got}, not {build[:12]}", again))
                else:
                    so.items.append(Item("tokenizer", label, MISSING, "no tokenizer row for this model and build", again))
                continue
            f = mine[-1]
            so.relied_on.append({"id": f.row["receipt_id"], "sha256": f.row["receipt_sha256"]})
            if f.problem:
                so.items.append(Item("tokenizer", label, FAILED, f.problem, _VERIFY))
                continue
            v = receipt_verdict(f.receipt)
            status = {"PASS": OK, "UNMEASURED": UNMEASURED}.get(v, FAILED)
            so.items.append(Item("tokenizer", label, status, f"receipt {f.row['receipt_id'][:12]} (row {f.row['seq']}): "
                                 f"tokenizer {v}: {str(f.receipt.get('message', ''))[:300]}", None if status == OK else again))


# ---------------------------------------------------------------------------------------------
# The sign-off
# ---------------------------------------------------------------------------------------------


def signoff(m: Manifest, ledger: str | Path | None = None, discharge_dir: str | Path | None = None, record: bool = True) -> Signoff:
    """Judge ``m`` (module docstring) against the ledger ``ledger`` (None: the project's) and the
    discharge records in ``discharge_dir`` (None: each contract's default), and with ``record``
    append the ``signoff`` row. Raises ``InvalidInput`` when the evidence cannot be read or the row
    cannot be written."""
    paths = preflight_evidence(ledger) if record else evidence_paths(ledger)
    ctx = plan_context(m, paths.ledger)
    runs = plan_runs(m, ctx)
    so = Signoff(m, builds=dict(ctx.builds))
    _pins(m, ctx, so)
    _lint(m, ctx, so)
    _contracts(m, so, Path(discharge_dir) if discharge_dir else None)
    _cells(m, ctx, runs, paths, so, ledger_given=ledger is not None)
    _tokenizer(m, ctx, paths, so)
    seen: set[str] = set()
    so.relied_on = [r for r in so.relied_on if not (r["id"] in seen or seen.add(r["id"]))]
    if record:
        for sup in {s["seq"]: s for s in so.superseding}.values():  # a re-judged cell's earlier rows: withdrawn, never edited
            record_row(paths.ledger, supersede_row(sup["seq"], sup["reason"]), None, paths.markdown)
        so.row = record_row(paths.ledger, signoff_row(so), None, paths.markdown)
    return so


def signoff_row(so: Signoff) -> dict[str, Any]:
    """The ``signoff`` ledger row of a sign-off (``harness.evidence.ledger.SIGNOFF_FIELDS``)."""
    return {"kind": "signoff", "release_name": so.manifest.release, "verdict": so.verdict, "builds": so.builds,
            "cells": [vars(c) for c in so.cells], "relied_on": so.relied_on, "blocked": [i.line() for i in so.blocking]}


def verdict_of(so: Signoff) -> Verdict:
    """The shared verdict the exit code stands for (PASS, FAIL or UNMEASURED)."""
    return {0: Verdict.PASS, 1: Verdict.FAIL, 5: Verdict.UNMEASURED}[so.exit_code]
