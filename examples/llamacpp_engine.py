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
  (``session``: keep the state, checkpoint it, fork from a checkpoint), ``draft`` (the MTP head's
  draft logits through llama.cpp's own MTP context, llama.cpp's row convention; refused on a
  model without an MTP block), ``serve`` (a whole serving scenario through this engine's own
  scheduler: sequence ids as slots, continuous batching, a prompt cache of sequence states; see
  ``Server``), ``drop``, ``shutdown``. Settings (``n_ubatch``) apply per request.
- ``llamacpp_engine.py --capabilities`` prints ``{"version", "capabilities"}``: the protocol
  capabilities these bindings give (``mtp`` and ``speculative`` only where llama-cpp-python has the
  nextn API, 0.3.36 but not 0.3.17; ``serve`` where they have the memory and sequence-state API);
  an engine table declares these (pyproject.toml).

Each request gets a fresh llama.cpp context on the loaded model (recurrent memory cannot be
trimmed); a session's state between requests is kept as llama.cpp's own sequence state bytes
(``llama_state_seq_get_data`` / ``llama_state_seq_set_data``).
"""

import ctypes
import json
import logging
import os
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

# The harness runs its llama.cpp reference beside this engine, often on the same few cores. With
# OpenMP's default wait policy each of llama.cpp's threads spins at every barrier of the graph
# while the other process holds the core it waits for; passive waiting sleeps instead (the same
# arithmetic, so the same logits). Read by libgomp when llama.cpp loads: set before the import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

try:  # llama.cpp's nextn (MTP) staging API: experimental bindings, absent before llama-cpp-python 0.3.36
    from llama_cpp import llama_cpp_ext
except ImportError:
    llama_cpp_ext = None

N_THREADS = 2
GIVEN_MAX = 8  # the most given drafts per step verified (the harness's SPEC_GIVEN_MAX)
HAS_MTP = (llama_cpp_ext is not None and hasattr(llama_cpp, "llama_model_n_layer_nextn")
           and hasattr(llama_cpp, "LLAMA_CONTEXT_TYPE_MTP")
           and "load_mtp" in dict(llama_cpp.llama_model_params._fields_))
"""Whether these bindings can run the MTP (nextn) head: the ``llama_cpp_ext`` staging module, the
``load_mtp`` model parameter, ``llama_model_n_layer_nextn`` and the MTP context type. llama-cpp-python
0.3.17 (llama.cpp 49bfddec) has none of them; 0.3.36 has all."""
HAS_SERVE = all(hasattr(llama_cpp, f) for f in ("llama_get_memory", "llama_memory_seq_rm", "llama_state_seq_get_size",
                                                 "llama_state_seq_get_data", "llama_state_seq_set_data"))
"""Whether these bindings have what op ``serve`` uses: clearing one sequence of the memory
(``llama_memory_seq_rm``) and one sequence's state bytes (``llama_state_seq_get_data`` /
``set_data``)."""
CAPABILITIES = ["chunks", "multi_seq", "n_ubatch", "generate", "prefix_reuse", "tokenize", "logits_ring", "first_row"] + (
    ["mtp", "mtp_chain", "speculative"] if HAS_MTP else []) + (["serve"] if HAS_SERVE else [])
"""The protocol capabilities this engine has with the bindings it runs on (``--capabilities`` prints
them): an engine table in the harness's config should declare these and no more."""
NO_MTP = (f"these bindings (llama-cpp-python {llama_cpp.__version__}) have no MTP (nextn) API: "
          "no llama_cpp_ext, load_mtp or LLAMA_CONTEXT_TYPE_MTP")


def parse_override(text):
    key, _, rest = text.partition("=")
    typ, _, raw = rest.partition(":")
    return key, {"int": int, "float": float, "str": str, "bool": lambda s: s == "true"}[typ](raw)


def kv_override_array(overrides):
    """``--override-kv KEY=TYPE:VALUE`` strings as llama.cpp's NUL-terminated
    ``llama_model_kv_override`` array (None when there are none); kept alive with the model."""
    if not overrides:
        return None
    arr = (llama_cpp.llama_model_kv_override * (len(overrides) + 1))()
    for i, (key, value) in enumerate(parse_override(o) for o in overrides):
        arr[i].key = key.encode()
        if isinstance(value, bool):
            arr[i].tag, arr[i].value.val_bool = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_BOOL, value
        elif isinstance(value, int):
            arr[i].tag, arr[i].value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, value
        elif isinstance(value, float):
            arr[i].tag, arr[i].value.val_f64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_FLOAT, value
        else:
            arr[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
            at = ctypes.addressof(arr[i].value) + llama_cpp.llama_model_kv_override_value.val_str.offset
            ctypes.memmove(at, value.encode()[:127].ljust(128, b"\0"), 128)
    arr[len(overrides)].key = b"\0"
    return arr


class Model:
    """The GGUF loaded once through llama.cpp's C API, with its MTP (nextn) tensors: llama.cpp
    skips them unless ``load_mtp`` is set, and the trunk's logits are the same bytes either way.
    ``n_nextn`` is the number of MTP blocks (``llama_model_n_layer_nextn``; 0: no draft head)."""

    def __init__(self, model_path, overrides):
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's log lines: errors only
        llama_cpp.llama_backend_init()
        p = llama_cpp.llama_model_default_params()
        if HAS_MTP:
            p.load_mtp = True
        self._kv = kv_override_array(overrides)
        if self._kv is not None:
            p.kv_overrides = self._kv
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), p)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed for {model_path}")
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model)))
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.model))
        self.n_nextn = int(llama_cpp.llama_model_n_layer_nextn(self.model)) if HAS_MTP else 0

    def tokenize(self, text: bytes, add_bos: bool = False, special: bool = False) -> list:
        """llama.cpp's own tokenization of ``text`` (``llama_tokenize``): BOS/EOS only with
        ``add_bos`` and where the vocabulary asks for them, special-token strings parsed only
        with ``special``."""
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        n_max = len(text) + 16
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, n_max, add_bos, special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} slots")
        return [int(buf[i]) for i in range(n)]


class Context:
    """One llama.cpp context on the loaded model: ``n_seq`` sequences, ``n_ubatch`` tokens per graph.
    ``other``: the trunk context this one is the MTP context of (``LLAMA_CONTEXT_TYPE_MTP``: its own
    KV cache, holding the nextn block only; its batches carry a token and an embedding per row)."""

    def __init__(self, model, n_ctx, n_seq=1, n_ubatch=512, other=None):
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, min(n_ubatch, 512), n_seq
        p.n_threads = p.n_threads_batch = N_THREADS
        p.kv_unified = True
        if other is not None:
            p.ctx_type, p.ctx_other = llama_cpp.LLAMA_CONTEXT_TYPE_MTP, other.ctx
        self.ctx = llama_cpp.llama_init_from_model(model.model, p)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.n_vocab, self.n_embd = model.n_vocab, model.n_embd
        if other is None:
            self.batch = llama_cpp.llama_batch_init(512, 0, 1)
            self.tokens = None
        else:  # with embd allocated, llama_batch_init leaves token NULL: give it an array of ours
            self.batch = llama_cpp.llama_batch_init(512, model.n_embd, 1)
            self.tokens = (llama_cpp.llama_token * 512)()
            self.batch.token = ctypes.cast(self.tokens, type(self.batch.token))

    def run(self, items, embd=None, first_row=0):
        """One ``llama_decode`` of items = [(token, pos, seq)], at most 512, logits on every row
        at a position from ``first_row`` on (``batch.logits``: llama.cpp computes no other row's,
        as llama-perplexity asks for a window's second half); ``embd`` float32 [n, n_embd]: the
        rows' embeddings (MTP context only). Returns the number of rows with logits."""
        b = self.batch
        for i, (tok, pos, seq) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(pos >= first_row)
            b.seq_id[i][0] = seq
        if embd is not None:
            np.ctypeslib.as_array(b.embd, shape=(512, self.n_embd))[: len(items)] = embd
        b.n_tokens = len(items)
        if llama_cpp.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return sum(pos >= first_row for _, pos, _ in items)

    def decode(self, items, embd=None):
        """``run``, then the rows' logits float32 [n, V]."""
        self.run(items, embd)
        ptr = llama_cpp.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(items), self.n_vocab)).copy()

    def feed(self, tokens, start_pos=0, chunks=None, seq=0, sink=None, first_row=0):
        """Feed one sequence's tokens in the given chunks (each in batches of 512); [T, V], or
        [T − first_row, V]: the rows from position ``first_row`` on alone (the request's
        ``first_row``). With ``sink``, each batch's rows (a view of llama.cpp's output buffer) go
        to ``sink(rows)`` instead, and nothing is returned."""
        rows, pos = [], 0
        for c in chunks or [len(tokens)]:
            end = pos + c
            while pos < end:
                k = min(512, end - pos)
                items = [(tokens[pos + i], start_pos + pos + i, seq) for i in range(k)]
                n = self.run(items, first_row=first_row)
                if n:
                    out = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=(n, self.n_vocab))
                    if sink is None:
                        rows.append(out.copy())
                    else:
                        sink(out)
                pos += k
        if sink is None:
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
        if self.tokens is not None:
            self.batch.token = None  # ours: llama_batch_free would free() it
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


class Ring:
    """The harness's shared-memory logits ring (capability ``logits_ring``; the request's
    ``logits_ring``: ``path``, ``slots``, ``rows``): rows are written in order into slots 0, 1, ...
    of the file (slot k at byte k * rows * V * 4), each block announced on stdout as
    ``{"id", "block": {"slot", "start", "rows"}}``; a slot is written again only after the harness
    acknowledged it on stdin (``{"id", "ack": slot}``, in order), and ``finish`` reads the acks
    still due before the final reply."""

    def __init__(self, spec, req_id):
        self.fd = os.open(spec["path"], os.O_RDWR)
        self.slots, self.rows, self.id = int(spec["slots"]), int(spec["rows"]), req_id
        self.sent = self.acked = self.start = 0

    def write(self, rows):
        for i in range(0, len(rows), self.rows):
            part = np.ascontiguousarray(rows[i : i + self.rows], dtype=np.float32)
            if self.sent - self.acked == self.slots:
                self.wait_ack()
            slot = self.sent % self.slots
            data, at = memoryview(part).cast("B"), slot * self.rows * part.shape[1] * 4
            while data.nbytes:
                n = os.pwrite(self.fd, data, at)
                data, at = data[n:], at + n
            sys.stdout.write(json.dumps({"id": self.id, "block": {"slot": slot, "start": self.start, "rows": len(part)}}) + "\n")
            sys.stdout.flush()
            self.sent, self.start = self.sent + 1, self.start + len(part)

    def wait_ack(self):
        msg = json.loads(sys.stdin.readline() or "null")
        if not isinstance(msg, dict) or msg.get("id") != self.id or msg.get("ack") != self.acked % self.slots:
            raise RuntimeError(f"expected the harness's ack of slot {self.acked % self.slots}, got {str(msg)[:80]}")
        self.acked += 1

    def finish(self):
        while self.acked < self.sent:
            self.wait_ack()
        os.close(self.fd)


def n_ctx_for(n):
    return max(512, -(-n // 256) * 256)


def batches(seqs, chunks=None):
    """The trunk's llama_decode batches, [(token, pos, seq)] each: one sequence in its ``chunks``
    (each piece in batches of 512), or several side by side (512 // n tokens of each per batch)."""
    if len(seqs) == 1:
        pos = 0
        for c in chunks or [len(seqs[0])]:
            end = pos + c
            while pos < end:
                k = min(512, end - pos)
                yield [(seqs[0][pos + i], pos + i, 0) for i in range(k)]
                pos += k
        return
    per = max(1, 512 // len(seqs))
    for start in range(0, max(map(len, seqs)), per):
        yield [(q[p], p, i) for i, q in enumerate(seqs) for p in range(start, min(start + per, len(q)))]


def chain(head, g, draft_tokens):
    """Depth 2 of op ``draft`` after its teacher-forced rows (llama.cpp's position convention):
    for draft row t, last to first, the head's KV cells after its row p = t + 1 are removed
    (``llama_memory_seq_rm``, as a drafting step removes its draft rows) and the row (g_p, d_t)
    is decoded at position p + 1, g_p the head's own nextn embedding of row p (after its head
    norm: what ``propose`` chains) and d_t ``draft_tokens[t]``. Returns float32 [T − 1, V]."""
    mem = llama_cpp.llama_get_memory(head.ctx)
    out = np.zeros((len(draft_tokens), head.n_vocab), np.float32)
    for t in range(len(draft_tokens) - 1, -1, -1):
        llama_cpp.llama_memory_seq_rm(mem, 0, t + 2, -1)
        out[t] = head.decode([(int(draft_tokens[t]), t + 2, 0)], g[t + 1][None])[0]
    return out


def propose(head, wants):
    """Step 1 of ``Engine.speculative`` and of a speculating request's step in ``Server``: chained
    drafts from the MTP context ``head`` for each sequence q in ``wants`` = {q: (t, P, h_{P-1}, k)}:
    the head decodes (h_{P-1}, t) at P, then
    (g_i, d_i) at P + i, g_i its own nextn embedding (post-norm) of the row before, d_i the
    argmax (ties: lowest id), all drafting sequences in one batch per round. Returns
    {q: [d_1 ... d_k]}; the draft rows stay in the head's KV cache (the caller removes them)."""
    drafts = {q: [] for q in wants}
    rows = [(t, p, q) for q, (t, p, _, k) in wants.items() if k > 0]
    embd = [h for _, _, h, k in wants.values() if k > 0]
    while rows:
        logits = head.decode(rows, np.stack(embd))
        g = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn(head.ctx), shape=(len(rows), head.n_embd)).copy()
        nxt, nemb = [], []
        for j, (_, p, q) in enumerate(rows):
            drafts[q].append(int(np.argmax(logits[j])))
            if len(drafts[q]) < wants[q][3]:
                nxt.append((drafts[q][-1], p + 1, q))
                nemb.append(g[j])
        rows, embd = nxt, nemb
    return drafts


SERVE_SLOTS = 8
"""Sequence ids of op ``serve``'s context (``n_seq_max``): the slots, more than any shipped
scenario keeps in flight; a request takes the lowest free one."""
SERVE_CHUNK = 64
"""Most prompt tokens one request feeds in one ``llama_decode`` (a prefill chunk): 8 slots × 64
fill one batch of 512."""
SERVE_BLOCK = 64
"""The prompt cache's grid: a request's sequence state is kept after every multiple of this many
prompt tokens (prefill chunks are cut there), and at its end."""
SERVE_CACHE = 256
"""Sequence states the prompt cache keeps; the oldest is dropped first."""


class Running:
    """A request in a slot (sequence id ``seq``): its whole ``prompt`` (a continuation's history
    included), the prefix restored from the cache (``cached``), the next position to feed
    (``pos``), the tokens it emitted, and its logit rows from position ``cached`` on, spilled to a
    temporary file as float32 as they are computed (``n_rows`` of them). ``draft_max``: the
    request's own (None: it does not speculate)."""

    def __init__(self, req, seq, prompt, cached):
        self.req, self.seq, self.prompt, self.cached, self.pos = req, seq, prompt, cached, cached
        n, k = int(req["n_tokens"]), req.get("abort_after")
        self.emits = n if k is None else min(int(k), n)
        self.draft_max = None if req.get("draft_max") is None else int(req["draft_max"])
        self.tokens, self.spill, self.n_rows = [], tempfile.TemporaryFile(), 0

    def n_drafts(self):
        """Drafts this request verifies in its next step: ``draft_max``, fewer near the end (tokens
        it may still emit − 1); 0 while it prefills or when it does not speculate."""
        if self.draft_max is None or self.pos < len(self.prompt):
            return 0
        return max(0, min(self.draft_max, self.emits - len(self.tokens) - 1))

    @property
    def done(self):
        """Whether the request has fed its prompt and emitted all it may (``n_tokens``, or
        ``abort_after`` when the client cancels it)."""
        return self.pos >= len(self.prompt) and len(self.tokens) >= self.emits

    def piece(self):
        """What this request feeds in the next step: a prefill chunk (at most ``SERVE_CHUNK``
        tokens, cut at the cache grid), or its last token (a decode)."""
        if self.pos < len(self.prompt):
            n = min(len(self.prompt) - self.pos, SERVE_CHUNK, SERVE_BLOCK - self.pos % SERVE_BLOCK)
            return self.prompt[self.pos : self.pos + n]
        return [self.tokens[-1]]


class Server:
    """Op ``serve``: one scenario (docs/engine-protocol.md, "Op serve") through a scheduler of
    this engine's own, on one llama.cpp context with ``SERVE_SLOTS`` sequences (``n_seq_max``,
    one KV cache shared by them, ``kv_unified``):

    - **slots**: an admitted request takes the lowest free sequence id; the sequence is cleared
      first (``llama_memory_seq_rm(mem, seq, -1, -1)``: its KV cells and its conv and recurrent
      state), so a reused slot starts from nothing but what the cache restores;
    - **continuous batching**: each step is one ``llama_decode`` holding one decode token of every
      running request and a prefill chunk of each arriving one; a request is admitted at the
      first step its arrival allows (``arrival.step``, and ``after`` having emitted ``tokens``),
      and ends once it has emitted ``n_tokens`` (``abort_after``: that many; aborted);
    - **prompt cache**: after a step in which a request's prefill reaches a multiple of
      ``SERVE_BLOCK`` prompt tokens, and when it ends (not when aborted), its sequence state
      (``llama_state_seq_get_data``: KV cells, conv and recurrent state) is kept under the tokens
      it follows; an admitted request restores the longest kept state whose tokens begin its
      prompt, leaving at least one prompt token to feed (``llama_state_seq_set_data`` into its
      own sequence id), and reports that length as ``cached``. llama.cpp's recurrent memory
      cannot be cut back to an earlier position, so only states kept at those positions can be
      restored. A continuation (``continues``) runs the continued request's prompt and tokens and
      its new turn, and finds that history's end state here;
    - ``force`` (teacher forcing): the given ids are fed as the generated tokens.

    - **speculation under traffic** (requests with ``draft_max``, on a model with an MTP block and
      bindings with the nextn API): the scenario's context has its nextn embeddings on and an MTP
      context beside it (``LLAMA_CONTEXT_TYPE_MTP``, the same sequence ids), fed every trunk row
      (h_{p-1}, x_p) as ``Engine.speculative`` feeds it, so a cached state carries the head's K/V
      and the last h too. A speculating request's decode step is ``Engine.speculative``'s step
      inside the shared batch: its drafts (``propose``, every drafting request in one head batch
      per round; a forced request's drafts are its forced ids) are verified as 1 + k rows of the
      step's one ``llama_decode`` beside the other requests' pieces, its trunk sequence state
      saved before; with a rejected draft that state is restored, the head's rows from the
      position trimmed, and the accepted tokens fed again in one more ``llama_decode`` after the
      step's (every rolled-back request together: a repair of the step, not a step of the log).
      Its rows are the verify rows that chose its tokens. On a model without an MTP block the
      requests are served plainly (no drafts: the probe says the scenario is UNMEASURED).

    The step log is built from the batches themselves: per step, each request's slot, the tokens
    it put in that ``llama_decode`` (``fed``) and the tokens it emitted, and for a verification
    ``drafts`` and ``accepted``. Every fed position has its logits row (float32, llama.cpp's
    ``llama_get_logits`` in batch order); a verification keeps the rows of its accepted positions."""

    def __init__(self, llm, requests, n_ubatch):
        big = [q["id"] for q in requests if int(q.get("draft_max") or 0) > SERVE_CHUNK - 1]
        if big:  # a step's batch (8 slots × at most 64 tokens) must fit llama_batch_init's 512
            raise ValueError(f"requests {big} ask for draft_max above {SERVE_CHUNK - 1}, more than a step of this engine verifies")
        self.n_vocab, self.n_embd = llm.n_vocab, llm.n_embd
        self.spec = HAS_MTP and llm.n_nextn > 0 and any(q.get("draft_max") is not None for q in requests)
        n_ctx = n_ctx_for(sum(history_bound(requests).values()))
        self.ctx = Context(llm, n_ctx, n_seq=SERVE_SLOTS, n_ubatch=n_ubatch)
        self.mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        self.head = self.head_mem = None
        self.h_last = {}  # seq -> the trunk's nextn embedding of its last fed position (speculation only)
        if self.spec:
            llama_cpp_ext.llama_set_embeddings_nextn(self.ctx.ctx, True, False)
            self.head = Context(llm, n_ctx, n_seq=SERVE_SLOTS, n_ubatch=n_ubatch, other=self.ctx)
            llama_cpp_ext.llama_set_embeddings_nextn(self.head.ctx, True, False)
            self.head_mem = llama_cpp.llama_get_memory(self.head.ctx)
        self.cache = OrderedDict()  # tuple(tokens) -> the sequence's state after them (``snapshot``)

    # -- a sequence's state -----------------------------------------------------------------------
    def snapshot(self, seq):
        """Sequence ``seq``'s state: the trunk's state bytes, and with speculation the head's and
        the last h too (trunk bytes, head bytes, h)."""
        if not self.spec:
            return self.ctx.save(seq)
        return self.ctx.save(seq), self.head.save(seq), self.h_last[seq].copy()

    def clear(self, seq):
        """Sequence ``seq`` emptied in the trunk (KV cells, conv and recurrent state) and the head."""
        llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1)
        if self.spec:
            llama_cpp.llama_memory_seq_rm(self.head_mem, seq, -1, -1)
            self.h_last[seq] = np.zeros(self.n_embd, np.float32)

    def restore(self, state, seq):
        """A ``snapshot`` into sequence ``seq``."""
        if not self.spec:
            return self.ctx.restore(state, seq)
        trunk, head, h = state
        self.ctx.restore(trunk, seq)
        self.head.restore(head, seq)
        self.h_last[seq] = h.copy()

    def decode(self, items):
        """One trunk ``llama_decode`` of items [(token, pos, seq)]; with speculation the head then
        gets the same rows with (h_{p-1}, x_p) (``Engine.speculative``'s ``trunk_rows``). Returns
        the trunk's logits float32 [n, V]."""
        logits = self.ctx.decode(items)
        if self.spec:
            h = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn(self.ctx.ctx), shape=(len(items), self.n_embd)).copy()
            embd, prev = [], {}
            for j, (_, _, q) in enumerate(items):
                embd.append(prev.get(q, self.h_last[q]))
                prev[q] = h[j]
            self.head.run(items, np.stack(embd))
            self.h_last.update(prev)
        return logits

    # -- the prompt cache -----------------------------------------------------------------------
    def keep(self, tokens, seq):
        """Keep sequence ``seq``'s state bytes under ``tokens`` (the history it follows), the
        newest last; the oldest beyond ``SERVE_CACHE`` states is dropped."""
        key = tuple(tokens)
        self.cache.pop(key, None)
        self.cache[key] = self.snapshot(seq)
        while len(self.cache) > SERVE_CACHE:
            self.cache.popitem(last=False)

    def lookup(self, prompt):
        """The longest kept (length, state) whose tokens begin ``prompt``, at most
        ``len(prompt) - 1`` long; (0, None) when none does."""
        best = (0, None)
        for key, state in self.cache.items():
            if best[0] < len(key) <= len(prompt) - 1 and tuple(prompt[: len(key)]) == key:
                best = (len(key), state)
        return best

    # -- slots ------------------------------------------------------------------------------------
    def admit(self, req, seq, prompt):
        """``req`` into sequence ``seq``: the sequence cleared, the longest cached prefix restored."""
        self.clear(seq)
        cached, state = self.lookup(prompt)
        if state is not None:
            self.restore(state, seq)
        return Running(req, seq, prompt, cached)

    # -- one step ---------------------------------------------------------------------------------
    def step(self, running):
        """One ``llama_decode`` of every running request's piece (a speculating request's: its last
        token and its drafts); returns the step's entries ``{"request", "slot", "fed", "emitted"}``
        as fed, with ``drafts`` and ``accepted`` for a verification."""
        drafts = self.drafts(running)
        saved = {}
        for r in running:
            if drafts.get(r.seq):  # 2. verify: the head's draft rows out, the trunk's state kept for a rollback
                llama_cpp.llama_memory_seq_rm(self.head_mem, r.seq, r.pos, -1)
                saved[r.seq] = (self.ctx.save(r.seq), self.h_last[r.seq])
        pieces = [(r, r.piece() + drafts.get(r.seq, [])) for r in running]
        items = [(t, r.pos + i, r.seq) for r, piece in pieces for i, t in enumerate(piece)]
        logits = self.decode(items)
        entries, at, refeed = [], 0, []
        for r, piece in pieces:
            rows = logits[at : at + len(piece)]
            at += len(piece)
            if r.seq in saved:
                entries.append(self.verified(r, piece, rows, saved[r.seq], refeed))
                continue
            r.spill.write(np.ascontiguousarray(rows, np.float32).tobytes())
            r.n_rows += len(piece)
            r.pos += len(piece)
            if r.pos <= len(r.prompt) and r.pos % SERVE_BLOCK == 0:
                self.keep(r.prompt[: r.pos], r.seq)
            emitted = 0
            if r.pos >= len(r.prompt) and len(r.tokens) < r.emits:
                force = r.req.get("force")
                r.tokens.append(int(force[len(r.tokens)]) if force is not None else int(np.argmax(rows[-1])))
                emitted = 1
            entries.append({"request": r.req["id"], "slot": r.seq, "fed": len(piece), "emitted": emitted})
        if refeed:  # 3. roll back: the accepted tokens of every request that rejected a draft, fed again
            self.decode(refeed)
        return entries

    def drafts(self, running):
        """Step 1 for every speculating request in decode: {seq: [d_1 ... d_k]}, k = ``n_drafts``;
        drafted by the head (``propose``), or a forced request's next forced ids; none without an
        MTP head (the scenario is served plainly)."""
        drafts, wants = {}, {}
        if not self.spec:
            return drafts
        for r in running:
            k = r.n_drafts()
            if k and r.req.get("force") is not None:
                drafts[r.seq] = [int(t) for t in r.req["force"][len(r.tokens) : len(r.tokens) + k]]
            elif k:
                wants[r.seq] = (r.tokens[-1], r.pos, self.h_last[r.seq], k)
        if wants:
            drafts.update(propose(self.head, wants))
        return drafts

    def verified(self, r, piece, rows, saved, refeed):
        """Step 2's verdict for ``r``, which fed ``piece`` = [t, d_1 ... d_k] (``rows``: their logits):
        d_i accepted while it is the argmax of the row before; the rows of t and the accepted
        drafts kept; after a rejection the trunk's ``saved`` state restored, the head trimmed and
        [t, d_1 ... d_a] appended to ``refeed``. Returns the step entry."""
        k = len(piece) - 1
        choice = [int(np.argmax(row)) for row in rows]
        a = 0
        while a < k and piece[1 + a] == choice[a]:
            a += 1
        r.spill.write(np.ascontiguousarray(rows[: 1 + a], np.float32).tobytes())
        r.n_rows += 1 + a
        if a < k:
            self.ctx.restore(saved[0], r.seq)
            llama_cpp.llama_memory_seq_rm(self.head_mem, r.seq, r.pos, -1)
            self.h_last[r.seq] = saved[1]
            refeed += [(t, r.pos + i, r.seq) for i, t in enumerate(piece[: 1 + a])]
        force = r.req.get("force")
        j = len(r.tokens)
        r.tokens += [int(t) for t in force[j : j + a + 1]] if force is not None else piece[1 : 1 + a] + [choice[a]]
        r.pos += 1 + a
        return {"request": r.req["id"], "slot": r.seq, "fed": 1 + k, "emitted": a + 1, "drafts": k, "accepted": a}

    # -- the scenario -----------------------------------------------------------------------------
    def run(self, requests):
        """Serve ``requests`` (the request's ``requests``, in the order sent); returns
        (finished runs by id, the step log). Raises ``ValueError`` when requests wait for arrivals
        that never come."""
        pending, running, done, steps, step = list(requests), [], {}, [], 0
        while pending or running:
            for req in [q for q in pending if self.due(q, step, steps, done)]:
                free = sorted(set(range(SERVE_SLOTS)) - {r.seq for r in running})
                if not free:
                    break
                prev = done.get(req.get("continues"))
                prompt = list(req["tokens"]) if prev is None else prev.prompt + prev.tokens + list(req["tokens"])
                running.append(self.admit(req, free[0], prompt))
                pending.remove(req)
            if not running:
                later = [int(q["arrival"].get("step", 0)) for q in pending if int(q["arrival"].get("step", 0)) > step]
                if not later:
                    raise ValueError(f"requests {[q['id'] for q in pending]} wait for arrivals that never come")
                step = min(later)
                continue
            steps.append({"index": step, "entries": self.step(running)})
            for r in [r for r in running if r.done]:
                if len(r.tokens) == int(r.req["n_tokens"]):  # an aborted request's state is not kept
                    self.keep(r.prompt + r.tokens[:-1], r.seq)
                done[r.req["id"]] = r
                running.remove(r)
            step += 1
        return done, steps

    @staticmethod
    def due(req, step, steps, done):
        """Whether ``req`` may be admitted at ``step``: not before ``arrival.step``, a
        continuation only once the request it continues ended, and with ``arrival.after`` only
        once that request has emitted ``arrival.tokens`` tokens in earlier steps."""
        arrival = req.get("arrival") or {}
        if step < int(arrival.get("step", 0)) or (req.get("continues") is not None and req["continues"] not in done):
            return False
        if arrival.get("after") is None:
            return True
        emitted = sum(e["emitted"] for s in steps for e in s["entries"] if e["request"] == arrival["after"])
        return emitted >= int(arrival.get("tokens", 0))

    def write(self, done, steps, requests, out, with_logits):
        """``serve.json`` (per request: prompt, tokens, slot, cached, aborted, its rows in
        ``serve_logits.npy``; the step log) and ``serve_logits.npy`` (float32 [Σ rows, V], copied
        from each request's spill in blocks); returns the file names."""
        doc, first = {"requests": [], "steps": steps}, 0
        for q in requests:
            r = done[q["id"]]
            entry = {"id": q["id"], "prompt": r.prompt, "tokens": r.tokens, "slot": r.seq, "cached": r.cached,
                     "aborted": len(r.tokens) < int(q["n_tokens"])}
            if with_logits:
                entry["logits"] = {"start": r.cached, "row": first, "rows": r.n_rows}
                first += r.n_rows
            doc["requests"].append(entry)
        (out / "serve.json").write_text(json.dumps(doc))
        if not with_logits:
            return ["serve.json"]
        arr = np.lib.format.open_memmap(out / "serve_logits.npy", mode="w+", dtype=np.float32, shape=(first, self.n_vocab))
        at = 0
        for q in requests:
            r = done[q["id"]]
            r.spill.seek(0)
            for lo in range(0, r.n_rows, 256):
                n = min(256, r.n_rows - lo)
                arr[at : at + n] = np.frombuffer(r.spill.read(n * self.n_vocab * 4), np.float32).reshape(n, self.n_vocab)
                at += n
        arr.flush()
        del arr
        return ["serve.json", "serve_logits.npy"]

    def close(self, done=()):
        """Free the contexts and the row spills of the runs ``done``."""
        for r in done:
            r.spill.close()
        if self.head is not None:
            self.head.close()
        self.ctx.close()


def history_bound(requests):
    """{id: positions} each request's history can reach (a continuation's: the continued
    request's history, its tokens and the new turn; a speculating request's drafts beyond it): their
    sum bounds the KV cells in use."""
    out = {}
    for q in requests:
        prev = out.get(q.get("continues"), 0) + (1 if q.get("continues") else 0)
        out[q["id"]] = prev + len(q["tokens"]) + int(q["n_tokens"]) + int(q.get("draft_max") or 0)
    return out


class Engine:
    """The loaded model and the sessions kept between requests: {id: {position: state bytes}}."""

    def __init__(self, model_path, overrides):
        self.model_path, self.overrides = model_path, list(overrides)
        self.llm = Model(model_path, overrides)
        self.sessions = {}
        self.plain = None  # ((n_ctx, n_ubatch), Context) of plain logits requests (plain_context)
        self.spec_sessions = {}  # speculative sessions: {id: {"trunk", "head": state bytes, "h": h_last, "n": length}}

    def info(self, req):
        return {"name": "example-llamacpp", "version": llama_cpp.__version__, "compute_class": "f32",
                "settings": {"n_batch": 512, "n_ubatch": int((req.get("settings") or {}).get("n_ubatch", 512)),
                             "n_threads": N_THREADS, "backend": "cpu", "overrides": self.overrides,
                             **({"mtp_convention": "llama.cpp"} if HAS_MTP else {}), "capabilities": CAPABILITIES}}

    def logits(self, req, sink=None):
        """The request's logits [T, V]; with ``sink`` (a ``Ring``'s ``write``) handed to it instead:
        batch by batch straight from llama.cpp's buffer for one plain sequence, whole otherwise."""
        n_ubatch = int((req.get("settings") or {}).get("n_ubatch", 512))
        tokens, session = req.get("tokens"), req.get("session")
        if not req.get("sequences") and not session:  # "first_row": the rows from it on alone (capability first_row)
            ctx = self.plain_context(n_ctx_for(len(tokens)), n_ubatch)
            return ctx.feed(tokens, chunks=req.get("chunks"), sink=sink, first_row=int(req.get("first_row") or 0))
        rows = self.side_by_side(req["sequences"], n_ubatch) if req.get("sequences") else self.in_session(tokens, session, n_ubatch)
        if sink is None:
            return rows
        sink(rows)

    def plain_context(self, n_ctx, n_ubatch):
        """The context of plain one-sequence ``logits`` requests, kept from the last one with the same
        ``n_ctx`` and ``n_ubatch`` and emptied (``llama_memory_clear``: KV cells, conv and recurrent
        state), so its buffers are not allocated and faulted in again for every request; another
        shape gets a new one."""
        key = (n_ctx, n_ubatch)
        if self.plain is not None and self.plain[0] == key and hasattr(llama_cpp, "llama_memory_clear"):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.plain[1].ctx), True)
            return self.plain[1]
        if self.plain is not None:
            self.plain[1].close()
        self.plain = (key, Context(self.llm, n_ctx, n_ubatch=n_ubatch))
        return self.plain[1]

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

    def speculative(self, req):
        """Op ``generate`` with ``speculative`` (``{"draft": "mtp", "draft_max": k}``): greedy
        speculative decoding with drafts from llama.cpp's MTP context, one sequence (``tokens`` in
        ``chunks``, optionally from or into a ``session``) or several ``sequences`` side by side,
        one sequence id each, every phase of a step one ``llama_decode`` for all of them.
        Returns ([ids per sequence], [{"accepted": [...], "rejected": [...]} per sequence]).

        The trunk context has its nextn embeddings on (h_t after each batch); the MTP context holds
        the head rows (h_{p-1}, x_p) at position p, as ``draft`` fills them. A step, with P tokens
        fed and the chosen token t not yet fed, k = min(draft_max, tokens still wanted - 1):

        1. draft: the head decodes (h_{P-1}, t) at P, then (g_i, d_i) at P + i, g_i the head's own
           nextn embedding of the row before (chained drafts, as llama.cpp's draft-mtp driver);
           d_i is the argmax; the draft rows are then removed from the head's KV cache
           (``llama_memory_seq_rm``: the head is attention only, so it can be trimmed);
        2. verify: the trunk's sequence state is saved (``llama_state_seq_get_data``) and
           [t, d_1 ... d_k] decoded at P ... P + k in one batch; d_i is accepted while it equals
           the argmax of the row before; the head gets the accepted rows with the trunk's h;
        3. roll back: with a rejected draft, llama.cpp's recurrent memory cannot be trimmed, so the
           saved state is restored (``llama_state_seq_set_data``: KV cells, conv and recurrent
           state) and [t, d_1 ... d_a] fed again.

        A session keeps the trunk's and the head's sequence state bytes, the last h and the length
        (the prompt and every generated token but the last, which is never fed)."""
        spec, n = req["speculative"], int(req["n_tokens"])
        if spec.get("draft") not in ("mtp", "given") or int(spec.get("draft_max", 0)) < 1:
            raise ValueError("speculative needs draft \"mtp\" or \"given\" and draft_max >= 1")
        given = self.given_drafts(req) if spec["draft"] == "given" else None
        if not HAS_MTP:
            raise ValueError(NO_MTP)
        if self.llm.n_nextn < 1:
            raise ValueError("this model has no MTP (nextn) block (llama_model_n_layer_nextn is 0): no draft head to run")
        k_max, m = int(spec["draft_max"]), self.llm
        multi = bool(req.get("sequences"))
        seqs = [q["tokens"] for q in req["sequences"]] if multi else [req["tokens"]]
        s = None if multi else req.get("session")
        start = None
        if s and s.get("parent") is not None:
            start = self.spec_sessions.get(s["parent"])
            if start is None or int(s.get("after", -1)) != start["n"]:
                have = "no such session" if start is None else f"it keeps the state after {start['n']} tokens"
                raise ValueError(f"session {s['parent']!r} cannot be continued after {s.get('after')} tokens: {have}")
        p0 = start["n"] if start else 0
        n_ctx = n_ctx_for(sum(p0 + len(q) + n + k_max + 1 for q in seqs))
        n_ubatch = int((req.get("settings") or {}).get("n_ubatch", 512))
        trunk = Context(m, n_ctx, n_seq=len(seqs), n_ubatch=n_ubatch)
        llama_cpp_ext.llama_set_embeddings_nextn(trunk.ctx, True, False)
        head = Context(m, n_ctx, n_seq=len(seqs), n_ubatch=n_ubatch, other=trunk)
        llama_cpp_ext.llama_set_embeddings_nextn(head.ctx, True, False)
        mem = llama_cpp.llama_get_memory(head.ctx)
        zero = np.zeros(m.n_embd, np.float32)
        pos = [p0] * len(seqs)
        h_last = [start["h"].copy() if start else zero for _ in seqs]
        outs, acc, rej = [[] for _ in seqs], [[] for _ in seqs], [[] for _ in seqs]
        self.spec_rows = [[] for _ in seqs]  # the row that chose each generated token (logits.npy)

        def trunk_rows(items):
            """Decode items in the trunk, give the head their rows; (logits, h) per item."""
            logits = trunk.decode(items)
            h = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn(trunk.ctx), shape=(len(items), m.n_embd)).copy()
            embd, prev = [], {}
            for j, (_, _, q) in enumerate(items):
                embd.append(prev.get(q, h_last[q]))
                prev[q] = h[j]
            head.run(items, np.stack(embd))
            for q, row in prev.items():
                h_last[q] = row
            return logits, h

        try:
            if start:
                trunk.restore(start["trunk"])
                head.restore(start["head"])
            last = [None] * len(seqs)
            for items in batches(seqs, None if multi else req.get("chunks")):  # the prefill
                items = [(t, p0 + p, q) for t, p, q in items]
                logits, _ = trunk_rows(items)
                for (_, _, q), row in zip(items, logits):
                    last[q] = row
            for q in range(len(seqs)):
                pos[q] += len(seqs[q])
                if n > 0:
                    outs[q].append(int(np.argmax(last[q])))
                    self.spec_rows[q].append(last[q])
            while any(len(o) < n for o in outs):
                live = [q for q in range(len(seqs)) if len(outs[q]) < n]
                ks = {q: min(k_max, n - len(outs[q]) - 1) for q in live}
                if given is not None:  # the harness's drafts: given[j] for generated index j
                    ks = {q: max(0, min(ks[q], len(given) - len(outs[q]))) for q in live}
                    drafts = {q: given[len(outs[q]):len(outs[q]) + ks[q]] for q in live}
                else:
                    drafts = self.propose(head, {q: (outs[q][-1], pos[q], h_last[q], ks[q]) for q in live})  # 1. draft
                for q in live:
                    if ks[q] > 0:
                        llama_cpp.llama_memory_seq_rm(mem, q, pos[q], -1)
                saved = {q: trunk.save(q) for q in live if ks[q] > 0}
                batch = [(t, pos[q] + i, q) for q in live for i, t in enumerate([outs[q][-1]] + drafts[q])]
                h_before = {q: h_last[q] for q in live}
                logits, _ = trunk_rows(batch)  # 2. verify: every sequence's 1 + k tokens in one batch
                refeed, j = [], 0
                for q in live:
                    k = ks[q]
                    choice = [int(np.argmax(r)) for r in logits[j : j + 1 + k]]
                    a = 0
                    while a < k and drafts[q][a] == choice[a]:
                        a += 1
                    self.spec_rows[q].extend(logits[j : j + 1 + a])
                    j += 1 + k
                    if a < k:  # 3. roll back: the state before the batch, the accepted tokens again
                        trunk.restore(saved[q], q)
                        llama_cpp.llama_memory_seq_rm(mem, q, pos[q], -1)
                        h_last[q] = h_before[q]
                        refeed += [(t, pos[q] + i, q) for i, t in enumerate([outs[q][-1]] + drafts[q][:a])]
                    if k > 0:
                        acc[q].append(a)
                        rej[q].append(k - a)
                    else:
                        acc[q].append(0)
                        rej[q].append(0)
                    pos[q] += 1 + a
                    outs[q] += drafts[q][:a] + [choice[a]]
                if refeed:
                    trunk_rows(refeed)
            if s and s.get("id") is not None:
                self.spec_sessions[s["id"]] = {"trunk": trunk.save(0), "head": head.save(0), "h": h_last[0].copy(), "n": pos[0]}
        finally:
            head.close()
            trunk.close()
        return [o[:n] for o in outs], [{"accepted": a, "rejected": r} for a, r in zip(acc, rej)]

    def given_drafts(self, req):
        """The drafts the harness gives (``{"draft": "given", "draft_max": k, "tokens": [...]}``),
        checked: one sequence, k at most GIVEN_MAX, at most n_tokens ids in the vocab. Raises
        ``ValueError`` (the harness reports the refusal as ENGINE-ERROR)."""
        spec, n = req["speculative"], int(req["n_tokens"])
        toks = spec.get("tokens")
        if req.get("sequences"):
            raise ValueError("given drafts are verified for one sequence (tokens), not sequences")
        if int(spec["draft_max"]) > GIVEN_MAX:
            raise ValueError(f"given drafts with draft_max {spec['draft_max']}: this engine verifies at most {GIVEN_MAX} per step")
        if not isinstance(toks, list) or len(toks) > n:
            raise ValueError(f"given drafts must be a list of at most n_tokens ({n}) ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.llm.n_vocab for t in toks):
            raise ValueError(f"a given draft is not a token id in [0, {self.llm.n_vocab})")
        return toks

    def propose(self, head, wants):
        """Step 1 of ``speculative``: the module's ``propose`` (a subclass may draft otherwise)."""
        return propose(head, wants)

    def draft(self, req):
        """Op ``draft``: the MTP head's teacher-forced draft logits through llama.cpp's MTP context,
        in llama.cpp's position convention. Returns (draft logits float32 [Σ(T_i − 1), V], hidden
        float32 [Σ T_i, n_embd]), the sequences' rows concatenated in order.

        The trunk context decodes the tokens as ``logits`` does (one sequence in its ``chunks``, or
        ``sequences`` side by side) with its nextn embeddings on: after each batch they hold the
        batch's h_t, the trunk state after ``output_norm``. Each batch's positions p then go to the
        MTP context as rows (h_{p−1}, x_p) at position p, h_{−1} = 0: row 0 is a sentinel, decoded
        (it is a key the head attends to) but not a draft; row p ≥ 1 drafts tokens[p + 1], draft row
        p − 1. So a chunked prefill fills the head's KV cache piece by piece, as llama.cpp's server
        does. With ``"depth": 2`` (capability ``mtp_chain``; one sequence, fed whole) also the
        depth-2 rows (``chain``), returned third (else None). Raises ``ValueError`` on a model
        without an MTP block (the harness reports the refusal) or a depth-2 request it cannot run."""
        m = self.llm
        if not HAS_MTP:
            raise ValueError(NO_MTP)
        if m.n_nextn < 1:
            raise ValueError("this model has no MTP (nextn) block (llama_model_n_layer_nextn is 0): no draft head to run")
        seqs = [q["tokens"] for q in req["sequences"]] if req.get("sequences") else [req["tokens"]]
        if any(len(q) < 2 for q in seqs):
            raise ValueError("draft logits need at least 2 tokens per sequence")
        depth2 = int(req.get("depth") or 1) == 2
        if depth2 and (len(seqs) > 1 or req.get("chunks") or len(req.get("draft_tokens") or []) != len(seqs[0]) - 1):
            raise ValueError("depth 2 takes one sequence fed whole and one draft token per draft row (draft_tokens)")
        n_ubatch = int((req.get("settings") or {}).get("n_ubatch", 512))
        n_ctx = n_ctx_for(sum(map(len, seqs)))
        trunk = Context(m, n_ctx, n_seq=len(seqs), n_ubatch=n_ubatch)
        llama_cpp_ext.llama_set_embeddings_nextn(trunk.ctx, True, False)
        head = Context(m, n_ctx, n_seq=len(seqs), n_ubatch=n_ubatch, other=trunk)
        if depth2:
            llama_cpp_ext.llama_set_embeddings_nextn(head.ctx, True, False)  # g: the head's t_h_nextn (after its head norm)
        hidden = [np.zeros((len(q), m.n_embd), np.float32) for q in seqs]
        drafts = [np.zeros((len(q) - 1, m.n_vocab), np.float32) for q in seqs]
        g = np.zeros((len(seqs[0]), m.n_embd), np.float32)
        try:
            for items in batches(seqs, req.get("chunks") if len(seqs) == 1 else None):
                trunk.run(items)
                h = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn(trunk.ctx), shape=(len(items), m.n_embd))
                for (_, pos, seq), row in zip(items, h):
                    hidden[seq][pos] = row
                embd = np.stack([hidden[seq][pos - 1] if pos else np.zeros(m.n_embd, np.float32) for _, pos, seq in items])
                out = head.decode(items, embd)
                for (_, pos, seq), row in zip(items, out):
                    if pos >= 1:
                        drafts[seq][pos - 1] = row
                if depth2:
                    g[[pos for _, pos, _ in items]] = np.ctypeslib.as_array(
                        llama_cpp_ext.llama_get_embeddings_nextn(head.ctx), shape=(len(items), m.n_embd))
            chained = chain(head, g, req.get("draft_tokens")) if depth2 else None
        finally:
            head.close()
            trunk.close()
        return np.concatenate(drafts), np.concatenate(hidden), chained

    def serve(self, req, out):
        """Op ``serve``: the scenario through a ``Server`` on a fresh context (its prompt cache
        lives as long as the scenario); returns the names of the files written into ``out``."""
        if not HAS_SERVE:
            raise ValueError(f"these bindings (llama-cpp-python {llama_cpp.__version__}) have no sequence memory or state API")
        requests = req["requests"]
        server = Server(self.llm, requests, int((req.get("settings") or {}).get("n_ubatch", 512)))
        done = {}
        try:
            done, steps = server.run(requests)
            return server.write(done, steps, requests, out, "logits" in (req.get("want") or ["logits"]))
        finally:
            server.close(done.values())

    def handle(self, req):
        """One request; returns the reply (without ``id``)."""
        op, out = req.get("op", "logits"), Path(req.get("out_dir", "."))
        if op == "shutdown":
            return {"ok": True, "files": []}
        if op == "drop":
            for sid in req.get("sessions") or list(self.sessions) + list(self.spec_sessions):
                self.sessions.pop(sid, None)
                self.spec_sessions.pop(sid, None)
            return {"ok": True, "files": []}
        (out / "info.json").write_text(json.dumps(self.info(req)))
        if op == "tokenize":  # llama.cpp's own tokenizer of the GGUF: what this engine's users get
            ids = self.llm.tokenize(req["text"].encode("utf-8"), add_bos=bool(req.get("add_special")), special=False)
            (out / "tokens.json").write_text(json.dumps(ids))
            return {"ok": True, "files": ["tokens.json", "info.json"]}
        if op == "generate" and req.get("speculative"):
            ids, counts = self.speculative(req)
            (out / "tokens.json").write_text(json.dumps(ids if req.get("sequences") else ids[0]))
            spec = {"draft": req["speculative"]["draft"], "draft_max": int(req["speculative"]["draft_max"]), "sequences": counts}
            (out / "speculative.json").write_text(json.dumps(spec))
            files = ["tokens.json", "speculative.json", "info.json"]
            if not req.get("sequences") and "logits" in (req.get("want") or []):  # the verify rows of each token
                rows = self.spec_rows[0][: len(ids[0])]
                np.save(out / "logits.npy", np.asarray(rows, np.float32).reshape(len(rows), self.llm.n_vocab))
                files.append("logits.npy")
            return {"ok": True, "files": files}
        if op == "generate":
            (out / "tokens.json").write_text(json.dumps(self.generate(req)))
            return {"ok": True, "files": ["tokens.json", "info.json"]}
        if op == "serve":
            return {"ok": True, "files": self.serve(req, out) + ["info.json"]}
        if op == "draft":
            logits, hidden, depth2 = self.draft(req)
            np.save(out / "draft_logits.npy", logits)
            np.save(out / "hidden.npy", hidden)
            if depth2 is not None:
                np.save(out / "draft2_logits.npy", depth2)
            return {"ok": True, "files": ["draft_logits.npy", "hidden.npy", "info.json"] + (["draft2_logits.npy"] if depth2 is not None else [])}
        if req.get("logits_ring"):  # rows through the harness's shared-memory ring, no logits.npy
            ring = Ring(req["logits_ring"], req.get("id"))
            self.logits(req, sink=ring.write)
            ring.finish()
            return {"ok": True, "files": ["info.json"]}
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
    if sys.argv[1] == "--capabilities":  # what an engine table should declare for these bindings
        print(json.dumps({"version": llama_cpp.__version__, "capabilities": CAPABILITIES}))
    elif sys.argv[1] == "--serve":
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
