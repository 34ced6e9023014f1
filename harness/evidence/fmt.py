"""Numbers and positions written for a person: rounded to what their noise supports.

- Cosines close to 1 are written as ``1 − 3.2e-08`` (two significant digits of 1 − cos, the
  part that carries information; float32 logits put the noise floor near 1e-8); others with four
  decimals. A threshold is written as configured (``:g``) beside the same form.
- KLD (nats), NMSE and absolute differences: two significant digits.
- Rates: a percentage with its Wilson 95% interval, with as many decimals as keep a value that
  is not exactly 0 or 1 from printing as 0% or 100%.
- Positions: ``prompt 'code-python', position 23 (token 49 ' the')`` with the token text taken
  from the model's GGUF vocabulary (``harness.model.vocab``, looked up by the caller) and escaped.

Nothing here prints a Python repr, ``None`` or ``nan``: missing values are ``n/a``.
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any, Mapping, Protocol

from harness.evidence.page import Code, Inline

NA = "n/a"
MINUS = "\u2212"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def cosine(c: Any) -> str:
    """A cosine: ``1 − 3.2e-08`` when 1 − c < 1e-3, ``1`` when exactly 1, else ``0.9649``."""
    if c is None:
        return NA
    if not _finite(c):
        return "non-finite"
    d = 1.0 - float(c)
    if d == 0:
        return "1"
    if 0 < d < 1e-3:
        return f"1 {MINUS} {d:.1e}"
    return f"{float(c):.4f}"


def cosine_threshold(v: Any) -> str:
    """A cosine threshold as configured and, when close to 1, as ``1 − d``: ``0.999999 (1 − 1e-06)``."""
    if not _finite(v):
        return NA
    d = 1.0 - float(v)
    s = f"{float(v):g}"
    return f"{s} (1 {MINUS} {d:.2g})" if 0 < d < 1e-2 else s


def sig2(x: Any) -> str:
    """Two significant digits (KLD in nats, NMSE, |Δ|); ``0`` for zero."""
    if x is None:
        return NA
    if not _finite(x):
        return "non-finite"
    if x == 0:
        return "0"
    return f"{float(x):.2g}"


kld = sig2


def number(x: Any) -> str:
    """A configured value (threshold, margin) as written: ``:g`` (at most 6 significant digits)."""
    if x is None:
        return NA
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if not _finite(x):
        return "non-finite"
    return f"{float(x):g}"


def percent(x: Any) -> str:
    """A rate in [0, 1] as a percentage; never rounds a value short of 1 (or above 0) to 100% (0%)."""
    if not _finite(x):
        return NA
    x = float(x)
    if x in (0.0, 1.0):
        return f"{x * 100:.0f}%"
    for d in range(1, 6):
        s = f"{x * 100:.{d}f}"
        if float(s) not in (0.0, 100.0):
            return f"{s}%"
    return f"{x * 100:.2g}%"


def rate(r: Any, lo: Any = None, hi: Any = None) -> str:
    """``93.2% [91.8%, 94.4%]`` (the interval when given)."""
    if not _finite(r):
        return NA
    return percent(r) + (f" [{percent(lo)}, {percent(hi)}]" if _finite(lo) and _finite(hi) else "")


def count(n: Any, of: Any = None) -> str:
    """``1473 of 1479 (99.6%)`` or ``12``."""
    if n is None:
        return NA
    if of:
        return f"{n} of {of} ({percent(n / of)})"
    return str(n)


def when(iso: Any) -> str:
    """``2026-11-29 22:53 UTC`` from an ISO-8601 UTC time (the text as given if it is not one)."""
    s = str(iso or "")
    if len(s) >= 16 and s[10] == "T":
        return f"{s[:10]} {s[11:16]} UTC"
    return s or NA


def quoted(text: str) -> str:
    """``text`` in single quotes with backslash, quote and non-printable characters escaped
    (``\\n``, ``\\x1b``, ``\\u202e``): unambiguous, one line."""
    out = []
    for ch in str(text):
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # a byte that is not UTF-8 (surrogateescape)
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch in "\\'":
            out.append("\\" + ch)
        elif ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif not ch.isprintable() or unicodedata.category(ch) in ("Zl", "Zp", "Cf"):
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
        else:
            out.append(ch)
    return "'" + "".join(out) + "'"


# ----------------------------------------------------------------------------- positions


class TokenTexts(Protocol):
    """What a page needs of a vocabulary (``harness.model.vocab.Vocab``): ``raw(token_id)``, the
    decoded text (bytes that are not UTF-8 as surrogate escapes) or None outside it."""

    def raw(self, token_id: int) -> str | None: ...


def token_text(vocab: TokenTexts | None, token_id: int) -> str | None:
    """A token's text quoted and escaped (``' the'``), or None without a vocabulary entry."""
    raw = vocab.raw(int(token_id)) if vocab is not None else None
    return None if raw is None else quoted(raw)


def position(where: Mapping[str, Any] | None, vocab: TokenTexts | None) -> list[Inline]:
    """``prompt 'code-python', position 23 (token 49 ' the')`` as inline content (token text as
    code). ``where`` is a receipt's ``{prompt, position, token}``."""
    if not where:
        return [NA]
    out: list[Inline] = [f"prompt {quoted(where['prompt'])}, position {where['position']}"]
    tok = where.get("token")
    if tok is None:
        return out
    text = token_text(vocab, tok)
    if text is None:
        return out + [f" (token {tok})"]
    return out + [f" (token {tok} ", Code(text), ")"]


def position_text(where: Mapping[str, Any] | None, vocab: TokenTexts | None) -> str:
    """``position`` as one plain string (for terminals and plot titles)."""
    parts = position(where, vocab)
    return "".join(p.text if isinstance(p, Code) else str(p) for p in parts)


def signed_percent(x: Any) -> str:
    """A probability difference (Δp) as a signed percentage with two significant digits:
    ``+0.0012%``, ``−3.4%``, ``0%``."""
    if x is None:
        return NA
    if not _finite(x):
        return "non-finite"
    if x == 0:
        return "0%"
    s = f"{100 * float(x):+.2g}%"
    return MINUS + s[1:] if s[0] == "-" else s  # the sign only: an exponent keeps its hyphen


def ratio(r: Any) -> str:
    """A ratio near 1 (PPL(candidate) / PPL(reference)): ``1 + 2.5e-06`` / ``1 − 2.5e-06`` (two
    significant digits of the difference, as cosines are written) while |r − 1| < 1e-3, ``1`` when
    exactly 1, else six significant digits (``1.00343``)."""
    if r is None:
        return NA
    if not _finite(r):
        return "non-finite"
    d = float(r) - 1.0
    if d == 0:
        return "1"
    if abs(d) < 1e-3:
        return f"1 {'+' if d > 0 else MINUS} {abs(d):.1e}"
    return f"{float(r):.6g}"


def perplexity_text(ppl: Mapping[str, Any] | None) -> str:
    """A receipt's ``report_only.perplexity`` in one line: ``PPL reference 3.1416, candidate
    3.1417, ratio 1 + 2.1e-05 (ln ratio 2.1e-05 ± 3e-06) over 96 positions`` (``ratio``);
    ``unmeasured (no position scored)`` when None."""
    if not ppl:
        return "unmeasured (no position scored)"
    sem = ppl.get("ln_ratio_sem")
    return (f"PPL reference {number(ppl.get('reference'))}, candidate {number(ppl.get('candidate'))}, "
            f"ratio {ratio(ppl.get('ratio'))} "
            f"(ln ratio {sig2(ppl.get('ln_ratio'))}" + (f" ± {sig2(sem)}" if sem is not None else "") + f") over {ppl.get('positions')} positions")


def delta_p_text(dp: Mapping[str, Any] | None) -> str:
    """A ``delta_p`` summary in one line: mean ± standard error, RMS, then p1 / p50 / p99 and min /
    max, as signed percentages; ``unmeasured (no position scored)`` when None."""
    if not dp:
        return "unmeasured (no position scored)"
    sem = dp.get("sem")
    return (f"mean {signed_percent(dp.get('mean'))}" + (f" ± {sig2(None if sem is None else 100 * sem)}%" if sem is not None else "")
            + f", RMS {sig2(None if dp.get('rms') is None else 100 * dp['rms'])}%, p1 / p50 / p99 "
            + " / ".join(signed_percent(dp.get(k)) for k in ("p1", "p50", "p99"))
            + f", min / max {signed_percent(dp.get('min'))} / {signed_percent(dp.get('max'))} over {dp.get('positions')} positions")
