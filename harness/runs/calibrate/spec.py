"""``harness calibrate --speculative``: the speculative probe's acceptance gate, measured.

A restricted calibration of its own (the round's full re-calibration re-measures it): on the
trained MTP fixtures (``SPEC_MODELS``), the speculative probe's head-drafted cases
(``harness.runs.probes.probe_speculative`` without the given-draft cases) run on the calibration
code prompts (``harness.measure.code_prompts.CODE_CALIBRATION_PROMPTS``, from ``tests/``: not the
shipped sets the gate then judges), each case's first drafts against llama.cpp's MTP context at
the same steps (``harness.runs.spec_acceptance``). Known-good: the oracle (the same head, another
arithmetic). Known-bad: ``SPEC_KNOWN_BAD``, heads that draft badly while the output stays
lossless. The row's value is ``DROP_MARGIN`` × the known-good's worst drop, at least
``DROP_FLOOR``; refused (exit 1, nothing written) when a known-bad's worst drop does not exceed it.
``probes.spec_min_reference_accepted`` is declared (``MIN_REFERENCE``), its basis the smallest
drop the pair of rows detects.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from harness.runs.calibrate.plan import CalibrationRefused

SPEC_MODELS = ("fixture:trained-qwen35-mtp", "fixture:trained-qwen35moe-mtp")
SPEC_KNOWN_GOOD = ("oracle",)
SPEC_KNOWN_BAD = ("mutant:spec-drafts-crossed", "mutant:mtp-concat-swapped")
DROP_MARGIN = 2.0
DROP_FLOOR = 0.5
MIN_REFERENCE = 4
MIN_REFERENCE_BASIS = {
    "kind": "declared", "who": "harness maintainers (the speculative probe's acceptance gate; harness/runs/spec_acceptance.py)",
    "why": (f"A case is judged only where the reference head's first drafts are right at {MIN_REFERENCE} or more of the candidate's "
            f"steps: with fewer, one lost hit is already a drop of a third or more. With the measured drop bound d, a case where the "
            f"reference hits r first drafts FAILs when the candidate keeps fewer than r(1 - d): at r = {MIN_REFERENCE} and d = 0.5 the "
            f"smallest drop detected is 3 of 4 lost (0.75), at r = 8 it is 5 of 8 (0.625). A 16-token case proposes 6 to 15 first "
            f"drafts, so a head far below the reference is caught where it drafts at all, and one a little below is not."),
    "date": "2026-12-04"}


@dataclass
class SpecCalibration:
    """The measured cases: ``goods``/``bads`` label → the measured ``acceptance_gate`` records of
    its cases (each with ``case``, ``model``); ``rows`` the two thresholds.yaml ``probes`` rows;
    ``problems`` why the calibration is refused (empty: none)."""

    goods: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    bads: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    rows: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def measure_cases(candidate: str, spec: str, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The acceptance records of ``candidate``'s head-drafted cases on ``spec`` (the calibration
    code prompts' two longest, tokenized by llama.cpp) with a gate that never fails (drop ≤ 1,
    every case measured), each with its ``case`` label and ``model``. Raises ``EngineError``."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.engines.registry import resolve_engine
    from harness.fixtures.resolve import resolve_model
    from harness.measure.code_prompts import CODE_CALIBRATION_PROMPTS
    from harness.measure.prompts import load_prompt_set, tokenize_prompts
    from harness.runs.probes import MAIN_TOKENS, probe_speculative
    from harness.runs.spec_acceptance import AcceptanceGate

    path = resolve_model(spec)
    ref = LlamaCppEngine(path, ())
    ptoks = sorted(tokenize_prompts(load_prompt_set(CODE_CALIBRATION_PROMPTS), ref), key=lambda p: len(p.tokens), reverse=True)
    eng = resolve_engine(candidate, path)
    r = probe_speculative(eng, ptoks[0].tokens[:MAIN_TOKENS], [ptoks[1].tokens], ref, given=False,
                          prompt_ids=[ptoks[0].id, ptoks[1].id], acceptance=(AcceptanceGate(1.0, 0), ""))
    out = [{**c["acceptance_gate"], "case": c["case"], "model": spec} for c in r.details.get("cases", [])
           if isinstance(c.get("acceptance_gate"), dict) and "drop" in c["acceptance_gate"]]
    log(f"{candidate} on {spec}: {r.verdict.value}, {len(out)} cases, drops "
        + ", ".join(f"{c['reference_accepted'] - c['candidate_accepted']}/{c['reference_accepted']}" for c in out))
    return out


def _worst(recs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    judged = [c for c in recs if c["reference_accepted"] >= MIN_REFERENCE]
    return max(judged, key=lambda c: c["drop"]) if judged else None


def calibrate_speculative(models: Sequence[str] = SPEC_MODELS, command: str = "harness calibrate --speculative", commit: str | None = None,
                          log: Callable[[str], None] = lambda m: None) -> SpecCalibration:
    """Measure the known-good and known-bad engines on ``models`` (``measure_cases``) and propose
    the two rows (module docstring); problems recorded, not raised."""
    res = SpecCalibration()
    for label, side in [(g, res.goods) for g in SPEC_KNOWN_GOOD] + [(b, res.bads) for b in SPEC_KNOWN_BAD]:
        side[label] = [c for m in models for c in measure_cases(label, m, log)]
    good = [w for w in map(_worst, res.goods.values()) if w is not None]
    if not good:
        res.problems.append(f"no known-good case had {MIN_REFERENCE} or more reference first-draft hits")
        return res
    floor = max(w["drop"] for w in good)
    value = round(max(DROP_FLOOR, DROP_MARGIN * floor), 4)
    bads = []
    for label, recs in res.bads.items():
        w = _worst(recs)
        if w is None or w["drop"] <= value:
            res.problems.append(f"{label} is not caught: its worst measured drop is "
                                f"{'unmeasured' if w is None else format(w['drop'], '.3f')}, the bound {value:g}")
        else:
            bads.append({"value": float(w["drop"]), "what": f"{label} ({w['case']} on {w['model']}: {w['candidate_accepted']}/{w['steps']} "
                                                             f"against the reference's {w['reference_accepted']}/{w['steps']})"})
    n = sum(len(v) for v in res.goods.values())
    worst = max(good, key=lambda c: c["drop"])
    res.rows = {
        "spec_max_acceptance_drop": {"value": value, "basis": {
            "kind": "measured", "command": command, "n": n, "model": ", ".join(models), "date": datetime.date.today().isoformat(),
            "known_good_floor": float(floor), "known_bad": sorted(bads, key=lambda b: b["value"]),
            "note": (f"{DROP_MARGIN:g}x the known-good's worst drop of first-draft acceptance against llama.cpp's MTP context at the same "
                     f"steps, at least {DROP_FLOOR:g}: the speculative probe's head-drafted cases on the calibration code prompts "
                     f"(harness/data/prompts/code-calibration.jsonl, from tests/; judged on the shipped sets), 16 tokens a case. Known-good: "
                     f"{', '.join(SPEC_KNOWN_GOOD)} ({n} cases, worst {worst['reference_accepted'] - worst['candidate_accepted']} of "
                     f"{worst['reference_accepted']} lost in {worst['case']} on {worst['model']}). Known-bad: heads that draft badly, output "
                     f"lossless." + (f" harness commit {commit}." if commit else ""))}},
        "spec_min_reference_accepted": {"value": MIN_REFERENCE, "basis": MIN_REFERENCE_BASIS},
    }
    return res


def merge_spec_rows(path: str | Path, rows: dict[str, Any]) -> Path:
    """thresholds.yaml at ``path`` with ``rows`` set in its ``probes`` section, every other number
    kept; written by ``write_thresholds`` (atomic, validated by loading it back)."""
    from harness.judge.thresholds import load_thresholds
    from harness.runs.calibrate.document import write_thresholds

    doc = dict(load_thresholds(path).data)
    doc["probes"] = {**doc.get("probes", {}), **rows}
    return write_thresholds(doc, path)


def refuse(res: SpecCalibration) -> None:
    """Raise ``CalibrationRefused`` (exit 1) naming every problem of ``res``; nothing is written."""
    if res.problems:
        raise CalibrationRefused("speculative acceptance calibration refused: " + "; ".join(res.problems))
