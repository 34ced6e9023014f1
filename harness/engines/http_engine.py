"""Servers as engines: ``http:NAME``, an OpenAI-compatible completion server configured in
``[tool.harness.http.NAME]`` (docs/engine-protocol.md, "HTTP engines").

A server gives top-k logprobs per position, not logits: the engine's ``topk(tokens)`` returns
``harness.measure.topk.TopK`` rows aligned like logits (row t = the distribution after
``tokens[:t+1]``), and parity judges it with the top-k tier (the cosine release gate cannot be
computed; ``harness.measure.topk``). ``generate(tokens, n)`` decodes greedily (``temperature``
0). ``logits`` raises ``EngineError``: there are none to give.

Server kinds (``KINDS``) differ in three ways, each a column of the table and each tested against
its response shape (tests/test_http_engine.py):

- the prompt: the reference's token ids (llama-server, vLLM), or the reference's detokenized text
  whose tokenization by the server is checked first (llama-cpp-python's ``/extras/tokenize``): any
  difference is ``NotComparable`` naming the first differing position;
- prompt logprobs: all positions in one request (llama-cpp-python ``echo`` + ``logprobs``, whose
  entry i is the distribution after ``tokens[:i+1]`` and entry 0 is null, llama_cpp/llama.py
  ``_create_completion``; vLLM ``prompt_logprobs``, whose entry i is the distribution that
  predicted token i), else one request per position (the prompt cut after each position,
  ``max_tokens`` 1);
- keys: token ids (vLLM ``return_tokens_as_token_ids``, llama-server ``id``) or token text
  (llama-cpp-python: ``detokenize([id]).decode("utf-8", errors="ignore")``), mapped to ids through
  the reference vocabulary (``harness.model.vocab``); a text that several ids decode to (byte
  tokens, control tokens) is ambiguous and its entry goes to the tail bucket.

Errors: connection refused, timeout, an HTTP error status, a body that is not JSON (or larger than
``MAX_RESPONSE_BYTES``) or cut short (fewer bytes than its Content-Length), a response without
the logprobs asked for are ``EngineError`` (exit 3); ``timeout_s`` bounds each whole request, from
connect to the body's last byte (``HttpEngine._exchange``), not each read;
a server answering for another model than ``model``, or tokenizing the text differently, is
``NotComparable`` (exit 4). Every string a server sends is shown through ``harness.display``. The
API key is read from the variable ``api_key_env`` names and never stored: receipts carry the URL
without user info or query and the variable's name only.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from harness.config import HarnessConfig, configured_engine, engine_table, load_config
from harness.display import plain
from harness.engines.base import COMPUTE_CLASSES, EngineInfo, LogitBlock, TopK, checked_token_ids
from harness.engines.process import check_timeout
from harness.errors import EngineError, InvalidInput, NotComparable
from harness.model.gguf_model import GGUFModel, Override
from harness.model.vocab import Vocab

SPEC_KEYS = ("url", "url_env", "model", "kind", "api_key_env", "timeout_s", "max_logprobs", "compute_class")
MAX_RESPONSE_BYTES = 256 << 20
"""A response body larger than this (256 MiB) is refused: top-k logprobs of a long prompt are a
few MB."""
CONTROL_TOKEN_TYPES = (3,)
"""``tokenizer.ggml.token_type`` values llama.cpp renders as empty text without ``special`` (CONTROL)."""


@dataclass(frozen=True)
class ServerKind:
    """How one server family is spoken to (module docstring).

    ``sends_ids``: the prompt goes as token ids (else as text, checked through ``tokenize_path``);
    ``prompt_logprobs``: ``echo`` | ``prompt_logprobs`` | ``per_position``; ``keys``: ``id`` |
    ``text``; ``endpoint``: the completion path; ``source``: where the shape is documented.
    """

    name: str
    sends_ids: bool
    prompt_logprobs: str
    keys: str
    endpoint: str
    tokenize_path: str | None
    source: str


KINDS = {
    "llama-cpp-python": ServerKind("llama-cpp-python", False, "echo", "text", "/v1/completions", "/extras/tokenize",
                                   "llama_cpp/llama.py _create_completion (echo + logprobs), llama_cpp/server/app.py /extras/tokenize"),
    "vllm": ServerKind("vllm", True, "prompt_logprobs", "id", "/v1/completions", None,
                       "vLLM OpenAI server: prompt_logprobs, return_tokens_as_token_ids"),
    "llama-server": ServerKind("llama-server", True, "per_position", "id", "/completion", None,
                               "llama.cpp tools/server README: /completion with n_probs (completion_probabilities)"),
}
"""Server kind → how it is spoken to; ``kind`` in ``[tool.harness.http.NAME]`` names one."""


@dataclass
class HttpSpec:
    """One ``[tool.harness.http.NAME]`` table.

    ``url``: the server's base URL (``url_env``, when set in the environment, overrides it);
    ``model``: the model name the server must answer for; ``kind``: a ``KINDS`` key;
    ``api_key_env``: the environment variable holding a bearer token (never the token itself);
    ``timeout_s``: seconds for each whole request, connect to last byte; ``max_logprobs``: k, the logprobs asked per position;
    ``compute_class``: the precision the server computes in (picks the top-k row).
    """

    name: str
    url: str
    model: str
    kind: str = "llama-cpp-python"
    api_key_env: str | None = None
    timeout_s: float = 120.0
    max_logprobs: int = 20
    compute_class: str | None = None
    url_env: str | None = None

    @property
    def safe_url(self) -> str:
        """The URL without user info, query or fragment (what receipts carry)."""
        u = urlsplit(self.url)
        host = u.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if u.port:
            netloc += f":{u.port}"
        return urlunsplit((u.scheme, netloc, u.path, "", ""))


TOKENIZE: dict[str, Callable[[str, str, bool], tuple[str, dict[str, Any]]]] = {
    # kind -> (model, text, add_special) -> (path, JSON body); each answers {"tokens": [ids...]}
    "llama-cpp-python": lambda model, text, add: ("/extras/tokenize", {"input": text, "model": model}),
    "vllm": lambda model, text, add: ("/tokenize", {"model": model, "prompt": text, "add_special_tokens": add}),
    "llama-server": lambda model, text, add: ("/tokenize", {"content": text, "add_special": add}),
}
"""Each kind's own tokenize endpoint (the capability ``tokenize``): llama-cpp-python
``llama_cpp/server/app.py`` ``/extras/tokenize``; vLLM's OpenAI server ``/tokenize``
(``TokenizeCompletionRequest``); llama.cpp ``tools/server`` README ``POST /tokenize``."""

GREEDY_PARAMS: dict[str, dict[str, Any]] = {
    # Sampling settings that would bend a temperature-0 continuation away from the argmax, set to
    # their neutral values: llama-cpp-python's server defaults repeat_penalty to 1.1
    # (llama_cpp/server/types.py repeat_penalty_field), so without this its "greedy" text drifts
    # from the reference's on repetitive prompts (seen: hard divergences at step 2-3).
    "llama-cpp-python": {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0},
    "vllm": {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0},
    "llama-server": {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0},
}


MAX_WITHHELD = 8
"""How many withheld greedy picks in a row llama-server's per-position request may ban before the
position is an ``EngineError`` (``HttpEngine._llama_server_row``)."""


def ends_in_cut_utf8(data: bytes) -> bool:
    """True when ``data`` ends inside a UTF-8 character: one of its last 4 bytes starts a 2-, 3- or
    4-byte sequence that has fewer bytes after it than it needs. The test llama-server applies to
    its generated text before it emits a token (``tools/server/server-common.cpp`` ``validate_utf8``):
    a lone continuation byte or an invalid byte is not "cut", only a lead byte near the end is."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        need = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4 if lead & 0xF8 == 0xF0 else 0
        if need and back < need:
            return True
    return False


def _spec(name: str, t: Any, cfg: HarnessConfig) -> HttpSpec:
    """One http table, validated; ``InvalidInput`` names the engine and the field."""
    where = engine_table(cfg, "http", name, t, SPEC_KEYS)
    for key in ("url", "model"):
        if not isinstance(t.get(key), str) or not t[key] or "\x00" in t[key]:
            raise InvalidInput(f"{where}.{key} must be a non-empty string")
    for key in ("url_env", "api_key_env"):
        if key in t and (not isinstance(t[key], str) or not t[key] or "=" in t[key] or "\x00" in t[key]):
            raise InvalidInput(f"{where}.{key} must name an environment variable")
    url = t["url"]
    if t.get("url_env") and os.environ.get(t["url_env"]):
        url = os.environ[t["url_env"]]
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        raise InvalidInput(f"{where}.url must be an http:// or https:// URL, found {plain(url)[:80]!r}")
    kind = t.get("kind", "llama-cpp-python")
    if kind not in KINDS:
        raise InvalidInput(f"{where}.kind must be one of {', '.join(KINDS)}")
    k = t.get("max_logprobs", 20)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 1000:
        raise InvalidInput(f"{where}.max_logprobs must be an integer in [1, 1000]")
    cls = t.get("compute_class")
    if cls is not None and cls not in COMPUTE_CLASSES:
        raise InvalidInput(f"{where}.compute_class must be one of {', '.join(COMPUTE_CLASSES)}")
    timeout = check_timeout(t.get("timeout_s", 120), f"{where}.timeout_s")
    return HttpSpec(name, url, t["model"], kind, t.get("api_key_env"), timeout, k, cls, t.get("url_env"))


def configured_servers(config: HarnessConfig | None = None) -> dict[str, HttpSpec]:
    """Every ``[tool.harness.http.NAME]`` table, validated (``InvalidInput`` names the field)."""
    cfg = config or load_config()
    tables = cfg.get("http", {}) or {}
    if not isinstance(tables, dict):
        raise InvalidInput(f"{cfg.source}: http must be a table of [http.NAME] tables")
    return {name: _spec(name, t, cfg) for name, t in tables.items()}


def _only_minus_infinity(constant: str) -> float:
    """JSON's non-standard constants: ``-Infinity`` (a logprob of a token with probability 0, as
    Python's json writes it) is read; ``NaN`` and ``Infinity`` make the body malformed."""
    if constant == "-Infinity":
        return -math.inf
    raise ValueError(f"{constant} is not a number")


def _text_keys(vocab: Vocab, token_types: Sequence[int]) -> dict[str, int | None]:
    """Text key → token id as llama-cpp-python spells its keys (``detokenize([id])`` decoded with
    errors ignored; control tokens render empty); None for a key several ids share."""
    out: dict[str, int | None] = {}
    for i in range(len(vocab.tokens)):
        if i < len(token_types) and token_types[i] in CONTROL_TOKEN_TYPES:
            key = ""
        else:
            raw = vocab.raw(i) or ""
            key = raw.encode("utf-8", "surrogateescape").decode("utf-8", "ignore")
        out[key] = None if key in out else i
    return out


class HttpEngine:
    """An ``http:NAME`` server bound to one model file (module docstring). ``n_vocab`` and the
    vocabulary come from the model file, the reference's."""

    def __init__(self, spec: HttpSpec, model_path: str | os.PathLike, overrides: Sequence[Override] = ()):
        self.spec = spec
        self.kind = KINDS[spec.kind]
        self.model_path = Path(model_path).resolve()
        self.overrides = list(overrides)
        import requests  # only an http:NAME run needs it (about 25 ms of imports)

        self._session = requests.Session()
        self.requests_sent = 0
        self.served_model: str | None = None

    @property
    def who(self) -> str:
        return f"http:{self.spec.name}"

    @cached_property
    def _gguf(self) -> GGUFModel:
        return GGUFModel(self.model_path, self.overrides)

    @property
    def n_vocab(self) -> int:
        return self._gguf.hparams.n_vocab

    @cached_property
    def vocab(self) -> Vocab:
        return Vocab(self._gguf.tokens, self._gguf.raw_metadata("tokenizer.ggml.model"))

    @cached_property
    def _keys(self) -> dict[str, int | None]:
        return _text_keys(self.vocab, list(self._gguf.metadata("tokenizer.ggml.token_type", []) or []))

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.who,
            version=f"{self.kind.name} server",
            settings={"url": self.spec.safe_url, "model": self.spec.model, "kind": self.kind.name,
                      "max_logprobs": self.spec.max_logprobs, "timeout_s": self.spec.timeout_s,
                      "api_key_env": self.spec.api_key_env, "prompt": "token ids" if self.kind.sends_ids else "text",
                      "prompt_logprobs": self.kind.prompt_logprobs, "keys": self.kind.keys,
                      "served_model": self.served_model, "overrides": [o.to_flag() for o in self.overrides]},
            capabilities=["topk", "generate", "tokenize"] + (["chat_template"] if self.kind.name == "llama-cpp-python" else []),
            build={"kind_source": self.kind.source},
            compute_class=self.spec.compute_class,
        )

    # ----------------------------------------------------------------------------- transport
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` as JSON; the parsed JSON object (``EngineError`` for every failure)."""
        url = self.spec.url.rstrip("/") + path
        headers = {}
        if self.spec.api_key_env:
            key = os.environ.get(self.spec.api_key_env)
            if not key:
                raise EngineError(f"{self.who}: the API key variable {self.spec.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        self.requests_sent += 1
        status, raw = self._exchange(url, path, body, headers)
        if len(raw) > MAX_RESPONSE_BYTES:
            raise EngineError(f"{self.who} answered more than {MAX_RESPONSE_BYTES:,} bytes")
        if status >= 400:
            head = plain(raw[:200].decode("utf-8", "replace"))
            raise EngineError(f"{self.who} answered HTTP {status} for {path}: {head}")
        try:
            obj = json.loads(raw.decode("utf-8"), parse_constant=_only_minus_infinity)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise EngineError(f"{self.who} answered {path} with malformed JSON ({len(raw)} bytes)") from None
        if not isinstance(obj, dict):
            raise EngineError(f"{self.who} answered {path} with JSON that is not an object")
        return obj

    def _exchange(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
        """(HTTP status, at most ``MAX_RESPONSE_BYTES`` + 1 body bytes) of one POST, the whole
        request (connect, headers, body) bounded by ``timeout_s``: it runs on a worker thread, and
        past the deadline the connection is shut down and the session replaced (a server that
        trickles a byte at a time never resets a per-read timeout into a hang). ``EngineError``
        for a timeout, a refused or broken connection, a body cut short (its Content-Length not
        met: urllib3's ``IncompleteRead``) or any other transport failure."""
        import requests
        import urllib3

        timeout = self.spec.timeout_s
        box: dict[str, Any] = {}

        def exchange() -> None:
            try:
                with self._session.post(url, json=body, headers=headers, timeout=timeout, stream=True) as r:
                    box["response"] = r
                    box["result"] = (r.status_code, r.raw.read(MAX_RESPONSE_BYTES + 1, decode_content=True))
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e

        worker = threading.Thread(target=exchange, name=f"http {self.spec.name}", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            self._abandon(box.get("response"))
            raise EngineError(f"{self.who} timed out after {timeout:g} s ({self.spec.safe_url}{path}: the whole request, "
                              "connect to last byte)")
        e = box.get("error")
        if e is None:
            return box["result"]
        if isinstance(e, (requests.Timeout, urllib3.exceptions.TimeoutError)):
            raise EngineError(f"{self.who} timed out after {timeout:g} s ({self.spec.safe_url}{path})") from None
        if isinstance(e, (urllib3.exceptions.ProtocolError, requests.exceptions.ChunkedEncodingError)):
            cause = type(e.args[-1] if e.args else e).__name__
            raise EngineError(f"{self.who}: the answer to {path} was cut short ({cause}: the connection closed before the body's "
                              "announced length)") from None
        if isinstance(e, requests.ConnectionError):
            why = "connection refused" if "refused" in str(e).lower() else "connection failed"
            raise EngineError(f"{self.who}: cannot reach {self.spec.safe_url} ({why})") from None
        if isinstance(e, (requests.RequestException, urllib3.exceptions.HTTPError, OSError)):
            raise EngineError(f"{self.who}: request to {self.spec.safe_url}{path} failed ({type(e).__name__})") from None
        raise e

    def _abandon(self, response: Any) -> None:
        """Stop a request that ran past its deadline: shut its socket down (the worker's blocked
        read returns) and start a fresh session, so nothing of it is reused."""
        import requests

        sock = getattr(getattr(getattr(response, "raw", None), "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        old, self._session = self._session, requests.Session()
        old.close()

    def _check_model(self, obj: dict[str, Any]) -> None:
        """``NotComparable`` when the response names another model than the configured one."""
        served = obj.get("model")
        if served is None:  # llama-server's /completion may not name it; the tokenization and numbers still must agree
            return
        self.served_model = plain(str(served))[:200]
        if str(served) != self.spec.model:
            raise NotComparable(f"{self.who} answered for model {plain(str(served))[:120]!r}, but the configuration names "
                                f"{plain(self.spec.model)[:120]!r}: the server runs another model")

    def _complete(self, prompt: Any, **params: Any) -> dict[str, Any]:
        """One completion request at ``temperature`` 0 (llama-server's ``/completion`` takes no
        ``model``), its model checked (``_check_model``)."""
        named = {} if self.kind.name == "llama-server" else {"model": self.spec.model}
        obj = self._post(self.kind.endpoint, {**named, "prompt": prompt, "temperature": 0, **params})
        self._check_model(obj)
        return obj

    # ----------------------------------------------------------------------------- prompts
    def _prompt_text(self, tokens: Sequence[int]) -> str:
        """The reference's detokenized text of ``tokens``; ``NotComparable`` when it is not UTF-8."""
        data = b"".join((self.vocab.raw(t) or "").encode("utf-8", "surrogateescape") for t in tokens)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            pos = next(i for i in range(1, len(tokens) + 1)
                       if len(b"".join((self.vocab.raw(t) or "").encode("utf-8", "surrogateescape") for t in tokens[:i])) > e.start)
            raise NotComparable(f"{self.who} takes text, but the tokens are not valid UTF-8 text at position {pos - 1}: "
                                "they cannot be sent as text") from None

    def _prompt(self, tokens: Sequence[int]) -> Any:
        """What goes in ``prompt``: the ids, or the text after checking the server tokenizes it back
        to exactly ``tokens`` (``NotComparable`` naming the first differing position)."""
        tokens = [int(t) for t in tokens]
        if self.kind.sends_ids:
            return tokens
        text = self._prompt_text(tokens)
        obj = self._post(self.kind.tokenize_path, {"input": text, "model": self.spec.model})
        got = obj.get("tokens")
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            raise EngineError(f"{self.who} answered {self.kind.tokenize_path} without a list of token ids")
        if got != tokens:
            i = next((j for j, (a, b) in enumerate(zip(got, tokens)) if a != b), min(len(got), len(tokens)))
            theirs = got[i] if i < len(got) else "(end)"
            ours = tokens[i] if i < len(tokens) else "(end)"
            raise NotComparable(f"{self.who} tokenizes the prompt text differently: first difference at position {i} "
                                f"(server {theirs}, reference {ours}; {len(got)} vs {len(tokens)} tokens)")
        return text

    # ----------------------------------------------------------------------------- logprobs
    def _key_id(self, key: Any) -> int | None:
        """The token id of a logprobs key (None: ambiguous or unknown, it goes to the tail)."""
        if self.kind.keys == "text":
            return self._keys.get(key) if isinstance(key, str) else None
        if isinstance(key, str) and key.startswith("token_id:"):
            key = key[len("token_id:"):]
        try:
            i = int(key)
        except (TypeError, ValueError):
            return None
        return i if 0 <= i < self.n_vocab else None

    def _row(self, entries: dict[Any, float], k: int, where: str) -> tuple[np.ndarray, np.ndarray, float]:
        """One position's ``(ids [k], logprobs [k], dropped_max)`` from ``{key: logprob}``: the k
        largest mapped entries, and the largest logprob of the entries whose key maps to no single
        id (ambiguous: their mass stays in the tail; -inf when none). ``EngineError`` for a logprob
        that is not a number ≤ 0."""
        pairs, dropped = [], -math.inf
        for key, lp in entries.items():
            if isinstance(lp, bool) or not isinstance(lp, (int, float)) or math.isnan(lp) or lp > 1e-6:
                raise EngineError(f"{self.who}: logprob {plain(str(lp))[:40]} for {plain(str(key))[:40]!r} at {where} is not a log probability")
            tid = self._key_id(key)
            if tid is None:
                dropped = max(dropped, float(lp))
            else:
                pairs.append((float(lp), tid))
        pairs.sort(key=lambda p: (-p[0], p[1]))
        ids = np.full(k, -1, np.int64)
        lps = np.full(k, np.nan)
        for j, (lp, tid) in enumerate(pairs[:k]):
            ids[j], lps[j] = tid, min(lp, 0.0)
        return ids, lps, dropped

    def _entries(self, raw: Any, where: str) -> dict[Any, float]:
        """``{key: logprob}`` from one entry of a response (dict of numbers, vLLM's dict of
        ``{"logprob": x}``, or llama-server's list of ``{"id", "logprob"}``)."""
        if isinstance(raw, list):
            out = {}
            for e in raw:
                if not isinstance(e, dict) or "logprob" not in e or "id" not in e:
                    raise EngineError(f"{self.who}: malformed top_logprobs entry at {where}")
                out[e["id"]] = e["logprob"]
            return out
        if not isinstance(raw, dict) or not raw:
            raise EngineError(f"{self.who} gave no logprobs at {where}")
        return {k: (v.get("logprob") if isinstance(v, dict) else v) for k, v in raw.items()}

    def _choice(self, obj: dict[str, Any], what: str) -> dict[str, Any]:
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EngineError(f"{self.who} answered without choices ({what})")
        return choices[0]

    def _last_row(self, prompt: Any, k: int, where: str) -> dict[Any, float]:
        """The distribution after the whole ``prompt``: the first generated token's top logprobs."""
        if self.kind.name == "llama-server":
            return self._llama_server_row(prompt, k, where)
        extra = {"return_tokens_as_token_ids": True} if self.kind.keys == "id" else {}
        lp = self._choice(self._complete(prompt, max_tokens=1, logprobs=k, **extra), where).get("logprobs")
        tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
        if not isinstance(tops, list) or not tops:
            raise EngineError(f"{self.who} answered without logprobs (missing logprobs) at {where}")
        return self._entries(tops[0], where)

    def _llama_server_row(self, prompt: list[int], k: int, where: str) -> dict[Any, float]:
        """llama-server's distribution after ``prompt``: ``/completion`` with ``n_predict`` 1 and
        ``n_probs`` k, the probabilities of the raw logits (``post_sampling_probs`` false).

        llama-server withholds a sampled token whose text ends in a cut UTF-8 character (a byte
        token, or a merge such as ``' \\xe2'``), waiting for the bytes that complete it; with
        ``n_predict`` 1 none come, and it answers without ``completion_probabilities``
        (``server-context.cpp`` ``process_token``: no ``add_token`` while ``validate_utf8`` finds
        the text incomplete). The greedy pick is then such a token: the request is repeated with
        it banned (``logit_bias`` false), which moves the sampler to another token and leaves the
        logits, and so the probabilities asked for, as they were (``populate_token_probs`` reads
        them before sampling). At most ``MAX_WITHHELD`` bans per position. Raises ``EngineError``
        naming the position, the tokens tried and the server's ``stop_type`` when it still answers
        without them, or when the token it sampled was not withheld."""
        banned: list[int] = []
        while True:
            obj = self._complete(prompt, n_predict=1, n_probs=k, post_sampling_probs=False, cache_prompt=False, return_tokens=True,
                                 **({"logit_bias": [[t, False] for t in banned]} if banned else {}))
            probs = obj.get("completion_probabilities")
            if isinstance(probs, list) and probs and isinstance(probs[0], dict):
                return self._entries(probs[0].get("top_logprobs"), where)
            got = obj.get("tokens")
            tok = got[0] if isinstance(got, list) and len(got) == 1 and isinstance(got[0], int) and not isinstance(got[0], bool) else None
            cut = tok is not None and 0 <= tok < self.n_vocab and ends_in_cut_utf8(self._token_bytes(tok))
            tried = f"; banned before: {banned}" if banned else ""
            if not cut:
                raise EngineError(f"{self.who} answered without completion_probabilities (missing logprobs) at {where}: it sampled "
                                  f"{plain(str(got))[:60]} (stop_type {plain(str(obj.get('stop_type')))[:40]}), not a token it withholds "
                                  f"as a cut UTF-8 character{tried}")
            if len(banned) >= MAX_WITHHELD:
                raise EngineError(f"{self.who} answered without completion_probabilities (missing logprobs) at {where}: every "
                                  f"greedy pick ends in a cut UTF-8 character, which it withholds (tokens {banned + [tok]} "
                                  f"banned in turn, {MAX_WITHHELD} at most)")
            banned.append(tok)

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes of ``token_id``'s text in the reference vocabulary (b'' outside it)."""
        return (self.vocab.raw(token_id) or "").encode("utf-8", "surrogateescape")

    def topk(self, tokens: Sequence[int]) -> TopK:
        """Top-k logprobs per position (k = ``max_logprobs``) of ``tokens``, row t the distribution
        after ``tokens[:t+1]``, in as few requests as the kind allows (module docstring).

        Raises ``EngineError`` (transport, malformed or missing logprobs) and ``NotComparable``
        (another model, another tokenization).
        """
        tokens = [int(t) for t in tokens]
        n, k = len(tokens), self.spec.max_logprobs
        rows: list[dict[Any, float] | None] = [None] * n
        prompt = self._prompt(tokens)
        if self.kind.prompt_logprobs == "echo":
            lp = self._choice(self._complete(prompt, max_tokens=1, echo=True, logprobs=k), "echo").get("logprobs")
            tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
            if not isinstance(tops, list) or len(tops) < n:
                raise EngineError(f"{self.who} answered without prompt logprobs (missing logprobs: {0 if not isinstance(tops, list) else len(tops)} "
                                  f"entries for {n} positions; llama-cpp-python leaves out the entry of a BOS token inside the prompt)")
            for i in range(1, n):  # entry i: after tokens[:i+1]; entry 0 is null
                rows[i] = self._entries(tops[i], f"position {i}")
        elif self.kind.prompt_logprobs == "prompt_logprobs":
            obj = self._complete(prompt, max_tokens=1, prompt_logprobs=k, logprobs=k, return_tokens_as_token_ids=True)
            choice = self._choice(obj, "prompt_logprobs")
            pl = choice.get("prompt_logprobs", obj.get("prompt_logprobs"))
            if not isinstance(pl, list) or len(pl) != n:
                raise EngineError(f"{self.who} answered without prompt_logprobs for {n} positions (missing logprobs)")
            for i in range(1, n):  # entry i predicted token i: the distribution after tokens[:i]
                rows[i - 1] = self._entries(pl[i], f"position {i - 1}")
            lp = choice.get("logprobs")
            tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
            if not isinstance(tops, list) or not tops:
                raise EngineError(f"{self.who} answered without the generated token's logprobs (missing logprobs)")
            rows[n - 1] = self._entries(tops[0], f"position {n - 1}")
        for i in range(n):
            if rows[i] is None:  # one request per position (and llama-cpp-python's position 0)
                sub = tokens[: i + 1]
                rows[i] = self._last_row(sub if self.kind.sends_ids else self._prompt(sub), k, f"position {i}")
        ids = np.full((n, k), -1, np.int64)
        lps = np.full((n, k), np.nan)
        dropped = np.full(n, -np.inf)
        for i, entries in enumerate(rows):
            ids[i], lps[i], dropped[i] = self._row(entries, k, f"position {i}")
        return TopK(ids, lps, dropped)

    def tokenize_text(self, text: str, add_special: bool = False) -> list[int]:
        """The server's own token ids for ``text``, through its tokenize endpoint (``TOKENIZE``):
        llama-cpp-python's ``/extras/tokenize`` (which always adds the BOS the model asks for and
        parses special-token strings: ``llama_cpp/server/app.py``), vLLM's ``/tokenize``
        (``add_special_tokens``), llama-server's ``/tokenize`` (``add_special``). Raises
        ``EngineError`` (transport, no list of ids in the vocab)."""
        path, body = TOKENIZE[self.kind.name](self.spec.model, str(text), bool(add_special))
        obj = self._post(path, body)
        return checked_token_ids(obj.get("tokens"), self.n_vocab, self.who, f"{path} tokens")

    def chat_prompt_tokens(self, conversation: dict[str, Any]) -> int:
        """How many tokens the server's own chat template makes of a conversation (capability
        ``chat_template``, llama-cpp-python only): ``/v1/chat/completions`` with the conversation's
        ``messages``, ``tools`` and ``template_kwargs`` (as ``chat_template_kwargs``), ``max_tokens`` 1 and ``temperature`` 0, answered with
        ``usage.prompt_tokens``. llama-cpp-python renders the GGUF's ``tokenizer.chat_template``
        with its ``Jinja2ChatFormatter`` (generation prompt always on) and tokenizes the text with
        specials parsed and no BOS added (``llama_cpp/llama_chat_format.py``
        ``chat_formatter_to_chat_completion_handler``); it has no endpoint that returns the text,
        so the count is what can be compared. Raises ``EngineError`` (transport, no count)."""
        body: dict[str, Any] = {"model": self.spec.model, "messages": conversation["messages"], "max_tokens": 1, "temperature": 0}
        if conversation.get("tools"):
            body["tools"] = conversation["tools"]
        if conversation.get("template_kwargs"):
            body["chat_template_kwargs"] = conversation["template_kwargs"]
        usage = self._post("/v1/chat/completions", body).get("usage")
        n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise EngineError(f"{self.who} answered /v1/chat/completions without a usage.prompt_tokens count")
        return n

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]:
        """Not available: a server gives top-k logprobs (``topk``). Raises ``EngineError``."""
        raise EngineError(f"{self.who} gives top-{self.spec.max_logprobs} logprobs, not logits: only top-k comparisons "
                          "(harness parity's top-k tier) can judge it")

    def generate(self, tokens: Sequence[int], n_tokens: int) -> list[int]:
        """Greedy continuation (``temperature`` 0) of ``tokens``: at most ``n_tokens`` new ids
        (fewer when the server stops at an end-of-generation token). Token ids come from the
        server's token-id keys where it gives them, else from the generated text tokenized by the
        server itself. Raises ``EngineError`` / ``NotComparable`` as ``topk``."""
        prompt = self._prompt(tokens)
        if self.kind.name == "llama-server":
            obj = self._complete(prompt, n_predict=n_tokens, return_tokens=True, cache_prompt=False, **GREEDY_PARAMS[self.kind.name])
            got = obj.get("tokens")
        elif self.kind.keys == "id":
            lp = self._choice(self._complete(prompt, max_tokens=n_tokens, logprobs=1, return_tokens_as_token_ids=True,
                                             **GREEDY_PARAMS[self.kind.name]), "generate").get("logprobs")
            got = [self._key_id(t) for t in (lp.get("tokens") or [])] if isinstance(lp, dict) else None
        else:
            text = self._choice(self._complete(prompt, max_tokens=n_tokens, **GREEDY_PARAMS[self.kind.name]), "generate").get("text")
            if not isinstance(text, str):
                raise EngineError(f"{self.who} answered without generated text")
            full = self._post(self.kind.tokenize_path, {"input": prompt + text, "model": self.spec.model}).get("tokens")
            got = full[len(tokens):] if isinstance(full, list) and full[: len(tokens)] == list(tokens) else None
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            raise EngineError(f"{self.who} answered a generation without token ids")
        return [int(t) for t in got[:n_tokens]]


def load_http_engine(name: str, model_path: str | os.PathLike, overrides: Sequence[Override] = ()) -> HttpEngine:
    """The configured server ``name`` bound to ``model_path``; ``InvalidInput`` when none is
    configured (naming the configured ones)."""
    cfg = load_config()
    return HttpEngine(configured_engine(configured_servers(cfg), name, "http", "http", cfg), model_path, overrides)


def wait_until_up(url: str, timeout_s: float = 60.0) -> bool:
    """Poll ``url``/v1/models until it answers 200 (True) or ``timeout_s`` passes (False)."""
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(url.rstrip("/") + "/v1/models", timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.2)
    return False
