"""`asyncrl bench agents`: the agent-loop side's own costs, each against a baseline in the same run.

- delta vs retokenize: inserting a tool turn by rendering only the delta and tokenizing it once
  (what the loops do) vs the common baseline of re-rendering the whole conversation with the chat
  template and re-tokenizing it every turn (which also drifts when templates are not append-only).
  Measured per inserted turn over a conversation of `--turns` tool turns, real SmolLM2 tokenizer.
- parallel tools: one turn with `--calls` calls of a tool that sleeps `--tool-sleep-s`, run with
  tool_concurrency = calls vs 1 (the sequential baseline).
- python sandbox: per-call latency of `print(1)` through the python tool (namespaces, read-only view,
  scratch tmpfs with the episode's files copied in and back, rlimits, kill of the namespace) vs a bare
  `python -c 'print(1)'` subprocess, median over `--sandbox-repeats` calls.
- loop throughput: whole tool_agent episodes (2 calculator calls + answer) per second against a
  replaying engine double (zero model time), i.e. the loop's own overhead.
- OpenAI proxy: one chat completion of exactly 16 tokens (greedy, min_new_tokens=16) through the
  proxy with the real `openai` client, the second call of an episode (its history mapped back to the
  first call's ids), vs a direct EngineClient.generate of the same prompt ids on the same embedded
  engine (the default model on CPU), interleaved, median over `--proxy-repeats`. The proxy's own
  cost (`proxy_overhead_ms`) is the client-observed call less the engine call inside it (measured
  in the same call, so the engine's variance on a shared machine does not enter it);
  `proxy_overhead_ratio` is that cost over the direct 16-token call; `proxy_call_vs_direct_ratio`
  compares the two whole calls (engine variance included).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Optional

from transformers import AutoTokenizer

from asyncrl.agents.base import AgentContext, run_episode
from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.tool_calls import ToolCall, resolve_parser
from asyncrl.agents.tool_runner import ToolRunner
from asyncrl.config import AgentConfig, ModelConfig, SamplingConfig
from asyncrl.engine.base import GenerateResult, SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_embedded
from asyncrl.envs.base import Sample
from asyncrl.models import resolve_model_dir
from asyncrl.proxy.server import ProxyServer
from asyncrl.tools.base import Tool
from asyncrl.tools.loader import load_tool_specs
from asyncrl.tools.python import PythonTool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=8, help="tool turns in the delta-vs-retokenize conversation")
    parser.add_argument("--calls", type=int, default=4, help="tool calls in the parallel-tools turn")
    parser.add_argument("--tool-sleep-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--sandbox-repeats", type=int, default=20, help="calls of the python tool to time")
    parser.add_argument("--proxy-repeats", type=int, default=10, help="proxy vs direct calls to time")


class ReplayEngine:
    """A Generator double for benchmarking the loop alone: replays fixed replies with no model."""

    def __init__(self, replies: list[list[int]]):
        self.replies, self.k = replies, 0

    async def generate(self, input_ids: list[int], sampling: Any, *, rid: Optional[str] = None,
                       session_id: Optional[str] = None) -> Any:
        ids = self.replies[self.k % len(self.replies)][: sampling.max_new_tokens]
        self.k += 1
        return GenerateResult(output_ids=ids, logprobs=[-1.0] * len(ids), versions=[0] * len(ids),
                              finish_reason="stop", weight_version=0)


def _tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()))


def _calculator_call(expression: str) -> str:
    """A reply calling the calculator, written by the default tool parser (hermes), which owns its format."""
    return resolve_parser(AgentConfig().tool_parser).render("", [ToolCall("calculator", {"expression": expression})])


def bench_delta(tok: Any, turns: int, repeats: int) -> dict[str, float]:
    chat = ChatFormat(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = tok.encode(_calculator_call("12 * 7 + 3"), add_special_tokens=False) + [im_end]
    result = "Doc 1: " + "a passage of retrieved text " * 20
    base = [{"role": "user", "content": "Question " * 30}]
    delta_s, full_s = [], []
    for _ in range(repeats):
        msgs = list(base)
        t0 = time.perf_counter()
        for _ in range(turns):
            chat.delta_ids([{"role": "tool", "content": result}], gen)
        delta_s.append((time.perf_counter() - t0) / turns)
        t0 = time.perf_counter()
        for _ in range(turns):
            msgs += [{"role": "assistant", "content": tok.decode(gen, skip_special_tokens=True)},
                     {"role": "tool", "content": result}]
            tok.encode(chat.render(msgs, add_generation_prompt=True), add_special_tokens=False)
        full_s.append((time.perf_counter() - t0) / turns)
    d, f = statistics.median(delta_s), statistics.median(full_s)
    return {"delta_ms_per_turn": round(d * 1e3, 3), "retokenize_ms_per_turn": round(f * 1e3, 3),
            "delta_speedup_vs_retokenize": round(f / d, 2)}


async def bench_parallel_tools(tok: Any, calls: int, sleep_s: float) -> dict[str, float]:
    class SleepTool(Tool):
        name = "sleep"

        async def execute(self, instance_id: str, params: dict) -> tuple[str, float, dict]:
            await asyncio.sleep(sleep_s)
            return "done", 0.0, {}

    times = {}
    for conc in (calls, 1):
        runner = ToolRunner({"sleep": SleepTool()}, "i", {}, AgentConfig(tool_concurrency=conc), tok, Counter())
        t0 = time.perf_counter()
        await runner.run([ToolCall("sleep", {}) for _ in range(calls)])
        times[conc] = time.perf_counter() - t0
    return {"tools_parallel_s": round(times[calls], 3), "tools_sequential_s": round(times[1], 3),
            "tools_parallel_speedup": round(times[1] / times[calls], 2)}


async def bench_sandbox(repeats: int) -> dict[str, float]:
    tool = PythonTool()
    await tool.create("b")
    sand, bare = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        text, _, _ = await tool.execute("b", {"code": "print(1)"})
        sand.append(time.perf_counter() - t0)
        assert text == "1\n", text
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, check=True)
        bare.append(time.perf_counter() - t0)
    await tool.release("b")
    s, b = statistics.median(sand), statistics.median(bare)
    return {"sandbox_ms": round(s * 1e3, 1), "bare_python_ms": round(b * 1e3, 1),
            "sandbox_overhead_ratio": round(s / b, 2), "sandbox_isolated": tool.isolated}


async def bench_loop(tok: Any, episodes: int) -> dict[str, float]:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = [tok.encode(t, add_special_tokens=False) + [im_end] for t in (
        _calculator_call("3*4"), _calculator_call("12+5"), "Answer: 17")]
    ctx = AgentContext(engine=ReplayEngine(replies), tokenizer=tok, cfg=AgentConfig(),
                       tool_specs=load_tool_specs(["calculator"]), reward_fn=lambda **kw: 1.0)
    t0 = time.perf_counter()
    for i in range(episodes):
        s = Sample(uid=f"b-{i}", group_id="b", group_size=1, sample_index=0, data_index=i,
                   messages=[{"role": "user", "content": "What is 3*4+5?"}], ground_truth="17")
        traj = await run_episode(s, ctx, "tool_agent")
        assert traj.metrics["tool_calls"] == 2
    dt = time.perf_counter() - t0
    return {"episodes_per_s": round(episodes / dt, 1), "loop_ms_per_turn": round(dt / episodes / 3 * 1e3, 3)}


class TimedGenerator:
    """The engine client, timing each generate: the proxy's own cost is a call's time less this."""

    def __init__(self, inner: Any):
        self.inner, self.last_s = inner, 0.0

    async def generate(self, input_ids: list[int], sampling: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await self.inner.generate(input_ids, sampling, **kw)
        finally:
            self.last_s = time.perf_counter() - t0


async def _proxy_vs_direct(url: str, tok: Any, repeats: int, n: int = 16) -> dict[str, float]:
    # lazy: imports openai, which this module does not load otherwise
    import openai  # the dev extra's; only this part of the bench needs it

    cfg = AgentConfig(max_turn_tokens=n, sampling=SamplingConfig(temperature=0.0, min_new_tokens=n))
    question = [{"role": "user", "content": "What is 3*4+5? Think step by step."}]
    proxy_s, direct_s, own_s = [], [], []
    async with EngineClient(url) as engine, ProxyServer(TimedGenerator(engine), tok, cfg) as proxy:
        for i in range(repeats + 1):  # the first round warms both paths up and is not counted
            s = proxy.open_session(f"bench-{i}")
            async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s.key, max_retries=0) as client:
                first = await client.chat.completions.create(model="policy", messages=question, max_tokens=n)
                msgs = question + [first.choices[0].message.model_dump(exclude_none=True),
                                   {"role": "user", "content": "Are you sure?"}]
                t0 = time.perf_counter()
                second = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=n)
                dt_proxy = time.perf_counter() - t0
                inner = proxy.engine.last_s  # the engine's part of the proxied call
            assert second.usage.completion_tokens == n, second.usage
            sp = SamplingParams(temperature=0.0, max_new_tokens=n, min_new_tokens=n,
                                stop_token_ids=ChatFormat(tok).stop_token_ids())
            t0 = time.perf_counter()
            out = await engine.generate(s.records[1].prompt_ids, sp, session_id=s.uid)
            dt_direct = time.perf_counter() - t0
            assert out.output_ids == s.records[1].output_ids  # same work on both paths
            proxy.close_session(s)
            if i:
                proxy_s.append(dt_proxy)
                direct_s.append(dt_direct)
                own_s.append(dt_proxy - inner)
    p, d, o = statistics.median(proxy_s), statistics.median(direct_s), statistics.median(own_s)
    return {"proxy_call_ms": round(p * 1e3, 1), "direct_call_ms": round(d * 1e3, 1),
            "proxy_overhead_ms": round(o * 1e3, 1), "proxy_overhead_ratio": round(o / d, 4),
            "proxy_call_vs_direct_ratio": round(p / d, 3)}


def bench_proxy(tok: Any, repeats: int) -> dict[str, float]:
    with launch_embedded(resolve_model_dir(ModelConfig()), max_running_seqs=4, threads=1) as proc:
        return asyncio.run(_proxy_vs_direct(proc.url, tok, repeats))


def run(args: argparse.Namespace) -> dict:
    tok = _tokenizer()
    out: dict[str, Any] = {"baseline": "full re-render+retokenize / sequential tools / bare python subprocess / "
                                       "direct engine call"}
    out.update(bench_delta(tok, args.turns, args.repeats))
    out.update(asyncio.run(bench_parallel_tools(tok, args.calls, args.tool_sleep_s)))
    out.update(asyncio.run(bench_sandbox(args.sandbox_repeats)))
    out.update(asyncio.run(bench_loop(tok, args.episodes)))
    out.update(bench_proxy(tok, args.proxy_repeats))
    return out
