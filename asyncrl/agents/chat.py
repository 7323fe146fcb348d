"""Chat-template rendering for token-in/token-out agent loops.

The prompt is rendered once by the tokenizer's chat template and tokenized once. After that the
trajectory only grows: generated ids are kept exactly as the engine produced them, and each block
of messages inserted between turns (tool results, user turns) is rendered as a *delta* and
tokenized once:

    closing = the template's text after an assistant message's content ("<|im_end|>\\n" in ChatML)
    delta   = render(P + [assistant "\\x00"] + new, add_generation_prompt=True)
              - render(P + [assistant "\\x00"])               (P: a fixed dummy system+user prefix)
    inserted text = closing[len(stop):] + delta

where `stop` is the text of the stop token the generation ended with ("<|im_end|>", already in the
trajectory as a generated token), or "" when the generation was cut (then the whole closing is
inserted). Generated text is never re-tokenized, so templates that are not append-only cannot
make the ids drift.

Tools go into the prompt the way the template does it (`apply_chat_template(..., tools=schemas)`)
when its source mentions `tools`; otherwise (e.g. SmolLM2's ChatML template) as hermes-style text
appended to the system message (`hermes_tools_text`: the hermes parser plugin's `tools_text`, found in the
registry; the parser owns its format's spelling).
"""

from __future__ import annotations

from typing import Any, Optional

from asyncrl import registry

_MARK = "\x00"
_PREFIX = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
DEFAULT_SYSTEM = "You are a helpful assistant."


def hermes_tools_text(schemas: list[dict[str, Any]]) -> str:
    """The tool instructions of hermes-style templates (as in Qwen2.5's), for templates without tools: the
    hermes parser's (`tools_text`; the parser plugin owns the format's spelling)."""
    return registry.get("tool_parser", "hermes").tools_text(schemas)


class ChatFormat:
    def __init__(self, tokenizer: Any, tools: Optional[list[dict[str, Any]]] = None,
                 system_prompt: Optional[str] = None, system_suffix: Optional[str] = None):
        """`tools`: OpenAI schemas for the template (or hermes text); `system_suffix`: extra system text
        (e.g. the ReAct instructions) appended to the system message."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template")
        self.tok = tokenizer
        self.tools = list(tools or [])
        self.supports_tools = "tools" in tokenizer.chat_template
        self.system_prompt = system_prompt
        extra = []
        if self.tools and not self.supports_tools:
            extra.append(hermes_tools_text(self.tools))
        if system_suffix:
            extra.append(system_suffix)
        self.system_extra = "\n\n".join(extra)
        base = self.render(_PREFIX + [{"role": "assistant", "content": _MARK}])
        head = self.render(_PREFIX, add_generation_prompt=True)
        if not base.startswith(head) or _MARK not in base[len(head):]:
            raise ValueError("chat template is not append-only for an assistant turn; cannot render deltas")
        self.closing = base.split(_MARK, 1)[1]
        self._base = base

    # ------------------------------------------------------------------ rendering

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        kw = {"tools": self.tools} if self.tools and self.supports_tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The episode's opening messages: the row's, with the configured system prompt and any
        tool/ReAct instructions merged into the (possibly new) system message."""
        msgs = [dict(m) for m in messages]
        has_system = bool(msgs) and msgs[0].get("role") == "system"
        if not has_system and (self.system_prompt or self.system_extra):
            msgs.insert(0, {"role": "system", "content": self.system_prompt or DEFAULT_SYSTEM})
        if self.system_extra:
            msgs[0]["content"] = (str(msgs[0].get("content") or "") + "\n\n" + self.system_extra).strip()
        return msgs

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def stop_token_ids(self) -> list[int]:
        ids = []
        for t in ("<|im_end|>",):
            i = self.tok.convert_tokens_to_ids(t)
            if isinstance(i, int) and i != self.tok.unk_token_id and i >= 0:
                ids.append(i)
        if self.tok.eos_token_id is not None and self.tok.eos_token_id not in ids:
            ids.append(self.tok.eos_token_id)
        return ids

    # ------------------------------------------------------------------ deltas

    def closing_rest(self, generated_ids: list[int]) -> str:
        """What must follow the generated ids to close the assistant turn as the template would."""
        if generated_ids:
            last = self.tok.decode([generated_ids[-1]], skip_special_tokens=False)
            if last and self.closing.startswith(last) and generated_ids[-1] in self.stop_token_ids():
                return self.closing[len(last):]
        return self.closing

    def delta_text(self, new_messages: list[dict[str, Any]], generated_ids: list[int],
                   add_generation_prompt: bool = True) -> str:
        """Text to insert after an assistant turn ending in `generated_ids`, adding `new_messages`
        and opening the next assistant turn."""
        full = self.render(_PREFIX + [{"role": "assistant", "content": _MARK}] + list(new_messages),
                           add_generation_prompt=add_generation_prompt)
        if not full.startswith(self._base):
            raise ValueError("chat template re-renders earlier turns when messages are added; cannot render deltas")
        return self.closing_rest(generated_ids) + full[len(self._base):]

    def delta_ids(self, new_messages: list[dict[str, Any]], generated_ids: list[int]) -> list[int]:
        return self.encode(self.delta_text(new_messages, generated_ids))
