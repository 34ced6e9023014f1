"""llama.cpp's own ``llama-server`` as a real candidate: find the binary ``make llama-server`` built,
start it on a free loopback port with parallel slots and its prompt cache, wait for ``/health``,
read from its log which cache features it enabled, and stop it (docs/engines.md, "llama-server").

The binary is built from the llama.cpp that the installed llama-cpp-python vendors (the reference's
own commit) by ``scripts/build_llama_server.sh`` into
``$HARNESS_CACHE_DIR/llama.cpp-<commit>/build/bin/`` (default cache root
``~/.cache/qwen35-harness``); ``$HARNESS_LLAMA_SERVER`` names another binary.

Flags (llama.cpp ``tools/server`` README, ``common/arg.cpp`` at that commit): ``--host 127.0.0.1``,
``--port`` a free port, ``-np N`` slots, ``-c N·n_ctx_slot`` (llama-server splits the context
between its slots and caps each at the model's training context), ``-cb`` continuous batching,
``--cache-reuse 16`` (prompt-cache reuse by KV shifting; a hybrid model's recurrent memory cannot
shift, and the server disables it: ``server-context.cpp`` "cache_reuse is not supported by this
context"), ``--ctx-checkpoints 8`` (recurrent-state checkpoints of a hybrid model's slot),
``--checkpoint-min-step 0`` (a checkpoint at every message start it is told of, not one per 8,192
tokens: ``message_delimiters`` below),
``--no-webui``, ``-lv 4`` (trace lines: which prompt cache and checkpoints were set up), ``-t``
threads. Requests set ``cache_prompt`` themselves (``harness.engines.http_traffic``).

Where a hybrid model's prompt cache can hit: its recurrent state cannot be cut back to an arbitrary
prefix, so the server restores a slot only at a checkpoint it took while reading an earlier prompt:
4 and 4 + ``n_ubatch`` tokens before that prompt's end, and at each *user message start*
(``server-context.cpp``, ``spans.is_user_start``). Its chat endpoint knows the message starts from
the chat template; ``/completion`` takes them as ``message_delimiters`` (``[{"role": "user",
"delimiter": TEXT}]``: every occurrence of TEXT's tokens in the prompt starts a user message).
``message_delimiters`` gives a scenario's raw-token prompts the delimiters a chat client's
messages would: the tokens where one prompt leaves another, so a shared header is a message of its
own, as in a chat. Without them no prompt of the shared-header scenario is ever a cache hit.

Errors: ``EngineError`` (exit 3), one line naming the command and the tail of its stderr, for a
binary that is missing, a port already in use, a server that exits before it is healthy or is not
healthy within ``health_timeout_s``.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from harness.display import plain
from harness.engines.http_engine import HttpEngine
from harness.errors import EngineError
from harness.paths import llama_tool

BUILD_COMMAND = "make llama-server"
"""The command that builds the binary (named by every 'not built' message)."""


def _die_with_parent() -> None:
    """In the server's child process before exec: on Linux, ask for SIGTERM when the process that
    started it dies (``prctl(PR_SET_PDEATHSIG)``), so a harness killed by SIGKILL or a test timeout
    leaves no llama-server behind (servers in their own session are not in its process group).
    Elsewhere a no-op: ``stop()`` is then the only cleanup."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass


def built_binary(name: str = "llama-server") -> Path | None:
    """The tool ``name`` built from the installed llama-cpp-python's llama.cpp
    (``harness.paths.llama_tool``), or ``$HARNESS_LLAMA_SERVER`` for ``llama-server``. None when
    it is not built."""
    if name == "llama-server" and os.environ.get("HARNESS_LLAMA_SERVER"):
        p = Path(os.environ["HARNESS_LLAMA_SERVER"])
        return p if p.is_file() and os.access(p, os.X_OK) else None
    return llama_tool(name)


def build_commit(binary: Path) -> str | None:
    """The llama.cpp commit the build folder of ``binary`` was made from (its ``COMMIT`` file)."""
    c = binary.parent.parent.parent / "COMMIT"
    return c.read_text().strip() if c.is_file() else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound to port 0 and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


FEATURE_LINES = {
    "cache_reuse": (r"cache_reuse is not supported by (this context|multimodal)", None),
    "ctx_shift": (r"ctx_shift is not supported by (this context|multimodal)", None),
    "prompt_cache": (r"prompt cache is disabled", r"prompt cache is enabled, size limit: (\d+) MiB"),
    "ctx_checkpoints": (r"context checkpoints disabled", r"context checkpoints enabled, max = (\d+)"),
}
"""Feature → (the log line that says llama-server refused or disabled it, the line that says it
enabled it), from ``tools/server/server-context.cpp`` ``load_model`` at commit 0c1e570."""


def log_features(log: str, asked: dict[str, Any]) -> dict[str, str]:
    """Which cache features the server enabled, from its log: ``enabled`` (with the log's value),
    ``refused`` (the line that said so, quoted) or ``not reported`` (neither line: nothing is
    assumed). ``asked``: the features the command line asked for (``cache_reuse`` is refused only
    if asked)."""
    out: dict[str, str] = {}
    for name, (refused, enabled) in FEATURE_LINES.items():
        m = re.search(refused, log)
        if m:
            line = next(ln for ln in log.splitlines() if m.group(0) in ln)
            out[name] = f"refused: {plain(line.split(': ', 1)[-1].strip())[:120]}"
            continue
        e = re.search(enabled, log) if enabled else None
        if e:
            out[name] = f"enabled ({e.group(1)})"
        elif name in asked:
            out[name] = f"enabled ({asked[name]}; no refusal in the log)" if enabled is None else "not reported in the log"
        else:
            out[name] = "not asked"
    return out


@dataclass
class LlamaServer:
    """One ``llama-server`` process (module docstring). ``parallel``: slots (``-np``);
    ``n_ctx_slot``: context per slot (tokens); ``threads``: ``-t``; ``extra``: more flags.
    ``start()`` then ``url``; ``stop()`` (SIGTERM, then SIGKILL after ``stop_timeout_s``)."""

    model: Path
    binary: Path | None = None
    parallel: int = 4
    n_ctx_slot: int = 4608
    threads: int = 2
    cache_reuse: int = 16
    ctx_checkpoints: int = 8
    checkpoint_min_step: int = 0
    extra: Sequence[str] = ()
    health_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    port: int | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: Any = field(default=None, repr=False)

    NAME = "llama-server"
    HEALTH_PATH = "/health"
    READY_LINE = "listening on {url}"
    """The log line that says this process (not another on the port) is the one answering."""
    SOLO_EXTRA = {"cache_prompt": False}  # noqa: RUF012
    """Body fields of a request sent alone (``harness.runs.http_serving``)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line (``binary`` resolved by ``built_binary``; ``EngineError`` naming
        ``make llama-server`` when it is not built)."""
        binary = self.binary or built_binary()
        if binary is None:
            raise EngineError(f"llama-server is not built for the installed llama-cpp-python: run `{BUILD_COMMAND}`")
        self.binary = Path(binary)
        return [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(self.parallel), "-c", str(self.parallel * self.n_ctx_slot), "-cb",
                "--cache-reuse", str(self.cache_reuse), "--ctx-checkpoints", str(self.ctx_checkpoints),
                "--checkpoint-min-step", str(self.checkpoint_min_step), "-t", str(self.threads), "--no-webui", "-lv", "4", *self.extra]

    def log_text(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        if self._log is None:
            return ""
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def stderr_tail(self, n: int = 3) -> str:
        """The last ``n`` non-empty lines of its log, escaped, joined by `` | ``."""
        lines = [ln.strip() for ln in self.log_text().splitlines() if ln.strip()]
        return plain(" | ".join(lines[-n:]))[:400] or "(no output)"

    def _fail(self, why: str) -> EngineError:
        cmd = shlex.join(self.command())
        tail = self.stderr_tail()
        self.stop()
        return EngineError(f"{self.NAME} {why}: {cmd[:300]}; stderr: {tail}")

    def start(self) -> "LlamaServer":
        """Start it and wait for ``/health`` 200 (``EngineError`` for a port in use, an exit
        before healthy, or no health within ``health_timeout_s``)."""
        import httpx

        if self.port is not None and not _port_free(self.port):
            self._log = tempfile.NamedTemporaryFile(prefix=f"{self.NAME}-", suffix=".log", delete=False)
            raise self._fail(f"cannot listen on port {self.port}: it is already in use")
        self.port = self.port or free_port()
        cmd = self.command()
        self._log = tempfile.NamedTemporaryFile(prefix=f"{self.NAME}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_text()
                why = (f"could not listen on port {self.port} (already in use?)" if re.search(r"bind|in use|listen", log, re.I)
                       else f"exited with status {self.proc.returncode} before it was healthy")
                raise self._fail(why)
            try:
                if (httpx.get(self.url + self.HEALTH_PATH, timeout=2.0).status_code == 200
                        and self.READY_LINE.format(url=self.url) in self.log_text()):
                    return self  # healthy, and the one answering is this process (its log says it listens there)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise self._fail(f"was not healthy within {self.health_timeout_s:g} s")

    def features(self) -> dict[str, str]:
        """``log_features`` of its log so far, for what this command line asked."""
        return log_features(self.log_text(), {"cache_reuse": self.cache_reuse, "ctx_checkpoints": self.ctx_checkpoints,
                                              "prompt_cache": "default"})

    def prepare(self, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
        """Body fields every request of a scenario with these prompts carries: where they part, as
        user message starts (``message_delimiters``), so a hybrid slot can be restored there."""
        delims = message_delimiters(self.url, prompts)
        return {"message_delimiters": delims} if delims else {}

    def drive(self, scenario: Any, n_vocab: int, k: int, timeout_s: float, pin: dict[str, int] | None = None,
              extra: dict[str, Any] | None = None) -> Any:
        """``scenario`` served by concurrent clients (``http_traffic.drive_scenario``)."""
        from harness.engines.http_traffic import drive_scenario

        return drive_scenario(self.url, scenario, n_vocab, k, timeout_s, pin=pin, extra=extra)

    def serialized(self, traffic: Any) -> str:
        """The reason an overlap scenario is UNMEASURED on one slot."""
        return "serialized: one slot"

    def cache_source(self) -> str:
        """Where its replies say how many prompt tokens came from its cache."""
        return "timings.cache_n"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after ``stop_timeout_s``; idempotent."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def close(self) -> None:
        """``stop()`` and remove the log file."""
        self.stop()
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None

    def __enter__(self) -> "LlamaServer":
        try:
            return self.start()
        except BaseException:
            self.close()  # a start that failed leaves no process and no log file behind
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


DELIMITER_TOKENS = (3, 4, 5, 2)
"""Lengths tried, in order, for a delimiter's token run: long enough not to recur elsewhere in the
prompt (each recurrence is one more message start), short enough to round-trip."""


def message_delimiters(url: str, prompts: Sequence[Sequence[int]], timeout_s: float = 30.0) -> list[dict[str, str]]:
    """``message_delimiters`` for ``/completion`` (module docstring) that make every point where
    two of ``prompts`` part a user message start: for each pair with a common prefix ``p`` shorter
    than a prompt, that prompt's tokens from ``p`` (the first run of ``DELIMITER_TOKENS`` that the
    server at ``url`` detokenizes to a text it tokenizes back to the same ids, ``/detokenize`` and
    ``/tokenize`` with ``parse_special``), as ``{"role": "user", "delimiter": TEXT}``, each text
    once, in prompt order. A point whose tokens do not round-trip gets no delimiter (that hit then
    does not happen and the scenario says so: UNMEASURED). Raises ``EngineError`` when the server
    does not answer."""
    import httpx

    from harness.engines.serving import common_prefix

    points: list[tuple[int, int]] = []
    for i, a in enumerate(prompts):
        for j, b in enumerate(prompts):
            p = common_prefix(a, b)
            if i != j and 0 < p < len(a) and (i, p) not in points:
                points.append((i, p))
    out: list[dict[str, str]] = []
    try:
        with httpx.Client(base_url=url, timeout=timeout_s) as client:
            for i, p in points:
                for m in DELIMITER_TOKENS:
                    run = [int(t) for t in prompts[i][p:p + m]]
                    if len(run) < min(m, 2):
                        break
                    text = client.post("/detokenize", json={"tokens": run}).json()["content"]
                    back = client.post("/tokenize", json={"content": text, "add_special": False, "parse_special": True}).json()["tokens"]
                    if back == run:
                        if all(d["delimiter"] != text for d in out):
                            out.append({"role": "user", "delimiter": text})
                        break
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise EngineError(f"llama-server at {url} did not answer /tokenize or /detokenize: {plain(str(e))[:200]}") from None
    return out


def apply_template(url: str, conversation: Any, timeout_s: float = 30.0) -> str:
    """llama.cpp's own rendering of ``conversation`` (anything with a ``harness.measure.chat_template.Conversation``'s
    attributes: ``id``, ``messages``, ``tools``, ``add_generation_prompt``, ``template_kwargs``)
    by the llama-server at ``url`` (started with ``--jinja``): ``POST /apply-template`` with its
    ``messages``, ``tools``, ``add_generation_prompt`` and ``template_kwargs`` as
    ``chat_template_kwargs``; the answer's ``prompt``. Raises ``EngineError`` (transport, an
    error status, no prompt text)."""
    import httpx

    body: dict[str, Any] = {"messages": conversation.messages, "add_generation_prompt": conversation.add_generation_prompt,
                            "chat_template_kwargs": dict(conversation.template_kwargs)}
    if conversation.tools:
        body["tools"] = conversation.tools
    try:
        r = httpx.post(url + "/apply-template", json=body, timeout=timeout_s)
        obj = r.json()
    except (httpx.HTTPError, ValueError) as e:
        raise EngineError(f"llama-server at {url} did not answer /apply-template: {plain(str(e))[:200]}") from None
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    if r.status_code != 200 or not isinstance(prompt, str):
        raise EngineError(f"llama-server at {url} answered HTTP {r.status_code} for /apply-template of conversation "
                          f"{plain(conversation.id)!r}: {plain(r.text)[:200]}")
    return prompt


def chat_prompt_tokens(url: str, conversation: Any, timeout_s: float = 60.0) -> int:
    """How many prompt tokens the llama-server at ``url`` makes of ``conversation`` on its chat
    endpoint: ``/v1/chat/completions`` (messages, tools, ``chat_template_kwargs``, ``max_tokens``
    1, temperature 0), ``usage.prompt_tokens``. Raises ``EngineError`` (transport, status, no count)."""
    import httpx

    body: dict[str, Any] = {"messages": conversation.messages, "max_tokens": 1, "temperature": 0,
                            "chat_template_kwargs": dict(conversation.template_kwargs)}
    if conversation.tools:
        body["tools"] = conversation.tools
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout_s)
        n = r.json().get("usage", {}).get("prompt_tokens")
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise EngineError(f"llama-server at {url} did not answer /v1/chat/completions: {plain(str(e))[:200]}") from None
    if r.status_code != 200 or not isinstance(n, int):
        raise EngineError(f"llama-server at {url} answered HTTP {r.status_code} without usage.prompt_tokens for conversation "
                          f"{plain(conversation.id)!r}: {plain(r.text)[:200]}")
    return n


SERVE_CAPABILITY = "serve_http"
"""The capability of an engine whose serving the harness judges under concurrent clients, each
scenario on servers it starts itself (``LlamaServerEngine.fresh_server``;
``harness.runs.http_serving``)."""

DEFAULT_PARALLEL = 4
"""Slots of the ``llama-server`` engine's servers (``-np``)."""


def load_llama_server(model_path: str | Path, overrides: Sequence[Any] = (), parallel: int = DEFAULT_PARALLEL) -> Any:
    """The ``llama-server`` engine (``LlamaServerEngine``) on ``model_path``. Raises ``EngineError``
    when the binary is not built or the server does not start."""
    return LlamaServerEngine(model_path, overrides, parallel)


class LlamaServerEngine(HttpEngine):
    """``llama-server``: llama.cpp's own server, built from the reference's commit (``built_binary``,
    ``make llama-server``), started by the harness on the model and spoken to as an ``http:`` engine
    of kind ``llama-server`` (top-k rows: ``harness parity`` judges it by the top-k tier). It also
    declares ``SERVE_CAPABILITY``: ``harness probe --only serving`` then judges its serving under
    concurrent clients, each scenario on a server of its own (``fresh_server``) with ``parallel``
    slots. Overrides become ``--override-kv`` flags. The server is stopped by ``close`` (and, should
    the harness die, by the kernel: ``PR_SET_PDEATHSIG``). Raises ``EngineError`` as
    ``LlamaServer.start`` does."""

    def __init__(self, model_path: str | Path, overrides: Sequence[Any] = (), parallel: int = DEFAULT_PARALLEL):
        import weakref

        import httpx

        from harness.engines.http_engine import HttpSpec

        self.parallel = int(parallel)
        self._model = Path(model_path).resolve()
        self._flags = tuple(a for o in overrides for a in ("--override-kv", o.to_flag()))
        self.server = self.fresh_server(self.parallel).start()
        self._finalizer = weakref.finalize(self, self.server.stop)
        try:
            served = httpx.get(self.server.url + "/v1/models", timeout=10.0).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            served = Path(model_path).name
        super().__init__(HttpSpec(name="llama-server", url=self.server.url, model=str(served), kind="llama-server",
                                  compute_class="f32"), model_path, overrides)

    @property
    def who(self) -> str:
        return "llama-server"

    @property
    def info(self) -> Any:
        base = super().info
        base.settings.update(parallel=self.parallel, binary=str(self.server.binary), features=self.server.features())
        base.capabilities = [*base.capabilities, "chat_template", SERVE_CAPABILITY]
        base.version = f"llama-server ({Path(str(self.server.binary)).parent.parent.parent.name})"
        return base

    def render_chat(self, conversation: dict[str, Any]) -> str:
        """llama.cpp's own rendering of a chat conversation (capability ``chat_template``; the
        ``render`` op's fields: ``messages``, ``tools``, ``add_generation_prompt``,
        ``template_kwargs``), by the server's ``/apply-template`` (``apply_template``). Raises
        ``EngineError`` as ``apply_template``."""
        from types import SimpleNamespace

        conv = SimpleNamespace(id="render", messages=conversation["messages"], tools=conversation.get("tools"),
                               add_generation_prompt=bool(conversation.get("add_generation_prompt", True)),
                               template_kwargs=dict(conversation.get("template_kwargs") or {}))
        return apply_template(self.server.url, conv)

    def fresh_server(self, parallel: int) -> LlamaServer:
        """A new, not yet started server on the same model and flags with ``parallel`` slots (a
        context manager: ``with engine.fresh_server(4) as srv``)."""
        return LlamaServer(self._model, parallel=parallel, extra=self._flags)

    def close(self) -> None:
        """Stop the server (idempotent)."""
        self._finalizer()
