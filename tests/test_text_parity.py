"""Issue 48's features: parity over a text cut into windows (``--text FILE --ctx N``, as
llama-perplexity cuts it) with perplexity, the PPL ratio and Δp as report-only fields; the CI
summary (Markdown, JUnit XML, ``$GITHUB_STEP_SUMMARY``); ``harness doctor``.

The metrics are checked against hand-computed values; the acceptance run (oracle vs llama.cpp on
fixture:tiny-qwen35 over a text of three windows) checks the reference's perplexity against one
computed here in float64 from llama.cpp's own logits of the same windows.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from harness.errors import InvalidInput
from harness.evidence import fmt
from harness.evidence.ci import CiEntry, junit_xml, markdown_summary
from harness.measure import metrics as M
from harness.measure.text_windows import check_ctx, load_text, text_windows
from harness.paths import DEFAULT_PROMPTS

# ------------------------------------------------------------------------------ metrics by hand


def test_next_token_metrics_match_a_hand_computed_example():
    # row 0: softmax([1, 2, 3]) = [0.090031, 0.244728, 0.665241]; candidate softmax([1, 2, 2]) =
    # [0.155362, 0.422319, 0.422319]; the next token is 2, which is also the reference's top token.
    # row 1: reference all zeros (top token 0 by the lower id, p = 1/3), candidate [0, 1, 0]
    # (p(0) = 1 / (2 + e) = 0.211942); no next token.
    ref = np.array([[1, 2, 3], [0, 0, 0]], np.float32)
    cand = np.array([[1, 2, 2], [0, 1, 0]], np.float32)
    m = M.next_token_metrics(ref, cand, [2, -1], [True, True])
    assert m["ref_nll"][0] == pytest.approx(-math.log(0.665241), abs=1e-6)
    assert m["cand_nll"][0] == pytest.approx(-math.log(0.422319), abs=1e-6)
    assert m["delta_p"][0] == pytest.approx(0.422319 - 0.665241, abs=1e-6)
    assert m["delta_p_next"][0] == pytest.approx(0.422319 - 0.665241, abs=1e-6)
    assert m["delta_p"][1] == pytest.approx(1 / (2 + math.e) - 1 / 3, abs=1e-7)
    assert math.isnan(m["ref_nll"][1]) and math.isnan(m["delta_p_next"][1])
    unscored = M.next_token_metrics(ref, cand, [2, -1], [False, True])
    assert math.isnan(unscored["ref_nll"][0]) and math.isnan(unscored["delta_p"][0])


def test_delta_p_of_the_top_token_and_of_the_next_token_differ_when_the_next_token_is_not_the_top():
    ref = np.array([[3, 1, 0]], np.float32)   # top token 0; next token 1
    cand = np.array([[1, 3, 0]], np.float32)
    m = M.next_token_metrics(ref, cand, [1], [True])
    p = lambda row, t: math.exp(row[t]) / sum(math.exp(x) for x in row)  # noqa: E731
    assert m["delta_p"][0] == pytest.approx(p([1, 3, 0], 0) - p([3, 1, 0], 0), abs=1e-6)
    assert m["delta_p_next"][0] == pytest.approx(p([1, 3, 0], 1) - p([3, 1, 0], 1), abs=1e-6)
    assert m["delta_p"][0] < 0 < m["delta_p_next"][0]


def test_next_token_metrics_are_the_same_block_by_block():
    rng = np.random.default_rng(7)
    ref = rng.normal(0, 3, (9, 50)).astype(np.float32)
    cand = (ref + rng.normal(0, 0.1, ref.shape)).astype(np.float32)
    nxt = rng.integers(0, 50, 9)
    sc = np.arange(9) >= 3
    whole = M.next_token_metrics(ref, cand, nxt, sc)
    parts = [M.next_token_metrics(ref[a:b], cand[a:b], nxt[a:b], sc[a:b]) for a, b in ((0, 4), (4, 5), (5, 9))]
    for k in M.NEXT_TOKEN_KEYS:
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
    # and the float64 definition: nll = logsumexp(row) - row[next]
    r64 = ref.astype(np.float64)
    lse = np.log(np.exp(r64 - r64.max(1, keepdims=True)).sum(1)) + r64.max(1)
    np.testing.assert_allclose(whole["ref_nll"][3:], (lse - r64[np.arange(9), nxt])[3:], rtol=1e-6)
    assert np.isnan(whole["ref_nll"][:3]).all()


def test_next_token_metrics_leave_a_non_finite_row_unmeasured():
    ref = np.array([[1, 2, 3], [1, 2, 3]], np.float32)
    cand = np.array([[1, np.nan, 3], [1, 2, 3]], np.float32)
    m = M.next_token_metrics(ref, cand, [0, 0], [True, True])
    assert math.isnan(m["cand_nll"][0]) and math.isnan(m["delta_p"][0])
    assert m["delta_p"][1] == 0.0 and m["cand_nll"][1] == m["ref_nll"][1]
    pm = M.position_metrics(ref, cand)  # the finiteness compare_prompt already has gives the same values
    told = M.next_token_metrics(ref, cand, [0, 0], [True, True], pm["finite"] & pm["ref_finite"])
    for k in M.NEXT_TOKEN_KEYS:
        np.testing.assert_array_equal(told[k], m[k])


def test_a_large_logit_takes_the_shifted_log_partition():
    ref = np.array([[100.0, 99.0, 50.0]], np.float32)  # max above 40: exp(row - max)
    m = M.next_token_metrics(ref, ref - 200, [1], [True])
    assert m["ref_nll"][0] == pytest.approx(math.log1p(math.exp(-1) + math.exp(-50)) + 1, abs=1e-6)
    assert m["cand_nll"][0] == pytest.approx(m["ref_nll"][0], abs=1e-6) and abs(m["delta_p"][0]) < 1e-6


def test_perplexity_summary_matches_a_hand_computed_example():
    # NLLs ln 2 and ln 4 → PPL = exp((ln 2 + ln 4) / 2) = sqrt(8); the candidate's ln 4 twice → 4
    s = M.perplexity_summary(np.array([math.log(2), math.log(4), np.nan]), np.array([math.log(4), math.log(4), 1.0]))
    assert s["positions"] == 2
    assert s["reference"] == pytest.approx(math.sqrt(8))
    assert s["candidate"] == pytest.approx(4.0)
    assert s["ratio"] == pytest.approx(4 / math.sqrt(8))
    assert s["ln_ratio"] == pytest.approx(math.log(2) / 2)
    assert s["ln_ratio_sem"] == pytest.approx(math.log(2) / 2)  # differences ln 2 and 0: std ln2/√2, over √2
    assert M.perplexity_summary(np.array([np.nan]), np.array([1.0])) is None


def test_delta_p_summary_matches_a_hand_computed_example():
    s = M.delta_p_summary(np.array([-0.2, 0.0, 0.1, 0.3, np.nan]))
    assert s["positions"] == 4
    assert s["mean"] == pytest.approx(0.05)
    assert s["rms"] == pytest.approx(math.sqrt((0.04 + 0.01 + 0.09) / 4))
    assert (s["min"], s["max"]) == (pytest.approx(-0.2), pytest.approx(0.3))
    assert s["p50"] == pytest.approx(0.05)  # the median of four: (0 + 0.1) / 2
    assert s["p25"] == pytest.approx(-0.05)  # linear interpolation: -0.2 + 0.75 · 0.2
    assert M.delta_p_summary(np.array([np.nan])) is None


# ------------------------------------------------------------------------------ windows


def test_text_windows_are_cut_as_llama_perplexity_cuts_them():
    w = text_windows(list(range(10, 20)), 4)
    assert [p.id for p in w] == ["text:WINDOW-0", "text:WINDOW-1"]
    assert [p.tokens for p in w] == [[10, 11, 12, 13], [14, 15, 16, 17]]  # 18, 19: after the last whole window
    assert {p.score_from for p in w} == {2}
    bos = text_windows(list(range(10, 20)), 5, bos_id=1)
    assert [p.tokens for p in bos] == [[1, 11, 12, 13, 14], [1, 16, 17, 18, 19]]
    assert bos[0].score_from == 2  # 5 // 2
    with pytest.raises(InvalidInput, match="tokenizes to 3 tokens, fewer than one window of --ctx 4"):
        text_windows([1, 2, 3], 4, path="t.txt")


def test_bad_text_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(InvalidInput, match="cannot|No such|not found|missing|does not exist"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(InvalidInput, match="is empty"):
        load_text(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(InvalidInput, match="not UTF-8"):
        load_text(tmp_path / "latin1.txt")
    with pytest.raises(InvalidInput, match="--ctx 1: a window needs at least 2 tokens"):
        check_ctx(1, 4096)
    with pytest.raises(InvalidInput, match="--ctx 5000 is larger than the model's context_length 4096"):
        check_ctx(5000, 4096)


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def three_window_text(path: Path) -> Path:
    """The first 800 characters of the shipped prompt texts, one after another: 300 tokens on
    fixture:tiny-qwen35, four windows of 64 (the whole set is 23)."""
    texts = [json.loads(line)["text"] for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]
    path.write_text("\n\n".join(t for t in texts if t)[:800], encoding="utf-8")
    return path


@pytest.mark.parametrize("args, message", [
    (["--ctx", "64"], "--ctx: only with --text FILE"),
    (["--text", "T", "--prompts", "P"], "--text and --prompts: one of them"),
    (["--text", "MISSING"], "text file"),
    (["--text", "EMPTY"], "is empty"),
    (["--text", "SHORT", "--ctx", "64"], "tokens, fewer than one window of --ctx 64"),
    (["--text", "T", "--ctx", "1"], "--ctx 1: a window needs at least 2 tokens"),
    (["--text", "T", "--ctx", "4097"], "--ctx 4097 is larger than the model's context_length 4096"),  # tiny-qwen35: qwen35.context_length 4096
])
def test_parity_text_bad_input_exits_2_with_one_line(tmp_path, args, message):
    files = {"T": three_window_text(tmp_path / "t.txt"), "P": DEFAULT_PROMPTS, "MISSING": tmp_path / "missing.txt",
             "EMPTY": tmp_path / "empty.txt", "SHORT": tmp_path / "short.txt"}
    files["EMPTY"].write_text("")
    files["SHORT"].write_text("a few words")
    argv = [str(files.get(a, a)) for a in args]
    r = run_cli("parity", "--model", "fixture:tiny-qwen35", "--no-evidence", "--greedy-tokens", "0", *argv)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harness: INVALID") and message in lines[0], r.stderr


# ------------------------------------------------------------------------------ the acceptance run


def test_parity_over_a_text_of_three_windows_passes_for_the_oracle_with_perplexity_and_delta_p(tmp_path, tiny_path):
    text = three_window_text(tmp_path / "text.txt")
    ledger = tmp_path / "ev" / "ledger.jsonl"
    step = tmp_path / "step-summary.md"
    step.write_text("earlier step\n")
    r = run_cli("parity", "--model", "fixture:tiny-qwen35", "--candidate", "oracle", "--text", str(text), "--ctx", "64",
                "--ledger", str(ledger), "--greedy-tokens", "0", "--summary-md", str(tmp_path / "summary.md"),
                "--junit-xml", str(tmp_path / "junit.xml"), env={"GITHUB_STEP_SUMMARY": str(step)})
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(next((tmp_path / "ev" / "receipts").glob("*/*.json")).read_text())
    assert rec["gated"]["verdict"] == "PASS"
    t = rec["prompts"]["text"]
    assert t["n_ctx"] == 64 and t["windows"] == t["n_tokens"] // 64 >= 3 and t["unused_tokens"] == t["n_tokens"] % 64
    assert t["score_from"] == 32 and rec["prompts"]["path"] == str(text) and rec["prompts"]["count"] == t["windows"]
    assert [p["id"] for p in rec["prompts"]["items"]] == [f"text:WINDOW-{i}" for i in range(t["windows"])]
    assert all(len(p["tokens"]) == 64 for p in rec["prompts"]["items"])

    ro = rec["report_only"]
    ppl = ro["perplexity"]
    assert ppl["positions"] == t["windows"] * (64 - 1 - 32)  # n_ctx - 1 - n_ctx/2 scored a window
    assert abs(ppl["ratio"] - 1) < 1e-4  # the float64 oracle against llama.cpp in F32 on F32 weights
    assert ro["delta_p"]["positions"] == ppl["positions"] and abs(ro["delta_p"]["mean"]) < 1e-4
    assert ro["delta_p"]["min"] <= ro["delta_p"]["p50"] <= ro["delta_p"]["max"]

    # the reference's perplexity, computed here in float64 from llama.cpp's own logits of the windows
    from harness.engines.llamacpp import LlamaCppEngine

    eng = LlamaCppEngine(tiny_path)
    nll = []
    for item in rec["prompts"]["items"]:
        toks = item["tokens"]
        rows = np.concatenate([b for _, b in eng.logits(toks)]).astype(np.float64)
        for pos in range(32, 63):
            row = rows[pos]
            nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[toks[pos + 1]])
    assert ppl["reference"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-6)

    assert f"ratio {fmt.ratio(ppl['ratio'])}" in r.stdout and "Δp (reference's top token) mean" in r.stdout
    report = next((tmp_path / "ev").rglob("report.md")).read_text()
    assert "perplexity" in report and f"ratio {fmt.ratio(ppl['ratio'])}" in report and "Δp, next token" in report

    summary = (tmp_path / "summary.md").read_text()
    assert "| tiny-qwen35 | PASS |" in summary.replace("fixture:", "") and f"| {fmt.ratio(ppl['ratio'])} |" in summary
    assert step.read_text() == "earlier step\n" + summary  # appended, never replaced
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert root.tag == "testsuites" and root.get("failures") == "0" and root.get("errors") == "0"
    names = [c.get("name") for c in root.iter("testcase")]
    assert names == ["release gate", "calibrated tier", *(f"prompt text:WINDOW-{i}" for i in range(t["windows"]))]
    assert int(root.get("tests")) == len(names)

    # the page's reproduce line asks for the same text and window length
    md = run_cli("report", next((tmp_path / "ev" / "receipts").glob("*/*.json")).as_posix(), "--format", "junit")
    assert md.returncode == 0 and ET.fromstring(md.stdout.split("?>", 1)[1]).get("tests") == str(len(names))
    assert f"--text {text} --ctx 64" in report


# ------------------------------------------------------------------------------ CI summary


def _receipt(verdict: str, prompts: list[dict], release: str = "ok", calibrated: str = "ok", message: str = "") -> dict:
    return {"model": {"name": "fixture:tiny-qwen35"}, "engines": {"candidate": {"name": "mutant:x"}, "reference": {"name": "llama.cpp"}},
            "prompts": {"positions": sum(p["positions"] for p in prompts)},
            "gated": {"verdict": verdict, "message": message, "positions": sum(p["positions"] for p in prompts), "failing_positions": 3,
                      "min_cosine_observed": 0.5, "release": {"status": release, "line": f"release gate: {release}"},
                      "calibrated": {"status": calibrated, "line": f"calibrated tier: {calibrated}"}},
            "report_only": {"kld": {"mean": 0.25}, "perplexity": {"ratio": 1.5}, "delta_p": {"mean": -0.125}},
            "per_prompt": prompts}


def test_junit_xml_has_a_failure_per_failed_tier_and_prompt_and_skips_what_was_not_judged():
    fail = _receipt("FAIL", [{"id": "a", "positions": 10, "failing_positions": 3, "first_failing_position": 4, "min_cosine": 0.5},
                             {"id": "b<&>", "positions": 5, "failing_positions": 0}], release="fail", message="cosine 0.5 < 0.98")
    unmeasured = _receipt("UNMEASURED", [{"id": "c", "positions": 5, "failing_positions": 0}], release="unmeasured", calibrated="unmeasured")
    entries = [CiEntry("fixture:tiny-qwen35", fail), CiEntry("fixture:tiny-qwen35", unmeasured),
               CiEntry("broken.gguf", None, "ENGINE-ERROR", "llama.cpp could not load it")]
    root = ET.fromstring(junit_xml(entries).split("?>", 1)[1])
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["parity fixture:tiny-qwen35: mutant:x vs llama.cpp"] * 2 + ["parity broken.gguf"]
    case = {(i, c.get("name")): c for i, s in enumerate(suites) for c in s.findall("testcase")}
    assert case[(0, "release gate")].find("failure").get("message") == "release gate: fail"
    assert case[(0, "calibrated tier")].find("failure") is None and case[(0, "calibrated tier")].find("skipped") is None
    assert "3 of 10 positions" in case[(0, "prompt a")].find("failure").get("message")
    assert list(case[(0, "prompt b<&>")]) == []  # judged and clean: a pass
    assert case[(1, "prompt c")].find("skipped") is not None and case[(1, "release gate")].find("skipped") is not None
    assert case[(2, "run")].find("error").get("message") == "ENGINE-ERROR: llama.cpp could not load it"
    assert [(s.get("tests"), s.get("failures"), s.get("skipped"), s.get("errors")) for s in suites] == [
        ("4", "2", "0", "0"), ("3", "0", "3", "0"), ("1", "0", "0", "1")]
    assert (root.get("tests"), root.get("failures"), root.get("skipped"), root.get("errors")) == ("8", "2", "3", "1")


def test_a_ratio_near_one_is_written_as_its_difference():
    assert [fmt.ratio(x) for x in (1.0, 1 + 2.5e-6, 1 - 2.5e-6, 1.003428, None)] == ["1", "1 + 2.5e-06", "1 \u2212 2.5e-06", "1.00343", "n/a"]
    assert [fmt.signed_percent(x) for x in (0.0, 1.9e-7, -0.125)] == ["0%", "+1.9e-05%", "\u221212%"]


def test_markdown_summary_rows_and_messages():
    md = markdown_summary([CiEntry("m", _receipt("FAIL", [{"id": "a|b", "positions": 10, "failing_positions": 3}],
                                                    message="cosine 0.5 < 0.98 | see"))])
    row = next(line for line in md.splitlines() if line.startswith("| fixture:tiny-qwen35"))
    assert row == "| fixture:tiny-qwen35 | FAIL | 10 | 0.5000 | 3 | 0.25 | 1.5 | −12% |"
    assert "```\ncosine 0.5 < 0.98 | see\n```" in md


# ------------------------------------------------------------------------------ doctor


def test_doctor_reports_this_machine_as_receipts_record_it(tmp_path, tiny_path):
    cache = tmp_path / "cache"
    version = metadata.version("llama_cpp_python")
    (cache / "llama.cpp-abc123").mkdir(parents=True)
    (cache / "llama.cpp-abc123" / "VERSION").write_text(version + "\n")
    (cache / "llama.cpp-abc123" / "COMMIT").write_text("abc123\n")
    from harness.fixtures.synthetic import GENERATOR_VERSION

    fx = cache / f"fixtures-v{GENERATOR_VERSION}"
    fx.mkdir()
    (fx / "a.gguf").write_bytes(b"x" * 1000)
    (fx / "b.json").write_bytes(b"y" * 24)
    env = {"HARNESS_CACHE_DIR": str(cache), "HARNESS_LLAMA_BIN": ""}  # no tool named by the environment either
    r = run_cli("doctor", "--json", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["host"]["python"] == sys.version.split()[0]
    assert d["fixtures_cache"] == {"path": str(fx), "exists": True, "files": 2, "bytes": 1024}
    assert d["llama_cpp"]["commit"] == "abc123"
    from harness.engines.llamacpp import LlamaCppEngine

    info = LlamaCppEngine(tiny_path).info  # what a receipt records of the reference
    assert d["llama_cpp"]["version"] == info.version and d["llama_cpp"]["cpu_features"] == info.build["cpu_features"]
    assert set(d["llama_tools"]) == {"llama-server", "llama-quantize", "llama-imatrix", "llama-perplexity"}
    assert all(v is None for v in d["llama_tools"].values())  # none built under the empty cache
    test_extra = d["extras"]["test"]
    assert {p["name"] for p in test_extra["packages"]} >= {"import-linter", "tiktoken"}
    assert test_extra["installed"] is all(p["version"] is not None for p in test_extra["packages"])
    assert all(p["version"] == metadata.version(p["name"]) for p in test_extra["packages"] if p["version"])
    plain = run_cli("doctor", env=env)
    assert plain.returncode == 0 and "abc123" in plain.stdout and "llama-perplexity" in plain.stdout
