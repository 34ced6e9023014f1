"""The engine protocol: token ids in, per-position logits out (docs/design.md; docs/engine-protocol.md).

An engine maps a token id sequence to logits. Row ``t`` of the logits is the next-token
distribution after consuming ``tokens[:t+1]``. Logits stream as blocks ``(start, float32 [B, V])``
in position order so memory stays bounded at Qwen3.5's vocab (248,320 columns, ~1 MB per row).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from harness.errors import EngineError

LogitBlock = tuple[int, np.ndarray]
"""``(start, logits)``: ``logits`` is float32 ``[B, V]`` for positions ``start .. start+B-1``."""


@dataclass
class TopK:
    """Top-k logprobs of consecutive positions, what a server gives instead of logits
    (``http:NAME``; ``harness.measure.topk``): ``ids`` int64 ``[T, k]`` (-1: an empty slot),
    ``logprobs`` float64 ``[T, k]`` (natural log, NaN in empty slots); row t is the distribution
    after ``tokens[:t+1]``, as a logits row. ``dropped_max`` float64 ``[T]`` (optional): the
    largest logprob among the entries the server sent whose key maps to no single token id (their
    mass is in the tail; -inf when none), so a top-1 hidden among them is known to be unknown."""

    ids: np.ndarray
    logprobs: np.ndarray
    dropped_max: np.ndarray | None = None

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])


COMPUTE_CLASSES = ("f64", "f32", "bf16", "f16", "mixed")
"""The precision an engine computes in, which decides which calibrated gates apply to it:
``f64``/``f32``/``f16``/``bf16`` when its matmul inputs and accumulations are in that format
(norms, softmax and recurrent state may be kept in f32 by a ``bf16``/``f16`` engine, as GPU
engines do), ``mixed`` for anything else (e.g. per-layer choices)."""
ASSUMED_CLASS = "f32"
"""The class an engine that declares none is judged as (its verdict says so and how to declare)."""


@dataclass
class EngineInfo:
    """What a receipt records about an engine.

    ``settings`` holds every setting that changes numerics (threads, n_ctx, n_batch, n_ubatch,
    KV cache types, flash attention, backend, overrides); ``capabilities`` lists optional protocol
    features the engine supports (``"chunks"``, ``"activations"``, ``"n_ubatch"``, ``"multi_seq"``,
    ``"topk"``: top-k logprobs instead of logits, ``"generate"``: greedy generation,
    ``"prefix_reuse"``, ``"mtp"``, ``"speculative"``; see ``Engine``);
    ``compute_class`` is one of ``COMPUTE_CLASSES``, or None when the engine declares none.
    """

    name: str
    version: str
    settings: dict[str, Any] = field(default_factory=dict)
    capabilities: list[str] = field(default_factory=list)
    build: dict[str, Any] = field(default_factory=dict)
    compute_class: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "settings": self.settings,
            "capabilities": list(self.capabilities),
            "build": self.build,
            "compute_class": self.compute_class,
        }


MTP_CONVENTIONS = ("llama.cpp", "vllm")
"""Where an MTP head's rows sit (``info.settings["mtp_convention"]``): ``llama.cpp`` puts the row
(h_{p−1}, x_p) at position p after a sentinel row (h = 0, x_0) at 0; ``vllm`` (and SGLang) put
(h_t, x_{t+1}) at position t. The sentinel is one more key the head attends to, so the two give
different draft logits; an exact comparison drives the reference in the candidate's convention."""


@dataclass
class Drafts:
    """Teacher-forced draft logits of an MTP (nextn) head for one sequence of T tokens
    (capability ``mtp``; docs/qwen35-gguf-math.md, "The MTP draft head").

    ``logits``: float32 [T−1, V]; row t is the head's logits for tokens[t+2], from the trunk's
    state after tokens[:t+1] and the embedding of tokens[t+1] (the last row predicts the token
    after the sequence). ``hidden``: float32 [T, n_embd] or None, the h_t the head was fed (the
    trunk's state after ``output_norm``: ``output · h_t`` is the trunk's logit row t).
    ``activations``: the head's named tensors when asked for (llama.cpp ``graph_mtp`` names).
    """

    logits: np.ndarray
    hidden: np.ndarray | None = None
    activations: dict[str, np.ndarray] = field(default_factory=dict)


MTP_CHAIN = "mtp_chain"
"""The capability of a depth-2 draft (``draft_chain``; docs/engine-protocol.md, "Depth 2"): an
engine that declares it with ``mtp`` chains a second draft from its head's own output."""


@dataclass
class ChainedDrafts:
    """Teacher-forced drafts at depth 1 and 2 of an MTP head for one sequence of T tokens
    (capability ``mtp_chain``; docs/engine-protocol.md, op ``draft``, "Depth 2").

    ``logits``: float32 [T−1, V], depth 1, as ``Drafts.logits``: row t from (h_t, x_{t+1}).
    ``logits2``: float32 [T−1, V], depth 2: row t is the head's logits for tokens[t+3] from the
    row (g_t, d_t) at the position after row t's, g_t the head's own output hidden state of row t
    (after its head norm: llama.cpp ``t_h_nextn`` of the MTP context, what its ``draft-mtp``
    driver chains) and d_t the step-1 draft token ``tokens[t]``; the head's K/V holds the
    teacher-forced rows up to row t and this row, none after (a drafting engine removes its draft
    rows). ``tokens``: int64 [T−1], the d_t fed (given by the harness, else argmax of ``logits``
    row t, ties to the lowest id)."""

    logits: np.ndarray
    logits2: np.ndarray
    tokens: np.ndarray


SPEC_DRAFTS = ("mtp", "given")
"""Draft sources a speculative request may name: ``{"draft": "mtp", "draft_max": k}``, the
model's own MTP (nextn) head; ``{"draft": "given", "draft_max": k, "tokens": [g_0, g_1, ...]}``,
drafts the harness gives (docs/engine-protocol.md, "Given drafts"): the draft for generated index
j is ``g_j``, so a step after j generated tokens proposes ``g_j … g_{j+k'-1}``,
k' = min(k, n_tokens − j − 1, len(g) − j)."""
SPEC_GIVEN_MAX = 8
"""The most drafts per step (``draft_max``) the oracle and the example engine verify with given
drafts; a larger draft_max, or more given tokens than ``n_tokens``, is refused."""


def check_given(given: Sequence[int], n_tokens: int, draft_max: int, n_vocab: int, who: str) -> list[int]:
    """Drafts the harness gives (``SPEC_DRAFTS`` "given"), checked: ids in [0, n_vocab), at most
    ``n_tokens`` of them (one per generated index), ``draft_max`` at most ``SPEC_GIVEN_MAX``.
    Returns them as ints. Raises ``EngineError`` naming ``who`` and the first thing wrong."""
    toks = list(given)
    if draft_max > SPEC_GIVEN_MAX:
        raise EngineError(f"{who}: given drafts with draft_max {draft_max}: at most {SPEC_GIVEN_MAX} drafts per step are verified")
    if len(toks) > n_tokens:
        raise EngineError(f"{who}: {len(toks)} given drafts for {n_tokens} tokens: at most one per generated token")
    bad = next((t for t in toks if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < n_vocab), None)
    if bad is not None:
        raise EngineError(f"{who}: given draft {bad!r:.20} is not a token id in [0, {n_vocab})")
    return [int(t) for t in toks]


@dataclass
class Speculation:
    """One sequence's speculative greedy continuation (capability ``speculative``;
    docs/engine-protocol.md, ``speculative.json``): ``tokens`` the generated ids (int, at most
    ``n_tokens``); ``accepted[i]`` and ``rejected[i]`` the drafts the i-th verification step
    accepted and rejected (``accepted + rejected`` ≤ draft_max; 0 and 0 for a draft-less step).
    The prompt's prefill chooses the first token and is not a step; step i gives
    ``accepted[i] + 1`` tokens (the accepted drafts and the target's own choice after them)."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None
    """float32 [len(tokens), V] or None: the row that chose each generated token (the prefill's
    last row for token 0, then each verification batch's rows), where the engine returns them."""

    @property
    def proposed(self) -> int:
        return int(sum(self.accepted) + sum(self.rejected))

    def acceptance(self) -> float | None:
        """accepted / proposed over every step (None when nothing was proposed)."""
        return sum(self.accepted) / self.proposed if self.proposed else None

    def step_of(self, index: int) -> int | None:
        """The verification step that produced generated token ``index`` (None: the prefill's)."""
        if index == 0:
            return None
        done = 1
        for i, a in enumerate(self.accepted):
            done += a + 1
            if index < done:
                return i
        return None if index == 0 else len(self.accepted)

    def batches(self, n_prompt: int) -> list[tuple[int, int]]:
        """Each verification step's batch as (first position, last position), 0-based, for a
        prompt of ``n_prompt`` tokens: step i feeds 1 + a_i + r_i tokens from position
        n_prompt + Σ_{j<i}(a_j + 1) (the rejected drafts' cells are rolled back)."""
        out, p = [], int(n_prompt)
        for a, r in zip(self.accepted, self.rejected):
            out.append((p, p + a + r))
            p += a + 1
        return out


@runtime_checkable
class Engine(Protocol):
    """A candidate or reference engine bound to one model file.

    ``logits(tokens, chunks)`` yields ``(start, float32 [B, V])`` blocks in position order.
    ``chunks``, when given, is a list of piece lengths summing to ``len(tokens)``: the engine
    feeds the prompt as consecutive calls with its state carried across them. An engine that
    cannot do so raises ``EngineError`` only if asked; it advertises support with
    ``"chunks" in info.capabilities``.

    Optional methods, each present only with its capability in ``info.capabilities`` (a probe
    that needs one the engine lacks reports UNMEASURED, never PASS):

    - ``"multi_seq"``: ``logits_multi(sequences: Sequence[Sequence[int]]) -> Iterator[LogitBlock]``
      decodes the sequences together (side by side in the same batches, one sequence id / state
      slot each, as a server batches requests); rows are the sequences' rows concatenated in
      order, ``sum(len(q))`` in all.
    - ``"n_ubatch"``: ``with_settings(n_ubatch=N) -> Engine`` the same engine and model with the
      micro-batch size (llama.cpp ``n_ubatch``: tokens per graph evaluation) changed.
    - ``"generate"``: ``generate(tokens: Sequence[int], n_tokens: int) -> list[int]``: greedy
      (argmax of each step's logits, ties to the lowest id) free-running continuation of
      ``tokens``: the engine feeds the prompt, then each token it chose, with its own state
      carried (its decode path, not teacher forcing). Returns at most ``n_tokens`` new ids (an
      engine may stop early at its own end-of-generation token); the harness stops the
      comparison at the reference's EOS (``harness.runs.greedy``).
    - ``"prefix_reuse"``: ``session_logits(tokens, *, session: str, parent: str | None = None,
      after: int = 0, checkpoints: Sequence[int] = ()) -> Iterator[LogitBlock]`` feeds ``tokens``
      starting from the state sequence ``parent`` had after its first ``after`` tokens (None:
      a fresh state), keeps the resulting state under the id ``session`` and, for each position
      ``k`` in ``checkpoints`` (counted in the session's whole token history), a copy of the
      state after token ``k`` that a later request may fork from (``parent=session,
      after=k``); ``parent == session`` with ``after`` equal to its length continues it. Rows are
      ``tokens``' only. This is how a server restores a prompt-cache checkpoint; the
      ``prefix`` probe compares it with the same tokens fed fresh. ``drop_sessions()`` frees them.
    - ``"mtp"``: ``draft(tokens, chunks=None) -> Drafts``: the MTP head's teacher-forced draft
      logits (and the hidden states it was fed), through the engine's real prefill path (fed in
      ``chunks`` when given); with ``"multi_seq"`` too, ``draft_multi(sequences) -> list[Drafts]``
      for sequences decoded together. ``info.settings["mtp_convention"]`` says where the head's
      rows sit: ``"llama.cpp"`` or ``"vllm"`` (docs/engine-protocol.md, op ``draft``).
    - ``"mtp_chain"`` (with ``"mtp"``): ``draft_chain(tokens, draft_tokens=None) ->
      ChainedDrafts``: the teacher-forced drafts at depth 1 and 2 (step 2 fed step 1's output
      hidden state and ``draft_tokens[t]``, else step 1's own argmax; ``ChainedDrafts``).
    - ``"speculative"``: ``speculative(tokens, n_tokens, *, draft_max, chunks=None, session=None)
      -> Speculation``: greedy continuation through the engine's speculative path with drafts from
      its MTP head (``{"draft": "mtp", "draft_max": k}``, k ≥ 1): each step drafts up to k tokens,
      verifies them in one batch, keeps the accepted ones and rolls its state (KV, conv, recurrent)
      back to the last accepted token. It must equal ``generate`` token for token (the
      ``speculative`` probe, excused only at a near-tie of the plain path's margin). ``chunks``:
      the prompt's prefill pieces; ``session``: ``{"id", "parent", "after"}`` as for
      ``prefix_reuse`` (the state after the prompt and every generated token but the last, which
      is not fed, is kept under ``id``; ``parent``/``after`` continue from such a state, ``after``
      its length). ``speculative_multi(sequences, n_tokens, *, draft_max) -> list[Speculation]``
      generates several sequences together. ``drop_sessions()`` frees sessions.
    - ``"tokenize"``: ``tokenize_text(text: str, add_special: bool = False) -> list[int]``: the
      engine's *own* tokenization of ``text`` (the tokenizer its users get, not the harness's),
      special-token strings in the text not parsed, BOS/EOS added only with ``add_special`` and
      only where the vocabulary asks for them (llama.cpp ``llama_tokenize``'s ``add_special``).
      ``harness tokenizer`` compares it with llama.cpp's ids (``harness.runs.tokenizer``). An
      engine that declares it but has no tokenizer of its own for this model raises
      ``Unmeasured`` with the reason (never answers with the harness's ids).
    - ``"chat_template"``: the engine renders chat conversations itself, through one of
      ``render_chat(conversation: dict) -> str`` (the prompt text; protocol 2 op ``render``) or
      ``chat_prompt_tokens(conversation: dict) -> int`` (a server's token count of its own
      rendering: llama-cpp-python's ``/v1/chat/completions`` ``usage.prompt_tokens``);
      ``conversation`` holds ``messages``, ``tools`` and ``add_generation_prompt``. ``harness
      tokenizer`` compares them with the GGUF's ``tokenizer.chat_template`` rendered by
      ``harness.measure.chat_template`` (docs/engine-protocol.md, "The chat template").
    """

    @property
    def info(self) -> EngineInfo: ...

    @property
    def n_vocab(self) -> int: ...

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]: ...


def checked_token_ids(ids: Any, n_vocab: int, who: str, what: str = "tokens") -> list[int]:
    """``ids`` as a list of int token ids, each in ``[0, n_vocab)``. Raises ``EngineError``
    naming ``who`` and ``what`` for anything else (not a list, a bool, a float, an id out of range)."""
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise EngineError(f"{who} answered {what} that are not a list of token ids")
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise EngineError(f"{who} answered token id {bad} in {what}, outside the vocabulary [0, {n_vocab})")
    return [int(t) for t in ids]


def validate_chunks(n_tokens: int, chunks: Sequence[int] | None) -> list[int]:
    """Return the chunk lengths to feed (``[n_tokens]`` when ``chunks`` is None).

    Raises ``EngineError`` when the lengths are not positive or do not sum to ``n_tokens``.
    """
    if chunks is None:
        return [n_tokens]
    chunks = [int(c) for c in chunks]
    if any(c <= 0 for c in chunks) or sum(chunks) != n_tokens:
        raise EngineError(f"chunk lengths {chunks} must be positive and sum to {n_tokens}")
    return chunks


def checked_blocks(blocks: Iterator[LogitBlock], n_tokens: int | None = None) -> Iterator[np.ndarray]:
    """The blocks of a logits stream as float32 ``[B, V]`` arrays, in order, each checked as it
    arrives. Raises ``EngineError`` when blocks are out of order, overlap, have inconsistent
    widths, or (with ``n_tokens``) do not cover exactly ``n_tokens`` positions."""
    expect = 0
    width = None
    for start, block in blocks:
        block = np.asarray(block)
        if block.ndim != 2:
            raise EngineError(f"logit block at {start} has shape {block.shape}, expected [B, V]")
        if start != expect:
            raise EngineError(f"logit block starts at {start}, expected {expect}")
        if width is not None and block.shape[1] != width:
            raise EngineError(f"logit block width {block.shape[1]} != {width}")
        width = block.shape[1]
        expect += block.shape[0]
        yield block.astype(np.float32, copy=False)
    if n_tokens is not None and expect != n_tokens:
        raise EngineError(f"engine returned {expect} positions, expected {n_tokens}")


def gather(blocks: Iterator[LogitBlock], n_tokens: int | None = None) -> np.ndarray:
    """Join logit blocks into one float32 ``[T, V]`` array (use only when T·V is small); the
    checks and errors of ``checked_blocks``."""
    parts = list(checked_blocks(blocks, n_tokens))
    if not parts:
        return np.zeros((0, 0), dtype=np.float32)
    return np.concatenate(parts, axis=0)


def last_row(blocks: Iterator[LogitBlock], n_tokens: int | None = None) -> np.ndarray:
    """The last position's logits, float32 ``[1, V]``, with ``checked_blocks``'s checks, keeping
    one block at a time (a prompt's whole ``[T, V]`` at Qwen3.5's vocabulary is 1 MB a position).
    Raises ``EngineError`` as ``checked_blocks`` does, and for an empty stream."""
    last = None
    for block in checked_blocks(blocks, n_tokens):
        if block.shape[0]:
            last = np.array(block[-1:], dtype=np.float32)
    if last is None:
        raise EngineError("engine returned no positions")
    return last


class BlockPool:
    """Float32 block buffers handed out again once nobody else holds them, so that streaming a
    prompt's logits does not fault in fresh memory for every block: at V = 248,320 a 256-row block
    is 254 MB, and first-touching it cost about 0.3 s (2 MB pages) where a copy into a buffer
    already resident takes 0.03 s (measured on this project's 2-core machine).

    ``take(n_rows, n_vocab)`` returns a ``[n_rows, n_vocab]`` array: a view of a pooled buffer
    whose only holder is the pool (``sys.getrefcount``; a consumer's slice of a block holds its
    buffer), else a new buffer, pooled while fewer than ``size`` are. A block a consumer keeps
    (``gather``, a list of blocks) is never handed out again while it is kept, so every block
    stays valid for as long as anyone holds it."""

    def __init__(self, size: int = 2):
        self.size = int(size)
        self.buffers: list[np.ndarray] = []

    def take(self, n_rows: int, n_vocab: int) -> np.ndarray:
        for buf in self.buffers:
            # 3: the pool's list, the loop variable and getrefcount's own argument
            if buf.shape[1] == n_vocab and buf.shape[0] >= n_rows and sys.getrefcount(buf) <= 3:
                return buf[:n_rows]
        buf = np.empty((n_rows, n_vocab), dtype="<f4")
        if len(self.buffers) < self.size:
            self.buffers.append(buf)
        return buf


FIRST_ROW = "first_row"
"""The capability of a command engine that computes and returns only a prompt's rows from a
given position on (protocol 2 ``"first_row": k``; docs/engine-protocol.md, "Only the scored rows"):
``llama-perplexity`` asks llama.cpp for logits only on each window's second half."""


def from_row(blocks: Iterator[LogitBlock], first: int) -> Iterator[LogitBlock]:
    """The blocks of a full logits stream cut to positions ``first`` on: rows before ``first``
    dropped (a block that straddles it is sliced, a view), starts kept as positions. What the
    harness does for an engine that cannot be asked for those rows alone."""
    for start, block in blocks:
        lo = max(0, int(first) - int(start))
        if lo < len(block):
            yield start + lo, block[lo:]


def shifted(blocks: Iterator[LogitBlock], first: int) -> Iterator[LogitBlock]:
    """An engine's stream of a prompt's rows from ``first`` on, numbered from 0 as the engine
    counts what it returns, renumbered as positions (``start + first``)."""
    for start, block in blocks:
        yield start + int(first), block


def logits_each(engine: Any, prompts: Sequence[Sequence[int]], first_rows: Sequence[int] | None = None) -> Iterator[Iterator[LogitBlock]]:
    """Each prompt's ``engine.logits`` stream, in order: through the engine's own
    ``logits_each`` where its class defines one (the llama.cpp reference: one worker run for a
    whole prompt set; the timing and reference-cache wrappers pass it on), else
    ``engine.logits(p)`` per prompt, lazily. Looked up on the class, never through a wrapper's
    ``__getattr__``: a wrapper that changes logits (a mutant) must not be bypassed. Each stream is
    read before the next is asked for.

    ``first_rows`` (one int per prompt, or None): prompt i's stream holds only positions
    ``first_rows[i]`` .. n − 1, blocks' starts still positions (its first block starts at
    ``first_rows[i]``). A class whose ``logits_each`` takes them (``logits_each_first_rows``) or
    whose ``logits`` takes ``first_row`` (``logits_first_row``) is asked for those rows alone;
    any other engine computes every row and the rows before are dropped here (``from_row``), so
    the rows that remain are the same either way."""
    firsts = [int(k) for k in first_rows] if first_rows is not None else None
    cls = type(engine)
    if firsts is not None and any(firsts):
        if getattr(cls, "logits_each_first_rows", False):
            return engine.logits_each(prompts, first_rows=firsts)
        if getattr(cls, "logits_first_row", False):
            return (engine.logits(p, first_row=k) for p, k in zip(prompts, firsts))
        return (from_row(s, k) for s, k in zip(logits_each(engine, prompts), firsts))
    each = getattr(cls, "logits_each", None)
    if each is None:
        return (engine.logits(p) for p in prompts)
    return engine.logits_each(prompts)


def prestart(engine: Any) -> None:
    """Start ``engine``'s process now where its class can (``prestart``: a protocol-2 command
    engine), so that its start-up (an interpreter and its imports) runs while the reference
    tokenizes and loads instead of after; nothing for an engine without one. Looked up on the
    class, as ``logits_each`` is. A start that fails is left to the first request to report."""
    if getattr(type(engine), "prestart", None) is not None:
        engine.prestart()


def npy_rows(arr: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a ``[T, V]`` array from ``np.load(..., mmap_mode="r")``, as float32.

    A memory-mapped C-order file is read with a plain file read, not through the mapping: pages
    touched through a mapping count in this process's RSS until it is closed, and an engine's
    logits file at Qwen3.5's vocab is 1 MB per position (2 GB for 2,048 positions).
    """
    if isinstance(arr, np.memmap) and arr.filename and arr.ndim == 2 and arr.flags.c_contiguous:
        n = max(0, min(stop, arr.shape[0]) - start)
        rows = np.fromfile(arr.filename, dtype=arr.dtype, count=n * arr.shape[1], offset=arr.offset + start * arr.strides[0])
        return rows.reshape(n, arr.shape[1]).astype(np.float32, copy=False)
    return np.array(arr[start:stop], dtype=np.float32)


def iter_blocks(array: np.ndarray, block_size: int = 256) -> Iterator[LogitBlock]:
    """Yield ``(start, array[start:start+block_size])`` float32 blocks of a ``[T, V]`` array."""
    for start in range(0, array.shape[0], block_size):
        yield start, np.ascontiguousarray(array[start : start + block_size], dtype=np.float32)
