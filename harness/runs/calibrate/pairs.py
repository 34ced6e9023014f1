"""Measuring pairs: a candidate against the cached reference over the prompt set (``PairStats``), the
known-good pairs of each class, the probe floors, the MoE excursions, the localization bounds and
the mutants (known-bad pairs). Part of ``harness.runs.calibrate``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from harness.engines.base import COMPUTE_CLASSES, gather, logits_each
from harness.errors import HarnessError, Verdict
from harness.measure import metrics
from harness.runs.calibrate.fit import PairStats, _round_up, propose_probes
from harness.runs.calibrate.plan import (
    CLASS_MEMBERS,
    EXTRA_FLOOR_CLASSES,
    KNOWN_GOOD,
    MOE_EXCURSION_MARGIN,
    MOE_EXCURSION_MIN,
    MOE_ROUTER_MAX_GAP,
    PROBE_FLOOR_MODELS,
    RELEASE,
    CalibrationPlan,
    _llama,
    _oracle,
    usable,
)


class CachedReference:
    """llama.cpp logits (and router activations) per token sequence, computed once: every pair
    on a model shares them."""

    def __init__(self, engine):
        self.engine = engine
        self.cache: dict[tuple[int, ...], np.ndarray] = {}
        self.acts: dict[tuple[tuple[int, ...], tuple[str, ...]], dict[str, np.ndarray]] = {}

    def activations(self, tokens: Sequence[int], names: Sequence[str]) -> dict[str, np.ndarray]:
        """``engine.activations(tokens, names=names)``, once per (tokens, names)."""
        key = (tuple(tokens), tuple(names))
        if key not in self.acts:
            self.acts[key] = self.engine.activations(list(tokens), names=list(names))
        return self.acts[key]

    def get(self, tokens: Sequence[int]) -> np.ndarray:
        key = tuple(tokens)
        if key not in self.cache:
            self.cache[key] = gather(self.engine.logits(tokens), len(tokens))
        return self.cache[key]

    def prefetch(self, prompts: Sequence[Sequence[int]]) -> None:
        """The logits of every prompt not cached yet, in one run of the engine where it can
        (``harness.engines.base.logits_each``: one llama.cpp worker for all of them, each prompt
        on its own fresh context, so the rows ``get`` would compute)."""
        todo = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in self.cache))
        each = logits_each(self.engine, [list(k) for k in todo])
        for key in todo:
            self.cache[key] = gather(next(each), len(key))
        next(each, None)  # the engine's run ends and checks its exit


@dataclass
class RouterFlips:
    """How a known-good pair on an MoE model is measured the way ``harness parity`` judges it
    (``harness.measure.near_ties``): each prompt up to the first position where the candidate
    keeps other experts than llama.cpp, when llama.cpp's router gap there is at most
    ``max_gap`` (thresholds.yaml ``probes.moe_router_max_gap``); a flip where the router is not
    near-tied is measured like any other position, so it would widen the row and show."""

    n_layer: int
    n_expert_used: int
    max_gap: float
    log: Callable[[str], None] = print

    def cut(self, ref: Any, cand: Any, toks: Sequence[int], label: str) -> int | None:
        """The position the prompt's comparison ends at, or None (the whole prompt)."""
        from harness.errors import HarnessError
        from harness.measure import near_ties

        try:
            f, gap = near_ties.first_flip(ref, cand, toks, self.n_layer, self.n_expert_used)
        except (HarnessError, ValueError) as e:
            self.log(f"    {label}: router logits not compared ({str(e).splitlines()[0][:120]}): whole prompt measured")
            return None
        if f is None:
            return None
        if not gap <= self.max_gap:
            self.log(f"    {label}: keeps other experts from position {f} where llama.cpp's router gap is {gap:.3g} "
                     f"(> {self.max_gap:g}): measured, not cut")
            return None
        self.log(f"    {label}: keeps other experts from position {f} of {len(toks)} (router gap {gap:.2g}): measured up to it")
        return f


@dataclass
class ReleaseExcuses:
    """How a known-good pair on an MoE model is measured the way ``harness parity``'s release gate
    judges it (``harness.measure.near_ties.release_excuses``): a position below the release floor
    where llama.cpp's router gap is at most ``max_gap`` is left out, when such positions are at
    most ``max_share`` of the pair's positions; past that share none is, and the row shows them."""

    n_layer: int
    n_expert_used: int
    max_gap: float
    max_share: float
    floor: float = RELEASE["min_cosine"]["value"]
    log: Callable[[str], None] = print

    def candidates(self, ref: Any, toks: Sequence[int], pm: dict[str, np.ndarray]) -> np.ndarray:
        """Indices of the prompt's positions (of ``pm``, maybe cut) below the floor at a near-tie."""
        from harness.measure import near_ties

        below = np.flatnonzero(pm["finite"] & (pm["cosine"] < self.floor))
        if not below.size:
            return below
        gaps = near_ties.router_gaps(ref, toks, self.n_layer, self.n_expert_used)
        return below[gaps[below] <= self.max_gap]

    def decide(self, found: list[np.ndarray], n_positions: int, label: str) -> list[np.ndarray]:
        """``found`` (per prompt) when within the share, else nothing excused (logged)."""
        from harness.measure import near_ties

        n = sum(f.size for f in found)
        if n and n > near_ties.allowed_excuses(n_positions, self.max_share):
            self.log(f"    {label}: {n} positions below {self.floor:g} at a router near-tie, more than "
                     f"{self.max_share:.0%} of {n_positions}: none left out")
            return [np.zeros(0, int) for _ in found]
        if n:
            self.log(f"    {label}: {n} position(s) below {self.floor:g} at a router near-tie (gap ≤ {self.max_gap:g}) left out, "
                     "as the release gate excuses them")
        return found


def release_excuses(hp: Any, log: Callable[[str], None] = print) -> ReleaseExcuses | None:
    """The release gate's near-tie excuses as ``RELEASE`` declares them, for a model with experts
    (``hp``: its ``HParams``); None for a dense model."""
    if hp.n_expert <= 0:
        return None
    return ReleaseExcuses(hp.n_layer, hp.n_expert_used, float(RELEASE["moe_router_tie_gap"]["value"]),
                          float(RELEASE["moe_router_max_excused"]["value"]), log=log)


def measure_pair(label: str, good: bool, model: str, ref: CachedReference, cand, prompts: list[list[int]],
                 flips: RouterFlips | None = None, excuses: ReleaseExcuses | None = None) -> PairStats:
    """Per-position metrics of ``cand`` vs the cached reference over ``prompts``; the pair's class
    is the candidate's declared ``compute_class`` (``f64`` when none: the oracle's mutants).
    ``flips``: a known-good pair on an MoE model, each prompt measured up to its router flip
    (``RouterFlips``; ``extra["router_flips"]`` lists them). ``excuses``: a known-good pair on an
    MoE model, the positions the release gate would excuse left out (``ReleaseExcuses``;
    ``extra["release_excused"]`` counts them)."""
    pms, cut_at, found = [], [], []
    ref.prefetch(prompts)
    for i, toks in enumerate(prompts):
        pm = metrics.position_metrics(ref.get(toks), gather(cand.logits(toks), len(toks)))
        f = flips.cut(ref, cand, toks, label) if flips is not None else None
        if f is not None:
            cut_at.append({"prompt_index": i, "position": f, "positions": len(toks)})
            pm = {k: v[:f] for k, v in pm.items()}
        pms.append(pm)
        found.append(excuses.candidates(ref, toks, pm) if excuses is not None else np.zeros(0, int))
    if excuses is not None:
        found = excuses.decide(found, sum(pm["cosine"].size for pm in pms), label)
    mins, klds = [], []
    for pm, drop in zip(pms, found):
        if drop.size:
            keep = np.setdiff1d(np.arange(pm["cosine"].size), drop)
            pm = {k: v[keep] for k, v in pm.items()}
        if not pm["cosine"].size:
            continue
        cos = np.where(pm["finite"], pm["cosine"], -1.0)
        mins.append(float(np.min(cos)))
        klds.append(np.where(pm["finite"], pm["kld"], np.inf))
    allk = np.concatenate(klds)
    pair = PairStats(label, good, model, float(min(mins)), float(np.mean(allk)), float(np.quantile(allk, 0.99)),
                     np.array(mins), klds, compute_class=cand.info.compute_class or "f64")
    if cut_at:
        pair.extra["router_flips"] = cut_at
    if sum(f.size for f in found):
        pair.extra["release_excused"] = int(sum(f.size for f in found))
    return pair


def _worst(result) -> tuple[float, float] | None:
    """(min cosine, max KLD) over a probe's comparisons (None: nothing compared)."""
    comps = [c for c in result.comparisons if c.min_cosine is not None]
    if not comps:
        return None
    return min(c.min_cosine for c in comps), max(c.max_kld for c in comps)


@dataclass
class ModelMeasurement:
    """What calibration measured on one model."""

    spec: str
    path: Path
    weights: str
    file_type: str
    dims: dict[str, Any]
    prompts: list[list[int]]
    ref: CachedReference


def _prompts(model_path: Path, n_max_tokens: int | None) -> list[list[int]]:
    """The shipped prompts as llama.cpp tokenizes them, each cut to ``n_max_tokens`` (None: whole)."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.measure.prompts import load_prompt_set, tokenize_prompts

    ps = tokenize_prompts(load_prompt_set(None), LlamaCppEngine(model_path))
    return [p.tokens[:n_max_tokens] for p in ps]


def open_for_calibration(spec: str, max_tokens: int | None) -> ModelMeasurement:
    """Resolve ``spec`` (building a ladder fixture if needed) and set up its cached reference."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.fixtures.resolve import resolve_model
    from harness.model.gguf_model import GGUFModel

    path = resolve_model(spec)
    m = GGUFModel(path)
    hp = m.hparams
    dims = {"name": spec, "sha256": m.sha256, "arch": hp.arch, "n_layer": hp.n_layer, "n_embd": hp.n_embd}
    return ModelMeasurement(spec, path, m.weights_key, m.file_type, dims, _prompts(path, max_tokens), CachedReference(LlamaCppEngine(path)))


def measure_goods(mm: ModelMeasurement, classes: Sequence[str], use_optional: bool, log: Callable[[str], None]) -> list[PairStats]:
    """Every known-good engine of the member classes of ``classes`` on one model (the optional
    ones, transformers and mlx, with ``use_optional`` where their extra is installed: ``usable``)."""
    from harness.measure.near_ties import cuts_apply
    from harness.model.gguf_model import GGUFModel

    wanted = sorted({c for k in classes for c in CLASS_MEMBERS[k]}, key=COMPUTE_CLASSES.index)
    hp = GGUFModel(mm.path).hparams
    flips = RouterFlips(hp.n_layer, hp.n_expert_used, float(MOE_ROUTER_MAX_GAP["value"]), log) if hp.n_expert > 0 else None
    excuses = release_excuses(hp, log)
    out = []
    for cls in wanted:
        for label, make, module in KNOWN_GOOD[cls]:
            if not usable(module, use_optional):
                continue
            log(f"  good ({cls}): {label} vs llama.cpp on {mm.spec}")
            p = measure_pair(f"{label} vs llama.cpp", True, mm.spec, mm.ref, make(mm.path), mm.prompts,
                             flips if cuts_apply(cls, mm.weights) else None, excuses)
            p.compute_class, p.weights = cls, mm.weights
            p.extra.update(file_type=mm.file_type, dims=mm.dims)
            out.append(p)
    return out


def _probe_engines(classes: Sequence[str], use_optional: bool) -> dict[str, list[tuple[str, Callable[[Path], Any]]]]:
    """The engines whose self-consistency sets each member class's probe floor: the class's
    known-good engines (llama.cpp at n_ubatch 7 and at 1 thread among the f32 ones: a thread
    count changes its decode numerics), and llama.cpp at its defaults for ``f32``."""
    engines: dict[str, list[tuple[str, Callable[[Path], Any]]]] = {"f32": [("llama.cpp", lambda p: _llama(p))]}
    for cls, goods in KNOWN_GOOD.items():
        engines.setdefault(cls, [])
        engines[cls] += [(label, make) for label, make, module in goods if usable(module, use_optional)]
    needed = {c for k in classes for c in CLASS_MEMBERS[k]}
    return {c: e for c, e in engines.items() if c in needed}


def _self_comparisons(engine: Any, prompts: Sequence[Sequence[int]], decode_tokens: int) -> list[dict[str, np.ndarray]]:
    """Per-position metrics (``metrics.position_metrics``) of every way the split and decode
    probes feed ``engine`` (the longest prompt's first ``MAIN_TOKENS`` split at each point; the
    ``decode_prompt`` tokens after a prefill of 1 and 16) against the same tokens fed whole."""
    from harness.runs.probes import MAIN_TOKENS, decode_prompt, split_points

    out = []
    main = list(max(prompts, key=len))[:MAIN_TOKENS]
    whole = gather(engine.logits(main), len(main))
    for p in split_points(len(main)):
        out.append(metrics.position_metrics(whole, gather(engine.logits(main, chunks=[p, len(main) - p]), len(main))))
    toks = decode_prompt(prompts, decode_tokens)
    whole = gather(engine.logits(toks), len(toks))
    for k in (1, 16):
        out.append(metrics.position_metrics(whole, gather(engine.logits(toks, chunks=[k] + [1] * (len(toks) - k)), len(toks))))
    return out


def _extra_floor_models(path: Path) -> list[tuple[str, Path]]:
    from harness.fixtures.resolve import resolve_model

    out = [(spec, resolve_model(spec)) for spec in PROBE_FLOOR_MODELS]
    return [(spec, p) for spec, p in out if Path(p).resolve() != Path(path).resolve()]


def _measured(label: str, make: Callable[[Path], Any], path: Path, decode_tokens: int, log: Callable[[str], None],
              prompts: Sequence[Sequence[int]] | None = None) -> list[dict[str, np.ndarray]] | None:
    """``_self_comparisons`` of ``make(path)`` on ``prompts`` (default: the shipped prompts
    tokenized whole), or None, logged, when the engine cannot build that model (transformers
    cannot build every fixture, e.g. the random-weight MoE)."""
    log(f"  {label}: split and {decode_tokens}-token decode")
    try:
        return _self_comparisons(make(path), prompts if prompts is not None else _prompts(path, None), decode_tokens)
    except (HarnessError, RuntimeError) as e:
        log(f"  skipped: {label}: {str(e).splitlines()[0][:160]}")
        return None


def probe_floors(path: Path, classes: Sequence[str], use_optional: bool, log: Callable[[str], None],
                 decode_tokens: int | None = None, extra: bool = False) -> dict[str, dict[str, dict[str, Any]]]:
    """Probe tolerances per class (``propose_probes``) from the class engines' own split and
    decode floor on one model, measured as ``harness probe`` runs them: the shipped prompts
    tokenized whole, decode over ``decode_tokens`` (default ``probes.DECODE_TOKENS``) one token per
    call, so a drift a correct engine shows only after hundreds of calls is in the floor; for
    ``f32`` also llama.cpp at n_ubatch 7 against its default. ``extra``: the same engines on
    ``PROBE_FLOOR_MODELS`` join the floor (what thresholds.yaml's rows use; a subject's own
    measurement does not). Each tolerance's ``floor`` is the worst position of any comparison,
    ``n`` the comparisons, ``engines`` the worst per engine (and model), ``models`` the models."""
    from harness.runs.probes import DECODE_TOKENS, MAIN_TOKENS

    decode_tokens = decode_tokens or DECODE_TOKENS
    prompts = _prompts(path, None)
    extras = _extra_floor_models(path) if extra else []
    floors: dict[str, tuple[int, dict[str, tuple[float, float]], list[str]]] = {}
    for cls, engs in _probe_engines(classes, use_optional).items():
        where = [("", path, prompts)] + ([(f" on {spec}", p, None) for spec, p in extras] if cls in EXTRA_FLOOR_CLASSES else [])
        per: dict[str, tuple[float, float]] = {}
        n = 0
        for (label, make), (suffix, p, ps) in ((e, w) for e in engs for w in where):
            comps = _measured(f"probe floor ({cls}): {label}{suffix}", make, p, decode_tokens, log, ps)
            if comps is not None:
                per[label + suffix] = (min(float(np.min(c["cosine"])) for c in comps), max(float(np.max(c["kld"])) for c in comps))
                n += len(comps)
        if cls == "f32":
            main = list(max(prompts, key=len))[:MAIN_TOKENS]
            pm = metrics.position_metrics(gather(_llama(path).logits(main), len(main)), gather(_llama(path, n_ubatch=7).logits(main), len(main)))
            per["llama.cpp n_ubatch 7 vs default"] = (float(np.min(pm["cosine"])), float(np.max(pm["kld"])))
            n += 1
        floors[cls] = (n, per, [str(path)] + [spec for spec, _ in extras if cls in EXTRA_FLOOR_CLASSES])
    out = {}
    for cls in classes:
        members = CLASS_MEMBERS[cls]
        per = {label: w for c in members for label, w in floors[c][1].items()}
        out[cls] = propose_probes(min((c for c, _ in per.values()), default=1.0), max((k for _, k in per.values()), default=0.0), cls)
        for v in out[cls].values():
            v["models"] = list(dict.fromkeys(m for c in members for m in floors[c][2]))
            v["n"] = sum(floors[c][0] for c in members)
            v["engines"] = per
            v["decode_tokens"] = decode_tokens
    return out


def quantized_weights(weights: str) -> bool:
    """Whether a weights key (``F32+Q4_K+Q6_K``: the sorted tensor types of a file) holds a type
    llama.cpp multiplies through its quantized kernels (any type outside
    ``near_ties.UNQUANTIZED``); a key of float types only keeps the base model's probe floors."""
    from harness.measure.near_ties import UNQUANTIZED

    return not set(weights.split("+")) <= UNQUANTIZED


def weights_probe_files(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Quantized weights key → the model whose llama.cpp probe floor joins that key's rows: the
    first dense (``qwen35``) basis model of any row with the key, else its first basis model. The
    dense file, because on an MoE file an expert-router near-tie moves whole positions when the
    prompt is split (the excursion allowance, ``moe_excursions``, counts those), which is no measure
    of a kernel's rounding. ``rows``: calibrated rows (in memory or thresholds.yaml's) with
    ``weights`` and ``basis_models`` (``name``, ``arch``)."""
    found: dict[str, list[tuple[bool, str]]] = {}
    for r in rows:
        if quantized_weights(r["weights"]):
            found.setdefault(r["weights"], []).extend((m.get("arch") != "qwen35", m["name"]) for m in r.get("basis_models") or ())
    return {w: min(c, key=lambda m: m[0])[1] for w, c in found.items() if c}


def weights_probe_floors(files: dict[str, str], base: dict[str, dict[str, dict[str, Any]]], log: Callable[[str], None],
                         decode_tokens: int | None = None) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """Probe tolerances per quantized weights key: for every class of ``base`` (``probe_floors``'
    result on the F32 base model) whose members include ``f32``, the base floor joined by the
    llama.cpp family's own split and decode floor (``_self_comparisons``: llama.cpp at its defaults,
    at n_ubatch 7, at 1 thread, with extra buffer types where this CPU runs them) on ``files[key]``.

    Why: llama.cpp's products on quantized weights round the activations to 8 bits for the
    quantized dot product and take another kernel for a batch than for one token, so a correct
    engine fed the same tokens in other pieces (a split, a decode, a prefix served from a cache)
    moves by more than on F32 weights: the reference itself, through the example engine, gave
    cosine 0.99998388 on ``trained-qwen35-256-Q4_K_M`` against the F32 tolerance 0.999988 (the
    conformance page's serving probe; docs/gates.md, "Probe tolerances on quantized files"). The
    engines that dequantize to float (oracle, transformers, mlx) are batch-independent there, and
    their floors are the base's. Returns ``{weights: {class: {"min_cosine", "max_kld"}}}`` in
    ``probe_floors``' form (``models`` gains the file); a file no engine could load is logged and
    left out (its rows keep the base floors)."""
    from harness.fixtures.resolve import resolve_model
    from harness.runs.probes import DECODE_TOKENS

    decode_tokens = decode_tokens or DECODE_TOKENS
    engines = _probe_engines(["f32"], False)["f32"]
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for weights, spec in files.items():
        path = resolve_model(spec)
        per: dict[str, tuple[float, float]] = {}
        n = 0
        for label, make in engines:
            comps = _measured(f"probe floor on {weights}: {label} on {spec}", make, path, decode_tokens, log)
            if comps is not None:
                per[f"{label} on {spec}"] = (min(float(np.min(c["cosine"])) for c in comps), max(float(np.max(c["kld"])) for c in comps))
                n += len(comps)
        if not per:
            continue
        cos, kld = min(c for c, _ in per.values()), max(k for _, k in per.values())
        out[weights] = {}
        for cls, pr in base.items():
            if "f32" not in CLASS_MEMBERS[cls]:
                continue
            prop = propose_probes(min(cos, pr["min_cosine"]["floor"]), max(kld, pr["max_kld"]["floor"]), cls)
            for name, v in prop.items():
                old = pr[name]
                v.update(models=[*old.get("models", []), spec], n=old.get("n", 0) + n, engines={**old.get("engines", {}), **per},
                         decode_tokens=decode_tokens)
            out[weights][cls] = prop
    return out


def moe_excursions(specs: Sequence[str], bounds: dict[str, dict[str, Any]], use_optional: bool, log: Callable[[str], None],
                   decode_tokens: int | None = None) -> dict[str, Any]:
    """The excursion allowance of probes on MoE models: on each MoE model of ``specs``, every f32
    probe engine's split and decode comparisons (``_self_comparisons``) counted for positions
    outside ``bounds`` (the f32 class's probe tolerances, ``propose_probes``); the allowance is
    ``MOE_EXCURSION_MARGIN`` × the largest count, at least ``MOE_EXCURSION_MIN``. Returns
    ``{"value", "floor" (largest count), "n" (comparisons), "engines" ({"label on model": count}),
    "min_cosine" (the lowest cosine among them), "model" (the specs, comma-joined)}``."""
    from harness.fixtures.resolve import resolve_model
    from harness.runs.probes import DECODE_TOKENS, ProbeTolerance, outside

    decode_tokens = decode_tokens or DECODE_TOKENS
    tol = ProbeTolerance(min_cosine=bounds["min_cosine"]["value"], max_kld=bounds["max_kld"]["value"])
    counts, n, low, skipped = {}, 0, 1.0, []
    for spec, (label, make) in ((s_, e) for s_ in specs for e in _probe_engines(["f32"], use_optional)["f32"]):
        label = f"{label} on {spec}"
        comps = _measured(f"MoE router excursions: {label}", make, resolve_model(spec), decode_tokens, log)
        if comps is None:
            skipped.append(label)
            continue
        counts[label] = max(int(outside(c, tol).sum()) for c in comps)
        low = min([low] + [float(np.min(c["cosine"])) for c in comps])
        n += len(comps)
    worst = max(counts.values())
    return {"value": max(MOE_EXCURSION_MIN, MOE_EXCURSION_MARGIN * worst), "floor": worst, "n": n, "engines": counts,
            "min_cosine": low, "decode_tokens": decode_tokens, "model": ", ".join(specs), "skipped": skipped}


def localization_bounds(path: Path, tokens: list[int]) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """Per-tensor bounds from llama.cpp (F32) against the oracle, and the oracle's activations."""
    oracle_acts = _oracle(path).activations(tokens)
    rows = metrics.compare_activations(oracle_acts, _llama(path).activations(tokens))
    ok_rows = [r for r in rows if r["status"] == "ok"]
    nm_floor = max(r["nmse"] for r in ok_rows)
    cos_floor = min(r["cosine"] for r in ok_rows)
    return {
        "localize_max_nmse": {"value": _round_up(max(100 * nm_floor, 1e-6)), "floor": nm_floor, "n": len(ok_rows)},
        "localize_min_cosine": {"value": round(1 - _round_up(max(100 * (1 - cos_floor), 1e-4)), 8), "floor": cos_floor, "n": len(ok_rows)},
    }, oracle_acts


def measure_mutants(plan: CalibrationPlan, base: ModelMeasurement, moe: ModelMeasurement | None, ptol, localization,
                    oracle_acts: dict[str, np.ndarray], log: Callable[[str], None]) -> tuple[list[PairStats], list[str]]:
    """Every mutant vs llama.cpp on the F32 trained model of its arch, with the probes and
    first-divergence localization it trips."""
    from harness.engines.mutants import MUTANTS
    from harness.engines.registry import resolve_engine
    from harness.model.gguf_model import GGUFModel
    from harness.runs.localize import localize_activations
    from harness.runs.probes import probe_decode, probe_determinism, probe_split

    bads, skipped = [], []
    loc_tokens = base.prompts[0][:96]
    for name in plan.mutants or tuple(MUTANTS):
        m = MUTANTS[name]
        use_moe = "qwen35" not in m.archs
        if use_moe and moe is None:
            skipped.append(f"mutant:{name}: needs a qwen35moe model ({plan.moe_model} unavailable)")
            continue
        mm = moe if use_moe else base
        log(f"  bad: mutant:{name} vs llama.cpp on {mm.spec}")
        eng = resolve_engine(f"mutant:{name}", mm.path)
        # judged as parity judges it: on an MoE model, positions the release gate excuses are left out
        p = measure_pair(f"mutant:{name}", False, mm.spec, mm.ref, eng, mm.prompts,
                         excuses=release_excuses(GGUFModel(mm.path).hparams, log))
        p.weights = mm.weights
        p.extra["arch"] = mm.dims["arch"]
        toks = max(mm.prompts, key=len)[:160]
        split, decode = probe_split(eng, toks, ptol), probe_decode(eng, toks[:48], ptol)
        p.extra["probe_split"], p.extra["probe_split_worst"] = split.verdict is Verdict.FAIL, _worst(split)
        p.extra["probe_decode"], p.extra["probe_decode_worst"] = decode.verdict is Verdict.FAIL, _worst(decode)
        p.extra["probe_determinism"] = probe_determinism(eng, toks[:64]).verdict is Verdict.FAIL
        o_acts = oracle_acts if mm is base else _oracle(mm.path).activations(loc_tokens)
        loc = localize_activations(GGUFModel(mm.path).hparams, o_acts, eng.activations(loc_tokens),
                                   localization["localize_max_nmse"]["value"], localization["localize_min_cosine"]["value"])
        p.extra["localize"] = loc.first is not None
        p.extra["first_divergence"] = loc.first.name if loc.first else None
        bads.append(p)
    return bads, skipped


def measure_topk_pair(label: str, good: bool, model: str, ref: CachedReference, cand, prompts: list[list[int]], k: int) -> PairStats:
    """``cand``'s full logits cut to their top ``k`` (``topk.cut_topk``, what a server giving k
    logprobs would send) against the cached reference: per-prompt top-k KLDs (``min_cosine`` NaN:
    not computable from top-k)."""
    from harness.measure import topk

    klds = []
    for toks in prompts:
        pm = topk.topk_position_metrics(ref.get(toks), topk.cut_topk(gather(cand.logits(toks), len(toks)), k))
        klds.append(np.where(pm["finite"], pm["kld"], np.inf))
    allk = np.concatenate(klds)
    return PairStats(label, good, model, math.nan, float(np.mean(allk)), float(np.quantile(allk, 0.99)),
                     np.zeros(len(prompts)), klds, compute_class=cand.info.compute_class or "f64")
