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
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
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
