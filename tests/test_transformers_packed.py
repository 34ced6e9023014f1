"""Packed sequences in the transformers engine (issue 50, item 4): several sequences in one row,
position ids restarting per sequence and ``cu_seq_lens_q/k`` (as transformers'
``DataCollatorWithFlattening`` packs them), each judged against its solo run by the ``multiseq``
probe (``harness.engines.transformers_engine``, ``logits_multi``).

``pack_sequences`` is checked with NumPy alone. The tests marked ``hf`` need the hf extra (torch,
transformers; ``pip install -e .[hf]``, then ``pytest -m hf tests/test_transformers_packed.py``);
without it they are not collected by the default run. Measured with transformers 5.25.0 on CPU:
given ``cu_seqlens`` its PyTorch fallback of the gated delta rule refuses packed sequences, so the
probe is UNMEASURED naming the refusal; given the position ids alone it runs the row as one
sequence and the probe FAILs (the state carried across each boundary), a real engine's bug the
probe has to catch.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness.errors import Verdict
from harness.fixtures import synthetic as fx
from harness.runs.probe_types import ProbeTolerance

F32_PROBE = ProbeTolerance(min_cosine=1 - 1.3e-5, max_kld=1.6e-3)
"""The f32 class's probe row (thresholds.yaml ``probes``; harness.runs.probes.DECODE_TOKENS)."""


def test_sequences_are_packed_into_one_row_with_restarting_positions_and_cu_seqlens():
    from harness.engines.transformers_engine import pack_sequences

    ids, pos, cu = pack_sequences([[5, 6, 7], [8, 9], [10]])
    assert ids.tolist() == [5, 6, 7, 8, 9, 10] and ids.dtype == np.int64
    assert pos.tolist() == [0, 1, 2, 0, 1, 0] and cu.tolist() == [0, 3, 5, 6] and cu.dtype == np.int32


def _prompts(n_vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(0, n_vocab, n)] for n in (70, 45, 90)]


@pytest.fixture(scope="module")
def path():
    pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
    return fx.build("trained-qwen35")


@pytest.mark.hf
def test_packed_with_cu_seqlens_is_unmeasured_where_transformers_refuses_it(path):
    from harness.engines.transformers_engine import load_transformers
    from harness.runs.probes import probe_multiseq

    eng = load_transformers(path)
    assert "multi_seq" in eng.info.capabilities and "cu_seq_lens" in eng.info.settings["multi_seq"]
    r = probe_multiseq(eng, _prompts(eng.n_vocab), F32_PROBE)
    assert r.verdict is Verdict.UNMEASURED and "refuses packed sequences" in r.reason and "flash-linear-attention" in r.reason, r.reason


@pytest.mark.hf
def test_packed_by_position_ids_alone_leaks_state_across_sequences_and_the_probe_fails(path):
    from harness.engines.base import gather
    from harness.engines.transformers_engine import load_transformers
    from harness.measure.metrics import cosine
    from harness.runs.probes import probe_multiseq

    eng = load_transformers(path, packed="position_ids")
    seqs = _prompts(eng.n_vocab)
    packed = gather(eng.logits_multi(seqs), sum(map(len, seqs)))
    first = cosine(gather(eng.logits(seqs[0]), 70), packed[:70])
    third = cosine(gather(eng.logits(seqs[2]), 90), packed[115:])
    assert first.min() > 1 - 1e-6  # nothing before it in the row
    assert third[0] < 0.9  # its row 0 follows the second sequence's state
    r = probe_multiseq(eng, seqs, F32_PROBE)
    bad = [c.label for c in r.comparisons if not c.ok]
    assert r.verdict is Verdict.FAIL and "distinct prompt 0 beside 2 others" not in bad, bad
    assert "identical copy 1 of 3" in bad and "distinct prompt 2 beside 2 others" in bad
