"""Nothing an engine starts outlives it (issue 32): a helper that called ``setsid()`` and one
that double-forked (a daemon's usual way) are gone once the engine's run is over, for a
protocol-1 engine that times out or exits, and for a protocol-2 engine that is closed.

Each helper writes its pid to a file and sleeps for minutes; the test then looks the pid up in
/proc (a zombie counts as gone: nothing runs)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.engines.base import gather
from harness.engines.command import CommandEngine, CommandSpec
from harness.engines.process import run_process
from harness.errors import EngineError
from harness.fixtures import synthetic as fx

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper is Linux's (prctl)")

# The engine: start helpers of kind KIND ("setsid": fork, setsid, sleep; "daemon": fork, setsid,
# fork again, the middle process exits), record their pids, then MODE: "hang" past the timeout,
# "ok" (write the logits and exit 0) or, for protocol 2, serve requests.
ENGINE = """
import json, os, sys, time
kind, mode, pidfile = sys.argv[1], sys.argv[2], sys.argv[3]

def helper():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.setsid()
        if kind == "daemon" and os.fork() != 0:
            os._exit(0)  # the middle process: its child is re-parented (init, or a subreaper)
        os.write(w, str(os.getpid()).encode()); os.close(w)
        for fd in (0, 1, 2):
            os.close(fd)
        time.sleep(300)
        os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 32):
        got += chunk
    if kind == "setsid":
        pass  # its parent (this engine) stays alive
    else:
        os.waitpid(pid, 0)
    return got.decode()

with open(pidfile, "w") as f:
    f.write(" ".join(helper() for _ in range(2)))
if mode == "hang":
    time.sleep(300)
elif mode == "ok":
    import numpy as np
    req = json.load(open(sys.argv[4]))
    np.save(sys.argv[5] + "/logits.npy", np.zeros((len(req["tokens"]), 515), np.float32))
elif mode == "serve":
    import numpy as np
    for line in sys.stdin:
        req = json.loads(line)
        np.save(req["out_dir"] + "/logits.npy", np.zeros((len(req["tokens"]), 515), np.float32))
        print(json.dumps({"id": req["id"], "ok": True, "files": ["logits.npy"]}), flush=True)
"""


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _helpers(pidfile: Path) -> list[int]:
    pids = [int(x) for x in pidfile.read_text().split()]
    assert len(pids) == 2
    return pids


def _gone_soon(pids: list[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(map(_running, pids))


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "spawning_engine.py"
    p.write_text(ENGINE)
    return p


@pytest.mark.parametrize("kind", ["setsid", "daemon"])
def test_protocol1_engine_past_its_timeout_leaves_no_process(tmp_path, script, kind):
    pidfile = tmp_path / "pids.txt"
    spec = CommandSpec("spawner", [sys.executable, str(script), kind, "hang", str(pidfile)], timeout_s=2.0)
    eng = CommandEngine(spec, fx.build("tiny-qwen35"))
    with pytest.raises(EngineError, match="timed out after 2 s"):
        gather(eng.logits([1, 2, 3]), 3)
    pids = _helpers(pidfile)
    assert _gone_soon(pids), [p for p in pids if _running(p)]


@pytest.mark.parametrize("kind", ["setsid", "daemon"])
def test_protocol1_engine_that_exits_leaves_no_process(tmp_path, script, kind):
    pidfile = tmp_path / "pids.txt"
    spec = CommandSpec("spawner", [sys.executable, str(script), kind, "ok", str(pidfile), "{request}", "{out_dir}"], timeout_s=60.0)
    eng = CommandEngine(spec, fx.build("tiny-qwen35"))
    assert gather(eng.logits([1, 2, 3]), 3).shape == (3, 515)
    pids = _helpers(pidfile)
    assert _gone_soon(pids), [p for p in pids if _running(p)]


@pytest.mark.parametrize("kind", ["setsid", "daemon"])
def test_protocol2_engine_closed_leaves_no_process(tmp_path, script, kind):
    from harness.engines import persistent

    pidfile = tmp_path / "pids.txt"
    spec = CommandSpec("spawner2", [sys.executable, str(script), kind, "serve", str(pidfile)], timeout_s=60.0, protocol=2)
    eng = CommandEngine(spec, fx.build("tiny-qwen35"))
    assert gather(eng.logits([1, 2, 3]), 3).shape == (3, 515)
    pids = _helpers(pidfile)
    assert all(map(_running, pids))  # the engine's helpers live as long as the engine does
    persistent.close_all()
    assert _gone_soon(pids), [p for p in pids if _running(p)]


def test_exit_code_signal_and_missing_program_come_through_the_supervisor(tmp_path):
    """The supervisor reports what the engine did: its exit code, the signal that killed it,
    and a program that cannot be started as the ``OSError`` ``Popen`` would raise."""
    assert run_process([sys.executable, "-c", "import sys; sys.exit(7)"], timeout_s=30, workdir=tmp_path).returncode == 7
    res = run_process([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], timeout_s=30, workdir=tmp_path)
    assert res.returncode == -15
    res = run_process([sys.executable, "-c", "import sys; print('to stderr', file=sys.stderr)"], timeout_s=30, workdir=tmp_path)
    assert res.returncode == 0 and res.tail == "to stderr"
    with pytest.raises(FileNotFoundError):
        run_process([str(tmp_path / "no-such-program")], timeout_s=30, workdir=tmp_path)
    (tmp_path / "not-exec").write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        run_process([str(tmp_path / "not-exec")], timeout_s=30, workdir=tmp_path)


def test_a_killed_harness_takes_its_engines_helpers_with_it(tmp_path, script):
    """SIGKILL cannot be caught, but it closes the supervisor's lifeline: the engine and its
    helpers go too."""
    pidfile = tmp_path / "pids.txt"
    code = (f"import sys; from pathlib import Path; from harness.engines.process import run_process\n"
            f"run_process([sys.executable, {str(script)!r}, 'daemon', 'hang', {str(pidfile)!r}], timeout_s=600, workdir=Path({str(tmp_path)!r}))")
    harness = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and len(pidfile.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = _helpers(pidfile)
    assert all(map(_running, pids))
    harness.kill()
    harness.wait()
    assert _gone_soon(pids), [p for p in pids if _running(p)]
