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
