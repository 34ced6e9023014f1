"""Verdict pages and the evidence index, rendered for PASS, FAIL and UNMEASURED receipts and
looked at: no Python repr, no over-long float, every link resolves, untrusted text escaped, the
FAIL page explains itself on its first screen, and the HTML opens in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from harness.runs.explain import write_explained_report
from harness.runs.parity import ParityRequest, run_parity
from harness.runs.probes import ProbeRequest, run_probes
from harness.measure.prompts import load_prompts
from harness.evidence.index import INDEX_HTML, INDEX_MD, reports_dir
from harness.evidence.ledger import read_rows, verify_ledger
from harness.evidence.receipts import load_receipt, write_receipt
from harness.evidence.report import write_report

NASTY_ID = "<script>alert(1)</script> | `x` $\\notacommand$ \x1b[31mred [link=x]"
CHROMIUM_INSTALL = "apt-get update && apt-get install -y chromium"


@pytest.fixture(scope="module")
def evidence(tmp_path_factory):
    """A ledger with a FAIL (mutant with activations), a PASS, an UNMEASURED parity receipt and
    a FAIL probe receipt, each with its report written to the default folder."""
    d = tmp_path_factory.mktemp("ev")
    texts = {p.id: p.text for p in load_prompts(None)}
    gated = d / "weather.jsonl"
    gated.write_text(json.dumps({"id": "prose-weather", "text": texts["prose-weather"]}) + "\n")
    short = d / "short.jsonl"
    short.write_text(json.dumps({"id": NASTY_ID, "text": "A short prompt."}) + "\n")
    ledger = d / "ev" / "ledger.jsonl"
    out = {}
    for name, cand, prompts in (("fail", "mutant:qk-norm-skipped", gated), ("pass", "oracle", gated), ("unmeasured", "oracle", short)):
        o = run_parity(ParityRequest(model="fixture:tiny-qwen35", candidate=cand, prompts=str(prompts), ledger=str(ledger),
                                     argv=["harness", "parity", "--candidate", cand]))
        assert o.result.verdict.value == name.upper()
        out[name] = o.receipt_path
    run = run_probes(ProbeRequest(model="fixture:tiny-qwen35", candidate="mutant:conv-state-dropped", only=["decode"], ledger=str(ledger)))
    assert run.verdict.value == "FAIL"
    out["probe"] = run.receipt_path
    reports = {k: write_explained_report(p) for k, p in out.items()}
    return ledger, out, reports


def _first_screen(md: str) -> str:
    return md.split("\n## ", 1)[0]


def test_fail_page_first_screen_states_verdict_worst_position_divergence_cause_and_commands(evidence):
    _, receipts, reports = evidence
    md = reports["fail"].read_text()
    first = _first_screen(md)
    rec = load_receipt(receipts["fail"]).receipt
    worst = rec["gated"]["worst"]
    assert first.startswith("# FAIL · mutant:qk-norm-skipped vs llama.cpp on fixture:tiny-qwen35")
    # the worst position with its token's text from the model's vocabulary
    assert f"| worst position | prompt 'prose-weather', position {worst['position']} (token {worst['token']} `'" in first
    # localization ran on the receipt's token ids and found the planted fault's layer and op
    assert "| first divergent layer and op | **layer 3 (attention), op `Qcur_normed`**" in first
    assert "| likely cause | **QK-norm skipped" in first and "mutant:qk-norm-skipped" in first
    assert "| reproduce | `harness parity --model fixture:tiny-qwen35 --candidate mutant:qk-norm-skipped --reference llama.cpp --prompts " in first
    assert "| localize | `harness localize --candidate mutant:qk-norm-skipped --model fixture:tiny-qwen35 --prompt prose-weather" in first
    loc = json.loads((reports["fail"].parent / "localization.json").read_text())
    assert (loc["first_divergence"]["layer"], loc["first_divergence"]["op"]) == (3, "Qcur_normed")
    assert (reports["fail"].parent / "layers.png").stat().st_size > 5_000
    # the gates as a table and report-only fields marked, commands again at the end
    assert "| gate | threshold | observed | basis | ok |" in md and "| field (report-only) | value | how to read it |" in md
    assert md.rstrip().splitlines()[-1].startswith("| check the ledger | `harness ledger verify --ledger ")


def test_fail_without_activations_names_the_capability(evidence, tmp_path):
    _, receipts, _ = evidence
    loaded = load_receipt(receipts["fail"])
    rec = dict(loaded.receipt)
    rec["engines"] = json.loads(json.dumps(rec["engines"]))
    rec["engines"]["candidate"].update(name="command:my-engine", capabilities=["chunks"], build={})
    jp, _ = write_receipt(rec, loaded.arrays, tmp_path / "receipts")
    md = write_explained_report(jp).read_text()
    assert "does not declare the activations capability" in _first_screen(md)
    assert "harness localize --candidate command:my-engine" in md
    assert not (jp.parent.parent / "reports" / rec_id(jp) / "localization.json").exists()


def rec_id(jp: Path) -> str:
    return jp.stem[:16]


def test_unmeasured_page_says_it_is_not_a_pass(evidence):
    md = evidence[2]["unmeasured"].read_text()
    assert _first_screen(md).startswith("# UNMEASURED · oracle vs llama.cpp")
    assert "this is not a PASS" in md and "too few: UNMEASURED" in md and "not judged" in md


_FLOAT = re.compile(r"(?<![\w.])(-?\d+\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")


def _significant(num: str) -> int:
    digits = num.lstrip("-").replace(".", "").lstrip("0")
    return len(digits.rstrip("0")) if "." in num else len(digits)


def _pages(evidence) -> list[Path]:
    ledger, _, reports = evidence
    out = []
    for md in reports.values():
        out += [md, md.with_suffix(".html")]
    return out + [reports_dir(ledger) / INDEX_MD, reports_dir(ledger) / INDEX_HTML]


def test_no_python_repr_raw_null_or_long_float_on_any_page(evidence):
    for page in _pages(evidence):
        text = page.read_text()
        for bad in ("{'", "['", "': ", "None", "nan", "NaN", "inf"):
            assert not re.search(rf"(?<![\w]){re.escape(bad)}(?![\w])" if bad.isalpha() else re.escape(bad), text), f"{page.name}: {bad!r}"
        assert not re.search(r"\[-?\d+\.\d+, ", text), page.name  # a Python list of floats
        long = [m.group(0) for m in _FLOAT.finditer(text) if _significant(m.group(1)) > 6]
        assert not long, f"{page}: floats with more than 6 significant digits: {long[:5]}"


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for k, v in attrs:
            if k in ("href", "src"):
                self.refs.append(v)


def test_every_link_resolves(evidence):
    n = 0
    for page in _pages(evidence):
        text = page.read_text()
        if page.suffix == ".md":
            refs = re.findall(r"\]\(([^)\s]+)\)", text)
        else:
            p = _Refs()
            p.feed(text)
            refs = p.refs
        assert refs, page
        for ref in refs:
            assert "://" not in ref, (page, ref)  # static: nothing outside the evidence folder
            assert (page.parent / ref).exists(), f"{page}: {ref} does not resolve"
            n += 1
    assert n > 20


def test_untrusted_prompt_id_is_escaped_everywhere(evidence):
    md_path = evidence[2]["unmeasured"]
    md, html = md_path.read_text(), md_path.with_suffix(".html").read_text()
    assert "\x1b" not in md + html and "\\x1b" in md and "\\x1b" in html
    outside_code = re.sub(r"(`+)(?:(?!\1).)+?\1", "", md)  # inside a code span a tag is shown as text
    assert "<script>" not in outside_code and "&lt;script&gt;" in outside_code and "<script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    p = _Refs()
    p.feed(html)
    assert "script" not in p.tags
    # the id's pipe never splits a table row: every row has as many cells as its header
    for line in md.splitlines():
        if "alert(1)" in line and line.startswith("|"):
            assert "\\|" in line


def test_index_lists_every_receipt_newest_first_and_never_replaces_the_ledger(evidence):
    ledger, receipts, _ = evidence
    rows = read_rows(ledger)
    text = (reports_dir(ledger) / INDEX_MD).read_text()
    seqs = [int(m) for m in re.findall(r"^\| (\d+) \|", text, re.M)]
    assert seqs == sorted((r["seq"] for r in rows), reverse=True) == [4, 3, 2, 1]
    for r in rows:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {r['seq']} |"))
        assert r["receipt_id"][:12] in line and f"**{r['verdict']}**" in line and f"{r['receipt_id'][:16]}/report.md" in line
    assert "known-bad: QK-norm skipped" in text and "known-bad: conv state dropped between chunks" in text
    assert "[`ledger.jsonl`](../ledger.jsonl)" in text
    assert verify_ledger(ledger, ledger.parent / "receipts") == []  # the index writes nothing into the record


def test_probe_page_localizes_the_decode_that_failed(evidence):
    md = evidence[2]["probe"].read_text()
    first = _first_screen(md)
    assert first.startswith("# FAIL · probes of mutant:conv-state-dropped")
    assert "| first failing comparison | probe decode, prefill 1 then 1 token per call: first differing position 1 (token " in first
    assert "**layer 0 (recurrent), op `conv_output_raw`**" in first and "conv state dropped between chunks" in first
    assert "fed in pieces of 1, 1, 1, 1, 1, 1 …" in md  # the receipt's own tokens, fed as the failing probe fed them
    assert "harness report " in first and "--localize" in first


def test_cli_report_writes_markdown_and_html(evidence, tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness", "report", str(evidence[1]["pass"]), "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r" / "report.md").read_text().startswith("# PASS · oracle vs llama.cpp")
    assert (tmp_path / "r" / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert not (tmp_path / "r" / "localization.json").exists()  # a PASS is not localized unless asked


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason=f"headless Chromium not installed; install it with: {CHROMIUM_INSTALL}")
@pytest.mark.parametrize("which", ["fail", "index"])
def test_html_opens_in_headless_chromium_and_is_not_blank(evidence, tmp_path, which):
    import matplotlib.image as mpimg

    ledger, _, reports = evidence
    page = reports_dir(ledger) / INDEX_HTML if which == "index" else reports["fail"].with_suffix(".html")
    shot = tmp_path / "shot.png"
    r = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
                        "--window-size=1280,1000", f"--screenshot={shot}", page.resolve().as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    img = mpimg.imread(shot)[..., :3]
    assert img.shape[:2] == (1000, 1280)
    ink = (img.mean(axis=2) < 0.85).mean()  # share of pixels darker than the page background
    assert img.std() > 0.05 and ink > 0.02, (img.std(), ink)
    red = ((img[..., 0] > 0.7) & (img[..., 1] < 0.3) & (img[..., 2] < 0.3)).mean()
    assert red > 1e-4  # the FAIL badges are drawn (the page's CSS applied)
    assert np.isfinite(img).all()


def test_index_failure_never_costs_the_evidence(evidence, tmp_path, capfd):
    """The index is a rendering: when it cannot be written the receipt and row still are, and a
    one-line warning says so."""
    from harness.evidence.record import record_evidence

    loaded = load_receipt(evidence[1]["pass"])
    ledger = tmp_path / "ev" / "ledger.jsonl"
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "reports").write_text("a file where the reports folder would be")
    rec = record_evidence(loaded.receipt, loaded.arrays, ledger)
    assert rec.row["seq"] == 1 and verify_ledger(ledger, ledger.parent / "receipts") == []
    err = capfd.readouterr().err
    assert err.startswith("harness: warning: evidence index not regenerated: ") and err.count("\n") == 1


def test_rendering_from_the_receipt_alone_and_old_flip_field_names(evidence, tmp_path):
    """``write_report`` alone (no engines, no model file) renders the page from the receipt; a
    receipt written before the per-prompt flip counts took the ledger's names
    (``flips_near_tie`` / ``flips_hard``) renders the same numbers."""
    loaded = load_receipt(evidence[1]["pass"])
    old = dict(loaded.receipt)
    old["per_prompt"] = [{{"near_tie_flips": "flips_near_tie", "hard_flips": "flips_hard"}.get(k, k): v for k, v in p.items()}
                         for p in old["per_prompt"]]
    jp, _ = write_receipt(old, loaded.arrays, tmp_path / "receipts")
    md = write_report(jp).read_text()
    new = write_report(evidence[1]["pass"], tmp_path / "new").read_text()
    table = lambda t: t.split("## Per prompt", 1)[1].split("##", 1)[0]
    assert table(md) == table(new) and " 0 / 0 " in table(md)
    assert "Token texts not shown: token texts were not looked up" in md
