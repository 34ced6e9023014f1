"""Self-consistency probes on one engine: the same prompt fed in other ways gives the same logits.

Many real Qwen3.5 bugs only show when a prompt is fed in pieces (conv state, recurrent state and
KV cache carried between calls), in other micro-batch sizes, or beside other sequences. Each probe
compares an engine with itself (or, for ``long``, with the reference) and returns PASS, FAIL (with
the first differing position and the max KLD) or UNMEASURED (the engine lacks the capability).

Probes (tolerances from thresholds.yaml ``probes:``, each with a basis):

- ``split``: whole vs two pieces split at 1, 2, 3, 4, 5, 63, 64, 65 (conv kernel and the chunked
  delta rule's 64-token chunk boundary) and seeded random points; needs ``chunks``.
- ``decode``: a prefill of k tokens, then the rest one token at a time, vs whole; needs ``chunks``.
- ``ubatch``: n_ubatch ∈ {1, 2, 7, 64, 512} vs the engine's default; needs ``with_settings``.
- ``multiseq``: N identical prompts decoded together equal the solo run; N distinct prompts each
  equal their solo run; needs ``logits_multi``.
- ``determinism``: the same input twice gives bit-identical logits.
- ``long``: ≥ 1,024 positions against the reference with the parity gate; reports the first
  position where the gate fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from harness.compare import metrics
from harness.compare.inputs import RunRequest
from harness.engines.base import Engine, gather
from harness.engines.timing import timed
from harness.errors import InvalidInput, Verdict
from harness.evidence.receipts import harness_info, host_info
from harness.evidence.record import record_evidence

SPLIT_POINTS = (1, 2, 3, 4, 5, 63, 64, 65)
UBATCH_SIZES = (1, 2, 7, 64, 512)
PROBE_NAMES = ("split", "decode", "ubatch", "multiseq", "determinism", "long")
REQUIRED_PROBES = ("split", "decode", "determinism")


@dataclass
class ProbeTolerance:
    """Bounds a probe's comparison must meet: per-position cosine ≥ ``min_cosine`` and KLD ≤
    ``max_kld`` (nats). ``exact`` demands bit-identical logits (determinism)."""

    min_cosine: float = 0.99999
    max_kld: float = 1e-4
    exact: bool = False


@dataclass
class Comparison:
    """One variant compared with its baseline."""

    label: str
    positions: int
    ok: bool
    min_cosine: float | None
    max_kld: float | None
    max_abs_diff: float | None
    first_bad_position: int | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ProbeResult:
    """A probe's verdict with every comparison it made; ``reason`` explains UNMEASURED/FAIL."""

    name: str
    verdict: Verdict
    comparisons: list[Comparison] = field(default_factory=list)
    reason: str = ""

    @property
    def first_failure(self) -> Comparison | None:
        return next((c for c in self.comparisons if not c.ok), None)

    def summary(self) -> str:
        if self.verdict is Verdict.UNMEASURED:
            return self.reason
        f = self.first_failure
        if f is None:
            worst = min((c.min_cosine for c in self.comparisons if c.min_cosine is not None), default=None)
            mk = max((c.max_kld for c in self.comparisons if c.max_kld is not None), default=None)
            return f"{len(self.comparisons)} comparisons; min cosine {worst:.8f}, max KLD {mk:.3g}" if worst is not None else f"{len(self.comparisons)} comparisons"
        return (
            f"{f.label}: first differing position {f.first_bad_position}, min cosine "
            f"{f.min_cosine if f.min_cosine is None else round(f.min_cosine, 8)}, max KLD {f.max_kld if f.max_kld is None else f'{f.max_kld:.3g}'}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict.value, "reason": self.reason, "summary": self.summary(),
                "comparisons": [c.to_dict() for c in self.comparisons]}


def compare(label: str, base: np.ndarray, other: np.ndarray, tol: ProbeTolerance) -> Comparison:
    """Compare two float32 ``[T, V]`` logit arrays under ``tol`` (see ``ProbeTolerance``)."""
    if base.shape != other.shape:
        return Comparison(label, int(base.shape[0]), False, None, None, None, 0)
    n = base.shape[0]
    if tol.exact:
        diff = np.flatnonzero(~np.all((base == other) | (np.isnan(base) & np.isnan(other)), axis=1))
        pm = metrics.position_metrics(base, other)
        max_abs = float(np.nanmax(np.abs(base.astype(np.float64) - other))) if n else 0.0
        return Comparison(label, n, diff.size == 0, _min(pm["cosine"]), _max(pm["kld"]), max_abs, int(diff[0]) if diff.size else None)
    pm = metrics.position_metrics(base, other)
    with np.errstate(invalid="ignore"):
        bad = ~(pm["finite"] & (pm["cosine"] >= tol.min_cosine) & (pm["kld"] <= tol.max_kld))
    idx = np.flatnonzero(bad)
    max_abs = float(np.nanmax(np.abs(base.astype(np.float64) - other))) if n else 0.0
    return Comparison(label, n, idx.size == 0, _min(pm["cosine"]), _max(pm["kld"]), max_abs, int(idx[0]) if idx.size else None)


def _min(a: np.ndarray) -> float | None:
    a = np.asarray(a, np.float64)
    return float(np.nanmin(a)) if a.size and np.isfinite(a).any() else None


def _max(a: np.ndarray) -> float | None:
    a = np.asarray(a, np.float64)
    return float(np.nanmax(a)) if a.size and np.isfinite(a).any() else None


def _verdict(name: str, comps: list[Comparison]) -> ProbeResult:
    return ProbeResult(name, Verdict.PASS if all(c.ok for c in comps) else Verdict.FAIL, comps)


def split_points(n_tokens: int, seed: int = 0, n_random: int = 3) -> list[int]:
    """The split points used for a prompt of ``n_tokens``: the fixed ones that fit, then
    ``n_random`` seeded random points in [1, n_tokens)."""
    pts = [p for p in SPLIT_POINTS if 0 < p < n_tokens]
    rng = np.random.default_rng(seed)
    if n_tokens > 2:
        pts += sorted(int(x) for x in rng.choice(np.arange(1, n_tokens), size=min(n_random, n_tokens - 1), replace=False))
    return sorted(set(pts))


def has_chunks(engine: Engine) -> bool:
    return "chunks" in engine.info.capabilities


def probe_split(engine: Engine, tokens: Sequence[int], tol: ProbeTolerance, seed: int = 0) -> ProbeResult:
    """Whole vs two pieces at each split point (see module docstring)."""
    if not has_chunks(engine):
        return ProbeResult("split", Verdict.UNMEASURED, reason=f"{engine.info.name} cannot take a prompt in pieces (no 'chunks' capability)")
    n = len(tokens)
    whole = gather(engine.logits(tokens), n)
    comps = [compare(f"split at {p}", whole, gather(engine.logits(tokens, chunks=[p, n - p]), n), tol) for p in split_points(n, seed)]
    return _verdict("split", comps)


def probe_decode(engine: Engine, tokens: Sequence[int], tol: ProbeTolerance, prefill: Sequence[int] = (1, 16)) -> ProbeResult:
    """A prefill of k tokens then one token per call, vs whole (for each k in ``prefill``)."""
    if not has_chunks(engine):
        return ProbeResult("decode", Verdict.UNMEASURED, reason=f"{engine.info.name} cannot take a prompt in pieces (no 'chunks' capability)")
    n = len(tokens)
    whole = gather(engine.logits(tokens), n)
    comps = []
    for k in prefill:
        if not 0 < k < n:
            continue
        chunks = [k] + [1] * (n - k)
        comps.append(compare(f"prefill {k} then 1 token per call", whole, gather(engine.logits(tokens, chunks=chunks), n), tol))
    return _verdict("decode", comps)


def probe_ubatch(engine: Engine, tokens: Sequence[int], tol: ProbeTolerance, sizes: Sequence[int] = UBATCH_SIZES) -> ProbeResult:
    """Logits with each n_ubatch in ``sizes`` vs the engine's own setting."""
    with_settings: Callable | None = getattr(engine, "with_settings", None)
    if with_settings is None or "n_ubatch" not in engine.info.capabilities:
        return ProbeResult("ubatch", Verdict.UNMEASURED, reason=f"{engine.info.name} does not expose n_ubatch")
    n = len(tokens)
    base = gather(engine.logits(tokens), n)
    comps = [compare(f"n_ubatch={u}", base, gather(with_settings(n_ubatch=u).logits(tokens), n), tol) for u in sizes]
    return _verdict("ubatch", comps)


def probe_multiseq(engine: Engine, prompts: Sequence[Sequence[int]], tol: ProbeTolerance, n_copies: int = 3) -> ProbeResult:
    """N identical prompts together vs solo; N distinct prompts together vs each solo run."""
    multi: Callable | None = getattr(engine, "logits_multi", None)
    if multi is None or "multi_seq" not in engine.info.capabilities:
        return ProbeResult("multiseq", Verdict.UNMEASURED, reason=f"{engine.info.name} cannot batch several sequences")
    comps = []
    first = list(prompts[0])
    solo = gather(engine.logits(first), len(first))
    together = gather(multi([first] * n_copies), len(first) * n_copies)
    for i in range(n_copies):
        comps.append(compare(f"identical copy {i} of {n_copies}", solo, together[i * len(first) : (i + 1) * len(first)], tol))
    distinct = [list(p) for p in prompts[:n_copies]]
    together = gather(multi(distinct), sum(len(p) for p in distinct))
    off = 0
    for i, p in enumerate(distinct):
        s = gather(engine.logits(p), len(p))
        comps.append(compare(f"distinct prompt {i} beside {len(distinct) - 1} others", s, together[off : off + len(p)], tol))
        off += len(p)
    return _verdict("multiseq", comps)


def probe_determinism(engine: Engine, tokens: Sequence[int]) -> ProbeResult:
    """The same input twice gives bit-identical logits."""
    n = len(tokens)
    a = gather(engine.logits(tokens), n)
    b = gather(engine.logits(tokens), n)
    return _verdict("determinism", [compare("run twice", a, b, ProbeTolerance(exact=True))])


def probe_long(engine: Engine, reference: Engine | None, tokens: Sequence[int], min_cosine: float) -> ProbeResult:
    """≥ 1,024 positions against the reference with the parity gate's cosine; a FAIL names the
    first position where the gate fails."""
    if reference is None:
        return ProbeResult("long", Verdict.UNMEASURED, reason="no reference engine given")
    if len(tokens) < 1024:
        return ProbeResult("long", Verdict.UNMEASURED, reason=f"only {len(tokens)} tokens; the long probe needs >= 1024")
    n = len(tokens)
    ref = gather(reference.logits(tokens), n)
    cand = gather(engine.logits(tokens), n)
    comp = compare(f"{n} positions vs {reference.info.name}", ref, cand, ProbeTolerance(min_cosine=min_cosine, max_kld=float("inf")))
    return _verdict("long", [comp])


def long_tokens(prompts: Sequence[Sequence[int]], n: int = 1024) -> list[int]:
    """Concatenate the prompts (cycling) until at least ``n`` tokens."""
    out: list[int] = []
    while len(out) < n:
        for p in prompts:
            out.extend(p)
    return out


# ---------------------------------------------------------------------------------------------
# The probe run: all probes on one engine, a probe receipt and a ledger row
# ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ProbeRequest(RunRequest):
    """Inputs of ``harness probe`` (``RunRequest``): ``only`` restricts the probes run; the
    ``reference`` is used by the ``long`` probe; ``seed`` draws the probes' random prompts."""

    only: list[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class ProbeRun:
    """Results of a probe run and where its evidence went."""

    results: list[ProbeResult]
    verdict: Verdict
    message: str
    receipt: dict[str, Any]
    receipt_path: Any = None
    ledger_row: dict[str, Any] | None = None


def overall_verdict(results: Sequence[ProbeResult]) -> tuple[Verdict, str]:
    """FAIL if any measured probe failed; UNMEASURED if a required probe (split, decode,
    determinism) was not measured; else PASS."""
    failed = [r.name for r in results if r.verdict is Verdict.FAIL]
    unmeasured = [r.name for r in results if r.verdict is Verdict.UNMEASURED]
    measured = {r.name for r in results if r.verdict is not Verdict.UNMEASURED}
    if failed:
        return Verdict.FAIL, f"failed: {', '.join(failed)}" + (f"; unmeasured: {', '.join(unmeasured)}" if unmeasured else "")
    missing = [n for n in REQUIRED_PROBES if n not in measured]
    if missing:
        return Verdict.UNMEASURED, f"required probes not measured: {', '.join(missing)}"
    return Verdict.PASS, f"all {len(measured)} measured probes pass" + (f"; unmeasured: {', '.join(unmeasured)}" if unmeasured else "")


def run_probes(req: ProbeRequest, progress: Callable[[str], None] | None = None) -> ProbeRun:
    """Run the probes of ``req`` and write a ``harness-probe-receipt/v1`` and a ledger row.

    Raises ``InvalidInput`` (unknown probe, bad inputs, tolerance without basis), ``EngineError``.
    """
    names = list(req.only) or list(PROBE_NAMES)
    unknown = [n for n in names if n not in PROBE_NAMES]
    if unknown:
        raise InvalidInput(f"unknown probe {unknown[0]!r}; probes: {', '.join(PROBE_NAMES)}")
    inputs = req.resolve()
    resolved = inputs.resolved
    tol = ProbeTolerance(min_cosine=float(resolved.gate("min_cosine", "probes").value), max_kld=float(resolved.gate("max_kld", "probes").value))
    engine = timed(lambda: inputs.engine(req.candidate))
    reference = None
    prompts = [p.tokens for p in inputs.tokens()]
    main = max(prompts, key=len)[:160]  # spans the 63/64/65 chunk boundary
    short = main[:80]
    runs: dict[str, Callable[[], ProbeResult]] = {
        "split": lambda: probe_split(engine, main, tol, req.seed),
        "decode": lambda: probe_decode(engine, short, tol),
        "ubatch": lambda: probe_ubatch(engine, main, tol),
        "multiseq": lambda: probe_multiseq(engine, [p[:60] for p in sorted(prompts, key=len, reverse=True)[:3]], tol),
        "determinism": lambda: probe_determinism(engine, main),
        "long": lambda: probe_long(engine, reference_engine(), long_tokens(prompts), resolved.min_cosine),
    }
    def reference_engine() -> Any:
        nonlocal reference
        reference = reference or timed(lambda: inputs.engine(req.reference))
        return reference

    results = []
    for n in names:
        if progress:
            progress(n)
        results.append(runs[n]())
    verdict, message = overall_verdict(results)
    ref_info = None
    if "long" in names:
        ref_info = reference_engine().info.to_dict()
    cosines = [c.min_cosine for r in results for c in r.comparisons if c.min_cosine is not None]
    kinds = {resolved.gate(g, "probes").basis_kind for g in ("min_cosine", "max_kld")}
    receipt = {
        "schema": "harness-probe-receipt/v1",
        "kind": "probe",
        "host": host_info(),
        "harness": harness_info(),
        "command": list(req.argv) or ["harness", "probe"],
        "model": inputs.model_record(),
        "engines": {"candidate": engine.info.to_dict(), "reference": ref_info},
        "prompts": {"path": str(inputs.prompt_set.path), "main_tokens": main},
        "thresholds": resolved.to_receipt(),
        "probes": [r.to_dict() for r in results],
        "verdict": verdict.value,
        "message": message,
        "positions": sum(c.positions for r in results for c in r.comparisons),
        "min_cosine": min(cosines) if cosines else None,
        "basis_kind": "measured" if kinds == {"measured"} else "declared",
        "unmeasured": [r.name for r in results if r.verdict is Verdict.UNMEASURED],
        "timings": {"candidate": engine.timings(), "reference": reference.timings() if reference else None},
    }
    if not req.write_evidence:
        return ProbeRun(results, verdict, message, receipt)
    rec = record_evidence(receipt, {}, req.ledger)
    return ProbeRun(results, verdict, message, rec.receipt, rec.receipt_path, rec.row)
