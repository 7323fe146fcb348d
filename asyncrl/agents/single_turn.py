"""agent `single_turn`: one generation from the prompt; the reward scores its text."""

from __future__ import annotations

from asyncrl.agents.base import AgentContext, AgentLoop, Episode
from asyncrl.data.schema import Trajectory
from asyncrl.envs.base import Sample
from asyncrl.registry import register


@register("agent", "single_turn")
class SingleTurnAgent(AgentLoop):
    name = "single_turn"

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        chat = self.chat_format(ctx.tokenizer, ctx.cfg, [])
        ep = Episode(sample, ctx, self.name, chat, chat.prompt_messages(sample.messages))
        out = await ep.generate()
        text = ""
        if out is not None:
            text = ep.decode(out.output_ids)
            ep.messages.append({"role": "assistant", "content": text})
            ep.finish_reason = out.finish_reason if out.finish_reason in ("stop", "length", "abort") else "stop"
        return await ep.finish(text)
