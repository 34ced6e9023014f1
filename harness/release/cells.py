"""The cells of a release and the inputs that make a receipt current for one of them.

A cell is (model × candidate × backend) of a manifest (``harness.release.manifest``); it is
covered by two receipts: a parity receipt (the candidate against the reference) and a probe
receipt (the candidate's self-consistency probes). Each is one ``Run``, identified by the inputs
its numbers depend on (``planned_inputs``):

    kind, model sha256, candidate and its build id, reference and its build id (a probe run without
    the ``long`` probe has no reference), compute class, backend, thresholds sha256, prompts
    sha256, the harness's numbers hash (``harness.provenance.numbers_sha256``), the probes run,
    and the calibration receipt the calibrated tier comes from when no row of thresholds.yaml fits
    the model and class (``harness calibrate --model M --class C`` recorded one in the ledger)

and its ``key`` is the sha256 of their canonical JSON. The same inputs are read back from any
receipt (``receipt_inputs``: the candidate's build id, its reported compute class and backend,
...), so a receipt made by ``harness parity`` counts as much as one made by ``harness sweep``, and
a receipt whose inputs differ from the plan in some field (another build, another thresholds
file) is *stale*, naming the fields. Thread counts are left out on purpose: they are a scheduling
choice of the sweep (``--jobs``) that the calibrated tier already covers (calibration measures
llama.cpp at other thread counts), so resuming with another ``--jobs`` does not redo a cell.

A sweep writes the plan's key and inputs into the receipt (``cell``), so a cell whose engine
reported another class or backend than the manifest pins is not re-run by every sweep: the
sign-off names the mismatch instead.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from harness.judge.calibrated import find_recorded
from harness.runs.inputs import resolve_inputs, resolve_thresholds_path
from harness.measure.prompts import load_prompt_set
from harness.engines.options import candidate_flags, class_settings
from harness.engines.registry import engine_build_id
from harness.errors import HarnessError
from harness.evidence.index import receipt_summary
from harness.evidence.receipts import PROBE_SCHEMA_ID, canonical_json
from harness.provenance import numbers_sha256, sha256_bytes, sha256_file
from harness.release.manifest import PROBE_NAMES, CandidatePin, Manifest, ModelPin

KINDS = ("parity", "probe")
IN_PROCESS_CPU = ("oracle", "oracle-bf16", "oracle-f16", "llama.cpp")
"""Engines of the harness itself that compute on the CPU (as do ``mutant:NAME``): their backend
is ``cpu`` when their info names none."""
INPUT_FIELDS = ("kind", "model_sha256", "candidate", "candidate_build", "reference", "reference_build", "compute_class", "backend",
                "thresholds_sha256", "prompts_sha256", "harness_numbers", "probes", "calibration")


@dataclass(frozen=True)
class Cell:
    """One (model × candidate × backend) of a manifest."""

    model: ModelPin
    candidate: CandidatePin
    backend: str

    @property
    def label(self) -> str:
        return f"{self.candidate.engine} @ {self.model.spec} [{self.backend}]"


@dataclass(frozen=True)
class Run:
    """One receipt a cell needs: ``kind`` parity or probe, its planned ``inputs`` and their ``key``."""

    cell: Cell
    kind: str
    inputs: dict[str, Any]
    key: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.cell.label}"


def input_key(inputs: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``inputs`` (``INPUT_FIELDS``)."""
    return sha256_bytes(canonical_json({k: inputs.get(k) for k in INPUT_FIELDS}))


def reported_backend(info: Mapping[str, Any]) -> str:
    """The backend an engine reports: ``settings.backend``, else (a command engine's ``info.json``)
    ``settings.reported.backend``, else ``build.backend``; else ``cpu`` for the harness's own CPU
    engines (``IN_PROCESS_CPU``, ``mutant:NAME``), else ``unreported``."""
    settings = info.get("settings") if isinstance(info.get("settings"), Mapping) else {}
    reported = settings.get("reported") if isinstance(settings.get("reported"), Mapping) else {}
    build = info.get("build") if isinstance(info.get("build"), Mapping) else {}
    for source in (settings, reported, build):
        value = source.get("backend")
        if isinstance(value, str) and value:
            return value
    name = str(info.get("name") or "")
    return "cpu" if name in IN_PROCESS_CPU or name.startswith("mutant:") else "unreported"


@dataclass(frozen=True)
class PlanContext:
    """What every run of a manifest shares, resolved once: the thresholds and prompt files with
    their sha256, the reference's build id, each candidate's build id and each model's sha256 now
    (None: the model cannot be resolved)."""

    thresholds: Path
    thresholds_sha256: str
    prompts: Path | None
    prompts_sha256: str
    reference_build: str
    builds: dict[str, str]
    model_sha256: dict[str, str | None]
    calibrations: dict[tuple[str, str], str | None] = field(default_factory=dict)


def plan_context(m: Manifest, ledger: Path | None = None) -> PlanContext:
    """Resolve the manifest's files and builds (``PlanContext``), and per model and pinned class the
    calibration receipt in ``ledger`` the tier would come from when no committed row fits. Raises
    ``InvalidInput`` for an unreadable thresholds or prompt file or a malformed engine table."""
    thresholds = resolve_thresholds_path(m.thresholds_path)
    prompt_set = load_prompt_set(m.prompts)
    shas: dict[str, str | None] = {}
    cals: dict[tuple[str, str], str | None] = {}
    for pin in m.models:
        try:
            inputs = resolve_inputs(pin.spec, thresholds=thresholds, prompts=m.prompts)
        except HarnessError:
            shas[pin.spec] = None
            continue
        shas[pin.spec] = inputs.model.sha256
        for klass in {c.compute_class for c in m.candidates}:
            resolved = inputs.thresholds_for({"compute_class": klass})
            found = None if resolved.row is not None else find_recorded(ledger, resolved.subject.sha256, klass)
            cals[(pin.spec, klass)] = found[1] if found else None
    return PlanContext(thresholds, sha256_file(thresholds), m.prompts, prompt_set.sha256, engine_build_id(m.reference),
                       {c.engine: engine_build_id(c.engine) for c in m.candidates}, shas, cals)


def plan_runs(m: Manifest, ctx: PlanContext) -> list[Run]:
    """Every run of the manifest, in its order: per model, per candidate, per backend, the parity
    run then the probe run."""
    runs = []
    for pin in m.models:
        for cand in m.candidates:
            for backend in cand.backends:
                cell = Cell(pin, cand, backend)
                for kind in KINDS:
                    inputs = planned_inputs(m, ctx, cell, kind)
                    runs.append(Run(cell, kind, inputs, input_key(inputs)))
    return runs


def planned_inputs(m: Manifest, ctx: PlanContext, cell: Cell, kind: str) -> dict[str, Any]:
    """The inputs ``kind``'s receipt of ``cell`` must have been made from (module docstring)."""
    uses_reference = kind == "parity" or "long" in m.probes
    return {
        "kind": kind,
        "model_sha256": ctx.model_sha256.get(cell.model.spec),
        "candidate": cell.candidate.engine,
        "candidate_build": ctx.builds[cell.candidate.engine],
        "reference": m.reference if uses_reference else None,
        "reference_build": ctx.reference_build if uses_reference else None,
        "compute_class": cell.candidate.compute_class,
        "backend": cell.backend,
        "thresholds_sha256": ctx.thresholds_sha256,
        "prompts_sha256": ctx.prompts_sha256,
        "harness_numbers": numbers_sha256(),
        "probes": sorted(m.probes) if kind == "probe" else None,
        "calibration": ctx.calibrations.get((cell.model.spec, cell.candidate.compute_class)),
    }


def receipt_inputs(receipt: Mapping[str, Any]) -> dict[str, Any]:
    """The same inputs read from a parity or probe receipt (its candidate's reported compute class
    and backend, the build ids its engines' records carry; None where a receipt made before build
    ids were recorded has none)."""
    engines = receipt.get("engines") or {}
    cand = engines.get("candidate") or {}
    ref = engines.get("reference") or None
    probe = receipt.get("schema") == PROBE_SCHEMA_ID
    klass = receipt.get("compute_class") if probe else (receipt.get("gated") or {}).get("compute_class")
    return {
        "kind": "probe" if probe else "parity",
        "model_sha256": (receipt.get("model") or {}).get("sha256"),
        "candidate": cand.get("name"),
        "candidate_build": (cand.get("build") or {}).get("id"),
        "reference": ref.get("name") if ref else None,
        "reference_build": (ref.get("build") or {}).get("id") if ref else None,
        "compute_class": klass or cand.get("compute_class"),
        "backend": reported_backend(cand),
        "thresholds_sha256": (receipt.get("thresholds") or {}).get("sha256"),
        "prompts_sha256": (receipt.get("prompts") or {}).get("sha256"),
        "harness_numbers": (receipt.get("harness") or {}).get("numbers"),
        "probes": sorted(p["name"] for p in receipt.get("probes") or []) if probe else None,
        "calibration": (receipt.get("thresholds") or {}).get("self_calibration"),
    }


SAME_CELL_FIELDS = ("kind", "candidate", "backend", "model_sha256")
"""The inputs that make two receipts measurements of the same cell, whatever their other inputs
(builds, thresholds, prompts): what a sign-off calls a STALE receipt of a cell."""


def same_cell_key(inputs: Mapping[str, Any], model_sha256: str | None = None) -> str:
    """sha256 of the canonical JSON of ``SAME_CELL_FIELDS`` of ``inputs`` (``model_sha256``, when
    given, in place of theirs)."""
    picked = {k: inputs.get(k) for k in SAME_CELL_FIELDS}
    if model_sha256 is not None:
        picked["model_sha256"] = model_sha256
    return sha256_bytes(canonical_json(picked))


class ReceiptKeys(list):
    """``receipt_keys_of``'s ``[(typed key, created)]``, with ``summary``: the receipt's index
    summary from the same read (``harness.evidence.index.receipt_summary``)."""

    summary: tuple[str | None, str | None] = (None, None)


def receipt_keys_of(path: Path) -> ReceiptKeys | None:
    """``[(typed key, created)]`` of one parity or probe receipt file: ``input:`` + the key of the
    inputs it was made from (``input_key(receipt_inputs(...))``), ``cell:`` + its planned
    ``cell.key`` when a sweep made it, ``same:`` + ``same_cell_key``; ``created`` is the receipt's
    time. ``[]`` for a calibration receipt (it has no key); None for a file that cannot be read
    (the caller does not remember those: it reads them again next time). What the ledger's query cache keeps per
    receipt (``LedgerCache.add_receipt_keys``), so ``sweep`` and ``signoff`` read a receipt once;
    its ``summary`` (``ReceiptKeys``) is what the index keeps (``LedgerCache.add_summaries``)."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict):
        return None
    keys = ReceiptKeys(keys_of_receipt(rec))
    keys.summary = receipt_summary(rec)
    return keys


def receipt_verdict(rec: Mapping[str, Any]) -> Any:
    """The verdict a receipt holds (what its ledger row copies): a parity receipt's
    ``gated.verdict``, else its ``verdict``. Every verdict a sweep or sign-off acts on is read here,
    from the receipt the row binds by sha256, never from the row or the query cache."""
    return (rec.get("gated") or {}).get("verdict") if isinstance(rec.get("gated"), dict) else rec.get("verdict")


def keys_of_receipt(rec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``receipt_keys_of`` of a receipt already read (a JSON object)."""
    if rec.get("schema") == "harness-calibration-receipt/v1":
        return []
    inputs = receipt_inputs(rec)
    keys = {"input:" + input_key(inputs), "same:" + same_cell_key(inputs)}
    if isinstance(rec.get("cell"), dict) and isinstance(rec["cell"].get("key"), str):
        keys.add("cell:" + rec["cell"]["key"])
    return [(k, str(rec.get("created"))) for k in sorted(keys)]


def known_receipt_keys(cache: Any, receipt_ids: Iterable[str], path_of: Callable[[str], Path]) -> dict[str, list[tuple[str, str]]]:
    """``{receipt id: [(typed key, created)]}`` (``receipt_keys_of``) of every receipt the
    ledger's query cache ``cache`` (a ``LedgerCache``) has seen, and of every id in
    ``receipt_ids`` it had not: those are read once from ``path_of(id)`` and their keys stored.
    Receipts are content-addressed and never replaced, so a stored key never goes stale; an
    unreadable receipt maps to nothing and is read again next time. What ``sweep`` (ids from
    the receipts folder) and ``signoff`` (ids of the standing rows) both use. The same read stores
    each receipt's index summary, so the door's index refresh after a sign-off reads it no more."""
    known = cache.receipt_keys()
    new: dict[str, list[tuple[str, str]] | None] = {}
    summaries: dict[str, tuple[str | None, str | None]] = {}
    for rid in receipt_ids:
        if rid not in known and rid not in new:
            new[rid] = receipt_keys_of(path_of(rid))
            if getattr(new[rid], "summary", (None, None)) != (None, None):
                summaries[rid] = new[rid].summary
    read = {k: list(v) for k, v in new.items() if v is not None}
    cache.add_receipt_keys(read)
    cache.add_summaries(summaries)  # the same read gives the index its summary (``index.receipt_summary``)
    known.update(read)
    return known


def differences(planned: Mapping[str, Any], found: Mapping[str, Any]) -> list[str]:
    """``field: found → planned`` for each input that differs (hashes shortened to 12 digits)."""
    short = lambda v: v[:12] if isinstance(v, str) and len(v) == 64 else v  # noqa: E731
    return [f"{k} {short(found.get(k))} → {short(planned.get(k))}" for k in INPUT_FIELDS if planned.get(k) != found.get(k)]


def candidate_settings(pin: CandidatePin) -> dict[str, str]:
    """The settings that make the candidate compute in its pinned class: ``{"dtype": "bfloat16"}``
    for ``{engine: mlx, compute_class: bf16}`` (``harness.engines.options.class_settings``; the
    transformers and mlx engines compute in float32 unless given a dtype), ``{}`` for an engine
    whose class is its own. What a sweep's task runs with and ``run_command`` asks for."""
    return class_settings(pin.engine, pin.compute_class)


def run_command(m: Manifest, run: Run) -> str:
    """The one ``harness`` command that makes ``run``'s receipt by hand (what a sweep runs): the
    candidate with the ``--dtype`` of its pinned class where the engine takes one
    (``candidate_settings``)."""
    args = ["harness", run.kind, "--candidate", run.cell.candidate.engine, *candidate_flags(candidate_settings(run.cell.candidate)),
            "--model", run.cell.model.spec]
    if run.kind == "parity" or "long" in m.probes:
        args += ["--reference", m.reference]
    if m.prompts is not None:
        args += ["--prompts", str(m.prompts)]
    if m.thresholds_path is not None:
        args += ["--thresholds", str(m.thresholds_path)]
    if run.kind == "probe" and set(m.probes) != set(PROBE_NAMES):
        args += [a for p in m.probes for a in ("--only", p)]
    return shlex.join(args)
