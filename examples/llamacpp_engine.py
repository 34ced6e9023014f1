#!/usr/bin/env python3
"""An example external engine for the harness's command protocol (docs/engine-protocol.md).

Written the way a user's engine would be: directly against llama-cpp-python, importing nothing
from the harness. Two ways to run it:

- protocol 1 (one process per request): ``llamacpp_engine.py REQUEST.json OUT_DIR`` reads the
  request, writes ``OUT_DIR/logits.npy`` (float32 [T, V]) and ``OUT_DIR/info.json``, exits.
- protocol 2 (persistent): ``llamacpp_engine.py --serve`` loads the model once, then reads
  one JSON request per line on stdin and answers each with one JSON line on stdout naming the
  files it wrote into the request's ``out_dir``: ``logits`` (one sequence in chunks, or several
  ``sequences`` decoded side by side, one sequence id each), ``generate`` (greedy ids), ``tokenize``
  (llama.cpp's own tokenizer of the GGUF: ``tokens.json``), sessions
  (``session``: keep the state, checkpoint it, fork from a checkpoint), ``drop``, ``shutdown``. Settings (``n_ubatch``) apply per request.

Each request gets a fresh llama.cpp context on the loaded model (recurrent memory cannot be
trimmed); a session's state between requests is kept as llama.cpp's own sequence state bytes
(``llama_state_seq_get_data`` / ``llama_state_seq_set_data``).
"""

import ctypes
import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np

N_THREADS = 2


def parse_override(text):
    key, _, rest = text.partition("=")
    typ, _, raw = rest.partition(":")
    return key, {"int": int, "float": float, "str": str, "bool": lambda s: s == "true"}[typ](raw)


def load(model_path, overrides):
    overrides = dict(parse_override(o) for o in overrides)
    return llama_cpp.Llama(model_path, n_ctx=512, n_threads=N_THREADS, logits_all=False, verbose=False, kv_overrides=overrides or None)


class Context:
    """One llama.cpp context on the loaded model: ``n_seq`` sequences, ``n_ubatch`` tokens per graph."""

    def __init__(self, llm, n_ctx, n_seq=1, n_ubatch=512):
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, min(n_ubatch, 512), n_seq
        p.n_threads = p.n_threads_batch = N_THREADS
        p.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(llm.model, p)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.n_vocab = llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(self, items):
        """items: [(token, pos, seq)], at most 512; returns their logits float32 [n, V]."""
        b = self.batch
        for i, (tok, pos, seq) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, 1
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if llama_cpp.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        ptr = llama_cpp.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(items), self.n_vocab)).copy()

    def feed(self, tokens, start_pos=0, chunks=None, seq=0):
        """Feed one sequence's tokens in the given chunks (each in batches of 512); [T, V]."""
        rows, pos = [], 0
        for c in chunks or [len(tokens)]:
            end = pos + c
            while pos < end:
                k = min(512, end - pos)
                rows.append(self.decode([(tokens[pos + i], start_pos + pos + i, seq) for i in range(k)]))
                pos += k
        return np.concatenate(rows) if rows else np.zeros((0, self.n_vocab), np.float32)

    def save(self, seq=0):
        n = llama_cpp.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * n)()
        llama_cpp.llama_state_seq_get_data(self.ctx, buf, n, seq)
        return bytes(buf)

    def restore(self, data, seq=0):
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(data), seq) != len(data):
            raise RuntimeError("llama_state_seq_set_data failed")

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def n_ctx_for(n):
    return max(512, -(-n // 256) * 256)


class Engine:
    """The loaded model and the sessions kept between requests: {id: {position: state bytes}}."""

    def __init__(self, model_path, overrides):
        self.model_path, self.overrides = model_path, list(overrides)
        self.llm = load(model_path, overrides)
        self.sessions = {}

    def info(self, req):
        return {"name": "example-llamacpp", "version": llama_cpp.__version__, "compute_class": "f32",
                "settings": {"n_batch": 512, "n_ubatch": int((req.get("settings") or {}).get("n_ubatch", 512)),
                             "n_threads": N_THREADS, "backend": "cpu", "overrides": self.overrides}}

    def logits(self, req):
        n_ubatch = int((req.get("settings") or {}).get("n_ubatch", 512))
        if req.get("sequences"):
            return self.side_by_side(req["sequences"], n_ubatch)
        tokens, session = req["tokens"], req.get("session")
        if not session:
            ctx = Context(self.llm, n_ctx_for(len(tokens)), n_ubatch=n_ubatch)
            try:
                return ctx.feed(tokens, chunks=req.get("chunks"))
            finally:
                ctx.close()
        return self.in_session(tokens, session, n_ubatch)

    def in_session(self, tokens, s, n_ubatch):
        """Feed tokens after the parent's state at ``after`` (a checkpoint), keep checkpoints."""
        after = int(s.get("after", 0))
        start = {} if s.get("parent") is None else self.sessions.get(s["parent"], {})
        if s.get("parent") is not None and after not in start:
            raise ValueError(f"session {s['parent']!r} has no state after {after} tokens")
        ctx = Context(self.llm, n_ctx_for(after + len(tokens)), n_ubatch=n_ubatch)
        try:
            if s.get("parent") is not None:
                ctx.restore(start[after])
            keep = {after: start[after]} if s.get("parent") == s["id"] else {}
            cuts = sorted({int(k) - after for k in s.get("checkpoints", []) if after < int(k) < after + len(tokens)} | {len(tokens)})
            rows, done = [], 0
            for cut in cuts:  # feed up to each checkpoint, save the state there
                rows.append(ctx.feed(tokens[done:cut], start_pos=after + done))
                keep[after + cut] = ctx.save()
                done = cut
            self.sessions[s["id"]] = {**(self.sessions.get(s["id"], {}) if s.get("parent") == s["id"] else {}), **keep}
            return np.concatenate(rows)
        finally:
            ctx.close()

    def side_by_side(self, sequences, n_ubatch):
        """Sequences decoded together, one sequence id each; rows concatenated in order."""
        seqs = [q["tokens"] for q in sequences]
        ctx = Context(self.llm, n_ctx_for(sum(map(len, seqs))), n_seq=len(seqs), n_ubatch=n_ubatch)
        try:
            out = [np.zeros((len(q), ctx.n_vocab), np.float32) for q in seqs]
            per = max(1, 512 // len(seqs))
            for start in range(0, max(map(len, seqs)), per):
                items = [(q[p], p, i) for i, q in enumerate(seqs) for p in range(start, min(start + per, len(q)))]
                rows = ctx.decode(items)
                for (_, p, i), row in zip(items, rows):
                    out[i][p] = row
            return np.concatenate(out)
        finally:
            ctx.close()

    def generate(self, req):
        tokens, n = req["tokens"], int(req["n_tokens"])
        ctx = Context(self.llm, n_ctx_for(len(tokens) + n), n_ubatch=int((req.get("settings") or {}).get("n_ubatch", 512)))
        try:
            last, out = ctx.feed(tokens)[-1], []
            while len(out) < n:
                out.append(int(np.argmax(last)))
                if len(out) < n:
                    last = ctx.decode([(out[-1], len(tokens) + len(out) - 1, 0)])[-1]
            return out
        finally:
            ctx.close()

    def handle(self, req):
        """One request; returns the reply (without ``id``)."""
        op, out = req.get("op", "logits"), Path(req.get("out_dir", "."))
        if op == "shutdown":
            return {"ok": True, "files": []}
        if op == "drop":
            for sid in req.get("sessions") or list(self.sessions):
                self.sessions.pop(sid, None)
            return {"ok": True, "files": []}
        (out / "info.json").write_text(json.dumps(self.info(req)))
        if op == "tokenize":  # llama.cpp's own tokenizer of the GGUF: what this engine's users get
            ids = self.llm.tokenize(req["text"].encode("utf-8"), add_bos=bool(req.get("add_special")), special=False)
            (out / "tokens.json").write_text(json.dumps(ids))
            return {"ok": True, "files": ["tokens.json", "info.json"]}
        if op == "generate":
            (out / "tokens.json").write_text(json.dumps(self.generate(req)))
            return {"ok": True, "files": ["tokens.json", "info.json"]}
        np.save(out / "logits.npy", self.logits(req).astype(np.float32))
        return {"ok": True, "files": ["logits.npy", "info.json"]}


def serve():
    """Protocol 2: one JSON request per stdin line, one JSON reply per stdout line; the model
    (and its overrides) named by the requests is loaded on the first and kept."""
    engine = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if engine is None or engine.model_path != req["model"] or engine.overrides != req.get("overrides", []):
                engine = Engine(req["model"], req.get("overrides", []))
            reply = engine.handle(req)
        except Exception as e:  # the harness shows the message; the engine keeps serving
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps({"id": req.get("id"), **reply}) + "\n")
        sys.stdout.flush()
        if req.get("op") == "shutdown":
            return


def main(request_path, out_dir):
    """Protocol 1: one request file, outputs in out_dir, exit."""
    req = json.loads(Path(request_path).read_text())
    engine = Engine(req["model"], req.get("overrides", []))
    engine.handle({**req, "out_dir": out_dir})


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
