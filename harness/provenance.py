"""What identifies an input or a build: the sha256 of bytes and files, the git state of a checkout,
the harness release and the conformance suite it ships.

One statement of each, used by every layer that records where a result came from: the model
reader (a GGUF's sha256), fixtures (recipes, cache keys), receipts and the ledger (content
hashes, ``suite_pins``), contract discharge (what a record depends on, ``suite_pins``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from harness.errors import InvalidInput
from harness.paths import IS_CHECKOUT, SUITE_ROOT
from harness.yamlnodes import safe_load_shipped

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


def _files_sha256(files: list[Path], root: Path) -> str:
    """sha256 over ``path NUL sha256(content) LF`` of each file, in path order."""
    lines = sorted(f"{f.relative_to(root).as_posix()}\0{sha256_file(f)}\n" for f in files)
    return sha256_bytes("".join(lines).encode())


@lru_cache(maxsize=1)
def suite_pins() -> dict[str, Any]:
    """``{"version", "source", "contracts": {id: version}, "sha256"}``: the harness version, where
    it runs from (``checkout`` or ``installed``), each shipped contract's ``version`` field
    (``harness.paths.SUITE_ROOT``/contracts) and the sha256 over the shipped contract files and
    bound test modules (path and content). What receipts and discharge records pin; read once
    per process."""
    try:
        version = metadata.version("qwen35-harness")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    contracts: dict[str, str | None] = {}
    for path in sorted((SUITE_ROOT / "contracts").glob("*.yaml")):
        try:
            data = safe_load_shipped(path.read_text())
            contracts[path.stem] = str(data.get("version")) if isinstance(data, dict) else None
        except (OSError, yaml.YAMLError):
            contracts[path.stem] = None
    files = [*(SUITE_ROOT / "contracts").glob("*.yaml"), *(SUITE_ROOT / "tests" / "contracts").glob("*.py")]
    return {"version": version, "source": "checkout" if IS_CHECKOUT else "installed", "contracts": contracts,
            "sha256": _files_sha256(files, SUITE_ROOT) if files else None}


NUMBERS_SOURCES = ("measure", "judge", "runs", "model")
"""Folders of the ``harness`` package whose code turns engine outputs into numbers and verdicts
(metrics, tiers, thresholds, the parity, top-k, probe, localize and calibration runs, the GGUF
reader), read recursively (``harness/runs/calibrate/`` is a package); the engines' own code is in
their build ids (``harness.engines.registry.engine_build_id``)."""


@lru_cache(maxsize=1)
def numbers_sha256() -> str:
    """The harness version that matters for a result: sha256 over the ``*.py`` and ``*.c`` files
    (the metrics' row kernel, ``harness/measure/rowkernel.c``) of ``NUMBERS_SOURCES`` (path
    relative to the package and content), read once per process. A sweep re-runs a cell when it
    changes; a docs or CLI change leaves it alone."""
    pkg = Path(__file__).resolve().parent
    files = [f for d in NUMBERS_SOURCES for pat in ("*.py", "*.c") for f in sorted((pkg / d).rglob(pat))]
    return _files_sha256(files, pkg)
