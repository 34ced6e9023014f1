"""Self-consistency probes on one engine: the same prompt fed in other ways gives the same logits.

Many real Qwen3.5 bugs only show when a prompt is fed in pieces (conv state, recurrent state and
KV cache carried between calls), in other micro-batch sizes, or beside other sequences. Each probe
compares an engine with itself (or, for ``long``, with the reference) and returns PASS, FAIL (with
the first differing position and the max KLD) or UNMEASURED (the engine lacks the capability).

Probes (tolerances from thresholds.yaml ``probes:``, each with a basis):

- ``split``: whole vs two pieces split at 1, 2, 3, 4, 5, 63, 64, 65 (conv kernel and the chunked
  delta rule's 64-token chunk boundary) and seeded random points; needs ``chunks``.
- ``decode``: a prefill of k tokens, then the rest one token at a time, vs whole, over
  ``decode_tokens`` tokens (default ``DECODE_TOKENS``: a state kept in too low a precision between
  calls drifts slowly and fails only after a few hundred calls); needs ``chunks``. The receipt's
  ``long_decode`` row states its length and outcome.
- ``ubatch``: n_ubatch ∈ {1, 2, 7, 64, 512} vs the engine's default; needs ``with_settings``
  (capability ``n_ubatch``).
- ``multiseq``: N identical prompts decoded together equal the solo run; N distinct prompts each
  equal their solo run; needs ``logits_multi`` (capability ``multi_seq``).
- ``prefix``: A+B fed in a session with a checkpoint after A, then C forked from that
  checkpoint, equals A+C fed fresh; and D continued after A+B equals A+B+D fresh; needs
  ``session_logits`` (capability ``prefix_reuse``): a server's prompt-cache reuse.
- ``determinism``: the same input twice gives bit-identical logits.
- ``long``: ``LONG_TOKENS`` (8,192) positions by default, ``--long-tokens`` up to 32,768, capped at
  the model's declared ``context_length`` (at least 1,024), against the reference with the parity
  gate, both engines' logits compared block by block as they stream; reports the first position
  where the gate fails.

A failed probe run by ``run_probes`` carries a reproducer line (``probe_failure``, through
``harness.judge.reproducer``): the first failing comparison and its bounds, candidate, model
sha256, prompt, n_tokens, the chunks it fed, the bug classes of the mutants that break the probe's
contract obligation (``PROBES``), and the ``harness probe --only NAME`` command that reruns it; a
failure of a prompt fed in pieces also names the ``harness localize ... --chunks`` command at the
failing boundary (``localize_hint``), since ``localize`` fed whole cannot see a between-call fault.

Every optional capability a probe needs is checked in ``engine.info.capabilities``: an engine that
does not declare it gets UNMEASURED for that probe, never a PASS by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from harness.engines.base import Engine, checked_blocks, gather, last_row
from harness.engines.llama_server import SERVE_CAPABILITY
from harness.engines.timing import timed
from harness.errors import EngineError, InvalidInput, Unmeasured, Verdict
from harness.evidence.receipts import harness_info, host_info, prepare_receipt
from harness.evidence.record import preflight_evidence, record_evidence
from harness.judge.calibrated import MeasureTier, resolve_row
from harness.judge.reproducer import Reproducer, causes_breaking, chunks_arg, chunks_up_to, failure_message
from harness.judge.thresholds import ResolvedThresholds
from harness.measure import metrics
from harness.measure.prompts import PromptTokens
from harness.runs.inputs import RunInputs, RunRequest, engine_record, subject_of
from harness.runs.explain import explain
from harness.runs.probe_types import Comparison, ProbeResult, ProbeTolerance, _max, _min, compare, compare_streams, outside  # noqa: F401 (re-exported)
from harness.runs.spec_acceptance import AcceptanceGate, gate_case
from harness.runs.spec_given import _spec_checked, given_cases, judge_case, run_given  # noqa: F401 (_spec_checked re-exported)

SPLIT_POINTS = (1, 2, 3, 4, 5, 63, 64, 65)
MAIN_TOKENS = 160
"""Tokens of the longest prompt the split, ubatch and determinism probes feed (past 65)."""
UBATCH_SIZES = (1, 2, 7, 64, 512)
DECODE_TOKENS = 640
"""Tokens the decode probe feeds one per call unless told otherwise (``--decode-tokens``). On the
default model a recurrent state rounded to bf16 every 8th call first leaves a tolerance of
cosine 0.999999 / KLD 1e-6 at position 528; 640 leaves a margin over that. The f64 class's
tolerance (1 − cosine 1e-8, KLD 1e-9) sees it at position 8 (``tests/test_state_faults.py``).
Calibration measures every class's probe floor over this many decode calls (``harness calibrate
--probes``): llama.cpp's own 640-token decode drifts to 1 − cosine 4.0e-7 and KLD 1.4e-5 on the
default model (6.1e-7 on ``fixture:tiny-qwen35``; KLD 3.2e-5 at one thread), so the f32 class's
tolerance (1 − cosine 1.3e-5, KLD 1.6e-3) is above what a bf16 or f16 state does to an exact
engine on the default model (at most 1 − cosine 1.2e-6, KLD 8.5e-6). The state probe
(``fixture:state-qwen35``) is what catches it; docs/engine-protocol.md states the limit."""


@dataclass(frozen=True)
class ProbeKind:
    """What a probe's failure means: ``obligation``, the contract obligation it breaks
    (contracts/qwen35-e2e-verification-v1.yaml), whose mutants' bug classes are the likely cause;
    ``if_fails``, what to look at when no mutant (or too many) match."""

    obligation: str | None
    if_fails: str


PROBES = {
    "split": ProbeKind("QE2E-PRB-005", "conv state (the last conv_kernel - 1 inputs) or recurrent state dropped or reset between calls"),
    "decode": ProbeKind("QE2E-PRB-006", "the single-token (decode) path carries state differently from the prefill path"),
    "ubatch": ProbeKind(None, "a kernel chosen by micro-batch size computes differently, or state is handed between micro-batches wrongly"),
    "multiseq": ProbeKind(None, "sequences share or overwrite each other's KV cache or recurrent state, or their positions are mixed"),
    "prefix": ProbeKind(None, "a prompt-cache checkpoint restores another position's or sequence's recurrent/conv state or KV cache"),
    "determinism": ProbeKind("QE2E-DET-002", "thread-count or atomic-order dependent reductions, uninitialised buffers, or state left from the previous call"),
    "long": ProbeKind("QE2E-PAR-001", "the first op that leaves the oracle, which harness localize with this candidate and model names"),
    "state": ProbeKind("QE2E-STATE-009", "a buffer kept in too narrow a format: the recurrent state rounded (e.g. to bf16) between "
                       "calls, or attention computed in bf16 in multi-token calls, while the engine declares a wider class"),
    "serving": ProbeKind(None, "the engine's serving state handling: a reused slot, a prefix-cache hit, a sequence joining a running "
                         "batch or a continued conversation hands a request another request's state, or the wrong position's"),
    "speculative": ProbeKind("QMTP-SPEC-005", "the state after a verification batch is not rolled back to the last accepted token "
                             "(recurrent S, conv state or KV kept from rejected drafts), or a step reads another draft's state"),
}
"""Probe name → ``ProbeKind``, in the order ``harness probe`` runs them."""
CHECKS = {
    "QMTP-ACCEPT-011": ProbeKind("QMTP-ACCEPT-011", "the head drafts from the wrong state (another sequence's or a stale hidden "
                                "state, its own K/V not kept), or its weights or norms are wrong (4-bit head weights, a norm not "
                                "applied): harness parity --mtp judges its logits"),
}
"""Obligation → ``ProbeKind`` of a check inside a probe that is not the probe's own
(``Comparison.obligation``): the speculative probe's acceptance gate. A failing comparison of one
takes its likely cause from it (``probe_failure``)."""
PROBE_NAMES = tuple(PROBES)
REQUIRED_PROBES = ("split", "decode", "determinism")



def _verdict(name: str, comps: list[Comparison], tol: ProbeTolerance) -> ProbeResult:
    if tol.exact:
        bounds = "bit-identical"
    else:
        bounds = f"cosine >= {tol.min_cosine}" + (f", KLD <= {tol.max_kld}" if np.isfinite(tol.max_kld) else "")
        if tol.excursions:
            bounds += f"; up to {tol.excursions} positions outside that end before the last (MoE router near-ties)"
    return ProbeResult(name, Verdict.PASS if all(c.ok for c in comps) else Verdict.FAIL, comps, bounds=bounds)


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
    comps = []
    for p in split_points(n, seed):
        comps.append(compare(f"split at {p}", whole, gather(engine.logits(tokens, chunks=[p, n - p]), n), tol))
        comps[-1].chunks = [p, n - p]
    return _verdict("split", comps, tol)


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
        comps[-1].chunks = chunks
    return _verdict("decode", comps, tol)


STATE_PREFILL = 16
"""Tokens the state probe feeds in its first call (multi-token: attention's prefill path) before one per call."""


def probe_state(engine: Engine, tokens: Sequence[int], tol: ProbeTolerance, model: str = "") -> ProbeResult:
    """The state probe: ``engine`` loaded on the state fixture (``synthetic.STATE_FIXTURE``), fed
    ``tokens`` (int ids, at least ``STATE_PREFILL`` + 1) whole and as a prefill of
    ``STATE_PREFILL`` then one token per call; per-position cosine and KLD (nats) of the two
    float32 ``[T, V]`` logit blocks against ``tol``, the state row of the candidate's class.

    A recurrent state rounded between calls drifts with every call; attention computed in a
    narrower format in multi-token calls only moves the whole-prompt logits off the one-token
    ones. On this fixture both move the logits ~100x past a correct f32 engine's own drift
    (docs/gates.md, "The state probe"); on the trained default model they stay below it."""
    if not has_chunks(engine):
        return ProbeResult("state", Verdict.UNMEASURED, reason=f"{engine.info.name} cannot take a prompt in pieces (no 'chunks' capability)")
    n = len(tokens)
    if n <= STATE_PREFILL:
        raise InvalidInput(f"the state probe needs more than {STATE_PREFILL} tokens, got {n}")
    chunks = [STATE_PREFILL] + [1] * (n - STATE_PREFILL)
    whole = gather(engine.logits(tokens), n)
    comp = compare(f"{model}: prefill {STATE_PREFILL} then 1 token per call", whole, gather(engine.logits(tokens, chunks=chunks), n), tol)
    comp.chunks = chunks
    return _verdict("state", [comp], tol)


MODEL_FOLDER_SETTINGS = ("folder",)
"""Candidate settings that name the candidate's own converted model: an engine made with one
cannot be loaded on the state fixture, so the state probe is UNMEASURED for it."""


def plan_state(req: "ProbeRequest", inputs: RunInputs) -> Callable[[], ProbeResult]:
    """The state probe as ``run_probes`` runs it: the candidate made again on the state fixture
    (no ``--override-kv``: they are the user's model's), the state row of its class from the
    run's thresholds (``Thresholds.resolve_state``), the shipped prompts tokenized by llama.cpp on
    that fixture and cycled to the row's ``max_tokens``. UNMEASURED, naming why, when no row fits
    the class, the candidate was made on a model folder of its own, or it cannot load the
    fixture."""
    from harness.fixtures.resolve import resolve_model
    from harness.fixtures.synthetic import STATE_FIXTURE
    from harness.engines.registry import resolve_engine
    from harness.model.gguf_model import GGUFModel
    from harness.runs.inputs import subject_of

    name = f"fixture:{STATE_FIXTURE}"

    def run() -> ProbeResult:
        pinned = [k for k in MODEL_FOLDER_SETTINGS if req.candidate_settings.get(k)]
        if pinned:
            return ProbeResult("state", Verdict.UNMEASURED, reason=f"--mlx-{pinned[0].replace('_', '-')} names the candidate's own model; "
                               f"the state probe loads the candidate on {name}")
        path = resolve_model(name)
        try:
            engine = resolve_engine(req.candidate, path, (), **req.candidate_settings)
            info = engine.info
        except (EngineError, InvalidInput) as e:  # InvalidInput: a name only the run's own engine factory knows (tests)
            return ProbeResult("state", Verdict.UNMEASURED, reason=f"{req.candidate} could not be made on {name}: {str(e).splitlines()[0][:200]}")
        if "topk" in info.capabilities:
            return ProbeResult("state", Verdict.UNMEASURED, reason=f"{info.name} gives top-k logprobs, not logits")
        row, why = inputs.thresholds.resolve_state(subject_of(GGUFModel(path), info.to_dict()))
        if row is None:
            return ProbeResult("state", Verdict.UNMEASURED, reason=f"no state row for class {info.compute_class or 'undeclared'}: {why} "
                               f"(measure with: harness calibrate --state)")
        tol = ProbeTolerance(min_cosine=float(row.gates["min_cosine"]["value"]), max_kld=float(row.gates["max_kld"]["value"]))
        toks = decode_prompt([p.tokens for p in inputs.tokens_of(path)], int(row.max_tokens))
        return probe_state(engine, toks, tol, name)

    return run


def probe_ubatch(engine: Engine, tokens: Sequence[int], tol: ProbeTolerance, sizes: Sequence[int] = UBATCH_SIZES) -> ProbeResult:
    """Logits with each n_ubatch in ``sizes`` vs the engine's own setting."""
    with_settings: Callable | None = getattr(engine, "with_settings", None)
    if with_settings is None or "n_ubatch" not in engine.info.capabilities:
        return ProbeResult("ubatch", Verdict.UNMEASURED, reason=f"{engine.info.name} does not expose n_ubatch")
    n = len(tokens)
    base = gather(engine.logits(tokens), n)
    comps = [compare(f"n_ubatch={u}", base, gather(with_settings(n_ubatch=u).logits(tokens), n), tol) for u in sizes]
    return _verdict("ubatch", comps, tol)


def probe_multiseq(engine: Engine, prompts: Sequence[Sequence[int]], tol: ProbeTolerance, n_copies: int = 3) -> ProbeResult:
    """N identical prompts together vs solo; N distinct prompts together vs each solo run.
    UNMEASURED without ``multi_seq``, or naming why where the engine raises ``Unmeasured`` (the
    transformers engine where transformers refuses packed sequences)."""
    multi: Callable | None = getattr(engine, "logits_multi", None)
    if multi is None or "multi_seq" not in engine.info.capabilities:
        return ProbeResult("multiseq", Verdict.UNMEASURED, reason=f"{engine.info.name} cannot batch several sequences")
    try:
        return _multiseq(engine, multi, prompts, tol, n_copies)
    except Unmeasured as e:
        return ProbeResult("multiseq", Verdict.UNMEASURED, reason=f"{engine.info.name}: {e}")


def _multiseq(engine: Engine, multi: Callable, prompts: Sequence[Sequence[int]], tol: ProbeTolerance, n_copies: int) -> ProbeResult:
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
    return _verdict("multiseq", comps, tol)


def probe_prefix(engine: Engine, tokens: Sequence[int], tol: ProbeTolerance) -> ProbeResult:
    """Prompt-cache reuse: ``tokens`` cut into A, B, C, D (A half of it, B, C and D a sixth
    each); A+B in a session with a checkpoint after A; C forked from that checkpoint vs A+C fresh;
    D continued after A+B vs A+B+D fresh; A+B itself vs A+B fresh (capability ``prefix_reuse``)."""
    session: Callable | None = getattr(engine, "session_logits", None)
    if session is None or "prefix_reuse" not in engine.info.capabilities:
        return ProbeResult("prefix", Verdict.UNMEASURED, reason=f"{engine.info.name} does not declare prefix reuse (no 'prefix_reuse' capability)")
    n = len(tokens)
    if n < 8:
        return ProbeResult("prefix", Verdict.UNMEASURED, reason=f"only {n} tokens; the prefix probe needs >= 8")
    a, b, c = n // 2, n // 2 + n // 6, n // 2 + 2 * (n // 6)
    A, B, C, D = list(tokens[:a]), list(tokens[a:b]), list(tokens[b:c]), list(tokens[c:])
    comps = []
    ab = gather(session(A + B, session="probe-ab", checkpoints=[a]), a + len(B))
    comps.append(compare("A+B in a session vs fresh", gather(engine.logits(A + B), len(A) + len(B)), ab, tol))
    forked = gather(session(C, session="probe-ac", parent="probe-ab", after=a), len(C))
    comps.append(compare(f"C forked from the checkpoint after A ({a} tokens) vs A+C fresh", gather(engine.logits(A + C), a + len(C))[a:], forked, tol))
    cont = gather(session(D, session="probe-ab", parent="probe-ab", after=a + len(B)), len(D))
    comps.append(compare(f"D continued after A+B ({a + len(B)} tokens) vs A+B+D fresh", gather(engine.logits(A + B + D), a + len(B) + len(D))[a + len(B):],
                         cont, tol))
    drop: Callable | None = getattr(engine, "drop_sessions", None)
    if drop is not None:
        drop()
    return _verdict("prefix", comps, tol)


def probe_determinism(engine: Engine, tokens: Sequence[int]) -> ProbeResult:
    """The same input twice gives bit-identical logits."""
    n = len(tokens)
    a = gather(engine.logits(tokens), n)
    b = gather(engine.logits(tokens), n)
    exact = ProbeTolerance(exact=True)
    return _verdict("determinism", [compare("run twice", a, b, exact)], exact)


LONG_TOKENS = 8192
"""Positions the long probe feeds unless told otherwise (``--long-tokens``, up to 32,768 and more),
capped at the model's declared ``context_length`` (the 4,096-context fixtures get 4,096; the
``-32k`` fixtures, ``harness.fixtures.synthetic.LONG_CONTEXT_FIXTURES``, the full 8,192): past
about 2K tokens llama.cpp has given token soup (#29183), lost the oldest context (#27556) and
dropped digits at about 19K (#21681). Cost and peak memory per length: docs/benchmarks.md
section 12 (``benchmarks/bench_long.py``)."""
LONG_MIN_TOKENS = 1024
"""Fewer positions than this (a model declaring a shorter context) leave the long probe UNMEASURED."""


def long_length(requested: int, context_length: int) -> int:
    """The positions the long probe feeds: ``requested``, capped at the model's declared
    ``context_length`` (0: none declared, no cap). An engine may refuse a prompt longer than the
    file declares (llama-server sizes its context from it), which would judge the file, not the
    engine."""
    return min(requested, context_length) if context_length > 0 else requested


def probe_long(engine: Engine, reference: Engine | None, tokens: Sequence[int], min_cosine: float) -> ProbeResult:
    """≥ ``LONG_MIN_TOKENS`` positions against the reference with the parity gate's cosine; a FAIL
    names the first position where the gate fails. The two engines' logit blocks are compared as
    they stream (``compare_streams``): the probe holds one block of each and ``[T]`` metrics, never
    ``[T, V]`` (at Qwen3.5's vocabulary 1 MB a position: 32 GB at 32,768). Raises ``EngineError``
    when the reference returns a non-finite logit (the reference failed, not the candidate)."""
    if reference is None:
        return ProbeResult("long", Verdict.UNMEASURED, reason="no reference engine given")
    if len(tokens) < LONG_MIN_TOKENS:
        return ProbeResult("long", Verdict.UNMEASURED, reason=f"only {len(tokens)} tokens; the long probe needs >= {LONG_MIN_TOKENS}")
    n = len(tokens)
    ref = _finite_reference(checked_blocks(reference.logits(tokens), n), reference.info.name)
    cand = checked_blocks(engine.logits(tokens), n)
    tol = ProbeTolerance(min_cosine=min_cosine, max_kld=float("inf"))
    return _verdict("long", [compare_streams(f"{n} positions vs {reference.info.name}", ref, cand, tol)], tol)


def _finite_reference(blocks: Iterator[np.ndarray], name: str) -> Iterator[np.ndarray]:
    """The reference's blocks, each checked finite as it arrives (``EngineError`` naming the position)."""
    start = 0
    for block in blocks:
        bad = np.flatnonzero(~np.isfinite(block).all(axis=1))
        if bad.size:
            raise EngineError(f"reference {name} returned non-finite logits (NaN or Inf) at position {start + int(bad[0])} "
                              "of the long probe; a reference that fails cannot judge the candidate")
        start += len(block)
        yield block


SPEC_NEAR_TIE = {
    "value": 1e-3,
    "basis": {"kind": "declared", "who": "harness maintainers (speculative vs plain greedy; harness/runs/probes.py)",
              "why": "A divergence of an engine's speculative greedy continuation from its own plain one is excused only "
                     "where the plain path's top-1/top-2 logit margin at that step is below this: a verification batch of "
                     "1 + k tokens runs other kernels (other summation orders) than a one-token decode (llama.cpp #23335), "
                     "which moves a float32 logit by about 1e-5 relative on the MTP fixtures, so only a near-exact tie can "
                     "flip; a state fault moves logits by whole units. Far below the report-only greedy near_tie_margin "
                     "(0.25), so a fault cannot hide behind it.",
              "date": "2026-12-02"},
}
"""The speculative probe's declared near-tie δ (logits) and its basis (recorded in the probe's details)."""
SPEC_TOKENS = 16
"""Tokens each speculative case generates."""
SPEC_DRAFT_MAX = (1, 2, 3, 4)
SPEC_ACCEPTANCE_COUNTS = ("drafts accepted / drafts proposed while generating {n} tokens speculatively, up to {k} drafts a step "
                          "(a chained draft counts only when every draft before it was accepted)")
"""What one case's acceptance counts (its row's ``counts``): not the implied acceptance of
``harness parity --mtp`` (every draft row teacher-forced), nor a trained head's recipe
(docs/engine-protocol.md, "Three acceptance numbers")."""
SPEC_CASES = ("chunked prompt", "two sequences", "reused prefix", "3-token prompt")
"""The speculative probe's cases, in the order it runs them (``probe_speculative``)."""


def has_speculative(engine: Engine) -> bool:
    return ("speculative" in engine.info.capabilities and callable(getattr(engine, "speculative", None))
            and "generate" in engine.info.capabilities)


def compare_speculative(label: str, plain: Sequence[int], spec: Any, margin_at: Callable[[int], float], delta: float,
                        rerun: Callable[[int], Sequence[int]] | None = None) -> tuple[Comparison, dict[str, Any]]:
    """One case: the speculative continuation ``spec`` (``Speculation``) against the plain greedy
    ``plain`` token by token (``harness.runs.spec_given.judge_case``). At the first differing token
    i the plain path's margin ``margin_at(i)`` (top-1 minus top-2 logit after the prompt and
    plain[:i]) decides: at or above ``delta`` FAIL at token i, with the verification step that
    produced it; below, a near-tie, excused, and with ``rerun`` (``rerun(i)``: the engine's
    speculative tokens continuing prompt + plain[:i]) the comparison goes on by teacher forcing the
    plain token; without ``rerun`` it ends there (the row says ``forced: false``). Returns the
    ``Comparison`` and the case's row."""
    return judge_case(label, plain, spec, margin_at, delta, rerun)


def _has_head(engine: Any) -> bool:
    """Whether the engine's model has an MTP (nextn) block: an engine may declare speculative
    generation for every model it runs, and has nothing to draft with on a trunk-only file."""
    hp = getattr(engine, "_hparams", None) or getattr(engine, "hp", None)
    inner = getattr(engine, "engine", None)
    if hp is None and inner is not None:
        return _has_head(inner)
    if callable(hp):
        hp = hp()
    return hp is None or int(getattr(hp, "n_layer_nextn", 0) or 0) > 0


def probe_speculative(engine: Engine, long: Sequence[int], others: Sequence[Sequence[int]], reference: Engine | None = None,
                      n_tokens: int = SPEC_TOKENS, draft_maxes: Sequence[int] = SPEC_DRAFT_MAX, delta: float | None = None,
                      tol: ProbeTolerance | None = None, history: Sequence[int] | None = None, given: bool = True,
                      prompt_ids: Sequence[str] = (), acceptance: tuple[AcceptanceGate | None, str] = (None, "no acceptance gate given"),
                      code: Sequence[Sequence[int]] = (), code_ids: Sequence[str] = ()) -> ProbeResult:
    """Speculative greedy (``Engine.speculative``, drafts from the MTP head) equals the engine's
    own plain greedy (``generate``), step by step, in ``SPEC_CASES``: ``long`` fed in chunks
    [64, 1, rest] with each draft_max in ``draft_maxes``; ``long[:48]`` and ``others[0][:48]`` generated
    together (``speculative_multi``, draft_max 2); a prefix reused from a session (``long[:40]``
    generated with session ``spec-a``, then its last token and ``others[0][:8]`` continued from it,
    draft_max 3) against plain greedy of the whole history fed fresh; a 3-token prompt with draft_max
    2 (a prompt of 1 + k tokens). A divergence is excused only at a near-tie of the plain path's
    margin (< ``delta``, default ``SPEC_NEAR_TIE``). Acceptance over every draft (accepted /
    proposed) is report-only; the first drafts are gated against the reference head's (``acceptance``
    below). After an excused
    near-tie each case goes on by teacher forcing the plain token (the engine restarted on the
    plain prefix, ``compare_speculative`` with ``rerun``). Then, with ``given``, the given-draft
    cases of ``harness.runs.spec_given`` (``given_cases`` on ``long`` and ``history``, every
    prompt cycled; default ``long``): counts checked against the plain path, verify rows against
    the plain rows under ``tol`` (None: those comparisons unmeasured, said in ``details``).
    ``prompt_ids``: the ids of the prompts ``long`` and ``others[0]`` were cut from, which each
    comparison's ``case`` (what it fed: ``Comparison.case``) names. Each case's row counts its
    own acceptance (``SPEC_ACCEPTANCE_COUNTS``). ``acceptance``: (the gate, or None and why not) of
    ``harness.runs.spec_acceptance``: every head-drafted case's first drafts judged against the
    reference head's at the same steps (a FAIL names the case, the step and the token; the case's
    row holds ``acceptance_gate``). ``code``: prompts (``code_ids`` their ids) the head-drafted
    cases run on too, after the run's own (``SPEC_CODE_CASES``).
    UNMEASURED without the ``speculative`` and ``generate`` capabilities. Raises ``EngineError`` for
    malformed output or a refused case (naming it). Long because the cases share the plain
    continuation and the margin lookup defined in it."""
    if not has_speculative(engine):
        return ProbeResult("speculative", Verdict.UNMEASURED,
                           reason=f"{engine.info.name} does not declare speculative generation (capabilities 'speculative' and 'generate')")
    if not _has_head(engine):
        return ProbeResult("speculative", Verdict.UNMEASURED,
                           reason="the model has no MTP (nextn) block to draft with")
    delta = SPEC_NEAR_TIE["value"] if delta is None else float(delta)
    long, other = [int(t) for t in long], [int(t) for t in (others[0] if others else long[::-1])]
    if len(long) < 66:
        return ProbeResult("speculative", Verdict.UNMEASURED, reason=f"only {len(long)} tokens; the speculative probe needs >= 66")
    nv, who = int(engine.n_vocab), engine.info.name
    id0, id1 = (list(prompt_ids) + ["the probe's long prompt", "the probe's second prompt"][len(prompt_ids):])[:2]

    def plain(prompt: Sequence[int], n: int = n_tokens) -> list[int]:
        out = engine.generate(list(prompt), n)  # type: ignore[attr-defined]
        return [int(t) for t in out]

    def margin(prompt: Sequence[int], cont: Sequence[int]) -> Callable[[int], float]:
        def at(i: int) -> float:
            seq = list(prompt) + list(cont[:i])
            return float(metrics.reference_margin(last_row(engine.logits(seq), len(seq)))[0])
        return at

    comps, rows = [], []

    def add(label: str, prompt: Sequence[int], ref: list[int], spec: Any, k: int, source: str, chunks: Sequence[int] | None = None) -> None:
        def rerun(i: int) -> list[int]:
            out = engine.speculative(list(prompt) + ref[:i], n_tokens - i, draft_max=k)  # type: ignore[attr-defined]
            return [int(t) for t in _spec_checked(out, n_tokens - i, k, nv, who).tokens]
        out = _spec_checked(spec, n_tokens, k, nv, who)
        c, r = compare_speculative(label, ref, out, margin(prompt, ref), delta, rerun)
        r["draft_max"] = k
        r["counts"] = SPEC_ACCEPTANCE_COUNTS.format(n=n_tokens, k=k)
        c.case = {"prompt": source, "n_tokens": len(prompt), "chunks": list(chunks) if chunks else None, "generated": n_tokens}
        comps.append(c)
        rows.append(r)
        if c.ok:
            gated = gate_case(label, prompt, ref, out, reference, acceptance)
            r.update(gated[0])
            if gated[1] is not None:
                gated[1].case = c.case
                comps.append(gated[1])

    base: list[int] = []
    given_rows: list[dict[str, Any]] = []

    def chunked_and_pair(first: list[int], second: list[int], ids: tuple[str, str], on: str = "") -> list[int]:
        chunks = [64, 1, len(first) - 65]
        cont = plain(first)
        for k in draft_maxes:
            add(f"chunked prompt {chunks}, sequence 0, draft_max {k}{on}", first, cont, engine.speculative(first, n_tokens, draft_max=k, chunks=chunks), k,  # type: ignore[attr-defined]
                ids[0], chunks)
        pair = [first[:48], second[:48]]
        multi = getattr(engine, "speculative_multi", None)
        if callable(multi):
            outs = multi(pair, n_tokens, draft_max=2)
            if not isinstance(outs, list) or len(outs) != 2:
                raise EngineError(f"{who} answered {type(outs).__name__} for two sequences generated together")
            for i, q in enumerate(pair):
                add(f"two sequences together, sequence {i}, draft_max 2{on}", q, plain(q), outs[i], 2, ids[i])
        return cont

    def run_cases() -> None:
        base[:] = chunked_and_pair(long, other, (id0, id1))
        a = long[:40]
        first = _spec_checked(engine.speculative(a, 8, draft_max=3, session={"id": "spec-a"}), 8, 3, nv, who)  # type: ignore[attr-defined]
        hist = a + [int(t) for t in first.tokens[:-1]]
        tail = [int(first.tokens[-1])] + other[:8]
        cont = engine.speculative(tail, n_tokens, draft_max=3, session={"id": "spec-b", "parent": "spec-a", "after": len(hist)})  # type: ignore[attr-defined]
        add(f"reused prefix ({len(hist)} tokens from session spec-a), sequence 0, draft_max 3", hist + tail, plain(hist + tail), cont, 3,
            f"{id0}[:40] + 7 generated by session spec-a, then its last token and {id1}[:8]", [len(hist), len(tail)])
        three = long[:3]
        add("3-token prompt (1 + k tokens), sequence 0, draft_max 2", three, plain(three), engine.speculative(three, n_tokens, draft_max=2), 2,  # type: ignore[attr-defined]
            id0)
        drop = getattr(engine, "drop_sessions", None)
        if callable(drop):
            drop()
        if len(code) >= 2 and min(len(code[0]), len(code[1])) >= 66:
            cids = (list(code_ids) + ["code prompt 0", "code prompt 1"])[:2]
            chunked_and_pair([int(t) for t in code[0][:len(long)]], [int(t) for t in code[1]], (cids[0], cids[1]), ", code prompts")
        if given:
            cases, short = given_cases(long, history if history is not None else long, id0)
            run_given(engine, cases, plain, delta, tol, (comps, given_rows))
            if short:
                given_rows.append({"unmeasured": f"no case across cells {short}: the history has only {len(history or long)} tokens"})
    error = None
    try:
        run_cases()
    except EngineError as e:  # the cases judged so far are kept: the receipt records them beside the error
        error = f"the engine failed after {len(comps)} comparisons, which are kept: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    details = {"near_tie": {"delta": delta, **({"basis": SPEC_NEAR_TIE["basis"]} if delta == SPEC_NEAR_TIE["value"] else {})},
               "cases": rows, "report_only": ["cases[].acceptance"], "given": given_rows}
    bounds = (f"speculative greedy = plain greedy; a divergence excused only at a plain-path margin < {delta:g}; "
              + (f"first-draft acceptance dropping at most {acceptance[0].max_drop:g} below the reference head's "
                 f"(judged where it hits >= {acceptance[0].min_reference})" if acceptance[0] else "first-draft acceptance unmeasured"))
    if error is not None and all(c.ok for c in comps):
        return ProbeResult("speculative", Verdict.ENGINE_ERROR, comps, reason=error, bounds=bounds, details=details)
    return ProbeResult("speculative", Verdict.PASS if all(c.ok for c in comps) else Verdict.FAIL, comps,
                       reason=error or "", bounds=bounds, details=details)


def decode_prompt(prompts: Sequence[Sequence[int]], n: int = DECODE_TOKENS) -> list[int]:
    """The ``n`` tokens the decode probe feeds: the longest prompt's first ``n``, or every prompt
    cycled (``long_tokens``) when the longest is shorter. Calibration measures the decode floor on
    the same tokens."""
    first = list(max(prompts, key=len))
    return first[:n] if len(first) >= n else long_tokens(prompts, n)[:n]


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
    measure_tier: MeasureTier | None = None
    candidate_settings: dict[str, Any] = field(default_factory=dict)
    decode_tokens: int = DECODE_TOKENS
    long_tokens: int = LONG_TOKENS
    """Positions the long probe feeds (``--long-tokens``), capped at the model's ``context_length``."""
    scenarios: str | None = None
    """The serving probe's scenario file (``--scenarios``; None: the shipped set)."""


@dataclass
class ProbeRun:
    """Results of a probe run and where its evidence went."""

    results: list[ProbeResult]
    verdict: Verdict
    message: str
    receipt: dict[str, Any]
    receipt_path: Any = None
    ledger_row: dict[str, Any] | None = None
    report_path: Any = None
    """The verdict page's ``report.md``, when the run asked for it (``ProbeRequest.report``)."""


def overall_verdict(results: Sequence[ProbeResult], only: Sequence[str] = ()) -> tuple[Verdict, str]:
    """FAIL if any measured probe failed; ENGINE-ERROR if a probe ended at an engine error (the
    comparisons it made before are in its result); UNMEASURED if a required probe was not measured; else
    PASS. Required: the probes named in ``only`` (``harness probe --only``: it judges what it
    names, each of them), or, when ``only`` is empty, ``REQUIRED_PROBES`` (split, decode,
    determinism; the others may stay UNMEASURED). A subset's PASS says so: ``harness signoff``
    still needs every required probe (``covers_required``)."""
    failed = [r.name for r in results if r.verdict is Verdict.FAIL]
    unmeasured = [r.name for r in results if r.verdict is Verdict.UNMEASURED]
    measured = {r.name for r in results if r.verdict is not Verdict.UNMEASURED}
    errored = [r for r in results if r.verdict is Verdict.ENGINE_ERROR]
    if failed:
        return Verdict.FAIL, (f"failed: {', '.join(failed)}" + (f"; engine error in: {', '.join(r.name for r in errored)}" if errored else "")
                              + (f"; unmeasured: {', '.join(unmeasured)}" if unmeasured else ""))
    if errored:
        return Verdict.ENGINE_ERROR, "engine error in: " + "; ".join(f"{r.name} ({r.reason})" for r in errored)
    required = list(dict.fromkeys(only)) or list(REQUIRED_PROBES)
    missing = [n for n in required if n not in measured]
    if missing:
        what = "named probes" if only else "required probes"
        return Verdict.UNMEASURED, f"{what} not measured: {', '.join(missing)}"
    if only:
        rest = [n for n in REQUIRED_PROBES if n not in measured]
        return Verdict.PASS, (f"all {len(measured)} named probes pass (--only {' '.join(required)})"
                              + (f"; a sign-off also needs {', '.join(rest)}" if rest else ""))
    return Verdict.PASS, f"all {len(measured)} measured probes pass" + (f"; unmeasured: {', '.join(unmeasured)}" if unmeasured else "")


def covers_required(receipt: Mapping[str, Any]) -> list[str]:
    """The ``REQUIRED_PROBES`` a probe receipt did not measure (empty: it covers them all): what
    a receipt of ``harness probe --only`` lacks for ``harness signoff``. A probe counts when the
    receipt lists it with a verdict other than UNMEASURED."""
    measured = {p.get("name") for p in receipt.get("probes") or [] if p.get("verdict") not in (None, Verdict.UNMEASURED.value)}
    return [n for n in REQUIRED_PROBES if n not in measured]


TOLERANCED = ("split", "decode", "ubatch", "multiseq", "prefix", "serving")
"""Probes judged by the class's tolerances (determinism is exact; the long probe uses the release gate)."""


def probe_tolerance(resolved: ResolvedThresholds, moe: bool = False) -> ProbeTolerance | None:
    """The probe tolerances of the calibrated row that fits the subject (None: no row fits, so
    the toleranced probes are UNMEASURED, never judged with another class's numbers). ``moe``
    (the model has experts): the measured ``probes.moe_excursions`` allowance applies (none when
    thresholds.yaml has no such entry)."""
    if "min_cosine" not in resolved.probes or "max_kld" not in resolved.probes:
        return None
    excursions = int(resolved.probes["moe_excursions"].value) if moe and "moe_excursions" in resolved.probes else 0
    return ProbeTolerance(min_cosine=float(resolved.probes["min_cosine"].value), max_kld=float(resolved.probes["max_kld"].value),
                          excursions=excursions)


@dataclass
class ProbeCase:
    """One probe as ``run_probes`` runs it: ``run()`` returns its result; ``prompt`` (id, or ids)
    and ``n_tokens`` say what it fed the engine, for the reproducer of a failure; ``tokens`` the
    ids themselves where the receipt records them (decode)."""

    run: Callable[[], ProbeResult]
    prompt: str
    n_tokens: int
    tokens: Sequence[int] = ()
    model: str | None = None
    """The model the probe loads instead of the run's (``fixture:NAME``, without the run's
    ``--override-kv``): the state probe's ``fixture:state-qwen35``; None: the run's model."""


def plan_probes(req: ProbeRequest, resolved: ResolvedThresholds, engine: Engine, reference: Callable[[], Engine], tol: ProbeTolerance | None,
                ptoks: list[PromptTokens], inputs: RunInputs) -> dict[str, ProbeCase]:
    """Every probe on the run's prompts ``ptoks``: split, ubatch, prefix and determinism on the
    longest prompt's first ``MAIN_TOKENS`` (they span the 63/64/65 chunk boundary), decode on its
    first ``req.decode_tokens`` (every prompt cycled when it is shorter), multiseq on the three
    longest prompts' first 60, long (against ``reference()``, made only if it runs, judged by the
    release gate) on every prompt cycled to ``req.long_tokens`` capped at the model's
    ``context_length`` (``long_length``); the speculative probe's history on every prompt cycled to
    1,024 tokens. ``tol`` None (no calibrated row for the
    engine's class): the toleranced probes are UNMEASURED, naming why. A top-k engine
    (capability ``topk``, an ``http:`` server) gets every probe UNMEASURED: no logits."""
    from harness.fixtures.synthetic import STATE_FIXTURE

    first = max(ptoks, key=lambda p: len(p.tokens))
    main = first.tokens[:MAIN_TOKENS]
    if req.decode_tokens < 2:
        raise InvalidInput(f"--decode-tokens {req.decode_tokens}: the decode probe needs at least 2 tokens")
    cycled = len(first.tokens) < req.decode_tokens
    short = decode_prompt([p.tokens for p in ptoks], req.decode_tokens)
    three = sorted(ptoks, key=lambda p: len(p.tokens), reverse=True)[:3]
    side_by_side = [p.tokens[:60] for p in three]
    n_long = long_length(req.long_tokens, int(inputs.model.hparams.context_length or 0))
    long = long_tokens([p.tokens for p in ptoks], n_long)[:n_long]
    min_cosine = resolved.release_min_cosine
    cases = {
        "split": ProbeCase(lambda: probe_split(engine, main, tol, req.seed), first.id, len(main)),
        "decode": ProbeCase(lambda: probe_decode(engine, short, tol), "every prompt, cycled" if cycled else first.id, len(short), short),
        "ubatch": ProbeCase(lambda: probe_ubatch(engine, main, tol), first.id, len(main)),
        "multiseq": ProbeCase(lambda: probe_multiseq(engine, side_by_side, tol), ", ".join(p.id for p in three), sum(map(len, side_by_side))),
        "prefix": ProbeCase(lambda: probe_prefix(engine, main, tol), first.id, len(main)),
        "determinism": ProbeCase(lambda: probe_determinism(engine, main), first.id, len(main)),
        "long": ProbeCase(lambda: _with_length(probe_long(engine, reference(), long, min_cosine), req.long_tokens, inputs),
                          "every prompt, cycled", len(long)),
        "state": ProbeCase(plan_state(req, inputs), "every prompt, cycled", 0, model=f"fixture:{STATE_FIXTURE}"),
        "serving": ProbeCase(plan_serving(req, engine, reference, tol, ptoks, inputs, min_cosine),
                             f"scenarios {req.scenarios or 'shipped'}", 0),
        "speculative": ProbeCase(lambda: _speculative(req, resolved, engine, reference, tol, ptoks, inputs), first.id, len(main)),
    }
    if tol is None:
        _unmeasured(cases, TOLERANCED, f"no probe tolerance for {resolved.subject.key_text()} ({resolved.row_misfit})")
    if "topk" in engine.info.capabilities:  # a server (http:NAME): the probes compare logits it cannot give
        served = SERVE_CAPABILITY in engine.info.capabilities  # llama-server: its serving is judged on its top-k rows
        _unmeasured(cases, [c for c in cases if not (served and c == "serving")], f"{engine.info.name} gives top-k logprobs, not logits")
    return cases


def _speculative(req: ProbeRequest, resolved: ResolvedThresholds, engine: Engine, reference: Callable[[], Engine], tol: ProbeTolerance | None,
                 ptoks: list[PromptTokens], inputs: RunInputs) -> ProbeResult:
    """The speculative probe as ``plan_probes`` runs it: on the run's prompts (the longest's first
    ``MAIN_TOKENS`` and the next longest) and the shipped code prompts (``CODE_PROMPTS``, the two
    longest, tokenized as the run's), the acceptance gate from ``resolved.probes``
    (``harness.runs.spec_acceptance.gate_from``), the history of every prompt cycled."""
    from harness.measure.code_prompts import CODE_PROMPTS
    from harness.measure.prompts import load_prompt_set
    from harness.runs.spec_acceptance import gate_from

    first = max(ptoks, key=lambda p: len(p.tokens))
    three = sorted(ptoks, key=lambda p: len(p.tokens), reverse=True)[:3]
    ref = reference() if has_speculative(engine) else None
    code = sorted(inputs.tokens(ref, load_prompt_set(CODE_PROMPTS)), key=lambda p: len(p.tokens), reverse=True)[:2] if ref is not None else []
    return probe_speculative(engine, first.tokens[:MAIN_TOKENS], [p.tokens for p in three[1:]] or [first.tokens[:MAIN_TOKENS][::-1]], ref,
                             tol=tol, history=long_tokens([p.tokens for p in ptoks]),
                             prompt_ids=[first.id, three[1].id if len(three) > 1 else f"{first.id}, reversed"],
                             acceptance=gate_from(resolved.probes), code=[p.tokens for p in code], code_ids=[p.id for p in code])


def _with_length(result: ProbeResult, requested: int, inputs: RunInputs) -> ProbeResult:
    """The long probe's result with ``details`` naming the positions asked for (and the default,
    ``LONG_TOKENS``), the model's declared ``context_length`` and the positions fed (fewer when the file declares a shorter context)."""
    ctx = int(inputs.model.hparams.context_length or 0)
    result.details = {**result.details, "requested_positions": requested, "default_positions": LONG_TOKENS, "context_length": ctx,
                      "positions": long_length(requested, ctx)}
    if result.verdict is Verdict.UNMEASURED and ctx and ctx < min(requested, LONG_MIN_TOKENS):
        result.reason += f" (the model declares context_length {ctx})"
    return result


def plan_serving(req: ProbeRequest, engine: Engine, reference: Callable[[], Engine], tol: ProbeTolerance | None,
                 ptoks: list[PromptTokens], inputs: RunInputs, min_cosine: float) -> Callable[[], ProbeResult]:
    """The serving probe's run (``harness.runs.serving.probe_serving``) on the scenario file of
    ``req`` (read first, so a malformed file is refused before any engine runs: INVALID, exit 2),
    its solo runs judged against ``reference()`` by the release gate."""
    from harness.measure.scenarios import load_scenarios
    from harness.runs.serving import has_serve, probe_serving

    from harness.measure.scenarios import shipped_scenarios_path
    from harness.provenance import sha256_file

    wanted = "serving" in (req.only or PROBE_NAMES)
    scenarios = load_scenarios(req.scenarios) if wanted else []
    path = Path(req.scenarios).resolve() if req.scenarios else shipped_scenarios_path()
    source = {"path": str(path), "sha256": sha256_file(path)} if wanted else None
    ctx = int(inputs.model.hparams.context_length or 0) or None

    def run() -> ProbeResult:
        if SERVE_CAPABILITY in engine.info.capabilities:
            r = _llama_server_serving(engine, ptoks, tol, scenarios, reference, inputs, ctx)
        else:
            r = probe_serving(engine, ptoks, tol, scenarios, reference if has_serve(engine) else None,  # type: ignore[arg-type]
                              min_cosine, ctx)
        r.details = {"scenario_file": source, **r.details} if r.details else r.details
        return r

    return run


def _llama_server_serving(engine: Any, ptoks: list[PromptTokens], tol: ProbeTolerance | None, scenarios: Sequence[Any],
                          reference: Callable[[], Engine], inputs: RunInputs, ctx: int | None) -> ProbeResult:
    """The serving probe of the ``llama-server`` engine: ``harness.runs.http_serving.probe_llama_server``
    on servers it starts (``LlamaServerEngine.fresh_server``, its ``parallel`` slots), each solo
    reply against ``reference()`` by the top-k tier of the class's ``topk`` row (k = 20, the
    ``n_probs`` it asks); UNMEASURED naming what is missing when there is no probe tolerance or no
    top-k row."""
    from harness.runs.http_serving import K, TopkGate, probe_llama_server

    if tol is None:
        return ProbeResult("serving", Verdict.UNMEASURED, reason="no probe tolerance for this model and class")
    served = getattr(engine, "engine", engine)  # the timed wrapper's engine
    row, why = inputs.thresholds.resolve_topk(subject_of(inputs.model, engine.info.to_dict()), K)
    if row is None:
        return ProbeResult("serving", Verdict.UNMEASURED, reason=f"no top-k row judges the solo replies: {why}")
    gate = TopkGate(float(row.gates["max_topk_kld_mean"]["value"]), float(row.gates["max_topk_kld_p99"]["value"]), row.source)
    return probe_llama_server(served.fresh_server, ptoks, tol, scenarios, inputs.model.hparams.n_vocab, served.parallel,
                              reference(), gate, ctx)


def _unmeasured(cases: dict[str, ProbeCase], names: Sequence[str], why: str) -> None:
    """Make each probe of ``names`` in ``cases`` report UNMEASURED with ``why`` (what it would feed kept)."""
    for name in names:
        cases[name] = replace(cases[name], run=lambda name=name: ProbeResult(name, Verdict.UNMEASURED, reason=why))


def probe_failure(result: ProbeResult, case: Reproducer, reference: str, scenarios: str | None = None) -> str:
    """The reproducer line of a failed probe (``harness.judge.reproducer``): the first failing
    comparison and its bounds, the case with the chunks that comparison fed, the bug classes of the
    mutants that break the probe's obligation (the comparison's own where it names one: ``CHECKS``), and the ``harness probe`` command that reruns it."""
    first = result.first_failure
    kind = CHECKS.get(first.obligation or "", PROBES[result.name]) if first is not None else PROBES[result.name]
    numbers = f"probe {result.name} FAIL: {result.summary()} (bounds: {result.bounds})"
    if first is not None and first.case:  # a generation case names what it fed itself
        fed = first.case
        case = replace(case, prompt=fed.get("prompt"), n_tokens=fed.get("n_tokens"), chunks=fed.get("chunks"), generated=fed.get("generated"))
    else:
        case = replace(case, chunks=first.chunks if first is not None else None)
    extra = ["--reference", reference] if result.name in ("long", "serving") else []
    if result.name == "serving" and scenarios:
        extra += ["--scenarios", str(Path(scenarios).resolve())]
    causes = causes_breaking(kind.obligation) if kind.obligation else []
    line = failure_message(numbers, case, causes, kind.if_fails, case.harness("probe", "--only", result.name, *extra))
    hint = localize_hint(case, first)
    return line + (f"; next: {hint}" if hint else "")


def localize_hint(case: Reproducer, first: Comparison | None) -> str | None:
    """The ``harness localize`` command at a failing comparison's boundary: the prompt fed in the
    comparison's pieces up to and including the first differing position (``--chunks`` cut there,
    ``--max-tokens`` that position + 1), so a fault in state carried between calls, which a prompt
    fed whole never shows, is localized. None when the comparison fed no pieces, the failure has
    no position, or the case spans several prompts (localize takes one)."""
    if first is None or not first.chunks or first.first_bad_position is None or case.prompt is None or "," in case.prompt or "cycled" in case.prompt:
        return None
    n = first.first_bad_position + 1
    return case.harness("localize", "--prompt", case.prompt, "--chunks", chunks_arg(chunks_up_to(first.chunks, n)), "--max-tokens", n)


def long_decode_row(results: Sequence[ProbeResult], decode_tokens: int) -> dict[str, Any]:
    """The probe receipt's ``long_decode`` row: how many tokens the decode probe fed one per
    call (``tokens``; ``default_tokens``: ``DECODE_TOKENS``, so a reproduce line carries a length
    that was asked for), its verdict (``not run`` when it was not), and for its worst comparison the
    lowest cosine and the first differing position (None when none differed)."""
    r = next((r for r in results if r.name == "decode"), None)
    if r is None:
        return {"tokens": int(decode_tokens), "default_tokens": DECODE_TOKENS, "verdict": "not run", "min_cosine": None,
                "first_bad_position": None, "reason": ""}
    cos = [c.min_cosine for c in r.comparisons if c.min_cosine is not None]
    f = r.first_failure
    return {"tokens": int(decode_tokens), "default_tokens": DECODE_TOKENS, "verdict": r.verdict.value, "min_cosine": min(cos) if cos else None,
            "first_bad_position": f.first_bad_position if f is not None else None, "reason": r.reason}


def _probe_receipt(req: ProbeRequest, inputs: RunInputs, resolved: ResolvedThresholds, tier: dict[str, Any], engine: Any, reference: Any,
                   results: list[ProbeResult], main: Sequence[int], decode: Sequence[int] = (), ptoks: Sequence[Any] = ()) -> dict[str, Any]:
    """The ``harness-probe-receipt/v1`` document (before id and arrays are added); ``main`` and
    ``decode`` are the token ids the split/ubatch/prefix/determinism and the decode probes fed; ``engine`` and
    ``reference`` (None when the long probe did not run) are ``TimedEngine``s whose timings it
    records; ``ptoks`` the run's tokenized prompts (their set's id, count and tokens, for the
    page's prompts cell); ``tier`` says where the tolerances came from (``source``, ``self_calibration``) or
    why there were none (``unmeasured_reason``, ``command``)."""
    verdict, message = overall_verdict(results, req.only)
    decode_tokens = req.decode_tokens
    ref_info = reference.info.to_dict() if reference is not None else None
    cosines = [c.min_cosine for r in results for c in r.comparisons if c.min_cosine is not None]
    kinds = {resolved.probes[g].basis_kind for g in ("min_cosine", "max_kld") if g in resolved.probes} or {"declared"}
    return {
        "schema": "harness-probe-receipt/v1",
        "kind": "probe",
        "host": host_info(),
        "harness": harness_info(),
        "command": list(req.argv) or ["harness", "probe"],
        "model": inputs.model_record(),
        "engines": {"candidate": engine_record(engine.info.to_dict(), req.candidate, req.candidate_settings),
                    "reference": None if ref_info is None else engine_record(ref_info, req.reference)},
        "prompts": {"path": str(inputs.prompt_set.path), "sha256": inputs.prompt_set.sha256, "id": inputs.prompt_set.id,
                    "count": len(ptoks), "positions": sum(len(p.tokens) for p in ptoks), "main_tokens": main, "decode_tokens": list(decode)},
        "thresholds": {**resolved.to_receipt(), "self_calibration": tier.get("self_calibration")},
        "tier": {k: v for k, v in tier.items() if k != "self_calibration"},
        "compute_class": resolved.subject.compute_class,
        "probes": [r.to_dict() for r in results],
        "only": list(dict.fromkeys(req.only)),
        "verdict": verdict.value,
        "message": message,
        "positions": sum(c.positions for r in results for c in r.comparisons),
        "min_cosine": min(cosines) if cosines else None,
        "basis_kind": "measured" if kinds == {"measured"} else "declared",
        "unmeasured": [r.name for r in results if r.verdict is Verdict.UNMEASURED],
        "long_decode": long_decode_row(results, decode_tokens),
        "timings": {"candidate": engine.timings(), "reference": reference.timings() if reference else None},
    }


def run_probes(req: ProbeRequest, progress: Callable[[str], None] | None = None) -> ProbeRun:
    """Run the probes of ``req`` and write a ``harness-probe-receipt/v1`` and a ledger row.

    Inputs are resolved first (``req.resolve()``), the probes planned (``plan_probes``) and run,
    each failure given its reproducer (``probe_failure``), then the evidence recorded.
    Raises ``InvalidInput`` (unknown probe, bad inputs, tolerance without basis), ``EngineError``.
    """
    names = list(req.only) or list(PROBE_NAMES)
    unknown = [n for n in names if n not in PROBE_NAMES]
    if unknown:
        raise InvalidInput(f"unknown probe {unknown[0]!r}; probes: {', '.join(PROBE_NAMES)}")
    inputs = req.resolve()
    evidence = preflight_evidence(req.ledger) if req.write_evidence else None
    engine = timed(lambda: inputs.engine(req.candidate, **req.candidate_settings))
    resolved, cal_id, _, command = resolve_row(inputs.thresholds_for(engine.info.to_dict()), req.model, req.ledger,
                                               req.measure_tier if req.write_evidence else None, log=progress)
    tol = probe_tolerance(resolved, moe=inputs.model.hparams.n_expert > 0)
    tier = {"source": resolved.row.source if resolved.row else None, "self_calibration": cal_id,
            "unmeasured_reason": None if tol else resolved.row_misfit, "command": None if tol else command}
    made: list[Any] = []  # the timed reference, made on first use (the long probe)

    def reference() -> Any:
        made[:] = made or [timed(lambda: inputs.engine(req.reference, **req.reference_settings))]
        return made[0]

    ptoks = inputs.tokens()
    plan = plan_probes(req, resolved, engine, reference, tol, ptoks, inputs)
    results = []
    for n in names:
        if progress:
            progress(n)
        results.append(plan[n].run())
        if results[-1].verdict is Verdict.FAIL:
            case = replace(inputs.reproducer(req.candidate, settings=req.candidate_settings), prompt=plan[n].prompt, n_tokens=plan[n].n_tokens)
            if plan[n].model:  # the probe's own model (the state fixture) and the tokens its failing comparison fed
                from harness.fixtures.resolve import resolve_model
                from harness.provenance import sha256_file

                first = results[-1].first_failure
                case = replace(case, model=plan[n].model, sha256=sha256_file(resolve_model(plan[n].model)), overrides=(),
                               n_tokens=sum(first.chunks) if first is not None and first.chunks else None)
            results[-1].reproducer = probe_failure(results[-1], case, req.reference, req.scenarios)
    verdict, message = overall_verdict(results, req.only)
    if "long" in names:
        reference()
    receipt = _probe_receipt(req, inputs, resolved, tier, engine, made[0] if made else None, results,
                             max(ptoks, key=lambda p: len(p.tokens)).tokens[:MAIN_TOKENS], plan["decode"].tokens, ptoks)
    if not req.write_evidence:
        prepare_receipt(receipt, {})  # a dry run refuses what a recording run would
        return ProbeRun(results, verdict, message, receipt)
    page = explain(receipt, req.localize, None) if req.report else None
    rec = record_evidence(receipt, {}, evidence, page)
    return ProbeRun(results, verdict, message, rec.receipt, rec.receipt_path, rec.row, rec.report_path)
