"""Speculative greedy decoding with the oracle's own MTP head (capability ``speculative``).

The known-good control for the ``speculative`` probe (``harness.runs.probes.probe_speculative``)
and the base of its mutants (``harness.engines.mutants.SPEC_MUTANTS``). One ``SpecDecoder`` holds
one sequence: the trunk's ``OracleSession`` (conv state, recurrent state, K/V per layer), the MTP
head's own K/V, and the trunk's last hidden state. A step, as llama.cpp's MTP driver
(``common_speculative`` with ``draft-mtp``) and vLLM's do it:

1. **Draft.** With the last fed token at position q and the next token t chosen (not yet fed),
   the head drafts k = min(draft_max, tokens still wanted − 1) tokens: row q+1 is (h_q, t), row
   q+1+i is (g_i, d_i), g_i the head's post-norm output of the row before (chained drafts; rows in
   llama.cpp's convention, ``Qwen35Oracle.mtp_rows``). A step with k = 0 is draft-less.
2. **Verify.** The trunk is fed the 1 + k tokens [t, d_1 … d_k] as one piece (one batch, as an
   engine's verification batch); d_i is accepted while it equals the argmax (ties: lowest id) of
   the row before it; a accepted drafts give a + 1 new tokens: d_1 … d_a and the argmax after d_a.
3. **Roll back** (``rollback``): when a < k, the trunk's state must be the state after
   [t, d_1 … d_a]: the snapshot taken before the batch is restored (conv state, recurrent state,
   K/V) and those 1 + a tokens are fed again, so every layer's conv and recurrent state hold
   nothing of the rejected drafts. The head's K/V is cut back to the rows before the drafts and
   given the accepted rows with the trunk's own hidden states.

So the continuation equals plain greedy (``greedy_continue``) up to float64 summation order.
Each hook (``rollback``, ``draftless_state``, ``after_prompt``, ``session_state``) is where one
planted fault goes. Source of the scheme: llama.cpp ``common/speculative.cpp`` (draft, accept,
``llama_memory_seq_rm`` plus a recurrent-state checkpoint); vLLM ``EagleProposer`` / MTP with
mamba state columns per draft token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from harness.engines.base import Speculation, check_given, validate_chunks
from harness.engines.oracle.session import OracleSession
from harness.errors import EngineError


def _kv_keep(state: dict[str, Any], n: int) -> None:
    """Cut an attention layer's K/V state (``{"k", "v", "pos"}`` lists of pieces) to its first ``n`` rows, in place."""
    if not state["k"]:
        return
    k, v, pos = (np.concatenate(state[x], axis=0)[:n] for x in ("k", "v", "pos"))
    state["k"], state["v"], state["pos"] = [k], [v], [pos]


@dataclass
class _Step:
    """What a verification step leaves for the hooks of the next: the states before the batch
    (``before``), after it (``after``, rejected drafts included), the batch and the accepted count."""

    before: list[dict[str, Any]]
    after: list[dict[str, Any]]
    batch: list[int]
    accepted: int


@dataclass
class SpecDecoder:
    """One sequence's speculative decoder over ``session`` (see module docstring).

    ``history``: the tokens the trunk has been fed; ``h_last``: float64 [n_embd], the trunk's
    post-norm hidden state after the last of them; ``mtp``: the head's K/V state (rows 0 … len(history) − 1,
    llama.cpp convention); ``last_step``: the last verification step with drafts (None: none yet);
    ``spoiled``: the trunk states after the last batch whose drafts were rejected, before its
    rollback (what a faulty prompt cache would save); ``rows``: float64 [V] each, the row that
    chose each generated token (``speculate`` returns them as ``Speculation.logits``)."""

    session: OracleSession
    mtp: dict[str, Any]
    mtp_w: dict[str, np.ndarray]
    history: list[int] = field(default_factory=list)
    h_last: np.ndarray | None = None
    h_pre_last: np.ndarray | None = None
    last_step: _Step | None = None
    spoiled: list[dict[str, Any]] | None = None
    rows: list[np.ndarray] = field(default_factory=list)

    @property
    def oracle(self) -> Any:
        return self.session.oracle

    # -- the head -----------------------------------------------------------------------------
    def head_rows(self, hidden: np.ndarray, hidden_pre: np.ndarray, toks: Sequence[int], pos0: int, trunk: bool = True) -> np.ndarray:
        """Feed the head rows (hidden[i], toks[i]) at positions pos0 + i into its K/V; returns
        the post-norm outputs g float64 [R, n_embd]. ``trunk``: the hidden rows are the trunk's
        (passed through ``mtp_hidden``, the hook the MTP mutants use) rather than the head's own g."""
        o, il, w = self.oracle, self.oracle.mtp_layer(), self.mtp_w
        eps = o.hp.rms_eps
        h = o.mtp_hidden(hidden_pre, hidden) if trunk else hidden
        x = np.asarray(toks, np.int64)
        emit = o.recorder()
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            try:
                e = o.rmsnorm(o.mtp_embed(il, x), w["nextn.enorm"], eps)
                hn = o.rmsnorm(h, w["nextn.hnorm"], eps)
                u = o.mtp_concat(e, hn) @ w["nextn.eh_proj"].T
                b = o.block(il, w, u, self.mtp, np.arange(pos0, pos0 + len(x)), emit)
                return o.mtp_head_norm(b, il, w)
            except FloatingPointError as err:
                raise EngineError(f"oracle: floating-point {err} in the MTP block {il} (speculative drafting)") from None

    def draft(self, t: int, k: int) -> list[int]:
        """k chained drafts after the chosen token t (not yet fed); the head's K/V is left with
        the draft rows in it (``verify`` cuts them)."""
        o, out = self.oracle, []
        q = len(self.history) - 1
        g = self.head_rows(self.h_last[None], self.h_pre_last[None], [t], q + 1)
        for i in range(k):
            d = int(np.argmax(o.mtp_logits(g, o.mtp_layer(), np.float64)[0]))
            out.append(d)
            if i + 1 < k:
                g = self.head_rows(g, g, [d], q + 2 + i, trunk=False)
        return out

    # -- the trunk ----------------------------------------------------------------------------
    def feed(self, toks: Sequence[int], chunks: Sequence[int] | None = None) -> np.ndarray:
        """Feed the trunk ``toks`` (in ``chunks``) and the head their rows; returns the trunk's
        logits float64 [T, V] (row i: after toks[:i+1]). Updates ``history`` and ``h_last``."""
        toks = [int(t) for t in toks]
        rows, hs, pres = [], [], []
        done = 0
        for c in validate_chunks(len(toks), chunks):
            h, pre = self.session.feed_hidden(toks[done:done + c])
            hs.append(h)
            pres.append(pre)
            done += c
        h, pre = np.concatenate(hs), np.concatenate(pres)
        # head rows (h_{p-1}, x_p) for the new positions; h_{-1} = 0 (the sentinel row)
        p0 = len(self.history)
        prev = self.h_last[None] if self.h_last is not None else np.zeros((1, h.shape[1]))
        prev_pre = self.h_pre_last[None] if self.h_pre_last is not None else np.zeros((1, h.shape[1]))
        self.head_rows(np.vstack([prev, h[:-1]]), np.vstack([prev_pre, pre[:-1]]), toks, p0)
        self.history += toks
        self.h_last, self.h_pre_last = h[-1], pre[-1]
        rows.append(self.oracle.lm_head(h, np.float64))
        return np.concatenate(rows)

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of every trunk layer's state (conv, recurrent, K/V)."""
        return copy.deepcopy(self.session.states)

    def restore(self, states: list[dict[str, Any]], n_past: int) -> None:
        self.session.states = copy.deepcopy(states)
        self.session.n_past = n_past

    def step(self, t: int, k: int, given: Sequence[int] | None = None) -> tuple[list[int], int, int]:
        """One verification step after the chosen token t with up to k drafts (``given``: the
        drafts to verify instead of the head's, k of them): returns (the new tokens after t:
        accepted drafts and the next choice, accepted, rejected). The rows that chose them are
        appended to ``rows`` (float64 [V] each)."""
        if k == 0:
            self.draftless_state()
            logits = self.feed([t])
            self.rows.append(logits[-1])
            return [int(np.argmax(logits[-1]))], 0, 0
        drafts = self.draft(t, k) if given is None else [int(d) for d in given]
        _kv_keep(self.mtp, len(self.history))  # the draft rows out; verify feeds the true ones
        before, n_past, hist, h_last, h_pre = self.snapshot(), self.session.n_past, list(self.history), self.h_last, self.h_pre_last
        mtp_before = copy.deepcopy(self.mtp)
        batch = [t] + drafts
        logits = self.feed(batch)
        choice = logits.argmax(axis=1)
        a = 0
        while a < k and drafts[a] == int(choice[a]):
            a += 1
        after = self.snapshot()
        self.rows.extend(logits[: a + 1])
        if a < k:
            self.spoiled = after
            self.history, self.h_last, self.h_pre_last, self.mtp = hist, h_last, h_pre, mtp_before
            self.rollback(before, after, n_past, batch[: 1 + a])
        self.last_step = _Step(before, after, batch, a)
        return drafts[:a] + [int(choice[a])], a, k - a

    # -- hooks (each one planted fault's place) -----------------------------------------------
    def rollback(self, before: list[dict[str, Any]], after: list[dict[str, Any]], n_past: int, keep: list[int]) -> None:
        """Roll the trunk back to the state after ``keep`` (the batch's token and its accepted
        drafts): restore the snapshot ``before`` the batch and feed ``keep`` again (with the head's
        rows). ``after`` is the state the batch left (rejected drafts in it), unused here."""
        self.restore(before, n_past)
        self.feed(keep)

    def draftless_state(self) -> None:
        """Before a draft-less step: the trunk's state is read as it is (the last accepted token's)."""

    def after_prompt(self, n_prompt: int, draft_max: int) -> None:
        """After the prompt's prefill: its state is written as computed."""

    def session_state(self) -> list[dict[str, Any]]:
        """The trunk states a session keeps for reuse: the current (rolled-back) ones."""
        return self.snapshot()


def speculate(dec: SpecDecoder, tokens: Sequence[int], n_tokens: int, draft_max: int, chunks: Sequence[int] | None = None,
              first_logits: np.ndarray | None = None, given: Sequence[int] | None = None) -> Speculation:
    """Greedy speculative continuation of ``tokens`` (fed in ``chunks``) by ``dec``: ``n_tokens``
    ids with the accepted and rejected draft counts of every verification step, and the rows that
    chose them (``Speculation.logits`` float32 [n, V]). ``given``: drafts the harness gives (the
    draft for generated index j is given[j]; a step after j tokens proposes
    given[j : j + min(draft_max, n_tokens − j − 1, len(given) − j)], none past the list) instead of
    the head's. Raises ``EngineError`` for a draft_max below 1, an empty prompt, or given drafts
    refused by ``harness.engines.base.check_given``."""
    if draft_max < 1:
        raise EngineError(f"oracle: draft_max {draft_max} must be at least 1")
    if not tokens:
        raise EngineError("oracle: speculative generation needs at least one prompt token")
    given = None if given is None else check_given(given, n_tokens, draft_max, int(dec.oracle.n_vocab), "oracle")
    out: list[int] = []
    acc: list[int] = []
    rej: list[int] = []
    if n_tokens <= 0:
        return Speculation(out, acc, rej)
    dec.rows = []
    logits = dec.feed(tokens, chunks)
    dec.after_prompt(len(tokens), draft_max)
    out.append(int(np.argmax(logits[-1])))
    dec.rows.append(logits[-1])
    while len(out) < n_tokens:
        j = len(out)
        k = min(draft_max, n_tokens - j - 1)
        if given is not None:
            k = max(0, min(k, len(given) - j))
        new, a, r = dec.step(out[-1], k, None if given is None else given[j:j + k])
        out += new
        acc.append(a)
        rej.append(r)
    rows = np.asarray(dec.rows[:n_tokens], np.float32)
    return Speculation(out[:n_tokens], acc, rej, rows)


def new_decoder(oracle: Any, cls: type = SpecDecoder) -> SpecDecoder:
    """A fresh decoder (class ``cls``) on ``oracle``'s session: empty trunk state, empty head K/V."""
    il = oracle.mtp_layer()
    w = oracle.mtp_weights(il)
    return cls(oracle.session(), oracle.init_state(il, w), w)


def fork_decoder(dec: SpecDecoder) -> SpecDecoder:
    """An independent copy of ``dec`` from the state its ``session_state`` hook keeps (a session)."""
    other = copy.copy(dec)
    other.session = dec.session.fork()
    other.session.states = copy.deepcopy(dec.session_state())
    other.mtp = copy.deepcopy(dec.mtp)
    other.history = list(dec.history)
    other.last_step, other.spoiled = None, None
    return other
