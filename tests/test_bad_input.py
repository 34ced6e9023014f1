"""The bad-input catalogue (issue 9): every kind of bad input a user can hand the harness is
answered by one line ``harness: VERDICT: message`` and the documented exit code (README, "Exit
codes") — never a traceback, never a half-written receipt.

One test per kind, through the CLI. Cheap kinds run the CLI's own entry point in this process
(``harness.cli.main``: the same argument parsing and error mapping as the console script); kinds
where the process matters (a ggml abort, a SIGKILL mid-write) run ``python -m harness`` as a
subprocess. Kinds already covered elsewhere are listed in ``COVERED_ELSEWHERE`` with the test that
covers them, and ``test_catalogue_references_exist`` keeps that list honest.

| kind | where | verdict / exit |
|---|---|---|
| GGUF truncated at 23 offsets (header, metadata, tensor infos, data) | here | INVALID 2 |
| GGUF wrong magic, unknown version, tensor offset past the end, duplicate tensor names | here | INVALID 2 |
| GGUF metadata of the wrong type (block_count a string) | here | lint FAIL 1 (QL102) / parity INVALID 2 |
| GGUF metadata array whose length runs past the end (was an endless, memory-filling loop) | test_fuzz.py | INVALID 2 |
| GGUF bytes mutated at random (flips, integers, truncations, splices) | test_fuzz.py | INVALID 2 or lint findings |
| GGUF unsupported architecture | here | INVALID 2 |
| thresholds.yaml: YAML syntax, schema violations, no basis | here | INVALID 2 |
| unknown engine names, bad ``--override-kv``, bad config / prompt files | here | INVALID 2 |
| command engine crash, garbage, nothing, wrong shape (CLI) | here | ENGINE-ERROR 3 |
| command engine hang, abort, pickle, float64 (engine level) | test_command_engine.py | ENGINE-ERROR 3 |
| vocab-size mismatch, token id out of range | here | NOT-COMPARABLE 4 |
| NaN / Inf logits | here | FAIL 1 |
| llama.cpp abort() mid-forward in a multi-model run | here | ENGINE-ERROR 3, next model runs |
| ledger row edited / removed / reordered / appended, 8 concurrent appends | test_ledger.py | verify exit 1 names the row |
| run SIGKILLed mid-write (6 code points + 5 moments) | here | no partial receipt; verify 0; next run PASS |
| contracts: YAML syntax, schema, unknown/duplicate obligation ids, unknown reds/oracles | here | INVALID 2, every error FILE:LINE: FIELD |
| contracts: missing or unmarked test ids | test_contracts.py | INVALID 2 |

Hostile inputs (issue 16), each kind with its inputs and a hypothesis strategy in test_hostile.py:

| kind | inputs | verdict / exit |
|---|---|---|
| 1 evidence lost or corrupted | identical runs racing on one receipt; ``--ledger LEDGER.md``; ``--ledger notes/README.jsonl``; read-only ledger, rendering, lock, receipts | every row verifies; INVALID 2 before engines run, nothing written |
| 2 resource exhaustion | ``block_count=int:1000000000`` (any count or size beyond the file); YAML aliases to large scalars; 600 MB engine stderr | INVALID 2 / lint QL103; INVALID 2; ENGINE-ERROR 3 with a 64 KiB tail |
| 3 hangs | logits.npy (any output) a FIFO, socket, directory or link to a device; ``timeout_s = inf`` | ENGINE-ERROR 3; INVALID 2 |
| 4 terminal and markup injection | ESC/OSC/C1/bidi, ``[link=…]``, ``[/bold]``, ``$\\notacommand$`` in ids, names, engine output | shown escaped everywhere, PASS 0 |
| 5 exit 70 where the input is at fault | read-only HARNESS_CACHE_DIR; report ``--out`` under a file; config ``env = "X"``; a 5,000-digit token id; a prompt line nested 100k deep | INVALID 2, one line |
| 6 wrong party blamed | reference returning NaN logits; NaN in an engine's info.json | ENGINE-ERROR 3 naming that engine |
| 7 accepted nonsense | negative ``max_kld_mean``; NaN/Inf in token_embd, output, norms; NaN rms_eps; non-UTF-8 prompts; a depends_on cycle | INVALID 2 / lint QL406, QL111 |
| 8 leftovers | engine children on every exit path; SIGTERM, SIGKILL mid-run; failed reports | no process, temp folder or empty report folder left |
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import fake_engines_config

from harness.fixtures import synthetic as fx

REPO = Path(__file__).resolve().parents[1]
V = 515  # tiny-qwen35's vocab


# ---------------------------------------------------------------------------------------------
# Running the CLI
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.strip()]

    def assert_one_line(self, verdict: str, code: int, *needles: str) -> str:
        """Exit ``code``, no traceback, exactly one ``harness: VERDICT: ...`` line naming ``needles``."""
        assert self.code == code, f"exit {self.code} != {code}\nstdout: {self.out[-2000:]}\nstderr: {self.err[-2000:]}"
        assert "Traceback" not in self.out + self.err
        lines = self.error_lines
        assert len(lines) == 1, self.err
        assert lines[0].startswith(f"harness: {verdict}: "), lines[0]
        for n in needles:
            assert n in lines[0], (n, lines[0])
        return lines[0]


def cli(*args: str) -> Run:
    """``harness ARGS`` through the console script's entry point, in this process."""
    from harness.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return Run(code, out.getvalue(), err.getvalue())


def cli_process(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300) -> Run:
    """``python -m harness ARGS`` as a separate process (the user's path)."""
    p = subprocess.run([sys.executable, "-m", "harness", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd or REPO)
    return Run(p.returncode, p.stdout, p.stderr)


GATES = """schema: harness-thresholds/v2
release:
  min_positions: {value: 64, basis: {kind: declared, who: tests/test_bad_input.py, why: fixed gate so these tests do not follow calibration}}
  min_cosine: {value: 0.98, basis: {kind: declared, who: tests/test_bad_input.py, why: fixed gate so these tests do not follow calibration}}
"""


@pytest.fixture()
def gates(tmp_path) -> Path:
    """A thresholds file with a fixed cosine gate of 0.98 over 64 positions (the repository's
    thresholds.yaml is calibrated and moves)."""
    p = tmp_path / "gates.yaml"
    p.write_text(GATES)
    return p


def write_prompts(path: Path, prompts: dict[str, list[int]]) -> Path:
    path.write_text("".join(json.dumps({"id": k, "tokens": v}) + "\n" for k, v in prompts.items()))
    return path


# ---------------------------------------------------------------------------------------------
# GGUF files
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bytes() -> bytes:
    return fx.build("tiny-qwen35").read_bytes()


def gguf_regions(path: Path) -> dict[str, tuple[int, int]]:
    """Byte ranges ``[start, end)`` of a GGUF's header, metadata, tensor infos and tensor data,
    from ``gguf.GGUFReader``'s field offsets (the fixed header is magic, version, tensor count
    and KV count: 24 bytes)."""
    import gguf

    r = gguf.GGUFReader(path)
    first_info = r.tensors[0].field.offset
    last = r.tensors[-1].field
    infos_end = last.offset + sum(p.nbytes for p in last.parts)
    return {"header": (0, 24), "metadata": (24, first_info), "tensor_info": (first_info, infos_end),
            "data": (int(r.data_offset), path.stat().st_size)}


# (region, position): ints are absolute offsets inside the 24-byte header; floats are fractions
# of the region. 23 cut points: 8 in the header, 6 in metadata, 4 in tensor infos, 5 in data.
TRUNCATIONS = (
    [("header", o) for o in (0, 3, 4, 7, 8, 15, 16, 23)]
    + [("metadata", f) for f in (0.0, 0.001, 0.25, 0.5, 0.75, 0.999)]
    + [("tensor_info", f) for f in (0.0, 0.02, 0.5, 0.999)]
    + [("data", f) for f in (0.0, 1e-4, 0.5, 0.9, 0.99999)]
)


@pytest.mark.parametrize("region, where", TRUNCATIONS, ids=[f"{r}-{w}" for r, w in TRUNCATIONS])
def test_gguf_truncated(tmp_path, tiny_bytes, region, where):
    start, end = gguf_regions(fx.build("tiny-qwen35"))[region]
    cut = where if isinstance(where, int) else start + int((end - start) * where)
    assert start <= cut < end and cut < len(tiny_bytes)
    p = tmp_path / f"cut-{cut}.gguf"
    p.write_bytes(tiny_bytes[:cut])
    line = cli("lint", p).assert_one_line("INVALID", 2, str(p))
    assert "truncated" in line or "not a readable GGUF" in line


def _edited(tmp_path: Path, data: bytes, name: str, at: int, new: bytes) -> Path:
    b = bytearray(data)
    b[at : at + len(new)] = new
    p = tmp_path / name
    p.write_bytes(bytes(b))
    return p


def test_gguf_wrong_magic(tmp_path, tiny_bytes):
    p = _edited(tmp_path, tiny_bytes, "magic.gguf", 0, b"GGML")
    cli_process("lint", p).assert_one_line("INVALID", 2, "not a readable GGUF", "magic")


def test_gguf_unknown_version(tmp_path, tiny_bytes):
    p = _edited(tmp_path, tiny_bytes, "version.gguf", 4, struct.pack("<I", 99))
    cli_process("lint", p).assert_one_line("INVALID", 2, "version 99")


def test_gguf_tensor_offset_past_the_end(tmp_path, tiny_bytes):
    """The 8-byte offset that closes a tensor-info record is set beyond the file's end."""
    import gguf

    r = gguf.GGUFReader(fx.build("tiny-qwen35"))
    t = r.tensors[5]
    at = t.field.offset + sum(p.nbytes for p in t.field.parts) - 8
    assert struct.unpack("<Q", tiny_bytes[at : at + 8])[0] == t.data_offset - r.data_offset
    p = _edited(tmp_path, tiny_bytes, "offset.gguf", at, struct.pack("<Q", 1 << 40))
    cli_process("lint", p).assert_one_line("INVALID", 2, str(p))


def test_gguf_duplicate_tensor_names(tmp_path, tiny_bytes):
    """blk.0.attn_norm.weight renamed in place to blk.1.attn_norm.weight (same length)."""
    import gguf

    r = gguf.GGUFReader(fx.build("tiny-qwen35"))
    old, new = b"blk.0.attn_norm.weight", b"blk.1.attn_norm.weight"
    at = tiny_bytes.index(old, r.tensors[0].field.offset)
    p = _edited(tmp_path, tiny_bytes, "dup.gguf", at, new)
    cli_process("lint", p).assert_one_line("INVALID", 2, "duplicate", "blk.1.attn_norm.weight")


@pytest.fixture(scope="module")
def block_count_string(tmp_path_factory) -> Path:
    def plant(meta, tensors):
        meta["qwen35.block_count"] = ("str", "8")

    return fx.build_fixture(fx.SPECS["tiny-qwen35"], tmp_path_factory.mktemp("wrongtype") / "bc-str.gguf", plant)


def test_gguf_metadata_wrong_type_is_a_lint_finding(block_count_string):
    r = cli("lint", block_count_string)
    assert r.code == 1 and "Traceback" not in r.out + r.err
    assert "QL102" in r.out and "qwen35.block_count has type STRING" in r.out


def test_gguf_metadata_wrong_type_refuses_parity(block_count_string):
    cli("parity", "--model", block_count_string, "--no-evidence").assert_one_line(
        "INVALID", 2, "'qwen35.block_count' should be an integer")


@pytest.fixture(scope="module")
def llama_arch(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("arch") / "llama.gguf"
    fx.write_gguf(p, "llama", {"llama.block_count": ("u32", 1)}, {"token_embd.weight": np.zeros((8, 4), np.float32)})
    return p


@pytest.mark.parametrize("command", ["lint", "parity"])
def test_gguf_unsupported_architecture(llama_arch, command):
    args = [llama_arch] if command == "lint" else ["--model", llama_arch, "--no-evidence"]
    cli(command, *args).assert_one_line("INVALID", 2, "unsupported architecture 'llama'", "qwen35, qwen35moe")


# ---------------------------------------------------------------------------------------------
# Configuration: thresholds.yaml, engine names, --override-kv, config and prompt files
# ---------------------------------------------------------------------------------------------
BASIS = "basis: {kind: declared, who: test, why: test}"
THRESHOLDS_BAD = {
    "yaml-syntax": ("schema: harness-thresholds/v2\nrelease:\n  min_cosine: {value: 0.98\n", ["YAML syntax error", ":4:"]),
    "yaml-tab-indent": ("schema: harness-thresholds/v2\nrelease:\n\tmin_cosine: 1\n", ["YAML syntax error"]),
    "not-a-mapping": ("- 1\n- 2\n", ["must be a mapping"]),
    "empty-file": ("", ["must be a mapping"]),
    "wrong-schema-id": (f"schema: harness-thresholds/v9\nrelease:\n  min_positions: {{value: 64, {BASIS}}}\n  min_cosine: {{value: 0.98, {BASIS}}}\n", ["schema"]),
    "value-not-a-number": (f"schema: harness-thresholds/v2\nrelease:\n  min_positions: {{value: 64, {BASIS}}}\n  min_cosine: {{value: high, {BASIS}}}\n", ["release.min_cosine"]),
    "gate-missing": (f"schema: harness-thresholds/v2\nrelease:\n  min_positions: {{value: 64, {BASIS}}}\n", ["min_cosine"]),
    "unknown-basis-kind": ("schema: harness-thresholds/v2\nrelease:\n  min_positions: {value: 64, basis: {kind: guessed}}\n"
                           f"  min_cosine: {{value: 0.98, {BASIS}}}\n", ["invalid basis"]),
    "duplicate-key": (f"schema: harness-thresholds/v2\nrelease:\n  min_positions: {{value: 64, {BASIS}}}\n  min_cosine: {{value: 0.98, {BASIS}}}\n"
                      f"  min_cosine: {{value: 0.5, {BASIS}}}\n", ["duplicate key 'min_cosine'", ":5"]),
    "non-finite": (f"schema: harness-thresholds/v2\nrelease:\n  min_positions: {{value: 64, {BASIS}}}\n  min_cosine: {{value: .nan, {BASIS}}}\n", ["finite"]),
    "no-basis": ("schema: harness-thresholds/v2\nrelease:\n  min_positions: {value: 64, basis: {kind: declared, who: a, why: b}}\n"
                 "  min_cosine: {value: 0.98}\n", ["release.min_cosine has no basis", ":4"]),
    "bare-number": (f"schema: harness-thresholds/v2\nrelease:\n  min_positions: {{value: 64, {BASIS}}}\n  min_cosine: 0.98\n", ["has no basis"]),
    "not-utf8": (b"schema: \xff\xfe\n", ["not UTF-8"]),
}


@pytest.mark.parametrize("kind", list(THRESHOLDS_BAD))
def test_thresholds_file_refused(tmp_path, kind):
    text, needles = THRESHOLDS_BAD[kind]
    p = tmp_path / "thresholds.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    cli("parity", "--model", "fixture:tiny-qwen35", "--thresholds", p, "--no-evidence").assert_one_line(
        "INVALID", 2, str(p), *needles)


def test_missing_thresholds_file(tmp_path):
    cli("parity", "--model", "fixture:tiny-qwen35", "--thresholds", tmp_path / "nope.yaml", "--no-evidence").assert_one_line(
        "INVALID", 2, "cannot read thresholds file")


@pytest.mark.parametrize("option, name", [("--candidate", "nosuch"), ("--reference", "llama-cpp-2"), ("--candidate", "command:nope"),
                                          ("--candidate", "mutant:nope")])
def test_unknown_engine_name(option, name):
    line = cli("parity", "--model", "fixture:tiny-qwen35", option, name, "--no-evidence").assert_one_line("INVALID", 2)
    assert name.split(":")[-1] in line and ("known:" in line or "configured:" in line)


BAD_OVERRIDES = ["qwen35.block_count=8", "=int:8", "qwen35.block_count", "qwen35.block_count=long:8",
                 "qwen35.block_count=int:eight", "qwen35.block_count=int:", "general.flag=bool:maybe", "x=float:1e"]


@pytest.mark.parametrize("command", ["lint", "parity"])
@pytest.mark.parametrize("text", BAD_OVERRIDES)
def test_bad_override_kv(command, text):
    args = ["fixture:tiny-qwen35"] if command == "lint" else ["--model", "fixture:tiny-qwen35", "--no-evidence"]
    cli(command, *args, "--override-kv", text).assert_one_line("INVALID", 2, "--override-kv")


CONFIG_BAD = {
    "toml-syntax": ("[engines.x\ncommand = 1\n", "invalid TOML"),
    "command-a-string": ('[engines.x]\ncommand = "python engine.py {request}"\n', "list of strings without NUL (no shell)"),
    "timeout-negative": ('[engines.x]\ncommand = ["a"]\ntimeout_s = -1\n', "timeout_s must be a finite number of seconds"),
    "engine-not-a-table": ("[engines]\nx = 3\n", "must be a table"),
}


@pytest.mark.parametrize("kind", list(CONFIG_BAD))
def test_bad_engine_config(tmp_path, monkeypatch, kind):
    text, needle = CONFIG_BAD[kind]
    cfg = tmp_path / "harness.toml"
    cfg.write_text(text)
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    cli("parity", "--model", "fixture:tiny-qwen35", "--candidate", "command:x", "--no-evidence").assert_one_line(
        "INVALID", 2, needle)


PROMPTS_BAD = {
    "bad-json": ('{"id": "a", "tokens": [1, 2\n', "invalid JSON"),
    "no-id": ('{"tokens": [1, 2]}\n', "string 'id'"),
    "duplicate-id": ('{"id": "a", "tokens": [1]}\n{"id": "a", "tokens": [2]}\n', "duplicate prompt id"),
    "negative-token": ('{"id": "a", "tokens": [1, -2]}\n', "non-negative ints"),
    "float-token": ('{"id": "a", "tokens": [1, 2.5]}\n', "non-negative ints"),
    "empty": ("\n", "no prompts"),
}


@pytest.mark.parametrize("kind", list(PROMPTS_BAD))
def test_bad_prompt_file(tmp_path, kind):
    text, needle = PROMPTS_BAD[kind]
    p = tmp_path / "prompts.jsonl"
    p.write_text(text)
    cli("parity", "--model", "fixture:tiny-qwen35", "--prompts", p, "--no-evidence").assert_one_line("INVALID", 2, needle)


def test_unknown_fixture_and_missing_model(tmp_path):
    cli("lint", "fixture:nope").assert_one_line("INVALID", 2, "unknown fixture 'nope'", "tiny-qwen35")
    cli("parity", "--model", tmp_path / "none.gguf", "--no-evidence").assert_one_line("INVALID", 2, "no such model file")


# ---------------------------------------------------------------------------------------------
# Contracts (harness contracts validate / harness discharge)
# ---------------------------------------------------------------------------------------------
SHAPES = REPO / "contracts" / "qwen35-shapes-v1.yaml"
CONTRACT_BAD = {
    # kind: (edit of the committed shapes contract, text every error report must name)
    "yaml-syntax": (lambda t: t.replace("obligations:\n", "obligations: [\n", 1), "YAML syntax error"),
    "yaml-tab": (lambda t: t.replace("\n  - id: Q35S-HP-002", "\n\t- id: Q35S-HP-002", 1), "YAML syntax error"),
    "not-a-mapping": (lambda t: "- just\n- a list\n", "a contract is a YAML mapping"),
    "obligation-id-pattern": (lambda t: t.replace("id: Q35S-KEY-001", "id: q35s-key-1", 1), "obligations[0].id: 'q35s-key-1' does not match"),
    "field-missing": (lambda t: t.replace("    formal: \"∀ required key", "    formol: \"∀ required key", 1), "obligations[0].formal: required field missing"),
    "unknown-kind": (lambda t: t.replace("kind: shape", "kind: vibes", 1), "obligations[0].kind: 'vibes' is not one of"),
    "duplicate-obligation-id": (lambda t: t.replace("id: Q35S-HP-002", "id: Q35S-KEY-001", 1), "duplicate obligation id Q35S-KEY-001"),
    "duplicate-key": (lambda t: t.replace("version: 1.0.0\n", "version: 1.0.0\nversion: 1.0.1\n", 1), "version: duplicate key"),
    "id-not-file-name": (lambda t: t.replace("id: qwen35-shapes-v1", "id: qwen35-shapes-v2", 1), "must equal the file name"),
    "unknown-red": (lambda t: t.replace("{fixture: missing-key}", "{fixture: no-such-defect}", 1), "unknown fixture 'no-such-defect'"),
    "unknown-oracle": (lambda t: t.replace("oracle: harness.model.lint.check_tensors", "oracle: harness.model.lint.no_such_check", 1), "has no attribute 'no_such_check'"),
}


@pytest.mark.parametrize("kind", list(CONTRACT_BAD))
def test_contract_refused(tmp_path, kind):
    """Every error is one ``harness: INVALID: FILE:LINE: FIELD: message`` line; exit 2."""
    edit, needle = CONTRACT_BAD[kind]
    (tmp_path / "contracts").mkdir()
    p = tmp_path / "contracts" / SHAPES.name
    text = SHAPES.read_text()
    assert edit(text) != text, "the edit must change the contract"
    p.write_text(edit(text))
    r = cli("contracts", "validate", p)
    assert r.code == 2 and "Traceback" not in r.out + r.err
    assert r.error_lines and all(ln.startswith(f"harness: INVALID: {p}:") for ln in r.error_lines), r.err
    assert any(needle in ln for ln in r.error_lines), r.err


def test_unknown_obligation_id_in_discharge():
    cli("discharge", SHAPES, "--obligation", "Q35S-NOPE-999", "--no-write").assert_one_line(
        "INVALID", 2, "no obligation 'Q35S-NOPE-999'", "Q35S-KEY-001")


def test_missing_contract_file(tmp_path):
    cli("contracts", "validate", tmp_path / "nope.yaml").assert_one_line("INVALID", 2, "no such contract file")


# ---------------------------------------------------------------------------------------------
# Engines: command engines configured through $HARNESS_CONFIG, llama.cpp aborting
# ---------------------------------------------------------------------------------------------
# Each fake engine is a Python body run with the request in ``req``, the output dir in ``out``
# and ``good`` (deterministic well-formed logits for the request's tokens) at hand.
FAKES = {
    "good": "np.save(out + '/logits.npy', good)",
    "near": "np.save(out + '/logits.npy', good + np.float32(1e-3))",
    "nan": "good[70, 3] = np.nan; np.save(out + '/logits.npy', good)",
    "inf": "good[65, 9] = np.inf; np.save(out + '/logits.npy', good)",
    "wide": "np.save(out + '/logits.npy', np.zeros((len(req['tokens']), V + 1), np.float32))",
    "crash": "sys.stderr.write('kernel panic in matmul_q4k\\n'); sys.exit(9)",
    "garbage": "open(out + '/logits.npy', 'wb').write(b'\\x93NUMPY garbage')",
    "nothing": "pass",
    "short": "np.save(out + '/logits.npy', good[:-1])",
}


@pytest.fixture()
def engines_config(tmp_path, monkeypatch) -> Path:
    """A $HARNESS_CONFIG naming one command engine per ``FAKES`` entry."""
    good = "good = np.stack([np.random.default_rng(t).standard_normal(V).astype(np.float32) for t in req['tokens']])\n"
    return fake_engines_config(tmp_path, monkeypatch, FAKES, V, 20, preamble=good)


@pytest.fixture()
def prompts_80(tmp_path) -> Path:
    return write_prompts(tmp_path / "p80.jsonl", {"p80": [(7 * i + 3) % V for i in range(80)]})


def _parity_cmd(prompts: Path, candidate: str, reference: str = "command:good", *extra) -> list:
    """A parity command line judged by the fixed test gates alone (``--no-calibrate``)."""
    return ["parity", "--model", "fixture:tiny-qwen35", "--prompts", prompts, "--candidate", candidate, "--reference", reference,
            "--no-calibrate", *extra]


@pytest.mark.parametrize("name, nonfinite, pos", [("nan", "nan", 70), ("inf", "inf", 65)])
def test_nonfinite_logits_fail_at_their_position(engines_config, prompts_80, gates, name, nonfinite, pos):
    r = cli(*_parity_cmd(prompts_80, f"command:{name}", "command:good", "--no-evidence", "--thresholds", gates))
    assert r.code == 1, r.err + r.out
    assert "Traceback" not in r.out + r.err
    assert "FAIL: release gate cosine ≥ 0.98 over ≥ 64 positions: FAIL" in r.out and "(1 below)" in r.out
    assert f"first failing: prompt 'p80' position {pos}" in r.out
    assert "non-finite" in r.out


def test_nonfinite_fail_is_recorded_as_evidence(engines_config, prompts_80, gates, tmp_path):
    ledger = tmp_path / "ev" / "ledger.jsonl"
    r = cli(*_parity_cmd(prompts_80, "command:nan", "command:good", "--ledger", ledger, "--json", "--thresholds", gates))
    assert r.code == 1
    rec = json.loads(r.out)
    assert rec["gated"]["verdict"] == "FAIL" and rec["gated"]["first_nonfinite"] == {"prompt": "p80", "position": 70, "token": rec["prompts"]["items"][0]["tokens"][70]}
    assert cli("ledger", "verify", "--ledger", ledger).code == 0


def test_vocab_size_mismatch_is_not_comparable(engines_config, prompts_80):
    cli(*_parity_cmd(prompts_80, "command:wide", "command:good", "--no-evidence")).assert_one_line(
        "NOT-COMPARABLE", 4, "516 columns", "vocab has 515")


def test_token_id_out_of_range_is_not_comparable(tmp_path):
    """A prompt file holding an id outside the model's vocab; llama.cpp is the reference."""
    p = write_prompts(tmp_path / "oob.jsonl", {"ok": list(range(100)), "oob": [1, 2, 3, V + 1000]})
    cli("parity", "--model", "fixture:tiny-qwen35", "--prompts", p, "--no-evidence").assert_one_line(
        "NOT-COMPARABLE", 4, "prompt 'oob'", f"token id {V + 1000} outside the vocab [0, {V})")


@pytest.mark.parametrize("name, needle", [("crash", "exited 9"), ("garbage", "unreadable logits.npy"),
                                          ("nothing", "wrote no logits.npy"), ("short", "shape (79, 515)")])
def test_broken_command_engine_is_engine_error(engines_config, prompts_80, tmp_path, name, needle):
    ledger = tmp_path / "ev" / "ledger.jsonl"
    r = cli(*_parity_cmd(prompts_80, f"command:{name}", "command:good", "--ledger", ledger))
    assert r.code == 3 and "Traceback" not in r.out + r.err
    first = r.error_lines[0]
    assert first.startswith("harness: ENGINE-ERROR: command:") and needle in first, r.err
    if name == "crash":  # the engine's own stderr tail follows the one-line verdict
        assert "kernel panic in matmul_q4k" in r.err
    assert not ledger.exists() and not (ledger.parent / "receipts").exists()  # nothing half-written


@pytest.fixture(scope="module")
def aborting_model(tmp_path_factory) -> Path:
    """Loads in llama.cpp, then ggml aborts in the first forward (ssm_conv1d stored F16)."""

    def ssm_conv_f16(meta, tensors):
        tensors["blk.0.ssm_conv1d.weight"] = tensors["blk.0.ssm_conv1d.weight"].astype(np.float16)

    return fx.build_fixture(fx.SPECS["tiny-qwen35"], tmp_path_factory.mktemp("abort") / "abort.gguf", ssm_conv_f16)


def test_llama_cpp_abort_in_multi_model_run(aborting_model, gates, tmp_path):
    """``harness parity --model bad --model good``: the abort is ENGINE-ERROR for the bad model,
    the good one still runs to PASS and its receipt and ledger row are written."""
    prompts = write_prompts(tmp_path / "p.jsonl", {"p": [(5 * i + 1) % V for i in range(72)]})
    ledger = tmp_path / "ev" / "ledger.jsonl"
    r = cli_process("parity", "--model", aborting_model, "--model", "fixture:tiny-qwen35", "--prompts", prompts,
                    "--ledger", ledger, "--thresholds", gates, "--no-calibrate", cwd=tmp_path, timeout=120)
    assert r.code == 3, r.err + r.out
    assert "Traceback" not in r.out + r.err
    bad = [ln for ln in r.err.splitlines() if ln.startswith("harness: ")]
    assert len(bad) == 1 and bad[0].startswith(f"harness: ENGINE-ERROR: {aborting_model}: llama.cpp died with SIGABRT"), r.err
    assert "GGML_ASSERT" in bad[0]  # llama.cpp's own reason, not a debugger's backtrace
    assert f"2 models: {aborting_model}=ENGINE-ERROR, fixture:tiny-qwen35=PASS -> ENGINE-ERROR" in r.out
    receipts = sorted((ledger.parent / "receipts").glob("*/*.json"))
    assert len(receipts) == 1
    rec = json.loads(receipts[0].read_text())
    assert rec["model"]["name"] == "fixture:tiny-qwen35" and rec["gated"]["verdict"] == "PASS"
    v = cli("ledger", "verify", "--ledger", ledger)
    assert v.code == 0 and "OK (1 rows" in v.out


# ---------------------------------------------------------------------------------------------
# Evidence: a run killed mid-write
# ---------------------------------------------------------------------------------------------
def test_run_killed_mid_write_leaves_no_partial_evidence(tmp_path):
    """SIGKILL ``harness parity`` at every write step of its evidence (npz temp written, npz
    renamed, json temp written, receipt done but no ledger row, ledger row done but LEDGER.md not
    re-rendered, report half-written) and at five moments of a run: no partial receipt ``.json``
    is ever visible, every visible receipt loads and checks, ``harness ledger verify`` exits 0
    and the next run proceeds (tests/_kill_driver.py does the killing, forked from one warm
    process so each run costs no interpreter start)."""
    work = tmp_path / "kill"
    work.mkdir()
    (work / "gates.yaml").write_text(GATES)
    p = subprocess.run([sys.executable, str(Path(__file__).parent / "_kill_driver.py"), str(work)],
                       capture_output=True, text=True, timeout=240, cwd=work)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    killed = [k for k in report["runs"] if k["signal"] == "SIGKILL"]
    assert len(killed) >= 8, report  # the six code points and at least two moments landed mid-run
    for k in report["runs"]:
        assert k["problems"] == [], k
        assert k["partial_json"] == [], k
    assert report["final"]["exit"] == 0
    assert report["final"]["rows"] == report["final"]["rows_before"] + 1
    ledger = work / "ev" / "ledger.jsonl"
    v = cli_process("ledger", "verify", "--ledger", ledger)
    assert v.code == 0 and "chain and receipts verified" in v.out, v.out + v.err


# ---------------------------------------------------------------------------------------------
# Kinds covered by other test files
# ---------------------------------------------------------------------------------------------
COVERED_ELSEWHERE = {
    "command engine hangs past its timeout": "tests/test_command_engine.py::test_broken_engines_are_engine_errors",
    "command engine aborts / writes a pickle / float64": "tests/test_command_engine.py::test_broken_engines_are_engine_errors",
    "command engine wrong vocab (engine level)": "tests/test_command_engine.py::test_vocab_mismatch_is_not_comparable",
    "ggml abort (engine level)": "tests/test_llamacpp.py::test_ggml_abort_becomes_engine_error",
    "ledger row edited": "tests/test_ledger.py::test_one_edited_byte_is_named",
    "ledger row edited into invalid JSON": "tests/test_ledger.py::test_edited_byte_that_breaks_json_is_named_by_line_and_seq",
    "ledger last row removed": "tests/test_ledger.py::test_removed_last_row_is_detected_by_the_markdown_head",
    "ledger middle row removed": "tests/test_ledger.py::test_removed_middle_row_is_detected",
    "ledger rows reordered": "tests/test_ledger.py::test_reordered_rows_are_detected",
    "ledger row appended by hand (forged, hashes recomputed)": "tests/test_ledger.py::test_forged_row_with_recomputed_hashes_is_caught_by_its_receipt",
    "8 processes appending at once": "tests/test_ledger.py::test_eight_processes_append_concurrently_without_loss",
    "receipt edited": "tests/test_receipts.py::test_edited_receipt_is_detected",
    "receipt sidecar replaced / pickled": "tests/test_receipts.py::test_pickled_npz_is_refused",
    "contract cites a test pytest cannot collect": "tests/test_contracts.py::test_unknown_test_id_is_invalid_exit_2",
    "contract cites an unmarked test / a missing file": "tests/test_contracts.py::test_unmarked_and_missing_file_tests_are_invalid",
    "contract obligation id duplicated across contracts": "tests/test_contracts.py::test_schema_and_semantic_errors_name_file_line_field",
    "GGUF truncated (GGUFModel level)": "tests/test_gguf_errors.py::test_truncated_file_is_invalid_input",
    "GGUF array length past the end of the file": "tests/test_fuzz.py::test_gguf_array_length_past_the_end_is_refused_at_once",
    "GGUF bytes mutated at random": "tests/test_fuzz.py::test_gguf_reader_and_lint_on_mutated_bytes",
    "thresholds.yaml alias bombs, recursive aliases, deep nesting": "tests/test_fuzz.py::test_thresholds_alias_bombs_and_deep_nesting_are_invalid",
    "1 identical runs racing on one receipt id": "tests/test_hostile.py::test_concurrent_writers_never_lose_or_replace_evidence",
    "1 --ledger LEDGER.md": "tests/test_hostile.py::test_ledger_named_like_a_rendering_is_refused_before_engines_run",
    "1 --ledger notes/README.jsonl": "tests/test_hostile.py::test_ledger_beside_an_unrelated_markdown_is_refused",
    "1 read-only ledger, rendering, lock, receipts": "tests/test_hostile.py::test_unwritable_evidence_is_refused_before_engines_run",
    "1 any ledger path and what lies beside it": "tests/test_hostile.py::test_evidence_never_overwrites_what_the_harness_did_not_write",
    "2 block_count=int:1000000000": "tests/test_hostile.py::test_block_count_override_beyond_the_file_is_refused",
    "2 every count and size field oversized": "tests/test_hostile.py::test_every_count_and_size_field_is_bounded_by_the_file",
    "2 YAML aliases to large scalars": "tests/test_hostile.py::test_yaml_aliases_to_large_scalars_are_refused",
    "2 600 MB engine stderr": "tests/test_hostile.py::test_engine_stderr_flood_is_read_as_a_tail",
    "3 FIFO logits.npy": "tests/test_hostile.py::test_fifo_logits_is_an_engine_error_not_a_hang",
    "3 non-regular files wherever an engine writes": "tests/test_hostile.py::test_non_regular_engine_outputs_are_refused_without_blocking",
    "3 infinite or non-positive timeouts": "tests/test_hostile.py::test_timeouts_must_be_finite_and_positive",
    "4 ESC/OSC, rich markup, mathtext in prompt ids": "tests/test_hostile.py::test_hostile_prompt_ids_are_shown_escaped_everywhere",
    "4 hostile text in every printed field": "tests/test_hostile.py::test_hostile_strings_in_every_printed_field",
    "5 read-only HARNESS_CACHE_DIR": "tests/test_hostile.py::test_read_only_cache_dir",
    "5 report --out under a regular file": "tests/test_hostile.py::test_report_out_under_a_regular_file",
    "5 config env = \"X\"": "tests/test_hostile.py::test_config_env_not_a_table",
    "5 a token id with 5,000 digits": "tests/test_hostile.py::test_token_id_with_5000_digits",
    "5 a prompt line nested 100k deep": "tests/test_hostile.py::test_prompt_line_nested_100k_deep",
    "6 reference returning NaN logits": "tests/test_hostile.py::test_reference_nan_is_an_engine_error_naming_the_reference",
    "6 non-finite info.json": "tests/test_hostile.py::test_nonfinite_info_json_is_refused_the_same_in_dry_and_recording_runs",
    "7 negative max_kld_mean": "tests/test_hostile.py::test_negative_max_kld_mean_is_refused_at_load",
    "7 NaN/Inf weights, NaN rms_eps (lint)": "tests/test_hostile.py::test_lint_flags_nonfinite_weights_and_hyperparameters",
    "7 non-UTF-8 prompt file": "tests/test_hostile.py::test_non_utf8_prompt_file_is_refused",
    "7 depends_on cycle": "tests/test_hostile.py::test_depends_on_cycle_is_refused",
    "8 engine children, temp folders on every exit path": "tests/test_hostile.py::test_no_engine_exit_path_leaves_children_or_temp_files",
    "8 SIGTERM mid-run": "tests/test_hostile.py::test_sigterm_mid_run_kills_the_engine_and_removes_temp_files",
    "8 SIGKILL mid-run": "tests/test_hostile.py::test_sigkilled_runs_temp_folders_are_removed_by_the_next_run",
    "8 empty report folders": "tests/test_hostile.py::test_failed_report_leaves_no_empty_folder",
    "engine-output reader fuzzing": "tests/test_fuzz.py::test_engine_output_reader_on_generated_outputs",
    "prompt loader fuzzing": "tests/test_fuzz.py::test_prompt_loader_on_generated_files",
}


def test_catalogue_references_exist():
    import ast

    for kind, ref in COVERED_ELSEWHERE.items():
        path, _, func = ref.partition("::")
        src = (REPO / path).read_text()
        if func:
            names = {n.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)}
            assert func in names, (kind, ref)


def test_calibrate_refuses_an_unknown_mutant_before_measuring_anything(tmp_path):
    """``harness calibrate --mutant NAME`` with a name no mutant has: exit 2, one line listing the
    mutants, and the thresholds file it would write is left as it was (nothing was measured)."""
    out = tmp_path / "thresholds.yaml"
    out.write_text("kept\n")
    line = cli("calibrate", "--mutant", "no-such-mutant", "--out", out).assert_one_line("INVALID", 2, "'no-such-mutant'", "conv-state-dropped")
    assert "mutants:" in line and out.read_text() == "kept\n"
