"""Where the harness's own files are: one statement of the package and checkout locations.

``PACKAGE_DIR`` is the installed ``harness`` package; ``SOURCE_ROOT`` its parent (the checkout
when run from one: it holds ``thresholds.yaml``, ``contracts/`` and ``tests/``); ``DATA_DIR`` the
packaged data (committed fixtures, default prompts); ``SCHEMA_DIR`` the JSON Schemas of every
format the harness reads or writes.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent
DATA_DIR = PACKAGE_DIR / "data"
SCHEMA_DIR = PACKAGE_DIR / "schemas"
