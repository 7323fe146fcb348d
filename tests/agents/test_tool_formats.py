"""Tool-call formats: each parser reads back a tool call rendered by its family's chat template through
transformers' apply_chat_template; `agent.tool_parser=auto` picks the parser from the template; hostile
model output is an invalid call, never an exception; tool arguments are checked against the full JSON
Schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from asyncrl.agents.parsers import (
    DeepSeekV3Parser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Qwen3Parser,
    ReactParser,
)
from asyncrl.agents.tool_calls import UnknownToolFormat, parser_for_template, resolve_parser
from asyncrl.tools.base import SchemaDefinitionError, check_parameters_schema, validate_arguments

TEMPLATES = Path(__file__).parent / "chat_templates"
# template file -> (the parser auto must choose, the end-of-turn text the engine stops at)
FAMILIES = {
    "qwen2_5": ("hermes", "<|im_end|>\n"),
    "qwen3": ("qwen3", "<|im_end|>\n"),
    "llama3_1": ("llama3_json", ""),
    "mistral_v3": ("mistral", ""),
    "mistral_v11": ("mistral", ""),
    "deepseek_v3": ("deepseek_v3", ""),
    "deepseek_v3_1": ("deepseek_v3", ""),
}
CALLS = [{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)", "precision": 2}},
         {"name": "search", "arguments": {"query": "capital of \"Freedonia\"", "filters": {"years": [1990, 2000]}}}]


@pytest.fixture()
def templated(tokenizer):
    """The tests' real tokenizer, its chat template swapped per case (put back afterwards)."""
    saved = tokenizer.chat_template
    yield tokenizer
    tokenizer.chat_template = saved


def _generated(tok, family: str, calls: list[dict]) -> str:
    """What the model generates for an assistant turn holding `calls`: the rendering of the conversation
    with that turn, less the rendering of the prompt before it."""
    tok.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    before = [{"role": "user", "content": "What is 12 * (3 + 4)?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{i:05d}", "type": "function", "function": c} for i, c in enumerate(calls)]}
    prompt = tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(before + [turn], tokenize=False)
    assert full.startswith(prompt), (family, prompt, full)
    return full[len(prompt):]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_parser_reads_back_calls_its_familys_template_rendered_and_auto_picks_it(templated, family):
    name, end_of_turn = FAMILIES[family]
    for calls in (CALLS[:1], CALLS):
        text = _generated(templated, family, copy.deepcopy(calls)).removesuffix(end_of_turn)
        parser = resolve_parser("auto", templated)
        assert type(parser) is type(resolve_parser(name)), family
        parsed = parser.parse(text)
        assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
            (c["name"], c["arguments"], None) for c in calls], (family, text)
        assert parsed.content == "", (family, parsed.content)


def test_content_and_thinking_are_kept_apart_from_calls():
    p = Qwen3Parser().parse('<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call></think>\n\nSure.'
                            '\n<tool_call>\n{"name": "calc", "arguments": {"e": "1"}}\n</tool_call>')
    assert p.content == "Sure." and [(c.name, c.arguments) for c in p.calls] == [("calc", {"e": "1"})]
    # the template opened <think> in the prompt: the response starts inside the thinking
    p = Qwen3Parser().parse('still thinking</think>\n\n<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert [c.name for c in p.calls] == ["a"] and p.content == ""
    assert Llama3JsonParser().parse("The answer is 84.").calls == []
    p = Llama3JsonParser().parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert [(c.name, c.arguments) for c in p.calls] == [("f", {"a": 1}), ("g", {})]
    p = MistralParser().parse('Let me check.[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}</s>')
    assert p.content == "Let me check." and [(c.name, c.arguments) for c in p.calls] == [("f", {"a": 1}), ("g", {})]
    p = DeepSeekV3Parser().parse("I will search.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>q<｜tool▁sep｜>{\"k\": 2}"
                                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert p.content == "I will search." and [(c.name, c.arguments) for c in p.calls] == [("q", {"k": 2})]


HOSTILE = [
    '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": Infinity}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * (1 << 21) + '"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}} trailing garbage</tool_call>',
    '<tool_call><tool_call>{"name": "f"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}',
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": NaN}"}</tool_call>',
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_model_output_is_an_invalid_call_never_an_exception(text):
    for parser in (HermesParser(), Qwen3Parser()):
        calls = parser.parse(text).calls
        assert calls and all(c.error == "invalid_json" and c.arguments is None for c in calls), calls[:1]
    for parser, wrapped in ((Llama3JsonParser(), text.removeprefix("<tool_call>").removesuffix("</tool_call>")),
                            (MistralParser(), "[TOOL_CALLS]" + text.removeprefix("<tool_call>")),
                            (DeepSeekV3Parser(), "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>"
                             + text.removeprefix('<tool_call>{"name": "f", "arguments": ')),
                            (ReactParser(), "Action: f\nAction Input: " + text)):
        parsed = parser.parse(wrapped)  # must not raise
        assert all(c.arguments is None or json.dumps(c.arguments, allow_nan=False) for c in parsed.calls)


def test_auto_names_the_markers_it_looked_for_when_a_template_has_none(templated):
    templated.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(UnknownToolFormat) as e:
        resolve_parser("auto", templated)
    assert "[TOOL_CALLS]" in str(e.value) and "<tool_call> + <think>" in str(e.value) and "hermes" in str(e.value)
    assert parser_for_template(None) is None


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["query", "filters"],
          "properties": {"query": {"type": "string", "maxLength": 50},
                         "filters": {"type": "object", "required": ["years"], "additionalProperties": False,
                                     "properties": {"years": {"type": "array", "maxItems": 3,
                                                              "items": {"type": "integer", "minimum": 1900}},
                                                    "lang": {"enum": ["en", "de"]}}}}}


def test_arguments_are_checked_against_the_full_schema_with_the_path_of_each_bad_value():
    assert validate_arguments(SCHEMA, {"query": "q", "filters": {"years": [1990]}}) == []
    got = validate_arguments(SCHEMA, {"query": "q", "filters": {"years": [1990, 1800, "x"], "lang": "fr", "zz": 1}})
    assert "argument 'filters.years[1]': 1800 is less than the minimum of 1900" in got
    assert "argument 'filters.years[2]' must be of type integer, got str 'x'" in got
    assert "argument 'filters.lang' must be one of ['en', 'de'], got 'fr'" in got
    assert "unknown argument 'zz' in 'filters' (expected: years, lang)" in got
    assert validate_arguments(SCHEMA, {"query": "q", "filters": {}}) == ["missing required argument 'filters.years'"]
    huge = validate_arguments(SCHEMA, {"query": "q" * 10_000, "filters": {"years": list(range(2000, 12000))}})
    assert len(huge) == 2 and all(len(p) < 300 for p in huge), huge
    assert validate_arguments(SCHEMA, {"query": float("nan"), "filters": {"years": []}}) == [
        "argument 'query' is not a finite number (JSON has no NaN or Infinity)"]
    deep: dict = {}
    node = deep
    for _ in range(50_000):
        node["a"] = {}
        node = node["a"]
    nested = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    assert validate_arguments(nested, deep) == [
        "the arguments could not be checked: they, or the tool's schema ($ref), nest too deeply"]
    assert validate_arguments({"$ref": "#"}, {"x": 1}) != []  # a schema that refers to itself forever


def test_a_tool_schema_that_is_not_json_schema_is_refused_naming_the_tool():
    check_parameters_schema(SCHEMA, "tool 'search'")
    with pytest.raises(SchemaDefinitionError, match="tool 'search': parameters is not a valid JSON Schema"):
        check_parameters_schema({"type": "object", "properties": {"a": {"type": "integr"}}}, "tool 'search'")
    with pytest.raises(SchemaDefinitionError, match="minimum"):
        check_parameters_schema({"type": "object", "properties": {"a": {"minimum": "five"}}}, "tool 'search'")
