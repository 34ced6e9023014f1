"""The oracle's logits, pinned bit for bit on the committed trained fixtures.

``tests/data/oracle_logits_pinned.json`` holds, for each trained fixture and each prompt of the
shipped default set (token ids as llama.cpp tokenized them when the pins were recorded), the
sha256 of:

* ``float64``: the bytes of ``activations(names=["result_output"])["result_output"]``, the
  float64 logits [T, V] (C order, little-endian) before any rounding;
* ``float32``: the bytes of the float32 blocks ``logits()`` streams, gathered to [T, V];
* ``chunked_float32``: the same prompt fed in pieces (``CHUNKS``: 1 token, 7 tokens, 64 tokens,
  the rest), which runs the recurrent and the chunked delta rule and the carried states.

Any change to the oracle (a refactor, a faster matmul arrangement, a new dequantize path) that
alters a single bit of a single logit fails here: speed work must keep the arithmetic. The
default suite checks every prompt up to 512 tokens (pieces of 64 and more take the chunked delta
rule there too); the 1,026-token prompt runs with ``make test-slow``. The pins
were recorded before the performance work of issue 15; re-record them only for a deliberate
change of the oracle's math, with the reason in the commit message:

    .venv/bin/python tests/test_oracle_pinned.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.engines.base import gather
from harness.engines.oracle import load_oracle
from harness.fixtures import synthetic as fx

PINS = Path(__file__).parent / "data" / "oracle_logits_pinned.json"
TRAINED = ["trained-qwen35", "trained-qwen35moe", "trained-qwen35-256"]
LONG = 512  # prompts longer than this (the 1,026-token prose) run with the slow tests: make test-slow


def chunks_for(n: int) -> list[int]:
    """Pieces 1, 7, 64, rest (as far as the prompt reaches)."""
    out, left = [], n
    for c in (1, 7, 64):
        if left > c:
            out.append(c)
            left -= c
    return out + [left]


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).hexdigest()


def measure(name: str, tokens: list[int]) -> dict[str, str]:
    """The three digests of one prompt on fixture ``name`` with the current oracle."""
    eng = load_oracle(fx.trained_fixtures()[name])
    f64 = eng.activations(tokens, names=["result_output"])["result_output"]
    assert f64.dtype == np.float64 and f64.shape == (len(tokens), eng.n_vocab)
    f32 = gather(eng.logits(tokens), len(tokens))
    c32 = gather(eng.logits(tokens, chunks_for(len(tokens))), len(tokens))
    return {"float64": sha(f64), "float32": sha(f32), "chunked_float32": sha(c32)}


def cases() -> list:
    if not PINS.exists():  # test_pins_cover_every_trained_fixture_and_default_prompt fails then
        return []
    pins = json.loads(PINS.read_text())
    return [
        pytest.param(name, pid, marks=[pytest.mark.slow] if len(p["tokens"]) > LONG else [])
        for name in TRAINED
        for pid, p in pins["fixtures"][name]["prompts"].items()
    ]


@pytest.mark.parametrize("name,prompt_id", cases())
def test_oracle_logits_bitwise_pinned(name, prompt_id):
    pins = json.loads(PINS.read_text())
    fixture = pins["fixtures"][name]
    assert hashlib.sha256(fx.trained_fixtures()[name].read_bytes()).hexdigest() == fixture["model_sha256"], \
        f"{name}.gguf changed since the pins were recorded"
    want = fixture["prompts"][prompt_id]
    got = measure(name, want["tokens"])
    assert got == {k: want[k] for k in got}, f"oracle logits of {name} / {prompt_id} are no longer bitwise identical"


def test_pins_cover_every_trained_fixture_and_default_prompt():
    from harness.compare.prompts import load_prompt_set

    pins = json.loads(PINS.read_text())
    ids = [p.id for p in load_prompt_set(None)]
    assert sorted(pins["fixtures"]) == sorted(TRAINED)
    for name in TRAINED:
        assert list(pins["fixtures"][name]["prompts"]) == ids


def write() -> None:
    """Record the pins with the current code (tokenizing the default prompts with llama.cpp)."""
    from harness.compare.prompts import load_prompt_set, tokenize_prompts
    from harness.engines.llamacpp import LlamaCppEngine

    out: dict = {"schema": "harness-oracle-logits-pins/v1", "fixtures": {}}
    for name in TRAINED:
        path = fx.trained_fixtures()[name]
        toks = tokenize_prompts(load_prompt_set(None), LlamaCppEngine(path))
        prompts = {}
        for p in toks:
            prompts[p.id] = {"tokens": p.tokens, **measure(name, p.tokens)}
            print(name, p.id, len(p.tokens), prompts[p.id]["float64"][:12], flush=True)
        out["fixtures"][name] = {"model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "prompts": prompts}
    PINS.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    write()
