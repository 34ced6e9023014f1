"""Helpers shared by tests/test_hostile.py and tests/test_fuzz.py: special files a hostile
engine can leave where its outputs belong, and an alarm that fails a blocked read instead of
hanging the suite."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any


def make_non_regular(path: Path, kind: str) -> None:
    """Put a ``kind`` of non-regular file at ``path`` (what a hostile or broken engine leaves)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "directory":
        path.mkdir()
    elif kind.startswith("symlink-dev-"):
        path.symlink_to("/dev/" + kind.removeprefix("symlink-dev-"))
    elif kind == "dangling-symlink":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "symlink-to-fifo":
        os.mkfifo(path.parent / "a-fifo")
        path.symlink_to(path.parent / "a-fifo")


class Alarm:
    """Fail (instead of hanging the suite) when the block takes longer than ``seconds``."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def __enter__(self):
        def fire(*_):
            raise TimeoutError(f"still blocked after {self.seconds} s")

        self.old = signal.signal(signal.SIGALRM, fire)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.old)


def load_prompts_or_refusal(directory: Path, raw: bytes) -> Any:
    """Write ``raw`` as ``directory/p.jsonl`` and load it with ``load_prompt_set``: the loaded
    set, or None when it was refused, after checking the refusal is one line naming the file."""
    from harness.measure.prompts import load_prompt_set
    from harness.errors import InvalidInput

    p = directory / "p.jsonl"
    p.write_bytes(raw)
    try:
        return load_prompt_set(p)
    except InvalidInput as e:
        assert str(e).startswith(str(p)) and "\n" not in str(e)
        return None
