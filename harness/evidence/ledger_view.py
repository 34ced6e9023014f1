"""``harness ledger show``: the ledger as a person reads it (rich tables at the console's width
whose ids and numbers are never wrapped or cut: a list where the width is too narrow,
``display.print_table``) and as a machine reads it (CSV or JSON, unrounded).

Two views over the rows that match the filters (``ledger.filter_frame``): trends per candidate
(``ledger.candidate_trends``: runs by verdict, the last result and the worst one) and the rows
themselves, newest first. Numbers are rounded as in the reports (``harness.evidence.fmt``);
every string from the ledger is escaped before it reaches the terminal (rich ``Text``, never
markup). The report-only threshold proposals (``ledger.proposed_report_only_thresholds``) follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.text import Text

from harness.display import print_table
from harness.evidence import fmt
from harness.evidence.views import (
    REPORT_ONLY_MIN_RECORDS,
    _num,
    candidate_trends,
    engine_name,
    filter_frame,
    ledger_frame,
    proposed_report_only_thresholds,
)
from harness.evidence.page import untrusted

ROW_COLUMNS = ["seq", "time", "kind", "verdict", "candidate", "compute_class", "model", "quant", "positions", "min_cosine", "kld_mean",
               "argmax_agreement", "hard_flips", "candidate_tokens_per_s", "candidate_wall_s", "superseded_by", "supersedes", "reason",
               "receipt_id"]
"""Columns of the rows view in CSV/JSON."""

_STYLE = {"PASS": "green", "FAIL": "bold red", "UNMEASURED": "yellow"}
_KIND = {"self-consistency": "self"}


def _cell(value: Any) -> str:
    """Untrusted text for a table cell (``page.untrusted``), "" for null or NaN."""
    return untrusted("" if value is None or (isinstance(value, float) and pd.isna(value)) else value)


def _speed(tps: Any, vs_median: Any) -> str:
    """``1.2e+03 (0.95×)``: the last prefill tokens/s and its ratio to the median, or a dash."""
    t, r = _num(tps), _num(vs_median)
    if t is None:
        return "—"
    return f"{t:.3g}" + (f" ({r:.2f}×)" if r is not None else "")


def _shorten(s: str, n: int = 100) -> str:
    """``s`` cut in the middle to at most ``n`` characters (a long path keeps its start and file name)."""
    return s if len(s) <= n else s[: n // 2 - 1] + "…" + s[-(n - n // 2):]


@dataclass
class LedgerView:
    """The filtered rows of a ledger, their trends per candidate, and the report-only proposals
    (computed on the whole ledger, not the filtered rows)."""

    rows: pd.DataFrame
    trends: pd.DataFrame
    proposals: dict[str, Any]
    total: int
    filters: dict[str, Any]
    cache_rebuilt: str | None = None
    """Why the query cache did not match the ledger and was rebuilt before it was read, else None."""

    @classmethod
    def load(cls, ledger_path: str | Path, **filters: Any) -> "LedgerView":
        """Read and filter a ledger (``filter_frame`` keywords). Raises ``InvalidInput``."""
        df = ledger_frame(ledger_path)
        rows = filter_frame(df, **filters)
        return cls(rows, candidate_trends(rows), proposed_report_only_thresholds(df), len(df), {k: v for k, v in filters.items() if v},
                   df.attrs.get("cache_rebuilt"))

    def cache_line(self) -> str | None:
        """``query cache did not match the ledger's head (why); rebuilt from the ledger: the rows
        shown are the ledger's``, or None when the cache matched."""
        if self.cache_rebuilt is None:
            return None
        return f"query cache did not match the ledger's head ({self.cache_rebuilt}); rebuilt from the ledger: the rows shown are the ledger's"

    # -------------------------------------------------------------- machines

    def row_records(self) -> list[dict[str, Any]]:
        """The filtered rows, newest first, as plain dicts (``ROW_COLUMNS``; null, never NaN)."""
        out = []
        for _, r in self.rows.sort_values("seq", ascending=False).iterrows():
            d = {}
            for c in ROW_COLUMNS:
                v = r.get(c)
                if c == "time":
                    v = v.isoformat() if pd.notna(v) else None
                elif c in ("min_cosine", "kld_mean", "argmax_agreement", "candidate_tokens_per_s", "candidate_wall_s"):
                    v = _num(v)
                elif c in ("seq", "positions", "hard_flips", "superseded_by", "supersedes"):
                    v = None if pd.isna(v) else int(v)
                else:
                    v = None if v is None or (isinstance(v, float) and pd.isna(v)) else v
                d[c] = v
            out.append(d)
        return out

    def trend_records(self) -> list[dict[str, Any]]:
        """Trends per candidate as plain dicts (null, never NaN)."""
        recs = self.trends.to_dict(orient="records")
        return [{k: (_num(v) if isinstance(v, float) else v) for k, v in r.items()} for r in recs]

    def to_json(self) -> dict[str, Any]:
        """``{filters, rows, trends, summary, proposed_report_only}`` (``summary``: the trends, kept
        under its earlier name)."""
        trends = self.trend_records()
        return {"filters": self.filters, "rows": self.row_records(), "trends": trends, "summary": trends,
                "proposed_report_only": self.proposals}

    def to_csv(self, rows: bool) -> str:
        """The rows view (``rows``) or the trends as CSV, unrounded."""
        if rows:
            return pd.DataFrame(self.row_records(), columns=ROW_COLUMNS).to_csv(index=False)
        t = self.trends.copy()
        t["versions"] = t["versions"].map(lambda v: "; ".join(v))
        return t.to_csv(index=False)

    # -------------------------------------------------------------- people

    def print(self, console: Console, rows: bool) -> None:
        """Print the tables (trends, or ``rows``), one per model, and the proposals to ``console``."""
        shown = len(self.rows)
        if self.cache_line():
            console.print(Text(untrusted(self.cache_line()), style="bold red"))
        what = f"{shown} of {self.total} rows" + (f" ({', '.join(f'{k} {v}' for k, v in self.filters.items())})" if self.filters else "")
        if shown == 0:
            console.print(Text(f"no rows match: {what}" if self.total else "(empty ledger)"))
        else:
            console.print(Text(("ledger rows, newest first: " if rows else "trends per candidate (standing rows only): ") + what, style="bold"))
            for title, columns, cells, right in (self._rows_tables() if rows else self._trends_tables()):
                console.print()
                print_table(console, title, columns, cells, right=right, fold=("reason",), styles=_STYLE, compact=True,
                            keys=1 if not rows else 2 if title.startswith("withdrawals") else 4)
            if rows and self.rows["superseded_by"].notna().any():
                console.print(Text("†N: withdrawn by supersede row #N (rows are never edited; the withdrawn result no longer stands)"))
            console.print()
        for line in self._proposal_lines():
            console.print(Text(line))

    def _trends_tables(self) -> list[tuple[str, list[str], list[list[str]], list[str]]]:
        """``(title, columns, rows, right-justified columns)`` of the trends, one table per model
        and compute class (newest first; the title names both): a candidate's f32 and bf16 runs
        are two trends, never one."""
        out = []
        trends = self.trends.copy()
        trends["model_key"] = [_shorten(f"{m} ({q})") + (f", {c} compute" if isinstance(c, str) else ", compute class not recorded")
                               for m, q, c in zip(trends["model"].fillna("—"), trends["quant"].fillna("n/a"), trends["compute_class"])]
        columns = ["candidate", "kind", "runs", "P/F/U", "last run", "lowest cos", "worst cos", "KLD mean", "tok/s (vs median)"]
        for key in dict.fromkeys(trends["model_key"]):  # newest model first
            cells = []
            for _, r in trends[trends["model_key"] == key].iterrows():
                cells.append([_cell(r["candidate"]), _KIND.get(r["kind"], r["kind"]), str(r["runs"]),
                              f"{r['pass']}/{r['fail']}/{r['other']}", f"{r['last_verdict']} #{r['last_seq']} {str(r['last_time'] or '')[:10]}",
                              fmt.cosine(_num(r["last_min_cosine"])), fmt.cosine(_num(r["worst_min_cosine"])), fmt.kld(_num(r["last_kld_mean"])),
                              _speed(r["candidate_tokens_per_s_last"], r["candidate_speed_vs_median"])])
            out.append((f"model {key}", columns, cells, [*columns[2:4], *columns[5:]]))
        return out

    def _rows_tables(self) -> list[tuple[str, list[str], list[list[str]], list[str]]]:
        """``(title, columns, rows, right-justified columns)`` of the rows, newest first, one table
        per model, then the withdrawals and the sign-offs."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in self.row_records():
            key = ("withdrawals (supersede rows)" if r["kind"] == "supersede" else "sign-offs (harness signoff rows)" if r["kind"] == "signoff"
                   else "model " + _shorten(f"{r['model'] or '—'} ({r['quant'] or 'n/a'})"))
            groups.setdefault(key, []).append(r)
        columns = ["#", "date", "kind", "verdict", "candidate", "class", "pos.", "lowest cos", "KLD mean", "argmax", "tok/s", "receipt"]
        out = []
        for key, rs in groups.items():
            if key.startswith("withdrawals"):
                out.append((key, ["#", "date", "withdraws", "reason"],
                            [[str(r["seq"]), (r["time"] or "")[:10], f"#{r['supersedes']}", _cell(r["reason"])] for r in rs], ["#"]))
                continue
            cells = []
            for r in rs:
                v = r["verdict"] or "—"
                if r["superseded_by"]:
                    v += f" †{r['superseded_by']}"
                cells.append([str(r["seq"]), (r["time"] or "")[:10], _KIND.get(r["kind"], r["kind"]), v, _cell(engine_name(r["candidate"]) or "—"),
                              _cell(r["compute_class"] or "—"),
                              "—" if r["positions"] is None else str(r["positions"]), fmt.cosine(r["min_cosine"]), fmt.kld(r["kld_mean"]),
                              fmt.percent(r["argmax_agreement"]), _speed(r["candidate_tokens_per_s"], None), (r["receipt_id"] or "—")[:8]])
            out.append((key, columns, cells, ["#", "pos.", "lowest cos", "KLD mean", "argmax", "tok/s"]))
        return out

    def _proposal_lines(self) -> list[str]:
        out = []
        for field, prop in self.proposals.items():
            if prop is None:
                out.append(f"report-only {field}: no threshold proposed (needs {REPORT_ONLY_MIN_RECORDS} standing PASS parity records)")
            else:
                rel = "≥" if prop["direction"] == "at least" else "≤"
                out.append(f"report-only {field}: proposed {rel} {fmt.sig2(prop['value'])} from {prop['n']} PASS rows "
                           f"(seq {prop['seqs'][0]}–{prop['seqs'][1]}); not applied: add it to thresholds.yaml with a measured basis to adopt it")
        return out
