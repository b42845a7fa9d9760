"""A small OpenAI-compatible server that misbehaves on request, for testing ``kvtier bench``.

Run as ``python -m tests.integration.flaky_server PORT``. The last word of
the last user message picks the behaviour: ``ok`` streams five tokens,
``error`` answers HTTP 500, ``stall`` never answers, ``cut`` drops the
connection mid-stream, ``empty`` finishes without output, ``midError``
sends an error event inside the stream, ``trickle`` sends a token every
200 ms and never finishes, ``nodone`` sends its tokens and usage and
closes without ``[DONE]``, ``silent`` streams tokens whose text is empty
(as vLLM does for a token that decodes to nothing yet), ``reasoning``
starts with a reasoning delta. Every stream starts with vLLM's role-only
chunk, sent with the first token. /metrics serves counters that grow by fixed
amounts per request, so hit rates are known; /requests returns every
request body received, so tests can check what the client sent.
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

STATE: dict = {"requests": 0, "bodies": []}


def _metrics() -> str:
    n = STATE["requests"]
    return "\n".join([
        "# TYPE vllm:prefix_cache_queries_total counter",
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {100 * n}',
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {50 * n}',
        f'vllm:external_prefix_cache_queries_total{{engine="0",model_name="m"}} {50 * n}',
        f'vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} {25 * n}',
        f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="m",source="host"}} {25 * n}',
        f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="m",source="device"}} {50 * n}',
        "",
    ])


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=_metrics())


async def bodies(request: web.Request) -> web.Response:
    return web.json_response(STATE["bodies"])


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "flaky-model"}]})


def _chunk(text: str, field: str = "content") -> bytes:
    return f"data: {json.dumps({'choices': [{'delta': {field: text}}]})}\n\n".encode()


ROLE_CHUNK = f"data: {json.dumps({'choices': [{'delta': {'role': 'assistant', 'content': ''}}]})}\n\n".encode()


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    STATE["requests"] += 1
    STATE["bodies"].append(body)
    last = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
    mode = last.split()[-1]
    if mode == "error":
        return web.json_response({"error": "boom"}, status=500)
    if mode == "stall":
        await asyncio.sleep(3600)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if mode == "empty":
        await resp.write(b"data: [DONE]\n\n")
        return resp
    turns = sum(1 for m in body["messages"] if m["role"] == "user")
    await resp.write(ROLE_CHUNK)
    if mode == "trickle":
        for i in range(100000):
            await resp.write(_chunk(f"t{turns}.{i} "))
            await asyncio.sleep(0.2)
    for i in range(5):
        if mode == "silent":
            await resp.write(_chunk(""))
        elif mode == "reasoning" and i == 0:
            await resp.write(_chunk("thinking", "reasoning_content"))
        else:
            await resp.write(_chunk(f"t{turns}.{i} "))
        await asyncio.sleep(0.005)
        if mode == "cut" and i == 2:
            request.transport.close()
            return resp
        if mode == "midError" and i == 2:
            await resp.write(f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n".encode())
            return resp
    usage = {"prompt_tokens": 10 * turns, "completion_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 4 * turns}}
    await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    if mode == "nodone":
        return resp
    await resp.write(b"data: [DONE]\n\n")
    return resp


def main() -> None:
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/requests", bodies)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)


if __name__ == "__main__":
    main()
