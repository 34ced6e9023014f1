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
alters a single bit of a single logit fails here: speed work must keep the arithmetic.

The bits also depend on which BLAS kernel NumPy runs (OpenBLAS picks one per processor, or takes
``OPENBLAS_CORETYPE``: Haswell and SkylakeX kernels give different last bits). So the digests are
recorded per kernel and processor (``kernels``, keyed by threadpoolctl's ``internal_api``-``architecture``
and the CPU model, ``blas_kernel``), and
each prompt also carries a sample of its float64 logits (``sample``: 64 entries at seeded
positions, as Python floats). On a kernel with digests the check is bitwise; on a kernel none were
recorded for, the sample must match to 1e-9 relative (kernels differ around 1e-13; any change of
the math moves logits by far more), and float32 whole vs fed in pieces must be bit-identical to
each other. The test's id names which check ran. The default suite checks every prompt up to 512
tokens (pieces of 64 and more take the chunked delta rule there too); the 1,026-token prompt runs
with ``make test-slow``. The pins were recorded before the performance work of issue 15 (SkylakeX
kernel); re-record them only for a deliberate change of the oracle's math, with the reason in the
commit message, or add the digests of another kernel (keeps the others):

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


def cpu_model() -> str:
    """The processor as ``/proc/cpuinfo`` names it: model name, then family, model and cache size
    where given (``AMD EPYC f26 m2 1024 KB``; ``platform.processor()`` elsewhere), or ``unknown``.
    A virtual machine may report a bare ``AMD EPYC`` for every generation: the Haswell kernel on
    an ``AMD EPYC`` of family 26 gave other float64 last bits than on the ``AMD EPYC`` the first
    such digests came from (its blocking follows the caches), so the name alone is not a key."""
    import platform
    import re

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            info = f.read()
    except OSError:
        return " ".join((platform.processor() or "unknown").split())

    def field(key: str) -> str | None:
        m = re.search(rf"^{key}\s*:\s*(.+)$", info, re.M)
        return " ".join(m.group(1).split()) if m else None

    name = field("model name") or platform.processor() or "unknown"
    family, model, cache = field("cpu family"), field("model"), field("cache size")
    extra = " ".join(x for x in (family and f"f{family}", model and f"m{model}", cache) if x)
    return " ".join(f"{name} {extra}".split())


def blas_kernel() -> str:
    """The BLAS kernel NumPy runs and the processor it runs on, e.g. ``openblas-Haswell@AMD EPYC
    f26 m2 1024 KB`` (threadpoolctl, ``cpu_model``): one OpenBLAS kernel gives other last bits on
    another processor (its blocking follows the caches: the Haswell kernel on an AMD EPYC is not
    bit-identical to it on the machine the first Haswell digests came from), so digests are matched
    per kernel and processor. Keys recorded before the processor was part of them (no ``@``), or
    before its family, model and cache size were (``@AMD EPYC``), are kept but match nothing: on
    those machines the sample check runs."""
    from threadpoolctl import threadpool_info

    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    kernel = "-".join(str(blas[0].get(k)) for k in ("internal_api", "architecture")) if blas else "unknown"
    return f"{kernel}@{cpu_model()}"


SAMPLE_N = 64
SAMPLE_RTOL = 1e-9


def sample_at(f64: np.ndarray) -> dict[str, list]:
    """``SAMPLE_N`` entries of the float64 logits [T, V] at seeded (row, column) positions."""
    rng = np.random.default_rng(0)
    rows, cols = rng.integers(0, f64.shape[0], SAMPLE_N), rng.integers(0, f64.shape[1], SAMPLE_N)
    return {"rows": rows.tolist(), "cols": cols.tolist(), "float64": [float(x) for x in f64[rows, cols]]}


def measure(name: str, tokens: list[int]) -> tuple[dict[str, str], np.ndarray]:
    """The three digests of one prompt on fixture ``name`` with the current oracle, and its
    float64 logits."""
    eng = load_oracle(fx.trained_fixtures()[name])
    f64 = eng.activations(tokens, names=["result_output"])["result_output"]
    assert f64.dtype == np.float64 and f64.shape == (len(tokens), eng.n_vocab)
    f32 = gather(eng.logits(tokens), len(tokens))
    c32 = gather(eng.logits(tokens, chunks_for(len(tokens))), len(tokens))
    return {"float64": sha(f64), "float32": sha(f32), "chunked_float32": sha(c32)}, f64


def cases() -> list:
    if not PINS.exists():  # test_pins_cover_every_trained_fixture_and_default_prompt fails then
        return []
    pins = json.loads(PINS.read_text())
    kernel = blas_kernel()
    out = []
    for name in TRAINED:
        for pid, p in pins["fixtures"][name]["prompts"].items():
            how = "bitwise" if kernel in p["kernels"] else "sample"
            out.append(pytest.param(name, pid, how, id=f"{name}-{pid}-{how}-{kernel}",
                                    marks=[pytest.mark.slow] if len(p["tokens"]) > LONG else []))
    return out


@pytest.mark.parametrize("name,prompt_id,how", cases())
def test_oracle_logits_pinned(name, prompt_id, how):
    pins = json.loads(PINS.read_text())
    fixture = pins["fixtures"][name]
    assert hashlib.sha256(fx.trained_fixtures()[name].read_bytes()).hexdigest() == fixture["model_sha256"], \
        f"{name}.gguf changed since the pins were recorded"
    want = fixture["prompts"][prompt_id]
    got, f64 = measure(name, want["tokens"])
    if how == "bitwise":
        pinned = want["kernels"][blas_kernel()]
        assert got == {k: pinned[k] for k in got}, f"oracle logits of {name} / {prompt_id} are no longer bitwise identical"
    else:
        s = want["sample"]
        np.testing.assert_allclose(f64[s["rows"], s["cols"]], s["float64"], rtol=SAMPLE_RTOL, atol=0,
                                   err_msg=f"oracle logits of {name} / {prompt_id} moved (kernel {blas_kernel()} has no digests)")
        assert got["float32"] == got["chunked_float32"], f"{name} / {prompt_id}: float32 logits differ fed in pieces"


def test_sample_check_sees_a_one_ulp_change_of_the_math():
    """The fallback check is not blind: logits moved by a relative 1e-8 fail it."""
    pins = json.loads(PINS.read_text())
    s = pins["fixtures"]["trained-qwen35"]["prompts"]["code-python"]["sample"]
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(np.array(s["float64"]) * (1 + 1e-8), s["float64"], rtol=SAMPLE_RTOL, atol=0)


def test_pins_cover_every_trained_fixture_and_default_prompt():
    from harness.measure.prompts import load_prompt_set

    pins = json.loads(PINS.read_text())
    ids = [p.id for p in load_prompt_set(None)]
    assert sorted(pins["fixtures"]) == sorted(TRAINED)
    for name in TRAINED:
        assert list(pins["fixtures"][name]["prompts"]) == ids


def write() -> None:
    """Record the current kernel's digests with the current code (tokenizing the default prompts
    with llama.cpp), keeping other kernels' digests when the tokens and model are unchanged, and
    each prompt's float64 sample."""
    from harness.measure.prompts import load_prompt_set, tokenize_prompts
    from harness.engines.llamacpp import LlamaCppEngine

    old = json.loads(PINS.read_text()) if PINS.exists() else {"fixtures": {}}
    out: dict = {"schema": "harness-oracle-logits-pins/v2", "fixtures": {}}
    kernel = blas_kernel()
    for name in TRAINED:
        path = fx.trained_fixtures()[name]
        model_sha = hashlib.sha256(path.read_bytes()).hexdigest()
        before = old["fixtures"].get(name, {})
        toks = tokenize_prompts(load_prompt_set(None), LlamaCppEngine(path))
        prompts = {}
        for p in toks:
            digests, f64 = measure(name, p.tokens)
            prev = before.get("prompts", {}).get(p.id, {})
            kept = prev.get("kernels", {}) if before.get("model_sha256") == model_sha and prev.get("tokens") == p.tokens else {}
            prompts[p.id] = {"tokens": p.tokens, "kernels": {**kept, kernel: digests}, "sample": sample_at(f64)}
            print(name, p.id, len(p.tokens), kernel, digests["float64"][:12], flush=True)
        out["fixtures"][name] = {"model_sha256": model_sha, "prompts": prompts}
    PINS.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    write()
