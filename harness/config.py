"""User configuration: ``[tool.harness]`` in the nearest pyproject.toml, or a harness TOML file.

Lookup order: the file named by ``$HARNESS_CONFIG`` (a TOML file whose top level is the harness
table, e.g. ``[engines.NAME]``), else the first ``pyproject.toml`` found walking up from the
current directory (its ``[tool.harness]`` table). Keys used: ``model``, ``candidate``,
``reference``, ``prompts``, ``thresholds``, ``ledger`` (defaults of ``harness parity``) and
``engines.NAME`` (external command engines, docs/engine-protocol.md).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import InvalidInput

DEFAULT_CANDIDATE = "oracle"
"""The engine judged where none is named (``candidate`` key, ``--candidate``)."""
DEFAULT_REFERENCE = "llama.cpp"
"""The engine judged against where none is named (``reference`` key, ``--reference``)."""


@dataclass
class HarnessConfig:
    """The harness table and the file it came from (None: no config found)."""

    table: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None

    @property
    def base_dir(self) -> Path:
        """Relative paths in the config resolve against the config file's directory."""
        return self.source.parent if self.source else Path.cwd()

    def get(self, key: str, default: Any = None) -> Any:
        return self.table.get(key, default)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read config ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(f"{path}: invalid TOML ({e})") from None


def load_config(start: Path | None = None) -> HarnessConfig:
    """Find and read the harness configuration (see module docstring).

    Raises ``InvalidInput`` for an unreadable or invalid file.
    """
    env = os.environ.get("HARNESS_CONFIG")
    if env:
        p = Path(env)
        return HarnessConfig(_read_toml(p), p.resolve())
    d = (start or Path.cwd()).resolve()
    for parent in [d, *d.parents]:
        pp = parent / "pyproject.toml"
        if pp.is_file():
            table = _read_toml(pp).get("tool", {}).get("harness", {})
            if not isinstance(table, dict):
                raise InvalidInput(f"{pp}: [tool.harness] must be a table")
            return HarnessConfig(table, pp)
    return HarnessConfig()
