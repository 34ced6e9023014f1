"""The MTP cell: a candidate's MTP (nextn) draft head against llama.cpp's own MTP context.

A wrong draft head changes no output (the target verifies every drafted token); it only loses
acceptance, so only a comparison of draft logits finds it. The cell asks the candidate for its
teacher-forced draft logits (capability ``mtp``: ``Engine.draft``, protocol-2 op ``draft``) and
the reference for the same rows, driven in the candidate's own row convention
(``info.settings["mtp_convention"]``: ``llama.cpp`` or ``vllm``; docs/qwen35-gguf-math.md,
"The MTP draft head"), and compares them row by row with the parity metrics
(``harness.measure.metrics``). Row t of a prompt of T tokens is the head's logits for
tokens[t+2]; the llama.cpp convention's sentinel row (h = 0 at position 0) is not a draft and is
never compared.

Checks, each judged by both tiers over the rows it compared: the release gate (per-row cosine
≥ 0.98) and the calibrated tier, the ``mtp:`` row of thresholds.yaml that fits the model's weights
key, the candidate's compute class and the architecture (``Thresholds.resolve_mtp``; cosine, KLD
mean, KLD p99 over each prompt's first ``max_tokens`` rows, as ``harness calibrate --mtp`` measured
it). Rows exist for classes ``MTP_CLASSES`` (f64, f32); another class's calibrated tier is
UNMEASURED, with the reason, until an emulation of it runs the head, and the release gate is its
verdict:

- ``whole``: every prompt fed whole;
- ``chunked``: every prompt fed in two pieces (capability ``chunks``), so the head's KV must be
  filled by a chunked prefill (ik_llama #1979, mlx-vlm #2096);
- ``sequences``: the first two prompts decoded side by side (capability ``multi_seq``) against the
  reference decoding them side by side, so a slot cannot draft from another slot's state
  (buun-llama-cpp PR #110);
- ``hidden``: when the candidate returns the h_t it fed the head (``hidden.npy``), ``output · h_t``
  against its own trunk logits for the same tokens: a pre-norm hidden state shows here with no
  reference at all (LightLLM PR #1402, llama.cpp PR #24025);
- ``depth2``: chained drafts (capability ``mtp_chain``, ``Engine.draft_chain``): every prompt fed
  whole, each draft row's second step (g_t, d_t) at the next head position, g_t the head's own
  output hidden state of row t and d_t the reference head's step-1 draft token, which the harness
  sends so both sides feed the same token (a near-tie of step 1 cannot make the rows
  incomparable); the reference's K/V holds the teacher-forced rows up to row t. A chained step fed
  the target's hidden state instead of g_t fails here (vLLM PR #36531). Judged by the release gate;
  its calibrated tier is UNMEASURED (``harness calibrate --mtp`` measures depth 1 only).

A check the candidate cannot be asked for is UNMEASURED with the reason, never PASS; the cell's
verdict is FAIL when any check fails, else UNMEASURED when fewer than the release gate's
positions were compared in ``whole``, else PASS. A check fails when either tier fails. The receipt
records the MTP row used (``thresholds.calibrated``), or ``unmeasured`` with the reason.

Report-only: the implied acceptance, mean[argmax D_t = tokens[t+2]] over the rows whose target is
known, for the candidate beside the reference's; and for sequences side by side, each sequence
against the candidate's own solo run.

A failing check on a candidate that exposes the head's named tensors (the oracle's mutants) is
localized against the oracle's: the first MTP tensor in graph order (``mtp_hnorm``,
``mtp_concat``, …, ``h_nextn``) over the localization bounds of thresholds.yaml.

The receipt is ``harness-mtp-receipt/v1`` (``harness/schemas/mtp-receipt.schema.json``), its
ledger row of kind ``mtp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from harness.engines.base import MTP_CHAIN, MTP_CONVENTIONS, ChainedDrafts, Drafts, Engine, gather
from harness.engines.timing import timed
from harness.errors import EngineError, NotComparable, Verdict
from harness.evidence.receipts import harness_info, host_info, prepare_receipt
from harness.evidence.record import preflight_evidence, record_evidence
from harness.judge import verdicts
from harness.judge.reproducer import failure_message, printable
from harness.judge.tiers import Row, Subject
from harness.measure import metrics
from harness.runs.inputs import RunInputs, RunRequest, engine_record

CHECKS = ("whole", "chunked", "sequences", "hidden", "depth2")
MTP_CLASSES = ("f64", "f32")
"""Compute classes with MTP rows (``harness calibrate --mtp``: the oracle, llama.cpp at other
settings): no engine of another class runs the head yet, so its calibrated tier is UNMEASURED."""
MTP_CALIBRATE_COMMAND = "harness calibrate --mtp"
MTP_OBLIGATION = "QMTP-DRAFT-001"
"""The MTP contract's draft-logits obligation: its mutants are an MTP FAIL's likely causes."""

CAUSES = {
    "whole": "the head fed a pre-norm hidden state, the embedding and hidden swapped in the concat, the head norm "
             "skipped, or rows off by one against the declared mtp_convention",
    "chunked": "the MTP layer's KV not filled by a chunked prefill (only the last piece's rows kept)",
    "sequences": "one sequence drafting from another sequence's hidden state or KV slot",
    "hidden": "the head fed the trunk's hidden state before output_norm (output · h_t is not the trunk's logits)",
    "depth2": "the chained step fed the target's hidden state instead of step 1's output hidden state (after the head norm; vLLM "
              "PR #36531), or the step-2 row at another position than the one after step 1's, or the head's KV holding other rows",
}
DEPTH2_UNCALIBRATED = ("no calibrated row for depth-2 drafts: harness calibrate --mtp measures depth 1 only, so the release gate "
                       "judges depth 2")


@dataclass
class MtpCheck:
    """One check of the cell: its verdict and numbers (rows compared, min cosine, max KLD, where
    it failed: ``first_failing_row``), or why it is UNMEASURED."""

    name: str
    verdict: Verdict
    positions: int = 0
    min_cosine: float | None = None
    max_kld: float | None = None
    first_failing: dict[str, Any] | None = None
    line: str = ""
    reason: str | None = None
    reproducer: str | None = None
    calibrated: dict[str, Any] | None = None
    """The calibrated tier's judgement of this check (``TierResult.to_dict``), None when the check
    compared nothing."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict.value, "positions": self.positions, "min_cosine": self.min_cosine,
                "max_kld": self.max_kld, "first_failing": self.first_failing, "line": self.line, "reason": self.reason,
                "reproducer": self.reproducer, "calibrated": self.calibrated}


@dataclass(frozen=True)
class MtpTier:
    """The calibrated tier of one cell: the MTP row that fits (``row``), or None with ``reason``
    and the ``command`` that would measure it (None: no command can, for this class)."""

    subject: Subject
    row: Row | None
    reason: str = ""
    command: str | None = None

    def to_receipt(self) -> dict[str, Any]:
        """The receipt's ``thresholds.calibrated``: ``{"status": "row", ...the row}`` or
        ``{"status": "unmeasured", "reason", "command"}``."""
        if self.row is None:
            return {"status": "unmeasured", "reason": self.reason, "command": self.command}
        return {"status": "row", **self.row.to_receipt()}


def mtp_tier(thresholds: Any, subject: Subject) -> MtpTier:
    """The MTP row of ``thresholds`` (``harness.judge.thresholds.Thresholds``) for ``subject``,
    or why none fits: a class outside ``MTP_CLASSES`` has none by construction (no engine of it
    runs the head); f64/f32 without a fitting row names ``harness calibrate --mtp``."""
    row, misfit = thresholds.resolve_mtp(subject)
    if row is not None:
        return MtpTier(subject, row)
    if subject.compute_class not in MTP_CLASSES:
        return MtpTier(subject, None, f"MTP rows exist for classes {', '.join(MTP_CLASSES)} only: no {subject.compute_class} "
                                      "engine or emulation runs the MTP head yet, so the release gate is this cell's verdict")
    return MtpTier(subject, None, misfit, MTP_CALIBRATE_COMMAND)


@dataclass(kw_only=True)
class MtpRequest(RunRequest):
    """Inputs of one MTP cell (``RunRequest``: model, candidate, reference, prompts, ledger)."""

    candidate_settings: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = 256
    """Tokens per prompt the head is compared over (None: whole prompts): the head's cost is the
    trunk's, twice, on both sides."""


@dataclass
class MtpRun:
    """A finished MTP cell: the checks, the verdict and its message, the receipt as written and
    where evidence went (None on a dry run)."""

    checks: list[MtpCheck]
    verdict: Verdict
    message: str
    receipt: dict[str, Any]
    receipt_path: Any = None
    ledger_row: dict[str, Any] | None = None


def convention_of(engine: Engine) -> str:
    """The candidate's declared ``mtp_convention``. Raises ``EngineError`` when it is missing or
    unknown (the reference cannot be driven to match it)."""
    conv = (engine.info.settings or {}).get("mtp_convention")
    if conv not in MTP_CONVENTIONS:
        raise EngineError(f"{engine.info.name}: info.json settings.mtp_convention is {printable(conv)!r}; it must be one of "
                          f"{', '.join(MTP_CONVENTIONS)} (docs/engine-protocol.md, op draft)")
    return conv


def _checked(d: Drafts, n_tokens: int, n_vocab: int, who: str) -> Drafts:
    if d.logits.shape != (n_tokens - 1, n_vocab):
        raise EngineError(f"{who} returned draft logits of shape {tuple(d.logits.shape)} for {n_tokens} tokens "
                          f"(expected [{n_tokens - 1}, {n_vocab}])")
    if who == "reference" and not np.isfinite(d.logits).all():
        raise EngineError("reference returned non-finite draft logits")
    return d


def acceptance(logits: np.ndarray, tokens: Sequence[int]) -> tuple[int, int]:
    """Implied acceptance of one prompt's draft rows [T−1, V]: (rows whose argmax is tokens[t+2],
    rows with a known target: T − 2)."""
    n = len(tokens) - 2
    if n <= 0:
        return 0, 0
    return int((np.argmax(logits[:n], axis=1) == np.asarray(tokens[2:], np.int64)).sum()), n


def _metrics(pairs: list[tuple[str, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    parts = []
    for i, (_, ref, cand) in enumerate(pairs):
        pm = metrics.position_metrics(ref, cand)
        pm["prompt_index"] = np.full(ref.shape[0], i, np.int32)
        pm["position"] = np.arange(ref.shape[0], dtype=np.int32)
        parts.append(pm)
    return metrics.concat_metrics(parts)


def judge_check(name: str, pairs: list[tuple[str, np.ndarray, np.ndarray]], release: dict[str, dict[str, Any]],
                need_positions: bool, tier: MtpTier | None = None) -> MtpCheck:
    """One check judged by the release gate over its rows (``pairs``: (prompt id, reference
    [R, V], candidate [R, V]) each) and, with ``tier``, by the calibrated tier
    (``verdicts.judge_calibrated`` with the MTP row, or UNMEASURED with its reason); a failure of
    either fails the check. ``need_positions``: fewer rows than the gate's ``min_positions`` make
    it UNMEASURED (the ``whole`` check); the others are judged on what they compared."""
    pm = _metrics(pairs)
    rel = verdicts.judge_release(pm, release)
    cal = None
    if tier is not None and pm["cosine"].size:
        cal = verdicts.judge_calibrated(pm, metrics.summarize(pm), tier.row, tier.subject, tier.reason, tier.command)
    n = int(pm["cosine"].size)
    cos = pm["cosine"][np.isfinite(pm["cosine"])]
    kld = pm["kld"][np.isfinite(pm["kld"])] if "kld" in pm else np.array([])
    first = first_failing_row(pairs, pm, rel, cal, tier)
    if rel.status == "fail" or (cal is not None and cal.status == "fail"):
        verdict = Verdict.FAIL
    elif rel.status == "unmeasured" and need_positions:
        verdict = Verdict.UNMEASURED
    else:
        verdict = Verdict.PASS if n else Verdict.UNMEASURED
    line = f"mtp {name}: {rel.line}" + (f"; {cal.line}" if cal is not None else "")
    return MtpCheck(name, verdict, n, float(cos.min()) if cos.size else None, float(kld.max()) if kld.size else None, first, line,
                    None if verdict is not Verdict.UNMEASURED else f"{n} rows compared", calibrated=None if cal is None else cal.to_dict())


KLD_BOUND_TEXT = {"max_kld_mean": "KLD mean", "max_kld_p99": "KLD p99"}


def first_failing_row(pairs: Sequence[tuple[str, np.ndarray, np.ndarray]], pm: dict[str, np.ndarray], rel: Any, cal: Any,
                      tier: MtpTier | None) -> dict[str, Any] | None:
    """Where a check failed, as ``{"prompt", "row", "cosine"}``: the earliest row (cell order:
    prompt, then row) that fails either tier (``rel``, ``cal``: ``TierResult``; the calibrated
    cosine is usually the stricter, so its first row can come before the release gate's). When
    only an aggregate bound of the calibrated tier failed (KLD mean or p99: no row fails alone),
    the row that contributes most, the largest KLD over the rows the tier judged, with ``kld`` and
    ``bound`` (the failed bounds, e.g. ``KLD mean``). None when the check did not fail."""
    cands = [i for i in (rel.first_failing, None if cal is None else cal.first_failing) if i is not None]

    def at(i: int, **extra: Any) -> dict[str, Any]:
        return {"prompt": pairs[int(pm["prompt_index"][i])][0], "row": int(pm["position"][i]), "cosine": metrics._f(pm["cosine"][i]), **extra}

    if cands:
        return at(min(cands))
    if cal is None or cal.status != "fail" or "kld" not in pm:
        return None
    kld = np.where(np.isfinite(pm["kld"]), pm["kld"], np.inf)
    if tier is not None and tier.row is not None and tier.row.max_tokens is not None:
        kld = np.where(pm["position"] < tier.row.max_tokens, kld, -np.inf)
    i = int(np.argmax(kld))
    bounds = [KLD_BOUND_TEXT.get(c.name, c.name) for c in cal.checks if c.ok is False]
    return at(i, kld=metrics._f(pm["kld"][i]), bound=" and ".join(bounds))


@dataclass
class ReferenceDrafts:
    """The reference's ``draft`` and ``draft_multi`` in one convention: llama.cpp's MTP context
    takes the convention per call; the oracle (``--reference oracle``) is given it as its own."""

    draft: Callable[..., Drafts]
    draft_multi: Callable[..., list[Drafts]]
    draft_many: Callable[..., list[Drafts]] | None = None
    """Several ``(tokens, chunks)`` in one call (llama.cpp: one worker run, one model load)."""
    chain_many: Callable[..., list[ChainedDrafts]] | None = None
    """Depth-2 drafts of several ``(tokens, draft_tokens)`` in one call (None: the reference has none)."""
    cache: dict[tuple, Drafts] = field(default_factory=dict)

    def prefetch(self, items: Sequence[tuple[Sequence[int], Sequence[int] | None]]) -> None:
        """Compute the drafts of ``items`` at once where the reference can (``draft_many``);
        ``get`` then answers from them."""
        if self.draft_many is None or not items:
            return
        for (toks, chunks), d in zip(items, self.draft_many(items)):
            self.cache[(tuple(toks), tuple(chunks) if chunks else None)] = d

    def get(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Drafts:
        """The drafts of ``tokens`` fed in ``chunks`` (prefetched, else computed now)."""
        key = (tuple(tokens), tuple(chunks) if chunks else None)
        return self.cache[key] if key in self.cache else self.draft(tokens, chunks)


def reference_drafts(engine: Any, convention: str) -> ReferenceDrafts:
    """``engine``'s drafts in ``convention``. Raises ``EngineError`` when the reference has no
    MTP head to drive (no ``mtp`` capability: a file without a nextn block)."""
    from harness.engines.oracle.qwen35 import Qwen35Oracle

    if "mtp" not in engine.info.capabilities:
        raise EngineError(f"reference {engine.info.name} cannot run the MTP head of this model (no 'mtp' capability: "
                          "the file has no nextn block, or the reference cannot drive one)")
    chain = MTP_CHAIN in engine.info.capabilities
    if isinstance(engine, Qwen35Oracle):
        engine.mtp_convention = convention
        return ReferenceDrafts(lambda t, c=None: engine.draft(t, c), engine.draft_multi, None,
                               (lambda items: [engine.draft_chain(t, d) for t, d in items]) if chain else None)
    return ReferenceDrafts(lambda t, c=None: engine.draft(t, c, convention), lambda qs: engine.draft_multi(qs, convention),
                           (lambda items: engine.draft_many(items, convention)) if hasattr(engine, "draft_many") else None,
                           (lambda items: engine.draft_chain_many(items, convention)) if chain and hasattr(engine, "draft_chain_many") else None)


def _can_multi(engine: Any) -> bool:
    """Whether the ``sequences`` check can ask ``engine``: ``draft_multi`` with ``multi_seq``
    declared, or the oracle family (one state per sequence by construction: its ``draft_multi``
    is each sequence alone, which a mutant may break)."""
    from harness.engines.oracle.qwen35 import Qwen35Oracle

    return callable(getattr(engine, "draft_multi", None)) and ("multi_seq" in engine.info.capabilities or isinstance(engine, Qwen35Oracle))


def _unmeasured(name: str, why: str) -> MtpCheck:
    return MtpCheck(name, Verdict.UNMEASURED, line=f"mtp {name}: UNMEASURED — {why}", reason=why)


def _chunks(n: int) -> list[int]:
    """The two pieces of the ``chunked`` check: the first half (at least 1 token), then the rest."""
    k = max(1, n // 2)
    return [k, n - k] if n - k else [n]


def localize_mtp(inputs: RunInputs, candidate: Engine, tokens: Sequence[int], chunks: Sequence[int] | None) -> dict[str, Any] | None:
    """The first MTP tensor (graph order) where the candidate leaves the oracle, for a candidate
    whose ``draft`` takes ``names`` (the oracle's mutants); None when it cannot be asked. Bounds:
    thresholds.yaml ``probes.localize_max_nmse`` / ``localize_min_cosine``."""
    from harness.engines.oracle import load_oracle
    from harness.engines.oracle.qwen35 import Qwen35Oracle

    if not isinstance(candidate, Qwen35Oracle):
        return None
    names = ("mtp_tok_embd", "mtp_hnorm", "mtp_enorm", "mtp_concat", "mtp_eh_proj", "attn_norm", "attn_output", "attn_residual",
             "attn_post_norm", "ffn_out", candidate.post_ffn_name, "l_out", "h_nextn")
    il = candidate.hp.n_layer
    wanted = {f"{n}-{il}" if n != "h_nextn" else n for n in names}
    oracle = load_oracle(inputs.path, inputs.overrides)
    oracle.mtp_convention = candidate.mtp_convention
    ref = oracle.draft(tokens, chunks, names=wanted).activations
    cand = candidate.draft(tokens, chunks, names=wanted).activations
    resolved = inputs.thresholds_for()
    max_nmse = float(resolved.gate("localize_max_nmse", "probes").value)
    min_cos = float(resolved.gate("localize_min_cosine", "probes").value)
    order = [k for k in ref if k in wanted]
    for name in order:
        r, c = np.asarray(ref[name], np.float64).reshape(len(ref[name]), -1), np.asarray(cand.get(name), np.float64)
        if cand.get(name) is None or c.size != r.size:
            return {"tensor": name, "status": "missing"}
        c = c.reshape(r.shape)
        nm = ((c - r) ** 2).sum(1) / np.maximum((r * r).sum(1), 1e-300)
        nr, nc = np.linalg.norm(r, axis=1), np.linalg.norm(c, axis=1)
        cs = np.where((nr == 0) & (nc == 0), 1.0, (r * c).sum(1) / np.maximum(nr * nc, 1e-300))  # the sentinel row's h = 0
        bad = np.flatnonzero((nm > max_nmse) | (cs < min_cos))
        if bad.size:
            return {"tensor": name, "row": int(bad[0]), "nmse": float(nm[bad[0]]), "cosine": float(cs[bad[0]])}
    return {"tensor": None}


@dataclass
class _Cell:
    """One MTP cell's engines, prompts and gates while its checks run (``run_mtp``)."""

    inputs: RunInputs
    candidate: Any
    prompts: list[Any]
    n_vocab: int
    release: dict[str, dict[str, Any]]
    tier: Any
    drive: ReferenceDrafts
    progress: Callable[[str], None] | None
    cand_whole: dict[str, Drafts] = field(default_factory=dict)

    def say(self, what: str) -> None:
        if self.progress:
            self.progress(what)

    def cand(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Drafts:
        return _checked(self.candidate.draft(tokens, chunks) if chunks else self.candidate.draft(tokens), len(tokens), self.n_vocab,
                        "candidate")

    def ref(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Drafts:
        return _checked(self.drive.get(tokens, chunks), len(tokens), self.n_vocab, "reference")

    def whole(self, first: Drafts) -> tuple[MtpCheck, dict[str, Any]]:
        """The ``whole`` check, and the implied acceptance of both sides over its rows."""
        pairs, acc = [], {"candidate": [0, 0], "reference": [0, 0]}
        for i, p in enumerate(self.prompts):
            if i:
                self.say(f"whole {p.id}")
            c = first if i == 0 else self.cand(p.tokens)
            r = self.ref(p.tokens)
            self.cand_whole[p.id] = c
            pairs.append((p.id, r.logits, c.logits))
            for side, d in (("candidate", c), ("reference", r)):
                a, n = acceptance(d.logits, p.tokens)
                acc[side][0] += a
                acc[side][1] += n
        rates = {side: {"accepted": a, "rows": n, "rate": (a / n) if n else None} for side, (a, n) in acc.items()}
        return judge_check("whole", pairs, self.release, True, self.tier), rates

    def depth2(self) -> MtpCheck:
        """The ``depth2`` check (module docstring): the reference's chained drafts with its own
        step-1 tokens, then the candidate's with those tokens given."""
        if MTP_CHAIN not in self.candidate.info.capabilities:
            return _unmeasured("depth2", f"{self.candidate.info.name} does not declare '{MTP_CHAIN}' (no chained drafts to judge)")
        if self.drive.chain_many is None:
            return _unmeasured("depth2", "the reference cannot be driven to chain drafts")
        self.say("depth 2")
        refs = self.drive.chain_many([(p.tokens, None) for p in self.prompts])
        pairs = []
        for p, r in zip(self.prompts, refs):
            _checked(Drafts(r.logits2), len(p.tokens), self.n_vocab, "reference")
            c = self.candidate.engine.draft_chain(p.tokens, [int(x) for x in r.tokens])
            _checked(Drafts(c.logits2), len(p.tokens), self.n_vocab, "candidate")
            pairs.append((p.id, r.logits2, c.logits2))
        tier = MtpTier(self.tier.subject, None, DEPTH2_UNCALIBRATED)
        check = judge_check("depth2", pairs, self.release, False, tier)
        if check.first_failing:
            check.first_failing["depth"] = 2
        return check

    def chunked(self) -> MtpCheck:
        if "chunks" not in self.candidate.info.capabilities:
            return _unmeasured("chunked", f"{self.candidate.info.name} does not declare 'chunks'")
        pairs = []
        for p in self.prompts:
            self.say(f"chunked {p.id}")
            ch = _chunks(len(p.tokens))
            pairs.append((p.id, self.ref(p.tokens, ch).logits, self.cand(p.tokens, ch).logits))
        return judge_check("chunked", pairs, self.release, False, self.tier)

    def sequences(self) -> tuple[MtpCheck, list[dict[str, Any]] | None]:
        """The ``sequences`` check, and each sequence against the candidate's solo run (report-only)."""
        if not _can_multi(self.candidate.engine) or len(self.prompts) < 2:
            return _unmeasured("sequences", f"{self.candidate.info.name} does not declare 'multi_seq' with draft_multi, "
                                            "or fewer than 2 prompts"), None
        self.say("sequences")
        seqs = [self.prompts[0].tokens, self.prompts[1].tokens]
        cm = [_checked(d, len(q), self.n_vocab, "candidate") for d, q in zip(self.candidate.engine.draft_multi(seqs), seqs)]
        rm = [_checked(d, len(q), self.n_vocab, "reference") for d, q in zip(self.drive.draft_multi(seqs), seqs)]
        pairs = [(f"{self.prompts[i].id} (sequence {i} of 2)", rm[i].logits, cm[i].logits) for i in range(2)]
        solo = [{"prompt": self.prompts[i].id,
                 "min_cosine": metrics._f(np.nanmin(metrics.cosine(self.cand_whole[self.prompts[i].id].logits, cm[i].logits)))}
                for i in range(2)]
        return judge_check("sequences", pairs, self.release, False, self.tier), solo

    def hidden(self) -> MtpCheck:
        """``output · h_t`` against the candidate's own trunk logits (``hidden.npy`` given)."""
        given = [p for p in self.prompts if self.cand_whole[p.id].hidden is not None]
        if not given:
            return _unmeasured("hidden", "the candidate returned no hidden.npy")
        model = self.inputs.model
        w = model.tensor("output.weight" if model.has_tensor("output.weight") else "token_embd.weight", np.float32)
        pairs = []
        for p in given:
            h = self.cand_whole[p.id].hidden
            if h.shape != (len(p.tokens), model.hparams.n_embd):
                raise EngineError(f"candidate returned hidden states of shape {tuple(h.shape)} for {len(p.tokens)} tokens")
            pairs.append((p.id, gather(self.candidate.logits(p.tokens), len(p.tokens)), (np.asarray(h, np.float64) @ w.T).astype(np.float32)))
        return judge_check("hidden", pairs, self.release, False, self.tier)


def cause_of(check: str, whole_failed: bool) -> str:
    """The likely cause of a failed ``check``: ``CAUSES[check]``, except that a check other than
    ``whole`` fails as ``whole`` does when ``whole`` failed too, so the head itself is blamed, not
    what only that check varies (the chunked prefill, the other sequence)."""
    if check == "whole" or not whole_failed:
        return CAUSES[check]
    return f"whole fails too, so the head itself is wrong, not what only the {check} check varies: {CAUSES['whole']}"


def where_text(where: dict[str, Any]) -> str:
    """``, first failing row R of prompt 'P'``, or for an aggregate bound ``, worst contributor to
    the KLD mean: row R of prompt 'P' (KLD k)`` (``first_failing_row``); "" for None."""
    if not where:
        return ""
    if where.get("bound"):
        return f", worst contributor to the {where['bound']}: row {where.get('row')} of prompt {where.get('prompt')!r} (KLD {where.get('kld'):.3g})"
    depth = f" at depth {where['depth']} (step 2 chained from draft row {where.get('row')})" if where.get("depth") else ""
    return f", first failing row {where.get('row')} of prompt {where.get('prompt')!r}" + depth


def _add_reproducers(checks: Sequence[MtpCheck], case: Any) -> None:
    """Every failed check's one-line reproducer (``harness.judge.reproducer.failure_message``)."""
    whole_failed = any(c.name == "whole" and c.verdict is Verdict.FAIL for c in checks)
    for c in checks:
        if c.verdict is Verdict.FAIL:
            where = c.first_failing or {}
            numbers = f"mtp {c.name} FAIL: {c.line}" + where_text(where)
            c.reproducer = failure_message(numbers, replace(case, prompt=where.get("prompt")), [], cause_of(c.name, whole_failed),
                                           case.harness("parity", "--mtp"))


def _localized(inputs: RunInputs, candidate: Any, prompts: Sequence[Any], checks: Sequence[MtpCheck], report: dict[str, Any]) -> str:
    """Localize the first failed check on its failing prompt (``localize_mtp``), recorded in
    ``report["localization"]``; returns what the message adds: the first divergent MTP tensor, or
    that none can be named for a candidate that returns no named MTP tensors (a ``command:`` engine)."""
    bad = next(c for c in checks if c.verdict is Verdict.FAIL)
    p = next((q for q in prompts if q.id == (bad.first_failing or {}).get("prompt")), prompts[0] if prompts else None)
    if p is None:
        return ""
    loc = localize_mtp(inputs, candidate.engine, p.tokens, _chunks(len(p.tokens)) if bad.name == "chunked" else None)
    if loc is not None:
        report["localization"] = {"prompt": p.id, **loc}
        return f"; first divergent MTP tensor: {loc['tensor']}" if loc.get("tensor") else ""
    why = (f"{candidate.info.name} returns no named MTP tensors (only the harness's own engines, the oracle and its mutants, "
           "return the head's tensors by name), so the first divergent MTP tensor cannot be named")
    report["localization"] = {"prompt": p.id, "unmeasured": why}
    return f"; no MTP tensor named: {why}"


def run_mtp(req: MtpRequest, progress: Callable[[str], None] | None = None) -> MtpRun:
    """Run one MTP cell end to end and write its evidence (module docstring).

    Raises ``InvalidInput`` (inputs), ``EngineError`` (either engine; a reference without MTP
    support), ``NotComparable`` (vocab sizes differ, no prompt of 3 tokens).
    """
    inputs = req.resolve()
    if req.write_evidence:
        preflight_evidence(req.ledger)
    candidate = timed(lambda: inputs.engine(req.candidate, **req.candidate_settings))
    reference = timed(lambda: inputs.engine(req.reference, **req.reference_settings))
    prompts = [p if req.max_tokens is None else replace(p, tokens=list(p.tokens[: req.max_tokens])) for p in inputs.tokens(reference.engine)]
    prompts = [p for p in prompts if len(p.tokens) >= 3]
    report: dict[str, Any] = {}
    conv = None
    if "mtp" not in candidate.info.capabilities or not inputs.model.hparams.n_layer_nextn:
        why = (f"{candidate.info.name} does not declare the 'mtp' capability (no draft op)" if "mtp" not in candidate.info.capabilities
               else "the model has no MTP (nextn) block (nextn_predict_layers 0): no draft head to judge")
        checks = [_unmeasured(n, why) for n in CHECKS]
    else:
        if int(candidate.n_vocab) != int(reference.n_vocab):
            raise NotComparable(f"vocab sizes differ: reference {reference.n_vocab}, candidate {candidate.n_vocab}")
        if not prompts:
            raise NotComparable("no prompt has the 3 tokens a draft row with a known target needs")
        if progress:
            progress(f"whole {prompts[0].id}")
        n_vocab = int(reference.n_vocab)
        first = _checked(candidate.draft(prompts[0].tokens), len(prompts[0].tokens), n_vocab, "candidate")
        conv = convention_of(candidate.engine)  # a protocol-2 engine states it (and its class) in its replies
        drive = reference_drafts(reference.engine, conv)
        drive.prefetch([(p.tokens, None) for p in prompts]
                       + ([(p.tokens, _chunks(len(p.tokens))) for p in prompts] if "chunks" in candidate.info.capabilities else []))
        resolved = inputs.thresholds_for(candidate.info.to_dict())
        cell = _Cell(inputs, candidate, prompts, n_vocab, resolved.release_gates, mtp_tier(inputs.thresholds, resolved.subject), drive,
                     progress)
        whole, report["acceptance"] = cell.whole(first)
        seqs, solo = cell.sequences()
        if solo is not None:
            report["sequences_vs_solo"] = solo
        checks = [whole, cell.chunked(), seqs, cell.hidden(), cell.depth2()]
    resolved = inputs.thresholds_for(candidate.info.to_dict())
    verdict, message = overall(checks)
    _add_reproducers(checks, inputs.reproducer(req.candidate, settings=req.candidate_settings))
    if verdict is Verdict.FAIL:
        message += _localized(inputs, candidate, prompts, checks, report)
    receipt = mtp_receipt(req, inputs, candidate, reference, resolved, conv, prompts, checks, verdict, message, report)
    if not req.write_evidence:
        prepare_receipt(receipt, {})
        return MtpRun(checks, verdict, message, receipt)
    rec = record_evidence(receipt, {}, req.ledger)
    return MtpRun(checks, verdict, message, rec.receipt, rec.receipt_path, rec.row)


def mtp_receipt(req: MtpRequest, inputs: RunInputs, candidate: Any, reference: Any, resolved: Any, conv: str | None, prompts: Sequence[Any],
                checks: Sequence[MtpCheck], verdict: Verdict, message: str, report: dict[str, Any]) -> dict[str, Any]:
    """The ``harness-mtp-receipt/v1`` document (before id and arrays are added)."""
    release = resolved.release_gates
    return {
        "schema": "harness-mtp-receipt/v1",
        "kind": "mtp",
        "host": host_info(),
        "harness": harness_info(),
        "command": list(req.argv) or ["harness", "parity", "--mtp"],
        "model": inputs.model_record(),
        "engines": {"candidate": engine_record(candidate.info.to_dict(), req.candidate, req.candidate_settings),
                    "reference": engine_record(reference.info.to_dict(), req.reference)},
        "mtp_convention": conv,
        "prompts": {"path": str(inputs.prompt_set.path), "sha256": inputs.prompt_set.sha256, "id": inputs.prompt_set.id, "count": len(prompts),
                    "positions": sum(len(p.tokens) for p in prompts), "max_tokens": req.max_tokens,
                    "items": [{"id": p.id, "tokens": list(p.tokens)} for p in prompts]},
        "thresholds": {"release": resolved.to_receipt()["release"], "calibrated": mtp_tier(inputs.thresholds, resolved.subject).to_receipt()},
        "compute_class": resolved.subject.compute_class,
        "checks": [c.to_dict() for c in checks],
        "verdict": verdict.value,
        "message": message,
        "positions": sum(c.positions for c in checks),
        "min_cosine": min((c.min_cosine for c in checks if c.min_cosine is not None), default=None),
        "basis_kind": release["min_cosine"].get("basis", {}).get("kind", "declared"),
        "report_only": report,
        "timings": {"candidate": candidate.timings(), "reference": reference.timings()},
    }


def overall(checks: Sequence[MtpCheck]) -> tuple[Verdict, str]:
    """FAIL when a check fails; UNMEASURED when ``whole`` is (too few rows, no capability); else
    PASS. The message joins every check's line."""
    lines = "; ".join(c.line for c in checks)
    if any(c.verdict is Verdict.FAIL for c in checks):
        return Verdict.FAIL, lines
    whole = next((c for c in checks if c.name == "whole"), None)
    if whole is None or whole.verdict is not Verdict.PASS:
        return Verdict.UNMEASURED, lines
    return Verdict.PASS, lines
