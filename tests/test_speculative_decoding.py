"""The oracle's speculative decoder (harness/engines/oracle/speculative.py) on partly accepted drafts.

The tiny MTP fixture's random head drafts nothing right, so the accept path is driven here by a
drafter that proposes plain greedy's own next tokens with every third one wrong: the continuation
must still equal plain greedy, and the counts must show accepted and rejected drafts."""

from __future__ import annotations

from harness.engines.oracle.qwen35 import Qwen35Oracle
from harness.engines.oracle.speculative import SpecDecoder, new_decoder, speculate
from harness.fixtures.resolve import resolve_model


def test_partly_accepted_drafts_equal_plain_greedy():
    o = Qwen35Oracle(resolve_model("fixture:tiny-qwen35-mtp"))
    prompt = list(range(5, 45))
    plain = o.generate(prompt, 14)

    class Oracular(SpecDecoder):
        def draft(self, t, k):
            at = len(self.history) - len(prompt) + 1  # index in plain of the token after t
            out = [plain[at + i] if at + i < len(plain) else 0 for i in range(k)]
            if k >= 3:
                out[2] = (out[2] + 1) % o.n_vocab  # the third draft wrong: two accepted, one rejected
            return out

    s = speculate(new_decoder(o, Oracular), prompt, 14, 3)
    assert s.tokens == plain
    assert sum(s.accepted) >= 6 and sum(s.rejected) >= 2, (s.accepted, s.rejected)
    assert s.step_of(0) is None and s.step_of(1) == 0
