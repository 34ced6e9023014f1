"""Incremental decoding with the oracle: a sequence's per-layer state kept between calls.

``Qwen35Oracle.logits`` runs each layer over the whole prompt (piece by piece with ``chunks``)
and forgets the state; free-running generation and sessions need the state kept after a call.
``OracleSession`` holds, for one sequence, every layer's weights (dequantized once, as
``load_layer`` returns them: about the model's parameter count in float64, so only for small
models) and state (``init_state``: conv and recurrent state, K/V of earlier tokens), and feeds
further tokens through the same ``embed`` → ``block`` per layer → ``result_norm`` → ``lm_head``
steps as ``Qwen35Oracle._forward`` does per piece. So ``feed(a)`` then ``feed(b)`` computes what
``logits(a + b, chunks=[len(a), len(b)])`` computes, and a mutant's or a low-precision
emulation's overrides apply unchanged (every step is called through the oracle).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np

from harness.errors import EngineError


class OracleSession:
    """One sequence's state in an oracle (see module docstring).

    ``oracle``: a ``Qwen35Oracle`` (or subclass); ``weights``: per-layer weights shared between
    sessions forked from one another (read-only). ``n_past`` counts the tokens fed so far.
    """

    def __init__(self, oracle: Any, weights: list[dict[str, np.ndarray]] | None = None):
        self.oracle = oracle
        self.weights = weights if weights is not None else [oracle.load_layer(il) for il in range(oracle.hp.n_layer)]
        self.states = [oracle.init_state(il, w) for il, w in enumerate(self.weights)]
        self.n_past = 0

    def fork(self) -> "OracleSession":
        """An independent copy of this session's state (weights shared)."""
        other = OracleSession.__new__(OracleSession)
        other.oracle, other.weights, other.n_past = self.oracle, self.weights, self.n_past
        other.states = copy.deepcopy(self.states)
        return other

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        """Feed ``tokens`` after the ones fed so far; returns their logits float32 ``[T, V]``
        (row t: the distribution after this session's history and ``tokens[:t+1]``), or with
        ``last_only`` only the last row ``[1, V]`` (the output projection of the others skipped:
        generation needs only the next token's distribution).
        Raises ``EngineError`` (empty input, token ids outside the vocab, non-finite values)."""
        h, _ = self.feed_hidden(tokens)
        return self.oracle.lm_head(h[-1:] if last_only else h, np.float32)

    def feed_hidden(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Feed ``tokens`` as one piece (as ``feed``) and return ``(result_norm, l_out)`` float64
        ``[T, n_embd]`` each: the trunk's state after ``output_norm`` (what the LM head scores and
        the MTP head is fed) and the last layer's output before it. Raises as ``feed``."""
        o = self.oracle
        toks = np.asarray([int(t) for t in tokens], dtype=np.int64)
        emit = o.recorder()
        pos = np.arange(self.n_past, self.n_past + len(toks))
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            h = emit("model.input_embed", -1, o.embed(toks))
            for il, (w, state) in enumerate(zip(self.weights, self.states)):
                try:
                    h[:] = o.block(il, w, h, state, pos, emit)
                except FloatingPointError as err:
                    raise EngineError(f"oracle: floating-point {err} in layer {il} after op {emit.last!r}") from None
            pre = h.copy()
            h = o.result_norm(h, emit)
        self.n_past += len(toks)
        return h, pre


def greedy_continue(session: OracleSession, tokens: Sequence[int], n_tokens: int) -> list[int]:
    """Feed ``tokens`` to ``session``, then ``n_tokens`` times its argmax (ties: lowest id),
    each fed back one token per call; returns the chosen ids (the last one is not fed)."""
    out: list[int] = []
    if n_tokens <= 0:
        return out
    last = session.feed(tokens, last_only=True)[-1]
    while True:
        out.append(int(np.argmax(last)))
        if len(out) >= n_tokens:
            return out
        last = session.feed([out[-1]], last_only=True)[-1]
