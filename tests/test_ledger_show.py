"""`harness ledger show`: trends per candidate and rows, filtered, within 120 columns; CSV/JSON
for machines; and the numbers and texts the reports print (harness.evidence.fmt / page)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from rich.cells import cell_len

from harness.evidence import fmt
from harness.evidence import ledger as L
from harness.evidence.page import Code, Link, Page, md_escape, untrusted

LONG = "command:" + "a-very-long-engine-name-" * 4


@pytest.fixture()
def ledger(tmp_path):
    p = tmp_path / "ledger.jsonl"
    base = {"kind": "parity", "model": "fixture:trained-qwen35", "quant": "ALL_F32", "reference": "llama.cpp llama-cpp-python 0.3.36",
            "positions": 1479, "near_tie_flips": 0, "hard_flips": 0, "argmax_agreement": 1.0, "basis_kind": "measured"}
    rows = [
        dict(base, candidate="oracle qwen35-float64 (numpy 2.4.6)", min_cosine=0.9999999675309167, kld_mean=2.4831330054892567e-08, verdict="PASS",
             time="2026-11-01T10:00:00Z"),
        dict(base, candidate="mutant:qk-norm-skipped qwen35-float64", min_cosine=0.9366118590100881, kld_mean=0.008472548427883307, verdict="FAIL",
             time="2026-11-02T10:00:00Z"),
        dict(base, candidate="oracle qwen35-float64 (numpy 2.4.6)", min_cosine=0.9999999, kld_mean=3e-08, verdict="PASS", time="2026-11-03T10:00:00Z",
             candidate_tokens_per_s=812.5, candidate_wall_s=3.5, candidate_load_s=0.2),
        dict(base, candidate=f"{LONG} 1.0 " + "x" * 60, model="/very/long/path/to/a/model/" + "m" * 80 + ".gguf", quant="Q4_K_M",
             min_cosine=None, kld_mean=None, argmax_agreement=None, positions=20, verdict="UNMEASURED", time="2026-11-04T10:00:00Z"),
        dict(base, kind="probe", candidate="llama.cpp llama-cpp-python 0.3.36", min_cosine=0.9999999881866312, kld_mean=None,
             argmax_agreement=None, verdict="PASS", time="2026-11-05T10:00:00Z"),
        dict(base, kind="probe", candidate="llama.cpp llama-cpp-python 0.3.36", min_cosine=0.9999999881866312, kld_mean=None,
             argmax_agreement=None, verdict="PASS", time="2026-11-06T10:00:00Z", candidate_tokens_per_s=2000.0, candidate_wall_s=1.0),
        dict(base, kind="probe", candidate="llama.cpp llama-cpp-python 0.3.36", min_cosine=0.9999999881866312, kld_mean=None,
             argmax_agreement=None, verdict="PASS", time="2026-11-07T10:00:00Z", candidate_tokens_per_s=1500.0, candidate_wall_s=1.3),
    ]
    for r in rows:
        L.append_row(p, r)
    L.append_row(p, L.supersede_row(3, "rerun on the wrong build"))  # seq 8
    return p


def show(ledger, *args):
    # env given: a child otherwise inherits the process's C environment, where a COLUMNS=80 os.environ does not show was
    # seen under pytest, and ledger show honours $COLUMNS (issue 48)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([sys.executable, "-m", "harness", "ledger", "show", "--ledger", str(ledger), *args], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("args", [[], ["--rows"]])
def test_show_fits_120_columns_and_rounds(ledger, args):
    out = show(ledger, *args)
    widths = [cell_len(line) for line in out.splitlines()]
    assert max(widths) <= 120, max(widths)
    assert "0.9999999675309167" not in out and "nan" not in out.lower() and "None" not in out
    assert "1 − 3.2e-08" in out and "0.9366" in out
    assert "model /very/long/path/to/a/model/mmm" in out and "m.gguf (Q4_K_M)" in out  # long names cut in the middle, not wrapped


def test_show_trends_per_candidate_count_standing_runs(ledger):
    out = show(ledger)
    oracle = next(line for line in out.splitlines() if line.startswith("oracle "))
    assert " 1 " in oracle and "1/0/0" in oracle and "PASS #1 2026-11-01" in oracle  # seq 3 was withdrawn by seq 8
    assert oracle.rstrip().endswith("—")  # the standing oracle run recorded no timings
    llama = next(line for line in out.splitlines() if line.startswith("llama.cpp "))
    assert "3/0/0" in llama and llama.rstrip().endswith("1.5e+03 (0.86×)")  # last 1500 tok/s vs median 1750
    rows = show(ledger, "--rows")
    assert "PASS †8" in rows and "†N: withdrawn by supersede row #N" in rows


def test_show_filters(ledger):
    assert "mutant:qk-norm-skipped" in show(ledger, "--verdict", "fail") and "oracle" not in show(ledger, "--verdict", "FAIL")
    assert "llama.cpp" in show(ledger, "--kind", "probe") and "mutant" not in show(ledger, "--kind", "probe")
    only_mutants = show(ledger, "--candidate", "mutant:", "--rows")
    assert "mutant:qk-norm-skipped" in only_mutants and "oracle" not in only_mutants
    assert "no rows match: 0 of 8 rows (since 2030-01-01)" in show(ledger, "--since", "2030-01-01")
    since = json.loads(show(ledger, "--since", "2026-11-04", "--format", "json"))
    assert [r["seq"] for r in since["rows"]] == [8, 7, 6, 5, 4]
    assert "Q4_K_M" in show(ledger, "--model", "Q4_K") and "trained-qwen35" not in show(ledger, "--model", "Q4_K")
    r = subprocess.run([sys.executable, "-m", "harness", "ledger", "show", "--ledger", str(ledger), "--since", "yesterday-ish"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("harness: INVALID: --since 'yesterday-ish'")


def test_show_csv_and_json_are_unrounded_and_null_not_nan(ledger):
    rows = pd.read_csv(io.StringIO(show(ledger, "--rows", "--format", "csv")))
    assert rows["seq"].tolist() == [8, 7, 6, 5, 4, 3, 2, 1]
    assert rows.loc[rows["seq"] == 7, "candidate_tokens_per_s"].item() == 1500.0
    assert rows.loc[rows["seq"] == 1, "min_cosine"].item() == 0.9999999675309167
    trends = pd.read_csv(io.StringIO(show(ledger, "--format", "csv")))
    assert set(trends["candidate"]) == {"oracle", "mutant:qk-norm-skipped", LONG, "llama.cpp"}
    doc = json.loads(show(ledger, "--format", "json"))
    assert set(doc) == {"filters", "rows", "trends", "summary", "proposed_report_only"}
    text = json.dumps(doc, allow_nan=False)  # raises on NaN
    assert "NaN" not in text
    o = next(t for t in doc["trends"] if t["candidate"] == "oracle")
    assert (o["runs"], o["last_seq"], o["worst_min_cosine"]) == (1, 1, 0.9999999675309167)


def test_numbers_are_rounded_to_their_noise():
    assert fmt.cosine(0.9999999675309167) == "1 − 3.2e-08"
    assert fmt.cosine(0.964896681010706) == "0.9649"
    assert fmt.cosine(1.0) == "1" and fmt.cosine(None) == "n/a" and fmt.cosine(float("nan")) == "non-finite"
    assert fmt.cosine_threshold(0.999999) == "0.999999 (1 − 1e-06)"
    assert fmt.kld(2.4831330054892567e-08) == "2.5e-08" and fmt.kld(0.008472548427883307) == "0.0085" and fmt.kld(0) == "0"
    assert fmt.rate(0.8985801217038539, 0.882147614760001, 0.9129475000863702) == "89.9% [88.2%, 91.3%]"
    assert fmt.percent(0.99996) == "99.996%" and fmt.percent(1.0) == "100%" and fmt.percent(1e-7) != "0.0%"
    assert fmt.when("2026-11-29T22:53:37Z") == "2026-11-29 22:53 UTC"


def test_token_text_from_the_gguf_vocabulary_is_decoded_and_escaped():
    from harness.fixtures import synthetic as fx
    from harness.model.vocab import Vocab, bytes_to_unicode

    toks, _, _ = fx.build_vocab()
    v = Vocab(toks, "gpt2")
    the = next(i for i, t in enumerate(toks) if t == "Ġthe")
    assert fmt.token_text(v, the) == "' the'"
    assert fmt.token_text(v, toks.index("Ċ")) == "'\\n'"
    assert fmt.token_text(v, toks.index("<|im_end|>")) == "'<|im_end|>'"
    assert fmt.token_text(v, 10**6) is None and fmt.token_text(None, the) is None
    lone = next(i for i, t in enumerate(toks[:256]) if t == bytes_to_unicode()[0xE4])
    assert fmt.token_text(v, lone) == "'\\xe4'"  # a byte that is not UTF-8 on its own
    assert Vocab(["\u2581the", "<0x0A>"], "llama").raw(0) == " the" and Vocab(["\u2581the", "<0x0A>"], "llama").raw(1) == "\n"
    where = {"prompt": "code-python", "position": 23, "token": the}
    assert fmt.position_text(where, v) == f"prompt 'code-python', position 23 (token {the} ' the')"
    assert fmt.position_text(where, None) == f"prompt 'code-python', position 23 (token {the})"
    assert fmt.quoted("it's\x1b[31m\u202e") == "'it\\'s\\x1b[31m\\u202e'"


def test_page_escapes_untrusted_text_for_markdown_and_html():
    nasty = "<img src=x onerror=alert(1)> | *b* [l](http://x) `c`\x1b\u202e"
    assert untrusted("a\x1bb\u202ec\nd") == "a\\x1bb\\u202ec\\nd"
    md = md_escape(nasty)
    assert "<img" not in md and "\\|" in md and "\\*b\\*" in md and "\\[l\\]" in md and "\x1b" not in md
    page = Page("t").table(["a", "b"], [[nasty, Code(nasty)]]).p(Link(nasty, "x.md", "x.html"))
    html = page.to_html()
    assert "<img" not in html and "&lt;img" in html and 'href="x.html"' in html
    text = page.to_markdown()
    row = text.splitlines()[2]
    assert row.count(" | ") == 1 + 0 and row.startswith("| ") and row.endswith(" |")  # the pipes inside stay escaped
    assert page.links() == ["x.md"] and page.links(html=True) == ["x.html"]


def test_show_says_when_the_query_cache_does_not_match_the_ledger(ledger):
    """Issue 44: an UPDATE in the query cache (row 2's FAIL set to PASS) was listed as PASS while
    ``ledger verify`` said OK. ``show`` compares the cache with the ledger, says which row and
    column disagreed, rebuilds it and lists the ledger's verdict; the next show says nothing."""
    import sqlite3

    from harness.evidence.ledger_cache import cache_path

    show(ledger)  # the cache exists and matches
    con = sqlite3.connect(cache_path(ledger))
    assert con.execute("UPDATE rows SET verdict='PASS' WHERE seq=2").rowcount == 1
    con.commit()
    con.close()
    out = show(ledger, "--rows")
    assert " ".join(out.split()).startswith("query cache did not match the ledger's head (ledger.jsonl.cache.sqlite row 2: verdict is 'PASS' in the "
                                   "cache but 'FAIL' in the ledger); rebuilt from the ledger: the rows shown are the ledger's")
    assert "| 2 | FAIL |" not in out and [line.split()[:4] for line in out.splitlines() if line.split()[:1] == ["2"]] == [
        ["2", "2026-11-02", "parity", "FAIL"]]
    doc = json.loads(show(ledger, "--json"))
    assert [r["verdict"] for r in doc["rows"] if r["seq"] == 2] == ["FAIL"]
    assert "query cache" not in show(ledger, "--rows")
