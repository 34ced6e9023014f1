#!/usr/bin/env python3
"""An example external engine for the harness's command protocol (docs/engine-protocol.md).

Written the way a user's engine would be: directly against llama-cpp-python, importing nothing
from the harness. Usage (the harness runs it): ``llamacpp_engine.py REQUEST.json OUT_DIR``.
Reads the request, feeds the token ids (in the requested chunks, state carried in one context),
writes ``OUT_DIR/logits.npy`` (float32 [T, V]) and ``OUT_DIR/info.json``.
"""

import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np


def parse_override(text):
    key, _, rest = text.partition("=")
    typ, _, raw = rest.partition(":")
    return key, {"int": int, "float": float, "str": str, "bool": lambda s: s == "true"}[typ](raw)


def main(request_path, out_dir):
    req = json.loads(Path(request_path).read_text())
    tokens = req["tokens"]
    chunks = req.get("chunks") or [len(tokens)]
    overrides = dict(parse_override(o) for o in req.get("overrides", []))
    n_ctx = max(512, len(tokens))
    llm = llama_cpp.Llama(
        req["model"], n_ctx=n_ctx, n_batch=512, n_threads=2, logits_all=True, verbose=False,
        kv_overrides=overrides or None,
    )
    start = 0
    for c in chunks:  # one eval per piece; the context carries the recurrent state
        llm.eval(tokens[start:start + c])
        start += c
    logits = np.asarray(llm.scores[: len(tokens)], dtype=np.float32)
    out = Path(out_dir)
    np.save(out / "logits.npy", logits)
    info = {"name": "example-llamacpp", "version": llama_cpp.__version__, "compute_class": "f32",
            "settings": {"n_ctx": n_ctx, "n_batch": 512, "n_threads": 2, "backend": "cpu", "overrides": req.get("overrides", [])}}
    (out / "info.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
