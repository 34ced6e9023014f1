"""The verdict page's token texts come from the run's own open model file when it is the receipt's
(issue 47: opening a 248,320-token GGUF again parsed every key, 0.2 s of a 2,048-position run)."""

from __future__ import annotations

from harness.fixtures import synthetic as fx
from harness.model.gguf_model import GGUFModel
from harness.runs import explain


def test_the_runs_open_model_is_used_when_path_and_sha256_are_the_receipts(monkeypatch):
    gm = GGUFModel(fx.build("tiny-qwen35"))
    record = {"path": str(gm.path), "sha256": gm.sha256, "name": "fixture:tiny-qwen35"}
    opened = []
    real = explain.GGUFModel
    monkeypatch.setattr(explain, "GGUFModel", lambda *a, **k: opened.append(a) or real(*a, **k))
    vocab, why = explain.vocabulary(record, gm)
    assert vocab is not None and why == "" and not opened  # no second parse of the file
    assert vocab.tokens[5] == gm.token_texts[5]
    # another file's sha256: the receipt's own file is looked up and opened, never the run's model
    vocab, why = explain.vocabulary({**record, "sha256": "0" * 64}, gm)
    assert vocab is None and "no longer has the receipt's sha256" in why and not opened
    vocab, _ = explain.vocabulary(record, None)
    assert vocab is not None and len(opened) == 1
