"""tool `search`: client of a retrieval server (Search-R1's protocol).

    POST {url}/retrieve  {"queries": [q, ...], "topk": k, "return_scores": true}
    ->   {"result": [[{"document": {"id": ..., "contents": ...}, "score": ...}, ...], ...]}

Config: `url` (required; usually filled at run time from the env's retrieval server through
AgentContext.tool_overrides; verl's `retrieval_service_url` too), `topk` (3), `timeout_s` (10; verl's
`default_timeout` too), `max_retries` (2: connection errors and 5xx replies are retried with 0.2 s *
2^attempt backoff). verl's `num_workers`, `rate_limit` and `enable_global_rate_limit` are accepted and unused. The model's call is {"query": str} (or
{"query_list": [str, ...]}, verl's shape). Hits are formatted as numbered passages:
"Doc 1 (score 0.83): <contents>", one block per query when several are asked.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import httpx

from asyncrl.registry import register
from asyncrl.tools.base import Tool, ToolError


def format_hits(hits: list[dict[str, Any]]) -> str:
    """Numbered passages from one query's hits."""
    if not hits:
        return "No results."
    lines = []
    for i, hit in enumerate(hits, 1):
        doc = hit.get("document") or {}
        contents = str(doc.get("contents", doc.get("text", ""))).strip()
        score = hit.get("score")
        head = f"Doc {i}" + (f" (score {float(score):.3g})" if isinstance(score, (int, float)) else "")
        lines.append(f"{head}: {contents}")
    return "\n".join(lines)


@register("tool", "search")
class SearchTool(Tool):
    name = "search"
    description = "Search a knowledge corpus and return the most relevant passages."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to search for"}},
        "required": ["query"],
    }

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self._client: Optional[httpx.AsyncClient] = None

    def _url(self) -> str:
        url = self.config.get("url") or self.config.get("retrieval_service_url")
        if not url:
            raise ToolError("search tool has no retrieval server url (config 'url' is unset)")
        url = str(url).rstrip("/")
        return url if url.endswith("/retrieve") else url + "/retrieve"

    async def retrieve(self, queries: list[str]) -> list[list[dict[str, Any]]]:
        timeout = float(self.config.get("timeout_s", self.config.get("default_timeout", 10.0)))  # verl's name
        retries = int(self.config.get("max_retries", 2))
        body = {"queries": queries, "topk": int(self.config.get("topk", 3)), "return_scores": True}
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=timeout)
        url, last = self._url(), ""
        for attempt in range(retries + 1):
            try:
                r = await self._client.post(url, json=body)
                if r.status_code < 500:
                    if r.status_code != 200:
                        raise ToolError(f"retrieval server {url} answered {r.status_code}: {r.text[:200]}")
                    result = r.json().get("result")
                    if not isinstance(result, list) or len(result) != len(queries):
                        raise ToolError(f"retrieval server {url} sent a malformed reply: {r.text[:200]}")
                    return result
                last = f"HTTP {r.status_code}"
            except (httpx.TransportError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < retries:
                await asyncio.sleep(0.2 * 2 ** attempt)
        raise ToolError(f"retrieval server {url} failed after {retries + 1} attempts ({last})")

    async def execute(self, instance_id: str, params: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        queries = params.get("query_list") or [params.get("query")]
        if not all(isinstance(q, str) and q.strip() for q in queries):
            raise ToolError(f"query must be a non-empty string, got {queries!r}")
        results = await self.retrieve(list(queries))
        if len(queries) == 1:
            return format_hits(results[0]), 0.0, {"hits": float(len(results[0]))}
        blocks = [f"Results for {q!r}:\n{format_hits(h)}" for q, h in zip(queries, results)]
        return "\n\n".join(blocks), 0.0, {"hits": float(sum(len(h) for h in results))}
