"""agent `tool_agent`: multi-turn tool calling in the model's chat format.

    loop:
      generate (max_new_tokens = min(max_turn_tokens, remaining budget))
      parse tool calls (AgentConfig.tool_parser; hermes `<tool_call>{...}</tool_call>` by default)
      calls      -> run them (ToolRunner: bounded parallelism, per-call timeout, errors as text),
                    append one `tool` message per call as a masked template delta, repeat
      no call    -> with an interaction (extra_info.interaction_kwargs.name): its score is a turn
                    reward (also for a reply cut by max_turn_tokens, as verl does); unless it is
                    done, its text is a masked user turn, repeat; without one: stop
    ends on: no call ("stop"), the interaction done ("stop"), max_assistant_turns / max_user_turns
    while more was wanted ("max_turns"), the token budget ("length"), max_consecutive_invalid_calls
    invalid calls in a row ("invalid_calls"), an engine abort ("abort"), or a generation cut by its
    token limit without a call and without an interaction ("length").
The reward function scores the last assistant message's text.
"""

from __future__ import annotations

from typing import Any

from asyncrl.agents.base import AgentContext, AgentLoop, Episode, InteractionSession
from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.tool_calls import resolve_parser
from asyncrl.agents.tool_runner import ToolRunner
from asyncrl.config import AgentConfig
from asyncrl.data.schema import Trajectory
from asyncrl.envs.base import Sample
from asyncrl.registry import register


@register("agent", "tool_agent")
class ToolAgent(AgentLoop):
    name = "tool_agent"

    def chat_format(self, tokenizer: Any, cfg: AgentConfig, tool_schemas: list[dict[str, Any]]) -> ChatFormat:
        return ChatFormat(tokenizer, tools=tool_schemas, system_prompt=cfg.system_prompt)

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        cfg = ctx.cfg
        chat = self.chat_format(ctx.tokenizer, cfg, ctx.tool_schemas())
        ep = Episode(sample, ctx, self.name, chat, chat.prompt_messages(sample.messages))
        parser = resolve_parser(cfg.tool_parser, ctx.tokenizer)
        keep_special = getattr(parser, "keeps_special_tokens", False)  # its markers are special tokens
        runner = ToolRunner(ctx.tools(), sample.uid, sample.tools_kwargs, cfg, ctx.tokenizer, ep.metrics)
        interaction = InteractionSession(sample, ctx)
        consecutive_invalid, final_text = 0, ""
        try:
            while True:
                out = await ep.generate()
                if out is None:
                    break
                text = ep.decode(out.output_ids)
                final_text = text
                ep.messages.append({"role": "assistant", "content": text})
                if out.finish_reason == "abort":
                    ep.finish_reason = "abort"
                    break
                calls = parser.parse(ctx.tokenizer.decode(out.output_ids, skip_special_tokens=False)
                                     if keep_special else text).calls
                if calls:
                    outcomes = await runner.run(calls)
                    ep.set_tool_rewards(runner.rewards)
                    for o in outcomes:
                        consecutive_invalid = consecutive_invalid + 1 if o.invalid else 0
                    if consecutive_invalid >= cfg.max_consecutive_invalid_calls:
                        ep.finish_reason = "invalid_calls"
                        break
                    if ep.assistant_turns >= cfg.max_assistant_turns:
                        ep.finish_reason = "max_turns"
                        break
                    replies = [{"role": "tool", "name": o.name, "content": o.text} for o in outcomes]
                    if not ep.insert_messages(replies, out.output_ids):
                        break
                    continue
                if not interaction:
                    ep.finish_reason = "length" if out.finish_reason == "length" else "stop"
                    break
                done, reply, turn_score, _ = await interaction.respond(ep.messages)
                ep.add_turn_reward(turn_score)
                if done:
                    ep.finish_reason = "stop"
                    break
                if ep.user_turns >= cfg.max_user_turns or ep.assistant_turns >= cfg.max_assistant_turns:
                    ep.finish_reason = "max_turns"
                    break
                if not ep.insert_messages([{"role": "user", "content": reply}], out.output_ids):
                    break
                ep.user_turns += 1
        finally:
            await runner.close()
            await interaction.close()
        return await ep.finish(final_text)
