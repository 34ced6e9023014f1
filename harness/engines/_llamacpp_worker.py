"""Worker process for the llama.cpp reference engine (run as ``python -m harness.engines._llamacpp_worker REQ``).

ggml can ``abort()`` the process on a malformed model, so llama.cpp never runs inside the harness
process. This worker reads one JSON request, talks to llama.cpp through llama-cpp-python's
low-level ctypes API (``llama_decode`` with a ``llama_batch`` that requests logits for every
token), and streams float32 logits to the harness through a pipe as each batch finishes, plus
``info.json``. Only numpy and llama_cpp are imported, so what it measures is llama.cpp.

The stream (file descriptor ``stream_fd``, inherited from the harness): ``n_vocab`` as one int64,
then per ``llama_decode`` call its rows, written straight from llama.cpp's memory (no copy in this
process, nothing kept once written, so the worker holds one batch of logits, not the prompt's).
A single sequence's rows are written from the graph's ``result_output`` tensor by an eval
callback (``_GraphRows``) as each ubatch finishes, and the pages of that tensor and of llama.cpp's
output buffer (which llama.cpp fills from it afterwards; nothing here reads it) are given back
to the kernel (``madvise(MADV_DONTNEED)``) once used: at V = 248,320 each is 485 MiB for a
512-token ubatch, and only one needs to be resident at a time. The graph, n_batch, n_ubatch and
the requested outputs are the same as without the callback, so the logits are the same bytes
(``tests/test_llamacpp.py``). A single sequence sends its rows in position order and nothing else; several
sequences (``sequences``) precede each batch's rows with an int64 count k and the k int64 row
indices the rows belong to (rows of different sequences interleave within a batch). All
little-endian.

Request fields: ``op`` (``tokenize`` | ``logits`` | ``activations`` | ``generate`` | ``draft`` | ``info``), ``model``,
``overrides`` (list of ``{key, type, value}``), ``use_extra_bufts`` (``llama_model_params.use_extra_bufts``, llama.cpp's
``--repack``: weights repacked into the CPU backend's extra buffer types, AMX and CPU_REPACK; default false), ``settings`` (n_ctx, n_batch, n_ubatch,
n_threads, type_k, type_v, flash_attn), ``tokens``, ``chunks``, ``sequences`` (list of token
lists decoded together, one sequence id each), ``texts``, ``out_dir``, ``stream_fd`` (``logits``),
``with_info`` (``tokenize``: load the whole model, not its vocabulary alone, and write what
``info`` writes beside the tokens), ``parse_special`` (``tokenize``: llama_tokenize's ``parse_special``, special-token strings in the text
become their ids; a rendered chat prompt is tokenized so), ``add_special`` (``tokenize``: llama_tokenize's
``add_special``, the BOS/EOS the vocabulary asks for; default false), ``rows_from`` (``graph``, the default, or ``output``: a single sequence's rows read from
llama.cpp's output buffer, as several sequences' are; tests compare the two), ``n_generate``
(``generate``: greedy ids written to ``generated.json``), ``mtp_convention`` (``draft``: ``llama.cpp`` or
``vllm``; the MTP head's draft logits and hidden states written to ``draft_logits.npy`` and
``hidden.npy``, see ``_draft``), ``prompts`` (``logits``: ``[{"tokens", "settings"}]``, each prompt decoded on a
fresh context of its own settings, one after another; its ``n_vocab`` header and rows follow the previous prompt's
on the stream; a prompt's ``first_row``, as the field of one sequence), ``ring`` and ``ack_fd`` (``logits`` of a single sequence: its rows go through the
harness's shared-memory ring, ``_Ring``, and only the announcements through the stream),
``first_row`` (``logits`` of a single sequence: ``batch.logits`` set only for positions from it
on, as ``llama-perplexity`` sets it for a window's second half; only those rows are computed by
llama.cpp's output projection and streamed, the first of them first).
``info.json`` holds ``load_s``, ``decode_s``, ``n_tokens`` and the worker's ``peak_rss_mb``
(``VmHWM``); a ``tokenize`` run's holds ``tokenize_s`` (inside ``llama_tokenize``).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "bf16": 30}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def _kv_override_array(llama_cpp, overrides):
    arr = (llama_cpp.llama_model_kv_override * (len(overrides) + 1))()
    for i, o in enumerate(overrides):
        arr[i].key = o["key"].encode()
        t, v = o["type"], o["value"]
        if t == "bool":
            arr[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_BOOL
            arr[i].value.val_bool = bool(v)
        elif t == "int":
            arr[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
            arr[i].value.val_i64 = int(v)
        elif t == "float":
            arr[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_FLOAT
            arr[i].value.val_f64 = float(v)
        else:
            arr[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
            b = str(v).encode()[:127].ljust(128, b"\0")
            addr = ctypes.addressof(arr[i].value) + llama_cpp.llama_model_kv_override_value.val_str.offset
            ctypes.memmove(addr, b, 128)
    arr[len(overrides)].key = b"\0"
    return arr


def _load(llama_cpp, req):
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    # llama.cpp's extra buffer types (weight repacking: AMX, CPU_REPACK; its --repack/--no-repack):
    # off unless asked for, whatever llama.cpp's own default (on)
    mparams.use_extra_bufts = bool(req.get("use_extra_bufts", False))
    if req.get("op") == "draft":
        mparams.load_mtp = True  # otherwise the nextn tensors are skipped at load
    overrides = req.get("overrides") or []
    keep = None
    if overrides:
        keep = _kv_override_array(llama_cpp, overrides)
        mparams.kv_overrides = keep
    if req.get("op") == "tokenize" and not req.get("with_info"):
        mparams.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(req["model"].encode(), mparams)
    if not model:
        sys.stderr.write("harness-worker: llama_model_load_from_file returned NULL\n")
        sys.exit(20)
    return model, keep


def _tokenize(llama_cpp, model, text, add_special: bool = False, parse_special: bool = False) -> list[int]:
    """llama_tokenize of ``text``: a str (sent as UTF-8) or ``{"hex": ...}``, raw bytes that need
    not be UTF-8 (JSON strings cannot carry them)."""
    vocab = llama_cpp.llama_model_get_vocab(model)
    data = bytes.fromhex(text["hex"]) if isinstance(text, dict) else text.encode("utf-8")
    n_max = len(data) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, bool(add_special), bool(parse_special))
    if n < 0:
        sys.stderr.write(f"harness-worker: tokenize needs {-n} slots\n")
        sys.exit(21)
    return [int(buf[i]) for i in range(n)]


def _context(llama_cpp, model, s, n_seq_max=1, cb_eval=None, other=None):
    """A context on ``model`` with settings ``s``; ``other``: a trunk context this one is the
    MTP (nextn) context of (``LLAMA_CONTEXT_TYPE_MTP``, ``ctx_other``: its own KV cache, holding
    the nextn block only)."""
    cparams = llama_cpp.llama_context_default_params()
    if other is not None:
        cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = other
    if cb_eval is not None:
        cparams.cb_eval = cb_eval
        cparams.cb_eval_user_data = None
    cparams.n_ctx = int(s["n_ctx"])
    cparams.n_batch = int(s["n_batch"])
    cparams.n_ubatch = int(s["n_ubatch"])
    cparams.n_seq_max = int(n_seq_max)
    cparams.n_threads = int(s["n_threads"])
    cparams.n_threads_batch = int(s["n_threads"])
    cparams.type_k = GGML_TYPES[s["type_k"]]
    cparams.type_v = GGML_TYPES[s["type_v"]]
    cparams.flash_attn_type = FLASH_ATTN[s["flash_attn"]]
    cparams.embeddings = False
    if hasattr(cparams, "kv_unified"):
        cparams.kv_unified = True
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        sys.stderr.write("harness-worker: llama_init_from_model returned NULL\n")
        sys.exit(22)
    return ctx


class _TensorHead(ctypes.Structure):
    """The stable leading fields of ggml's ``struct ggml_tensor`` (ggml/include/ggml.h)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int)]


_GGML_SIGNATURES = {  # name: (restype, argtypes), as declared in ggml.h / ggml-backend.h
    "ggml_get_name": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_get_data": (ctypes.c_void_p, [ctypes.c_void_p]),
    "ggml_nbytes": (ctypes.c_size_t, [ctypes.c_void_p]),
    "ggml_op_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ggml_backend_tensor_get": (None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    "ggml_backend_buffer_is_host": (ctypes.c_bool, [ctypes.c_void_p]),
}


def _ggml_base(llama_cpp) -> ctypes.CDLL:
    """llama-cpp-python's ``libggml-base.so`` with the tensor functions the eval callbacks call
    declared (``_GGML_SIGNATURES``)."""
    g = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    for name, (restype, argtypes) in _GGML_SIGNATURES.items():
        fn = getattr(g, name)
        fn.restype, fn.argtypes = restype, argtypes
    return g


class _Capture:
    """An eval callback (``cb_eval``) that copies named F32 tensors out of the graph, one
    ubatch at a time, in NumPy order (reverse of ggml ``ne``) with leading size-1 axes dropped,
    so the first axis is the ubatch's tokens for per-token tensors."""

    def __init__(self, llama_cpp, wanted):
        self.g = _ggml_base(llama_cpp)
        self.wanted = wanted  # None: every tensor
        self.parts: dict[str, list] = {}
        self.current: dict[str, np.ndarray] = {}  # this graph eval (one ubatch); a repeated name keeps the last
        self.ops: dict[str, str] = {}
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._cb)

    END = "result_output"  # the last tensor of every graph eval: closes the ubatch

    def _want(self, name: str) -> bool:
        return self.wanted is None or name in self.wanted or name == self.END

    def _cb(self, t, ask, _user):
        name = self.g.ggml_get_name(t).decode(errors="replace")
        if ask:
            return self._want(name)
        if not self._want(name):
            return True
        head = _TensorHead.from_address(t)
        self.ops[name] = self.g.ggml_op_name(head.op).decode()
        if head.type != 0:  # GGML_TYPE_F32 only
            return True
        nbytes = int(self.g.ggml_nbytes(t))
        buf = (ctypes.c_char * nbytes)()
        self.g.ggml_backend_tensor_get(t, buf, 0, nbytes)
        shape = [int(x) for x in reversed(head.ne)]
        strides = [int(x) for x in reversed(head.nb)]
        arr = np.lib.stride_tricks.as_strided(np.frombuffer(buf, dtype=np.float32), shape=shape, strides=strides).copy()
        while arr.ndim > 1 and arr.shape[0] == 1:
            arr = arr[0]
        if self.wanted is None or name in self.wanted:
            self.current[name] = arr
        if name == self.END:
            for k, v in self.current.items():
                self.parts.setdefault(k, []).append(v)
            self.current = {}
        return True

    def arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for name, parts in self.parts.items():
            if len(parts) == 1:
                out[name] = parts[0]
            elif all(p.shape[1:] == parts[0].shape[1:] for p in parts):
                out[name] = np.concatenate(parts, axis=0)  # ubatches joined per position
            else:
                for i, p in enumerate(parts):
                    out[f"{name}@ubatch{i}"] = p
        return out


_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def _release(addr: int, nbytes: int) -> None:
    """Hand the whole pages inside [addr, addr + nbytes) back to the kernel: an anonymous page
    read after this reads zeros, one written is faulted in anew (Linux ``madvise(2)``)."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo = -(-addr // page) * page
    hi = (addr + nbytes) // page * page
    if hi > lo:
        _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class _GraphRows:
    """An eval callback (``cb_eval``) that asks only for ``result_output`` (the last node of the
    graph, ggml ``ne = [n_vocab, n_outputs]``: one float32 row per output, in ubatch order) and
    writes its rows to the stream from the compute buffer itself, then releases those pages.
    Used for a single sequence (its ubatches come in position order) on a host (CPU) buffer;
    ``rows_seen`` counts the rows written since the last ``take``."""

    NAME = b"result_output"

    def __init__(self, llama_cpp, stream: "_Stream"):
        self.g, self.stream, self.rows_seen, self.write_s = _ggml_base(llama_cpp), stream, 0, 0.0
        self.llama_cpp, self.ctx = llama_cpp, None  # ctx: set once the context exists
        self.pending = 0  # rows of the output buffer to release before the next compute
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, t, ask, _user):
        if ask and self.pending:
            # The scheduler asks about every node before it computes any: llama.cpp has sized
            # (and, when it grew, zero-filled) its output buffer for this batch, and the compute
            # buffer is not written yet. The buffer is filled from the graph after the compute,
            # so its pages need not be resident during it.
            out = self.llama_cpp.llama_get_logits(self.ctx)
            if out:
                _release(ctypes.addressof(out.contents), self.pending * self.stream.n_vocab * 4)
            self.pending = 0
        if self.g.ggml_get_name(t) != self.NAME:
            return not ask  # ask: not wanted; told: carry on
        if ask:
            return True
        head = _TensorHead.from_address(t)
        n_vocab, n = int(head.ne[0]), int(head.ne[1])
        if head.type != 0 or n_vocab != self.stream.n_vocab or not self.g.ggml_backend_buffer_is_host(head.buffer):
            sys.stderr.write("harness-worker: result_output is not a host F32 [n_vocab, n] tensor\n")
            os._exit(24)
        addr, nbytes = int(self.g.ggml_get_data(t)), int(self.g.ggml_nbytes(t))
        t0 = time.perf_counter()
        self.stream.send_rows(addr, n)
        self.write_s += time.perf_counter() - t0
        _release(addr, nbytes)
        self.rows_seen += n
        return True

    def take(self) -> int:
        n, self.rows_seen = self.rows_seen, 0
        return n


class _Stream:
    """The logits stream to the harness (see the module docstring); ``fd`` None sends nothing
    (activation runs decode for their eval callback only)."""

    def __init__(self, fd: int | None, n_vocab: int, indexed: bool, ring: "_Ring | None" = None):
        self.fd, self.n_vocab, self.indexed = fd, n_vocab, indexed
        self.ring = None if indexed else ring  # several sequences' rows always cross the pipe
        self.decode_s = 0.0  # seconds inside llama_decode (not writing to the harness)
        self.graph: _GraphRows | None = None  # rows written by the eval callback instead
        if fd is not None:
            self._write(np.array([n_vocab], dtype="<i8").data)

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.write(self.fd, view)
            view = view[n:]

    def send_rows(self, addr: int, n: int) -> None:
        """Send the n float32 rows of ``n_vocab`` at address ``addr``: through the ring where
        there is one, else on the stream itself."""
        if self.ring is not None:
            self.ring.send(self, addr, n)
        else:
            self._write((ctypes.c_char * (n * self.n_vocab * 4)).from_address(addr))

    def rows(self, ptr, n: int, row_of: list[int]) -> None:
        """Send the n rows at ``ptr`` (llama.cpp's float32 output buffer) for rows ``row_of``."""
        if self.fd is None:
            return
        if self.indexed:
            self._write(np.array([n, *row_of], dtype="<i8").data)
        self.send_rows(ctypes.addressof(ptr.contents), n)


class _Ring:
    """The harness's logits ring (``harness.engines.ring.LogitRing``; the request's ``ring``:
    ``path``, ``slots``, ``rows``) as this worker writes it, with ``ack_fd`` the pipe on which the
    harness gives each slot back (one int64, the slot, in the order the slots were announced).
    Each piece of at most ``rows`` rows is copied from llama.cpp's memory into the next slot
    (waiting for that slot's ack when every slot is out) and announced on the stream as two
    int64s, the slot and the row count. The rows cross in one copy here and one in the harness,
    instead of a write into the pipe and a read out of it."""

    def __init__(self, spec: dict, ack_fd: int):
        self.slots, self.rows, self.ack_fd = int(spec["slots"]), int(spec["rows"]), int(ack_fd)
        fd = os.open(spec["path"], os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.next, self.out = 0, 0  # the slot written next; slots announced and not yet given back

    def send(self, stream: "_Stream", addr: int, n: int) -> None:
        """Copy ``n`` rows at ``addr`` into slots and announce each on ``stream``."""
        row = stream.n_vocab * 4
        if self.slots * self.rows * row > len(self.map):
            sys.stderr.write("harness-worker: the logits ring is smaller than its slots\n")
            os._exit(26)
        for lo in range(0, n, self.rows):
            k = min(self.rows, n - lo)
            if self.out == self.slots:
                self._await((self.next - self.out) % self.slots)
            ctypes.memmove(self.base + self.next * self.rows * row, addr + lo * row, k * row)
            stream._write(np.array([self.next, k], dtype="<i8").data)
            self.next, self.out = (self.next + 1) % self.slots, self.out + 1

    def _await(self, slot: int) -> None:
        got = b""
        while len(got) < 8:
            chunk = os.read(self.ack_fd, 8 - len(got))
            if not chunk:  # the harness is gone
                os._exit(26)
            got += chunk
        if int.from_bytes(got, "little", signed=True) != slot:
            sys.stderr.write(f"harness-worker: the harness gave back ring slot {int.from_bytes(got, 'little', signed=True)}, not {slot}\n")
            os._exit(26)
        self.out -= 1


def _decode_rows(llama_cpp, ctx, batch, items, stream, row_of, first_row=0):
    """Decode ``items`` = [(token, pos, seq)] as one llama_decode call, logits for every item at
    a position from ``first_row`` on (every item by default), and send the i-th row of the result
    to the harness as row ``row_of[i]``."""
    n = 0  # rows asked for
    for i, (tok, pos, seq) in enumerate(items):
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if pos >= first_row else 0
        n += pos >= first_row
    batch.n_tokens = len(items)
    graph = stream.graph
    if graph is not None:
        graph.pending = n  # the output buffer holds at least this batch's rows
    t = time.perf_counter()
    w0 = graph.write_s if graph else 0.0
    rc = llama_cpp.llama_decode(ctx, batch)
    stream.decode_s += time.perf_counter() - t - ((graph.write_s - w0) if graph else 0.0)
    if rc != 0:
        sys.stderr.write(f"harness-worker: llama_decode returned {rc}\n")
        sys.exit(23)
    if graph is None:
        if n:
            stream.rows(llama_cpp.llama_get_logits(ctx), n, row_of)
        return
    sent = graph.take()
    if sent != n:
        sys.stderr.write(f"harness-worker: the graph produced {sent} logit rows for a batch of {n}\n")
        sys.exit(25)
    out = llama_cpp.llama_get_logits(ctx)  # filled by llama.cpp from the graph; already sent
    if out:
        _release(ctypes.addressof(out.contents), n * stream.n_vocab * 4)


def _model_info(llama_cpp: Any, model: Any, info: dict[str, Any]) -> int:
    """Add the model's vocab size, training context and description to ``info``; return n_vocab."""
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
    info["n_vocab"] = n_vocab
    info["n_ctx_train"] = int(llama_cpp.llama_model_n_ctx_train(model))
    info["n_layer_nextn"] = int(llama_cpp.llama_model_n_layer_nextn(model))
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, buf, 256)
    info["model_desc"] = buf.value.decode(errors="replace")
    return n_vocab


def _decode_pieces(llama_cpp: Any, ctx: Any, batch: Any, tokens: list[int], chunks: list[int], n_batch: int, stream: Any,
                   first_row: int = 0) -> None:
    """One sequence fed as consecutive pieces (one call sequence each, state carried by the
    context), each piece in batches of at most ``n_batch``; the logits of every token from
    position ``first_row`` on to ``stream`` (rows numbered from it)."""
    pos = 0
    for c in chunks:
        end = pos + c
        while pos < end:
            k = min(n_batch, end - pos)
            items = [(tokens[pos + i], pos + i, 0) for i in range(k)]
            _decode_rows(llama_cpp, ctx, batch, items, stream, [p - first_row for p in range(max(pos, first_row), pos + k)], first_row)
            pos += k


def _decode_side_by_side(llama_cpp: Any, ctx: Any, batch: Any, sequences: list[list[int]], n_batch: int, stream: Any) -> None:
    """Several sequences side by side in each batch, one seq id each; sequence i's logits go to
    its rows of the output (sequences concatenated in order)."""
    offsets = np.cumsum([0] + [len(q) for q in sequences])
    longest = max(len(q) for q in sequences)
    per = max(1, n_batch // len(sequences))
    for start in range(0, longest, per):
        items, rows = [], []
        for sid, q in enumerate(sequences):
            for p in range(start, min(start + per, len(q))):
                items.append((q[p], p, sid))
                rows.append(int(offsets[sid]) + p)
        if items:
            _decode_rows(llama_cpp, ctx, batch, items, stream, rows)


def _generate(llama_cpp: Any, ctx: Any, batch: Any, tokens: list[int], n_generate: int, n_batch: int, n_vocab: int, stream: Any) -> list[int]:
    """Greedy free-running continuation: the prompt decoded in batches of ``n_batch``, then the
    argmax of the last row (ties: lowest id) fed back one token per ``llama_decode`` call,
    ``n_generate`` times; returns the chosen ids. No stop at EOS: the harness decides that."""
    _decode_pieces(llama_cpp, ctx, batch, tokens, [len(tokens)], n_batch, stream)
    out: list[int] = []
    while len(out) < n_generate:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        row = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
        out.append(int(np.argmax(row)))
        if len(out) < n_generate:
            _decode_rows(llama_cpp, ctx, batch, [(out[-1], len(tokens) + len(out) - 1, 0)], stream, [0])
    return out


def main(req_path: str) -> int:
    """Serve the request at ``req_path`` (module docstring: its fields): ``tokens.json``
    (tokenize), ``generated.json`` (generate), logits streamed to ``stream_fd`` (logits, activations), ``activations.npz``
    (activations) and always ``info.json`` in its ``out_dir``. Returns the exit status."""
    req = json.loads(Path(req_path).read_text())
    import llama_cpp

    out_dir = Path(req["out_dir"])
    t0 = time.time()
    model, _keep = _load(llama_cpp, req)
    info = {
        "llama_cpp_python": getattr(llama_cpp, "__version__", "unknown"),
        "system_info": (llama_cpp.llama_print_system_info() or b"").decode(errors="replace").strip(),
        "load_s": round(time.time() - t0, 4),
    }
    if req["op"] == "tokenize":
        t1 = time.time()
        toks = [_tokenize(llama_cpp, model, t, req.get("add_special", False), req.get("parse_special", False)) for t in req["texts"]]
        info["tokenize_s"] = round(time.time() - t1, 4)
        if req.get("with_info"):
            _model_info(llama_cpp, model, info)
        (out_dir / "tokens.json").write_text(json.dumps(toks))
        (out_dir / "info.json").write_text(json.dumps(info))
        return 0
    n_vocab = _model_info(llama_cpp, model, info)
    if req["op"] == "info":
        (out_dir / "info.json").write_text(json.dumps(info))
        return 0

    if req.get("ring"):  # one ring for every prompt of the request
        req["_ring"] = _Ring(req["ring"], req["ack_fd"])
    if req["op"] == "draft":
        _draft(llama_cpp, model, req, n_vocab, info, out_dir)
    elif req.get("prompts"):
        _decode_prompts(llama_cpp, model, req, n_vocab, info, out_dir)
    else:
        _decode(llama_cpp, model, req, n_vocab, info, out_dir)
    llama_cpp.llama_model_free(model)
    if req["op"] != "generate":
        info["peak_rss_mb"] = _peak_rss_mb()
    (out_dir / "info.json").write_text(json.dumps(info))
    return 0


def _decode(llama_cpp, model, req: dict, n_vocab: int, info: dict, out_dir: Path) -> None:
    """The ``logits``, ``activations`` and ``generate`` ops on a fresh context: rows streamed to
    ``stream_fd`` (a single sequence's from the graph's result_output unless ``rows_from`` says
    ``output``), ``activations.npz`` or ``generated.json`` written; timings added to ``info``."""
    s = req["settings"]
    sequences = req.get("sequences") or [req["tokens"]]
    stream = _Stream(req.get("stream_fd"), n_vocab, indexed=len(sequences) > 1, ring=req.get("_ring"))
    capture = None
    if req["op"] == "activations":
        capture = _Capture(llama_cpp, set(req["names"]) if req.get("names") else None)
    elif req["op"] == "logits" and len(sequences) == 1 and stream.fd is not None and req.get("rows_from", "graph") == "graph":
        stream.graph = _GraphRows(llama_cpp, stream)
    cb = capture.callback if capture else (stream.graph.callback if stream.graph else None)
    ctx = _context(llama_cpp, model, s, n_seq_max=len(sequences), cb_eval=cb)
    if stream.graph is not None:
        stream.graph.ctx = ctx
    n_batch = int(s["n_batch"])
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    t1 = time.time()
    if req["op"] == "generate":  # no decode_s in its info: a generation is not a prefill measurement
        gen = _generate(llama_cpp, ctx, batch, sequences[0], int(req["n_generate"]), n_batch, n_vocab, stream)
        (out_dir / "generated.json").write_text(json.dumps(gen))
        info["generate_s"] = round(stream.decode_s, 4)
    else:
        if len(sequences) == 1:
            _decode_pieces(llama_cpp, ctx, batch, sequences[0], req.get("chunks") or [len(sequences[0])], n_batch, stream,
                           int(req.get("first_row") or 0))
        else:
            _decode_side_by_side(llama_cpp, ctx, batch, sequences, n_batch, stream)
        info["decode_s"] = round(stream.decode_s, 4)  # llama_decode alone: llama.cpp's prefill time
        info["decode_wall_s"] = round(time.time() - t1, 4)  # including waits for the harness to read
        info["n_tokens"] = sum(len(q) for q in sequences)
        if capture is not None:
            np.savez(out_dir / "activations.npz", **capture.arrays())
            info["ops"] = capture.ops
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)


def _decode_prompts(llama_cpp, model, req: dict, n_vocab: int, info: dict, out_dir: Path) -> None:
    """The ``logits`` op over ``prompts`` (``[{"tokens", "settings"}]``): each prompt decoded as a
    one-prompt ``logits`` request is (``_decode``: a fresh context with its own settings, its
    ``n_vocab`` header and rows on the stream), one after another; ``info`` sums their timings."""
    total = {"decode_s": 0.0, "decode_wall_s": 0.0, "n_tokens": 0}
    for p in req["prompts"]:
        _decode(llama_cpp, model, {**req, "prompts": None, "tokens": p["tokens"], "chunks": None, "settings": p["settings"],
                                   "first_row": p.get("first_row", 0)}, n_vocab, info, out_dir)
        for k in total:
            total[k] += info[k]
    info.update({k: round(v, 4) if isinstance(v, float) else v for k, v in total.items()})


def _draft(llama_cpp, model, req: dict, n_vocab: int, info: dict, out_dir: Path) -> None:
    """The ``draft`` op: teacher-forced draft logits of the MTP (nextn) head through llama.cpp's
    own MTP context, written as ``draft_logits.npy`` float32 [Σ(T_i − 1), V] (row t of sequence i:
    the head's logits for its tokens[t+2]) and ``hidden.npy`` float32 [Σ T_i, n_embd] (the h_t the
    trunk context gave: its nextn embeddings, the state after ``output_norm``).

    The trunk context decodes the tokens as ``_decode`` does (``chunks`` pieces in batches of
    n_batch, or ``sequences`` side by side, one seq id each) with the nextn embeddings switched on
    (``llama_set_embeddings_nextn``). After each trunk batch, the rows that batch completes go to
    the MTP context (``ctx_type`` MTP, ``ctx_other`` the trunk) as one batch that carries a token
    and an embedding per row, in ``mtp_convention``: ``llama.cpp`` (row (h_{p−1}, x_p) at position
    p, h_{−1} = 0: the sentinel row 0 is decoded, as llama.cpp's speculative driver does, and not
    written) or ``vllm`` (row (h_t, x_{t+1}) at position t). So a chunked prefill fills the head's
    KV piece by piece, as llama.cpp's server does. ``items`` (a list of ``{tokens, chunks}`` or
    ``{sequences}``) runs several such requests one after another in fresh contexts, in one worker
    (one model load); their rows are written one after another."""
    from llama_cpp import llama_cpp_ext as ext

    conv = req.get("mtp_convention", "llama.cpp")
    if int(llama_cpp.llama_model_n_layer_nextn(model)) < 1:
        sys.stderr.write("harness-worker: the model has no MTP (nextn) layer (llama_model_n_layer_nextn is 0)\n")
        sys.exit(26)
    items = req.get("items") or [{"tokens": req.get("tokens"), "chunks": req.get("chunks"), "sequences": req.get("sequences"),
                                  "draft_tokens": req.get("draft_tokens")}]
    drafts, hidden, chain, decode_s = [], [], [], 0.0
    depth2 = int(req.get("depth") or 1) == 2
    t1 = time.time()
    for it in items:
        seqs = it.get("sequences") or [it["tokens"]]
        d, h, dt, c = _draft_one(llama_cpp, ext, model, req["settings"], seqs, it.get("chunks"), conv, n_vocab,
                                 (it.get("draft_tokens") or "own") if depth2 and len(seqs) == 1 else None)
        drafts += d
        hidden += h
        chain += [c] if c is not None else []
        decode_s += dt
    np.save(out_dir / "draft_logits.npy", np.concatenate(drafts))
    np.save(out_dir / "hidden.npy", np.concatenate(hidden))
    if depth2:
        np.save(out_dir / "draft2_logits.npy", np.concatenate([c[0] for c in chain]))
        np.save(out_dir / "draft_tokens.npy", np.concatenate([c[1] for c in chain]).astype(np.int64))
    info["decode_s"] = round(decode_s, 4)
    info["decode_wall_s"] = round(time.time() - t1, 4)
    info["n_tokens"] = sum(len(h) for h in hidden)
    info["mtp_convention"] = conv


def _draft_one(llama_cpp, ext, model, s: dict, sequences: list, chunks, conv: str, n_vocab: int, chain=None):
    """One ``draft`` request on fresh trunk and MTP contexts (``_draft``): returns the draft rows
    and hidden states per sequence, the seconds inside ``llama_decode`` and, with ``chain`` (one
    sequence: the step-1 tokens d_t, or ``"own"`` for the argmax of each draft row), the depth-2
    rows and the d_t fed (``_chain``), else None. Long because the two contexts' batches are
    filled by hand, in one place, as llama.cpp's own MTP driver fills them."""
    shift = 1 if conv == "vllm" else 0

    n_embd = int(llama_cpp.llama_model_n_embd(model))
    n_batch = int(s["n_batch"])
    ctx = _context(llama_cpp, model, s, n_seq_max=len(sequences))
    ext.llama_set_embeddings_nextn(ctx, True, False)
    mctx = _context(llama_cpp, model, s, n_seq_max=len(sequences), other=ctx)
    if chain is not None:
        ext.llama_set_embeddings_nextn(mctx, True, False)  # g: the head's own t_h_nextn, after its head norm
    g_rows = [np.zeros((len(q), n_embd), np.float32) for q in sequences]
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    mbatch = llama_cpp.llama_batch_init(n_batch, n_embd, 1)
    mtokens = (llama_cpp.llama_token * n_batch)()  # llama_batch_init leaves token NULL when embd is allocated
    mbatch.token = ctypes.cast(mtokens, type(mbatch.token))
    membd = np.ctypeslib.as_array(mbatch.embd, shape=(n_batch, n_embd))
    hidden = [np.zeros((len(q), n_embd), np.float32) for q in sequences]
    drafts = [np.zeros((len(q) - 1, n_vocab), np.float32) for q in sequences]
    decode_s = 0.0

    def step(items):
        nonlocal decode_s
        for i, (tok, pos, seq) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = tok, pos, 1, seq, 1
        batch.n_tokens = len(items)
        t = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch) != 0:
            sys.stderr.write("harness-worker: llama_decode (trunk) failed\n")
            sys.exit(23)
        decode_s += time.perf_counter() - t
        h = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(ctx), shape=(len(items), n_embd))
        for i, (_, pos, seq) in enumerate(items):
            hidden[seq][pos] = h[i]
        rows = []
        for _, pos, seq in items:
            r = pos - shift  # the head row whose inputs this token completes
            if r < 0:
                continue
            q = sequences[seq]
            emb = hidden[seq][r] if conv == "vllm" else (hidden[seq][r - 1] if r else np.zeros(n_embd, np.float32))
            rows.append((q[r + shift], emb, r, seq))
        if not rows:
            return
        for i, (tok, emb, r, seq) in enumerate(rows):
            mtokens[i] = tok
            membd[i] = emb
            mbatch.pos[i], mbatch.n_seq_id[i], mbatch.seq_id[i][0], mbatch.logits[i] = r, 1, seq, 1
        mbatch.n_tokens = len(rows)
        t = time.perf_counter()
        if llama_cpp.llama_decode(mctx, mbatch) != 0:
            sys.stderr.write("harness-worker: llama_decode (MTP context) failed\n")
            sys.exit(23)
        decode_s += time.perf_counter() - t
        out = np.ctypeslib.as_array(llama_cpp.llama_get_logits(mctx), shape=(len(rows), n_vocab))
        if chain is not None:
            g = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(mctx), shape=(len(rows), n_embd))
            for i, (_, _, r, seq) in enumerate(rows):
                g_rows[seq][r] = g[i]
        for i, (_, _, r, seq) in enumerate(rows):
            d = r - (1 - shift)  # llama.cpp: row p drafts for tokens[p+1], i.e. draft row p − 1
            if 0 <= d < len(drafts[seq]):
                drafts[seq][d] = out[i]

    if len(sequences) == 1:
        q, pos = sequences[0], 0
        for c in chunks or [len(q)]:
            end = pos + c
            while pos < end:
                k = min(n_batch, end - pos)
                step([(q[pos + i], pos + i, 0) for i in range(k)])
                pos += k
    else:
        per = max(1, n_batch // len(sequences))
        for start in range(0, max(len(q) for q in sequences), per):
            items = [(q[p], p, sid) for sid, q in enumerate(sequences) for p in range(start, min(start + per, len(q)))]
            if items:
                step(items)
    chained = None
    if chain is not None:
        d_tok = np.argmax(drafts[0], axis=1) if chain == "own" else np.asarray(chain, np.int64)
        t = time.perf_counter()
        chained = (_chain(llama_cpp, mctx, mbatch, mtokens, membd, g_rows[0], d_tok, 1 - shift, n_vocab), d_tok)
        decode_s += time.perf_counter() - t
    llama_cpp.llama_batch_free(batch)
    mbatch.token = None  # ours (mtokens): llama_batch_free would free() it
    llama_cpp.llama_batch_free(mbatch)
    llama_cpp.llama_free(mctx)
    llama_cpp.llama_free(ctx)
    return drafts, hidden, decode_s, chained


def _chain(llama_cpp, mctx, mbatch, mtokens, membd, g, d_tok, lead: int, n_vocab: int) -> np.ndarray:
    """Depth 2 after the teacher-forced rows (``_draft_one``): for draft row t, last to first,
    the MTP context's KV cells after its head row r = t + lead are removed
    (``llama_memory_seq_rm``, as llama.cpp's speculative driver drops its draft rows) and the row
    (g_r, d_t) is decoded at position r + 1, g_r the context's own nextn embedding of row r (its
    ``t_h_nextn``: after the head norm, what llama.cpp's ``draft-mtp`` driver chains). Returns the
    rows' logits float32 [T − 1, V]."""
    mem = llama_cpp.llama_get_memory(mctx)
    out = np.zeros((len(d_tok), n_vocab), np.float32)
    for t in range(len(d_tok) - 1, -1, -1):
        r = t + lead
        llama_cpp.llama_memory_seq_rm(mem, 0, r + 1, -1)
        mtokens[0], membd[0] = int(d_tok[t]), g[r]
        mbatch.pos[0], mbatch.n_seq_id[0], mbatch.seq_id[0][0], mbatch.logits[0] = r + 1, 1, 0, 1
        mbatch.n_tokens = 1
        if llama_cpp.llama_decode(mctx, mbatch) != 0:
            sys.stderr.write("harness-worker: llama_decode (MTP context, depth 2) failed\n")
            sys.exit(23)
        out[t] = np.ctypeslib.as_array(llama_cpp.llama_get_logits(mctx), shape=(1, n_vocab))[0]
    return out


def _peak_rss_mb() -> float:
    """This process's peak resident set (``VmHWM`` of ``/proc/self/status``) in MB; 0 elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


if __name__ == "__main__":
    rc = main(sys.argv[1])
    # Everything the harness reads (the stream, info.json and the other files) is written and closed:
    # end now. The interpreter's teardown and llama.cpp's destructors at exit (the model's buffers,
    # the backend's threads) took about 0.3 s a run at V = 248,320, which the harness waited for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
