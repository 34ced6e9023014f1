"""thresholds.yaml: every gating number with its basis; fail closed without one.

Schema ``harness-thresholds/v1`` (``harness/schemas/thresholds.schema.json``)::

    schema: harness-thresholds/v1
    report_only: {near_tie_margin: 0.25}          # parameters of report-only fields, no basis
    gates:                                        # parity gates; min_positions and min_cosine required
      min_cosine: {value: 0.98, basis: {kind: declared, who: ..., why: ...}}
    probes: {NAME: {value, basis}}                # probe tolerances, same rule
    models:                                       # per-model overrides, by sha256 or fixture name
      "fixture:trained-qwen35": {gates: {min_cosine: {value: ..., basis: {kind: measured, ...}}}}

A basis is ``kind: measured`` (command, n, model, date, known_good_floor, known_bad) or
``kind: declared`` (who, why). A gate without one is ``InvalidInput`` (exit 2) naming the key and
its line; so are YAML syntax errors, duplicate keys and non-finite values.
``Thresholds.for_model`` resolves the overrides for one model and flags every measured basis
that was measured on a different model than the subject (docs/design.md, "Thresholds").
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

from harness.errors import InvalidInput, Unmeasured
from harness.paths import SCHEMA_DIR
from harness.provenance import sha256_bytes
from harness.validation import schema_validator
from harness.yamlnodes import check_size, duplicate_keys, line_of

SCHEMA_ID = "harness-thresholds/v1"
SCHEMA_PATH = SCHEMA_DIR / "thresholds.schema.json"
SECTIONS = ("gates", "probes")
DEFAULT_NEAR_TIE_MARGIN = 0.25


@dataclass(frozen=True)
class Gate:
    """One resolved gating number.

    ``source`` says where it came from (``gates`` or ``models["ID"].gates``); ``basis_model`` is
    the model a measured basis was taken on (None for a declared basis) and
    ``basis_model_differs`` is True when that is not the subject (None for declared).
    """

    name: str
    value: float | int
    basis: dict[str, Any]
    source: str
    basis_model: str | None = None
    basis_model_differs: bool | None = None

    @property
    def basis_kind(self) -> str:
        return self.basis["kind"]

    def to_dict(self) -> dict[str, Any]:
        """The receipt form: value, basis, source, basis_model, basis_model_differs."""
        return {
            "value": self.value,
            "basis": self.basis,
            "source": self.source,
            "basis_model": self.basis_model,
            "basis_model_differs": self.basis_model_differs,
        }


@dataclass(frozen=True)
class ResolvedThresholds:
    """The thresholds that apply to one subject model (``Thresholds.for_model``)."""

    model_id: str
    aliases: tuple[str, ...]
    gates: dict[str, Gate]
    probes: dict[str, Gate]
    near_tie_margin: float
    path: str
    sha256: str

    @property
    def min_cosine(self) -> float:
        return float(self.gates["min_cosine"].value)

    @property
    def min_positions(self) -> int:
        return int(self.gates["min_positions"].value)

    def gate(self, name: str, section: str = "gates") -> Gate:
        """The named gate of ``section`` (``gates`` or ``probes``).

        Raises ``Unmeasured`` when the file has no such number: a gate never passes by default.
        """
        table = {"gates": self.gates, "probes": self.probes}[section]
        if name not in table:
            raise Unmeasured(
                f"{self.path}: no threshold {section}.{name} for model {self.model_id}; "
                "a number that is not in thresholds.yaml cannot gate (UNMEASURED)"
            )
        return table[name]

    @property
    def basis_mismatches(self) -> list[str]:
        """``section.name`` of every gate whose measured basis was taken on another model."""
        return [
            f"{sec}.{g.name}"
            for sec, table in (("gates", self.gates), ("probes", self.probes))
            for g in table.values()
            if g.basis_model_differs
        ]

    def to_receipt(self) -> dict[str, Any]:
        """JSON-ready record for a receipt: file, sha256, near-tie margin and every gate."""
        return {
            "file": self.path,
            "sha256": self.sha256,
            "subject": self.model_id,
            "near_tie_margin": self.near_tie_margin,
            "gates": {n: g.to_dict() for n, g in self.gates.items()},
            "probes": {n: g.to_dict() for n, g in self.probes.items()},
        }


@dataclass(frozen=True)
class Thresholds:
    """A validated thresholds file (``load_thresholds``); ``data`` is the parsed YAML."""

    path: str
    sha256: str
    data: dict[str, Any] = field(repr=False)

    @property
    def near_tie_margin(self) -> float:
        return float(self.data.get("report_only", {}).get("near_tie_margin", DEFAULT_NEAR_TIE_MARGIN))

    @property
    def model_keys(self) -> list[str]:
        return list(self.data.get("models", {}))

    def for_model(self, model_id: str, *aliases: str) -> ResolvedThresholds:
        """Resolve the gates for one model.

        Args:
            model_id: the subject's identity, its sha256 or fixture name (``fixture:NAME``).
            aliases: its other identities (e.g. the fixture name when ``model_id`` is a sha256).

        Overrides under ``models`` keyed by any identity replace the default gate of the same
        name; when several keys match, ``model_id``'s wins over the aliases'. Each measured basis
        is flagged when its ``model`` is none of the subject's identities.
        """
        ids = (model_id, *aliases)
        models = self.data.get("models", {})
        resolved: dict[str, dict[str, Gate]] = {}
        for section in SECTIONS:
            table = {
                name: self._gate(name, g, section, ids) for name, g in self.data.get(section, {}).items()
            }
            for key in reversed(ids):  # model_id applied last, so it wins
                for name, g in models.get(key, {}).get(section, {}).items():
                    table[name] = self._gate(name, g, f'models["{key}"].{section}', ids)
            resolved[section] = table
        return ResolvedThresholds(
            model_id=model_id,
            aliases=tuple(aliases),
            gates=resolved["gates"],
            probes=resolved["probes"],
            near_tie_margin=self.near_tie_margin,
            path=self.path,
            sha256=self.sha256,
        )

    @staticmethod
    def _gate(name: str, g: Mapping[str, Any], source: str, ids: tuple[str, ...]) -> Gate:
        basis = dict(g["basis"])
        if basis["kind"] == "measured":
            return Gate(name, g["value"], basis, source, basis["model"], basis["model"] not in ids)
        return Gate(name, g["value"], basis, source)


# ----------------------------------------------------------------------------------- loading


def load_thresholds(path: str | Path) -> Thresholds:
    """Read, parse (``yaml.safe_load``) and validate a thresholds file.

    Raises ``InvalidInput`` (exit 2), with the file and line, when the file cannot be read, is
    not YAML, repeats a key, breaks the schema (a gate without a basis names the gate and says
    so) or holds a non-finite number.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read thresholds file: {e.strerror or e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{path}: thresholds file is not UTF-8 text (byte {e.start})") from e
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            check_size(path, root)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidInput(_yaml_error_message(path, e)) from e
    except RecursionError:  # the YAML composer recurses once per nesting level
        raise InvalidInput(f"{path}: YAML nested too deeply (a thresholds file is a few levels deep)") from None
    for keys, line, first in duplicate_keys(root)[:1]:
        raise InvalidInput(f"{path}:{line}: duplicate key {keys[-1]!r} (first at line {first}); YAML would silently keep the last one")
    data = _dates_as_text(data)
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}:1: thresholds file must be a mapping with `schema: {SCHEMA_ID}`")
    errors = sorted(schema_validator(SCHEMA_PATH.name).iter_errors(data), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        first = _most_useful(errors)
        # Name every missing field of the same object at once, not one per run.
        missing = [
            e.message for e in errors
            if e.validator == "required" and e.absolute_path == first.absolute_path and e is not first
        ] if first.validator == "required" else []
        raise InvalidInput(_schema_error_message(path, root, first) + "".join(f"; {m}" for m in missing))
    _check_finite(path, root, data)
    return Thresholds(path=str(path), sha256=sha256_bytes(raw), data=data)


def _dates_as_text(obj: Any) -> Any:
    """YAML reads an unquoted 2026-11-29 as a date; the schema (and JSON receipts) want text."""
    if isinstance(obj, dict):
        return {k: _dates_as_text(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_dates_as_text(v) for v in obj]
    if isinstance(obj, (datetime.date, datetime.datetime)):
        return obj.isoformat()
    return obj


def _yaml_error_message(path: Path, e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    return f"{where}: YAML syntax error: {problem}" + (f" ({context})" if context else "")


def _is_gate_path(p: list[Any]) -> bool:
    return (len(p) == 2 and p[0] in SECTIONS) or (len(p) == 4 and p[0] == "models" and p[2] in SECTIONS)


def _most_useful(errors: list[jsonschema.ValidationError]) -> jsonschema.ValidationError:
    """A missing basis first (the rule this file exists for), else the shallowest error."""
    for e in errors:
        p = list(e.absolute_path)
        if _is_gate_path(p) and (
            (e.validator == "required" and "'basis'" in e.message) or e.validator == "type"
        ):
            return e
    return jsonschema.exceptions.best_match(errors)


def _schema_error_message(path: Path, root: yaml.Node | None, e: jsonschema.ValidationError) -> str:
    p = list(e.absolute_path)
    dotted = ".".join(str(k) for k in p) or "(top level)"
    where = f"{path}:{line_of(root, p)}"
    if _is_gate_path(p) and (
        (e.validator == "required" and "'basis'" in e.message) or (e.validator == "type" and not isinstance(e.instance, dict))
    ):
        return (
            f"{where}: {dotted} has no basis; every gating number needs "
            "{value, basis: {kind: measured (command, n, model, date, known_good_floor, known_bad) "
            "| declared (who, why)}} and refuses to gate without one"
        )
    if p and p[-1] == "basis" or "basis" in p:
        return f"{where}: {dotted}: invalid basis: {e.message}"
    return f"{where}: {dotted}: {e.message}"


def _check_finite(path: Path, root: yaml.Node | None, data: Mapping[str, Any]) -> None:
    def check(keys: list[Any], value: Any) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput(f"{path}:{line_of(root, keys)}: {'.'.join(map(str, keys))} is {value}; gates need finite numbers")

    for section in SECTIONS:
        for name, g in data.get(section, {}).items():
            check([section, name, "value"], g["value"])
    for key, m in data.get("models", {}).items():
        for section in SECTIONS:
            for name, g in m.get(section, {}).items():
                check(["models", key, section, name, "value"], g["value"])
