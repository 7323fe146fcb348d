"""The embedded engine over real HTTP: exactness, finish reasons, abort, pause, batching, validation."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from tests.engine.conftest import (
    greedy_path,
    greedy_reference,
    post,
    stats,
    teacher_forced_logprobs,
    wait_tokens,
)

PROMPTS = [[1, 2, 3, 4, 5], list(range(200, 260)), [42], list(range(5000, 5013))]


def gen_body(ids, rid=None, logprob=True, **sp):
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": logprob}
    if rid:
        body["rid"] = rid
    return body


async def generate(url, ids, **sp):
    r = await post(url, "/generate", gen_body(ids, **sp))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(120)
async def test_greedy_equals_transformers_generate_token_by_token(engine, tiny_model):
    lens = [17, 9, 30, 12]
    # one at a time, then all together (rows of different lengths share the decode forward)
    solo = [await generate(engine.url, p, temperature=0, max_new_tokens=n, min_new_tokens=n)
            for p, n in zip(PROMPTS, lens)]
    together = await asyncio.gather(*[generate(engine.url, p, temperature=0, max_new_tokens=n, min_new_tokens=n)
                                      for p, n in zip(PROMPTS, lens)])
    for p, n, a, b in zip(PROMPTS, lens, solo, together):
        ref = greedy_reference(tiny_model, p, n)
        assert a["output_ids"] == ref
        assert b["output_ids"] == ref
        assert a["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert a["meta_info"]["prompt_tokens"] == len(p) and a["meta_info"]["completion_tokens"] == n
        assert [t for _, t, _ in a["meta_info"]["output_token_logprobs"]] == ref
        assert a["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": n}]
        assert a["meta_info"]["weight_version"] == "0"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, -1), (0.7, 0.9, 50), (1.3, 1.0, -1)])
async def test_logprobs_equal_teacher_forced_forward(engine, tiny_model, temperature, top_p, top_k):
    outs = await asyncio.gather(*[generate(engine.url, p, temperature=temperature, top_p=top_p, top_k=top_k,
                                           max_new_tokens=24, min_new_tokens=24, sampling_seed=i)
                                  for i, p in enumerate(PROMPTS)])
    for p, o in zip(PROMPTS, outs):
        got = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        ref = teacher_forced_logprobs(tiny_model, p, o["output_ids"], temperature)
        assert len(got) == 24
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4


@pytest.mark.timeout(60)
async def test_seeded_sampling_is_reproducible(engine):
    a = await generate(engine.url, PROMPTS[1], temperature=1.0, max_new_tokens=20, sampling_seed=123)
    b, _c = await asyncio.gather(generate(engine.url, PROMPTS[1], temperature=1.0, max_new_tokens=20, sampling_seed=123),
                                generate(engine.url, PROMPTS[0], temperature=1.0, max_new_tokens=20, sampling_seed=5))
    d = await generate(engine.url, PROMPTS[1], temperature=1.0, max_new_tokens=20, sampling_seed=124)
    assert a["output_ids"] == b["output_ids"]
    # b shared its decode forwards with c (padded batch): same tokens, logprobs equal up to float rounding
    la, lb = ([x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in (a, b))
    assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
    assert a["output_ids"] != d["output_ids"]


@pytest.mark.timeout(60)
async def test_stop_token_and_length(engine, tiny_model):
    p = list(range(300, 340))
    ref = greedy_reference(tiny_model, p, 20)
    # stop at the first occurrence of the 4th distinct token of the greedy path
    k = next(i for i, t in enumerate(ref) if len(set(ref[: i + 1])) == min(3, len(set(ref))))
    stop = ref[k]
    o = await generate(engine.url, p, temperature=0, max_new_tokens=20, stop_token_ids=[stop])
    assert o["output_ids"] == ref[: k + 1]
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # min_new_tokens bans the stop token until reached
    o = await generate(engine.url, p, temperature=0, max_new_tokens=20, min_new_tokens=k + 3, stop_token_ids=[stop])
    assert len(o["output_ids"]) >= k + 3 and stop not in o["output_ids"][: k + 2]
    o = await generate(engine.url, p, temperature=0, max_new_tokens=7)
    assert o["output_ids"] == ref[:7] and o["meta_info"]["finish_reason"]["type"] == "length"
    o = await generate(engine.url, p, temperature=0, max_new_tokens=0)
    assert o["output_ids"] == [] and o["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.timeout(60)
async def test_abort_returns_partial_output(engine, tiny_model):
    p = list(range(700, 720))
    before = (await stats(engine.url))["tokens_out"]
    task = asyncio.create_task(post(engine.url, "/generate", gen_body(p, rid="abort-me", temperature=0,
                                                                       max_new_tokens=3000, min_new_tokens=3000)))
    await wait_tokens(engine.url, before + 5)
    r = await post(engine.url, "/abort_request", {"rid": "abort-me"})
    assert r.status_code == 200 and r.content == b""  # SGLang: 200, empty body
    o = (await task).json()
    n = len(o["output_ids"])
    assert o["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= n < 3000 and len(o["meta_info"]["output_token_logprobs"]) == n
    assert greedy_path(tiny_model, p, o["output_ids"]) == o["output_ids"]
    assert o["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": n}]


@pytest.mark.timeout(90)
async def test_pause_in_place_keeps_and_completes(engine, tiny_model):
    ps = [list(range(900, 910)), list(range(950, 990))]
    before = (await stats(engine.url))["tokens_out"]
    tasks = [asyncio.create_task(generate(engine.url, p, temperature=0, max_new_tokens=300, min_new_tokens=300))
             for p in ps]
    await wait_tokens(engine.url, before + 4)
    assert (await post(engine.url, "/pause_generation", {"mode": "in_place"})).json()["success"]
    frozen = await stats(engine.url)
    late = asyncio.create_task(generate(engine.url, [7, 7, 7], temperature=0, max_new_tokens=5))
    await asyncio.sleep(0.5)
    still = await stats(engine.url)
    assert still["tokens_out"] == frozen["tokens_out"] and still["paused"]
    assert still["running"] == 2 and still["waiting"] == 1  # caches and queue kept
    assert not any(t.done() for t in tasks) and not late.done()
    await post(engine.url, "/continue_generation", {})
    outs = await asyncio.gather(*tasks)
    for p, o in zip(ps, outs):
        assert o["meta_info"]["finish_reason"]["type"] == "length"
        assert len(o["output_ids"]) == 300 and greedy_path(tiny_model, p, o["output_ids"]) == o["output_ids"]
    late_ids = (await late)["output_ids"]
    assert len(late_ids) == 5 and greedy_path(tiny_model, [7, 7, 7], late_ids) == late_ids


@pytest.mark.timeout(90)
async def test_pause_abort_returns_partials_and_keeps_serving(engine, tiny_model):
    ps = [list(range(1100, 1110)), list(range(1200, 1205))]
    before = (await stats(engine.url))["tokens_out"]
    tasks = [asyncio.create_task(generate(engine.url, p, temperature=0, max_new_tokens=2000, min_new_tokens=2000))
             for p in ps]
    await wait_tokens(engine.url, before + 6)
    await post(engine.url, "/pause_generation", {"mode": "abort"})
    outs = await asyncio.gather(*tasks)
    for p, o in zip(ps, outs):
        n = len(o["output_ids"])
        assert o["meta_info"]["finish_reason"]["type"] == "abort" and 0 < n < 2000
        assert greedy_path(tiny_model, p, o["output_ids"]) == o["output_ids"]
    queued = asyncio.create_task(generate(engine.url, [3, 1, 4], temperature=0, max_new_tokens=6))
    await asyncio.sleep(0.3)
    assert not queued.done()  # a paused engine keeps new requests queued
    await post(engine.url, "/continue_generation", {})
    q = (await queued)["output_ids"]
    assert len(q) == 6 and greedy_path(tiny_model, [3, 1, 4], q) == q


@pytest.mark.timeout(120)
async def test_short_requests_finish_before_long_ones(engine):
    rng = random.Random(0)
    long_n, short_n = 80, 5
    specs = [("long", long_n)] * 2 + [("short", short_n)] * 6
    rng.shuffle(specs)
    order = []

    async def one(i, kind, n):
        p = [rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))]
        r = await post(engine.url, "/generate", {**gen_body(p, temperature=0, max_new_tokens=n, min_new_tokens=n),
                                                 "return_token_times": True})
        order.append(kind)
        return kind, r.json()

    results = await asyncio.gather(*[one(i, k, n) for i, (k, n) in enumerate(specs)])
    assert order == ["short"] * 6 + ["long"] * 2
    times = {k: [o["meta_info"]["output_token_times"] for kk, o in results if kk == k] for k in ("long", "short")}
    first_long_token = max(t[0] for t in times["long"])
    last_short_token = max(t[-1] for t in times["short"])
    # the long requests were already decoding while the short ones ran, and the short ones ended first
    assert first_long_token < last_short_token < min(t[-1] for t in times["long"])
    assert all(len(t) == long_n for t in times["long"]) and all(len(t) == short_n for t in times["short"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body,needle", [
    (b"{not json", "malformed JSON"),
    ({"input_ids": []}, "non-empty list"),
    ({"input_ids": [1, 49152]}, "input_ids[1]=49152"),
    ({"input_ids": [1, -3]}, "input_ids[1]=-3"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be >= 0"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature must be >= 0"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"tempreature": 1}}, "unknown sampling_params"),
    ({"input_ids": [1], "sampling_params": {"seed": 1}}, "unknown sampling_params ['seed']"),  # SGLang: sampling_seed
    ({"input_ids": [1], "sampling_params": {"sampling_seed": "1"}}, "sampling_seed must be an integer"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}, "sampling_seed must be in"),
    ({"input_ids": [1], "rid": 5}, "rid must be a non-empty string"),
    ({"input_ids": [1] * 100_000}, "tokens"),
    (b"[1, 2]", "JSON object"),
])
async def test_bad_requests_get_400_and_server_keeps_serving(engine, body, needle):
    r = await post(engine.url, "/generate", body)
    assert r.status_code == 400
    assert needle in r.json()["error"]
    ok = await generate(engine.url, [1, 2], temperature=0, max_new_tokens=2)
    assert len(ok["output_ids"]) == 2


@pytest.mark.timeout(60)
async def test_live_duplicate_rid_is_refused_like_sglang(engine):
    """SGLang's TokenizerManager raises 'Duplicate request ID detected' (400) for a live rid; a finished
    rid may be used again."""
    before = (await stats(engine.url))["tokens_out"]
    first = asyncio.create_task(post(engine.url, "/generate", gen_body([9, 8, 7], rid="dup-1", temperature=0,
                                                                       max_new_tokens=3000, min_new_tokens=3000)))
    await wait_tokens(engine.url, before + 2)
    r = await post(engine.url, "/generate", gen_body([9, 8, 7], rid="dup-1", max_new_tokens=2))
    assert r.status_code == 400 and "Duplicate request ID detected: dup-1" in r.text
    await post(engine.url, "/abort_request", {"rid": "dup-1"})
    assert (await first).json()["meta_info"]["finish_reason"]["type"] == "abort"
    r = await post(engine.url, "/generate", gen_body([1, 1], rid="dup-1", max_new_tokens=2))
    assert r.status_code == 200


@pytest.mark.timeout(60)
async def test_abort_matches_rids_by_prefix_like_sglang(engine):
    """SGLang's scheduler aborts every request whose rid startswith the given one: aborting "pfx-t1"
    also ends "pfx-t10" (which is why asyncrl's own rids are never prefixes of each other)."""
    before = (await stats(engine.url))["tokens_out"]
    body = dict(temperature=0, max_new_tokens=3000, min_new_tokens=3000)
    tasks = {rid: asyncio.create_task(post(engine.url, "/generate", gen_body([5, 5, i + 1], rid=rid, **body)))
             for i, rid in enumerate(["pfx-t1", "pfx-t10", "other-t1"])}
    await wait_tokens(engine.url, before + 6)
    await post(engine.url, "/pause_generation", {"mode": "in_place"})  # nothing finishes by itself now
    for bad in ({"rid": 7}, {"abort_all": "yes"}, [1]):
        assert (await post(engine.url, "/abort_request", bad)).status_code == 400
    r = await post(engine.url, "/abort_request", {"rid": ""})  # SGLang ignores an empty rid
    assert r.status_code == 200 and r.content == b""
    r = await post(engine.url, "/abort_request", {"rid": "pfx-t1"})
    assert r.status_code == 200 and r.content == b""
    for rid in ("pfx-t1", "pfx-t10"):
        assert (await tasks[rid]).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert not tasks["other-t1"].done()
    r = await post(engine.url, "/abort_request", {"rid": "no-such-rid"})  # nothing live: still 200
    assert r.status_code == 200 and r.content == b""
    await post(engine.url, "/abort_request", {"rid": "other-t1"})
    await post(engine.url, "/continue_generation", {})
    assert (await tasks["other-t1"]).json()["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.timeout(120)
async def test_nan_temperature_gets_400_and_requests_in_flight_complete(engine):
    """JSON NaN (which Python's json accepts) is refused at parse time with a 400 naming the field;
    the requests already in the running batch are untouched and finish normally."""
    before = (await stats(engine.url))["tokens_out"]
    running = [asyncio.create_task(generate(engine.url, [7, 7, i + 1], temperature=1.0, sampling_seed=i,
                                            max_new_tokens=12, min_new_tokens=12)) for i in range(3)]
    await wait_tokens(engine.url, before + 3)
    for raw, field in ((b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "temperature"),
                       (b'{"input_ids": [1, 2], "sampling_params": {"top_p": Infinity}}', "top_p")):
        r = await post(engine.url, "/generate", raw)
        assert r.status_code == 400, r.text
        assert f"sampling_params.{field} must be a finite number" in r.json()["error"]
    for out in await asyncio.gather(*running):
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert len(out["output_ids"]) == 12


@pytest.mark.timeout(180)
async def test_one_token_probe_is_answered_while_the_batch_is_full(engine):
    """A one-token request (the supervisor's liveness probe) ends at its prefill, so it is admitted at the
    next step boundary even while every running slot is taken and requests wait in the queue."""
    body = dict(temperature=0, max_new_tokens=3000, min_new_tokens=3000)
    before = (await stats(engine.url))["tokens_out"]
    hogs = [asyncio.create_task(post(engine.url, "/generate", gen_body([3, 3, i + 1], rid=f"hog-{i}", **body)))
            for i in range(17)]  # the shared engine runs 16 at a time: one waits
    await wait_tokens(engine.url, before + 16)
    assert (await stats(engine.url))["waiting"] >= 1
    probe = await generate(engine.url, [0], temperature=0, max_new_tokens=1)
    assert len(probe["output_ids"]) == 1
    assert (await stats(engine.url))["waiting"] >= 1  # answered ahead of the queue
    await post(engine.url, "/abort_request", {"rid": "hog-"})
    for h in hogs:
        assert (await h).json()["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.timeout(240)
@pytest.mark.heavy(21)
def test_engine_watch_counts_probes_skips_paused_and_kills_a_stopped_engine(engine_model_dir):
    """The supervisor's liveness check on a real engine process: a probe that a paused engine cannot
    answer is not counted; a SIGSTOPped engine (alive to `poll`, answering nothing) fails its probes,
    and at the limit its process group is SIGKILLed and the check answers False."""
    import httpx

    from asyncrl.engine.launcher import launch_embedded
    from asyncrl.run.engine_watch import EngineWatch

    proc = launch_embedded(engine_model_dir, max_running_seqs=4, threads=1, startup_timeout_s=120)
    try:
        watch = EngineWatch(proc, probe_timeout_s=3.0, max_failures=2)
        assert watch.check() and watch.failures == 0
        httpx.post(f"{proc.url}/pause_generation", json={"mode": "in_place"}, timeout=30)
        assert watch.check() and watch.failures == 0  # the probe waited on the pause: not counted
        httpx.post(f"{proc.url}/continue_generation", json={}, timeout=30)
        os.kill(proc.pid, signal.SIGSTOP)
        assert watch.check() and watch.failures == 1  # one failure is tolerated
        assert not watch.check()  # the second: hung, killed
        assert proc.proc.poll() == -signal.SIGKILL
        assert not watch.check()
    finally:
        proc.stop()


@pytest.mark.timeout(60)
async def test_a_body_past_the_context_is_413_unparsed_and_a_completion_past_it_is_400(engine):
    """The engine reads at most its context in token ids (JSON-written) plus 1 MiB, by Content-Length or as
    the body streams in, before parsing a byte; a request whose input_ids plus max_new_tokens pass the
    model's context is refused with SGLang's words; the engine keeps serving."""
    import httpx

    from asyncrl.engine.server import max_body_bytes
    from asyncrl.util.auth import auth_headers

    limit = max_body_bytes(4096)  # the tiny model's max_position_embeddings
    big = b'{"input_ids": [' + b"1, " * (limit // 3) + b'1]}'
    r = await post(engine.url, "/generate", big)
    assert r.status_code == 413 and f"over this server's limit of {limit} bytes" in r.json()["error"], r.text

    async def chunks():
        for _ in range(limit // (1 << 16) + 2):
            yield b" " * (1 << 16)

    async with httpx.AsyncClient(timeout=60, headers=auth_headers()) as h:
        r = await h.post(engine.url + "/generate", content=chunks())
    assert r.status_code == 413 and "content-length" not in r.request.headers, r.text
    for ids, n in (([1, 2, 3], 10**12), (list(range(1, 4001)), 97)):
        r = await post(engine.url, "/generate", gen_body(ids, max_new_tokens=n))
        assert r.status_code == 400, r.text
        assert (f"exceeds the model's maximum context length of 4096 tokens. You requested a total of {len(ids) + n} "
                f"tokens") in r.json()["error"]
    out = await generate(engine.url, list(range(1, 4001)), temperature=0, max_new_tokens=96)  # exactly the context
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")


@pytest.mark.timeout(90)
async def test_a_generation_whose_client_left_is_aborted(engine):
    """A client that sends /generate and hangs up: the engine aborts that generation (SGLang does, when its
    client disconnects) rather than decoding thousands of tokens nobody reads. The engine is paused first,
    so the generation cannot end any other way."""
    import socket
    import time
    from urllib.parse import urlsplit

    from asyncrl.util.auth import auth_headers

    before = (await stats(engine.url))["tokens_out"]
    url = urlsplit(engine.url)
    body = __import__("json").dumps(gen_body([4, 4, 4], rid="left-1", temperature=0, max_new_tokens=3000,
                                             min_new_tokens=3000)).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in auth_headers().items())
    conn = socket.create_connection((url.hostname, url.port))
    conn.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await wait_tokens(engine.url, before + 2)
    await post(engine.url, "/pause_generation", {"mode": "in_place"})  # nothing finishes by itself now
    try:
        assert (await stats(engine.url))["running"] == 1
        conn.close()
        deadline = time.monotonic() + 30
        while (await stats(engine.url))["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (await stats(engine.url))["running"] == 0, "the generation went on after its client left"
    finally:
        await post(engine.url, "/continue_generation", {})


@pytest.mark.timeout(90)
def test_half_sent_heads_are_closed_at_the_deadline_while_health_answers(engine):
    """5,000 half-sent requests once held an engine's connections for over a minute: now each connection
    must finish its head within 10 s (asyncrl/util/http_server.py), and /health answers meanwhile."""
    import socket
    from urllib.parse import urlsplit

    import httpx

    url = urlsplit(engine.url)
    conns = [socket.create_connection((url.hostname, url.port)) for _ in range(50)]
    for c in conns:
        c.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert httpx.get(engine.url + "/health", timeout=10).json() == {"status": "ok"}
    for c in conns:
        c.settimeout(60)
        try:
            assert c.recv(1) == b"", "the engine answered a request whose head never ended"
        except TimeoutError:
            pytest.fail("a half-sent request was held open for 60 s")
        finally:
            c.close()
