"""Tool-call formats: each parser reads back a tool call rendered by its family's chat template through
transformers' apply_chat_template; each parser renders what it parses (through its family's template and the
tokenizer and back), in its family's own spelling, and is the only module that spells its format;
`agent.tool_parser=auto` picks the parser from the template; hostile model output is an invalid call, never an
exception; tool arguments are checked against the full JSON Schema."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest

import asyncrl
from asyncrl import registry
from asyncrl.agents import parsers
from asyncrl.agents.parsers import (
    DeepSeekV3Parser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Qwen3Parser,
    ReactParser,
)
from asyncrl.agents.tool_calls import (
    ToolCall,
    ToolFormatError,
    UnknownToolFormat,
    parser_for_template,
    renderer,
    resolve_parser,
)
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


# parser -> the templates of its families (the tests' SmolLM2 tokenizer's own ChatML for react, which has none)
RENDER_FAMILIES = {"hermes": ["qwen2_5"], "qwen3": ["qwen3"], "llama3_json": ["llama3_1"],
                   "mistral": ["mistral_v3", "mistral_v11"], "deepseek_v3": ["deepseek_v3", "deepseek_v3_1"],
                   "react": ["chatml"]}
# template -> the end-of-turn text the engine stops at (not part of the generation the parser reads)
END_OF_TURN = {"qwen2_5": "<|im_end|>\n", "qwen3": "<|im_end|>\n", "chatml": "<|im_end|>\n", "llama3_1": "<|eot_id|>",
               "mistral_v3": "</s>", "mistral_v11": "</s>", "deepseek_v3": "<｜end▁of▁sentence｜>",
               "deepseek_v3_1": "<｜end▁of▁sentence｜>"}
# the templates whose own rendering of `tool_calls` is the form the parser renders: render must write exactly that
NATIVE = {"hermes": "qwen2_5", "llama3_json": "llama3_1", "mistral": "mistral_v11", "deepseek_v3": "deepseek_v3"}
WIDE = [{"name": "search", "arguments": {"query": "Gödel's \"Freedonia\" 東京", "filters": {"years": [1990, 2000]},
                                          "exact": True, "weight": 0.5, "none": None}}]


def _generation(tok, template: str, text: str) -> str:
    """What the engine returns for an assistant turn whose text is `text`: the conversation rendered by the
    template with that turn, less the prompt before it and the end-of-turn it stops at, through the tokenizer
    (encoded, then decoded as the agent loop decodes for the parser)."""
    if template != "chatml":
        tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    before = [{"role": "user", "content": "What is 12 * (3 + 4)?"}]
    prompt = tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(before + [{"role": "assistant", "content": text}], tokenize=False)
    assert full.startswith(prompt) and full.endswith(END_OF_TURN[template]), (template, prompt, full)
    return full[len(prompt): len(full) - len(END_OF_TURN[template])]


def _read_back(tok, parser, generated: str):
    ids = tok.encode(generated, add_special_tokens=False)
    return parser.parse(tok.decode(ids, skip_special_tokens=not getattr(parser, "keeps_special_tokens", False)))


def test_every_registered_tool_parser_is_a_built_in_covered_here():
    assert sorted(registry.names("tool_parser")) == sorted(RENDER_FAMILIES)


@pytest.mark.parametrize("name,template", [(n, t) for n, ts in sorted(RENDER_FAMILIES.items())
                                           for t in dict.fromkeys(ts + ["chatml"])])
def test_each_parser_renders_what_it_parses_through_its_familys_template_and_the_tokenizer(templated, name, template):
    """render -> the family's chat template (as the assistant turn's text) -> tokens -> decode -> parse gives
    back the calls, in order, and the content where the format has room for it beside calls."""
    parser = renderer(name)
    one_call_a_turn = name == "react"
    for content in ("", "Let me check that.", "  Padded text.\n"):
        for calls in ([], CALLS[:1], CALLS, WIDE):
            if one_call_a_turn and len(calls) > 1:
                continue
            objs = [ToolCall(c["name"], copy.deepcopy(c["arguments"])) for c in calls]
            if not calls and name == "react" and not content:
                continue
            parsed = _read_back(templated, parser, _generation(templated, template, parser.render(content, objs)))
            assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
                (c["name"], c["arguments"], None) for c in calls], (name, template, content, calls)
            no_room = name == "llama3_json" and calls  # the format has no place for content beside calls
            assert parsed.content == ("" if no_room else content.strip()), (name, template, content, parsed.content)


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_render_writes_the_spelling_of_its_familys_own_template(templated, name):
    """What SFT teaches is what the family's template writes for an assistant message with `tool_calls`."""
    family = NATIVE[name]
    for calls in (CALLS[:1], CALLS, WIDE):
        native = _generated(templated, family, copy.deepcopy(calls)).removesuffix(END_OF_TURN[family])
        if name == "hermes":  # Qwen2.5's template starts the calls with a newline after the (here empty) content
            native = native.removeprefix("\n")
        rendered = resolve_parser(name).render("", [ToolCall(c["name"], c["arguments"]) for c in calls])
        assert rendered == native, (name, rendered, native)


def test_a_turn_a_format_cannot_write_is_an_error_naming_the_parser_never_a_call_left_out():
    one = [ToolCall("calculator", {"expression": "1+1"})]
    with pytest.raises(ToolFormatError, match="tool_parser 'react' writes one call a turn.*has 2: calculator, calc"):
        ReactParser().render("", one + [ToolCall("calc", {})])
    with pytest.raises(ToolFormatError, match="'hermes' cannot write an assistant turn whose content holds '<tool_call>'"):
        HermesParser().render("see <tool_call>{}</tool_call>", one)
    with pytest.raises(ToolFormatError, match="'qwen3' .* holds '<think>'"):
        Qwen3Parser().render("<think>hm</think>", one)
    with pytest.raises(ToolFormatError, match="'mistral' cannot write a call named 'my tool'"):
        MistralParser().render("", [ToolCall("my tool", {})])
    with pytest.raises(ToolFormatError, match="'llama3_json' reads a turn that starts with '\\{'"):
        Llama3JsonParser().render('{"answer": 3}', [])
    with pytest.raises(ToolFormatError, match="'deepseek_v3' cannot write .*: Out of range float values"):
        DeepSeekV3Parser().render("", [ToolCall("f", {"x": float("nan")})])
    with pytest.raises(ToolFormatError, match="'react' cannot write a call after content that holds an 'Action:'"):
        ReactParser().render("Action: other", one)


def test_a_parser_without_render_is_refused_naming_it_and_the_parsers_that_render(plugin_registry, templated):
    @plugin_registry.register("tool_parser", "parse_only")
    class ParseOnly:
        def parse(self, text):
            return HermesParser().parse(text)

    assert renderer("hermes").render("", []) == ""  # a built-in renders
    with pytest.raises(ToolFormatError) as e:
        renderer("parse_only")
    msg = str(e.value)
    assert msg.startswith(f"agent.tool_parser=parse_only is the tool_parser plugin {ParseOnly.__qualname__} (module "
                          f"{__name__}), which has no render(content, calls)"), msg
    assert msg.endswith("set agent.tool_parser to one that has it: deepseek_v3, hermes, llama3_json, mistral, qwen3, "
                        "react"), msg
    templated.response_template = {"type": "object"}  # auto then picks the tokenizer's own parser, which cannot write
    try:
        with pytest.raises(ToolFormatError, match="agent.tool_parser=auto chose the tokenizer's own response_template"):
            renderer("auto", templated)
    finally:
        del templated.response_template


FORMAT_MARKERS = sorted({HermesParser.OPEN, HermesParser.CLOSE, Llama3JsonParser.PYTHON_TAG, MistralParser.MARK,
                         MistralParser.ARGS, DeepSeekV3Parser.CALLS_BEGIN, DeepSeekV3Parser.CALL_BEGIN,
                         DeepSeekV3Parser.SEP, DeepSeekV3Parser.CALL_END, "tool▁call"})


def _spellings(source: str) -> list[tuple[int, str]]:
    """(line, marker) of each string constant in `source` that spells a tool-call format's marker; docstrings,
    which describe formats and write nothing, are left out."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [(node.lineno, m) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            for m in FORMAT_MARKERS if m in node.value]


def test_no_module_but_the_parsers_spells_a_tool_call_format():
    """One owner for each format: a second spelling (SFT writing hermes blocks by hand, a list of the parsers
    whose format some code writes itself) is found in the source."""
    root = Path(asyncrl.__file__).resolve().parent
    own = Path(parsers.__file__).resolve()
    found = [f"{p.relative_to(root.parent)}:{line}: {m!r}" for p in sorted(root.rglob("*.py")) if p.resolve() != own
             for line, m in _spellings(p.read_text())]
    assert not found, "tool-call formats spelled outside asyncrl/agents/parsers.py:\n" + "\n".join(found)
    # the check finds what it looks for: the parsers' own spellings, and a hand-written block in an f-string
    assert {m for _, m in _spellings(own.read_text())} >= {HermesParser.OPEN, MistralParser.MARK, "tool▁call"}
    assert _spellings('def f(c):\n    """<tool_call> is hermes."""\n    return f"<tool_call>\\n{c}\\n</tool_call>"') == [
        (3, "<tool_call>"), (3, "</tool_call>")]


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
