"""The proxy's HTTP contract with the real `openai` client (and raw httpx for what the client would
refuse to send): auth, malformed requests, streaming, stop strings, completions, models, tool calls,
history rewriting."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from asyncrl.agents.chat import ChatFormat
from asyncrl.proxy.server import ProxyServer
from tests.agents.scripted_engine import ScriptedEngine

from .conftest import agent_cfg
from .test_exact_tokens import CALC, runs

USER = [{"role": "user", "content": "What is 3*4+5?"}]


async def raw(proxy, key, path: str, body, method: str = "POST") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=proxy.base_url.removesuffix("/v1"), headers=headers, timeout=60) as h:
        if method == "GET":
            return await h.get(path)
        return await h.post(path, content=body if isinstance(body, (bytes, str)) else json.dumps(body))


@pytest.mark.parametrize("path,method", [("/v1/chat/completions", "POST"), ("/v1/completions", "POST"),
                                         ("/v1/models", "GET"), ("/rl/set_reward", "POST")])
async def test_unknown_absent_and_ended_keys_get_openai_401(proxy, oai, path, method):
    s = proxy.open_session("g0-0")
    ended = proxy.open_session("g0-1")
    proxy.close_session(ended)
    body = {"model": "m", "messages": USER, "prompt": "x", "reward": 1.0}
    for key in (None, "sk-wrong", ended.key, s.key[:-1]):
        r = await raw(proxy, key, path, body, method)
        assert r.status_code == 401, (key, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert s.started == 0 and not s.records
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
    models = await oai(s).models.list()
    assert [m.id for m in models.data] == ["asyncrl-policy"]


MALFORMED = [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
    (b"[" * 100_000 + b"]" * 100_000, "body"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}', "body"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "tool", "content": "17"}]}, "messages[0].tool_call_id"),
    ({"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0]"),
    ({"model": "m", "messages": USER, "n": 2}, "n"),
    ({"model": "m", "messages": USER, "temperature": "hot"}, "temperature"),
    ({"model": "m", "messages": USER, "temperature": 3}, "temperature"),
    ({"model": "m", "messages": USER, "top_p": 0}, "top_p"),
    ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": USER, "max_tokens": True}, "max_tokens"),
    ({"model": "m", "messages": USER, "max_tokens": 10**9}, "max_tokens"),
    ({"model": "m", "messages": USER, "max_completion_tokens": 100000}, "max_tokens"),
    ({"model": "m", "messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "messages": USER, "stop": 3}, "stop"),
    ({"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "messages": USER, "stream": "yes"}, "stream"),
    ({"model": "m", "messages": USER, "seed": 1.5}, "seed"),
    ({"model": "m", "messages": USER, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"model": "m", "messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"model": "m", "messages": USER, "tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"model": "m", "messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    ({"model": "m", "messages": USER, "bogus": 1}, "bogus"),
    ({"model": 7, "messages": USER}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "x " * 1000}]}, "messages"),
]


async def test_malformed_chat_requests_get_openai_400_naming_the_field(proxy, oai):
    s = proxy.open_session("g0-0")
    for body, param in MALFORMED:
        r = await raw(proxy, s.key, "/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"], (body, err)
    assert s.started == 0 and s.bad_requests == len(MALFORMED)
    ok = await oai(s).chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert ok.usage.completion_tokens >= 1  # still serving


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": ""}, "prompt"), ({"model": "m", "prompt": [1, -1]}, "prompt"),
    ({"model": "m", "prompt": [10**9]}, "prompt"), ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "n": 3}, "n"), ({"model": "m", "prompt": "x", "logprobs": 9}, "logprobs"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"), ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix")])
async def test_malformed_completion_requests_get_400(proxy, body, param):
    s = proxy.open_session("g0-0")
    r = await raw(proxy, s.key, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_streaming_and_non_streaming_give_the_same_tokens(proxy, oai):
    a, b = proxy.open_session("g0-0"), proxy.open_session("g0-1")
    full = await oai(a).chat.completions.create(model="m", messages=USER, max_tokens=10, logprobs=True)
    stream = await oai(b).chat.completions.create(model="m", messages=USER, max_tokens=10, logprobs=True,
                                                                stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    lps = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert lps == [x.logprob for x in full.choices[0].logprobs.content]
    assert a.records[0].output_ids == b.records[0].output_ids and a.records[0].prompt_ids == b.records[0].prompt_ids

    c, d = proxy.open_session("g0-2"), proxy.open_session("g0-3")
    t1 = await oai(c).completions.create(model="m", prompt="Once upon a time", max_tokens=8, logprobs=1)
    t2 = [x async for x in await oai(d).completions.create(model="m", prompt="Once upon a time",
                                                                          max_tokens=8, stream=True)]
    assert "".join(x.choices[0].text for x in t2) == t1.choices[0].text
    assert c.records[0].output_ids == d.records[0].output_ids
    assert len(t1.choices[0].logprobs.token_logprobs) == t1.usage.completion_tokens


async def test_stop_strings_cut_the_engines_ids_at_a_prefix(proxy, oai, proxy_tokenizer):
    a = proxy.open_session("g0-0")
    full = await oai(a).chat.completions.create(model="m", messages=USER, max_tokens=12)
    text, ids = full.choices[0].message.content, a.records[0].output_ids
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"greedy output {text!r} too short for a stop string"
    b = proxy.open_session("g0-1")
    cut = await oai(b).chat.completions.create(model="m", messages=USER, max_tokens=12, stop=[stop])
    kept = b.records[0].output_ids
    assert ids[: len(kept)] == kept and len(kept) < len(ids)
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].message.content
    assert text.startswith(cut.choices[0].message.content)
    assert b.records[0].logprobs == a.records[0].logprobs[: len(kept)]


async def test_text_completions_continue_exact_ids_and_merge(proxy, oai):
    s = proxy.open_session("g0-0")
    client = oai(s)
    r1 = await client.completions.create(model="m", prompt="Q: 2+2?\nA:", max_tokens=5)
    await client.completions.create(model="m", prompt="Q: 2+2?\nA:" + r1.choices[0].text + "\nQ: 3+3?\nA:", max_tokens=5)
    assert s.records[1].prompt_ids[: len(s.records[0].prompt_ids) + len(s.records[0].output_ids)] == \
        s.records[0].prompt_ids + s.records[0].output_ids
    (traj, chain), = s.trajectories(uid="u", episode_reward=1.0, discount=1.0, group_id="g")
    assert chain.records == [0, 1] and len(runs(traj.loss_mask.numpy().tolist(), traj.response_ids.numpy().tolist())) == 2


async def test_rewritten_history_yields_separate_trajectories_not_wrong_ones(proxy, oai, proxy_tokenizer):
    s = proxy.open_session("g0-0")
    client = oai(s)
    r1 = await client.chat.completions.create(model="m", messages=USER, max_tokens=6)
    edited = {"role": "assistant", "content": "I rewrote this: " + r1.choices[0].message.content}
    await client.chat.completions.create(model="m", messages=USER + [edited, {"role": "user", "content": "More."}],
                                         max_tokens=6)
    built = s.trajectories(uid="g0-0", episode_reward=1.0, discount=0.5, group_id="g0")
    assert [c.records for _, c in built] == [[1], [0]]
    (last, _), (first, _) = built
    assert (last.uid, last.reward, first.uid, first.reward) == ("g0-0", 1.0, "g0-0-c1", 0.5)
    chat = ChatFormat(proxy_tokenizer)
    assert last.prompt_ids.numpy().tolist() == chat.prompt_ids(USER + [edited, {"role": "user", "content": "More."}])
    for t, rec in ((last, s.records[1]), (first, s.records[0])):
        assert t.response_ids.numpy().tolist() == rec.output_ids and t.loss_mask.numpy().all()


async def test_tool_calls_are_parsed_and_map_back_to_the_generated_ids(proxy_tokenizer):
    tok = proxy_tokenizer
    call_text = '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4+5"}}</tool_call>'
    engine = ScriptedEngine(tok, [call_text, "Answer: 17", call_text])
    async with ProxyServer(engine, tok, agent_cfg(max_turn_tokens=64)) as proxy:
        s = proxy.open_session("g0-0")
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s.key, max_retries=0)
        msgs = list(USER)
        r1 = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC])
        choice = r1.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "calculator" and json.loads(tc.function.arguments) == {"expression": "3*4+5"}
        msgs += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "17"}]
        r2 = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC])
        assert r2.choices[0].message.content == "Answer: 17" and r2.choices[0].finish_reason == "stop"
        chunks = [c async for c in await client.chat.completions.create(model="m", messages=USER, tools=[CALC],
                                                                         stream=True)]
        streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
        assert [(t.function.name, t.function.arguments) for t in streamed] == [(tc.function.name, tc.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        await client.close()
    ids1 = engine.script[0]
    delta = tok.encode("\n<|im_start|>tool\n17<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    p1 = engine.calls[0][0]
    assert engine.calls[1][0] == p1 + ids1 + delta  # the call's ids as generated, never re-rendered
    built = s.trajectories(uid="g0-0", episode_reward=1.0, discount=1.0, group_id="g0")
    traj, chain = built[1] if built[0][1].records == [2] else built[0]
    assert chain.records == [0, 1]
    assert traj.response_ids.numpy().tolist() == ids1 + delta + engine.script[1]
    assert traj.loss_mask.numpy().tolist() == [1] * len(ids1) + [0] * len(delta) + [1] * len(engine.script[1])


async def test_a_body_over_the_context_budget_is_413_before_it_is_parsed(proxy, oai, monkeypatch):
    """A body that cannot fit the context is refused by its size, by Content-Length or as it streams in
    (chunked, no length), before a byte of it is parsed or tokenized; the episode goes on."""
    from asyncrl.proxy import server as server_mod

    s = proxy.open_session("g9-0")
    limit = proxy.max_body_bytes
    assert limit == server_mod.max_body_bytes(proxy.cfg, proxy.tok) and limit < 64 << 20
    parsed: list[bytes] = []
    real_parse = server_mod.parse_body
    monkeypatch.setattr(server_mod, "parse_body", lambda raw: parsed.append(raw) or real_parse(raw))
    filler = "x" * (limit + 1 - len(json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]})))
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": filler}]})
    assert len(big) == limit + 1
    r = await raw(proxy, s.key, "/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    async def chunks():
        for _ in range(limit // (1 << 16) + 2):
            yield b"x" * (1 << 16)

    headers = {"Authorization": f"Bearer {s.key}"}
    async with httpx.AsyncClient(base_url=proxy.base_url.removesuffix("/v1"), headers=headers, timeout=60) as h:
        r = await h.post("/v1/completions", content=chunks())
    assert r.status_code == 413 and "content-length" not in r.request.headers, r.text
    assert parsed == []  # neither body reached the parser
    reply = await oai(s).chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert reply.choices[0].message is not None  # the episode goes on


async def test_a_half_sent_head_is_closed_at_the_deadline(client_engine, proxy_tokenizer, monkeypatch):
    """The proxy serves through asyncrl/util/http_server.py: a connection that never finishes its request's
    head is closed at the deadline (here 0.5 s), before any key is checked; whole requests are served."""
    import socket

    from asyncrl.proxy.server import ProxyServer
    from asyncrl.util import http_server
    from tests.proxy.conftest import agent_cfg

    monkeypatch.setattr(http_server, "HEADER_TIMEOUT_S", 0.5)
    async with ProxyServer(client_engine, proxy_tokenizer, agent_cfg()) as p:
        conn = socket.create_connection((p.host, p.port))
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")
        conn.settimeout(30)
        try:
            assert await asyncio.to_thread(conn.recv, 1) == b""
        except TimeoutError:
            pytest.fail("a half-sent request was held open for 30 s")
        finally:
            conn.close()
        r = await raw(p, "", "/v1/models", None, method="GET")
        assert r.status_code == 401  # whole requests still get their answer
