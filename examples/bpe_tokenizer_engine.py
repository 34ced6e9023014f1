#!/usr/bin/env python3
"""A tokenize-only engine with a byte-level BPE tokenizer of its own (docs/engine-protocol.md,
"Tokenizers"), for the harness's tokenizer check.

Written the way an engine author writes a tokenizer for a GGUF: read ``tokenizer.ggml.tokens`` and
``tokenizer.ggml.merges`` with the ``gguf`` package, split the text with the pre-tokenizer regex
``tokenizer.ggml.pre`` names, map each piece's UTF-8 bytes to GPT-2's printable characters
(openai/gpt-2 ``encoder.py`` ``bytes_to_unicode``) and apply the merges lowest rank first. It
imports nothing from the harness. Protocol 2 (``--serve``), op ``tokenize`` only: ``tokens.json``.

Two planted faults, each one flag, reproduce real tokenizer bugs (the harness's tokenizer check
must FAIL them, naming the position and the tokens):

- ``--pre gpt2``: split with GPT-2's pre-tokenizer regex whatever the file says (imp PR #983:
  ``pre="qwen35"`` fell back to gpt2: more tokens, non-canonical splits);
- ``--drop-merge RANK``: forget the merge of that rank (a merges list read off by one line, or a
  merge whose text did not survive a conversion).
"""

import argparse
import json
import sys
from pathlib import Path

import regex
from gguf import GGUFReader

PRE_REGEX = {
    # llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN35 (Qwen3.5's tokenizer.json
    # pre_tokenizer Split pattern; \p{M} joins letters, unlike qwen2's)
    "qwen35": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    # llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    # GPT-2's encoder.py pattern (llama.cpp LLAMA_VOCAB_PRE_TYPE_GPT2)
    "gpt2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
}


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    if len(f.data) == 1 and f.types and f.types[0].name != "ARRAY":
        v = f.parts[f.data[0]]
        return bytes(v).decode("utf-8") if f.types[0].name == "STRING" else v.tolist()[0]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data] if f.types[-1].name == "STRING" else [f.parts[i].tolist()[0] for i in f.data]


class Tokenizer:
    """Byte-level BPE of one GGUF: ``encode(text, add_special)`` -> ids."""

    def __init__(self, model_path, pre=None, drop_merge=None):
        r = GGUFReader(model_path)
        tokens = _field(r, "tokenizer.ggml.tokens")
        merges = _field(r, "tokenizer.ggml.merges") or []
        if drop_merge is not None:
            merges = merges[:drop_merge] + merges[drop_merge + 1:]
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.pre = pre or _field(r, "tokenizer.ggml.pre") or "gpt2"
        if self.pre not in PRE_REGEX:
            raise ValueError(f"no pre-tokenizer regex for {self.pre!r}")
        self.split = regex.compile(PRE_REGEX[self.pre])
        self.b2u = bytes_to_unicode()
        self.bos = _field(r, "tokenizer.ggml.bos_token_id")
        self.add_bos = bool(_field(r, "tokenizer.ggml.add_bos_token"))
        self.cache = {}

    def bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best = min((p for p in pairs if p[0] is not None), default=None)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        out = []
        for p in parts:
            if p in self.ids:
                out.append(self.ids[p])
            else:  # not in the vocabulary: its single bytes
                out.extend(self.ids[ch] for ch in p)
        self.cache[word] = out
        return out

    def encode(self, text, add_special=False):
        ids = [self.bos] if add_special and self.add_bos and self.bos is not None else []
        for piece in self.split.findall(text):
            ids.extend(self.bpe("".join(self.b2u[b] for b in piece.encode("utf-8"))))
        return ids


def serve(args):
    """Protocol 2: one JSON request per stdin line, one reply per stdout line."""
    tok = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req.get("op") == "shutdown":
                reply = {"ok": True, "files": []}
            elif req.get("op") != "tokenize":
                reply = {"ok": False, "error": f"this engine only tokenizes (op {req.get('op')!r})"}
            else:
                if tok is None or tok.path != req["model"]:
                    tok = Tokenizer(req["model"], args.pre, args.drop_merge)
                    tok.path = req["model"]
                out = Path(req["out_dir"])
                (out / "tokens.json").write_text(json.dumps(tok.encode(req["text"], bool(req.get("add_special")))))
                (out / "info.json").write_text(json.dumps({"name": "example-bpe", "version": "1",
                                                           "settings": {"pre": tok.pre, "drop_merge": args.drop_merge}}))
                reply = {"ok": True, "files": ["tokens.json", "info.json"]}
        except Exception as e:  # the harness shows the message; the engine keeps serving
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps({"id": req.get("id"), **reply}) + "\n")
        sys.stdout.flush()
        if req.get("op") == "shutdown":
            return


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true", required=True)
    ap.add_argument("--pre", choices=sorted(PRE_REGEX), default=None, help="planted fault: this pre-tokenizer regex, not the file's")
    ap.add_argument("--drop-merge", type=int, default=None, metavar="RANK", help="planted fault: forget the merge of this rank")
    serve(ap.parse_args())
