"""The ledger's pandas views: the frame of every row, the ``ledger show`` summary, the trends per
candidate, the filters, and the report-only thresholds the ledger proposes. Read from the query
cache after it is compared with the ledger (an index, never a verdict's source).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import InvalidInput
from harness.evidence.ledger_cache import LedgerCache
from harness.evidence.rows import CACHE_COLUMNS, REPORT_ONLY_MIN_RECORDS, read_rows


class _Pandas:
    """``pandas``, imported on first use: only the ledger views (``ledger show``, trends) need it,
    and importing it costs a parity run about a second it would otherwise not spend."""

    def __getattr__(self, name: str) -> Any:
        import pandas

        return getattr(pandas, name)


pd = _Pandas()


def ledger_frame(ledger_path: str | Path) -> pd.DataFrame:
    """All rows as a DataFrame (one row per ledger row, columns ``ROW_FIELDS`` + optional ones),
    with ``time`` parsed to UTC timestamps and ``superseded_by`` (seq or NA). Read from the query
    cache (``LedgerCache``: columns through ``pandas.read_sql_query``) after the cache is compared
    with the ledger and rebuilt where it disagrees (``LedgerCache.open(check=True)``;
    ``df.attrs["cache_rebuilt"]`` says why, else None), so the verdicts shown are the ledger's.
    Raises ``InvalidInput`` naming a line that is not a row."""
    cols = list(CACHE_COLUMNS)
    with LedgerCache.open(ledger_path, CACHE_COLUMNS, check=True) as cache:
        if cache.bad_line is not None:
            read_rows(ledger_path)  # names the bad line (InvalidInput)
        df = pd.read_sql_query(cache.frame_query(cols), cache.con)
        by = cache.superseded()
        df.attrs["cache_rebuilt"] = cache.rebuilt
    for c in ("builds", "cells", "relied_on", "blocked"):  # JSON text in the cache
        df[c] = df[c].map(lambda v: json.loads(v) if isinstance(v, str) else v)
    df["time"] = pd.to_datetime(df["time"], utc=True)
    df["superseded_by"] = pd.array([by.get(s) for s in df["seq"]], dtype="Int64")
    return df


def _effective(df: pd.DataFrame) -> pd.DataFrame:
    """Measurement rows that stand: no supersede or sign-off rows, nothing superseded."""
    return df[~df["kind"].isin(["supersede", "signoff"]) & df["superseded_by"].isna()]


def summarize_ledger(ledger_path: str | Path) -> pd.DataFrame:
    """The ``harness ledger show`` table: one line per (model, quant, candidate, reference, kind)
    over rows that stand (no supersede rows, nothing superseded), with run counts by verdict,
    the latest run (seq, ISO time, verdict), the worst and latest min cosine, mean argmax
    agreement and mean KLD, and the candidate's speed across the rows (``_speed_summary``). Raises ``InvalidInput`` on a malformed ledger line."""
    eff = _effective(ledger_frame(ledger_path))
    keys = ["model", "quant", "candidate", "reference", "kind"]
    cols = keys + ["runs", "pass", "fail", "other", "last_seq", "last_time", "last_verdict", "min_cosine_last",
                   "min_cosine_worst", "argmax_agreement_mean", "kld_mean_mean", "basis_kind_last",
                   "candidate_tokens_per_s_last", "candidate_tokens_per_s_median", "candidate_speed_vs_median",
                   "candidate_wall_s_last"]
    if eff.empty:
        return pd.DataFrame(columns=cols)
    out = []
    for key, g in eff.sort_values("seq").groupby(keys, dropna=False, sort=True):
        last = g.iloc[-1]
        out.append(
            dict(
                zip(keys, key),
                runs=len(g),
                **{"pass": int((g["verdict"] == "PASS").sum()), "fail": int((g["verdict"] == "FAIL").sum())},
                other=int((~g["verdict"].isin(["PASS", "FAIL"])).sum()),
                last_seq=int(last["seq"]),
                last_time=last["time"].isoformat() if pd.notna(last["time"]) else None,
                last_verdict=last["verdict"],
                min_cosine_last=last["min_cosine"],
                min_cosine_worst=pd.to_numeric(g["min_cosine"]).min(),
                argmax_agreement_mean=pd.to_numeric(g["argmax_agreement"]).mean(),
                kld_mean_mean=pd.to_numeric(g["kld_mean"]).mean(),
                basis_kind_last=last["basis_kind"],
                **_speed_summary(g),
            )
        )
    return pd.DataFrame(out, columns=cols)


def _speed_summary(g: pd.DataFrame) -> dict[str, Any]:
    """The candidate's speed across one group's rows (oldest first): the last prefill tokens/s,
    the median over the rows that recorded one, the last as a fraction of that median (below 1:
    slower than usual) and the last wall seconds; None where no row recorded timings."""
    tps = pd.to_numeric(g["candidate_tokens_per_s"], errors="coerce")
    last = g.iloc[-1]
    last_tps = pd.to_numeric(pd.Series([last["candidate_tokens_per_s"]]), errors="coerce").iloc[0]
    med = tps.median() if tps.notna().any() else None
    return {
        "candidate_tokens_per_s_last": None if pd.isna(last_tps) else float(last_tps),
        "candidate_tokens_per_s_median": None if med is None or pd.isna(med) else float(med),
        "candidate_speed_vs_median": None if med is None or pd.isna(last_tps) or not med else float(last_tps / med),
        "candidate_wall_s_last": None if pd.isna(pd.to_numeric(pd.Series([last["candidate_wall_s"]]), errors="coerce").iloc[0]) else float(last["candidate_wall_s"]),
    }


_REPORT_ONLY = {
    # field: (direction, how to read the proposal)
    "argmax_agreement": ("at least", "the lowest argmax agreement among known-good runs"),
    "kld_mean": ("at most", "the highest mean KLD among known-good runs"),
    "hard_flip_rate": ("at most", "the highest hard-flip rate (hard flips / positions) among known-good runs"),
}


def proposed_report_only_thresholds(df: pd.DataFrame, min_records: int = REPORT_ONLY_MIN_RECORDS) -> dict[str, dict[str, Any] | None]:
    """Proposals for the report-only fields (never applied; a reviewer copies one into
    thresholds.yaml with a measured basis if they accept it).

    ``df`` is ``ledger_frame(...)``. Records are the standing PASS rows of kind ``parity``
    holding the field. A field gets None until it has ``min_records`` (20) records; then
    ``{value, direction, n, seqs, quantiles, basis}`` where ``value`` is the worst known-good
    value (a floor for agreement, a ceiling for KLD and hard flips) and ``basis`` says how it
    was measured.
    """
    good = _effective(df)
    good = good[(good["kind"] == "parity") & (good["verdict"] == "PASS")].copy()
    good["hard_flip_rate"] = pd.to_numeric(good["hard_flips"]) / pd.to_numeric(good["positions"]).where(lambda s: s > 0)
    out: dict[str, dict[str, Any] | None] = {}
    for field, (direction, what) in _REPORT_ONLY.items():
        vals = pd.to_numeric(good[field], errors="coerce")
        ok = vals.notna()
        n = int(ok.sum())
        if n < min_records:
            out[field] = None
            continue
        v = vals[ok].to_numpy(dtype=np.float64)
        seqs = good.loc[ok, "seq"].astype(int).tolist()
        value = float(v.min() if direction == "at least" else v.max())
        q = {f"p{p}": float(np.quantile(v, p / 100)) for p in (5, 50, 95)}
        out[field] = {
            "value": value,
            "direction": direction,
            "n": n,
            "seqs": [min(seqs), max(seqs)],
            "quantiles": q,
            "basis": (
                f"proposed from the ledger: {what} over {n} standing PASS parity rows (seq {min(seqs)}–{max(seqs)}; "
                f"p5 {q['p5']:.6g}, median {q['p50']:.6g}, p95 {q['p95']:.6g}); no known-bad values yet. "
                "Not applied: report-only fields gate only once a reviewer adds them to thresholds.yaml with a measured basis."
            ),
        }
    return out


# ----------------------------------------------------------------------------- ledger show


def engine_name(label: Any) -> str | None:
    """The engine name of a row's ``candidate``/``reference`` label (``"NAME VERSION"``)."""
    if label is None or (isinstance(label, float) and np.isnan(label)):
        return None
    return str(label).split(" ", 1)[0]


def filter_frame(
    df: pd.DataFrame,
    *,
    candidate: str | None = None,
    model: str | None = None,
    kind: str | None = None,
    since: str | None = None,
    verdict: str | None = None,
) -> pd.DataFrame:
    """Rows of ``ledger_frame`` matching every filter given: ``candidate`` and ``model`` are
    substrings of the row's label (``"mutant:"`` selects every mutant), ``kind`` and ``verdict``
    exact (verdict case-insensitive), ``since`` an ISO date or time (UTC unless it names a zone)
    the row's time is at or after. Raises ``InvalidInput`` for a ``since`` that is not a date."""
    out = df
    if candidate:
        out = out[out["candidate"].fillna("").str.contains(candidate, regex=False)]
    if model:
        out = out[(out["model"].fillna("") + " " + out["quant"].fillna("")).str.contains(model, regex=False)]
    if kind:
        out = out[out["kind"] == kind]
    if verdict:
        out = out[out["verdict"].fillna("").str.upper() == verdict.upper()]
    if since:
        try:
            t = pd.Timestamp(since)
        except (ValueError, TypeError):
            raise InvalidInput(f"--since {since!r}: not a date (YYYY-MM-DD or an ISO 8601 time)") from None
        t = t.tz_localize("UTC") if t.tzinfo is None else t.tz_convert("UTC")
        out = out[out["time"] >= t]
    return out


def candidate_trends(df: pd.DataFrame) -> pd.DataFrame:
    """Trends per candidate: one line per (candidate engine name, compute class, model, quant,
    kind) over the standing measurement rows of ``df`` (``ledger_frame``, filtered or not), newest
    group first: an f32 and a bf16 run of one engine are two trends, never one.

    Columns: ``candidate``, ``compute_class`` (None for rows that recorded none), ``model``, ``quant``, ``kind``, ``runs``, ``pass``, ``fail``,
    ``other`` (UNMEASURED and the rest), ``last_seq``, ``last_time`` (ISO), ``last_verdict``,
    ``last_min_cosine``, ``worst_min_cosine`` (lowest over the runs), ``last_kld_mean``,
    ``worst_kld_mean`` (highest), ``versions`` (distinct candidate labels) and the candidate's
    speed (``_speed_summary``: last and median prefill tokens/s, last / median, last wall s).
    """
    eff = _effective(df).copy()
    cols = ["candidate", "compute_class", "model", "quant", "kind", "runs", "pass", "fail", "other", "last_seq", "last_time", "last_verdict",
            "last_min_cosine", "worst_min_cosine", "last_kld_mean", "worst_kld_mean", "versions", "candidate_tokens_per_s_last",
            "candidate_tokens_per_s_median", "candidate_speed_vs_median", "candidate_wall_s_last"]
    if eff.empty:
        return pd.DataFrame(columns=cols)
    eff["engine"] = eff["candidate"].map(engine_name)
    out = []
    for (eng, cls, model, quant, kind), g in eff.sort_values("seq").groupby(["engine", "compute_class", "model", "quant", "kind"], dropna=False,
                                                                             sort=False):
        last = g.iloc[-1]
        cos, kld = pd.to_numeric(g["min_cosine"]), pd.to_numeric(g["kld_mean"])
        out.append({
            "candidate": eng, "compute_class": None if pd.isna(cls) else cls, "model": model, "quant": quant, "kind": kind, "runs": len(g),
            "pass": int((g["verdict"] == "PASS").sum()), "fail": int((g["verdict"] == "FAIL").sum()),
            "other": int((~g["verdict"].isin(["PASS", "FAIL"])).sum()), "last_seq": int(last["seq"]),
            "last_time": last["time"].isoformat() if pd.notna(last["time"]) else None, "last_verdict": last["verdict"],
            "last_min_cosine": _num(last["min_cosine"]), "worst_min_cosine": _num(cos.min()),
            "last_kld_mean": _num(last["kld_mean"]), "worst_kld_mean": _num(kld.max()),
            "versions": sorted({str(c) for c in g["candidate"].dropna()}),
            **_speed_summary(g),
        })
    return pd.DataFrame(out, columns=cols).sort_values("last_seq", ascending=False, ignore_index=True)


def _num(v: Any) -> float | None:
    """A float, or None for null/NaN (JSON and CSV get no NaN)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(f) else f
