"""Every file git tracks in this repository is at most 10 MiB (10,485,760 bytes): committed
fixtures, evidence and pages alike. A file over it (a retrained fixture with a larger recipe, a
receipt with its arrays inline) fails here, naming the file and its size."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_TRACKED_BYTES = 10 * 2**20


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


def test_the_limit_catches_a_file_over_it(tmp_path):
    """The comparison itself: a file of one byte more than the limit is over it, one of the limit is not."""
    at, past = tmp_path / "at", tmp_path / "past"
    at.write_bytes(b"\0" * MAX_TRACKED_BYTES)
    past.write_bytes(b"\0" * (MAX_TRACKED_BYTES + 1))
    assert at.stat().st_size <= MAX_TRACKED_BYTES < past.stat().st_size
