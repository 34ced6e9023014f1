"""``harness calibrate --mtp``: the MTP rows of thresholds.yaml, the calibrated tier of the MTP cell
(``harness parity --mtp``, ``harness.runs.mtp``).

What is measured (docs/gates.md, "MTP rows"):

- **Known-good pairs**, per compute class (``MTP_KNOWN_GOOD``), each against llama.cpp's own MTP
  context at its default settings (the cell's reference): ``f64`` the exact oracle's head
  (``Qwen35Oracle.draft``); ``f32`` llama.cpp's MTP context at ``n_ubatch`` 7 and at one thread.
  They run on every model of ``MTP_MODELS`` (the one list to extend when another MTP fixture
  lands) over the shipped prompts as llama.cpp tokenizes them, each cut to ``max_tokens`` tokens
  as the cell cuts them, fed whole: the ``whole`` check's draft rows [T−1, V], in the llama.cpp
  row convention.
- **Rows**: one per weights key × class × architecture, its gates from ``propose`` (the trunk's
  rule: bootstrap CI by prompt, ``MARGIN``, ``MIN_STEP``, never below the release floor).
- **Known-bad pairs**: every MTP mutant (``harness.engines.mutants.MTP_MUTANTS``) on the first
  model of each architecture, measured in the check that names it (``MTP_CAUGHT_BY``: whole,
  chunked in two pieces, the first two prompts side by side, or depth 2); each must fail the release
  floor or its architecture's ``f64`` row (mutants are the oracle's class), or calibration refuses
  (``CalibrationRefused``), as it does for the trunk.

Nothing else in thresholds.yaml is measured or changed: ``merge_mtp_rows`` replaces the ``mtp:``
rows of the same key and keeps every other number as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from harness.errors import InvalidInput
from harness.measure import metrics
from harness.runs.calibrate.document import _basis, merge_rows
from harness.runs.calibrate.fit import PairStats, caught, propose
from harness.runs.calibrate.plan import MARGIN, MIN_STEP, RELEASE, CalibrationRefused, _llama, _oracle

MTP_MODELS: tuple[str, ...] = ("fixture:tiny-qwen35-mtp", "fixture:tiny-qwen35-mtp-own-head", "fixture:tiny-qwen35moe-mtp")
"""The models ``harness calibrate --mtp`` measures: the MTP fixtures, dense and MoE (the
own-head variant carries ``nextn.embed_tokens`` / ``nextn.shared_head_head``). Add a new MTP
fixture (e.g. a trained head) here; the mutants run on the first model of each architecture."""

MTP_MAX_TOKENS = 256
"""Tokens per prompt, as the cell's default cap (``MtpRequest.max_tokens``)."""

MTP_KNOWN_GOOD: dict[str, list[tuple[str, Callable[[Path], Any]]]] = {
    "f64": [("oracle", _oracle)],
    "f32": [("llama.cpp n_ubatch=7", lambda p: _llama(p, n_ubatch=7)), ("llama.cpp n_threads=1", lambda p: _llama(p, n_threads=1))],
}
"""Compute class → the known-good MTP engines of that class: (label, factory(path)). Only these
two classes have an engine with the head; another class's MTP tier is UNMEASURED until an
emulation of it runs the head (``harness.runs.mtp.MTP_CLASSES``)."""


@dataclass
class MtpModel:
    """One model being measured: its key, the prompts (token ids, cut) and the reference's
    whole-prompt drafts, computed once and shared by every pair."""

    spec: str
    path: Path
    weights: str
    file_type: str
    dims: dict[str, Any]
    prompts: list[list[int]]
    reference: Any
    whole: dict[tuple[int, ...], np.ndarray]

    def ref_whole(self, tokens: Sequence[int]) -> np.ndarray:
        """The reference's draft logits float32 [T−1, V] for ``tokens`` fed whole (cached)."""
        key = tuple(tokens)
        if key not in self.whole:
            self.whole[key] = self.reference.draft(list(tokens)).logits
        return self.whole[key]


def open_mtp_model(spec: str, max_tokens: int | None) -> MtpModel:
    """Resolve ``spec`` and tokenize the shipped prompts with llama.cpp, each cut to
    ``max_tokens`` (None: whole), prompts under 3 tokens dropped as the cell drops them. Raises
    ``InvalidInput`` when the file has no MTP block, ``EngineError`` when llama.cpp cannot load it."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.fixtures.resolve import resolve_model
    from harness.measure.prompts import load_prompt_set, tokenize_prompts
    from harness.model.gguf_model import GGUFModel

    path = resolve_model(spec)
    m = GGUFModel(path)
    hp = m.hparams
    if not hp.n_layer_nextn:
        raise InvalidInput(f"{spec} has no MTP (nextn) block to calibrate")
    ref = LlamaCppEngine(path)
    prompts = [list(p.tokens[:max_tokens]) for p in tokenize_prompts(load_prompt_set(None), ref)]
    dims = {"name": spec, "sha256": m.sha256, "arch": hp.arch, "n_layer": hp.n_layer, "n_embd": hp.n_embd}
    return MtpModel(spec, Path(path), m.weights_key, m.file_type, dims, [p for p in prompts if len(p) >= 3], ref, {})


def pair_stats(label: str, good: bool, model: str, pairs: Sequence[tuple[np.ndarray, np.ndarray]], compute_class: str) -> PairStats:
    """``PairStats`` of (reference, candidate) draft-logit blocks, one per prompt (float32 [R, V]
    each): per-row cosine and KL(P_ref ‖ P_cand) in nats (``metrics.position_metrics``), a
    non-finite candidate row counted as cosine −1 and KLD ∞."""
    mins, klds = [], []
    for ref, cand in pairs:
        pm = metrics.position_metrics(ref, cand)
        if not pm["cosine"].size:
            continue
        mins.append(float(np.min(np.where(pm["finite"], pm["cosine"], -1.0))))
        klds.append(np.where(pm["finite"], pm["kld"], np.inf))
    allk = np.concatenate(klds)
    return PairStats(label, good, model, float(min(mins)), float(np.mean(allk)), float(np.quantile(allk, 0.99)),
                     np.array(mins), klds, compute_class=compute_class)


def measure_good(mm: MtpModel, cls: str, label: str, make: Callable[[Path], Any], log: Callable[[str], None]) -> PairStats:
    """One known-good engine's whole-prompt drafts against the reference's on ``mm``."""
    log(f"  good MTP ({cls}): {label} vs llama.cpp on {mm.spec}")
    eng = make(mm.path)
    p = pair_stats(f"{label} vs llama.cpp", True, mm.spec, [(mm.ref_whole(t), eng.draft(t).logits) for t in mm.prompts], cls)
    p.weights = mm.weights
    p.extra.update(file_type=mm.file_type, dims=mm.dims)
    return p


def measure_mutant(mm: MtpModel, name: str, log: Callable[[str], None]) -> PairStats:
    """MTP mutant ``name`` against the reference on ``mm`` in the check that names it
    (``MTP_CAUGHT_BY``): whole prompts, the prompts in two pieces, the first two prompts side by
    side (each against the reference decoding them side by side), or the depth-2 rows of whole
    prompts (``depth2``: chained drafts, the reference's step-1 tokens given to the mutant)."""
    from harness.engines.mutants import MTP_CAUGHT_BY, load_mutant
    from harness.runs.mtp import _chunks

    check = MTP_CAUGHT_BY[name]
    log(f"  bad MTP: mutant:{name} ({check}) vs llama.cpp on {mm.spec}")
    eng = load_mutant(name, mm.path)
    if check == "chunked":
        pairs = [(mm.reference.draft(t, _chunks(len(t))).logits, eng.draft(t, _chunks(len(t))).logits) for t in mm.prompts]
    elif check == "depth2":  # chained drafts: the reference's step-1 tokens given to the mutant, as the cell does
        refs = mm.reference.draft_chain_many([(t, None) for t in mm.prompts])
        pairs = [(r.logits2, eng.draft_chain(t, r.tokens).logits2) for t, r in zip(mm.prompts, refs)]
    elif check == "sequences":
        seqs = mm.prompts[:2]
        pairs = [(r.logits, c.logits) for r, c in zip(mm.reference.draft_multi(seqs), eng.draft_multi(seqs))]
    else:
        pairs = [(mm.ref_whole(t), eng.draft(t).logits) for t in mm.prompts]
    p = pair_stats(f"mutant:{name}", False, mm.spec, pairs, "f64")
    p.weights = mm.weights
    p.extra.update(arch=mm.dims["arch"], check=check)
    return p


def _rows(goods: list[PairStats]) -> list[dict[str, Any]]:
    rows = []
    for weights, arch, cls in dict.fromkeys((g.weights, g.extra["dims"]["arch"], g.compute_class) for g in goods):
        members = [g for g in goods if (g.weights, g.extra["dims"]["arch"], g.compute_class) == (weights, arch, cls)]
        rows.append({"weights": weights, "class": cls, "arch": arch, "goods": members, "gates": propose(members),
                     "file_types": sorted({g.extra["file_type"] for g in members}),
                     "basis_models": list({g.extra["dims"]["name"]: g.extra["dims"] for g in members}.values())})
    return rows


def _row_for(rows: list[dict[str, Any]], cls: str, bad: PairStats) -> dict[str, Any] | None:
    return next((r for r in rows if r["class"] == cls and r["arch"] == bad.extra["arch"] and r["weights"] == bad.weights), None)


def mtp_row_document(r: dict[str, Any], bads: list[PairStats], command: str, max_tokens: int | None, commit_txt: str) -> dict[str, Any]:
    """One ``mtp:`` row of thresholds.yaml (schema ``$defs/mtp_row``) from a fitted row: each gate
    with its measured basis (command, n rows, the known-good floor, the mutants of its
    architecture it separates, the rule)."""
    g = r["gates"]
    n = sum(p.n for p in r["goods"])
    model = ", ".join(m["name"] for m in r["basis_models"])
    goods_txt = "; ".join(f"{p.label} on {p.model}: min cos {p.min_cosine:.10f}, KLD mean {p.kld_mean:.3g}, p99 {p.kld_p99:.3g}"
                          for p in r["goods"])
    mine = [b for b in bads if b.extra["arch"] == r["arch"] and b.weights == r["weights"]]
    cut = f"each prompt's first {max_tokens} tokens" if max_tokens else "whole prompts"
    where = (f"Draft rows of the shipped prompts ({cut}) fed whole, llama.cpp row convention, against llama.cpp's MTP context "
             f"at its defaults. Known-good ({r['class']}): {goods_txt}. Known-bad: the MTP mutants on {r['arch']} models, each in "
             "the check that names it (MTP_CAUGHT_BY).")
    return {
        "weights": r["weights"], "class": r["class"], "file_type": ", ".join(r["file_types"]),
        "basis_models": [{k: d[k] for k in ("name", "sha256", "arch", "n_layer", "n_embd")} for d in r["basis_models"]],
        "max_tokens": max_tokens,
        "gates": {
            "min_cosine": {"value": g["min_cosine"]["value"], "basis": _basis(
                command, n, model, g["min_cosine"]["floor"], [(b.min_cosine, b.label) for b in sorted(mine, key=lambda b: -b.min_cosine)],
                f"1 - {MARGIN}x(1 - lower 95% bootstrap CI by prompt {g['min_cosine']['ci']:.10f}), at most 1 - "
                f"{MIN_STEP['min_cosine']:g}, never below the release floor. {where}{commit_txt}", g["min_cosine"]["value"], True)},
            "max_kld_mean": {"value": g["max_kld_mean"]["value"], "basis": _basis(
                command, n, model, g["max_kld_mean"]["floor"], [(b.kld_mean, b.label) for b in sorted(mine, key=lambda b: b.kld_mean)],
                f"{MARGIN}x upper 95% bootstrap CI by prompt ({g['max_kld_mean']['ci']:.3g}) of the known-good KLD mean, at least "
                f"{MIN_STEP['max_kld_mean']:g}.{commit_txt}", g["max_kld_mean"]["value"], False)},
            "max_kld_p99": {"value": g["max_kld_p99"]["value"], "basis": _basis(
                command, n, model, g["max_kld_p99"]["floor"], [(b.kld_p99, b.label) for b in sorted(mine, key=lambda b: b.kld_p99)],
                f"{MARGIN}x upper 95% bootstrap CI by prompt ({g['max_kld_p99']['ci']:.3g}) of the known-good KLD p99, at least "
                f"{MIN_STEP['max_kld_p99']:g}.{commit_txt}", g["max_kld_p99"]["value"], False)},
        },
    }


@dataclass
class MtpCalibration:
    """``calibrate_mtp``'s result: the known-good and known-bad pairs, the ``mtp:`` rows as
    written (thresholds.yaml form), which gates catch each mutant (at its architecture's f64 row),
    and the problems that make calibration refuse."""

    goods: list[PairStats]
    bads: list[PairStats]
    rows: list[dict[str, Any]]
    caught: dict[str, dict[str, bool]]
    problems: list[str]


def calibrate_mtp(models: Sequence[str] = MTP_MODELS, classes: Sequence[str] = tuple(MTP_KNOWN_GOOD),
                  mutants: Sequence[str] | None = None, max_tokens: int | None = MTP_MAX_TOKENS,
                  command: str = "harness calibrate --mtp", commit: str | None = None,
                  log: Callable[[str], None] = print) -> MtpCalibration:
    """Measure the MTP rows (module docstring) and return them with their pairs; writes nothing.

    Raises ``InvalidInput`` for a class with no known-good MTP engine or an unknown MTP mutant
    (before anything runs), ``EngineError`` when an engine cannot run the head. A refusal is in
    ``problems`` (the caller raises ``CalibrationRefused`` before writing): a known-good pair past
    its own row, or a mutant caught by neither the release floor nor its architecture's f64 row.
    """
    from harness.engines.mutants import MTP_MUTANTS

    bad_cls = [c for c in classes if c not in MTP_KNOWN_GOOD]
    if bad_cls:
        raise InvalidInput(f"MTP rows are measured for classes {', '.join(MTP_KNOWN_GOOD)} (no engine of class "
                           f"{', '.join(bad_cls)} runs the MTP head yet)")
    names = list(MTP_MUTANTS) if mutants is None else list(mutants)
    unknown = [m for m in names if m not in MTP_MUTANTS]
    if unknown:
        raise InvalidInput(f"unknown MTP mutant {unknown[0]!r}; MTP mutants: {', '.join(MTP_MUTANTS)}")
    mms = [open_mtp_model(spec, max_tokens) for spec in models]
    goods = [measure_good(mm, cls, label, make, log) for mm in mms for cls in classes for label, make in MTP_KNOWN_GOOD[cls]]
    rows = _rows(goods)
    firsts = list({mm.dims["arch"]: mm for mm in reversed(mms)}.values())[::-1]  # the first model of each arch
    bads = [measure_mutant(mm, name, log) for mm in firsts for name in names
            if mm.dims["arch"] in MTP_MUTANTS[name].archs]
    floor = float(RELEASE["min_cosine"]["value"])
    problems, hits = [], {}
    for r in rows:
        g = r["gates"]
        for p in r["goods"]:
            if p.min_cosine < g["min_cosine"]["value"] or p.kld_mean > g["max_kld_mean"]["value"] or p.kld_p99 > g["max_kld_p99"]["value"]:
                problems.append(f"known-good {p.label} on {p.model} lies past the MTP row {r['weights']} × {r['class']} × {r['arch']}")
    for b in bads:
        r = _row_for(rows, "f64", b) or _row_for(rows, "f32", b)
        c = {"release": b.min_cosine < floor, **({k: v for k, v in caught(b, r["gates"]).items() if k in ("cosine", "kld_mean", "kld_p99")}
                                                 if r is not None else {})}
        hits[f"{b.label} on {b.model}"] = c
        if not any(c.values()):
            problems.append(f"{b.label} on {b.model} ({b.extra['check']}) passes the release floor and every gate of its MTP row "
                            f"(min cosine {b.min_cosine:.8f}, KLD mean {b.kld_mean:.3g}, p99 {b.kld_p99:.3g})")
    commit_txt = f" harness commit {commit}." if commit else ""
    docs = [mtp_row_document(r, bads, command, max_tokens, commit_txt) for r in rows]
    for r in rows:
        g = r["gates"]
        log(f"  MTP row {r['weights']} × {r['class']} × {r['arch']}: cosine ≥ {g['min_cosine']['value']}, KLD mean ≤ "
            f"{g['max_kld_mean']['value']:g}, p99 ≤ {g['max_kld_p99']['value']:g} ({len(r['goods'])} pairs)")
    return MtpCalibration(goods, bads, docs, hits, problems)


def merge_mtp_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """thresholds.yaml at ``path`` with ``rows`` replacing the ``mtp:`` rows of the same weights ×
    class × architecture, every other number kept (``document.merge_rows``)."""
    return merge_rows(path, "mtp", rows)


def refuse(res: MtpCalibration) -> None:
    """Raise ``CalibrationRefused`` (exit 1) naming every problem of ``res``; nothing is written."""
    if res.problems:
        raise CalibrationRefused("MTP calibration refused: " + "; ".join(res.problems))
