"""A small streaming client for OpenAI-compatible servers: TTFT and friends.

Runs in the demo, tests and benchmarks. :func:`stream_chat` and
:func:`stream_completion` send one streaming request and return a
:class:`RequestResult`; time to first token is measured from just before the
request is sent to the first chunk that carries a generated token, as
vLLM's own benchmark does: a completion chunk with a ``text`` field, even
empty (a token that decodes to nothing yet: part of a UTF-8 character, a
special token), or a chat delta other than the role-only first one
(content or reasoning). A stream that reports an error or ends before
``[DONE]`` is a failed request.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.tools.server import parse_metrics


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the server does not say (vLLM without --enable-prompt-tokens-details)
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    token_chunks: int = 0  # chunks that carried a generated token (the first one sets ttft_s)


def absorb_chunk(res: Any, chunk: dict, t0: float, last: float) -> float:
    """Add one streamed chunk to ``res`` (text, TTFT, inter-token gaps, usage);
    returns the time of the latest token. ``res`` has the fields of
    :class:`RequestResult`."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            piece = delta.get("content") or ""
            # vLLM's first chat chunk names the role with empty content.
            token = bool(piece or delta.get("reasoning_content") or delta.get("reasoning")) \
                or ("role" not in delta and "content" in delta)
        else:
            piece = choice.get("text") or ""
            token = "text" in choice
        if token:
            now = time.perf_counter()
            if res.token_chunks == 0:
                res.ttft_s = now - t0
            else:
                res.itl_s.append(now - last)
            res.token_chunks += 1
            last = now
        res.text += piece
    usage = chunk.get("usage")
    if usage:
        res.prompt_tokens = usage.get("prompt_tokens") or 0
        res.completion_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        res.cached_tokens = cached if isinstance(cached, int) else None
    return last


def _stream(client: httpx.Client, url: str, body: dict, timeout_s: float) -> RequestResult:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = t0
    done = False
    try:
        with client.stream("POST", url, json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                r.read()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    res.error = f"error in the stream: {str(chunk['error'])[:200]}"
                    return res
                last = absorb_chunk(res, chunk, t0, last)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        res.error = f"{type(err).__name__}: {err}"
        return res
    res.e2e_s = time.perf_counter() - t0
    if not done:
        res.error = "stream ended before [DONE]"
    elif res.token_chunks == 0:
        res.error = "stream ended without output"
    else:
        res.ok = True
    return res


def stream_chat(client: httpx.Client, base_url: str, messages: list[dict], max_tokens: int = 16,
                model: str = "model", timeout_s: float = 600.0, **params: object) -> RequestResult:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **params}
    return _stream(client, base_url + "/v1/chat/completions", body, timeout_s)


def stream_completion(client: httpx.Client, base_url: str, prompt: str | list[int], max_tokens: int = 16,
                      model: str = "model", timeout_s: float = 600.0, **params: object) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **params}
    return _stream(client, base_url + "/v1/completions", body, timeout_s)


def random_prompt(seed: int, n: int, vocab: int) -> list[int]:
    """``n`` token ids drawn from ``seed`` (ids under 16 left out: special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(16, vocab) for _ in range(n)]


QUIET_S = 2.0  # seconds of quiet before a request to another instance: see quiet_ttft


def quiet_ttft(client: httpx.Client, base_url: str, prompt: list[int], gap_s: float,
               max_tokens: int = 4) -> float:
    """TTFT of one completion sent after ``gap_s`` of quiet.

    On a machine with few cores, a vLLM CPU instance that has just answered
    keeps a core busy: its worker busy-polls the engine's shared-memory
    queue for 1 s after the last message it read (vLLM's shm_broadcast
    SpinCondition, ``busy_loop_s=1``), and a ``reset_prefix_cache`` call is
    such a message too. A request to another instance in that time waits
    for the core (TTFTs of 40 ms or 450-800 ms at random, device hits
    included, measured with two instances on two cores). Benchmarks that
    compare single requests across instances wait first, longer than that
    second (:data:`QUIET_S` by default).
    """
    time.sleep(gap_s)
    r = stream_completion(client, base_url, prompt, max_tokens=max_tokens)
    if not r.ok:
        raise RuntimeError(r.error)
    return r.ttft_s


@dataclass(frozen=True)
class HitRates:
    """Prefix-cache hit rates over an interval, from vLLM's counters.

    h1: device prefix cache; h2: external (kvtier) over what the device
    missed; h_all = h1 + (1 - h1) * h2. ``by_source`` counts cached prompt
    tokens per source (device, host, disk, ...).

    vLLM counts an external hit when it schedules the load, before the load
    runs; ``loaded_blocks`` and ``load_errors`` (kvtier's own counters, 0
    on a server without kvtier) say whether those loads then succeeded.
    """

    h1: float
    h2: float
    queries: float
    by_source: dict[str, float]
    external_tokens: float = 0.0
    loaded_blocks: float = 0.0
    load_errors: float = 0.0

    @property
    def h_all(self) -> float:
        return self.h1 + (1 - self.h1) * self.h2


# kvtier's gauges whose names end in _total like counters (they may fall).
_GAUGES_NAMED_TOTAL = frozenset({"kvtier_dram_slots_total", "kvtier_ssd_slots_total"})


def hit_rates(before: dict[str, float], after: dict[str, float]) -> HitRates:
    # A counter lower than before means the server restarted in between
    # and all its counters began again at 0: what they count now is all
    # there is of the interval since (a counter that grew past its old
    # value by then would otherwise give a wrong, smaller delta).
    restarted = any(v < before.get(k, 0.0) for k, v in after.items()
                    if k.startswith(("vllm:", "kvtier_")) and k.partition("{")[0].endswith("_total")
                    and k.partition("{")[0] not in _GAUGES_NAMED_TOTAL)
    if restarted:
        before = {}

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    q1, hits1 = d("vllm:prefix_cache_queries_total"), d("vllm:prefix_cache_hits_total")
    q2, hits2 = d("vllm:external_prefix_cache_queries_total"), d("vllm:external_prefix_cache_hits_total")
    prefix = 'vllm:prompt_tokens_cached_by_source_total{source="'
    by_source = {k[len(prefix):-2]: d(k) for k in after if k.startswith(prefix)}
    return HitRates(hits1 / q1 if q1 else 0.0, hits2 / q2 if q2 else 0.0, q1, by_source, hits2,
                    d("kvtier_blocks_loaded_total"), d("kvtier_load_errors_total"))


def scrape(base_url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)
