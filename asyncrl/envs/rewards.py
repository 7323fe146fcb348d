"""Pure answer-extraction and matching functions shared by the built-in envs.

- `parse_number(s)`: "1,234" / "$5" / "7." / "-3.50" -> Decimal, else None.
- `numbers_equal(a, b)`: numeric equality after `parse_number` on both sides ("72.0" == "72").
- `extract_tagged_answer(text)`: "Answer: N" or "the answer is N" (last occurrence, case-insensitive) -> "N".
- `extract_gsm8k(text, method)`: strict = the last "#### N"; flexible = the last number in the text
  (verl's gsm8k rule).
- `normalize_answer(s)` (SQuAD): lower case, drop punctuation, drop articles a/an/the, squeeze spaces.
- `extract_answer_tag(text)`: the content of the last <answer>...</answer>.
- `em(pred, golds)` / `substring_em(pred, golds)`: exact / substring match after normalization
  against one gold or a list of golds.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from typing import Any, Optional

_NUMBER = r"-?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)"


def parse_number(s: Any) -> Optional[Decimal]:
    """A number written with optional $, thousands commas and a trailing period; None if not one."""
    if isinstance(s, bool) or s is None:
        return None
    if isinstance(s, (int, float)):
        return Decimal(str(s))
    t = str(s).strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if not t or t in ("-", "."):
        return None
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


def numbers_equal(pred: Any, gold: Any) -> bool:
    a, b = parse_number(pred), parse_number(gold)
    return a is not None and b is not None and a == b


# "Answer: N", "answer = N", "the answer is N", "answer is: **N**" (case-insensitive)
_ANSWER_LINE = re.compile(r"answer\s*(?:is\s*)?[:=]?\s*[\"'*]*\s*(" + _NUMBER + r")", re.IGNORECASE)


def extract_tagged_answer(text: str) -> Optional[str]:
    """The number stated as the answer ("Answer: N", "the answer is N") at its last occurrence, or None."""
    found = _ANSWER_LINE.findall(text or "")
    return found[-1] if found else None


_STRICT = re.compile(r"####\s*(" + _NUMBER + r")")
_FLEX = re.compile(_NUMBER)


def extract_gsm8k(text: str, method: str = "strict") -> Optional[str]:
    """strict: the number after the last '####'; flexible: the last number anywhere in `text`."""
    if method == "strict":
        found = _STRICT.findall(text or "")
    elif method == "flexible":
        found = [m for m in _FLEX.findall(text or "") if parse_number(m) is not None]
    else:
        raise ValueError(f"gsm8k extraction method {method!r} is not one of strict, flexible")
    return found[-1] if found else None


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower, remove punctuation, remove articles (a, an, the), squeeze whitespace."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer_tag(text: str) -> Optional[str]:
    """The content of the last <answer>...</answer> in `text`, or None."""
    found = _ANSWER_TAG.findall(text or "")
    return found[-1].strip() if found else None


def _golds(golds: Any) -> list[str]:
    if isinstance(golds, dict) and "target" in golds:  # Search-R1's ground_truth {"target": [...]}
        golds = golds["target"]
    if isinstance(golds, (str, int, float)):
        return [str(golds)]
    return [str(g) for g in (golds if isinstance(golds, Iterable) else [golds])]


def em(pred: Optional[str], golds: Any) -> bool:
    """Exact match after normalization against any gold answer."""
    if pred is None:
        return False
    p = normalize_answer(pred)
    return any(p == normalize_answer(g) for g in _golds(golds))


def substring_em(pred: Optional[str], golds: Any) -> bool:
    """True if a normalized gold answer occurs inside the normalized prediction (a non-empty one)."""
    if pred is None:
        return False
    p = normalize_answer(pred)
    return any((g := normalize_answer(gold)) and g in p for gold in _golds(golds))
