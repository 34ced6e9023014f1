"""thresholds.yaml: every gating number with its basis; fail closed without one.

Schema ``harness-thresholds/v2`` (``harness/schemas/thresholds.schema.json``), two tiers
(``harness.judge.tiers``)::

    schema: harness-thresholds/v2
    report_only: {near_tie_margin: 0.25}          # parameters of report-only fields, no basis
    release:                                      # the release gate: a declared floor
      min_cosine: {value: 0.98, basis: {kind: declared, who: ..., why: ...}}
      min_positions: {value: 64, basis: {kind: declared, ...}}
    probes: {localize_max_nmse: {value, basis}, ...}     # class-independent tolerances
    calibrated:                                   # measured rows, keyed by weights × class
      - {weights: F32+Q4_K+Q6_K, class: f32, file_type: Q4_K_M,
         basis_models: [{name: fixture:trained-qwen35-256-Q4_K_M, n_layer: 4, n_embd: 256}],
         gates: {min_cosine: {value, basis}, max_kld_mean: ..., max_kld_p99: ...},
         probes: {min_cosine: ..., max_kld: ...}}
    topk:                                         # top-k rows (http:NAME servers), keyed by weights × class × k
      - {weights: F32, class: f32, k: 20, file_type: ALL_F32, basis_models: [...],
         gates: {max_topk_kld_mean: {value, basis}, max_topk_kld_p99: ...}}
    mtp:                                          # MTP draft-head rows (harness parity --mtp), keyed by weights × class × arch
      - {weights: F32, class: f64, file_type: ALL_F32, max_tokens: 256,
         basis_models: [{name: fixture:tiny-qwen35-mtp, arch: qwen35, n_layer: 4, n_embd: 64}],
         gates: {min_cosine: {value, basis}, max_kld_mean: ..., max_kld_p99: ...}}
    state:                                        # the state probe's rows (harness probe: state), keyed by class
      - {weights: F32, class: f32, file_type: ALL_F32, max_tokens: 256,
         basis_models: [{name: fixture:state-qwen35, arch: qwen35, n_layer: 8, n_embd: 64}],
         gates: {min_cosine: {value, basis}, max_kld: ...}}

A basis is ``kind: measured`` (command, n, model, date, known_good_floor, known_bad) or
``kind: declared`` (who, why). A gate without one is ``InvalidInput`` (exit 2) naming the key and
its line; so are YAML syntax errors, duplicate keys, non-finite values, two rows for one
weights × class key, and a row looser than the release floor (its ``min_cosine`` below
``release.min_cosine``); the same for ``mtp`` and ``state`` rows. ``Thresholds.resolve`` picks the row that fits
a subject (``tiers.find_row``) — never one of another key; ``Thresholds.resolve_mtp`` the MTP row.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import yaml

from harness.errors import InvalidInput, Unmeasured
from harness.fschecks import read_utf8
from harness.judge import parsed_cache
from harness.judge.tiers import Row, Subject, find_row, find_topk_row
from harness.paths import SCHEMA_DIR
from harness.provenance import sha256_bytes
from harness.validation import schema_validator
from harness.yamlnodes import duplicate_keys, line_of, load_bounded

if TYPE_CHECKING:
    import jsonschema  # errors are explained by jsonschema only when a file breaks the schema

SCHEMA_ID = "harness-thresholds/v2"
SCHEMA_PATH = SCHEMA_DIR / "thresholds.schema.json"
SECTIONS = ("release", "probes")
ROW_SECTIONS = ("gates", "probes")
ROW_LISTS = ("calibrated", "topk", "mtp", "state")
DEFAULT_NEAR_TIE_MARGIN = 0.25


@dataclass(frozen=True)
class Gate:
    """One resolved gating number.

    ``source`` says where it came from (``release``, ``probes``, ``calibrated[3].gates``, or a
    calibration receipt); ``basis_model`` is the model a measured basis was taken on (None for a
    declared basis) and ``basis_model_differs`` is True when that is not the subject.
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


def _gate(name: str, g: Mapping[str, Any], source: str, ids: tuple[str, ...]) -> Gate:
    basis = dict(g["basis"])
    if basis["kind"] == "measured":
        return Gate(name, g["value"], basis, source, basis["model"], basis["model"] not in ids)
    return Gate(name, g["value"], basis, source)


@dataclass(frozen=True)
class ResolvedThresholds:
    """The thresholds that apply to one subject (``Thresholds.resolve``).

    ``release``: the release gate (``min_cosine``, ``min_positions``); ``row``: the calibrated
    row that fits the subject, or None with ``row_misfit`` saying why; ``probes``: the
    class-independent tolerances plus, when a row fits, its probe tolerances.
    """

    subject: Subject
    release: dict[str, Gate]
    row: Row | None
    row_misfit: str
    probes: dict[str, Gate]
    near_tie_margin: float
    path: str
    sha256: str
    ids: tuple[str, ...] = ()

    @property
    def release_min_cosine(self) -> float:
        return float(self.release["min_cosine"].value)

    @property
    def min_positions(self) -> int:
        return int(self.release["min_positions"].value)

    @property
    def release_gates(self) -> dict[str, dict[str, Any]]:
        return {n: {"value": g.value, "basis": g.basis} for n, g in self.release.items()}

    def gate(self, name: str, section: str = "release") -> Gate:
        """The named number of ``section`` (``release`` or ``probes``).

        Raises ``Unmeasured`` when there is no such number for this subject: a gate never passes
        by default, and a row of another weights key or class is never borrowed.
        """
        table = {"release": self.release, "probes": self.probes}[section]
        if name not in table:
            why = f" ({self.row_misfit})" if section == "probes" and self.row is None and self.row_misfit else ""
            raise Unmeasured(
                f"{self.path}: no threshold {section}.{name} for {self.subject.key_text()}{why}; "
                "a number that is not in thresholds.yaml cannot gate (UNMEASURED)"
            )
        return table[name]

    def with_row(self, row: Row) -> ResolvedThresholds:
        """The same thresholds with ``row`` (e.g. measured on the subject itself) as the calibrated tier."""
        probes = dict(self.probes)
        probes.update({n: _gate(n, g, f"{row.source}.probes", self.ids) for n, g in row.probes.items()})
        return replace(self, row=row, row_misfit="", probes=probes)

    @property
    def basis_mismatches(self) -> list[str]:
        """``section.name`` of every release/probe number whose measured basis was taken on another model."""
        return [f"{sec}.{g.name}" for sec, table in (("release", self.release), ("probes", self.probes))
                for g in table.values() if g.basis_model_differs]

    def to_receipt(self) -> dict[str, Any]:
        """JSON-ready record for a receipt: file, sha256, subject key, the release gate, the
        calibrated row used (or why none fits), and the probe tolerances."""
        return {
            "file": self.path,
            "sha256": self.sha256,
            "subject": self.subject.to_dict(),
            "near_tie_margin": self.near_tie_margin,
            "release": {n: g.to_dict() for n, g in self.release.items()},
            "calibrated": self.row.to_receipt() if self.row else None,
            "calibrated_misfit": self.row_misfit or None,
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
    def rows(self) -> list[Row]:
        """The calibrated rows, in file order (``source`` names each by index)."""
        return [
            Row(r["weights"], r["class"], tuple(r["basis_models"]), r["gates"], r.get("probes", {}),
                f"{self.path} calibrated[{i}]", r["file_type"])
            for i, r in enumerate(self.data.get("calibrated", []))
        ]

    @property
    def topk_rows(self) -> list[Row]:
        """The top-k rows (``topk:``), in file order, each with its ``k``."""
        return [
            Row(r["weights"], r["class"], tuple(r["basis_models"]), r["gates"], {}, f"{self.path} topk[{i}]", r["file_type"], int(r["k"]))
            for i, r in enumerate(self.data.get("topk", []))
        ]

    def _capped_rows(self, section: str) -> list[Row]:
        """The rows of ``section`` (``mtp``, ``state``; absent: none), in file order, each with its ``max_tokens``."""
        return [
            Row(r["weights"], r["class"], tuple(r["basis_models"]), r["gates"], {}, f"{self.path} {section}[{i}]", r["file_type"],
                max_tokens=r.get("max_tokens"))
            for i, r in enumerate(self.data.get(section, []))
        ]

    @property
    def mtp_rows(self) -> list[Row]:
        """The MTP draft-head rows (``mtp:``, absent: none), in file order, each with the
        ``max_tokens`` per prompt it was measured over."""
        return self._capped_rows("mtp")

    @property
    def state_rows(self) -> list[Row]:
        """The state probe's rows (``state:``, absent: none), in file order, each with the
        ``max_tokens`` the probe feeds."""
        return self._capped_rows("state")

    def resolve_state(self, subject: Subject) -> tuple[Row | None, str]:
        """The state probe's row that fits ``subject`` (the state fixture judged at the
        candidate's class; ``tiers.find_row``), or None and why none does."""
        return find_row(self.state_rows, subject, what="state row")

    def resolve_mtp(self, subject: Subject) -> tuple[Row | None, str]:
        """The MTP row that fits ``subject`` (``tiers.find_row``: same weights key, class and
        architecture, within ``MAX_SCALE`` of its basis models), or None and why none does."""
        return find_row(self.mtp_rows, subject, what="MTP row")

    def resolve_topk(self, subject: Subject, k: int) -> tuple[Row | None, str]:
        """The top-k row that fits ``subject`` with ``k`` logprobs per position (``tiers.find_topk_row``)."""
        return find_topk_row(self.topk_rows, subject, k)

    def resolve(self, subject: Subject, *ids: str) -> ResolvedThresholds:
        """The release gate, the calibrated row that fits ``subject`` (``tiers.find_row``) and the
        probe tolerances. ``ids``: the subject model's identities (sha256, fixture name), used to
        flag measured bases taken on another model."""
        ids = (subject.sha256, *ids)
        release = {n: _gate(n, g, "release", ids) for n, g in self.data["release"].items()}
        probes = {n: _gate(n, g, "probes", ids) for n, g in self.data.get("probes", {}).items()}
        row, misfit = find_row(self.rows, subject)
        resolved = ResolvedThresholds(subject, release, None, misfit, probes, self.near_tie_margin, self.path, self.sha256, ids)
        return resolved.with_row(row) if row is not None else resolved


# ----------------------------------------------------------------------------------- loading



def load_thresholds(path: str | Path) -> Thresholds:
    """Read, parse (``yaml.safe_load``) and validate a thresholds file.

    Raises ``InvalidInput`` (exit 2), with the file and line, when the file cannot be read, is
    not YAML, repeats a key, breaks the schema (a gate without a basis names the gate and says
    so) or holds a non-finite number. Bytes already parsed and checked by this version of the
    loader come from ``harness.judge.parsed_cache`` (the checks on the data still run).
    """
    path = Path(path)
    raw, text = read_utf8(path, "thresholds file", "; thresholds files are UTF-8 YAML")
    cached = parsed_cache.get(raw)
    if cached is not None:
        try:
            return _checked(path, None, cached, raw)
        except InvalidInput:
            pass  # parsed again below, so the message can name the line
    try:
        # composed once, by libyaml when PyYAML has it (the pure-Python composer spends about a
        # second on this 290 kB file), bounded, then constructed from the node tree
        root, data = load_bounded(path, text, "a thresholds file")
    except yaml.YAMLError as e:
        raise InvalidInput(_yaml_error_message(path, e)) from e
    for keys, line, first in duplicate_keys(root)[:1]:
        raise InvalidInput(f"{path}:{line}: duplicate key {keys[-1]!r} (first at line {first}); YAML would silently keep the last one")
    data = _dates_as_text(data)
    th = _checked(path, root, data, raw)
    parsed_cache.put(raw, data)
    return th


def _checked(path: Path, root: yaml.Node | None, data: Any, raw: bytes) -> Thresholds:
    """``Thresholds`` of parsed ``data`` after the schema, finite-value and row checks
    (``InvalidInput`` naming the line of ``root``, or line 1 without a node tree)."""
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}:1: thresholds file must be a mapping with `schema: {SCHEMA_ID}`")
    if data.get("schema") == "harness-thresholds/v1":
        raise InvalidInput(f"{path}:1: harness-thresholds/v1 has one set of gates for every file; v2 keys them by weights "
                           "and compute class under a release floor: re-run `harness calibrate` to write it")
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
    _check_rows(path, root, data)
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
    return (len(p) == 2 and p[0] in SECTIONS) or (len(p) == 4 and p[0] in ROW_LISTS and p[2] in ROW_SECTIONS)


def _most_useful(errors: list[jsonschema.ValidationError]) -> jsonschema.ValidationError:
    """A missing basis first (the rule this file exists for), else the shallowest error."""
    for e in errors:
        p = list(e.absolute_path)
        if _is_gate_path(p) and (
            (e.validator == "required" and "'basis'" in e.message) or e.validator == "type"
        ):
            return e
    import jsonschema

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


def _gate_values(data: Mapping[str, Any]) -> list[tuple[list[Any], Any]]:
    """``(key path, value)`` of every gating number in the file."""
    out = [([sec, name, "value"], g["value"]) for sec in SECTIONS for name, g in data.get(sec, {}).items()]
    for lst in ROW_LISTS:
        for i, row in enumerate(data.get(lst, [])):
            out += [([lst, i, sec, name, "value"], g["value"]) for sec in ROW_SECTIONS for name, g in row.get(sec, {}).items()]
    return out


def _check_finite(path: Path, root: yaml.Node | None, data: Mapping[str, Any]) -> None:
    for keys, value in _gate_values(data):
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput(f"{path}:{line_of(root, keys)}: {'.'.join(map(str, keys))} is {value}; gates need finite numbers")


def _check_rows(path: Path, root: yaml.Node | None, data: Mapping[str, Any]) -> None:
    """One row per weights × class × architecture key, and none looser than the release floor."""
    floor = float(data["release"]["min_cosine"]["value"])
    for lst, what in (("calibrated", "row"), ("mtp", "MTP row"), ("state", "state row")):
        seen: dict[tuple[str, str, tuple[str, ...]], int] = {}
        for i, row in enumerate(data.get(lst, [])):
            archs = tuple(sorted({str(m.get("arch")) for m in row.get("basis_models", [])}))
            key = (row["weights"], row["class"], archs)
            where = f"{path}:{line_of(root, [lst, i])}: {lst}[{i}] (weights {key[0]}, class {key[1]})"
            if key in seen:
                raise InvalidInput(f"{where} repeats the key of {lst}[{seen[key]}]; one {what} per weights × class × architecture")
            seen[key] = i
            cos = float(row["gates"]["min_cosine"]["value"])
            if cos < floor:
                raise InvalidInput(f"{where}: min_cosine {cos} is looser than the release floor {floor}; no row may loosen it")
    seen_topk: dict[tuple[str, str, int], int] = {}
    for i, row in enumerate(data.get("topk", [])):
        key = (row["weights"], row["class"], row["k"])
        if key in seen_topk:
            raise InvalidInput(f"{path}:{line_of(root, ['topk', i])}: topk[{i}] (weights {key[0]}, class {key[1]}, k {key[2]}) "
                               f"repeats the key of topk[{seen_topk[key]}]; one row per weights × class × k")
        seen_topk[key] = i
