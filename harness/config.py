"""User configuration: ``[tool.harness]`` in the nearest pyproject.toml, or a harness TOML file.

Lookup order: the file named by ``$HARNESS_CONFIG`` (a TOML file whose top level is the harness
table, e.g. ``[engines.NAME]``; or a ``pyproject.toml``, whose ``[tool.harness]`` is taken), else
the first ``pyproject.toml`` found walking up from the current directory (its ``[tool.harness]``
table).

Keys: ``model`` / ``models``, ``candidate``, ``reference``, ``prompts``, ``thresholds``,
``ledger`` (defaults of ``harness parity``, ``probe`` and the pytest cells); ``engines.NAME``
(external command engines, docs/engine-protocol.md); ``http.NAME`` (OpenAI-compatible servers,
docs/engine-protocol.md "HTTP engines"); ``evidence`` (the evidence folder, default
``evidence/`` at the project root); ``pytest`` (true: ``pytest`` collects the shipped parity and
probe cells, as ``pytest --harness``); ``probes`` (which probes the probe cell runs);
``contracts`` (shipped contract ids ``harness status`` must see). Relative paths resolve
against the config file's folder, the project root. Any other key is refused (INVALID), with the
known key it was most likely meant to be (``did_you_mean``): a misspelt key is never ignored.

Reproducers: a receipt records, for each engine its config defines (``command:NAME``,
``http:NAME``), the file and its sha256 (``config_record``), and a reproduce line carries both
(``HARNESS_CONFIG=FILE HARNESS_CONFIG_SHA256=HEX harness ...``: ``reproduce_env``). With
``$HARNESS_CONFIG_SHA256`` set, ``load_config`` refuses (INVALID) a config whose sha256 is
another: its engine tables may not be the ones the receipt was made with.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from harness.errors import InvalidInput

DEFAULT_CANDIDATE = "oracle"
"""The engine judged where none is named (``candidate`` key, ``--candidate``)."""
DEFAULT_REFERENCE = "llama.cpp"
"""The engine judged against where none is named (``reference`` key, ``--reference``)."""
FIXTURE_PREFIX = "fixture:"


@dataclass
class HarnessConfig:
    """The harness table and the file it came from (None: no config found) with that file's
    sha256; ``start`` is the folder the lookup started from (the project root when no file was
    found)."""

    table: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None
    start: Path | None = None
    sha256: str | None = None
    """The sha256 (hex) of the file the table came from (None: no file)."""

    @property
    def base_dir(self) -> Path:
        """The project root: relative paths in the config resolve against the config file's
        folder (the lookup's start folder, else the current directory, when there is none)."""
        if self.source:
            return self.source.parent
        return self.start or Path.cwd()

    def get(self, key: str, default: Any = None) -> Any:
        return self.table.get(key, default)

    def path(self, key: str) -> Path | None:
        """The file or folder ``key`` names, resolved against ``base_dir`` (None when unset).
        Raises ``InvalidInput`` when the value is not a string."""
        value = self.table.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise InvalidInput(f"{self.source}: [tool.harness] {key} must be a path (a non-empty string)")
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base_dir / p

    def names(self, key: str) -> list[str]:
        """A key that holds one string or a list of strings, as a list (empty when unset).
        Raises ``InvalidInput`` for anything else."""
        value = self.table.get(key)
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise InvalidInput(f"{self.source}: [tool.harness] {key} must be a string or a list of strings")
        return list(value)

    def model_specs(self) -> list[str]:
        """``models`` (or ``model``): ``fixture:NAME`` kept as given, paths resolved against
        ``base_dir``."""
        specs = self.names("models") or self.names("model")
        return [s if s.startswith(FIXTURE_PREFIX) or Path(s).is_absolute() else str(self.base_dir / s) for s in specs]

    @property
    def evidence_dir(self) -> Path:
        """``evidence`` (resolved), else ``<project root>/evidence``."""
        return self.path("evidence") or self.base_dir / "evidence"

    @property
    def ledger(self) -> Path:
        """``ledger`` (resolved), else ``<evidence>/parity/ledger.jsonl``; receipts go in
        ``receipts/`` beside it."""
        return self.path("ledger") or self.evidence_dir / "parity" / "ledger.jsonl"

    def flag(self, key: str) -> bool:
        """A boolean key (False when unset); raises ``InvalidInput`` for a non-boolean."""
        value = self.table.get(key, False)
        if not isinstance(value, bool):
            raise InvalidInput(f"{self.source}: [tool.harness] {key} must be true or false")
        return value


MAX_CONFIG_BYTES = 16 << 20
"""The most bytes a config file may have (``HARNESS_CONFIG=/dev/zero`` is one INVALID line)."""


def _read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """The TOML document at ``path`` (at most ``MAX_CONFIG_BYTES``; a FIFO is read as ``cat``
    reads it) and the sha256 (hex) of its bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise InvalidInput(f"{path}: config is larger than {MAX_CONFIG_BYTES:,} bytes; refused")
        return tomllib.loads(raw.decode("utf-8")), hashlib.sha256(raw).hexdigest()
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read config ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{path}: config is not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(f"{path}: invalid TOML ({e})") from None


STRING_KEYS = ("reference", "prompts", "thresholds", "ledger", "evidence")
"""Keys read as one string (``candidate`` and ``model`` may also be lists: ``HarnessConfig.names``)."""

TOP_KEYS = ("model", "models", "candidate", *STRING_KEYS, "engines", "http", "pytest", "probes", "contracts")
"""Every key of the harness table (see the module docstring); any other is refused."""


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice closest to ``word`` (``difflib.get_close_matches``, cutoff 0.6), or None when
    none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``" (did you mean 'X'?)"`` for the choice closest to ``word`` (``closest``), or "" when
    none is close: put right after ``word`` in a message refusing it."""
    close = closest(word, choices)
    return f" (did you mean {close!r}?)" if close else ""


def engine_table(cfg: HarnessConfig, section: str, name: str, t: Any, known: Sequence[str]) -> str:
    """Check that ``[SECTION.NAME]`` (``engines.NAME``, ``http.NAME``) is a table holding only
    ``known`` keys; returns ``"<config file>: SECTION.NAME"``, the prefix of every message about
    it. ``InvalidInput`` names the table and the first unknown key."""
    where = f"{cfg.source}: {section}.{name}"
    if not isinstance(t, dict):
        raise InvalidInput(f"{where} must be a table")
    unknown = [k for k in t if k not in known]
    if unknown:
        raise InvalidInput(f"{where}: unknown key {unknown[0]!r}{did_you_mean(unknown[0], known)}; known: {', '.join(known)}")
    return where


def configured_engine(specs: dict[str, Any], name: str, kind: str, section: str, cfg: HarnessConfig) -> Any:
    """``specs[name]``, the spec of a configured engine (``kind`` ``command`` or ``http``, found
    in ``[tool.harness.SECTION]``); ``InvalidInput`` naming the configured ones when it is not."""
    if name not in specs:
        known = ", ".join(f"{kind}:{n}" for n in specs) or "none"
        where = cfg.source or "no pyproject.toml or $HARNESS_CONFIG found"
        hint = did_you_mean(f"{kind}:{name}", [f"{kind}:{n}" for n in specs])
        raise InvalidInput(f"no {kind} engine {name!r} configured in [tool.harness.{section}] ({where}){hint}; configured: {known}")
    return specs[name]


def _checked(table: dict[str, Any], source: Path) -> dict[str, Any]:
    """``table`` after checking that every key is one of ``TOP_KEYS`` (``[engine.mine]`` for
    ``[engines.mine]`` is refused, naming ``engines``), the kinds of the keys the harness reads as
    one string (without NUL, which no path or engine name can hold) and that ``engines`` is a
    table (each engine is checked when it is used). ``InvalidInput`` names the file and key."""
    for key in table:
        if key not in TOP_KEYS:
            raise InvalidInput(f"{source}: unknown key {key!r} in the harness table{did_you_mean(str(key), TOP_KEYS)}; known: {', '.join(TOP_KEYS)}")
    for key in STRING_KEYS:
        if key in table and (not isinstance(table[key], str) or "\x00" in table[key]):
            raise InvalidInput(f"{source}: {key} must be a string (without NUL), found {type(table[key]).__name__}")
    if "engines" in table and not isinstance(table["engines"], dict):
        raise InvalidInput(f"{source}: engines must be a table of [engines.NAME] tables")
    if "http" in table and not isinstance(table["http"], dict):
        raise InvalidInput(f"{source}: http must be a table of [http.NAME] tables")
    return table


def _harness_table(path: Path) -> tuple[dict[str, Any], str]:
    doc, sha = _read_toml(path)
    table = doc.get("tool", {}).get("harness", {})
    if not isinstance(table, dict):
        raise InvalidInput(f"{path}: [tool.harness] must be a table")
    return _checked(table, path), sha


EXPECTED_SHA256_ENV = "HARNESS_CONFIG_SHA256"
"""Set by a reproduce line: the sha256 the config file must have (``load_config``)."""


def load_config(start: Path | None = None) -> HarnessConfig:
    """Find and read the harness configuration (see module docstring).

    Raises ``InvalidInput`` for an unreadable or invalid file, a known key of the wrong kind, or
    a file whose sha256 is not ``$HARNESS_CONFIG_SHA256`` when that is set (a reproducer run
    with another config than the one its receipt recorded).
    """
    env = os.environ.get("HARNESS_CONFIG")
    if env:
        p = Path(env).resolve()
        if p.name == "pyproject.toml":
            table, sha = _harness_table(p)
        else:
            doc, sha = _read_toml(p)
            table = _checked(doc, p)
        cfg = HarnessConfig(table, p, p.parent, sha)
    else:
        d = (start or Path.cwd()).resolve()
        cfg = HarnessConfig(start=d)
        for parent in [d, *d.parents]:
            pp = parent / "pyproject.toml"
            if pp.is_file():
                table, sha = _harness_table(pp)
                cfg = HarnessConfig(table, pp, parent, sha)
                break
    _check_expected(cfg)
    return cfg


def _check_expected(cfg: HarnessConfig) -> None:
    """``InvalidInput`` when ``$HARNESS_CONFIG_SHA256`` is set and ``cfg``'s file has another
    sha256 (or there is no file)."""
    want = os.environ.get(EXPECTED_SHA256_ENV, "").strip().lower()
    if not want or want == cfg.sha256:
        return
    got = f"has sha256 {cfg.sha256[:12]}" if cfg.sha256 else "was not found"
    raise InvalidInput(f"config {cfg.source or '(none)'} {got}, but ${EXPECTED_SHA256_ENV} asks for {want[:12]} (the config the receipt "
                       f"was made with): its engine tables may differ; restore that file, or unset ${EXPECTED_SHA256_ENV} to run anyway")


CONFIGURED_PREFIXES = ("command:", "http:")
"""Engine names whose definition is a table of the config (``[engines.NAME]``, ``[http.NAME]``)."""


def config_record(engine: str, cfg: HarnessConfig | None = None) -> dict[str, str] | None:
    """Where the table of ``engine`` came from, for a receipt: ``{"path": absolute path of the
    config file, "sha256": hex}``, or None for an engine no config defines (or no file found).
    Raises as ``load_config`` when ``cfg`` is None and the config cannot be read."""
    if not engine.startswith(CONFIGURED_PREFIXES):
        return None
    cfg = cfg or load_config()
    if cfg.source is None or cfg.sha256 is None:
        return None
    return {"path": str(cfg.source.resolve()), "sha256": cfg.sha256}


def reproduce_env(*records: dict[str, Any] | None) -> list[str]:
    """The ``HARNESS_CONFIG=FILE HARNESS_CONFIG_SHA256=HEX`` assignments (shell-quoted) that put a
    reproduce line in front of the config of the first of ``records`` (``config_record``) that
    is not None; empty when none is."""
    rec = next((r for r in records if r), None)
    if rec is None:
        return []
    return [f"HARNESS_CONFIG={shlex.quote(str(rec['path']))}", f"{EXPECTED_SHA256_ENV}={shlex.quote(str(rec['sha256']))}"]
