"""Hostile inputs (issue 16): evidence that cannot be lost, clobbered or forged, and a harness that
no input can hang, flood or inject.

One section per kind. Each kind has the inputs that broke it as fixtures, with the exact exit code
and the one ``harness: VERDICT: message`` line asserted through the CLI, and a hypothesis strategy
that generates the kind's variants (the input named in the issue is one point of it):

1. evidence lost or corrupted: ledger paths and the files beside them (``ledger_layouts``); 8
   writers x 12 rounds x 3 repeats, identical and different runs mixed, through the real
   ``record_evidence`` path, the ledger verified after every repeat;
2. resource exhaustion: oversized values in every count and size field of the model
   (``oversized_hparams``), YAML aliases to large scalars, an engine's 600 MB stderr;
3. hangs: non-regular files (FIFO, socket, directory, symlinks to devices, dangling links)
   wherever an engine writes (``non_regular``); timeouts that are not finite and positive;
4. terminal and markup injection: C0/C1 controls, bidi marks, rich markup and mathtext in every
   printed string (``hostile_text``): tables, progress, error lines, ledger, reports, plots;
5. exit 70 where the input is at fault: read-only cache, report folder under a file, config of
   the wrong kinds (``config_tables``), huge numbers and deep nesting in prompt lines;
6. the wrong party blamed: NaN/Inf planted anywhere in either engine's logits
   (``nonfinite_plants``), non-finite values anywhere in an engine's info.json;
7. accepted nonsense: out-of-range gate values of every gate kind (``bad_gates``), NaN/Inf
   planted in any tensor lint checks (``tensor_plants``), non-UTF-8 prompts, depends_on cycles;
8. leftovers: every exit path of an engine that leaves children behind (``exit_paths``), runs
   stopped by SIGTERM or SIGKILL, report folders of failed reports.

Hypothesis budgets are small and seeded in the default suite (``derandomize``, 5 to 80 examples
per strategy; tests/test_fuzz.py explains the convention); ``make fuzz`` scales them with
``HARNESS_FUZZ_EXAMPLES`` (``budget``) and seeds them randomly.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from _hostile_util import Alarm as _Alarm
from _hostile_util import load_prompts_or_refusal, make_non_regular
from helpers import fake_engines_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import GATES, V, cli, cli_process, write_prompts
from test_receipts import make_receipt

from harness import display
from harness.errors import EngineError, InvalidInput, NotComparable, Verdict
from harness.evidence import ledger as L
from harness.evidence.receipts import load_receipt, write_receipt
from harness.evidence.record import preflight_evidence, record_evidence
from harness.fixtures import synthetic as fx

REPO = Path(__file__).resolve().parents[1]
FUZZ_EXAMPLES = os.environ.get("HARNESS_FUZZ_EXAMPLES")
RANDOM = os.environ.get("HARNESS_FUZZ_RANDOM") == "1"
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""What must never reach a terminal, table, report or plot unescaped (tab and newline aside)."""


def budget(n: int):
    """Hypothesis settings: ``n`` seeded examples by default; under ``make fuzz`` the same share of
    ``$HARNESS_FUZZ_EXAMPLES`` as ``n`` is of test_fuzz.py's default 60 (a strategy that runs the
    CLI or draws plots gets fewer than one that calls a function), randomly seeded."""
    examples = max(n, int(FUZZ_EXAMPLES) * n // 60) if FUZZ_EXAMPLES else n
    return settings(max_examples=examples, deadline=None, derandomize=not RANDOM, database=None,
                    suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------------------------------
# Fake command engines (tests/helpers.py): each body has ``req``, ``out``, ``good`` (deterministic
# logits for the request's tokens) and ``os`` at hand; every engine appends its name to ran.log
# beside the scripts, the proof that an engine ran.
# ---------------------------------------------------------------------------------------------
ENGINES = {
    "good": "np.save(out + '/logits.npy', good)",
    "near": "np.save(out + '/logits.npy', good + np.float32(1e-3))",
    "fifo": "os.mkfifo(out + '/logits.npy')",
    "nanref": "good[70, 3] = np.nan; np.save(out + '/logits.npy', good)",
    "infonan": "open(out + '/info.json', 'w').write('{\"name\": \"x\", \"settings\": {\"eps\": NaN}}'); np.save(out + '/logits.npy', good)",
    "flood": "os.ftruncate(2, 600 << 20); os.lseek(2, 0, 2); os.write(2, b'\\nLAST LINE\\n'); sys.exit(1)",
    "stderr-fifo": ("os.remove(os.path.dirname(sys.argv[1]) + '/stderr.txt'); os.mkfifo(os.path.dirname(sys.argv[1]) + '/stderr.txt');"
                    " np.save(out + '/logits.npy', good)"),
}
PREAMBLE = """
import os
open(os.path.join(os.path.dirname(__file__), 'ran.log'), 'a').write(os.path.basename(__file__) + '\\n')
good = np.stack([np.random.default_rng(t).standard_normal(V).astype(np.float32) for t in req['tokens']])
"""


@pytest.fixture()
def engines(tmp_path, monkeypatch) -> Path:
    """The ``ENGINES`` configured through $HARNESS_CONFIG; returns the work folder (``ran.log``
    appears there when any engine ran)."""
    fake_engines_config(tmp_path, monkeypatch, ENGINES, V, 30, PREAMBLE)
    return tmp_path


@pytest.fixture()
def gates(tmp_path) -> Path:
    p = tmp_path / "gates.yaml"
    p.write_text(GATES)
    return p


@pytest.fixture()
def prompts_80(tmp_path) -> Path:
    return write_prompts(tmp_path / "p80.jsonl", {"p80": [(7 * i + 3) % V for i in range(80)]})


def parity(prompts: Path, candidate: str = "command:near", reference: str = "command:good", *extra) -> list:
    """A parity command line judged by the fixed test gates alone (``--no-calibrate``: these tests
    are about inputs and evidence, not about measuring a calibrated tier)."""
    return ["parity", "--model", "fixture:tiny-qwen35", "--prompts", prompts, "--candidate", candidate, "--reference", reference,
            "--no-calibrate", *extra]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for folders and special files)."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out


def seed_ledger(ledger: Path, seeds=(0,)) -> None:
    """A valid ledger with one row per seed (synthetic receipts through ``record_evidence``)."""
    for s in seeds:
        r, a = make_receipt(seed=s)
        record_evidence(r, a, ledger)


# =============================================================================================
# 1. Evidence lost or corrupted
# =============================================================================================
def _ledger_refused_before_engines_run(engines: Path, prompts: Path, gates: Path, ledger: Path, watched: Path, message: str) -> None:
    """A parity run with ``--ledger ledger`` exits INVALID (2) with exactly ``message``, before any
    engine ran and with nothing under ``watched`` changed."""
    before = snapshot(watched)
    r = cli(*parity(prompts, "command:near", "command:good", "--ledger", ledger, "--thresholds", gates))
    r.assert_one_line("INVALID", 2, message)
    assert snapshot(watched) == before and not (engines / "ran.log").exists()


def test_ledger_named_like_a_rendering_is_refused_before_engines_run(engines, prompts_80, gates):
    """``--ledger LEDGER.md`` made the rendering overwrite the JSON rows it renders."""
    ev = engines / "ev"
    seed_ledger(ev / "ledger.jsonl")
    _ledger_refused_before_engines_run(engines, prompts_80, gates, ev / "ledger.md", ev,
                                       f"{ev / 'ledger.md'}: a ledger's file name must end in .jsonl (its Markdown rendering is "
                                       "written beside it as .md); refusing an ambiguous ledger path")


def test_ledger_beside_an_unrelated_markdown_is_refused(engines, prompts_80, gates):
    """``--ledger notes/README.jsonl`` overwrote the user's notes/README.md."""
    notes = engines / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("# My notes\n\nnot a ledger\n")
    _ledger_refused_before_engines_run(engines, prompts_80, gates, notes / "README.jsonl", notes,
                                       f"{notes / 'README.md'}: exists and is not a ledger rendering written by the harness; "
                                       "refusing to overwrite it (choose a --ledger whose .md sibling is free)")


def test_rendering_of_another_ledger_is_refused(engines, prompts_80, gates):
    """``<root>/evidence/parity/ledger.jsonl`` renders to ``<root>/LEDGER.md``; a second ledger
    ``<root>/LEDGER.jsonl`` would overwrite that rendering with its own."""
    seed_ledger(engines / "evidence" / "parity" / "ledger.jsonl")
    before = snapshot(engines / "evidence") | {"LEDGER.md": (engines / "LEDGER.md").read_bytes()}
    r = cli(*parity(prompts_80, "command:near", "command:good", "--ledger", engines / "LEDGER.jsonl", "--thresholds", gates))
    r.assert_one_line("INVALID", 2, f"{engines / 'LEDGER.md'}: is the rendering of another ledger, not LEDGER.jsonl; refusing to overwrite it")
    assert snapshot(engines / "evidence") | {"LEDGER.md": (engines / "LEDGER.md").read_bytes()} == before
    assert not (engines / "ran.log").exists()


READ_ONLY = {
    # case: (make it unwritable, the path named, what the message says)
    "ledger": (lambda ev: (ev / "ledger.jsonl").chmod(0o444), "ledger.jsonl", "the ledger is read-only"),
    "rendering": (lambda ev: (ev / "ledger.md").chmod(0o444), "ledger.md", "the rendered ledger is read-only"),
    "lock": (lambda ev: (ev / "ledger.jsonl.lock").chmod(0o444), "ledger.jsonl.lock", "the ledger lock file is read-only"),
    "receipts": (lambda ev: (ev / "receipts").chmod(0o555), "receipts", "the receipts folder is read-only"),
    "folder": (lambda ev: ev.chmod(0o555), "ledger.md", "cannot be replaced"),
}


@pytest.mark.parametrize("case", list(READ_ONLY))
def test_unwritable_evidence_is_refused_before_engines_run(engines, prompts_80, gates, case):
    """A read-only ledger left an orphan receipt; a read-only rendering failed after the row was
    committed. Now every evidence path is checked before any engine runs, nothing is written.
    (Read-only means no write bit: refused even for root, who could write anyway.)"""
    make_unwritable, named, says = READ_ONLY[case]
    ev = engines / "ev"
    seed_ledger(ev / "ledger.jsonl")
    before = snapshot(ev)
    make_unwritable(ev)
    try:
        r = cli(*parity(prompts_80, "command:near", "command:good", "--ledger", ev / "ledger.jsonl", "--thresholds", gates))
    finally:
        for p in [ev, *ev.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    line = r.assert_one_line("INVALID", 2, str(ev / named) if case != "folder" else named, says)
    assert snapshot(ev) == before, line  # no orphan receipt, no temp file, no row
    assert not (engines / "ran.log").exists()


def test_ledger_under_a_regular_file_is_refused(engines, prompts_80, gates):
    (engines / "afile").write_text("x")
    cli(*parity(prompts_80, "command:near", "command:good", "--ledger", engines / "afile" / "ev" / "ledger.jsonl",
                "--thresholds", gates)).assert_one_line(
        "INVALID", 2, f"{engines / 'afile' / 'ev' / 'ledger.jsonl'}: cannot create the ledger: {engines / 'afile'} is not a directory")
    assert not (engines / "ran.log").exists()


# -- concurrency: 8 writers x 12 rounds x 3 repeats, identical and different runs mixed ----------
WRITERS, ROUNDS, REPEATS = 8, 12, 3


def _writer(ledger: str, w: int, template: tuple[dict, dict], barrier, errors) -> None:
    """Writer ``w``: in each round, even writers record the round's shared measurement (identical
    content; a ``created`` of their own, so their receipt bytes differ) and odd writers one of
    their own, all released at once by the barrier. Content differs by ``command`` (one
    synthetic receipt, built once, varied cheaply)."""
    receipt, arrays = template
    try:
        for rnd in range(ROUNDS):
            seed = rnd if w % 2 == 0 else 1000 + 100 * w + rnd
            mine = dict(receipt, command=["harness", "parity", "--seed", str(seed)], created=f"2026-01-0{1 + rnd % 9}T00:00:{w:02d}Z")
            barrier.wait(60)
            record_evidence(mine, arrays, ledger)
    except BaseException as e:  # reported to the parent, which fails the test with it
        errors.put(f"writer {w}: {type(e).__name__}: {e}")
        raise


@pytest.mark.parametrize("repeat", range(REPEATS))
def test_concurrent_writers_never_lose_or_replace_evidence(tmp_path, repeat):
    """Identical runs raced on one receipt id: the existence check was outside the ledger lock
    and the bytes include ``created``, so a later writer replaced a receipt an earlier row had
    hashed (13 of 96 rows failed ``ledger verify``). Receipts are now created with link
    semantics: the first writer's bytes stay, every row verifies."""
    ledger = tmp_path / "ev" / "ledger.jsonl"
    ctx = multiprocessing.get_context("fork")
    barrier, errors = ctx.Barrier(WRITERS), ctx.Queue()
    template = make_receipt(seed=7, n=16, v=31)
    procs = [ctx.Process(target=_writer, args=(str(ledger), w, template, barrier, errors)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert [p.exitcode for p in procs] == [0] * WRITERS, problems
    rows = L.read_rows(ledger)
    assert [r["seq"] for r in rows] == list(range(1, WRITERS * ROUNDS + 1))
    assert L.verify_ledger(ledger, ledger.parent / "receipts") == []
    shared = [r for r in rows if r["receipt_id"] in _shared_ids(rows)]
    by_id: dict[str, set[str]] = {}
    for r in shared:
        by_id.setdefault(r["receipt_id"], set()).add(r["receipt_sha256"])
    assert len(by_id) == ROUNDS and all(len(h) == 1 for h in by_id.values())  # 4 rows per shared receipt, one set of bytes
    assert len({r["receipt_id"] for r in rows}) == ROUNDS + (WRITERS // 2) * ROUNDS
    assert not [p for p in (ledger.parent / "receipts").rglob("*.tmp")]


def _shared_ids(rows: list[dict]) -> set[str]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["receipt_id"]] = counts.get(r["receipt_id"], 0) + 1
    return {k for k, v in counts.items() if v == WRITERS // 2}


# -- hypothesis: ledger paths and what lies beside them -----------------------------------------
SUFFIXES = [".jsonl", ".md", ".json", "", ".JSONL", ".jsonl.md", ".md.jsonl", ".txt"]
SIBLINGS = ["none", "user-text", "rendering-of-other", "rendering-of-this", "directory", "symlink", "fifo"]
ledger_layouts = st.tuples(st.text("abcXY_-", min_size=1, max_size=8), st.sampled_from(SUFFIXES), st.sampled_from(SIBLINGS))


def _make_sibling(md: Path, kind: str, ledger: Path) -> None:
    if kind == "user-text":
        md.write_text("# notes\nkeep me\n")
    elif kind == "rendering-of-other":
        md.write_text(L.render_markdown([], md.parent / "other.jsonl", md))
    elif kind == "rendering-of-this":
        md.write_text(L.render_markdown([], ledger, md))
    elif kind == "directory":
        md.mkdir()
    elif kind == "symlink":
        (md.parent / "target.md").write_text("# target\n")
        md.symlink_to(md.parent / "target.md")
    elif kind == "fifo":
        os.mkfifo(md)


@budget(40)
@given(layout=ledger_layouts)
def test_evidence_never_overwrites_what_the_harness_did_not_write(layout):
    """Any ledger name and anything beside it: either refused (``InvalidInput``, nothing written)
    or recorded with a verifying chain, and a file the harness did not write is never changed."""
    stem, suffix, sibling = layout
    with tempfile.TemporaryDirectory() as d:
        ledger = Path(d) / f"{stem}{suffix}"
        md = ledger.with_suffix(".md") if suffix else ledger.with_name(ledger.name + ".md")
        if md != ledger:
            _make_sibling(md, sibling, ledger)
        before = snapshot(Path(d))
        try:
            preflight_evidence(ledger)
        except InvalidInput as e:
            assert "\n" not in str(e)
            assert snapshot(Path(d)) == before
            return
        assert ledger.suffix == ".jsonl" and sibling in ("none", "rendering-of-this")
        r, a = make_receipt(seed=1, n=8, v=17)
        record_evidence(r, a, ledger)
        assert L.verify_ledger(ledger, ledger.parent / "receipts") == []


# =============================================================================================
# 2. Resource exhaustion from tiny inputs
# =============================================================================================
def test_block_count_override_beyond_the_file_is_refused():
    """``--override-kv qwen35.block_count=int:1000000000`` on a 2 MB model: 7.8 GB and 31
    minutes. Now one line at once (parity) and a QL103 finding (lint)."""
    cli("parity", "--model", "fixture:tiny-qwen35", "--override-kv", "qwen35.block_count=int:1000000000", "--no-evidence").assert_one_line(
        "INVALID", 2, f"{fx.build('tiny-qwen35')}: key 'qwen35.block_count' is 1000000000; llama.cpp takes 1..512 blocks")
    r = cli("lint", "fixture:tiny-qwen35", "--override-kv", "qwen35.block_count=int:100")
    assert r.code == 1 and "Traceback" not in r.out + r.err
    assert ("QL103  error    hyperparameters unusable: qwen35.block_count 100 minus nextn_predict_layers 0 counts 100 trunk blocks, "
            "but the file holds tensors for 8 block(s)") in r.out


def test_yaml_aliases_to_large_scalars_are_refused(tmp_path):
    """A 1 MB thresholds file whose aliases repeat a large scalar became a 106 MB receipt."""
    big = "x" * 50_000
    text = GATES.replace("who: tests/test_bad_input.py", "who: &w " + big, 1).replace("who: tests/test_bad_input.py", "who: *w")
    text += "probes:\n" + "".join(f"  g{i}: {{value: 1, basis: {{kind: declared, who: *w, why: t}}}}\n" for i in range(100))
    p = tmp_path / "aliases.yaml"
    p.write_text(text)
    assert p.stat().st_size < 60_000
    cli("parity", "--model", "fixture:tiny-qwen35", "--thresholds", p, "--no-evidence").assert_one_line(
        "INVALID", 2, f"{p}:", "YAML expands to more than", "characters through aliases (at most 1,048,576 beyond the file's own text)")


MEASURED_RUN = """
import re, sys
from harness.cli import main
code = main(sys.argv[1:])
# VmHWM: this process image's peak RSS (ru_maxrss would carry the forking parent's over exec)
print("maxrss_kib", re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1), file=sys.stderr)
sys.exit(code)
"""


def test_engine_stderr_flood_is_read_as_a_tail(engines, prompts_80):
    """An engine that wrote 600 MB to stderr cost 2 GB of RSS (the whole file was read). Now
    the last 64 KiB are: one line and the tail, and the harness process's own peak RSS (its
    engines not counted) stays far below the stderr's size."""
    p = subprocess.run([sys.executable, "-c", MEASURED_RUN, *map(str, parity(prompts_80, "command:flood", "command:good", "--no-evidence"))],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 3, p.stderr
    assert lines[:3] == ["harness: ENGINE-ERROR: command:flood exited 1", "engine stderr (last lines):", "LAST LINE"], p.stderr
    peak_kib = int(lines[3].split()[1])
    assert peak_kib < 400 * 1024, peak_kib  # reading the 600 MB would alone take 600 MB


def test_engine_stderr_flood_reads_at_most_the_tail(tmp_path):
    """``read_tail`` on a 600 MB (sparse) stderr reads 64 KiB: its peak memory is measured."""
    import tracemalloc

    from harness.engines.process import STDERR_TAIL_BYTES, read_tail

    p = tmp_path / "stderr.txt"
    with open(p, "wb") as f:
        f.truncate(600 << 20)
        f.seek(0, 2)
        f.write(b"\nLAST LINE\n")
    tracemalloc.start()
    with open(p, "rb") as f:
        text = read_tail(f)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert text.strip().splitlines()[-1] == "LAST LINE"
    assert peak < 4 * STDERR_TAIL_BYTES, peak


INT_HPARAMS = [(f, s) for f, s, t, _ in __import__("harness.model.gguf_model", fromlist=["HPARAM_KEYS"]).HPARAM_KEYS if t is int]
oversized_hparams = st.tuples(
    st.sampled_from(INT_HPARAMS),
    st.one_of(st.integers(516, (1 << 63) - 1), st.integers(-(1 << 63), -1), st.sampled_from([516, 1 << 20, 1 << 31, 1 << 32, (1 << 63) - 1])),
)


@budget(60)
@given(case=oversized_hparams)
def test_every_count_and_size_field_is_bounded_by_the_file(case):
    """Any integer hyperparameter overridden beyond what tiny-qwen35 holds (its largest tensor
    dimension is 515, it has 8 blocks): refused naming the key, or — for the two that size
    nothing (context_length, full_attention_interval) — accepted and linted at once."""
    from harness.model.gguf_model import NOT_TENSOR_SIZES, GGUFModel, parse_override
    from harness.model.lint import lint_model

    (field, suffix), value = case
    ov = parse_override(f"qwen35.{suffix}=int:{value}")
    model = GGUFModel(fx.build("tiny-qwen35"), [ov])
    if suffix in NOT_TENSOR_SIZES and value >= 1:
        assert lint_model(model).exit_code in (0, 1)
        return
    with pytest.raises(InvalidInput, match=re.escape(f"qwen35.{suffix}")):
        model.hparams


# =============================================================================================
# 3. Hangs
# =============================================================================================
def test_fifo_logits_is_an_engine_error_not_a_hang(engines, prompts_80, tmp_path):
    """An engine whose logits.npy is a FIFO blocked the harness forever (subprocess: a hang
    fails this test by its timeout instead of hanging the suite)."""
    r = cli_process(*parity(prompts_80, "command:fifo", "command:good", "--ledger", tmp_path / "ev" / "ledger.jsonl"),
                    env={"HARNESS_CONFIG": str(engines / "harness.toml")}, timeout=120)
    r.assert_one_line("ENGINE-ERROR", 3, "harness: ENGINE-ERROR: command:fifo wrote logits.npy as a FIFO; outputs must be regular files")
    assert not (tmp_path / "ev" / "receipts").exists()


def test_engine_replacing_its_stderr_with_a_fifo_does_not_hang(engines, prompts_80, gates):
    """The stderr tail is read from the harness's own descriptor, never reopened by name."""
    r = cli(*parity(prompts_80, "command:stderr-fifo", "command:good", "--no-evidence", "--thresholds", gates))
    assert r.code == 0, r.err


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "0", "-1", "true", '"10"', "1e9"])
def test_timeouts_must_be_finite_and_positive(tmp_path, monkeypatch, value):
    cfg = tmp_path / "h.toml"
    cfg.write_text(f'[engines.x]\ncommand = ["a"]\ntimeout_s = {value}\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    shown = {"inf": "inf", "nan": "nan", "-inf": "-inf", "0": "0", "-1": "-1", "true": "True", '"10"': "'10'", "1e9": "1000000000.0"}[value]
    cli("parity", "--model", "fixture:tiny-qwen35", "--candidate", "command:x", "--no-evidence").assert_one_line(
        "INVALID", 2, f"{cfg}: engines.x.timeout_s must be a finite number of seconds in (0, 604800], found {shown}")


NON_REGULAR = ["fifo", "socket", "directory", "symlink-dev-zero", "symlink-dev-null", "symlink-dev-urandom", "dangling-symlink",
               "symlink-to-fifo"]
OUTPUTS = ["logits.npy", "activations.npz", "info.json"]
non_regular = st.tuples(st.sampled_from(OUTPUTS), st.sampled_from(NON_REGULAR))


def read_output(out: Path, name: str, n_tokens: int = 4, n_vocab: int = 7):
    """Read one engine output with the protocol's reader (``harness.engines.command``)."""
    from harness.engines.command import load_activations, load_info, load_logits

    if name == "logits.npy":
        return load_logits(out, "command:x", n_tokens, n_vocab)
    if name == "activations.npz":
        return load_activations(out, "command:x", n_tokens, 1 << 20)
    return load_info(out, "command:x")


@budget(30)
@given(case=non_regular)
def test_non_regular_engine_outputs_are_refused_without_blocking(case):
    """A FIFO, socket, directory, a symlink to a device or to a FIFO, or a dangling link, in
    place of any output an engine writes: ``EngineError`` naming the file, never a blocked read."""
    name, kind = case
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        out = Path(d)
        make_non_regular(out / name, kind)
        with _Alarm(10), pytest.raises(EngineError) as ei:
            read_output(out, name)
    assert name in str(ei.value) and "\n" not in str(ei.value)


# =============================================================================================
# 4. Terminal and markup injection
# =============================================================================================
HOSTILE_IDS = {
    "osc-title": "\x1b]0;pwned\x07title",
    "osc8-link": "\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\",
    "rich-link": "[link=http://evil.example]click[/link]",
    "rich-close": "[/bold]x",
    "mathtext": "$\\notacommand$",
    "c1-csi": "c1\x9b31mred",
    "bidi": "abc\u202eevil",
    "cr-overwrite": "safe\rFAKE PASS",
}


@pytest.fixture()
def hostile_prompts(tmp_path) -> Path:
    return write_prompts(tmp_path / "hostile.jsonl", {v: [(7 * k + j) % V for k in range(40)] for j, v in enumerate(HOSTILE_IDS.values())})


def test_hostile_prompt_ids_are_shown_escaped_everywhere(engines, hostile_prompts, gates, monkeypatch):
    """Prompt ids with ESC/OSC sequences reached the terminal raw, ``[link=…]`` was interpreted,
    ``[/bold]x`` crashed the progress thread (exit 70 after the row was written) and
    ``$\\notacommand$`` crashed the report. Now: exit 0; every id shown escaped in the table, the
    progress bar (forced on, as on a terminal), the ledger rendering and the report."""
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich renders the progress bar and styles as on a terminal
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    ledger = engines / "ev" / "ledger.jsonl"
    r = cli(*parity(hostile_prompts, "command:near", "command:good", "--ledger", ledger, "--thresholds", gates))
    assert r.code == 0, r.err[-3000:]
    shown = r.out + r.err
    printable = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)  # rich's own SGR/cursor codes aside
    assert not RAW_CONTROL.search(printable.replace("\r", "")), repr(RAW_CONTROL.findall(printable))
    assert "\x1b]" not in shown and "\x9b" not in shown  # no OSC (title, hyperlink) from any id
    for raw in HOSTILE_IDS.values():
        assert display.plain(raw) in printable  # shown, escaped, in the table
    md = ledger.with_suffix(".md").read_text()
    assert not RAW_CONTROL.search(md)
    report = next((ledger.parent / "reports").glob("*/report.md"))
    text = report.read_text()
    assert not RAW_CONTROL.search(text)
    assert "| '\\[link=http://evil.example\\]click\\[/link\\]' |" in text  # the per-prompt table cell, markup escaped
    assert (report.parent / "positions.png").stat().st_size > 10_000
    assert L.verify_ledger(ledger, ledger.parent / "receipts") == []


FRAGMENTS = ["[link=http://x]", "[/link]", "[/bold]", "[bold red]", "[/]", "$", "$\\notacommand$", "$x^2$", "\\", "|", "`", "<b>",
             "\x1b[31m", "\x1b]0;t\x07", "\x1b]8;;http://x\x1b\\", "\x9b", "\x85", "\r", "\n", "\t", "\x00", "\u202e", "\u2066", "\u2028",
             "\ud800", "\U000e0001", "\ufeff", "\u00a0", ":smile:"]
hostile_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4),
                                  st.characters(min_codepoint=0, max_codepoint=0x9F)), max_size=12).map("".join)


@budget(60)
@given(s=hostile_text)
def test_escaping_is_literal_for_every_output_kind(s):
    """Any string with controls, rich markup, mathtext or Markdown: ``plain`` holds no control
    character, rich shows ``markup(s)`` as exactly ``plain(s)`` (no tag, link or emoji code
    interpreted), matplotlib draws ``mathtext(s)`` and ``md(s)`` cannot end a table cell."""
    import io

    from rich.console import Console

    p = display.plain(s)
    assert p.isprintable() and not RAW_CONTROL.search(p)
    p.encode("utf-8")  # even a lone surrogate is shown as an escape
    buf = io.StringIO()
    Console(file=buf, width=10_000, color_system=None, highlight=False, soft_wrap=True, emoji=False).print(display.markup(s), end="")
    # rich.markup.escape doubles a lone trailing backslash (so a tag written after it stays a tag)
    assert buf.getvalue() == (p + "\\" if p.endswith("\\") and not p.endswith("\\\\") else p)
    assert not RAW_CONTROL.search(display.md_text(s)) and not re.search(r"(?<!\\)\|", display.md_text(s).replace("\\\\", ""))
    _draw_text(display.mathtext(s))


def _draw_text(text: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import warnings

    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1))
    fig.suptitle(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # glyphs missing from the font
        fig.canvas.draw()  # raises on a mathtext parse error


@pytest.mark.filterwarnings("ignore:Glyph")  # matplotlib: characters the font lacks
@budget(5)
@given(s=hostile_text.map(lambda x: x.replace("\ud800", "")).filter(lambda x: x.strip()))  # surrogates: refused on input
def test_hostile_strings_in_every_printed_field(tmp_path_factory, s):
    """The same strings in every field a run prints (prompt id, engine names and versions,
    model name and file type, threshold basis, verdict message) through the parity table, the
    ledger rendering, the report and its plots, and the error line: no raw control characters
    anywhere, markup never interpreted, and the report and plots are written."""
    import contextlib
    import io

    from harness.cli import _render_parity, main

    d = tmp_path_factory.mktemp("hostile")
    receipt, arrays = make_receipt(seed=3, n=16, v=31)
    receipt["prompts"]["items"][0]["id"] = s
    receipt["per_prompt"][0]["id"] = s
    receipt["engines"]["candidate"]["name"] = "command:" + s
    receipt["engines"]["reference"]["version"] = s
    receipt["model"]["name"] = s
    receipt["thresholds"]["release"]["min_cosine"]["basis"] = {"kind": "declared", "who": s, "why": s}
    receipt["gated"]["message"] = s
    rec = record_evidence(receipt, arrays, d / "ev" / "ledger.jsonl")
    outcome = _FakeOutcome(rec, s)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        _render_parity(outcome)
        code = main(["report", str(rec.receipt_path), "--out", str(d / "rep")])
    assert code == 0, err.getvalue()
    for text in (out.getvalue(), err.getvalue(), (d / "ev" / "ledger.md").read_text(), (d / "rep" / "report.md").read_text()):
        assert not RAW_CONTROL.search(text), repr(text[:500])
    squash = lambda x: re.sub(r"[\s│┃║]+", "", x)  # noqa: E731  (wrapping and table borders aside)
    assert squash(display.plain(s)) in squash(out.getvalue())
    err2 = io.StringIO()
    with contextlib.redirect_stderr(err2):
        assert main(["parity", "--model", str(d / "m") + s.replace("\x00", "").replace("/", "_"), "--no-evidence"]) == 2
    assert len(err2.getvalue().strip("\n").splitlines()) == 1 and not RAW_CONTROL.search(err2.getvalue().rstrip("\n"))


class _FakeOutcome:
    """What ``_render_parity`` reads, from a recorded synthetic receipt."""

    def __init__(self, rec, s: str):
        from harness.runs.parity import CellResult

        r = rec.receipt
        self.receipt, self.receipt_path, self.ledger_path, self.ledger_row = r, rec.receipt_path, rec.ledger_path, rec.row
        self.result = CellResult(Verdict.PASS, "parity", [], {}, r["report_only"],
                                 [dict(id=s, positions=16, min_cosine=0.99, mean_cosine=0.99, argmax_agreement=1.0, near_tie_flips=0,
                                       hard_flips=0, kld_mean=None, failing_positions=0)], {}, {}, {}, 31, s)


# =============================================================================================
# 5. Exit 70 where the input is at fault
# =============================================================================================
def test_read_only_cache_dir(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o555)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(cache))
    try:
        cli("parity", "--model", "fixture:tiny-qwen35", "--no-evidence").assert_one_line(
            "INVALID", 2, f"{cache}/fixtures-v{fx.GENERATOR_VERSION}: cannot create the fixture cache folder: {cache} is read-only; "
            "set $HARNESS_CACHE_DIR to a writable folder")
    finally:
        cache.chmod(0o755)
    assert list(cache.iterdir()) == []


def test_report_out_under_a_regular_file(tmp_path):
    jp, _ = write_receipt(*make_receipt(seed=2), tmp_path / "receipts")
    (tmp_path / "afile").write_text("x")
    cli("report", jp, "--out", tmp_path / "afile" / "rep").assert_one_line(
        "INVALID", 2, f"{tmp_path / 'afile' / 'rep'}: cannot create the report folder: {tmp_path / 'afile'} is not a directory")


def test_config_env_not_a_table(tmp_path, monkeypatch):
    cfg = tmp_path / "h.toml"
    cfg.write_text('[engines.x]\ncommand = ["a"]\nenv = "X"\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    cli("parity", "--model", "fixture:tiny-qwen35", "--candidate", "command:x", "--no-evidence").assert_one_line(
        "INVALID", 2, f'{cfg}: engines.x.env must be a table of variable = "value" (strings or numbers)')


def test_token_id_with_5000_digits(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "tokens": [1, ' + "9" * 5000 + "]}\n")
    line = cli("parity", "--model", "fixture:tiny-qwen35", "--prompts", p, "--no-evidence").assert_one_line(
        "INVALID", 2, f"{p}:1: invalid JSON (a number of more than 4,300 digits)")
    assert len(line) < 300


def test_token_id_beyond_int32(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "tokens": [1, ' + "9" * 100 + "]}\n")
    cli("parity", "--model", "fixture:tiny-qwen35", "--prompts", p, "--no-evidence").assert_one_line(
        "INVALID", 2, f"{p}:1: token id 999999999999… (100 digits) is larger than any token id can be (2147483647, int32)")


def test_prompt_with_a_lone_surrogate_escape(tmp_path):
    """``"\\ud800"`` is valid JSON but no text: a receipt could not record it (UTF-8), so the run
    failed after its engines ran. Refused on load."""
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "ok", "tokens": [1, 2]}\n{"id": "x\\ud800", "tokens": [3]}\n')
    cli("parity", "--model", "fixture:tiny-qwen35", "--prompts", p, "--no-evidence").assert_one_line(
        "INVALID", 2, f"{p}:2: a string holds a lone surrogate escape (\\ud800-\\udfff), which is no text")


def test_prompt_line_nested_100k_deep(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "ok", "tokens": [1, 2]}\n{"id": "deep", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    cli("parity", "--model", "fixture:tiny-qwen35", "--prompts", p, "--no-evidence").assert_one_line(
        "INVALID", 2, f"{p}:2: JSON nested too deeply (a prompt is an object of strings and ints)")


toml_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
                           lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text("ab", max_size=2), c, max_size=3)), max_leaves=6)
config_tables = st.dictionaries(st.sampled_from(["command", "timeout_s", "capabilities", "cwd", "env", "timeout", "shell"]),
                                toml_values, max_size=5)


@budget(80)
@given(table=config_tables, top=st.dictionaries(st.sampled_from(["model", "prompts", "ledger", "engines"]), toml_values, max_size=2))
def test_config_of_any_shape_is_invalid_input_or_valid(table, top):
    """Any value of any kind under any engine key, and under the top-level keys the harness
    reads: ``InvalidInput`` naming the key, or a valid spec — never another exception."""
    from harness.config import HarnessConfig, _checked
    from harness.engines.command import configured_commands

    try:
        cfg = HarnessConfig(_checked({**top, "engines": {"x": table}} if "engines" not in top else top, Path("h.toml")), Path("h.toml"))
        specs = configured_commands(cfg)
    except InvalidInput as e:
        assert "\n" not in str(e)
        return
    for spec in specs.values():
        assert spec.command and all(isinstance(a, str) for a in spec.command)
        assert 0 < spec.timeout_s <= 7 * 24 * 3600 and all(isinstance(v, str) for v in spec.env.values())


prompt_lines = st.one_of(
    st.integers(0xD800, 0xDFFF).map(lambda c: '{"id": "s", "text": "a\\u%04x"}' % c),
    st.integers(1, 200_000).map(lambda n: '{"id": "d", "x": ' + "[" * n + "]" * n + "}"),
    st.integers(1, 20_000).map(lambda n: '{"id": "n", "tokens": [' + "7" * n + "]}"),
    st.binary(max_size=40).map(lambda b: b'{"id": "b", "text": "' + b + b'"}'),
)


@budget(30)
@given(lines=st.lists(prompt_lines, min_size=1, max_size=3))
def test_prompt_lines_at_fault_are_invalid_input(tmp_path_factory, lines):
    """Deep nesting, long numbers and raw bytes in prompt lines: ``InvalidInput`` or a loaded
    set whose tokens are int32 ids — never RecursionError, ValueError or UnicodeDecodeError."""
    from harness.measure.prompts import MAX_TOKEN_ID

    raw = b"\n".join(ln if isinstance(ln, bytes) else ln.encode() for ln in lines) + b"\n"
    ps = load_prompts_or_refusal(tmp_path_factory.mktemp("prompts"), raw)
    if ps is None:
        return
    for pr in ps:
        assert pr.tokens is None or all(0 <= t <= MAX_TOKEN_ID for t in pr.tokens)
        assert pr.text is None or "\ufffd" not in pr.text or "\ufffd".encode() in raw


# =============================================================================================
# 6. Wrong party blamed
# =============================================================================================
def test_reference_nan_is_an_engine_error_naming_the_reference(engines, prompts_80, gates):
    """A reference returning NaN logits gave FAIL against the candidate, and a FAIL row in its
    name. Now ENGINE-ERROR naming the reference and the position; no row, no receipt."""
    ledger = engines / "ev" / "ledger.jsonl"
    r = cli(*parity(prompts_80, "command:good", "command:nanref", "--ledger", ledger, "--thresholds", gates))
    r.assert_one_line("ENGINE-ERROR", 3, "harness: ENGINE-ERROR: reference command:nanref returned non-finite logits (NaN or Inf) at "
                      "prompt 'p80' position 70 (1 position(s) in this block); a reference that fails cannot judge the candidate")
    assert not ledger.exists() and not (ledger.parent / "receipts").exists()


@pytest.mark.parametrize("evidence", [["--no-evidence"], ["--ledger", "ev/ledger.jsonl"]], ids=["dry-run", "recording"])
def test_nonfinite_info_json_is_refused_the_same_in_dry_and_recording_runs(engines, prompts_80, gates, evidence, monkeypatch):
    """Non-finite values in an engine's info.json passed a dry run and failed the recording run
    after the engines ran. Now both refuse them as the engine's error when they are read."""
    monkeypatch.chdir(engines)
    cli(*parity(prompts_80, "command:infonan", "command:good", *evidence, "--thresholds", gates)).assert_one_line(
        "ENGINE-ERROR", 3, "harness: ENGINE-ERROR: command:infonan wrote an unreadable info.json (NaN is not a finite number)")
    assert not (engines / "ev").exists()


class ArrayEngine:
    """An in-process engine serving fixed logits per prompt (keyed by the token tuple)."""

    def __init__(self, name: str, table: dict[tuple, np.ndarray], n_vocab: int):
        from harness.engines.base import EngineInfo

        self._info, self.table, self.n_vocab = EngineInfo(name, "1"), table, n_vocab

    @property
    def info(self):
        return self._info

    def logits(self, tokens, chunks=None):
        a = self.table[tuple(tokens)]
        for start in range(0, a.shape[0], 16):
            yield start, a[start : start + 16]


nonfinite_plants = st.tuples(st.sampled_from(["reference", "candidate"]), st.integers(0, 2), st.integers(0, 39), st.integers(0, V - 1),
                             st.sampled_from([np.nan, np.inf, -np.inf]))


@budget(40)
@given(plant=nonfinite_plants)
def test_nonfinite_logits_blame_the_engine_that_produced_them(plant):
    """NaN/±Inf anywhere in one engine's logits: in the reference, ``EngineError`` naming the
    reference, the prompt and the first bad position; in the candidate, FAIL at that position."""
    from harness.runs.parity import run_cell
    from harness.measure.prompts import PromptTokens
    from harness.model.gguf_model import GGUFModel

    side, pi, pos, col, value = plant
    prompts = [PromptTokens(f"p{i}", [(11 * k + i) % V for k in range(40)], "ids") for i in range(3)]
    base = {tuple(p.tokens): np.random.default_rng(i).standard_normal((40, V)).astype(np.float32) for i, p in enumerate(prompts)}
    bad = {k: v.copy() for k, v in base.items()}
    bad[tuple(prompts[pi].tokens)][pos, col] = value
    ref = ArrayEngine("ref", bad if side == "reference" else base, V)
    cand = ArrayEngine("cand", bad if side == "candidate" else base, V)
    model = GGUFModel(fx.build("tiny-qwen35"))
    if side == "reference":
        with pytest.raises(EngineError, match=re.escape(f"reference ref returned non-finite logits (NaN or Inf) at prompt 'p{pi}' position {pos} ")):
            run_cell(model, ref, cand, prompts, 0.98, 64)
        return
    res = run_cell(model, ref, cand, prompts, 0.98, 64)
    assert res.verdict is Verdict.FAIL and res.gate["first_nonfinite"]["prompt"] == f"p{pi}" and res.gate["first_nonfinite"]["position"] == pos


json_with_constants = st.recursive(
    st.one_of(st.integers(-5, 5), st.text("ab", max_size=3), st.sampled_from(["NaN", "Infinity", "-Infinity"]).map(lambda c: ("RAW", c))),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text("xyz", min_size=1, max_size=2), c, max_size=3)), max_leaves=8)


def _dump(v) -> str:
    if isinstance(v, tuple):
        return v[1]
    if isinstance(v, list):
        return "[" + ",".join(_dump(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_dump(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


@budget(60)
@given(doc=st.dictionaries(st.sampled_from(["name", "version", "settings", "extra"]), json_with_constants, max_size=4))
def test_info_json_with_nonfinite_values_anywhere_is_the_engines_error(doc):
    """NaN/Infinity anywhere in info.json: ``EngineError`` naming the engine when it is read
    (before any receipt); otherwise the parsed info is finite JSON."""
    from harness.engines.command import parse_info
    from harness.evidence.receipts import canonical_json

    text = _dump(doc)
    try:
        info = parse_info(text.encode(), "command:x")
    except EngineError as e:
        assert str(e).startswith("command:x wrote ")
        return
    assert not any(c in text for c in ("NaN", "Infinity"))
    canonical_json(info)  # a receipt can hold it


# =============================================================================================
# 7. Accepted nonsense
# =============================================================================================
def test_negative_max_kld_mean_is_refused_at_load(tmp_path, engines, prompts_80):
    p = tmp_path / "t.yaml"
    p.write_text(GATES + "  max_kld_mean: {value: -0.5, basis: {kind: declared, who: me, why: typo}}\n")
    cli(*parity(prompts_80, "command:near", "command:good", "--thresholds", p, "--no-evidence")).assert_one_line(
        "INVALID", 2, f"{p}:5: release.max_kld_mean.value: -0.5 is less than the minimum of 0")
    assert not (engines / "ran.log").exists()


LINT_NONSENSE = {
    "output-norm-all-nan": "QL406  error    output_norm.weight holds 64 non-finite (NaN or Inf) of 64 values",
    "token-embd-nan": "QL406  error    token_embd.weight holds 1 non-finite (NaN or Inf) of 32960 values",
    "output-inf": "QL406  error    output.weight holds 1 non-finite (NaN or Inf) of 32960 values",
    "rms-eps-nan": "QL111  error    key qwen35.attention.layer_norm_rms_epsilon is nan; it must be a finite positive number",
}


@pytest.mark.parametrize("name", list(LINT_NONSENSE))
def test_lint_flags_nonfinite_weights_and_hyperparameters(tmp_path_factory, name):
    from harness.fixtures.defects import build_defect

    p = build_defect(name, tmp_path_factory.mktemp("nonsense"))
    r = cli("lint", p)
    assert r.code == 1 and "Traceback" not in r.out + r.err
    assert LINT_NONSENSE[name] in r.out.splitlines(), r.out


def test_non_utf8_prompt_file_is_refused(tmp_path):
    """Invalid bytes became U+FFFD and the text prompt still passed."""
    p = tmp_path / "p.jsonl"
    data = b'{"id": "ok", "text": "fine"}\n{"id": "bad", "text": "caf\xe9"}\n'
    p.write_bytes(data)
    at = data.index(b"\xe9")
    cli("parity", "--model", "fixture:tiny-qwen35", "--prompts", p, "--no-evidence").assert_one_line(
        "INVALID", 2, f"{p}:2: not UTF-8 text (byte {at}: b'\\xe9'); prompt files are UTF-8 JSON lines")


def test_depends_on_cycle_is_refused(tmp_path):
    (tmp_path / "contracts").mkdir()
    for f in (REPO / "contracts").glob("*.yaml"):
        (tmp_path / "contracts" / f.name).write_text(f.read_text())
    shapes = tmp_path / "contracts" / "qwen35-shapes-v1.yaml"
    shapes.write_text(shapes.read_text().replace("depends_on: []", "depends_on: [qwen35-e2e-verification-v1]", 1))
    r = cli("contracts", "validate", shapes)
    r.assert_one_line("INVALID", 2, f"{shapes}:19: depends_on[0]: depends_on cycle: qwen35-shapes-v1 -> qwen35-e2e-verification-v1 -> "
                      "qwen35-hybrid-forward-v1 -> gated-delta-net-v1 -> qwen35-shapes-v1")


bad_gates = st.one_of(
    st.tuples(st.sampled_from(["calibrated.0.gates.max_kld_mean", "calibrated.0.gates.max_kld_p99", "probes.max_kld", "probes.localize_max_nmse"]),
              st.floats(max_value=-1e-300, allow_nan=False, allow_infinity=False)),
    st.tuples(st.sampled_from(["release.min_cosine", "probes.min_cosine", "probes.localize_min_cosine"]),
              st.one_of(st.floats(min_value=1.0000001, allow_nan=False, allow_infinity=False), st.floats(max_value=-1.0000001, allow_nan=False, allow_infinity=False))),
    st.tuples(st.just("release.min_positions"), st.one_of(st.integers(max_value=0), st.floats(0.1, 1e6).filter(lambda x: x != int(x)))),
)


@budget(60)
@given(case=bad_gates)
def test_out_of_range_gate_values_are_refused_at_load(tmp_path_factory, case):
    """Every kind of gate with a value it can never mean: a negative divergence bound, a cosine
    outside [-1, 1], a non-positive or fractional position count: refused at load, naming it."""
    from harness.judge.thresholds import load_thresholds

    where, value = case
    section, name = where.split(".")[0], where.split(".")[-1]
    basis = "basis: {kind: declared, who: t, why: t}"
    num = lambda v: str(v) if isinstance(v, int) else f"{v:.17e}"  # noqa: E731  (YAML reads 1e-300 without a dot as text)
    release = {"min_positions": 64, "min_cosine": 0.98}
    probes, row = {}, {"min_cosine": 0.99}
    {"release": release, "probes": probes, "calibrated": row}[section][name] = value
    text = "schema: harness-thresholds/v2\nrelease:\n" + "".join(f"  {k}: {{value: {num(v)}, {basis}}}\n" for k, v in release.items())
    if probes:
        text += "probes:\n" + "".join(f"  {k}: {{value: {num(v)}, {basis}}}\n" for k, v in probes.items())
    text += ("calibrated:\n  - weights: F32\n    class: f32\n    file_type: ALL_F32\n"
             "    basis_models: [{name: m, n_layer: 8, n_embd: 96}]\n    gates:\n"
             + "".join(f"      {k}: {{value: {num(v)}, {basis}}}\n" for k, v in row.items()))
    p = tmp_path_factory.mktemp("gates") / "t.yaml"
    p.write_text(text)
    with pytest.raises(InvalidInput, match=re.escape(f"{where}.value")):
        load_thresholds(p)


FINITE_CHECKED = ["token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_norm.weight", "blk.3.attn_q_norm.weight",
                  "blk.1.ssm_norm.weight", "blk.2.ssm_a", "blk.7.post_attention_norm.weight"]
tensor_plants = st.tuples(st.sampled_from(FINITE_CHECKED), st.floats(0, 1, exclude_max=True), st.sampled_from([np.nan, np.inf, -np.inf]))


@budget(12)
@given(plant=tensor_plants)
def test_lint_finds_a_nonfinite_value_planted_anywhere(tmp_path_factory, plant):
    """One NaN/±Inf written over any element of any tensor lint checks for finiteness:
    exactly one QL406 finding, naming that tensor."""
    import gguf

    from harness.model.lint import lint_path

    name, where, value = plant
    src = fx.build("tiny-qwen35")
    t = next(t for t in gguf.GGUFReader(src).tensors if t.name == name)
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    at = int(t.data_offset) + 4 * int(where * int(t.n_elements))
    data = bytearray(src.read_bytes())
    data[at : at + 4] = np.float32(value).tobytes()
    p = tmp_path_factory.mktemp("plant") / "plant.gguf"
    p.write_bytes(bytes(data))
    found = [f for f in lint_path(str(p)).findings if f.code == "QL406"]
    assert [f.where["tensor"] for f in found] == [name] and found[0].where["found"] == 1


# =============================================================================================
# 8. Leftovers
# =============================================================================================
LEFTOVER_ENGINE = """
import json, os, signal, subprocess, sys, time
req = json.load(open(sys.argv[1])); out = sys.argv[2]; mode, n, pidfile = sys.argv[3], int(sys.argv[4]), sys.argv[5]
kids = [subprocess.Popen(["sleep", "300"]) for _ in range(n)]
with open(pidfile, "w") as f:
    f.write(" ".join(str(k.pid) for k in kids))
if mode == "ok":
    import numpy as np
    np.save(out + "/logits.npy", np.zeros((len(req["tokens"]), 515), np.float32))
elif mode == "fail":
    sys.exit(5)
elif mode == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "hang":
    time.sleep(300)
elif mode == "fifo":
    os.mkfifo(out + "/logits.npy")
"""
EXIT_PATHS = {"ok": None, "fail": "exited 5", "signal": "died with SIGKILL", "hang": "timed out after 1 s", "fifo": "as a FIFO",
              "nothing": "wrote no logits.npy"}
exit_paths = st.tuples(st.sampled_from(list(EXIT_PATHS)), st.integers(1, 3))


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def _leftover_engine(work: Path, mode: str, n: int):
    from harness.engines.command import CommandEngine, CommandSpec

    script = work / "leftover_engine.py"
    script.write_text(LEFTOVER_ENGINE)
    pidfile = work / f"kids-{mode}-{n}.txt"
    spec = CommandSpec("left", [sys.executable, str(script), "{request}", "{out_dir}", mode, str(n), str(pidfile)], timeout_s=1.0)
    return CommandEngine(spec, fx.build("tiny-qwen35")), pidfile


@budget(10)
@given(case=exit_paths)
def test_no_engine_exit_path_leaves_children_or_temp_files(tmp_path_factory, case):
    """Whatever way the engine ends (success, exit code, killed, timeout, a FIFO output, no
    output), the children it started are dead and its temporary folder is gone."""
    from harness.engines.base import gather
    from harness.rundir import run_dir

    mode, n = case
    eng, pidfile = _leftover_engine(tmp_path_factory.mktemp("left"), mode, n)
    before = set(run_dir().iterdir())
    if EXIT_PATHS[mode] is None:
        assert gather(eng.logits([1, 2, 3]), 3).shape == (3, 515)
    else:
        with pytest.raises(EngineError, match=re.escape(EXIT_PATHS[mode])):
            gather(eng.logits([1, 2, 3]), 3)
    kids = [int(x) for x in pidfile.read_text().split()]
    assert len(kids) == n
    deadline = time.monotonic() + 10
    while not all(process_gone(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(process_gone(k) for k in kids), kids
    assert set(run_dir().iterdir()) == before


def _run_dirs() -> set[Path]:
    from harness.rundir import _base_dir

    base = _base_dir()
    return set(base.glob("run-*")) if base else set()


def test_sigterm_mid_run_kills_the_engine_and_removes_temp_files(tmp_path):
    """``harness parity`` stopped by SIGTERM while an engine runs: the engine's process group is
    killed and the run's temporary folder removed, through the normal exit path."""
    script = tmp_path / "leftover_engine.py"
    script.write_text(LEFTOVER_ENGINE)
    pidfile = tmp_path / "kids.txt"
    (tmp_path / "h.toml").write_text(f'[engines.hang]\ncommand = ["{{python}}", "{script}", "{{request}}", "{{out_dir}}", "hang", "2", '
                                     f'"{pidfile}"]\ntimeout_s = 600\n')
    prompts = write_prompts(tmp_path / "p.jsonl", {"p": [1, 2, 3]})
    proc = subprocess.Popen([sys.executable, "-m", "harness", "parity", "--model", "fixture:tiny-qwen35", "--prompts", str(prompts),
                             "--candidate", "command:hang", "--reference", "command:hang", "--no-evidence"],
                            env={**os.environ, "HARNESS_CONFIG": str(tmp_path / "h.toml")}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    mine = {d for d in _run_dirs() if d.name.startswith(f"run-{proc.pid}-")}
    assert mine, "the run made its temporary folder"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    kids = [int(x) for x in pidfile.read_text().split()]
    deadline = time.monotonic() + 10
    while not all(process_gone(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(process_gone(k) for k in kids)
    assert not any(d.exists() for d in mine)


def test_sigkilled_runs_temp_folders_are_removed_by_the_next_run():
    """SIGKILL cannot be caught: the folder stays until the next run removes it (its process
    is gone)."""
    from harness.rundir import _base_dir, run_dir, scratch_dir

    base = _base_dir()
    if base is None:
        pytest.skip("no private per-user temporary folder here")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = base / f"run-{dead.pid}-stale"
    (stale / "cmd-x").mkdir(parents=True)
    (stale / "cmd-x" / "logits.npy").write_bytes(b"x" * 100)
    proc = subprocess.run([sys.executable, "-c", "from harness.rundir import scratch_dir\nwith scratch_dir('x-'): pass"], timeout=60)
    assert proc.returncode == 0 and not stale.exists()
    assert run_dir().exists()
    with scratch_dir("y-") as d:
        assert d.parent == run_dir()
    assert not d.exists()


def test_failed_report_leaves_no_empty_folder(tmp_path, monkeypatch):
    import harness.evidence.report as rep

    jp, _ = write_receipt(*make_receipt(seed=4), tmp_path / "receipts")

    def boom(*a, **k):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(rep, "plot_positions", boom)
    with pytest.raises(RuntimeError):
        rep.write_report(jp, tmp_path / "new" / "rep")
    assert not (tmp_path / "new" / "rep").exists()


def test_receipt_temp_files_of_killed_writers_are_swept(tmp_path):
    from harness.evidence.receipts import sweep_temp_files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    d = tmp_path / "receipts"
    d.mkdir()
    stale = d / f".{'a' * 64}.json.{dead.pid}.xyz.tmp"
    live = d / f".{'b' * 64}.npz.{os.getpid()}.xyz.tmp"
    stale.write_text("partial")
    live.write_text("being written")
    assert sweep_temp_files(d) == [stale]
    assert not stale.exists() and live.exists()
    jp, _ = write_receipt(*make_receipt(seed=5), d)
    assert load_receipt(jp).receipt["id"] == jp.stem


def test_non_comparable_stays_distinct_from_engine_errors(tmp_path):
    """The reader keeps NOT-COMPARABLE (a vocab mismatch) apart from engine errors."""
    out = tmp_path / "out"
    out.mkdir()
    np.save(out / "logits.npy", np.zeros((4, 8), np.float32))
    with pytest.raises(NotComparable, match="8 columns but the model's vocab has 7"):
        read_output(out, "logits.npy")
    assert stat.S_ISREG(os.stat(out / "logits.npy").st_mode)
