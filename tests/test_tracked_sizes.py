"""Every file git tracks in this repository is at most 10 MiB (10,485,760 bytes): committed
fixtures, evidence and pages alike. A file over it (a retrained fixture with a larger recipe, a
receipt with its arrays inline) fails here, naming the file and its size."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import MAX_TRACKED_BYTES

REPO = Path(__file__).resolve().parents[1]


def _tracked() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("not a git checkout: the tracked files cannot be listed (run the suite from a clone)")
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], check=True, capture_output=True).stdout
    return [REPO / p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def test_every_tracked_file_is_at_most_10_mib():
    files = [p for p in _tracked() if p.is_file()]
    assert len(files) > 100, "git listed too few files: is this the repository?"
    over = sorted((p.stat().st_size, str(p.relative_to(REPO))) for p in files if p.stat().st_size > MAX_TRACKED_BYTES)
    assert not over, "tracked files over 10 MiB: " + ", ".join(f"{name} ({size:,} bytes)" for size, name in over)

