"""The proxy's exact-token contract, with the real `openai` client against the real embedded engine.

Greedy sampling makes every generation reproducible, so each check re-asks the engine directly
(EngineClient, token in / token out) and compares: the trajectory's generated runs are the engine's
outputs for exactly the ids the trajectory holds before them, the inserted ids are the hand-written
ChatML delta, the mask is 1 on generated ids only, versions per token.
"""

from __future__ import annotations

from asyncrl.agents.chat import ChatFormat
from asyncrl.engine.base import SamplingParams
from tests.engine.conftest import post

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}
QUESTION = "What is 3*4+5?"


def runs(mask: list[int], ids: list[int]) -> list[list[int]]:
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


async def direct(engine, ids: list[int], n: int, stop_ids: list[int]) -> list[int]:
    out = await engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=stop_ids))
    return out.output_ids


def closing(tok, g: list[int]) -> str:
    return "\n" if g and g[-1] == tok.convert_tokens_to_ids("<|im_end|>") else "<|im_end|>\n"


async def test_multi_turn_agent_gets_one_trajectory_of_the_engines_exact_tokens(proxy, oai, client_engine, proxy_tokenizer,
                                                                               proxy_engine, proxy_model_dir):
    """Across a weight update between the turns (the same weights reloaded from disk as version v+1, so
    greedy outputs stay reproducible): each generated token carries the version that produced it."""
    tok = proxy_tokenizer
    s = proxy.open_session("g0-0")
    client = oai(s)
    msgs = [{"role": "user", "content": QUESTION}]
    r1 = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALC], max_tokens=8)
    msgs.append(r1.choices[0].message.model_dump())  # what agents send back, None fields included
    (v0,) = await client_engine.weight_versions()
    r = await post(proxy_engine.url, "/update_weights_from_disk", {"model_path": str(proxy_model_dir),
                                                                   "weight_version": str(v0 + 1)})
    assert r.status_code == 200, r.text
    msgs.append({"role": "user", "content": "Check it."})
    r2 = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALC], max_tokens=8,
                                              logprobs=True)
    (traj, chain), = s.trajectories(uid=s.uid, episode_reward=1.0, discount=1.0, group_id="g0", group_size=1,
                                    env="e", agent="openai_agent")
    prompt, resp = traj.prompt_ids.numpy().tolist(), traj.response_ids.numpy().tolist()
    mask = traj.loss_mask.numpy().tolist()
    chat = ChatFormat(tok, tools=[CALC])
    assert prompt == chat.prompt_ids(chat.prompt_messages([{"role": "user", "content": QUESTION}]))
    g = runs(mask, resp)
    assert len(g) == 2 and chain.records == [0, 1]
    stop_ids = chat.stop_token_ids()
    assert g[0] == await direct(client_engine, prompt, 8, stop_ids)
    delta = tok.encode(closing(tok, g[0]) + "<|im_start|>user\nCheck it.<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False)
    assert resp == g[0] + delta + g[1]
    assert mask == [1] * len(g[0]) + [0] * len(delta) + [1] * len(g[1])
    assert g[1] == await direct(client_engine, prompt + g[0] + delta, 8, stop_ids)
    versions = traj.versions.numpy().tolist()
    assert versions == [v0] * len(g[0]) + [-1] * len(delta) + [v0 + 1] * len(g[1])
    lps = traj.behavior_logprobs.numpy().tolist()
    got = [c.logprob for c in r2.choices[0].logprobs.content]
    assert [round(x, 4) for x in lps[-len(g[1]):]] == [round(x, 4) for x in got]
    assert r2.usage.prompt_tokens == len(prompt) + len(g[0]) + len(delta)
    assert r2.usage.completion_tokens == len(g[1])
    assert r1.choices[0].message.content == tok.decode(g[0], skip_special_tokens=True)
