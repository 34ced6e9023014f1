"""Tables people can copy from (issue 32): names in the CLI's rich tables are never wrapped, and
a terminal too narrow for them gets a list instead."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from harness.cli import cli
from harness.engines.mutants import mutant_rows


@pytest.mark.parametrize("columns", [80, 120, 200])
def test_mutants_list_prints_every_name_whole_on_one_line(columns):
    out = CliRunner().invoke(cli, ["mutants", "list"], env={"COLUMNS": str(columns)})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    names = [r["name"] for r in mutant_rows()]
    assert len(names) > 20
    for name in names:
        assert any(name in ln for ln in lines), f"{name} is not whole on any line at COLUMNS={columns}"
    assert all(len(ln) <= columns for ln in lines if "│" in ln or "┃" in ln)  # a table fits its width
    table = any("┃ name" in ln for ln in lines)
    assert table == (columns >= 120)  # at 80 the names leave too little room: a list


def test_long_names_stay_whole_in_a_table_and_other_columns_fold(monkeypatch, capsys):
    from harness import cli as cli_mod

    name = "mutant:" + "x" * 60
    monkeypatch.setenv("COLUMNS", "140")
    cli_mod._render_table("t", ("name", "detail"), [(name, "word " * 60)])
    lines = capsys.readouterr().out.splitlines()
    assert any(name in ln and "│" in ln for ln in lines)  # whole, inside the table
    assert sum("word" in ln for ln in lines) > 1  # the other column folds instead


# ------------------------------------------------------------------------------------------
# Issue 48 (1, 2): every table at COLUMNS=80, on a terminal and not, keeps its ids and numbers
# whole; the compute class shows where results are scanned.

import fcntl  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pty  # noqa: E402
import re  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import termios  # noqa: E402
from pathlib import Path  # noqa: E402

from harness.evidence import ledger as L  # noqa: E402

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)")
MODES = ["terminal", "pipe"]


def run_cli(args, *, tty: bool, columns: int | None = 80, cwd=None, timeout: float = 300) -> tuple[int, str]:
    """``python -m harness ARGS`` with ``$COLUMNS`` set, stdout a pseudo-terminal 200 columns wide
    (``tty``) or a pipe; returns (exit code, stdout without colour codes or carriage returns)."""
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    cmd = [sys.executable, "-m", "harness", *map(str, args)]
    if not tty:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
        return r.returncode, r.stdout
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # a wide terminal: $COLUMNS must win
    p = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    rc = p.wait(timeout=timeout)
    return rc, _ANSI.sub("", b"".join(chunks).decode("utf-8", "replace")).replace("\r\n", "\n")


def whole_on_a_line(out: str, values) -> list[str]:
    """The values that are not whole on any one line of ``out``."""
    lines = out.splitlines()
    return [v for v in values if not any(v in ln for ln in lines)]


LONG_CAND = "command:an-engine-with-a-rather-long-name-v2"


@pytest.fixture()
def class_ledger(tmp_path):
    """A ledger whose rows differ in compute class (f32, bf16, none) and carry long names."""
    p = tmp_path / "ledger.jsonl"
    base = {"kind": "parity", "model": "fixture:trained-qwen35", "quant": "ALL_F32", "reference": "llama.cpp llama-cpp-python 0.3.36",
            "positions": 1479, "near_tie_flips": 0, "hard_flips": 0, "argmax_agreement": 0.99961, "basis_kind": "measured",
            "receipt_id": None}
    rows = [
        dict(base, candidate=f"{LONG_CAND} 1.0", min_cosine=0.9999123, kld_mean=1.26e-05, verdict="PASS", time="2026-11-01T10:00:00Z",
             compute_class="f32", release="ok", calibrated="ok", receipt_id="a1b2c3d4" + "0" * 56),
        dict(base, candidate=f"{LONG_CAND} 1.0", min_cosine=0.9912345, kld_mean=0.0042, verdict="FAIL", time="2026-11-02T10:00:00Z",
             compute_class="bf16", release="ok", calibrated="fail", receipt_id="e5f6a7b8" + "0" * 56),
        dict(base, candidate="mutant:qk-norm-skipped qwen35-float64", min_cosine=0.9366118590100881, kld_mean=0.008472548427883307,
             verdict="FAIL", time="2026-11-03T10:00:00Z", receipt_id="c0ffee12" + "0" * 56),
        dict(base, kind="mtp", candidate="oracle qwen35-float64", min_cosine=0.99999, kld_mean=None, verdict="PASS",
             time="2026-11-04T10:00:00Z", compute_class="f64", receipt_id="d00dfeed" + "0" * 56),
    ]
    for r in rows:
        L.append_row(p, r)
    L.append_row(p, {"kind": "signoff", "verdict": "BLOCKED", "release_name": "demo-1", "builds": {}, "cells": [], "relied_on": [],
                     "blocked": ["x"]})
    return p


@pytest.mark.parametrize("mode", MODES)
def test_ledger_show_rows_at_80_columns_keeps_every_id_and_number_whole(class_ledger, mode):
    rc, out = run_cli(["ledger", "show", "--rows", "--ledger", class_ledger], tty=mode == "terminal")
    assert rc == 0, out
    assert "…" not in out
    ids = ["a1b2c3d4", "e5f6a7b8", "c0ffee12", "d00dfeed", LONG_CAND, "mutant:qk-norm-skipped", "fixture:trained-qwen35",
           "1 − 8.8e-05", "0.9912", "0.9366", "1.3e-05", "0.0042", "0.0085", "99.96%"]
    assert whole_on_a_line(out, ids) == []
    lines = out.splitlines()
    # every row's class is on the row's own record: seq 1 f32, seq 2 bf16, seq 3 none recorded
    for seq, cls in ((1, "f32"), (2, "bf16"), (4, "f64")):
        at = next(i for i, ln in enumerate(lines) if re.match(rf"\s*{seq}\s+2026-11-0{seq}\b", ln))
        block = "\n".join(lines[at:at + 14])
        assert re.search(rf"\b{cls}\b", block), block


@pytest.mark.parametrize("mode", MODES)
def test_ledger_show_trends_split_by_compute_class(class_ledger, mode):
    rc, out = run_cli(["ledger", "show", "--ledger", class_ledger], tty=mode == "terminal")
    assert rc == 0, out
    assert "f32 compute" in out and "bf16 compute" in out and "compute class not recorded" in out
    # one trend per class: the f32 run is a PASS of 1 run, the bf16 run a FAIL of 1 run
    assert out.count(LONG_CAND) == 2  # the f32 trend and the bf16 trend
    doc = json.loads(run_cli(["ledger", "show", "--ledger", class_ledger, "--format", "json"], tty=False)[1])
    mine = sorted((t["compute_class"], t["runs"], t["last_verdict"]) for t in doc["trends"] if t["candidate"] == LONG_CAND)
    assert mine == [("bf16", 1, "FAIL"), ("f32", 1, "PASS")]
    assert {r["seq"]: r["compute_class"] for r in doc["rows"]}[2] == "bf16"


@pytest.mark.parametrize("kind, seqs", [("mtp", [4]), ("signoff", [5])])
def test_ledger_show_takes_every_kind_the_ledger_holds(class_ledger, kind, seqs):
    from harness.cli.release import LEDGER_KINDS
    from harness.evidence.rows import KINDS

    assert LEDGER_KINDS == KINDS
    rc, out = run_cli(["ledger", "show", "--ledger", class_ledger, "--kind", kind, "--format", "json"], tty=False)
    assert rc == 0, out
    assert [r["seq"] for r in json.loads(out)["rows"]] == seqs


def _parity_outcome(compute_class: str):
    from types import SimpleNamespace

    from test_receipts import make_receipt

    from harness.errors import Verdict
    from harness.runs.parity import CellResult

    receipt, _ = make_receipt(seed=1)
    receipt["gated"]["compute_class"] = compute_class
    per_prompt = [dict(id=f"prose-{w}-{'x' * 20}", positions=123456, min_cosine=0.987654321, mean_cosine=0.99912345, argmax_agreement=0.98765,
                       near_tie_flips=12, hard_flips=3456, kld_mean=0.000123456, failing_positions=7890) for w in ("english", "german")]
    result = CellResult(Verdict.PASS, "parity", [], {}, receipt["report_only"], per_prompt, {}, {}, {}, 97, "a message")
    return SimpleNamespace(result=result, receipt=receipt, receipt_path=None)


_PARITY_SNIPPET = """
import sys
sys.path.insert(0, {tests!r})
from test_cli_tables import _parity_outcome
from harness.cli import _render_parity
_render_parity(_parity_outcome({cls!r}))
"""


@pytest.mark.parametrize("mode", MODES)
def test_parity_table_at_80_columns_keeps_prompt_ids_and_numbers_whole_and_names_the_class(tmp_path, mode):
    for cls in ("f32", "bf16"):
        script = tmp_path / f"render_{cls}.py"
        script.write_text(_PARITY_SNIPPET.format(tests=str(Path(__file__).parent), cls=cls))
        env = {**os.environ, "COLUMNS": "80", "TERM": "xterm-256color"}
        if mode == "pipe":
            r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
            assert r.returncode == 0, r.stderr
            out = r.stdout
        else:
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
            p = subprocess.Popen([sys.executable, str(script)], stdout=slave, stderr=subprocess.DEVNULL, env=env)
            os.close(slave)
            data = b""
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                data += chunk
            os.close(master)
            assert p.wait(timeout=120) == 0
            out = _ANSI.sub("", data.decode()).replace("\r\n", "\n")
        ids = [f"prose-english-{'x' * 20}", f"prose-german-{'x' * 20}", "123456", "0.987654", "0.999123", "0.9877", "12/3456", "0.000123",
               "7890"]
        assert whole_on_a_line(out, ids) == [], out
        assert "…" not in out
        assert f"{cls} compute" in out and "F32 weights" in out, out


@pytest.mark.parametrize("mode", MODES)
def test_signoff_commands_at_80_columns_are_whole_on_one_line(tmp_path, mode):
    from test_release import make_project

    root = make_project(tmp_path / "proj", ["oracle", "command:example"], ["tiny-qwen35"])
    rc, out = run_cli(["signoff", "release.yaml", "--no-record"], tty=mode == "terminal", cwd=root)
    assert rc == 5, out
    rc, doc = run_cli(["signoff", "release.yaml", "--no-record", "--json"], tty=False, cwd=root)
    commands = [i["command"] for i in json.loads(doc)["items"] if i["command"]]
    assert len(commands) == 4 and all(len(c) > 80 for c in commands)
    assert whole_on_a_line(out, commands) == []
    assert whole_on_a_line(out, ["fixture:tiny-qwen35", "command:example"]) == []


@pytest.mark.parametrize("mode", MODES)
def test_mutants_list_at_80_columns_on_a_terminal_and_not(mode):
    rc, out = run_cli(["mutants", "list"], tty=mode == "terminal")
    assert rc == 0
    names = [r["name"] for r in mutant_rows()]
    assert whole_on_a_line(out, names) == []
    assert not any("┃ name" in ln for ln in out.splitlines())  # a list at 80, wherever it goes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("columns", [40, 80, 120])
def test_print_table_keeps_whole_columns_whole_at_any_width(mode, columns, monkeypatch):
    """Every table of the CLI is drawn by ``display.print_table`` (below): cells of the columns
    that do not fold are whole on one line, at any width, on a terminal or not."""
    import io

    from harness.cli.render import _render_table

    class Tty(io.StringIO):
        def isatty(self):
            return mode == "terminal"

    out = Tty()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setenv("COLUMNS", str(columns))
    rows = [(f"id-{i:02d}-" + "k" * (3 * i), f"{0.123456789 * i:.9f}", "a free text detail that may fold " * (i % 3), f"cmd --flag-{i} value")
            for i in range(1, 9)]
    _render_table("t", ("id", "number", "detail", "command"), rows, fold=("detail",))
    text = _ANSI.sub("", out.getvalue())
    assert whole_on_a_line(text, [v for r in rows for v in (r[0], r[1], r[3])]) == []
    assert "…" not in text


def test_every_table_is_drawn_by_print_table():
    """No module builds a rich Table of its own: the rule of ``display.print_table`` (names, ids
    and numbers whole; a list when too narrow) then holds for every table the harness prints."""
    root = Path(__file__).resolve().parents[1] / "harness"
    own = [str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "display.py" and re.search(r"\bTable\(", p.read_text())]
    assert own == []


def test_the_index_class_column_names_each_rows_compute_class(class_ledger):
    """Issue 48 (2): the index's class column was "—" in every row; it names the compute class."""
    from harness.evidence import index as I

    md = I.build_index(class_ledger).to_markdown()
    cls = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \|(?:[^|]*\|){5}([^|]*)\|", md, re.M)}
    assert {k: v.strip() for k, v in cls.items()} == {1: "f32 compute", 2: "bf16 compute", 3: "—", 4: "f64 compute", 5: ""}


def test_mutants_list_shows_every_mutant_the_harness_accepts():
    """Issue 48 (4): ``mutants list`` showed the 24 trunk mutants of the 50 ``mutant:NAME`` accepts."""
    from harness.engines.mutants import ALL_MUTANTS, PLANTS
    from harness.engines.registry import resolve_engine  # noqa: F401 - the names it accepts are ALL_MUTANTS'

    out = CliRunner().invoke(cli, ["mutants", "list", "--json"])
    names = [r["name"] for r in json.loads(out.output)]
    assert names == [f"mutant:{m}" for m in ALL_MUTANTS] + [f"planted:{p}" for p in PLANTS]
    assert "mutant:serve-spec-cache-spoiled" in names and "mutant:mtp-slot-crossed" in names
    title = CliRunner().invoke(cli, ["mutants", "list"], env={"COLUMNS": "200"}).output.splitlines()[0]
    assert f"{len(ALL_MUTANTS)} mutants, {len(PLANTS)} plants" in title


def test_the_pass_line_does_not_repeat_the_tier_lines(monkeypatch, capsys):
    """Issue 48 (4): the PASS line was the release line and the calibrated line again."""
    from harness.cli import _render_parity

    monkeypatch.setenv("COLUMNS", "400")
    outcome = _parity_outcome("f32")
    g = outcome.receipt["gated"]
    g["calibrated"].update(status="ok", line="calibrated tier (weights F32, class f32): cosine ≥ 0.99999: ok")
    assert g["release"]["status"] == "ok"
    outcome.result.message = f"{g['release']['line']}; {g['calibrated']['line']}"  # what verdicts.overall says on a PASS
    _render_parity(outcome)
    out = capsys.readouterr().out
    assert out.count(g["release"]["line"]) == 1 and out.count(g["calibrated"]["line"]) == 1
    assert "PASS: release gate ok, calibrated tier ok\n" in out


def test_the_failing_column_says_which_threshold_it_counts(monkeypatch, capsys):
    """Issue 48 (4): a FAIL's "failing" column counted the calibrated tier's failures while the
    release line beside it counts the release gate's: the header names its threshold and tier."""
    from harness.cli import _render_parity

    monkeypatch.setenv("COLUMNS", "400")
    outcome = _parity_outcome("f32")
    g = outcome.receipt["gated"]
    g["min_cosine"] = 0.99995  # the calibrated row's cosine, the one the per-prompt counts use
    _render_parity(outcome)
    out = capsys.readouterr().out
    header = out[: out.index("┡")]  # the header's lines: it folds at its spaces
    assert all(w in header for w in ("below", "0.99995", "(calibrated)")) and "failing" not in header


def test_progress_lines_off_a_terminal_come_every_so_often():
    import io

    from harness.cli.render import _progress_lines

    t = [0.0]
    out = io.StringIO()
    cb = _progress_lines(out, every_s=10, clock=lambda: t[0])
    for done, at, pid in [(16, 1, "a"), (32, 10, "a"), (48, 12, "a"), (64, 20, "b"), (80, 31, "b"), (96, 32, "b")]:
        t[0] = at
        cb(pid, done, 96)
    assert out.getvalue().splitlines() == [
        "harness: parity: prompt a, 32/96 positions compared (33%), 10 s",
        "harness: parity: prompt b, 64/96 positions compared (66%), 20 s",
        "harness: parity: prompt b, 80/96 positions compared (83%), 31 s",
        "harness: parity: prompt b, 96/96 positions compared (100%), 32 s",
    ]
    quick = io.StringIO()
    cb = _progress_lines(quick, every_s=10, clock=lambda: 0.0)
    cb("a", 96, 96)
    assert quick.getvalue() == ""  # a run shorter than the interval prints nothing: its stderr is its last word


def test_parity_off_a_terminal_prints_progress_lines(tmp_path):
    """Issue 48 (4): with stdout and stderr not a terminal, parity printed nothing until the end."""
    env = {**__import__("os").environ, "HARNESS_PROGRESS_SECONDS": "0.001"}
    r = subprocess.run([sys.executable, "-m", "harness", "parity", "--candidate", "oracle", "--model", "fixture:tiny-qwen35", "--no-evidence",
                        "--greedy-tokens", "0"], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("harness: parity: prompt ")]
    assert len(lines) > 1, r.stderr
    done, total = re.search(r", (\d+)/(\d+) positions compared", lines[-1]).groups()
    assert done == total  # the last line says the run is done
    bad = subprocess.run([sys.executable, "-m", "harness", "parity", "--candidate", "oracle", "--model", "fixture:tiny-qwen35", "--no-evidence"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**env, "HARNESS_PROGRESS_SECONDS": "soon"})
    assert bad.returncode == 2 and bad.stderr.strip() == "harness: INVALID: $HARNESS_PROGRESS_SECONDS 'soon': not a positive number of seconds"
