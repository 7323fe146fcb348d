"""ChatFormat: tools through a tools-aware template, hermes text otherwise, and loud failure on
templates whose deltas cannot be rendered."""

from __future__ import annotations

import copy

import pytest

from asyncrl.agents.chat import ChatFormat, hermes_tools_text

SCHEMA = {"type": "function", "function": {"name": "calculator", "description": "math",
                                            "parameters": {"type": "object", "properties": {}}}}

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def tok(tokenizer):
    return copy.deepcopy(tokenizer)


def test_tools_aware_template_gets_the_schemas(tok):
    tok.chat_template = TOOLS_TEMPLATE
    chat = ChatFormat(tok, tools=[SCHEMA])
    assert chat.supports_tools
    msgs = chat.prompt_messages([{"role": "user", "content": "hi"}])
    assert msgs == [{"role": "user", "content": "hi"}]  # nothing injected: the template renders the tools
    assert chat.render(msgs, True) == "<|im_start|>system\nTOOLS: calculator<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.delta_text([{"role": "tool", "content": "7"}], [5, im_end]) == \
        "\n<|im_start|>user\n<tool_response>7</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_template_without_tools_gets_hermes_text_in_the_system_message(tokenizer):
    chat = ChatFormat(tokenizer, tools=[SCHEMA], system_prompt="Be brief.")
    assert not chat.supports_tools
    msgs = chat.prompt_messages([{"role": "system", "content": "Row system."}, {"role": "user", "content": "hi"}])
    assert msgs[0] == {"role": "system", "content": "Row system.\n\n" + hermes_tools_text([SCHEMA])}
    msgs = chat.prompt_messages([{"role": "user", "content": "hi"}])
    assert msgs[0] == {"role": "system", "content": "Be brief.\n\n" + hermes_tools_text([SCHEMA])}
    assert ChatFormat(tokenizer).prompt_messages([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]


def test_closing_after_a_cut_generation(tokenizer):
    chat = ChatFormat(tokenizer)
    assert chat.closing == "<|im_end|>\n"
    assert chat.closing_rest([5, 2]) == "\n" and chat.closing_rest([5, 6]) == "<|im_end|>\n" and chat.closing_rest([]) == "<|im_end|>\n"


def test_non_append_only_template_fails_loudly(tok):
    tok.chat_template = ("{{ messages|length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="not append-only for an assistant turn"):
        ChatFormat(tok)
    # a template that rewrites past assistant turns (as thinking-stripping templates do)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not loop.last %}"
                         "(old) {% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = ChatFormat(tok)
    with pytest.raises(ValueError, match="re-renders earlier turns"):
        chat.delta_text([{"role": "user", "content": "x"}], [2])
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        ChatFormat(tok)
