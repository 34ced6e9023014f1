"""Speed as evidence: an engine wrapped so that the harness's time inside it is measured.

``TimedEngine(engine, load_s)`` delegates everything to ``engine`` and adds up the wall time of
its calls (the ``logits`` / ``logits_multi`` streams while they compute, ``activations``,
``info``, ``n_vocab``) and the tokens it was given; ``timings()`` is the receipt's
``timings.<role>`` entry. Timings are measurements of one run on one machine: receipts keep them
out of their content hash (``harness.evidence.receipts.HASH_EXCLUDED``), so identical runs keep
one receipt id.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Sequence

from harness.engines.base import LogitBlock, logits_each, prestart


class TimedEngine:
    """``engine`` with its calls timed. ``load_s``: seconds it took to construct (open the model).

    ``timings()`` returns ``{"wall_s", "load_s", "prefill_s", "tokens", "prefill_tokens_per_s",
    "source"}``: ``wall_s`` is construction plus every call (seconds, harness clock);
    ``load_s`` and ``prefill_s`` are the engine's own model-load and forward seconds where it
    reports them (``engine.timings`` with ``load_s``, ``decode_s``: llama.cpp's worker measures
    ``llama_model_load_from_file`` and ``llama_decode``; ``source`` ``"engine"``), else
    construction time and the harness-measured time of its logits streams (``source``
    ``"harness"``); ``prefill_tokens_per_s`` is tokens / prefill_s (None when nothing ran). An
    engine that computes in its own process while the harness does other work (the llama.cpp
    reference's one worker run for a prompt set decodes the next prompt while an in-process
    candidate computes) can report more ``prefill_s`` than the harness waited for it (``wall_s``).
    """

    def __init__(self, engine: Any, load_s: float = 0.0):
        self.engine = engine
        self._load_s = float(load_s)
        self._calls_s = 0.0
        self._stream_s = 0.0
        self._tokens = 0

    @classmethod
    def load(cls, make: Callable[[], Any]) -> "TimedEngine":
        """Construct an engine with ``make()`` and time it."""
        t = time.perf_counter()
        engine = make()
        return cls(engine, time.perf_counter() - t)

    def _timed_stream(self, blocks: Iterator[LogitBlock], n_tokens: int) -> Iterator[LogitBlock]:
        self._tokens += n_tokens
        while True:
            t = time.perf_counter()
            try:
                item = next(blocks)
            except StopIteration:
                return
            finally:
                dt = time.perf_counter() - t
                self._calls_s += dt
                self._stream_s += dt
            yield item

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]:
        return self._timed_stream(iter(self.engine.logits(tokens, chunks)), len(tokens))


    def _call(self, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        try:
            return fn()
        finally:
            self._calls_s += time.perf_counter() - t

    @property
    def info(self) -> Any:
        return self._call(lambda: self.engine.info)

    @property
    def n_vocab(self) -> int:
        return self._call(lambda: self.engine.n_vocab)

    def activations(self, *a: Any, **k: Any) -> Any:
        return self._call(lambda: self.engine.activations(*a, **k))

    logits_each_first_rows = True
    """``logits_each`` passes ``first_rows`` on (``harness.engines.base.logits_each``)."""

    def logits_each(self, prompts: Sequence[Sequence[int]], first_rows: Sequence[int] | None = None) -> Iterator[Iterator[LogitBlock]]:
        """``harness.engines.base.logits_each`` of the engine (with ``first_rows``), every stream
        timed (starting the engine's run counts in its wall time); ``tokens`` counts every
        prompt's tokens, all of which the engine decodes."""
        each = logits_each(self.engine, prompts, first_rows)
        for p in prompts:
            stream = self._call(lambda: next(each))
            yield self._timed_stream(iter(stream), len(p))
        self._call(lambda: next(each, None))  # the engine's run ends and checks itself

    def prestart(self) -> None:
        """``harness.engines.base.prestart`` of the engine (its start counts in its wall time)."""
        self._call(lambda: prestart(self.engine))

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.engine, attr)  # AttributeError where the engine lacks it (logits_multi)
        if attr == "logits_multi":
            return lambda sequences: self._timed_stream(iter(value(sequences)), sum(len(q) for q in sequences))
        if attr in ("topk", "generate"):  # a server's requests count in its wall time
            return lambda *a, **k: self._call(lambda: value(*a, **k))
        return value

    def timings(self) -> dict[str, Any]:
        own = getattr(self.engine, "timings", None)
        if isinstance(own, dict) and "decode_s" in own:
            load_s, prefill_s, source = float(own.get("load_s", 0.0)), float(own["decode_s"]), "engine"
        else:
            load_s, prefill_s, source = self._load_s, self._stream_s, "harness"
        return {
            "wall_s": round(self._load_s + self._calls_s, 4),
            "load_s": round(load_s, 4),
            "prefill_s": round(prefill_s, 4),
            "tokens": self._tokens,
            "prefill_tokens_per_s": round(self._tokens / prefill_s, 2) if self._tokens and prefill_s > 0 else None,
            "source": source,
        }


def timed(make: Callable[[], Any]) -> TimedEngine:
    """``TimedEngine.load(make)``: construct an engine and time everything it does from then on."""
    return TimedEngine.load(make)
