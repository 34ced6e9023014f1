"""Hostile inputs, round 3 (issue 44): each defect found by the 122 hostile inputs of that round,
with the exact exit code and the one ``harness: VERDICT: message`` line asserted, and the
judgement calls of docs/release.md ("Hostile evidence folders and inputs") held to what the docs say.

The two forging routes of the sign-off (an edited query cache, a re-hashed last row) are in
tests/test_release.py (``test_an_edited_query_cache_cannot_flip_a_tokenizer_fail``,
``test_a_rehashed_last_row_cannot_flip_a_tokenizer_fail``); ``ledger show`` on an edited cache in
tests/test_ledger_show.py. Here:

1. a truncated HTTP body (Content-Length larger than what is sent) is ENGINE-ERROR (3);
2. a server trickling a byte every 0.2 s is stopped by ``timeout_s`` (the whole request), and so is
   a ``command:`` engine trickling its reply line;
3. a checkpoint nested 100,000 deep is INVALID (2), no RecursionError;
4. ``ledger render`` on a read-only evidence folder is INVALID (2);
5. a row with seq 2**70 is flagged and refused, never an OverflowError;
6. a no-op incremental verify prints the checkpoint it holds;
7. ``--prompts``, ``HARNESS_CONFIG``, ``--thresholds`` and ``--checkpoint`` are read with size
   limits (a 4 GiB address-space limit, ``/dev/zero``): INVALID (2), no MemoryError;
8. the judgement calls: duplicate JSON keys, a reply id ``true``, a checkpoint seq 3.5.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
from test_bad_input import cli, cli_process

from harness.engines.http_engine import HttpEngine, HttpSpec
from harness.errors import EngineError
from harness.fixtures.resolve import default_model, resolve_model

MODEL = resolve_model(default_model())


def one_line(err: str, verdict: str) -> str:
    """The single ``harness: VERDICT: ...`` line of ``err`` (asserted to be the only line)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"harness: {verdict}: "), err[-2000:]
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------------------ HTTP servers


class RawServer:
    """A one-connection-at-a-time TCP server whose ``reply(conn)`` writes whatever bytes it likes
    (a body shorter than its Content-Length, a byte at a time) after reading the request head."""

    def __init__(self, reply):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    data = b""
                    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                        data += chunk
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")), 0)
                    while len(body) < length and (chunk := conn.recv(65536)):  # the whole request: unread bytes at close send a reset
                        body += chunk
                    self.reply(conn, self.stop)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def raw_server():
    made = []

    def make(reply):
        s = RawServer(reply)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _truncated(conn, stop) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"tokens\": [5,")


def _trickle(conn, stop) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    while not stop.is_set():
        conn.sendall(b" ")
        time.sleep(0.2)


def test_a_truncated_http_body_is_an_engine_error(raw_server):
    """Issue 44 defect 2: 200 with a Content-Length larger than what is sent, then close, was
    ``INTERNAL-ERROR: ProtocolError: ('Connection broken: IncompleteRead(...)')``."""
    srv = raw_server(_truncated)
    eng = HttpEngine(HttpSpec("cut", srv.url, "m", timeout_s=10), MODEL)
    with pytest.raises(EngineError) as e:
        eng.tokenize_text("hello")
    assert str(e.value) == ("http:cut: the answer to /extras/tokenize was cut short (IncompleteRead: the connection closed before "
                            "the body's announced length)")


def test_a_trickling_server_is_stopped_by_the_whole_request_timeout(raw_server):
    """Issue 44 defect 3: one byte every 0.5 s kept a 15 s timeout waiting past 200 s (the timeout
    bounded each read). ``timeout_s`` now bounds the whole request."""
    srv = raw_server(_trickle)
    eng = HttpEngine(HttpSpec("slow", srv.url, "m", timeout_s=1.0), MODEL)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as e:
        eng.tokenize_text("hello")
    assert time.monotonic() - t0 < 3.0
    assert str(e.value) == f"http:slow timed out after 1 s ({srv.url}/extras/tokenize: the whole request, connect to last byte)"
    srv.stop.set()


def _http_config(tmp_path: Path, url: str, timeout_s: float) -> Path:
    cfg = tmp_path / "harness.toml"
    cfg.write_text(f'[http.bad]\nurl = "{url}"\nmodel = "m"\ntimeout_s = {timeout_s}\n')
    return cfg


@pytest.mark.parametrize("reply, timeout_s, message", [
    (_truncated, 10, "http:bad: the answer to /extras/tokenize was cut short (IncompleteRead: "),
    (_trickle, 1, "http:bad timed out after 1 s ("),
], ids=["truncated", "trickle"])
def test_bad_http_servers_through_the_cli_are_exit_3_and_one_line(raw_server, tmp_path, reply, timeout_s, message):
    srv = raw_server(reply)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "one", "tokens": [5, 9]}) + "\n")
    t0 = time.monotonic()
    r = cli_process("parity", "--candidate", "http:bad", "--no-evidence", "--prompts", prompts,
                    env={"HARNESS_CONFIG": str(_http_config(tmp_path, srv.url, timeout_s))}, timeout=120)
    srv.stop.set()
    assert r.code == 3 and message in one_line(r.err, "ENGINE-ERROR") and time.monotonic() - t0 < 60


def test_a_command_engine_trickling_its_reply_is_stopped_by_its_timeout(tmp_path, monkeypatch):
    """``timeout_s`` bounds a ``command:`` engine's whole request too (protocol 2: the reply line
    must be complete by the deadline, however many bytes arrive before it)."""
    script = tmp_path / "trickle.py"
    script.write_text("import sys, time\nfor line in sys.stdin:\n    while True:\n        sys.stdout.write(' '); sys.stdout.flush(); time.sleep(0.2)\n")
    cfg = tmp_path / "harness.toml"
    cfg.write_text(f'[engines.trickle]\ncommand = ["{{python}}", "{script}"]\nprotocol = 2\ntimeout_s = 1\ncapabilities = []\n')
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "one", "tokens": [5, 9]}) + "\n")
    t0 = time.monotonic()
    r = cli_process("parity", "--candidate", "command:trickle", "--no-evidence", "--prompts", prompts, env={"HARNESS_CONFIG": str(cfg)},
                    timeout=120)
    assert r.code == 3 and "command:trickle timed out after 1 s" in one_line(r.err, "ENGINE-ERROR") and time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------ the evidence folder


@pytest.fixture
def evidence(tmp_path) -> Path:
    """A valid 3-row ledger (synthetic receipts through ``record_evidence``) in ``tmp_path/ev``."""
    from test_hostile import seed_ledger

    ledger = tmp_path / "ev" / "ledger.jsonl"
    seed_ledger(ledger, seeds=(0, 1, 2))
    return ledger


def verify(ledger: Path, checkpoint: Path, *extra: str):
    return cli("ledger", "verify", "--ledger", ledger, "--checkpoint", checkpoint, "--quiet", *extra)


@pytest.mark.parametrize("depth, message", [
    (100_000, "the verify checkpoint is larger than 65,536 bytes; refused"),  # the file: refused unread
    (30_000, "not a verify checkpoint: nested too deeply"),  # within the size limit: parsed, and the depth refused
])
def test_a_deeply_nested_checkpoint_is_invalid(evidence, tmp_path, depth, message):
    """Issue 44 defect 4: 100,000 nested brackets as ``--checkpoint`` was ``INTERNAL-ERROR: RecursionError``."""
    cp = tmp_path / "cp.json"
    cp.write_text("[" * depth)
    r = verify(evidence, cp, "--incremental")
    assert r.code == 2 and one_line(r.err, "INVALID") == f"harness: INVALID: {cp}: {message}"


def test_a_no_op_incremental_verify_prints_the_checkpoint_it_holds(evidence, tmp_path):
    """Issue 44 defect 7: after a full verify, an incremental one with nothing new printed
    ``checkpoint: seq 0 row_hash 0000…`` while the file still held seq 3."""
    cp = tmp_path / "cp.json"
    full = verify(evidence, cp)
    assert full.code == 0 and json.loads(cp.read_text())["seq"] == 3
    again = verify(evidence, cp, "--incremental")
    line = again.out.splitlines()[-1]
    assert again.code == 0 and line == full.out.splitlines()[-1]
    assert line.startswith("checkpoint: seq 3 row_hash ") and "0" * 64 not in line
    assert "OK (3 rows, chain and receipts verified, incremental)" in again.out


def test_ledger_render_on_a_read_only_evidence_folder_is_invalid(evidence):
    """Issue 44 defect 5: ``ledger render`` exited 70 (``OSError: [Errno 30] Read-only file
    system: '…/ledger.jsonl.lock'``); parity and signoff gave a clean INVALID. Now so does render."""
    folder = evidence.parent
    (folder / "ledger.jsonl.lock").unlink(missing_ok=True)
    modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
    for p in modes:
        p.chmod(p.stat().st_mode & ~0o222)
    try:
        r = cli("ledger", "render", "--ledger", evidence)
    finally:
        for p, m in modes.items():
            p.chmod(m)
    assert r.code == 2
    assert one_line(r.err, "INVALID") == f"harness: INVALID: {folder}/ledger.jsonl.lock: cannot create the ledger lock file: {folder} is read-only"


def _append_seq(ledger: Path, seq: int) -> None:
    """Append a row chained to the last one, with its seq set to ``seq`` and its row_hash recomputed."""
    from harness.evidence import ledger as L
    from harness.evidence.receipts import canonical_json

    last = L.read_rows(ledger)[-1]
    row = dict(last, seq=seq, prev_hash=last["row_hash"])
    row["row_hash"] = L.row_hash(row)
    with open(ledger, "ab") as f:
        f.write(canonical_json(row) + b"\n")


def test_a_row_with_seq_2_70_is_flagged_and_refused_never_an_overflow(evidence):
    """Issue 44 defect 6: after one row with seq 2**70, ``verify`` flagged it but ``ledger show``,
    ``render``, ``index`` and every later append exited 70 (``OverflowError: Python int too large
    to convert to SQLite INTEGER``). Each now names the line and exits 2; verify still flags it."""
    from test_receipts import make_receipt

    from harness.errors import InvalidInput
    from harness.evidence.record import record_evidence

    _append_seq(evidence, 2**70)
    line = f"harness: INVALID: {evidence}:4: seq 1180591620717411303424 is out of range (1 to 2**63-1); run `harness ledger verify`"
    for args in (["show"], ["show", "--rows"], ["render"], ["index"]):
        r = cli("ledger", *args, "--ledger", evidence)
        assert r.code == 2 and one_line(r.err, "INVALID") == line, args
    v = cli("ledger", "verify", "--ledger", evidence, "--quiet")
    assert v.code == 1 and "SEQUENCE (line 4 seq 1180591620717411303424)" in v.out
    receipt, arrays = make_receipt(seed=7)
    with pytest.raises(InvalidInput) as e:
        record_evidence(receipt, arrays, evidence)
    assert str(e.value) == (f"{evidence}:4: last row is malformed (seq 1180591620717411303424 is out of range (1 to 2**63-1)); "
                            "run `harness ledger verify`")


def test_an_append_after_the_largest_seq_is_refused(evidence):
    """The largest seq SQLite holds (2**63-1) as the last row: the next append would overflow; it is refused."""
    from test_receipts import make_receipt

    from harness.errors import InvalidInput
    from harness.evidence.record import record_evidence

    _append_seq(evidence, 2**63 - 1)
    receipt, arrays = make_receipt(seed=7)
    with pytest.raises(InvalidInput, match=r"the last row's seq 9223372036854775807 leaves no room for another"):
        record_evidence(receipt, arrays, evidence)


# ------------------------------------------------------------------------------ inputs read with limits


def _limited(*args: str, env: dict[str, str] | None = None):
    """``python -m harness ARGS`` under a 4 GiB address-space limit (the issue's setting)."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    import os

    p = subprocess.run([sys.executable, "-m", "harness", *map(str, args)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})}, preexec_fn=limit)
    return p.returncode, p.stderr


@pytest.mark.parametrize("args, env, message", [
    (["parity", "--candidate", "oracle", "--no-evidence", "--prompts", "/dev/zero"], None,
     "harness: INVALID: /dev/zero: the prompt file is larger than 67,108,864 bytes; refused"),
    (["parity", "--candidate", "oracle", "--no-evidence"], {"HARNESS_CONFIG": "/dev/zero"},
     "harness: INVALID: /dev/zero: config is larger than 16,777,216 bytes; refused"),
    (["parity", "--candidate", "oracle", "--no-evidence", "--thresholds", "/dev/zero"], None,
     "harness: INVALID: /dev/zero: the thresholds file is larger than 67,108,864 bytes; refused"),
], ids=["prompts", "HARNESS_CONFIG", "thresholds"])
def test_inputs_are_read_with_size_limits(args, env, message):
    """Issue 44 defect 8: under a 4 GB address-space limit, ``--prompts /dev/zero`` and
    ``HARNESS_CONFIG=/dev/zero`` ended in ``INTERNAL-ERROR: MemoryError``."""
    code, err = _limited(*args, env=env)
    assert code == 2 and one_line(err, "INVALID") == message


def test_a_checkpoint_of_dev_zero_is_invalid(evidence):
    code, err = _limited("ledger", "verify", "--ledger", evidence, "--incremental", "--checkpoint", "/dev/zero", "--quiet")
    assert code == 2 and one_line(err, "INVALID") == "harness: INVALID: /dev/zero: the verify checkpoint is larger than 65,536 bytes; refused"


# ------------------------------------------------------------------------------ the judgement calls


@pytest.mark.parametrize("edit, message", [
    (lambda d: {**d, "seq": 3.5}, "not a verify checkpoint (field 'seq' must be a non-negative integer)"),
    (lambda d: {**d, "seq": True}, "not a verify checkpoint (field 'seq' must be a non-negative integer)"),
    (None, "not a verify checkpoint: key 'seq' appears twice"),
], ids=["seq-3.5", "seq-true", "seq-twice"])
def test_a_checkpoint_seq_must_be_an_integer_given_once(evidence, tmp_path, edit, message):
    """Judgement call (docs/release.md): a checkpoint ``seq`` of 3.5 was taken as 3; a checkpoint
    vouches for a prefix, so anything but one non-negative integer per field is refused."""
    cp = tmp_path / "cp.json"
    assert verify(evidence, cp).code == 0
    d = json.loads(cp.read_text())
    text = json.dumps(edit(d)) if edit else cp.read_text().replace('"seq": 3,', '"seq": 3, "seq": 3,')
    cp.write_text(text)
    r = verify(evidence, cp, "--incremental")
    assert r.code == 2 and one_line(r.err, "INVALID") == f"harness: INVALID: {cp}: {message}"


def test_a_duplicate_key_in_speculative_json_is_an_engine_error():
    """Judgement call: ``{"draft_max": 2, "draft_max": 9, ...}`` was read as 9 (the last wins); a
    key given twice in an engine's JSON (speculative.json, info.json, a reply line) is refused."""
    from harness.engines.command import parse_info, parse_speculation

    counts = b'{"draft": "mtp", "draft_max": 2, "draft_max": 2, "sequences": [{"accepted": [1], "rejected": [1]}]}'
    with pytest.raises(EngineError) as e:
        parse_speculation(b"[1, 2, 3]", counts, "command:x", 1, 3, 2, 100)
    assert str(e.value) == "command:x wrote a tokens.json or speculative.json that is not UTF-8 JSON (key 'draft_max' appears twice)"
    with pytest.raises(EngineError, match=r"unreadable info.json \(key 'name' appears twice\)"):
        parse_info(b'{"name": "a", "name": "b", "version": "1"}', "command:x")


@pytest.mark.parametrize("reply, message", [
    ('{"id": true, "ok": true, "files": []}', """answered request 1 with "{'id': True, 'ok': True, 'files': []}"; expected a JSON object with "id": 1"""),
    ('{"id": 1, "id": 1, "ok": true, "files": []}', "answered request 1 with a line that is not JSON (key 'id' appears twice)"),
], ids=["id-true", "id-twice"])
def test_a_reply_id_must_be_the_request_number(tmp_path, reply, message):
    """Judgement call: a reply ``id`` of ``true`` for request 1 was accepted (``True == 1`` in
    Python); an id is an integer, and a reply line names it once."""
    import sys

    from harness.engines.persistent import PersistentProcess

    script = tmp_path / "e.py"
    script.write_text(f"import sys\nfor line in sys.stdin:\n    print({reply!r}, flush=True)\n")
    p = PersistentProcess("command:e", [sys.executable, str(script)], None, {}, ("e", str(tmp_path)))
    try:
        with pytest.raises(EngineError) as e:
            p.request({"op": "info"}, p.out_dir(), 30)
        assert message in str(e.value)
    finally:
        p.close()


def test_a_wait_on_the_ledger_lock_says_so(tmp_path, monkeypatch):
    """Judgement call: an append waiting on a lock another live process holds printed nothing
    for over 60 s. It says so after ``LOCK_NOTICE_S`` and every ``LOCK_NOTICE_EVERY_S`` after."""
    from filelock import FileLock, Timeout

    from harness.evidence import ledger as L

    monkeypatch.setattr(L, "LOCK_NOTICE_S", 0.2)
    monkeypatch.setattr(L, "LOCK_NOTICE_EVERY_S", 0.2)
    ledger = tmp_path / "ledger.jsonl"
    said: list[str] = []
    holder = FileLock(str(ledger) + ".lock", is_singleton=False)
    holder.acquire()
    try:
        with pytest.raises(Timeout):
            with L.ledger_lock(ledger, 0.7, said.append):
                pass
    finally:
        holder.release()
    assert 2 <= len(said) <= 4
    assert said[0] == f"harness: waiting for the ledger lock {ledger}.lock (held by another process; 0 s of at most 0.7 s)"
    with L.ledger_lock(ledger, 0.7, said.append):  # free: no line
        n = len(said)
    assert len(said) == n


@pytest.mark.parametrize("folder", ["receipts", "reports"])
def test_a_symlinked_receipts_or_reports_folder_is_refused(evidence, tmp_path, folder):
    """Judgement call: a ``receipts/`` or ``reports/`` folder that is a symbolic link was followed
    out of the evidence folder. Evidence is written only inside it: refused before anything runs."""
    from harness.errors import InvalidInput
    from harness.evidence.record import preflight_evidence

    real = evidence.parent / folder
    outside = tmp_path / f"elsewhere-{folder}"
    real.rename(outside) if real.exists() else outside.mkdir()
    real.symlink_to(outside, target_is_directory=True)
    with pytest.raises(InvalidInput) as e:
        preflight_evidence(evidence)
    assert str(e.value) == f"{real}: the {folder} folder is a symbolic link; evidence is written only inside {evidence.parent}"


def test_a_sweeps_current_decision_reads_the_receipt_the_row_binds(evidence):
    """A sweep skips a run whose receipt and row exist (``current``), with the receipt's verdict.
    A row whose verdict is not its receipt's, a receipt whose bytes are not the row's sha256, or a
    receipt the query cache filed under the wrong run is an error naming what disagrees; nothing is
    skipped as current on the row's word."""
    from types import SimpleNamespace

    from harness.evidence import ledger as L
    from harness.evidence.receipts import receipt_file
    from harness.release.cells import keys_of_receipt
    from harness.release.sweep import _current

    row = L.read_rows(evidence)[-1]
    path = receipt_file(evidence.parent / "receipts", row["receipt_id"])
    rec = json.loads(path.read_text())
    key = next(k for k, _ in keys_of_receipt(rec) if k.startswith("input:"))[len("input:"):]
    run = SimpleNamespace(key=key)
    good = _current(run, path, row)
    assert (good.status, good.verdict) == ("current", rec["gated"]["verdict"])
    flipped = _current(run, path, dict(row, verdict="FAIL" if row["verdict"] == "PASS" else "PASS"))
    assert flipped.status == "error" and flipped.verdict == "INVALID"
    assert flipped.message.startswith(f"row {row['seq']} says '{'FAIL' if row['verdict'] == 'PASS' else 'PASS'}' but its receipt ")
    rehashed = _current(run, path, dict(row, receipt_sha256="0" * 64))
    assert rehashed.status == "error" and "not the 000000000000 row 3 binds; not run (harness ledger verify --deep)" in rehashed.message
    elsewhere = _current(SimpleNamespace(key="another-run"), path, row)
    assert elsewhere.status == "error" and "the query cache files receipt" in elsewhere.message
