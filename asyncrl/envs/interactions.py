"""Interactions: a simulated user that answers the model when it calls no tool.

Interface (verl-compatible), one object per episode, registered with `@register("interaction", name)`
and constructed as `Cls(config: dict)`:

    await it.start(instance_id, **interaction_kwargs)      # the row's extra_info.interaction_kwargs
    done, text, score, extra = await it.respond(instance_id, messages)
    await it.finish(instance_id)

`text` becomes a user turn (masked 0) unless `done`; `score` is recorded as that turn's reward
(Trajectory.turn_rewards). A row selects its interaction by `extra_info.interaction_kwargs.name`.

Built-in `answer_feedback`: compares the answer in the last assistant message with the ground truth
(`interaction_kwargs.ground_truth`, else the row's) and, when wrong, asks for another try, up to
`max_attempts` answers (default 2). The answer is the text after the last "Answer:" (pattern
`answer_pattern`), else the last number in the message. `compare`: "numeric" (|a - b| <= 1e-6 after
removing thousands separators, "$" and "%"), "string" (case- and whitespace-insensitive), or
"auto" (numeric when both parse as numbers). Score: 1.0 right, 0.0 wrong.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from asyncrl.registry import register


class Interaction:
    name: str = ""

    def __init__(self, config: Optional[dict[str, Any]] = None):
        self.config = dict(config or {})

    async def start(self, instance_id: str, **kwargs: Any) -> str:
        return instance_id

    async def respond(self, instance_id: str, messages: list[dict[str, Any]]) -> tuple[bool, str, float, dict[str, Any]]:
        raise NotImplementedError

    async def finish(self, instance_id: str) -> None:
        return None


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def parse_number(text: str) -> Optional[float]:
    t = str(text).strip().replace(",", "").replace("$", "").rstrip("%").rstrip(".").strip()
    try:
        return float(t)
    except ValueError:
        return None


def extract_answer(text: str, answer_pattern: str = r"answer\s*:\s*(.+)") -> Optional[str]:
    """The text after the last match of `answer_pattern` (first line), else the last number, else None."""
    hits = list(re.finditer(answer_pattern, text, flags=re.IGNORECASE))
    if hits:
        return hits[-1].group(1).strip().splitlines()[0].strip() if hits[-1].group(1).strip() else None
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def answers_match(answer: Optional[str], truth: Any, compare: str = "auto") -> bool:
    if answer is None or truth is None:
        return False
    if compare not in ("auto", "numeric", "string"):
        raise ValueError(f"answer_feedback: compare must be auto|numeric|string, got {compare!r}")
    if compare in ("auto", "numeric"):
        a, b = parse_number(answer), parse_number(str(truth))
        if a is None and compare == "auto":
            nums = _NUMBER.findall(answer)  # "42 apples" -> 42
            a = parse_number(nums[-1]) if nums else None
        if a is not None and b is not None:
            return abs(a - b) <= 1e-6
        if compare == "numeric":
            return False
    return " ".join(answer.lower().split()).rstrip(".") == " ".join(str(truth).lower().split()).rstrip(".")


@register("interaction", "answer_feedback")
class AnswerFeedback(Interaction):
    name = "answer_feedback"

    def __init__(self, config: Optional[dict[str, Any]] = None):
        super().__init__(config)
        self.max_attempts = int(self.config.get("max_attempts", 2))
        self.compare = str(self.config.get("compare", "auto"))
        self.pattern = str(self.config.get("answer_pattern", r"answer\s*:\s*(.+)"))
        self.retry_text = str(self.config.get(
            "retry_text", "Your answer {answer} is incorrect. Check your work and try again. "
                          "End with a line \"Answer: N\"."))
        if self.max_attempts < 1:
            raise ValueError(f"answer_feedback: max_attempts must be >= 1, got {self.max_attempts}")
        self._state: dict[str, dict[str, Any]] = {}

    async def start(self, instance_id: str, **kwargs: Any) -> str:
        self._state[instance_id] = {"ground_truth": kwargs.get("ground_truth"), "attempts": 0}
        return instance_id

    async def respond(self, instance_id: str, messages: list[dict[str, Any]]) -> tuple[bool, str, float, dict[str, Any]]:
        st = self._state[instance_id]
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        answer = extract_answer(last, self.pattern)
        st["attempts"] += 1
        if answers_match(answer, st["ground_truth"], self.compare):
            return True, "Correct.", 1.0, {"attempts": st["attempts"]}
        if st["attempts"] >= self.max_attempts:
            return True, "Incorrect.", 0.0, {"attempts": st["attempts"]}
        shown = answer if answer is not None else "(none found)"
        return False, self.retry_text.format(answer=shown), 0.0, {"attempts": st["attempts"]}

    async def finish(self, instance_id: str) -> None:
        self._state.pop(instance_id, None)
