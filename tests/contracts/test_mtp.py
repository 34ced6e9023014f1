"""Bound tests of contracts/qwen35-mtp-v1.yaml: the candidate's MTP (nextn) draft head.

Teacher-forced draft logits (``Engine.draft``: row t is the head's logits for tokens[t+2]) against
llama.cpp's own MTP context driven in the candidate's ``mtp_convention`` (``harness.runs.mtp``),
the hidden states the head was fed against the candidate's own trunk logits, a chunked prefill
against the whole prompt, and sequences drafted together against each alone. Subjects:
``candidate_engine``, ``reference_engine`` on ``harness_model_path`` (a file with a nextn block).
Each tolerance is the one the contract states (``tolerance``).
"""

from __future__ import annotations

import numpy as np
import pytest
from contract_helpers import MTP_RUN, PROBE_SEED

from harness.engines.base import MTP_CHAIN, gather
from harness.measure import metrics
from harness.runs.mtp import convention_of, reference_drafts

pytestmark = pytest.mark.contract

N_TOKENS = 64
PIECES = [23, 1, 40]
"""A prefill of 23 tokens, one decode step, then the rest: the head's KV must carry over both."""


@pytest.fixture(scope="module")
def tokens(harness_model_path) -> list[int]:
    from harness.model.gguf_model import GGUFModel

    n_vocab = int(GGUFModel(harness_model_path).tensor_info("token_embd.weight").ne[1])
    return np.random.default_rng(PROBE_SEED + 27).integers(0, n_vocab, N_TOKENS).tolist()


@pytest.fixture(scope="module")
def drafts(candidate_engine):
    if "mtp" not in candidate_engine.info.capabilities:
        pytest.skip(f"{candidate_engine.info.name} does not declare 'mtp' (the model needs a nextn block): the obligation is unmeasured for it; "
                    f"checked with: {MTP_RUN}")
    return candidate_engine


_REFERENCE: dict[tuple, object] = {}


def _reference(engine, tokens: tuple[int, ...], conv: str):
    """The reference's drafts, once per engine and tokens for the session: the matrix runs every
    mutant against the same reference rows."""
    key = (id(engine), tokens, conv)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_drafts(engine, conv).draft(list(tokens))
    return _REFERENCE[key]


def _convention(engine, tokens) -> str:
    """The candidate's ``mtp_convention``: a protocol-2 engine states it in its first draft
    reply's info.json, so one short draft is asked for when it has not replied yet."""
    if (engine.info.settings or {}).get("mtp_convention") is None:
        engine.draft(tokens[:3])
    return convention_of(engine)


def _min_cosine(ref: np.ndarray, cand: np.ndarray) -> float:
    return float(np.nanmin(np.where(np.isfinite(c := metrics.cosine(ref, cand)), c, -np.inf)))


def test_draft_logits_match_the_reference(drafts, reference_engine, tokens, where, tolerance):
    """QMTP-DRAFT-001: every draft row's cosine against llama.cpp's MTP context ≥ min_cosine."""
    tol = tolerance("QMTP-DRAFT-001")
    conv = _convention(drafts, tokens)
    ref = _reference(reference_engine, tuple(tokens), conv)
    cand = drafts.draft(tokens)
    assert cand.logits.shape == ref.logits.shape == (len(tokens) - 1, reference_engine.n_vocab)
    worst = _min_cosine(ref.logits, cand.logits)
    assert worst >= tol["cosine"], f"draft logits min cosine {worst:.8f} < {tol['cosine']} ({where})"


def test_hidden_state_is_post_norm(drafts, subject_model, tokens, where, tolerance):
    """QMTP-HID-002: output · h_t reproduces the candidate's own trunk logits row t."""
    tol = tolerance("QMTP-HID-002")
    d = drafts.draft(tokens)
    if d.hidden is None:
        pytest.skip("the candidate returns no hidden states")
    w = subject_model.tensor("output.weight" if subject_model.has_tensor("output.weight") else "token_embd.weight")
    trunk = gather(drafts.logits(tokens), len(tokens))
    worst = _min_cosine(trunk, np.asarray(d.hidden, np.float64) @ w.T)
    assert worst >= tol["cosine"], f"output · h_t vs trunk logits: min cosine {worst:.8f} < {tol['cosine']} ({where})"


def test_chunked_prefill_equals_whole(drafts, tokens, where, tolerance):
    """QMTP-CHUNK-003: draft logits with the prompt fed as PIECES equal the prompt fed whole."""
    tol = tolerance("QMTP-CHUNK-003")
    if "chunks" not in drafts.info.capabilities:
        pytest.skip(f"the candidate does not declare 'chunks'; checked with: {MTP_RUN}")
    whole = drafts.draft(tokens).logits
    pieces = drafts.draft(tokens, PIECES).logits
    worst = _min_cosine(whole, pieces)
    assert worst >= tol["cosine"], f"chunked {PIECES} vs whole: min cosine {worst:.8f} < {tol['cosine']} ({where})"


def test_sequences_drafted_together_equal_each_alone(drafts, tokens, where, tolerance):
    """QMTP-SEQ-004: two sequences drafted together give each one's solo draft logits."""
    tol = tolerance("QMTP-SEQ-004")
    if not callable(getattr(drafts, "draft_multi", None)):
        pytest.skip("the candidate has no draft_multi")
    seqs = [tokens[:40], tokens[10:]]
    together = drafts.draft_multi(seqs)
    for i, q in enumerate(seqs):
        worst = _min_cosine(drafts.draft(q).logits, together[i].logits)
        assert worst >= tol["cosine"], f"sequence {i} drafted beside another: min cosine {worst:.8f} ({where})"


def test_chained_drafts_match_the_reference_at_depth_2(drafts, reference_engine, tokens, where, tolerance):
    """QMTP-CHAIN-012: every depth-2 draft row's cosine against llama.cpp's chained drafts ≥
    min_cosine, the candidate given llama.cpp's step-1 draft tokens."""
    tol = tolerance("QMTP-CHAIN-012")
    if MTP_CHAIN not in drafts.info.capabilities:
        pytest.skip(f"{drafts.info.name} does not declare '{MTP_CHAIN}' (no chained drafts); checked with: {MTP_RUN}")
    conv = _convention(drafts, tokens)
    ref = reference_drafts(reference_engine, conv).chain_many([(tokens, None)])[0]
    cand = drafts.draft_chain(tokens, [int(x) for x in ref.tokens])
    assert cand.logits2.shape == ref.logits2.shape == (len(tokens) - 1, reference_engine.n_vocab)
    c = metrics.cosine(ref.logits2, cand.logits2)
    row = int(np.argmin(np.where(np.isfinite(c), c, -np.inf)))
    worst = _min_cosine(ref.logits2, cand.logits2)
    assert worst >= tol["cosine"], f"depth-2 draft logits min cosine {worst:.8f} < {tol['cosine']} at row {row} ({where})"
