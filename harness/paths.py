"""Where the harness's own files are: one statement of the package, checkout and suite locations.

``PACKAGE_DIR`` is the installed ``harness`` package; ``SOURCE_ROOT`` its parent (the checkout
when run from one); ``DATA_DIR`` the packaged data (committed fixtures, default prompts);
``SCHEMA_DIR`` the JSON Schemas of every format the harness reads or writes.

``SUITE_ROOT`` is the conformance suite: a folder laid out as this repository's top level, with
``contracts/*.yaml``, the bound tests ``tests/contracts/*.py`` and ``thresholds.yaml``. In an
installed wheel it is ``harness/suite/`` (pyproject.toml maps those files there; nothing is
copied in git); run from a checkout (an editable install) it is the checkout itself. Test node ids
(``tests/contracts/<file>.py::<test>``) are relative to it in both cases.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent
DATA_DIR = PACKAGE_DIR / "data"
SCHEMA_DIR = PACKAGE_DIR / "schemas"
DEFAULT_PROMPTS = DATA_DIR / "prompts" / "default.jsonl"
"""The shipped prompt set (``harness.measure.prompts``; reports omit ``--prompts`` for it)."""
INSTALLED_SUITE = PACKAGE_DIR / "suite"


def _is_suite(folder: Path) -> bool:
    return (folder / "contracts").is_dir() and (folder / "tests" / "contracts").is_dir()


IS_CHECKOUT = not _is_suite(INSTALLED_SUITE) and _is_suite(SOURCE_ROOT) and (SOURCE_ROOT / "pyproject.toml").is_file()
"""True when the harness runs from its own source checkout (not from an installed wheel)."""

SUITE_ROOT = SOURCE_ROOT if IS_CHECKOUT else INSTALLED_SUITE


def cache_root() -> Path:
    """The harness's cache folder outside the checkout: ``$HARNESS_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/qwen35-harness`` (``~/.cache/qwen35-harness``). Fixtures, the reference cache
    and llama.cpp's tools (``scripts/build_llama_server.sh``) live under it."""
    import os

    env = os.environ.get("HARNESS_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen35-harness"


def llama_tool(name: str) -> Path | None:
    """llama.cpp's tool ``name`` (``llama-server``, ``llama-quantize``, ``llama-imatrix``,
    ``llama-perplexity``) built by ``make llama-server`` from the installed llama-cpp-python's
    vendored llama.cpp: ``$HARNESS_LLAMA_BIN/name`` when that variable is set, else the newest
    ``<cache_root>/llama.cpp-<commit>/build/bin/name`` whose ``VERSION`` file is the installed
    version. None when it is not built (or not executable). Never raises."""
    import os
    from importlib import metadata

    def runnable(p: Path) -> bool:
        return p.is_file() and os.access(p, os.X_OK)

    if os.environ.get("HARNESS_LLAMA_BIN"):
        p = Path(os.environ["HARNESS_LLAMA_BIN"]) / name
        return p if runnable(p) else None
    try:
        version = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None
    found = []
    for root in cache_root().glob("llama.cpp-*"):
        v, b = root / "VERSION", root / "build" / "bin" / name
        try:
            if v.is_file() and v.read_text().strip() == version and runnable(b):
                found.append((b.stat().st_mtime, str(b)))
        except OSError:
            continue
    return Path(max(found)[1]) if found else None
