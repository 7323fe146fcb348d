"""agent `react`: the text ReAct format over the same tools, for models without a tool-call template.

The system message lists the tools and the format (Thought / Action / Action Input / Observation /
Final Answer). The whole episode is one assistant message that grows:

    generate -> parse (ReactParser)
      "Final Answer: ..."     -> stop; the reward scores this generation's text
      Action + Action Input   -> run the tool; insert "Observation: <result>\\n" (masked) and continue
      neither                 -> stop ("length" if the generation was cut)

Without stop strings in the engine API, a model may write its own "Observation:" after the Action
Input: the generated ids are cut back to the last token that ends before it (a prefix of the
engine's ids keeps exact logprobs and versions; counted in metrics["observation_trimmed"]). If the
model closed its message (<|im_end|>) after an Action, the observation comes as a user turn
rendered by the chat template instead. A bare (non-JSON) Action Input is accepted for tools with
exactly one required string parameter. Interactions are not used by this loop.
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.agents.base import AgentContext, AgentLoop, Episode
from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.tool_calls import ToolCall
from asyncrl.agents.tool_runner import ToolRunner
from asyncrl.config import AgentConfig
from asyncrl.data.schema import Trajectory
from asyncrl.envs.base import Sample
from asyncrl.registry import register

from .parsers import ReactParser

OBSERVATION = "Observation:"


def react_instructions(schemas: list[dict[str, Any]]) -> str:
    tools = "\n".join(f"- {s['function']['name']}: {s['function'].get('description', '')} "
                      f"Arguments: {json.dumps(s['function'].get('parameters', {}).get('properties', {}))}"
                      for s in schemas)
    names = ", ".join(s["function"]["name"] for s in schemas)
    return (f"You can use these tools:\n{tools}\n\nUse this format:\n"
            "Thought: what to do next\n"
            f"Action: the tool to use, one of [{names}]\n"
            "Action Input: the tool's arguments as a JSON object\n"
            "Observation: the tool's result\n"
            "... (Thought/Action/Action Input/Observation can repeat)\n"
            "Thought: I now know the final answer\n"
            "Final Answer: the answer")


def trim_at(ids: list[int], tokenizer: Any, text_pos: int) -> int:
    """The largest k such that decode(ids[:k]) ends at or before character `text_pos` of decode(ids)."""
    k = 0
    for i in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:i], skip_special_tokens=True)) <= text_pos:
            k = i
        else:
            break
    return k


def coerce_bare_input(call: ToolCall, tools: dict[str, Any]) -> ToolCall:
    """'Action Input: 3 + 4' for a tool whose only required parameter is a string -> {param: '3 + 4'}."""
    tool = tools.get(call.name)
    if call.error != "invalid_json" or tool is None:
        return call
    params = tool.tool_schema["function"].get("parameters") or {}
    req = params.get("required") or []
    if len(req) == 1 and (params.get("properties", {}).get(req[0], {}).get("type") == "string"):
        return ToolCall(call.name, {req[0]: call.raw.strip().strip('"')}, None, call.raw)
    return call


@register("agent", "react")
class ReactAgent(AgentLoop):
    name = "react"

    def chat_format(self, tokenizer: Any, cfg: AgentConfig, tool_schemas: list[dict[str, Any]]) -> ChatFormat:
        return ChatFormat(tokenizer, system_prompt=cfg.system_prompt, system_suffix=react_instructions(tool_schemas))

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        cfg = ctx.cfg
        chat = self.chat_format(ctx.tokenizer, cfg, ctx.tool_schemas())
        ep = Episode(sample, ctx, self.name, chat, chat.prompt_messages(sample.messages))
        parser = ReactParser()
        tools = ctx.tools()
        runner = ToolRunner(tools, sample.uid, sample.tools_kwargs, cfg, ctx.tokenizer, ep.metrics)
        consecutive_invalid, final_text = 0, ""
        try:
            while True:
                out = await ep.generate()
                if out is None:
                    break
                ids = list(out.output_ids)
                text = ep.decode(ids)
                parsed = parser.parse(text)
                if parsed.calls and parsed.final_answer is None:
                    obs = text.find(OBSERVATION, text.find("Action Input") if "Action Input" in text else 0)
                    k = trim_at(ids, ctx.tokenizer, obs) if obs >= 0 else len(ids)
                    drop = len(ids) - k
                    if drop > 0:  # the model wrote its own observation: keep only the ids before it
                        del ep.builder.response_ids[-drop:], ep.builder.loss_mask[-drop:]
                        del ep.builder.logprobs[-drop:], ep.builder.versions[-drop:]
                        ep.metrics["observation_trimmed"] += 1
                        ep.metrics["generated_tokens"] -= drop
                        ids = ids[:k]
                        text = ep.decode(ids)
                        parsed = parser.parse(text)
                final_text = text
                ep.messages.append({"role": "assistant", "content": text})
                if out.finish_reason == "abort":
                    ep.finish_reason = "abort"
                    break
                if parsed.final_answer is not None or not parsed.calls:
                    ep.finish_reason = "length" if (out.finish_reason == "length" and parsed.final_answer is None) else "stop"
                    break
                call = coerce_bare_input(parsed.calls[0], tools)
                (outcome,) = await runner.run([call])
                ep.set_tool_rewards(runner.rewards)
                consecutive_invalid = consecutive_invalid + 1 if outcome.invalid else 0
                if consecutive_invalid >= cfg.max_consecutive_invalid_calls:
                    ep.finish_reason = "invalid_calls"
                    break
                if ep.assistant_turns >= cfg.max_assistant_turns:
                    ep.finish_reason = "max_turns"
                    break
                observation = f"{OBSERVATION} {outcome.text}"
                if ids and ids[-1] in ep.stop_ids:  # the model closed its message: observe as a user turn
                    if not ep.insert_messages([{"role": "user", "content": observation}], ids):
                        break
                    continue
                sep = "" if text.endswith("\n") else "\n"
                if not ep.insert_ids(chat.encode(sep + observation + "\n")):
                    break
                ep.messages.append({"role": "tool", "name": outcome.name, "content": observation})
        finally:
            await runner.close()
        return await ep.finish(final_text)
