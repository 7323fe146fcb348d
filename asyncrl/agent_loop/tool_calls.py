"""What a tool-call parser returns (parsers are plugins of kind "tool_parser"; see asyncrl/agents/parsers.py).

A call that cannot be understood is still a `ToolCall`, with `error` set ("invalid_json"), so the
loop can tell the model and count it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ToolCall:
    name: str
    arguments: Optional[dict[str, Any]]  # None when they could not be parsed
    error: Optional[str] = None  # "invalid_json" when the call could not be parsed
    raw: str = ""  # the call's text as the model wrote it


@dataclass
class Parsed:
    content: str  # the text without the tool-call blocks
    calls: list[ToolCall] = field(default_factory=list)
    final_answer: Optional[str] = None  # react only
