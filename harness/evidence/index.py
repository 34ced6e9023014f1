"""The evidence index: ``reports/index.md`` and ``reports/index.html`` beside the ledger.

One line per ledger row, newest first: verdict, kind, candidate, model, class (the planted bug
class of a ``mutant:*`` candidate, i.e. known-bad evidence), key numbers, and links to the
row's verdict page and receipt. It is regenerated after every append (``record_evidence``) and
after every report written to the default folder (``write_report``), under the ledger's file
lock so concurrent runs leave the newest view. It is a rendering for people: the hash-chained
``ledger.jsonl`` stays the record (``harness ledger verify``), and the index links to it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from harness.errors import HarnessError, InvalidInput
from harness.evidence import fmt
from harness.evidence.ledger import default_markdown_path, read_rows
from harness.evidence.page import Badge, Code, Inline, Link, Page, untrusted
from harness.evidence.report import REPORT_HTML, REPORT_MD

INDEX_MD, INDEX_HTML = "index.md", "index.html"


def reports_dir(ledger_path: str | Path) -> Path:
    """``reports/`` beside the ledger (where ``write_report`` puts each receipt's folder)."""
    return Path(ledger_path).parent / "reports"


def _receipt(receipts: Path, rid: str) -> dict[str, Any] | None:
    try:
        return json.loads((receipts / f"{rid}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _key_numbers(row: dict[str, Any]) -> str:
    parts = []
    if row.get("min_cosine") is not None:
        parts.append(f"lowest cosine {fmt.cosine(row['min_cosine'])}")
    if row.get("kld_mean") is not None:
        parts.append(f"KLD mean {fmt.kld(row['kld_mean'])}")
    if row.get("argmax_agreement") is not None:
        parts.append(f"argmax {fmt.percent(row['argmax_agreement'])}")
    if row.get("hard_flips") is not None:
        parts.append(f"{row['hard_flips']} hard flips")
    if row.get("positions") is not None:
        parts.append(f"{row['positions']} positions")
    return " · ".join(parts) or fmt.NA


def _rel(target: Path, base: Path) -> str | None:
    try:
        return os.path.relpath(target, base).replace(os.sep, "/")
    except ValueError:
        return None


def _row_cells(row: dict[str, Any], superseded: dict[int, int], ledger_dir: Path, out: Path) -> list[Inline]:
    rid = row.get("receipt_id")
    rec = _receipt(ledger_dir / "receipts", rid) if rid else None
    verdict: Inline = Badge(row.get("verdict") or fmt.NA)
    if row.get("seq") in superseded:
        verdict = [verdict, f" (withdrawn by #{superseded[row['seq']]})"]
    cand_name = (rec or {}).get("engines", {}).get("candidate", {}).get("name") or str(row.get("candidate") or fmt.NA).split(" ")[0]
    build = (rec or {}).get("engines", {}).get("candidate", {}).get("build") or {}
    klass = f"known-bad: {build['bug_class']}" if build.get("bug_class") else ("self-check" if row.get("kind") == "self-consistency" else "—")
    model = f"{row.get('model') or fmt.NA}" + (f" ({row['quant']})" if row.get("quant") else "")
    if row.get("kind") == "supersede":
        return [str(row.get("seq")), fmt.when(row.get("time")), "", "supersede", "", f"withdraws #{row.get('supersedes')}: {row.get('reason', '')}",
                "", "", "", ""]
    if row.get("kind") == "signoff":
        cells = row.get("cells") or []
        return [str(row.get("seq")), fmt.when(row.get("time")), verdict, "signoff", "", f"release {row.get('release_name')}", "",
                f"{sum(c.get('status') == 'ok' for c in cells)}/{len(cells)} cells ok; {len(row.get('relied_on') or [])} receipts", "", ""]
    report: Inline = "not rendered"
    folder = out / rid[:16] if rid else None
    if folder is not None and (folder / REPORT_MD).is_file():
        html = REPORT_HTML if (folder / REPORT_HTML).is_file() else REPORT_MD
        report = Link("verdict page", f"{rid[:16]}/{REPORT_MD}", f"{rid[:16]}/{html}")
    receipt: Inline = fmt.NA
    if rid:
        target = ledger_dir / "receipts" / f"{rid}.json"
        href = _rel(target, out) if target.is_file() else None
        receipt = Link(Code(rid[:12]), href) if href else [Code(rid[:12]), " (missing)"]
    return [str(row.get("seq")), fmt.when(row.get("time")), verdict, str(row.get("kind") or ""), Code(cand_name), model, klass,
            _key_numbers(row), report, receipt]


def build_index(ledger_path: str | Path) -> Page:
    """The index page for a ledger (rows newest first). Raises ``InvalidInput`` on a malformed
    ledger line."""
    ledger_path = Path(ledger_path)
    out = reports_dir(ledger_path)
    rows = read_rows(ledger_path)
    superseded = {r.get("supersedes"): r.get("seq") for r in rows if r.get("kind") == "supersede"}
    counts: dict[str, int] = {}
    for r in rows:
        if r.get("kind") != "supersede" and r.get("seq") not in superseded:
            counts[r.get("verdict") or "n/a"] = counts.get(r.get("verdict") or "n/a", 0) + 1
    page = Page("Evidence index").h(1, "Evidence index")
    links: list[Inline] = []
    href = _rel(ledger_path, out)
    if href:
        links.append(Link(Code(ledger_path.name), href))
    md = default_markdown_path(ledger_path)
    if md.is_file() and (mhref := _rel(md, out)):
        links += [" (rendered: ", Link(Code(md.name), mhref), ")"]
    page.p("Every receipt of the ledger ", *links, ", newest first. The hash-chained ledger is the record and ",
           Code("harness ledger verify"), " checks it; this page is regenerated from it after every append and every report.")
    standing = ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "none"
    page.p(f"{len(rows)} rows; standing results: {standing}.")
    cells = [_row_cells(r, superseded, ledger_path.parent, out) for r in sorted(rows, key=lambda r: -(r.get("seq") or 0))]
    page.table(["#", "time", "verdict", "kind", "candidate", "model", "class", "key numbers", "report", "receipt"], cells, "rnnlnllnll")
    if any(c[8] == "not rendered" for c in cells):
        page.note("A row without a verdict page: render it with ", Code("harness report RECEIPT"), ".")
    return page


def refresh_index(ledger_path: str | Path, *, lock_timeout: float = 60.0) -> tuple[Path, Path]:
    """Regenerate ``reports/index.md`` and ``index.html`` beside ``ledger_path`` under the ledger's
    lock; return their paths. Raises ``InvalidInput`` (malformed ledger, unwritable folder, lock
    not obtained within ``lock_timeout`` seconds)."""
    ledger_path = Path(ledger_path)
    out = reports_dir(ledger_path)
    try:
        with FileLock(str(ledger_path) + ".lock", timeout=lock_timeout):
            page = build_index(ledger_path)
            md, html = page.write(out / INDEX_MD, out / INDEX_HTML)
    except Timeout as e:
        raise InvalidInput(f"{ledger_path}: could not take the ledger lock within {lock_timeout:g} s to render the index") from e
    except OSError as e:
        raise InvalidInput(f"{out}: cannot write the index: {e.strerror or e}") from e
    return md, html


def refresh_index_quietly(ledger_path: str | Path) -> bool:
    """``refresh_index``; on failure one warning line on stderr and False (the evidence is already
    written and the index is only a rendering of it)."""
    try:
        refresh_index(ledger_path)
    except HarnessError as e:
        sys.stderr.write(f"harness: warning: evidence index not regenerated: {untrusted(e)}\n")
        return False
    return True
