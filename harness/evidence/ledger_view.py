"""``harness ledger show``: the ledger as a person reads it (a rich table that fits 120 columns)
and as a machine reads it (CSV or JSON, unrounded).

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
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

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

ROW_COLUMNS = ["seq", "time", "kind", "verdict", "candidate", "model", "quant", "positions", "min_cosine", "kld_mean",
               "argmax_agreement", "hard_flips", "candidate_tokens_per_s", "candidate_wall_s", "superseded_by", "supersedes", "reason",
               "receipt_id"]
"""Columns of the rows view in CSV/JSON."""

_STYLE = {"PASS": "green", "FAIL": "bold red", "UNMEASURED": "yellow"}
_KIND = {"self-consistency": "self"}


def _t(value: Any, style: str = "") -> Text:
    """Untrusted text for a rich table cell (no markup is interpreted)."""
    return Text(untrusted("" if value is None or (isinstance(value, float) and pd.isna(value)) else value), style=style)


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
            for _, table in (self._rows_tables() if rows else self._trends_tables()):
                console.print()
                console.print(table)
            if rows and self.rows["superseded_by"].notna().any():
                console.print(Text("†N: withdrawn by supersede row #N (rows are never edited; the withdrawn result no longer stands)"))
            console.print()
        for line in self._proposal_lines():
            console.print(Text(line))

    @staticmethod
    def _table(title: str, columns: list[tuple[str, dict[str, Any]]]) -> Table:
        t = Table(title=_t(title), title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, expand=False,
                  show_edge=False, collapse_padding=True)
        for name, kw in columns:
            t.add_column(name, no_wrap=True, overflow="ellipsis", **kw)
        return t

    def _trends_tables(self) -> list[tuple[str, Table]]:
        out = []
        trends = self.trends.copy()
        trends["model_key"] = [_shorten(f"{m} ({q})") for m, q in zip(trends["model"].fillna("—"), trends["quant"].fillna("n/a"))]
        for key in dict.fromkeys(trends["model_key"]):  # newest model first
            t = self._table(f"model {key}", [("candidate", dict(max_width=30)), ("kind", dict(max_width=8)), ("runs", dict(justify="right")),
                                             ("P/F/U", dict(justify="right")), ("last run", {}), ("lowest cos", dict(justify="right")),
                                             ("worst cos", dict(justify="right")), ("KLD mean", dict(justify="right")),
                                             ("tok/s (vs median)", dict(justify="right"))])
            for _, r in trends[trends["model_key"] == key].iterrows():
                v = r["last_verdict"]
                t.add_row(_t(r["candidate"]), _t(_KIND.get(r["kind"], r["kind"])), _t(r["runs"]), _t(f"{r['pass']}/{r['fail']}/{r['other']}"),
                          _t(f"{v} #{r['last_seq']} {str(r['last_time'] or '')[:10]}", _STYLE.get(v, "")),
                          _t(fmt.cosine(_num(r["last_min_cosine"]))), _t(fmt.cosine(_num(r["worst_min_cosine"]))), _t(fmt.kld(_num(r["last_kld_mean"]))),
                          _t(_speed(r["candidate_tokens_per_s_last"], r["candidate_speed_vs_median"])))
            out.append((key, t))
        return out

    def _rows_tables(self) -> list[tuple[str, Table]]:
        recs = self.row_records()
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in recs:
            key = ("withdrawals (supersede rows)" if r["kind"] == "supersede" else "sign-offs (harness signoff rows)" if r["kind"] == "signoff"
                   else _shorten(f"{r['model'] or '—'} ({r['quant'] or 'n/a'})"))
            groups.setdefault(key, []).append(r)
        out = []
        for key, rs in groups.items():
            t = self._table(key if key.startswith(("withdrawals", "sign-offs")) else f"model {key}", [("#", dict(justify="right")), ("date", {}), ("kind", dict(max_width=8)), ("verdict", {}),
                                             ("candidate", dict(max_width=24)), ("pos.", dict(justify="right")), ("lowest cos", dict(justify="right")),
                                             ("KLD mean", dict(justify="right")), ("argmax", dict(justify="right")),
                                             ("tok/s", dict(justify="right")), ("receipt", {})])
            for r in rs:
                v = r["verdict"] or "—"
                if r["superseded_by"]:
                    v += f" †{r['superseded_by']}"
                cand = f"withdraws #{r['supersedes']}: {r['reason']}" if r["kind"] == "supersede" else engine_name(r["candidate"]) or "—"
                t.add_row(_t(r["seq"]), _t((r["time"] or "")[:10]), _t(_KIND.get(r["kind"], r["kind"])), _t(v, _STYLE.get(r["verdict"] or "", "")),
                          _t(cand), _t("—" if r["positions"] is None else r["positions"]), _t(fmt.cosine(r["min_cosine"])),
                          _t(fmt.kld(r["kld_mean"])), _t(fmt.percent(r["argmax_agreement"])), _t(_speed(r["candidate_tokens_per_s"], None)),
                          _t((r["receipt_id"] or "—")[:8]))
            out.append((key, t))
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
