"""agent `openai_agent`: train an agent written against the OpenAI API, unchanged but for its base_url.

Per episode the loop opens a session on the rollout worker's OpenAI-compatible proxy
(asyncrl/proxy; one server per worker, on loopback) and runs the user's agent against it:

- `agent.openai.function`: an `async def run(client: openai.AsyncOpenAI, sample) -> float | None`,
  registered with `@register("openai_agent_fn", name)` (or named as module:fn / file.py:fn);
- `agent.openai.command`: an external command (argv list) started per episode in its own process
  group, with OPENAI_BASE_URL, OPENAI_API_KEY (the episode's key), ASYNCRL_REWARD_URL (POST
  {reward, completion_id?}), ASYNCRL_SAMPLE (the sample as JSON, also on stdin) and
  ASYNCRL_TOOL_CONFIG (the env's services for tools as JSON, e.g. the Search-R1 retrieval server's
  {"search": {"retrieval_service_url", "topk"}}); the run's engine token is not passed on. It must
  exit 0.

Both are bounded by `agent.openai.timeout_s` (the command's process group is SIGKILLed after it).
Reward: the function's return value; else what the agent POSTed to /rl/set_reward; else the env's
reward function on the last reply's text. A reward set for a completion id overrides it for the
chain that ends in that completion. The episode yields one trajectory per chain of calls (docs/design.md
"The OpenAI-compatible proxy": merged vs split calls), the chain holding the last call first; all go to
the buffer in the episode's group (`episode_chains`), and `proxy/chains` counts them. An agent that raises, times out, makes no call, returns something that
is not a number, or exits non-zero fails only its own episode (`OpenAIAgentError`, naming why).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import weakref
from typing import Any, Optional

from asyncrl import registry
from asyncrl.agents.base import AgentContext, AgentLoop
from asyncrl.agents.chat import ChatFormat
from asyncrl.config import AgentConfig, OpenAIAgentConfig
from asyncrl.data.schema import Trajectory
from asyncrl.envs.base import Sample, checked_reward, score
from asyncrl.proxy.server import ProxyServer
from asyncrl.proxy.session import Session
from asyncrl.registry import register
from asyncrl.secrets import SECRET_ENV
from asyncrl.util.auth import ENV as ENGINE_TOKEN_ENV

STDERR_TAIL = 2000


class OpenAIAgentError(RuntimeError):
    """The user's agent misbehaved; only its episode fails."""


_proxies: dict[int, tuple[weakref.ref, asyncio.AbstractEventLoop, ProxyServer]] = {}
_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def proxy_for(ctx: AgentContext) -> ProxyServer:
    """The context's proxy server in this event loop (started on first use, shared by its episodes)."""
    loop = asyncio.get_running_loop()
    lock = _locks.setdefault(loop, asyncio.Lock())
    async with lock:
        hit = _proxies.get(id(ctx))
        if hit is not None and hit[0]() is ctx and hit[1] is loop:
            return hit[2]
        p = await ProxyServer(ctx.engine, ctx.tokenizer, ctx.cfg, model_name=ctx.cfg.openai.model_name,
                                reward_max_abs=ctx.reward_max_abs).start()
        _proxies[id(ctx)] = (weakref.ref(ctx), loop, p)
        return p


async def stop_proxy(ctx: AgentContext) -> None:
    hit = _proxies.pop(id(ctx), None)
    if hit is not None:
        await hit[2].stop()


def openai_module() -> Any:
    """The `openai` package, which only `agent.openai.function` needs (its client is handed to the function):
    imported on use, so that every other command works without it."""
    try:
        # lazy: optional: the except below reports a missing package
        import openai
    except ImportError as e:
        raise OpenAIAgentError("agent.openai.function needs the openai package (pip install 'openai>=1.50'); "
                               f"importing it failed: {e}") from None
    return openai


def resolve_function(oc: OpenAIAgentConfig) -> Any:
    openai_module()
    name = oc.function or ""
    fn = registry.resolve_object(name) if (":" in name or name.endswith(".py")) else registry.get("openai_agent_fn", name)
    if not callable(fn):
        raise OpenAIAgentError(f"agent.openai.function={name!r} is {type(fn).__name__}, not callable")
    return fn


def check_config(oc: OpenAIAgentConfig) -> None:
    if (oc.function is None) == (oc.command is None):
        raise OpenAIAgentError("agent=openai_agent needs exactly one of agent.openai.function (a registered "
                               "openai_agent_fn) and agent.openai.command (an argv list); got "
                               f"function={oc.function!r}, command={oc.command!r}")
    if oc.command is not None and (not oc.command or not all(isinstance(a, str) and a for a in oc.command)):
        raise OpenAIAgentError(f"agent.openai.command must be a non-empty list of strings, got {oc.command!r}")
    if oc.function is not None:
        resolve_function(oc)


def sample_json(sample: Sample) -> str:
    return json.dumps(dataclasses.asdict(sample), default=str)


async def run_function(oc: OpenAIAgentConfig, proxy: ProxyServer, s: Session, sample: Sample) -> Optional[float]:
    fn = resolve_function(oc)
    client = openai_module().AsyncOpenAI(base_url=proxy.base_url, api_key=s.key, max_retries=0, timeout=oc.timeout_s)
    try:
        got = await fn(client, sample)
    except (asyncio.CancelledError, OpenAIAgentError):
        raise
    except Exception as e:
        raise OpenAIAgentError(f"openai_agent: agent function {oc.function} raised {e!r:.500}") from e
    finally:
        await client.close()
    if got is None:
        return None
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise OpenAIAgentError(f"openai_agent: agent function {oc.function} returned {got!r:.100}; expected a number or None")
    return float(got)


async def run_command(oc: OpenAIAgentConfig, proxy: ProxyServer, s: Session, sample: Sample,
                      tool_config: dict[str, Any]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV and k != ENGINE_TOKEN_ENV}
    payload = sample_json(sample)
    env.update(OPENAI_BASE_URL=proxy.base_url, OPENAI_API_KEY=s.key, ASYNCRL_SAMPLE=payload,
               ASYNCRL_REWARD_URL=proxy.base_url.removesuffix("/v1") + "/rl/set_reward",
               ASYNCRL_TOOL_CONFIG=json.dumps(tool_config, default=str))
    try:
        proc = await asyncio.create_subprocess_exec(*oc.command, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                                                    env=env, start_new_session=True)
    except OSError as e:
        raise OpenAIAgentError(f"openai_agent: cannot start agent.openai.command {oc.command!r}: {e}") from None
    try:
        _, err = await proc.communicate(payload.encode())
    finally:
        if proc.returncode is None:  # cancelled (the episode's timeout): the whole process group goes
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
    if proc.returncode != 0:
        tail = err.decode(errors="replace")[-STDERR_TAIL:].strip()
        raise OpenAIAgentError(f"openai_agent: agent command exited with {proc.returncode}: {tail}")


@register("agent", "openai_agent")
class OpenAIAgent(AgentLoop):
    name = "openai_agent"

    def chat_format(self, tokenizer: Any, cfg: AgentConfig, tool_schemas: list[dict[str, Any]]) -> ChatFormat:
        check_config(cfg.openai)  # the preflight calls this: a missing or unknown agent fails before the run
        return ChatFormat(tokenizer, tools=tool_schemas, system_prompt=cfg.system_prompt)

    async def run(self, sample: Sample, ctx: AgentContext) -> list[Trajectory]:
        oc = ctx.cfg.openai
        check_config(oc)
        proxy = await proxy_for(ctx)
        s = proxy.open_session(sample.uid)
        try:
            drive = (run_function(oc, proxy, s, sample) if oc.function is not None
                     else run_command(oc, proxy, s, sample, ctx.tool_overrides))
            try:
                returned = await asyncio.wait_for(drive, oc.timeout_s)
            except TimeoutError:
                raise OpenAIAgentError(f"openai_agent: the agent did not finish within agent.openai.timeout_s="
                                       f"{oc.timeout_s} ({len(s.records)} calls made)") from None
        finally:
            proxy.close_session(s)
        if s.engine_error is not None:
            raise s.engine_error
        if not s.records:
            raise OpenAIAgentError("openai_agent: the agent made no call to the proxy (is its base_url the "
                                   "episode's OPENAI_BASE_URL?)")
        return await self.finish(sample, ctx, s, returned)

    async def finish(self, sample: Sample, ctx: AgentContext, s: Session, returned: Optional[float]) -> list[Trajectory]:
        extra: dict[str, float] = {}
        if returned is not None:
            reward, source = returned, "returned"
        elif s.reward is not None:
            reward, source = s.reward, "set"
        else:
            last = s.records[-1]
            reward, extra = await score(ctx.reward_fn, final_text=last.text, ground_truth=sample.ground_truth,
                                        extra_info=sample.extra_info, tool_rewards=[], turn_rewards=[],
                                        data_source=sample.data_source, solution_str=last.text)
            source = "env"
        reward = checked_reward(reward, ctx.reward_max_abs, f"openai_agent: the reward ({source}, for {sample.uid})")
        built = s.trajectories(uid=sample.uid, episode_reward=reward, discount=ctx.cfg.openai.turn_discount,
                               group_id=sample.group_id, group_size=sample.group_size, env=ctx.env_name,
                               agent=self.name, data_index=sample.data_index, sample_index=sample.sample_index)
        traj, chain = built[0]
        n = len(s.records)
        metrics = {
            "proxy/calls": float(n),
            "proxy/calls_merged": float(sum(len(c.records) - 1 for _, c in built)),
            "proxy/chains": float(len(built)),
            "proxy/tool_calls": float(sum(len(r.tool_calls) for r in s.records)),
            "proxy/bad_requests": float(s.bad_requests),
            "proxy/sampling_overridden": float(s.sampling_overridden),
            "proxy/messages_mapped": float(s.messages_mapped),
            f"proxy/reward_{source}": 1.0,
            "assistant_turns": float(len(chain.records)),
            "generated_tokens": float(sum(traj.loss_mask.numpy())),
            "response_tokens": float(len(traj.response_ids)),
        }
        metrics.update({f"reward/{k}": v for k, v in extra.items()})
        traj.metrics = metrics
        return [t for t, _ in built]
