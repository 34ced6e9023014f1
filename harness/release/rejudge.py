"""Cells judged by an older thresholds file: which bounds moved since a receipt was judged, the
command that judges it again, and the signed cells that need it.

A parity or probe receipt keeps its own copy of every number that judged it
(``receipt["thresholds"]``, ``ResolvedThresholds.to_receipt``): the release gate, the
class-independent probe tolerances, the calibrated row that fitted (its label, e.g.
``calibrated[3]``, in its ``source``; a top-k cell's ``topk`` row; or a calibration receipt the tier
was measured into) and the near-tie margin; a cell on a low-bit i-quant file whose exact check
ran keeps the F32 row that judged that check too (``gated.exact_check.row``,
``harness.runs.exact_check.row_record``). ``moved_bounds`` resolves the same subject
(``thresholds.subject`` and the model's sha256) in a thresholds file as it stands now and compares
the two bound by bound: a row whose content is unchanged (``engines_page.row_sha256``, the one hash
of a row) is skipped, and a row that was only renumbered or re-measured to the same values moves
nothing. What remains is one ``Moved`` per bound: the row that judged it, the gate, the old and
the new value (None: no row of that kind fits the subject any more).

Used by ``harness signoff`` (a cell whose newest receipt differs from the plan only in the
thresholds file's sha256 is current when none of its bounds moved, else stale naming them; a
re-judged cell's earlier row is superseded) and by ``harness status --check``
(``signed_cells_moved``: the cells of each release's newest SIGNED sign-off whose bounds moved).
The command that judges a cell again is its receipt's reproduce line
(``harness.evidence.report.reproduce_command``) with the thresholds file it is compared with.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from harness.evidence.engines_page import row_label, row_sha256
from harness.evidence.receipts import PROBE_SCHEMA_ID, receipt_file
from harness.evidence.report import reproduce_command
from harness.evidence.rows import read_rows
from harness.judge.thresholds import Thresholds, load_thresholds
from harness.judge.tiers import Subject, find_row
from harness.runs import exact_check

ROLES = ("calibrated", "topk", "exact")
"""The rows that judged a receipt, one thresholds.yaml row each (``calibrated[i]``, ``topk[i]``):
its calibrated or top-k row (in its ``thresholds``) and its exact check's F32 row (``exact``, from
``gated.exact_check.row``: a low-bit i-quant cell whose candidate dequantizes)."""
EXACT = " (exact check)"
"""Appended to the label of the row that judged a cell's exact check (``calibrated[0] (exact check)``)."""
USED_BY = {
    "parity": ("release.", "report_only.", "calibrated.gates.", "calibrated.max_tokens", "topk.", "exact."),
    "probe": ("release.", "probes.", "calibrated.probes."),
}
"""The bounds (``judged_bounds`` keys, by prefix) that judge each kind of receipt: a parity cell
its release gate, near-tie margin and calibrated (or top-k) gates; a probe cell the probe
tolerances, the class-independent ones and its row's, and the release gate its long and serving
probes apply. A bound of the other kind moving names no cell."""


@dataclass(frozen=True)
class Moved:
    """One bound that moved: ``row`` judged the receipt (``calibrated[3]``, ``topk[0]``,
    ``release``, ``probes``, ``report_only``, or ``calibration receipt 0123456789ab``), ``gate``
    names the bound in it (``min_cosine``, ``probes.max_kld``, ``max_tokens``), ``old`` is the
    receipt's value and ``new`` the value now (None: nothing of that kind judges the subject now);
    ``now_row`` is the row that holds it now when that is another row (None: the same, or none)."""

    row: str
    gate: str
    old: Any
    new: Any
    now_row: str | None = None

    def text(self) -> str:
        """``calibrated[3] min_cosine 0.98 → 0.9999`` (``(now calibrated[5])`` when renumbered)."""
        now = f" (now {self.now_row})" if self.now_row else ""
        return f"{self.row} {self.gate} {_value(self.old)} → {_value(self.new)}{now}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``--json``): row, gate, old, new, now_row."""
        return {"row": self.row, "gate": self.gate, "old": self.old, "new": self.new, "now_row": self.now_row}


def _value(v: Any) -> str:
    return "none" if v is None else str(v)


def _row_name(row: Mapping[str, Any]) -> str:
    """A recorded row's label (``calibrated[3]``), or the calibration receipt it came from."""
    source = str(row.get("source", ""))
    return row_label(source) or f"calibration receipt {source.split()[-1][:12] if source else '?'}"


def receipt_kind(receipt: Mapping[str, Any]) -> str:
    """``probe`` for a probe receipt, else ``parity``."""
    return "probe" if receipt.get("schema") == PROBE_SCHEMA_ID else "parity"


def judged_bounds(t: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """``{bound: (row, value)}`` of a receipt-form thresholds record (``ResolvedThresholds.to_receipt``,
    with ``topk`` for a top-k cell and ``exact`` for a cell whose exact check ran): ``release.NAME``,
    ``probes.NAME`` (the class-independent tolerances; a row's own are under the row),
    ``calibrated.gates.NAME``, ``calibrated.probes.NAME``, ``calibrated.max_tokens``, the same under
    ``topk`` (and its ``k``), ``exact.gates.NAME`` (its row labelled with ``EXACT``), and
    ``report_only.near_tie_margin``. Values as recorded (float or int; a gate recorded as
    ``{"value": v, ...}`` or, in an exact check's row, as ``v``)."""
    out: dict[str, tuple[str, Any]] = {}
    for name, g in (t.get("release") or {}).items():
        out[f"release.{name}"] = ("release", (g or {}).get("value"))
    for name, g in (t.get("probes") or {}).items():
        if (g or {}).get("source") == "probes":
            out[f"probes.{name}"] = ("probes", g.get("value"))
    for role in ROLES:
        row = t.get(role)
        if not isinstance(row, Mapping):
            continue
        label = _row_name(row) + (EXACT if role == "exact" else "")
        for part in ("gates", "probes"):
            for name, g in (row.get(part) or {}).items():
                out[f"{role}.{part}.{name}"] = (label, g.get("value") if isinstance(g, Mapping) else g)
        for extra in ("max_tokens", "k"):
            if row.get(extra) is not None:
                out[f"{role}.{extra}"] = (label, row[extra])
    out["report_only.near_tie_margin"] = ("report_only", t.get("near_tie_margin"))
    return out


def _subject(receipt: Mapping[str, Any]) -> Subject | None:
    s = (receipt.get("thresholds") or {}).get("subject")
    if not isinstance(s, Mapping):
        return None
    try:
        return Subject(str(s["weights"]), str(s.get("file_type", "")), str(s["compute_class"]), bool(s.get("class_declared", True)),
                       int(s["n_layer"]), int(s["n_embd"]), str((receipt.get("model") or {}).get("sha256") or ""), str(s.get("arch") or ""))
    except (KeyError, TypeError, ValueError):
        return None


def exact_row(receipt: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The row that judged ``receipt``'s exact check (``gated.exact_check.row``), or None when its
    check did not run (not a low-bit i-quant file, a candidate that does not dequantize) or no row
    fitted it."""
    check = (receipt.get("gated") or {}).get("exact_check")
    row = check.get("row") if isinstance(check, Mapping) and check.get("status") != "not-run" else None
    return row if isinstance(row, Mapping) else None


def judged_record(receipt: Mapping[str, Any]) -> dict[str, Any]:
    """What judged ``receipt`` as it recorded it: its ``thresholds`` and, when its exact check ran,
    that check's row as ``exact``."""
    old = dict(receipt.get("thresholds") or {})
    if (row := exact_row(receipt)) is not None:
        old["exact"] = row
    return old


def current_record(receipt: Mapping[str, Any], th: Thresholds) -> dict[str, Any] | None:
    """The thresholds record the receipt's subject gets from ``th`` now, in the receipt's form; a
    calibrated tier measured into a calibration receipt (``self_calibration``) stays that receipt's
    while ``th`` still has no row for the subject; with ``exact`` (the F32 row of the same
    architecture and class, ``exact_check.float_subject``; None when none fits now) where the
    receipt's exact check ran. None when the receipt records no subject (made before receipts
    did): nothing can be compared."""
    subject = _subject(receipt)
    if subject is None:
        return None
    old = receipt.get("thresholds") or {}
    now = th.resolve(subject).to_receipt()
    if now["calibrated"] is None and old.get("self_calibration") and isinstance(old.get("calibrated"), Mapping):
        now["calibrated"] = old["calibrated"]
    if "topk" in old:
        k = ((receipt.get("gated") or {}).get("topk") or {}).get("k") or (old.get("topk") or {}).get("k") or 0
        row, _ = th.resolve_topk(subject, int(k))
        now["topk"] = {**row.to_receipt(), "k": row.k} if row is not None else None
    if exact_row(receipt) is not None:
        row, _ = find_row(th.rows, exact_check.float_subject(subject))
        now["exact"] = exact_check.row_record(row) if row is not None else None
    return now


def moved_bounds(receipt: Mapping[str, Any], th: Thresholds) -> list[Moved] | None:
    """Every bound that judged ``receipt`` (``USED_BY`` its kind) and has another value in ``th``
    now (module docstring), in the order ``judged_bounds`` lists them; ``[]`` when none moved;
    None when the receipt records no subject to resolve."""
    now = current_record(receipt, th)
    if now is None:
        return None
    old = judged_record(receipt)
    same_rows = {role for role in ROLES if isinstance(old.get(role), Mapping) and isinstance(now.get(role), Mapping)
                 and row_sha256(old[role]) == row_sha256(now[role])}
    before, after = judged_bounds(old), judged_bounds(now)
    used = USED_BY[receipt_kind(receipt)]
    out = []
    for key in [*before, *(k for k in after if k not in before)]:
        if key.split(".")[0] in same_rows or not key.startswith(used):
            continue
        (row, v0), (row1, v1) = before.get(key, (None, None)), after.get(key, (None, None))
        if v0 == v1:
            continue
        parts = key.split(".")
        gate = ".".join(parts[2:] if parts[0] in ROLES and parts[1] == "gates" else parts[1:])
        out.append(Moved(row or row1 or "?", gate, v0, v1, row1 if row and row1 and row1 != row else None))
    return out


def rejudge_command(receipt: Mapping[str, Any], thresholds: str | Path, ledger: str | Path | None = None) -> str:
    """The command that judges ``receipt``'s run again with ``thresholds``: its reproduce line
    (``report.reproduce_command``: its candidate and options, model, prompts, probes) with
    ``--thresholds`` set to ``thresholds`` and, when given, ``--ledger``."""
    rec = json.loads(json.dumps(receipt))  # a copy: the receipt itself is never changed
    rec.setdefault("thresholds", {})["file"] = str(thresholds)
    return reproduce_command(rec, ["--ledger", str(ledger)] if ledger is not None else [])


@dataclass
class MovedCell:
    """A cell of a SIGNED sign-off whose receipt was judged by bounds that moved: the release, the
    sign-off row's seq, the cell (model, candidate, backend), the receipt (``kind`` parity or
    probe, id), what moved and the command that judges it again."""

    release: str
    signoff_seq: int
    model: str
    candidate: str
    backend: str
    kind: str
    receipt_id: str
    moved: list[Moved] = field(default_factory=list)
    command: str = ""
    why: str | None = None
    """Set when nothing could be compared (the receipt cannot be read, or records no subject)."""

    def line(self) -> str:
        """One line (unescaped: the caller escapes it for where it goes)."""
        head = f"release {self.release} (sign-off row {self.signoff_seq}): {self.candidate} @ {self.model} [{self.backend}] {self.kind} receipt {self.receipt_id[:12]}"
        if self.why:
            return f"{head} {self.why}; run: {self.command}"
        what = "; ".join(m.text() for m in self.moved)
        return f"{head} was judged by rows that moved since: {what}; re-judge: {self.command}; then sign off again"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``harness status --json``'s ``signoff_cells_moved``)."""
        return {**{k: v for k, v in vars(self).items() if k != "moved"}, "moved": [m.to_dict() for m in self.moved]}


def newest_signed(rows: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The newest standing SIGNED ``signoff`` row of each release, in seq order."""
    withdrawn = {r.get("supersedes") for r in rows if r.get("kind") == "supersede"}
    newest: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        if r.get("kind") == "signoff" and r.get("verdict") == "SIGNED" and r.get("seq") not in withdrawn:
            newest[str(r.get("release_name"))] = r
    return sorted(newest.values(), key=lambda r: r["seq"])


def signed_cells_moved(ledger: str | Path, thresholds: str | Path, ledger_opt: bool = False) -> list[MovedCell]:
    """Every receipt a release's newest SIGNED sign-off in ``ledger`` relies on for a cell whose
    bounds moved in ``thresholds`` (``moved_bounds``), with its re-judge command (``--ledger`` named
    when ``ledger_opt``); ``[]`` when the ledger holds no such sign-off (the thresholds file is then
    not read). A receipt that cannot be read, or records no subject, is named with that as its
    move (``harness ledger verify`` says more). Raises ``InvalidInput`` for an unreadable ledger
    or thresholds file."""
    ledger = Path(ledger)
    signed = newest_signed(read_rows(ledger)) if ledger.is_file() else []
    if not signed:
        return []
    th = load_thresholds(thresholds)
    out = []
    for so in signed:
        for cell in so.get("cells") or []:
            for kind in ("parity", "probe"):
                rid = cell.get(kind)
                if not rid:
                    continue
                try:
                    receipt = json.loads(receipt_file(ledger.parent / "receipts", rid).read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    receipt = None
                moved = moved_bounds(receipt, th) if isinstance(receipt, dict) else None
                if moved == []:
                    continue
                named = MovedCell(str(so.get("release_name")), int(so["seq"]), str(cell.get("model")), str(cell.get("candidate")),
                                  str(cell.get("backend")), kind, str(rid), moved or [])
                if moved is None:
                    named.why = ("cannot be read" if not isinstance(receipt, dict) else
                                 "records no thresholds subject: what judged it cannot be compared with the file now")
                    named.command = "harness ledger verify --deep" + (f" --ledger {shlex.quote(str(ledger))}" if ledger_opt else "")
                else:
                    named.command = rejudge_command(receipt, thresholds, ledger if ledger_opt else None)
                out.append(named)
    return out
