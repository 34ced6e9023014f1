"""llama-cpp-python's own server (``python -m llama_cpp.server``, the ``server`` extra of the
installed llama-cpp-python) as a real candidate under traffic: started by the harness on a free
loopback port, spoken to through its OpenAI ``/v1/completions`` (docs/engines.md,
"llama-cpp-python's server").

What it is, read from its source (llama-cpp-python 0.3.36, ``llama_cpp/server/app.py`` and
``llama_cpp/llama.py``):

- **One model, one context, one request at a time.** Every endpoint that touches the model
  (completions, chat, embeddings, ``/v1/models``, ``/extras/tokenize``) first takes
  ``get_llama_proxy``'s two ``anyio`` locks (``llama_outer_lock`` then ``llama_inner_lock``) and
  holds the inner one until the last chunk of a streamed reply is sent: requests are served one
  after another, never beside each other; there are no slots and no batching.
- **``interrupt_requests``** (on by default): a streaming reply checks after each chunk whether
  another request waits on the outer lock and, if so, ends its stream with ``[DONE]`` and no
  ``finish_reason``: the earlier client is cut short. The harness starts it with
  ``--interrupt_requests False``, so a second client waits instead (``INTERRUPT``).
- **Its prompt cache** is the one context's tokens (``Llama.generate``): a prompt that extends
  what the context holds keeps it (the line "N prefix-match hit"); a prompt that shares only part
  of it would cut the KV memory back (``llama_memory_seq_rm``), which a hybrid model's recurrent
  state refuses, and it re-evaluates the whole prompt ("prefix-match found but partial kv removal
  not supported"). ``--cache`` (an LRU of saved states, off by default) is not asked for: a state
  it restores meets the same refusal for any prompt that is not an extension.
- **Text prompts, text keys.** ``prompt`` is a string (``llama_cpp/server/types.py``), tokenized
  by the server with special tokens parsed and no BOS added; top logprobs are keyed by each
  token's text (``harness.engines.http_traffic.TextRun``).
- ``logits_all`` is on by default: the context keeps every position's logits (``n_ctx × n_vocab``
  float32: 4.6 GB at Qwen3.5's 248,320 and 4,608 positions).

The same server answers ``harness chat-parsers --server llama-cpp-python`` (``harness.runs.chat_parsers``):
one thread, a 2,048-token context, ``--verbose False``, and ``--chat_format NAME`` where a chat
handler is named. Without one, ``Llama.__init__`` picks the handler from the GGUF: a format
``guess_chat_format_from_gguf_metadata`` recognises in ``tokenizer.chat_template``, else the
template itself (``chat_template.default``, a ``Jinja2ChatFormatter``); ``chat_handler`` below
names the handler the same way, so a receipt says which one answered. ``missing()`` says why the
server cannot be started here at all (the package or its server extra absent), for a run to record
UNMEASURED; ``version()`` is the installed package's version.

Errors: ``EngineError`` (exit 3) as ``LlamaServer.start`` gives them: a server that exits before it
answers ``/v1/models``, a port in use, no answer within ``health_timeout_s``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from harness.display import plain
from harness.engines.http_engine import HttpEngine
from harness.engines.http_traffic import Traffic, check_loopback, drive_text_scenario
from harness.engines.llama_server import SERVE_CAPABILITY, LlamaServer
from harness.engines.serving import ServeScenario
from harness.errors import EngineError, InvalidInput

ENGINE_NAME = "llama-cpp-python-server"
INTERRUPT = "--interrupt_requests False"
SERIALIZED = ("serialized: llama-cpp-python's server serves one request at a time (one model context; get_llama_proxy's locks "
              "held for a whole streamed reply, llama_cpp/server/app.py)")
"""Why its overlap scenarios are UNMEASURED (module docstring)."""
PARTIAL_REFUSED = "prefix-match found but partial kv removal not supported"
INSTALL = "pip install 'llama-cpp-python[server]'"
"""What installs the server (named by every 'missing' reason)."""


def version() -> str | None:
    """The installed llama-cpp-python's version (its distribution metadata), None when absent."""
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def missing() -> str | None:
    """Why the server cannot be started here (the package or a module of its ``server`` extra is
    not importable), or None. Imports nothing heavy: ``importlib.util.find_spec`` only."""
    import importlib.util

    if version() is None:
        return f"llama-cpp-python is not installed ({INSTALL})"
    for mod in ("llama_cpp.server", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"llama-cpp-python's server extra is not installed: no module {mod!r} ({INSTALL})"
    return None


def chat_handler(metadata: Mapping[str, Any], chat_format: str | None) -> str:
    """The chat handler the server answers with for a GGUF of ``metadata`` (its raw key values):
    ``chat_format`` where one is named; else the format llama-cpp-python guesses from the file's
    ``tokenizer.chat_template`` (``llama_chat_format.guess_chat_format_from_gguf_metadata``), else
    ``chat_template.default`` (the template itself); ``llama-2`` for a file without a template
    (``Llama.__init__``'s order)."""
    if chat_format:
        return chat_format
    if not isinstance(metadata.get("tokenizer.chat_template"), str):
        return "llama-2"
    from llama_cpp import llama_chat_format

    guessed = llama_chat_format.guess_chat_format_from_gguf_metadata({k: str(v) for k, v in metadata.items() if isinstance(v, str)})
    return guessed or "chat_template.default"


@dataclass
class LlamaCppPythonServer(LlamaServer):
    """One ``python -m llama_cpp.server`` process (module docstring), run by this interpreter.
    ``n_ctx_slot``: its context (``--n_ctx``, tokens); ``threads``: ``--n_threads`` and
    ``--n_threads_batch``; ``model_alias``: ``--model_alias``; ``chat_format``: ``--chat_format``
    (None: not passed, the handler the GGUF gives, ``chat_handler``); ``verbose``: ``--verbose``
    (its log lines ``cache_source`` counts); ``to_text`` / ``key_id``: ids → the text sent, a
    logprobs key → its id (the engine's reference vocabulary; only ``drive`` needs them).
    ``parallel`` is always 1: it has no slots."""

    model_alias: str = "model"
    chat_format: str | None = None
    verbose: bool = True
    to_text: Callable[[list[int]], str] | None = None
    key_id: Callable[[Any], int | None] | None = None

    NAME = ENGINE_NAME
    HEALTH_PATH = "/v1/models"
    READY_LINE = "Uvicorn running on {url}"
    SOLO_EXTRA = {}  # noqa: RUF012 (a class constant: each solo request runs on a fresh server anyway)

    def command(self) -> list[str]:
        """The command line: this interpreter's ``-m llama_cpp.server`` (module docstring), so the
        server is the installed package's."""
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model), "--model_alias", self.model_alias,
                "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.n_ctx_slot), "--n_threads", str(self.threads),
                "--n_threads_batch", str(self.threads), *INTERRUPT.split(), "--verbose", str(self.verbose),
                *(["--chat_format", self.chat_format] if self.chat_format else []), *self.extra]

    def features(self) -> dict[str, str]:
        """What it serializes, how it was started, and what its prompt cache is (module docstring)."""
        return {"serving": SERIALIZED, "interrupt_requests": f"off ({INTERRUPT})",
                "prompt_cache": "the one context's tokens (Llama.generate): a prompt that extends them keeps them; a hybrid model's "
                                "partial prefix is re-evaluated whole; --cache not asked"}

    def tokenize(self, text: str) -> list[int]:
        """The server's ids for ``text`` (``/extras/tokenize``). ``EngineError`` when it does not answer a list of ids."""
        import httpx

        try:
            got = httpx.post(self.url + "/extras/tokenize", json={"input": text, "model": self.model_alias}, timeout=60.0).json()["tokens"]
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
            raise EngineError(f"{self.NAME} at {self.url} did not answer /extras/tokenize: {plain(str(e))[:160]}") from None
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            raise EngineError(f"{self.NAME} at {self.url} answered /extras/tokenize without a list of token ids")
        return got

    def prepare(self, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
        """Nothing to tell it before a scenario (it has no message starts to be told of)."""
        return {}

    def drive(self, scenario: ServeScenario, n_vocab: int, k: int, timeout_s: float, pin: dict[str, int] | None = None,
              extra: dict[str, Any] | None = None) -> Traffic:
        """``scenario`` served by concurrent clients (``http_traffic.drive_text_scenario``); ``pin``
        and ``extra`` are ignored (one context, no slots, no per-request cache switch)."""
        check_loopback(self.url)
        if self.to_text is None or self.key_id is None:
            raise InvalidInput("a llama-cpp-python server needs to_text and key_id to be driven")
        return drive_text_scenario(self.url, scenario, n_vocab, k, self.model_alias, self.to_text, self.key_id, self.tokenize,
                                   self.log_text, timeout_s)

    def serialized(self, traffic: Traffic) -> str:
        """The reason an overlap scenario is UNMEASURED."""
        return SERIALIZED

    def cache_source(self) -> str:
        """Where it says what it reused (its log), and what its log says so far of prefixes it refused."""
        n = self.log_text().count(PARTIAL_REFUSED)
        return (f"its log's 'prefix-match hit' lines; instead it logged '{PARTIAL_REFUSED}' {n} times: a hybrid model's recurrent "
                "state cannot be cut back to a shared prefix, so Llama.generate re-evaluates the whole prompt")


def load_llamacpp_python_server(model_path: str | Path, overrides: Sequence[Any] = ()) -> "LlamaCppPythonServerEngine":
    """The ``llama-cpp-python-server`` engine on ``model_path``. Raises ``InvalidInput`` for GGUF
    overrides (its command line has no place the harness fills for them) and ``EngineError`` when the
    server does not start."""
    if overrides:
        raise InvalidInput(f"{ENGINE_NAME} takes no --override-kv: the harness does not pass overrides to llama-cpp-python's server")
    return LlamaCppPythonServerEngine(model_path)


class LlamaCppPythonServerEngine(HttpEngine):
    """``llama-cpp-python-server``: llama-cpp-python's own server, started by the harness on the model
    and spoken to as an ``http:`` engine of kind ``llama-cpp-python`` (text prompts checked against
    its tokenization, top-k rows keyed by text: ``harness parity`` judges it by the top-k tier). It
    declares ``SERVE_CAPABILITY``: ``harness probe --only serving`` judges it under concurrent
    clients, each scenario on a server of its own (``fresh_server``), with one "slot" (module
    docstring). Raises ``EngineError`` as ``LlamaServer.start`` does."""

    parallel = 1

    def __init__(self, model_path: str | Path):
        import weakref

        from harness.engines.http_engine import HttpSpec

        self._model = Path(model_path).resolve()
        super().__init__(HttpSpec(name=ENGINE_NAME, url="http://127.0.0.1:0", model=self._model.stem, kind="llama-cpp-python",
                                  compute_class="f32"), model_path)
        self.server = self.fresh_server(1).start()
        self.spec.url = self.server.url
        self._finalizer = weakref.finalize(self, self.server.stop)

    @property
    def who(self) -> str:
        return ENGINE_NAME

    @property
    def info(self) -> Any:
        base = super().info
        import llama_cpp

        base.settings.update(parallel=1, interrupt_requests=False, n_ctx=self.server.n_ctx_slot, features=self.server.features())
        base.capabilities = [*base.capabilities, SERVE_CAPABILITY]
        base.version = f"llama-cpp-python {llama_cpp.__version__} server"
        return base

    def fresh_server(self, parallel: int = 1) -> LlamaCppPythonServer:
        """A new, not yet started server on the same model (a context manager); ``parallel`` is
        ignored: it has no slots."""
        return LlamaCppPythonServer(self._model, parallel=1, model_alias=self._model.stem, to_text=self._prompt_text,
                                    key_id=self._key_id)

    def close(self) -> None:
        """Stop the server (idempotent)."""
        self._finalizer()
