"""What identifies an input or a build: the sha256 of bytes and files, the git state of a checkout.

One statement of each, used by every layer that records where a result came from: the model
reader (a GGUF's sha256), fixtures (recipes, cache keys), receipts and the ledger (content
hashes), contract discharge (what a record depends on).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

from harness.errors import InvalidInput

CHUNK_BYTES = 1 << 20
GIT_TIMEOUT_S = 30


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (a GGUF can be gigabytes).

    Raises ``InvalidInput`` naming the file when it cannot be read.
    """
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
                h.update(chunk)
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read: {e.strerror or e}") from e
    return h.hexdigest()


def git_state(root: str | os.PathLike) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the git checkout at ``root`` (``dirty``: tracked
    files differ from HEAD; untracked files do not count). Both are None outside a checkout or
    when git is missing; ``dirty`` alone is None when ``git status`` fails."""

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(Path(root)), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}
