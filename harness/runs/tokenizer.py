"""``harness tokenizer``: the candidate's own token ids for every prompt's text, against llama.cpp's.

Parity feeds both engines the reference's ids, so it never judges how an engine tokenizes; users
send text. This run asks the candidate's own tokenizer (capability ``tokenize``:
``Engine.tokenize_text``, ``harness.engines.base``) for each text of a prompt set (default: the
hostile set ``harness/data/prompts/tokenizer.jsonl``: CJK, emoji and ZWJ sequences, digit runs,
whitespace runs, code, mixed scripts, characters whose UTF-8 bytes split across tokens), asks
llama.cpp (``llama_tokenize`` on the same GGUF, specials in the text not parsed) for the same
texts, and compares the ids exactly (``harness.measure.tokens.compare_ids``).

Verdicts: FAIL when any text's ids differ, the message naming the first such prompt, the first
differing position and both sides' tokens with their texts (reference vocabulary, escaped);
PASS when all are equal; UNMEASURED when the candidate declares no ``tokenize``, has no tokenizer
of its own for the model (it raises ``Unmeasured``: e.g. transformers without ``--tokenizer-dir``)
or no prompt has text. Every verdict is a ``harness-tokenizer-receipt/v1`` and a ledger row of
kind ``tokenizer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from harness import display
from harness.errors import Unmeasured, Verdict
from harness.evidence.receipts import TOKENIZER_SCHEMA_ID, harness_info, host_info, prepare_receipt
from harness.evidence.record import preflight_evidence, record_evidence
from harness.judge.reproducer import command
from harness.measure.tokens import IdsComparison, compare_ids
from harness.model.vocab import Vocab
from harness.paths import DATA_DIR
from harness.runs.inputs import RunRequest, engine_record

TOKENIZER_PROMPTS = DATA_DIR / "prompts" / "tokenizer.jsonl"
"""The hostile prompt set (module docstring). Kept apart from the parity set: the fixtures learn
their BPE merges from the parity prompts, so changing those would change every fixture."""


@dataclass(kw_only=True)
class TokenizerRequest(RunRequest):
    """``harness tokenizer``: a ``RunRequest`` (``prompts`` None: ``TOKENIZER_PROMPTS``) plus
    ``add_special`` (llama_tokenize's, asked of both sides) and the candidate's engine settings
    (``candidate_settings``: e.g. ``tokenizer_dir`` for ``transformers``)."""

    add_special: bool = False
    candidate_settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenizerRun:
    """The outcome: per-prompt comparisons, verdict, one-line message, the receipt (and where it
    went: path and ledger row, None for a dry run)."""

    comparisons: list[IdsComparison]
    verdict: Verdict
    message: str
    receipt: dict[str, Any]
    receipt_path: Any = None
    ledger_row: dict[str, Any] | None = None


def token_text(vocab: Vocab, t: int) -> str | None:
    """The text of token ``t`` as a receipt can hold it: its bytes decoded as UTF-8 with a byte
    that is part of a character split across tokens written ``\\xNN``; None outside the vocabulary."""
    raw = vocab.raw(t)
    return None if raw is None else raw.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _token(vocab: Vocab, t: int) -> str:
    """``ID 'text'`` with the text escaped for one line (``harness.display.plain``)."""
    text = token_text(vocab, t)
    return f"{t} '{display.plain(text)}'" if text is not None else f"{t} (outside the vocabulary)"


def failure_line(c: IdsComparison, vocab: Vocab, candidate: str, reproduce: str) -> str:
    """The FAIL message of a differing prompt: prompt, first differing position, up to three
    tokens of each side from there (id and text, ``(end)`` where a side has ended), both counts
    and the command that reproduces it."""
    def side(name: str) -> str:
        ids = c.window(name)
        return ", ".join(_token(vocab, t) for t in ids) if ids else "(end)"
    return (f"prompt {display.plain(c.prompt)!r}: first difference at position {c.first_diff}: llama.cpp {side('reference')} | "
            f"{display.plain(candidate)} {side('candidate')} ({len(c.reference)} vs {len(c.candidate)} tokens); reproduce: {reproduce}")


def judge(comparisons: list[IdsComparison], vocab: Vocab, candidate: str, reproduce: str) -> tuple[Verdict, str]:
    """FAIL naming the first differing prompt (``failure_line``) and how many differ; UNMEASURED
    with nothing compared; else PASS with the counts."""
    bad = [c for c in comparisons if not c.ok]
    if bad:
        more = f" ({len(bad)} of {len(comparisons)} prompts differ)" if len(bad) > 1 else ""
        return Verdict.FAIL, failure_line(bad[0], vocab, candidate, reproduce) + more
    if not comparisons:
        return Verdict.UNMEASURED, "no prompt has text to tokenize"
    n = sum(len(c.reference) for c in comparisons)
    return Verdict.PASS, f"all {len(comparisons)} texts tokenize to llama.cpp's ids ({n} tokens)"


def run_tokenizer(req: TokenizerRequest, progress: Callable[[str], None] | None = None) -> TokenizerRun:
    """Run the tokenizer check of ``req`` (module docstring) and record its receipt and row.

    Raises ``InvalidInput`` (bad inputs, an unknown engine), ``EngineError`` (the candidate or
    llama.cpp failed or answered malformed ids). A candidate without the capability, or whose
    tokenizer is missing (``Unmeasured``), is an UNMEASURED receipt, not an error.
    """
    from harness.runs.inputs import resolve_inputs

    inputs = resolve_inputs(req.model, thresholds=req.thresholds, overrides=req.overrides, prompts=req.prompts or TOKENIZER_PROMPTS)
    if req.write_evidence:
        preflight_evidence(req.ledger)
    engine = inputs.engine(req.candidate, **req.candidate_settings)
    reference = inputs.tokenizer(None)
    texts = [p for p in inputs.prompt_set if p.text is not None]
    skipped = [p.id for p in inputs.prompt_set if p.text is None]
    vocab = Vocab(inputs.model.tokens, inputs.model.raw_metadata("tokenizer.ggml.model"))
    argv = ["harness", "tokenizer", "--candidate", req.candidate, "--model", req.model]
    if req.prompts:
        argv += ["--prompts", str(req.prompts)]
    if req.add_special:
        argv.append("--add-special")
    reproduce = command(*argv)
    comparisons: list[IdsComparison] = []
    unmeasured = None
    if "tokenize" not in engine.info.capabilities or not hasattr(engine, "tokenize_text"):
        unmeasured = f"{req.candidate} does not declare the 'tokenize' capability (docs/engine-protocol.md, \"Tokenizers\")"
    elif not texts:
        unmeasured = "no prompt of the set has text (prompts given as token ids have nothing to tokenize)"
    else:
        ref_ids = reference.tokenize_many([p.text for p in texts], add_special=req.add_special)
        try:
            for p, ids in zip(texts, ref_ids):
                if progress:
                    progress(p.id)
                comparisons.append(compare_ids(p.id, ids, engine.tokenize_text(p.text, add_special=req.add_special)))
        except Unmeasured as e:
            comparisons, unmeasured = [], str(e)
    if unmeasured:
        verdict, message = Verdict.UNMEASURED, unmeasured
    else:
        verdict, message = judge(comparisons, vocab, req.candidate, reproduce)
    ref_info = {"name": "llama.cpp", "version": _llamacpp_version(), "settings": {"op": "llama_tokenize", "parse_special": False},
                "capabilities": ["tokenize"], "build": {}, "compute_class": None}
    receipt = {
        "schema": TOKENIZER_SCHEMA_ID,
        "kind": "tokenizer",
        "host": host_info(),
        "harness": harness_info(),
        "command": list(req.argv) or argv,
        "model": inputs.model_record(),
        "engines": {"candidate": engine_record(engine.info.to_dict(), req.candidate), "reference": engine_record(ref_info, "llama.cpp")},
        "prompts": {"path": str(inputs.prompt_set.path), "sha256": inputs.prompt_set.sha256, "skipped": skipped},
        "add_special": bool(req.add_special),
        "comparisons": [c.to_dict(lambda t: token_text(vocab, t)) for c in comparisons],
        "verdict": verdict.value,
        "message": message,
        "positions": sum(len(c.reference) for c in comparisons),
        "unmeasured": unmeasured,
    }
    if not req.write_evidence:
        return TokenizerRun(comparisons, verdict, message, prepare_receipt(receipt, {}))
    rec = record_evidence(receipt, {}, req.ledger)
    return TokenizerRun(comparisons, verdict, message, rec.receipt, rec.receipt_path, rec.row)


def _llamacpp_version() -> str:
    from importlib import metadata

    try:
        return f"llama-cpp-python {metadata.version('llama-cpp-python')}"
    except metadata.PackageNotFoundError:
        return "unknown"
