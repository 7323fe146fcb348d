"""search tool against a real HTTP retrieval server (http.server in a thread) speaking Search-R1's shape."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncrl.agents.base import run_episode
from asyncrl.tools.base import ToolError
from asyncrl.tools.search import SearchTool, format_hits

from ..agents.helpers import call, make_ctx, make_sample
from ..agents.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(60)

CORPUS = ["Paris is the capital of France.", "Berlin is the capital of Germany.", "The Seine flows through Paris."]


class Retriever(BaseHTTPRequestHandler):
    fail_first = 0  # how many requests answer 500 before the server works
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(500)
            self.end_headers()
            return
        result = []
        for q in body["queries"]:
            words = set(q.lower().split())
            scored = sorted(((len(words & set(d.lower().rstrip(".").split())), i) for i, d in enumerate(CORPUS)), reverse=True)
            result.append([{"document": {"id": str(i), "contents": CORPUS[i]}, "score": float(s)} for s, i in scored[: body["topk"]]])
        data = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Retriever.fail_first, Retriever.requests = 0, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Retriever)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_format_hits():
    hits = [{"document": {"id": "1", "contents": "A."}, "score": 0.5}, {"document": {"id": "2", "contents": " B. "}}]
    assert format_hits(hits) == "Doc 1 (score 0.5): A.\nDoc 2: B."
    assert format_hits([]) == "No results."


async def test_retrieves_with_retries(server):
    Retriever.fail_first = 1
    tool = SearchTool({"url": server, "topk": 2, "max_retries": 2})
    text, reward, m = await tool.execute("i", {"query": "capital of France"})
    assert text == "Doc 1 (score 3): Paris is the capital of France.\nDoc 2 (score 2): Berlin is the capital of Germany."
    assert m == {"hits": 2.0} and reward == 0.0
    assert [r[0] for r in Retriever.requests] == ["/retrieve", "/retrieve"]
    assert Retriever.requests[-1][1] == {"queries": ["capital of France"], "topk": 2, "return_scores": True}
    # the search_r1 env's override shape (retrieval_service_url ending in /retrieve) works the same
    env_shaped = SearchTool({"retrieval_service_url": server + "/retrieve", "topk": 1})
    assert (await env_shaped.execute("i", {"query": "Berlin Germany"}))[0] == "Doc 1 (score 2): Berlin is the capital of Germany."
    text, _, _ = await tool.execute("i", {"query_list": ["Seine", "Berlin"]})
    assert text.startswith("Results for 'Seine':\nDoc 1 (score 1): The Seine flows through Paris.")


async def test_gives_up_with_a_tool_error(server):
    Retriever.fail_first = 5
    tool = SearchTool({"url": server, "max_retries": 1})
    with pytest.raises(ToolError, match=r"failed after 2 attempts \(HTTP 500\)"):
        await tool.execute("i", {"query": "x"})
    with pytest.raises(ToolError, match="ConnectError"):
        await SearchTool({"url": "http://127.0.0.1:9", "max_retries": 0}).execute("i", {"query": "x"})
    with pytest.raises(ToolError, match="no retrieval server url"):
        await SearchTool({}).execute("i", {"query": "x"})


async def test_search_in_an_episode_with_the_url_from_overrides(tokenizer, server):
    engine = ScriptedEngine(tokenizer, [call("search", {"query": "capital of France"}), "Answer: Paris"])
    ctx, _ = make_ctx(tokenizer, engine, tools=[{"class_name": "search", "config": {"topk": 1}}])
    ctx.tool_overrides = {"search": {"url": server}}
    traj = await run_episode(make_sample(ground_truth="Paris"), ctx, "tool_agent")
    assert traj.messages[3]["content"] == "Doc 1 (score 3): Paris is the capital of France."
    assert traj.reward == 1.0 and traj.metrics["tool/search/hits"] == 1.0
