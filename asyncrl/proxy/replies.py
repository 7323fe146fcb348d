"""OpenAI's reply shapes: chat completions, text completions, their stream chunks, the model list.

Streams are cut from the finished generation (the engine's /generate is not streamed): one chunk
with the role, one per output token whose text is complete (a token that ends inside a UTF-8
character waits for the next), the tool calls, the finish reason, then `usage` when
`stream_options.include_usage`, and `data: [DONE]`. The concatenated deltas equal the
non-streamed reply's content exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

from .session import CallRecord


def usage(rec: CallRecord) -> dict[str, int]:
    p, c = len(rec.prompt_ids), len(rec.output_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def openai_finish(rec: CallRecord) -> str:
    if rec.tool_calls:
        return "tool_calls"
    return "length" if rec.finish_reason in ("length", "abort") else "stop"


def token_logprobs(rec: CallRecord, decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    out = []
    for t, lp in zip(rec.output_ids, rec.logprobs):
        s = decode([t])
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []})
    return out


def text_pieces(ids: list[int], decode: Callable[[list[int]], str], text: str) -> list[tuple[str, int, int]]:
    """(piece, first token, end token) per streamed delta; the pieces concatenate to `text`."""
    pieces, prev, start = [], "", 0
    for i in range(len(ids)):
        cur = decode(ids[: i + 1])
        if cur.startswith(prev) and not cur.endswith("\ufffd") and len(cur) > len(prev) and text.startswith(cur):
            pieces.append((cur[len(prev):], start, i + 1))
            prev, start = cur, i + 1
    if prev != text:  # whatever did not come out token by token (never more than the tail)
        pieces.append((text[len(prev):], start, len(ids)))
    return pieces


def chat_reply(rec: CallRecord, model: str, with_logprobs: bool, decode: Callable[[list[int]], str],
               fingerprint: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": rec.content, "refusal": None}
    if rec.tool_calls:
        msg["tool_calls"] = rec.tool_calls
    return {"id": rec.id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": msg, "finish_reason": openai_finish(rec),
                         "logprobs": {"content": token_logprobs(rec, decode), "refusal": None} if with_logprobs else None}],
            "usage": usage(rec)}


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def chat_chunks(rec: CallRecord, model: str, with_logprobs: bool, include_usage: bool,
                decode: Callable[[list[int]], str], fingerprint: str) -> Iterator[bytes]:
    created = int(time.time())
    lps = token_logprobs(rec, decode) if with_logprobs else None

    def chunk(delta: dict[str, Any], finish: Optional[str] = None, logprobs: Optional[list] = None) -> bytes:
        c: dict[str, Any] = {"id": rec.id, "object": "chat.completion.chunk", "created": created, "model": model,
                             "system_fingerprint": fingerprint,
                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                          "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}]}
        if include_usage:
            c["usage"] = None
        return sse(c)

    yield chunk({"role": "assistant", "content": ""})
    if rec.tool_calls:
        if rec.content:
            yield chunk({"content": rec.content}, logprobs=lps)
        yield chunk({"tool_calls": [dict(c, index=k) for k, c in enumerate(rec.tool_calls)]},
                    logprobs=None if rec.content else lps)
    else:
        for piece, a, b in text_pieces(rec.output_ids, decode, rec.content or ""):
            yield chunk({"content": piece}, logprobs=lps[a:b] if lps is not None else None)
    yield chunk({}, finish=openai_finish(rec))
    if include_usage:
        yield sse({"id": rec.id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "system_fingerprint": fingerprint, "choices": [], "usage": usage(rec)})
    yield DONE


def completion_logprobs(rec: CallRecord, decode: Callable[[list[int]], str], a: int = 0,
                        b: Optional[int] = None) -> dict[str, Any]:
    ids, lps = rec.output_ids[a:b], rec.logprobs[a:b]
    tokens = [decode([t]) for t in ids]
    offsets, pos = [], len(rec.prompt_text) + len(decode(rec.output_ids[:a]))
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": None, "text_offset": offsets}


def completion_reply(rec: CallRecord, model: str, logprobs: Optional[int], decode: Callable[[list[int]], str]) -> dict:
    return {"id": rec.id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": rec.text, "finish_reason": openai_finish(rec),
                         "logprobs": completion_logprobs(rec, decode) if logprobs is not None else None}],
            "usage": usage(rec)}


def completion_chunks(rec: CallRecord, model: str, logprobs: Optional[int], include_usage: bool,
                      decode: Callable[[list[int]], str]) -> Iterator[bytes]:
    created = int(time.time())
    pieces = text_pieces(rec.output_ids, decode, rec.text) or [("", 0, 0)]
    for k, (piece, a, b) in enumerate(pieces):
        c: dict[str, Any] = {"id": rec.id, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": piece,
                                          "finish_reason": openai_finish(rec) if k == len(pieces) - 1 else None,
                                          "logprobs": completion_logprobs(rec, decode, a, b) if logprobs is not None else None}]}
        if include_usage:
            c["usage"] = None
        yield sse(c)
    if include_usage:
        yield sse({"id": rec.id, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": usage(rec)})
    yield DONE


def model_list(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "asyncrl"}]}
