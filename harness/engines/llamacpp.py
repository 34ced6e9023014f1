"""The reference engine: llama.cpp through llama-cpp-python, run in a worker process.

Each call starts ``harness.engines._llamacpp_worker`` with a JSON request: a fresh context per
prompt (recurrent memory cannot be trimmed), logits requested for every token and streamed back
through a pipe as each ``llama_decode`` batch finishes; this side reads them straight into the
blocks it yields, so logits move once and neither process holds more than a batch or a block
(the worker's stream format is in its module docstring). A worker that exits non-zero or dies by
a signal (ggml ``abort()`` → SIGABRT), or whose stream ends early, becomes ``EngineError`` quoting
llama.cpp's own error line and the worker's last stderr lines; the harness itself never dies.

Settings that change numerics (recorded in ``info``): n_ctx, n_batch, n_ubatch, n_threads,
type_k/type_v (KV cache types, ``KV_TYPES``, checked when the settings are made), flash_attn,
use_extra_bufts, kv overrides; after a decode, ``flash_attn_ran`` (whether llama.cpp's log says
flash attention ran, which ``auto`` leaves to llama.cpp).

Extra buffer types (``llama_model_params.use_extra_bufts``, llama.cpp's ``--repack`` /
``--no-repack``) are off by default, where llama.cpp's own default is on: with them the CPU
backend repacks quantized weights at load into an ``AMX`` buffer (x86 with AMX_INT8) or a
``CPU_REPACK`` buffer (Q4_0, Q4_K, IQ4_XS, ... on AVX2/AVX512 and ARM), whose kernels round
differently, and on Intel Xeon CPUs with AMX the AMX path kills the worker with SIGSEGV at its
first compute (llama.cpp #20824, ollama #17236; measured on this project's Q8_0, Q6_K and Q4_K_M
fixtures). The engine ``llama.cpp-repack`` turns them on (``REPACK_ENGINE``). The setting is
the model's: llama.cpp's MTP context (``draft``) reads the same loaded weights, so it follows
too. ``info.build`` holds ``cpu_features`` (``llama_print_system_info()``: the CPU features
llama.cpp was built for and found, AMX_INT8 and REPACK among them) and ``model_buffers`` (each
model buffer llama.cpp's load log names, with its MiB: ``CPU_Mapped``, ``AMX``, ``CPU_REPACK``).
A worker killed by SIGSEGV or SIGILL after making an AMX or CPU_REPACK buffer says so and names
the setting that avoids it (``crash_cause``).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from harness.engines.base import MTP_CHAIN, MTP_CONVENTIONS, BlockPool, ChainedDrafts, Drafts, EngineInfo, LogitBlock, shifted, validate_chunks
from harness.engines.process import exit_status, read_tail, tail_lines
from harness.engines.ring import LogitRing, ring_dir
from harness.errors import EngineError, InvalidInput
from harness.model.gguf_model import Override
from harness.rundir import scratch_dir

REPACK_ENGINE = "llama.cpp-repack"
"""The engine name of llama.cpp with its extra buffer types on (``use_extra_bufts=True``, as
llama.cpp runs by default): for users who want the reference as llama.cpp's own users run it."""

EXTRA_BUFFERS = ("AMX", "CPU_REPACK")
"""The CPU backend's extra buffer types a repacked weight lands in (ggml-cpu ``amx/amx.cpp``,
``repack.cpp``; the names llama.cpp's load log prints)."""

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
"""The KV-cache types (``llama_context_params.type_k`` / ``type_v``; llama.cpp's ``--cache-type-k`` /
``--cache-type-v``) the harness runs and judges: the float ones and the two quantized ones the
KV-type matrix measures (docs/gates-matrix.md, "KV-cache types")."""

QUANTIZED_KV = ("q8_0", "q4_0")
"""The quantized ones: llama.cpp needs flash attention for a quantized V cache (``llama_context``:
"quantized V cache requires flash_attn to be enabled")."""

FLASH_ATTN_MODES = ("auto", "on", "off")
"""``llama_context_params.flash_attn_type``: ``LLAMA_FLASH_ATTN_TYPE_AUTO`` / ``ENABLED`` / ``DISABLED``
(llama.cpp's ``--flash-attn auto|on|off``)."""

_FLASH_ATTN_LOG = re.compile(r"llama_context: flash_attn\s+=\s+(\w+)|Flash Attention (enabled)|Flash Attention not supported, set to (disabled)")

_MODEL_BUFFER = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")

_ERROR_LINE = re.compile(r"(error loading model[^\n]*|llama_model_load: error[^\n]*|GGML_ASSERT[^\n]*|failed to[^\n]*|missing tensor[^\n]*|error:[^\n]*)", re.I)


@dataclass
class LlamaCppSettings:
    """llama.cpp settings that change numerics: the context's and, ``use_extra_bufts``, the
    model load's. ``n_ctx`` 0: fit the prompt (≥ 512)."""

    n_ctx: int = 0
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 2
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"
    use_extra_bufts: bool = False
    """``llama_model_params.use_extra_bufts`` (llama.cpp ``--repack``): weights repacked into the
    CPU backend's extra buffer types (``EXTRA_BUFFERS``). Off: the AMX path segfaults on Intel
    Xeon (module docstring); the ``llama.cpp-repack`` engine turns it on."""

    def __post_init__(self) -> None:
        """Check ``type_k`` / ``type_v`` (``KV_TYPES``) and ``flash_attn`` (``FLASH_ATTN_MODES``) before
        any worker starts. Raises ``InvalidInput`` (exit 2), one line naming the allowed values; also
        for a quantized V cache with flash attention off, which llama.cpp refuses (its context fails
        to initialize)."""
        for key in ("type_k", "type_v"):
            if getattr(self, key) not in KV_TYPES:
                raise InvalidInput(f"llama.cpp {key} {getattr(self, key)!r} is not a KV-cache type the harness runs; "
                                   f"allowed: {', '.join(KV_TYPES)}")
        if self.flash_attn not in FLASH_ATTN_MODES:
            raise InvalidInput(f"llama.cpp flash_attn {self.flash_attn!r} is not one of {', '.join(FLASH_ATTN_MODES)}")
        if self.type_v in QUANTIZED_KV and self.flash_attn == "off":
            raise InvalidInput(f"llama.cpp needs flash attention for a quantized V cache (type_v {self.type_v}): "
                               "flash_attn on or auto")

    def resolved(self, n_tokens: int) -> dict[str, Any]:
        d = dict(self.__dict__)
        if not d["n_ctx"]:
            d["n_ctx"] = max(512, -(-max(n_tokens, 1) // 256) * 256)
        d["n_batch"] = min(d["n_batch"], d["n_ctx"])
        d["n_ubatch"] = min(d["n_ubatch"], d["n_batch"])
        return d


def _error_line(stderr: str) -> str:
    lines = [m.group(1).strip() for m in _ERROR_LINE.finditer(stderr)]
    return lines[0] if lines else ""


def model_buffers(log_lines: Iterable[str]) -> dict[str, float]:
    """The model buffers llama.cpp's load log names (``load_tensors: AMX model buffer size =
    2.97 MiB``), ``{buffer type name: MiB}`` in the order made (llama-model.cpp ``load_tensors``);
    empty when the log holds none (a vocabulary-only load)."""
    out: dict[str, float] = {}
    for line in log_lines:
        m = _MODEL_BUFFER.search(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def flash_attn_ran(log_lines: Iterable[str]) -> str | None:
    """Whether llama.cpp's context ran flash attention, from its log: ``"enabled"`` or
    ``"disabled"`` (``llama_context: flash_attn = enabled|disabled``, or, for ``auto``, what
    ``resolve_fused_ops`` settled on: ``Flash Attention enabled``, ``... not supported, set to
    disabled``); None when the log says neither (no context was made)."""
    ran = None
    for line in log_lines:
        m = _FLASH_ATTN_LOG.search(line)
        if m:
            v = next(g for g in m.groups() if g)
            ran = v if v in ("enabled", "disabled") else ran
    return ran


def crash_cause(rc: int, buffers: Mapping[str, float]) -> str:
    """Why a worker that ended with ``rc`` (``Popen.returncode``) probably died, or "" when no
    known cause fits: killed by SIGSEGV or SIGILL after llama.cpp made an extra-buffer-type model
    buffer (``EXTRA_BUFFERS`` among ``buffers``, from ``model_buffers``), the repacked-weight
    kernels' crash (AMX: llama.cpp #20824), and the setting that avoids it."""
    if rc not in (-signal.SIGSEGV, -signal.SIGILL):
        return ""
    made = [b for b in EXTRA_BUFFERS if b in buffers]
    if not made:
        return ""
    where = f"{' and '.join(made)} model buffer{'s' if len(made) > 1 else ''}"
    known = "the AMX path is known to crash (llama.cpp #20824); " if "AMX" in made else ""
    return (f"llama.cpp had repacked weights into its {where} (extra buffer types on); {known}"
            f"the engine llama.cpp instead of {REPACK_ENGINE} (use_extra_bufts false, llama.cpp --no-repack) avoids it")


def cpu_has_amx(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """Whether this CPU has Intel AMX for int8 (the ``amx_int8`` flag of Linux ``/proc/cpuinfo``),
    where llama.cpp built for it makes an ``AMX`` model buffer with extra buffer types on; False
    where the file cannot be read (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            return any(line.startswith("flags") and "amx_int8" in line.split() for line in f)
    except OSError:
        return False


def _scan_buffers(stderr_path: Path) -> dict[str, float]:
    """``model_buffers`` of a worker's whole stderr file, read a line at a time."""
    try:
        with open(stderr_path, "r", encoding="utf-8", errors="replace") as f:
            return model_buffers(f)
    except OSError:
        return {}


def _scan_flash_attn(stderr_path: Path) -> str | None:
    """``flash_attn_ran`` of a worker's whole stderr file, read a line at a time."""
    try:
        with open(stderr_path, "r", encoding="utf-8", errors="replace") as f:
            return flash_attn_ran(f)
    except OSError:
        return None


class LlamaCppEngine:
    """llama.cpp as an engine (the reference). One model file, fixed settings.

    ``logits(tokens, chunks)`` yields float32 ``[B, V]`` blocks; ``chunks`` feeds consecutive
    pieces through separate ``llama_decode`` calls in one context (state carried).
    ``logits_multi(sequences)`` decodes several sequences side by side (one seq id each);
    ``generate(tokens, n)`` continues greedily through llama.cpp's own decode path.
    Raises ``EngineError`` (exit 3) on load failure, crash, timeout or malformed output.

    ``block_size``: rows per yielded block (32: 32 MB at V = 248,320). The rows arrive a ring
    slot of 4 at a time, so a larger block only delays the consumer's first metrics and holds
    more memory: at 256 rows the pool's two blocks were 508 MB of the harness process (issue 47;
    docs/benchmarks.md section 2). The bytes of every row are the same at any block size.
    """

    name = "llama.cpp"
    use_ring = True
    """A single sequence's rows cross from the worker through a shared-memory ring
    (``harness.engines.ring``) where one can be made; False: through the pipe, as before (tests
    compare the two)."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        overrides: Sequence[Override] = (),
        settings: LlamaCppSettings | None = None,
        timeout_s: float = 900.0,
        block_size: int = 32,
        tokenizer_only: bool = False,
    ):
        self.model_path = Path(model_path)
        self.tokenizer_only = tokenizer_only
        """Made only to tokenize (another engine is the reference): its runs load the vocabulary alone."""
        self.overrides = list(overrides)
        self.settings = settings or LlamaCppSettings()
        self.timeout_s = timeout_s
        self.block_size = block_size
        self.timings: dict[str, float] = {}
        """Summed over this engine's worker runs: ``load_s`` (model load), ``decode_s`` (inside
        ``llama_decode``), ``n_tokens`` (tokens decoded)."""
        self._pool = BlockPool()
        """The blocks of this engine's streams, kept across its worker runs and prompts, so that a
        prompt does not fault in fresh ones (at 256 rows, 254 MB, that page zeroing cost about
        0.3 s a block: ``BlockPool``)."""
        self.worker_peak_rss_mb = 0.0
        """The largest decoding worker's peak RSS so far (its ``VmHWM``, MB): benchmarks, tests."""
        self.flash_attn_ran: str | None = None
        """Whether the last decoding run ran flash attention (``flash_attn_ran``: ``enabled`` /
        ``disabled``; None before one): ``info.settings["flash_attn_ran"]``, so a receipt says which
        rows ran with it whatever ``flash_attn`` asked (``auto``)."""

    def with_settings(self, **changes: Any) -> "LlamaCppEngine":
        """The same model with some settings changed (e.g. ``n_ubatch=7``)."""
        return LlamaCppEngine(self.model_path, self.overrides, replace(self.settings, **changes), self.timeout_s, self.block_size)

    # -- worker plumbing ------------------------------------------------------------------
    def _start(self, request: dict[str, Any], workdir: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        """Write the request into ``workdir`` and start a worker on it (stderr to a file there)."""
        request = {
            "model": str(self.model_path),
            "overrides": [o.__dict__ for o in self.overrides],
            "use_extra_bufts": bool(self.settings.use_extra_bufts),
            "out_dir": str(workdir),
            **request,
        }
        req_path = workdir / "request.json"
        req_path.write_text(json.dumps(request))
        with open(workdir / "stderr.txt", "wb") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "harness.engines._llamacpp_worker", str(req_path)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                stdin=subprocess.DEVNULL,
                pass_fds=pass_fds,
                env=worker_env(os.environ),
            )

    def _finish(self, proc: subprocess.Popen, workdir: Path, deadline: float) -> dict[str, Any]:
        """Wait for the worker until ``deadline`` (``time.monotonic``), then check its exit and
        return its ``info.json`` (a decoding run's load and decode seconds are added to
        ``self.timings``).
        Raises ``EngineError`` on a timeout, a non-zero exit, a signal or a missing info file."""
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        with open(workdir / "stderr.txt", "rb") as f:
            stderr = read_tail(f)  # at most the last 64 KiB, whatever the worker wrote
        tail = tail_lines(stderr)
        if rc is None:
            raise EngineError(f"llama.cpp worker timed out after {self.timeout_s:.0f} s on {self.model_path.name}", tail)
        if rc != 0:
            what = exit_status(rc)
            line = _error_line(stderr) or crash_cause(rc, _scan_buffers(workdir / "stderr.txt"))
            msg = f"llama.cpp {what} on {self.model_path.name}"
            raise EngineError(f"{msg}: {line}" if line else msg, tail)
        info_path = workdir / "info.json"
        if not info_path.exists():
            raise EngineError("llama.cpp worker wrote no info.json", tail)
        info = json.loads(info_path.read_text())
        if "n_vocab" in info and "decode_s" not in info:  # a whole-model load described (info, tokenize with_info)
            info["model_buffers"] = _scan_buffers(workdir / "stderr.txt")
        if "decode_s" in info:  # a run that decoded (logits, activations); not info or tokenize
            for key in ("load_s", "decode_s", "n_tokens"):
                self.timings[key] = self.timings.get(key, 0) + info.get(key, 0)
            self.worker_peak_rss_mb = max(self.worker_peak_rss_mb, float(info.get("peak_rss_mb") or 0))
            self.flash_attn_ran = _scan_flash_attn(workdir / "stderr.txt") or self.flash_attn_ran
        return info

    def _run(self, request: dict[str, Any], workdir: Path) -> dict[str, Any]:
        """One worker run to completion (no stream); returns its ``info.json``."""
        return self._finish(self._start(request, workdir), workdir, time.monotonic() + self.timeout_s)

    @cached_property
    def _static_info(self) -> dict[str, Any]:
        with scratch_dir("llamacpp-") as d:
            return self._run({"op": "info"}, d)

    @property
    def n_vocab(self) -> int:
        return int(self._static_info["n_vocab"])

    @property
    def info(self) -> EngineInfo:
        si = self._static_info
        return EngineInfo(
            name=self.name,
            version=f"llama-cpp-python {si.get('llama_cpp_python', '?')}",
            settings={**self.settings.__dict__, "overrides": [o.to_flag() for o in self.overrides],
                      **({"flash_attn_ran": self.flash_attn_ran} if self.flash_attn_ran else {})},
            capabilities=["chunks", "n_ubatch", "multi_seq", "activations", "generate"] + (["mtp", MTP_CHAIN] if si.get("n_layer_nextn") else []),
            build={"cpu_features": si.get("system_info", ""), "model_desc": si.get("model_desc", ""),
                   "model_buffers": si.get("model_buffers", {})},
            compute_class="f32",
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` by the model's own vocab (no BOS, specials not parsed)."""
        return self.tokenize_many([text])[0]

    def tokenize_many(self, texts: Sequence[str | bytes], add_special: bool = False, parse_special: bool = False) -> list[list[int]]:
        """Token ids of each text, in one worker run (a ``bytes`` item is given to llama_tokenize
        as it is, UTF-8 or not; ``add_special``: llama_tokenize's, the
        BOS/EOS the vocabulary's ``add_bos_token``/``add_eos_token`` ask for; ``parse_special``:
        llama_tokenize's, special-token strings in the text become their ids, as a server
        tokenizes a rendered chat prompt; off by default).

        Until this engine's ``info`` has been read, that run also loads the whole model and
        returns what an ``info`` run would (kept for ``info``, ``n_vocab``): the reference
        tokenizes its prompts and is then described in the receipt, so one process start and
        one model load serve both (about 0.3 s each at V = 248,320). An engine made only to
        tokenize (``tokenizer_only``) loads the vocabulary alone."""
        with_info = not self.tokenizer_only and "_static_info" not in self.__dict__
        with scratch_dir("llamacpp-") as d:
            sent = [{"hex": t.hex()} if isinstance(t, bytes) else t for t in texts]
            info = self._run({"op": "tokenize", "texts": sent, "with_info": with_info, "add_special": bool(add_special),
                              "parse_special": bool(parse_special)}, d)
            if with_info:
                self.__dict__["_static_info"] = {k: v for k, v in info.items() if k != "tokenize_s"}
            return json.loads((d / "tokens.json").read_text())

    @contextmanager
    def _worker_stream(self, request: dict[str, Any], ring: bool = False) -> Iterator[tuple["_PipeReader", Any]]:
        """Start a worker on ``request`` with a pipe for its logits; yields the pipe's reader and a
        ``finish()`` that waits for the worker and checks its exit (raising with llama.cpp's error).
        ``ring`` (a single sequence's rows): the rows go through a shared-memory ring
        (``_open_ring``; the reader's ``ring``) where one can be made, else through the pipe.
        A worker still running when the block ends (the consumer stopped early, or an error) is
        killed."""
        with scratch_dir("llamacpp-") as workdir:
            lring = self._open_ring(workdir) if ring and self.use_ring else None
            r, w = os.pipe()
            _widen_pipe(w)
            ack_r, ack_w = os.pipe() if lring else (None, None)
            fds = (w,) if ack_r is None else (w, ack_r)
            extra = {} if lring is None else {"ring": lring.spec, "ack_fd": ack_r}
            try:
                proc = self._start({**request, "stream_fd": w, **extra}, workdir, pass_fds=fds)
            finally:
                for fd in fds:
                    os.close(fd)
            deadline = time.monotonic() + self.timeout_s
            try:
                with open(r, "rb", buffering=0) as pipe:
                    yield _PipeReader(pipe, deadline, lring, ack_w), lambda: self._finish(proc, workdir, deadline)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if ack_w is not None:
                    os.close(ack_w)
                if lring is not None:
                    lring.close()

    def _open_ring(self, workdir: Path) -> LogitRing | None:
        """A mapped ``LogitRing`` for the worker's rows in ``/dev/shm`` (else ``workdir``), or None
        when none can be made (the pipe then carries the rows, as before the ring)."""
        try:
            return LogitRing(ring_dir(workdir), self.n_vocab, rows=WORKER_RING_ROWS, mapped=True, sealed=True)
        except OSError:
            return None

    def _header(self, reader: "_PipeReader", finish: Any) -> int:
        """The stream's int64 ``n_vocab`` header; a stream that ends first raises the worker's error."""
        head = np.empty(1, dtype="<i8")
        if not reader.fill(head):
            finish()  # raises with llama.cpp's error
            raise EngineError("llama.cpp worker closed its logits stream without a header")
        return int(head[0])

    @staticmethod
    def _checked(blocks: Iterator[LogitBlock | None], n_rows: int, finish: Any) -> Iterator[LogitBlock]:
        for item in blocks:
            if item is None:  # the stream ended early: the worker's exit says why
                finish()
                raise EngineError(f"llama.cpp worker's logits stream ended before {n_rows} rows")
            yield item

    def _stream(self, request: dict[str, Any], n_rows: int) -> Iterator[LogitBlock]:
        """Start a worker on ``request`` and yield its logits as ``(start, float32 [B, V])``
        blocks of ``block_size`` rows while it decodes. Rows of several sequences (``sequences``)
        arrive interleaved with their indices and are put in order through a file first."""
        with self._worker_stream(request, ring=request["op"] == "logits" and not request.get("sequences")) as (reader, finish):
            n_vocab = self._header(reader, finish)
            if request.get("sequences"):
                with scratch_dir("llamacpp-order-") as d:
                    yield from self._checked(self._ordered_from_indexed(reader, n_rows, n_vocab, d), n_rows, finish)
            else:
                yield from self._checked(self._in_order(reader, n_rows, n_vocab), n_rows, finish)
            finish()

    logits_each_first_rows = True
    """``logits_each`` takes ``first_rows`` (``harness.engines.base.logits_each``): the worker sets
    ``batch.logits`` only for the rows asked for, as ``llama-perplexity`` does."""

    def logits_each(self, prompts: Sequence[Sequence[int]], first_rows: Sequence[int] | None = None) -> Iterator[Iterator[LogitBlock]]:
        """Each prompt's ``logits`` stream, in order, from one worker run: one process start and
        one model load for a whole prompt set, where ``logits`` per prompt pays both every time
        (about 1 s a prompt at V = 248,320). Every prompt is decoded exactly as ``logits(tokens)``
        decodes it: its own fresh context, with the settings its length resolves to, so its rows
        are the same bytes (``tests/test_llamacpp.py``). Yields one block iterator per prompt; a
        prompt's stream must be read before the next one is (what is left unread is read and
        dropped). ``first_rows``: prompt i's rows from position ``first_rows[i]`` on alone (the
        worker's ``first_row``: llama.cpp computes no others), blocks' starts positions. Raises
        ``EngineError`` as ``logits``."""
        toks = [[int(t) for t in p] for p in prompts]
        firsts = [int(k) for k in first_rows] if first_rows is not None else [0] * len(toks)
        if len(toks) <= 1:
            yield from (self.logits(t, first_row=k) for t, k in zip(toks, firsts))
            return
        req = {"op": "logits", "prompts": [{"tokens": t, "settings": self.settings.resolved(len(t)), **({"first_row": k} if k else {})}
                                           for t, k in zip(toks, firsts)]}
        with self._worker_stream(req, ring=True) as (reader, finish):
            for t, k in zip(toks, firsts):
                stream = shifted(self._prompt_stream(reader, finish, len(t) - k), k)
                yield stream  # before the worker has loaded: the caller can start its candidate meanwhile
                for _ in stream:  # what the consumer left unread
                    pass
            finish()

    def _prompt_stream(self, reader: "_PipeReader", finish: Any, n_rows: int) -> Iterator[LogitBlock]:
        """One prompt of a ``logits_each`` run: its ``n_vocab`` header, read on the first block
        asked for, then its rows in order."""
        n_vocab = self._header(reader, finish)
        yield from self._checked(self._in_order(reader, n_rows, n_vocab), n_rows, finish)

    def _in_order(self, reader: "_PipeReader", n_rows: int, n_vocab: int) -> Iterator[LogitBlock | None]:
        """Blocks read straight from a single sequence's stream (rows in position order), or,
        with a ring, from the slots it announces."""
        if reader.ring is not None:
            yield from reader.ring_blocks(n_rows, n_vocab, self.block_size, self._pool)
            return
        pool = self._pool
        for start in range(0, n_rows, self.block_size):
            block = pool.take(min(self.block_size, n_rows - start), n_vocab)
            if not reader.fill(block):
                yield None
                return
            yield start, block

    def _ordered_from_indexed(self, reader: "_PipeReader", n_rows: int, n_vocab: int, workdir: Path) -> Iterator[LogitBlock | None]:
        """Several sequences' interleaved rows written to their places in a file (plain
        positioned writes: no mapping, so no rows stay in this process), then read back in
        blocks."""
        row_bytes = n_vocab * 4
        seen = 0
        with open(workdir / "logits.f32", "w+b") as f:
            while seen < n_rows:
                count = np.empty(1, dtype="<i8")
                if not reader.fill(count):
                    yield None
                    return
                k = int(count[0])
                rows = np.empty(k, dtype="<i8")
                buf = np.empty((k, n_vocab), dtype="<f4")
                if k <= 0 or not reader.fill(rows) or not reader.fill(buf) or rows.min() < 0 or rows.max() >= n_rows:
                    yield None
                    return
                for i, row in enumerate(rows.tolist()):
                    os.pwrite(f.fileno(), buf[i].data, row * row_bytes)
                seen += k
            for start in range(0, n_rows, self.block_size):
                n = min(self.block_size, n_rows - start)
                block = np.empty((n, n_vocab), dtype="<f4")
                f.seek(start * row_bytes)
                f.readinto(memoryview(block).cast("B"))
                yield start, block

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, first_row: int = 0) -> Iterator[LogitBlock]:
        """``Engine.logits``; ``first_row`` > 0: positions ``first_row`` .. T − 1 alone (the
        worker asks llama.cpp for no others), blocks' starts positions."""
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks)
        first = int(first_row)
        if not 0 <= first < max(1, len(tokens)):
            raise EngineError(f"llama.cpp: first row {first} outside a {len(tokens)}-token prompt")
        req = {"op": "logits", "tokens": tokens, "chunks": pieces, "settings": self.settings.resolved(len(tokens)),
               **({"first_row": first} if first else {})}
        yield from shifted(self._stream(req, len(tokens) - first), first)

    def activations(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """llama.cpp's own intermediate tensors, captured through the eval callback (``cb_eval``).

        Returns ``{name: float32 array}`` under the graph's names (``l_out-N``, ``attn_output-N``,
        ``linear_attn_out-N``, ``result_norm``, ...), in NumPy order with leading size-1 axes
        dropped, joined across ubatches along the token axis (position-major). ``names``
        restricts the capture (default: every tensor). The ggml op that produced each tensor is in
        ``self.last_ops`` (e.g. which gated-delta-net kernel ran).
        """
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks)
        req = {"op": "activations", "tokens": tokens, "chunks": pieces, "settings": self.settings.resolved(len(tokens)),
               "names": list(names) if names else None}
        with scratch_dir("llamacpp-") as d:
            info = self._run(req, d)
            self.last_ops = info.get("ops", {})
            try:
                with np.load(d / "activations.npz", allow_pickle=False) as z:
                    return {k: np.array(z[k]) for k in z.files}
            except (OSError, ValueError) as e:
                raise EngineError(f"llama.cpp worker wrote unreadable activations: {e}") from None

    def generate(self, tokens: Sequence[int], n_tokens: int) -> list[int]:
        """Greedy free-running continuation (capability ``generate``; ``harness.engines.base.Engine``):
        the prompt in one context, then each argmax (llama.cpp's float32 logits, ties to the
        lowest id) fed back through one ``llama_decode`` call; ``n_tokens`` ids, no EOS stop."""
        tokens = [int(t) for t in tokens]
        n = max(0, int(n_tokens))
        if n == 0:
            return []
        req = {"op": "generate", "tokens": tokens, "n_generate": n, "settings": self.settings.resolved(len(tokens) + n)}
        with scratch_dir("llamacpp-") as d:
            self._run(req, d)
            try:
                out = json.loads((d / "generated.json").read_text())
            except (OSError, ValueError) as e:
                raise EngineError(f"llama.cpp worker wrote no readable generated.json ({e})") from None
        if not isinstance(out, list) or len(out) != n or not all(isinstance(t, int) for t in out):
            raise EngineError(f"llama.cpp worker generated {str(out)[:80]!r}, expected {n} token ids")
        return out

    def draft(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, convention: str = "llama.cpp") -> Drafts:
        """The MTP head's teacher-forced draft logits through llama.cpp's own MTP context
        (capability ``mtp``; ``harness.engines.base.Drafts``): the trunk fed in ``chunks``, its nextn
        embeddings (post-``output_norm`` h_t) fed with the next tokens to a second context of type
        MTP, rows in ``convention`` (``llama.cpp``: after a sentinel row; ``vllm``: (h_t, x_{t+1})
        at t). Raises ``EngineError`` (no MTP block, worker failure, malformed output)."""
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks)
        return self._draft({"tokens": tokens, "chunks": pieces}, [tokens], convention)[0]

    def draft_multi(self, sequences: Sequence[Sequence[int]], convention: str = "llama.cpp") -> list[Drafts]:
        """``draft`` of several sequences decoded together, one seq id each in both contexts."""
        seqs = [[int(t) for t in q] for q in sequences]
        return self._draft({"sequences": seqs}, seqs, convention)

    def draft_many(self, items: Sequence[tuple[Sequence[int], Sequence[int] | None]], convention: str = "llama.cpp") -> list[Drafts]:
        """``draft`` of several prompts ``(tokens, chunks)``, each on fresh contexts, in one worker
        run (one model load): the same rows as one ``draft`` call each."""
        reqs = [{"tokens": [int(t) for t in toks], "chunks": validate_chunks(len(toks), chunks)} for toks, chunks in items]
        return self._draft({"items": reqs}, [r["tokens"] for r in reqs], convention)

    def draft_chain(self, tokens: Sequence[int], draft_tokens: Sequence[int] | None = None, convention: str = "llama.cpp") -> ChainedDrafts:
        """Teacher-forced drafts at depth 1 and 2 through llama.cpp's MTP context (capability
        ``mtp_chain``; ``harness.engines.base.ChainedDrafts``), the prompt fed whole: after the
        teacher-forced rows, each draft row's step 2 (g_r, d_t) is decoded at the next position
        with the context's later KV cells removed (the worker's ``_chain``). Raises as ``draft``."""
        return self.draft_chain_many([(tokens, draft_tokens)], convention)[0]

    def draft_chain_many(self, items: Sequence[tuple[Sequence[int], Sequence[int] | None]], convention: str = "llama.cpp") -> list[ChainedDrafts]:
        """``draft_chain`` of several ``(tokens, draft_tokens)`` in one worker run (one model load)."""
        reqs = [{"tokens": [int(t) for t in toks], "chunks": None, "draft_tokens": None if d is None else [int(x) for x in d]}
                for toks, d in items]
        seqs = [r["tokens"] for r in reqs]
        for r in reqs:
            if r["draft_tokens"] is not None and len(r["draft_tokens"]) != len(r["tokens"]) - 1:
                raise EngineError(f"draft_tokens: {len(r['draft_tokens'])} ids for {len(r['tokens']) - 1} draft rows")
        return self._draft({"items": reqs, "depth": 2}, seqs, convention)

    def _draft(self, fields: dict[str, Any], seqs: list[list[int]], convention: str) -> list[Any]:
        if convention not in MTP_CONVENTIONS:
            raise EngineError(f"unknown MTP convention {convention!r} (one of {', '.join(MTP_CONVENTIONS)})")
        if any(len(q) < 2 for q in seqs):
            raise EngineError("draft logits need at least 2 tokens per sequence (row t predicts tokens[t+2])")
        req = {"op": "draft", **fields, "mtp_convention": convention, "settings": self.settings.resolved(max(len(q) for q in seqs))}
        with scratch_dir("llamacpp-") as d:
            self._run(req, d)
            try:
                logits = np.load(d / "draft_logits.npy", allow_pickle=False)
                hidden = np.load(d / "hidden.npy", allow_pickle=False)
                chain = (np.load(d / "draft2_logits.npy", allow_pickle=False), np.load(d / "draft_tokens.npy", allow_pickle=False)) \
                    if fields.get("depth") == 2 else None
            except (OSError, ValueError) as e:
                raise EngineError(f"llama.cpp worker wrote unreadable draft logits: {e}") from None
        n_rows, n_tok = sum(len(q) - 1 for q in seqs), sum(len(q) for q in seqs)
        if logits.shape != (n_rows, self.n_vocab) or hidden.shape[0] != n_tok or (chain and chain[0].shape != logits.shape):
            raise EngineError(f"llama.cpp worker wrote draft logits {logits.shape} / hidden {hidden.shape} for {len(seqs)} sequence(s)")
        out, r, t = [], 0, 0
        for q in seqs:
            rows = slice(r, r + len(q) - 1)
            out.append(Drafts(logits[rows], hidden[t : t + len(q)]) if chain is None else ChainedDrafts(logits[rows], chain[0][rows], chain[1][rows]))
            r, t = r + len(q) - 1, t + len(q)
        return out

    def logits_multi(self, sequences: Sequence[Sequence[int]]) -> Iterator[LogitBlock]:
        """Logits of several sequences decoded together; rows are the sequences concatenated."""
        seqs = [[int(t) for t in q] for q in sequences]
        total = sum(len(q) for q in seqs)
        # one KV cache holds every sequence (kv_unified): the context must fit their sum
        req = {"op": "logits", "sequences": seqs, "settings": self.settings.resolved(total)}
        yield from self._stream(req, total)


WORKER_RING_ROWS = 4
"""Rows per slot of the worker's ring: 2 slots of 4 rows are 8 MB at V = 248,320, mapped in the
worker and in the harness. Larger slots cost resident memory in both (the worker already holds
one 512-row batch), not speed: with 16 rows the ring's 32 MB pushed the harness's own memory
above its 512 MB target (532 MB, docs/benchmarks.md section 2); a slot's announcement and ack
cost microseconds."""


HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc's malloc tunable (glibc 2.35 on, "Memory Allocation Tunables" in its manual): memory it
maps itself (every large allocation: llama.cpp's compute and output buffers, its KV cache) is
advised ``MADV_HUGEPAGE``, so a kernel whose transparent huge pages are in ``madvise`` mode backs
it with 2 MiB pages."""


def worker_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a llama.cpp worker: ``base`` with ``GGML_NO_BACKTRACE=1`` (ggml's
    ``abort()`` otherwise attaches gdb for a backtrace: seconds to minutes, or a hang under load,
    before the worker dies, and gdb's lines bury the assert), ``OMP_WAIT_POLICY=PASSIVE`` unless
    the caller set it, and ``HUGETLB_TUNABLE`` added to
    ``GLIBC_TUNABLES`` (after the caller's own tunables; a caller who set ``glibc.malloc.hugetlb``
    keeps theirs).

    Why huge pages: the worker gives the pages of each batch's logits back to the kernel once
    written (``_llamacpp_worker``, issue 15's one-batch memory bound), so every 512-row batch at
    V = 248,320 faults about 250,000 4 KiB pages in again, and every prompt's fresh context as
    many. On ``fixture:tiny-qwen35-v248k`` (3 × 512 positions, docs/benchmarks.md section 14)
    that was 1.88 million page faults and about 4 s of kernel time in the worker; with 2 MiB
    pages, 17,000 faults and about 1.3 s. The logits are the same bytes (memory placement
    changes no arithmetic; ``tests/test_llamacpp_rows.py``). An older glibc ignores the tunable
    and a kernel with transparent huge pages off ignores the advice: the worker is then as
    before.

    Why passive waiting: the worker decodes beside the candidate engine, often on the same
    cores. llama.cpp's CPU backend (built with OpenMP) otherwise spins its threads at every
    barrier of the graph while the other process holds the core they wait for. On 2 cores with
    the example engine beside it (docs/benchmarks.md section 14) a parity run took 13.2–17.2 s
    with spinning and 11.0–11.4 s with passive waiting, under the same background load; alone,
    the two are alike. The arithmetic, and so the logits, are the same."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", **base, "GGML_NO_BACKTRACE": "1"}
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{HUGETLB_TUNABLE}" if tunables else HUGETLB_TUNABLE
    return env


PIPE_BYTES = 1 << 20
"""The logits pipe's capacity asked for (``F_SETPIPE_SZ``; Linux's default ``pipe-max-size``):
a 1 MB row crosses in one read, not sixteen of the default 64 KiB."""


def _widen_pipe(fd: int) -> None:
    """Ask for a ``PIPE_BYTES`` pipe buffer where the system allows it; a smaller limit
    (``/proc/sys/fs/pipe-max-size``) or another OS leaves the default, which only costs reads."""
    setsz = getattr(fcntl, "F_SETPIPE_SZ", 1031)
    try:
        fcntl.fcntl(fd, setsz, PIPE_BYTES)
    except OSError:
        pass


class _PipeReader:
    """Exact reads from the worker's stream into NumPy buffers, bounded by a deadline; with a
    ``ring`` (``LogitRing``) and ``ack_fd`` (the pipe on which slots are given back), the rows
    of a single sequence come through the ring (``ring_blocks``)."""

    def __init__(self, pipe: Any, deadline: float, ring: LogitRing | None = None, ack_fd: int | None = None):
        self.pipe, self.deadline, self.ring, self.ack_fd = pipe, deadline, ring, ack_fd

    def ring_blocks(self, n_rows: int, n_vocab: int, block_size: int, pool: BlockPool | None = None) -> Iterator[LogitBlock | None]:
        """A single sequence's ``n_rows`` rows from the ring, as blocks of ``block_size`` rows
        (the last shorter, taken from ``pool``), as the pipe gives them. Each announcement (int64 slot, int64 row
        count) is read from the stream, the slot's rows copied into the blocks and the slot given
        back to the worker (int64 slot on ``ack_fd``) before the blocks it completed are yielded
        (a worker that has already exited, after its last rows, is not an error here). None when
        the stream ends first (the worker's exit says why). Raises ``EngineError`` for
        an announcement outside the ring or past ``n_rows``, or a ring of another vocabulary."""
        ring = self.ring
        assert ring is not None and self.ack_fd is not None
        if ring.n_vocab != n_vocab:
            raise EngineError(f"llama.cpp worker streams {n_vocab} logits a row into a ring of {ring.n_vocab}")
        head, pool = np.empty(2, dtype="<i8"), pool if pool is not None else BlockPool()
        got, start, block, filled = 0, 0, None, 0
        while got < n_rows:
            if not self.fill(head):
                yield None
                return
            slot, k = int(head[0]), int(head[1])
            if not (0 <= slot < ring.slots and 0 < k <= ring.rows and got + k <= n_rows):
                raise EngineError(f"llama.cpp worker announced {k} rows in ring slot {slot} at row {got} of {n_rows}")
            done: list[LogitBlock] = []
            lo = 0  # rows of this slot copied so far
            while lo < k:
                if block is None:
                    block, filled = pool.take(min(block_size, n_rows - start), n_vocab), 0
                m = min(k - lo, block.shape[0] - filled)
                ring.read_into(slot, lo, block[filled:filled + m])
                lo, filled = lo + m, filled + m
                if filled == block.shape[0]:
                    done.append((start, block))
                    start, block = start + filled, None
            got += k
            try:
                os.write(self.ack_fd, head[:1].tobytes())
            except OSError:
                pass  # the worker is gone: after its last rows, rightly; else the next read finds the stream ended
            yield from done

    def fill(self, array: np.ndarray) -> bool:
        """Fill ``array`` (C-contiguous) from the stream; False if the stream ends first.
        Raises ``EngineError`` when the deadline passes."""
        view = memoryview(array).cast("B")
        while view.nbytes:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.pipe], [], [], left)[0]:
                raise EngineError("llama.cpp worker timed out while streaming logits")
            n = self.pipe.readinto(view)
            if not n:
                return False
            view = view[n:]
        return True
