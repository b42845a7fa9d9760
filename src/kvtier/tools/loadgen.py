"""Load client for OpenAI-compatible servers: ``kvtier bench``.

Runs from the command line against any server (vLLM with or without
kvtier, or anything speaking the OpenAI API). A workload is a list of
sessions; a session is one or more user turns. Single-turn QA is a session
of one turn; a multi-turn session sends each turn with all earlier turns
and the server's real answers to them. Workers (``concurrency``) take
sessions from a queue; session starts follow the request rate (Poisson or
fixed intervals, or all at once). No warm-up request is sent unless asked:
a warm-up would fill the very cache being measured.

Per request: TTFT, TPOT, inter-token latencies, end-to-end latency,
prompt/completion/cached tokens. Failures (HTTP errors, timeouts, streams
cut short, empty answers) are counted by kind and kept out of the latency
figures. vLLM's /metrics are read before and after, for the hit rates h1
(device prefix cache), h2 (external) and h_all = h1 + (1 - h1) * h2.
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from kvtier.errors import ConfigError
from kvtier.tools.client import HitRates, absorb_chunk, hit_rates
from kvtier.tools.server import parse_metrics


class Endpoint(str, enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"


class Arrival(str, enum.Enum):
    POISSON = "poisson"
    FIXED = "fixed"


@dataclass
class Session:
    turns: list[str]
    system: str | None = None


@dataclass
class Result:
    session: int
    turn: int
    ok: bool
    error_kind: str = ""  # http, timeout, cut, empty, connect, skipped
    error: str = ""
    start_s: float = 0.0  # since the run's start
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tpot_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the server does not say
    text: str = ""
    token_chunks: int = 0  # chunks that carried a generated token (the first one sets ttft_s)


@dataclass
class BenchOptions:
    url: str
    model: str | None = None  # None: the first of /v1/models
    endpoint: Endpoint = Endpoint.CHAT
    concurrency: int = 1
    request_rate: float = 0.0  # sessions per second; 0: as fast as the workers go
    arrival: Arrival = Arrival.POISSON
    max_tokens: int = 64
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    warmup: int = 0
    seed: int = 0
    label: str = "run"

    def validate(self) -> None:
        try:
            self.endpoint = Endpoint(self.endpoint)
        except ValueError:
            raise ConfigError("--endpoint", self.endpoint, "expected chat or completions") from None
        try:
            self.arrival = Arrival(self.arrival)
        except ValueError:
            raise ConfigError("--arrival", self.arrival, "expected poisson or fixed") from None
        if self.concurrency < 1:
            raise ConfigError("--concurrency", self.concurrency, "must be at least 1")
        if self.request_rate < 0:
            raise ConfigError("--request-rate", self.request_rate, "must be 0 (no limit) or more")
        if self.max_tokens < 1:
            raise ConfigError("--max-tokens", self.max_tokens, "must be at least 1")


@dataclass
class BenchReport:
    label: str
    options: dict
    results: list[Result]
    duration_s: float
    hits: HitRates | None
    summary: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = {"label": self.label, "options": self.options, "duration_s": self.duration_s,
             "summary": self.summary, "results": [asdict(r) for r in self.results]}
        if self.hits is not None:
            d["hit_rates"] = {"h1": self.hits.h1, "h2": self.hits.h2, "h_all": self.hits.h_all,
                              "by_source": self.hits.by_source, "external_tokens": self.hits.external_tokens,
                              "loaded_blocks": self.hits.loaded_blocks, "load_errors": self.hits.load_errors}
        return d


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles of ``values``; None for each with no value (no
    request succeeded): never a 0 that reads as a measurement."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[Result], duration_s: float) -> dict:
    good = [r for r in results if r.ok]
    errors = Counter(r.error_kind for r in results if not r.ok)
    out_tokens = sum(r.completion_tokens for r in good)
    in_tokens = sum(r.prompt_tokens for r in good)
    return {
        "requests": len(results),
        "succeeded": len(good),
        "failed": len(results) - len(good),
        "errors": dict(errors),
        "ttft_s": percentiles([r.ttft_s for r in good]),
        "tpot_s": percentiles([r.tpot_s for r in good if r.completion_tokens > 1]),
        "itl_s": percentiles([x for r in good for x in r.itl_s]),
        "e2el_s": percentiles([r.e2e_s for r in good]),
        "prompt_tokens": in_tokens,
        "completion_tokens": out_tokens,
        # None when the server said for no request (not 0: nothing was measured).
        "cached_tokens": sum(said) if (said := [r.cached_tokens for r in good if r.cached_tokens is not None])
        else None,
        "request_throughput": len(good) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
    }


async def _stream_one(client: httpx.AsyncClient, opts: BenchOptions, model: str, messages: list[dict],
                      res: Result) -> None:
    body: dict = {"model": model, "max_tokens": opts.max_tokens, "temperature": opts.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint is Endpoint.CHAT:
        url = opts.url + "/v1/chat/completions"
        body["messages"] = messages
    else:
        url = opts.url + "/v1/completions"
        body["prompt"] = "\n\n".join(m["content"] for m in messages)
    t0 = time.perf_counter()
    last = t0
    done = False
    try:
        # The limit covers the whole request: a server that trickles tokens
        # forever times out as surely as one that never answers.
        async with asyncio.timeout(opts.timeout_s), client.stream("POST", url, json=body,
                                                                   timeout=opts.timeout_s) as r:
            if r.status_code != 200:
                await r.aread()
                res.error_kind, res.error = "http", f"HTTP {r.status_code}: {r.text[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error_kind, res.error = "http", str(chunk["error"])[:200]
                    return
                last = absorb_chunk(res, chunk, t0, last)
    except (httpx.TimeoutException, TimeoutError) as err:
        res.error_kind, res.error = "timeout", f"{type(err).__name__} after {opts.timeout_s}s"
        return
    except httpx.ConnectError as err:
        res.error_kind, res.error = "connect", str(err)[:200]
        return
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        res.error_kind, res.error = "cut", f"{type(err).__name__}: {str(err)[:200]}"
        return
    res.e2e_s = time.perf_counter() - t0
    if not done:
        res.error_kind, res.error = "cut", "stream ended before [DONE]"
    elif res.token_chunks == 0:
        res.error_kind, res.error = "empty", "no output"
    else:
        res.ok = True
        if res.completion_tokens > 1:
            res.tpot_s = (res.e2e_s - res.ttft_s) / (res.completion_tokens - 1)


async def _resolve_model(client: httpx.AsyncClient, opts: BenchOptions) -> str:
    if opts.model:
        return opts.model
    try:
        r = await client.get(opts.url + "/v1/models", timeout=30)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except httpx.HTTPError as err:
        raise ConfigError("--url", opts.url, f"cannot list the served models at /v1/models: {err}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError("--url", opts.url, "/v1/models names no model; give --served-model") from None


def arrival_schedule(n: int, rate: float, arrival: Arrival, seed: int = 0) -> list[float]:
    """Start times (seconds from the run's start) of ``n`` sessions.

    ``rate`` 0 starts them all at once (the workers set the pace); otherwise
    gaps are exponential with mean 1/rate (Poisson arrivals) or exactly
    1/rate (fixed), seeded so runs repeat.
    """
    rng = random.Random(seed)
    starts: list[float] = []
    t = 0.0
    for _ in range(n):
        starts.append(t)
        if rate > 0:
            t += rng.expovariate(rate) if arrival is Arrival.POISSON else 1.0 / rate
    return starts


async def scrape_async(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    try:
        r = await client.get(url + "/metrics", timeout=10)
        return parse_metrics(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def run_async(sessions: list[Session], opts: BenchOptions,
                    progress: Callable[[Result], None] | None = None) -> BenchReport:
    opts.validate()
    limits = httpx.Limits(max_connections=opts.concurrency + 4, max_keepalive_connections=opts.concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        model = await _resolve_model(client, opts)
        for i in range(opts.warmup):
            await _stream_one(client, opts, model, [{"role": "user", "content": f"warm-up {i}"}], Result(-1, 0, False))
        before = await scrape_async(client, opts.url)
        starts = arrival_schedule(len(sessions), opts.request_rate, opts.arrival, opts.seed)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(sessions)):
            queue.put_nowait(i)
        results: list[Result] = []
        t0 = time.perf_counter()

        async def worker() -> None:
            while True:
                try:
                    idx = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                delay = starts[idx] - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                s = sessions[idx]
                history: list[dict] = [{"role": "system", "content": s.system}] if s.system else []
                for turn, text in enumerate(s.turns):
                    history.append({"role": "user", "content": text})
                    res = Result(idx, turn, False, start_s=time.perf_counter() - t0)
                    await _stream_one(client, opts, model, list(history), res)
                    results.append(res)
                    if progress:
                        progress(res)
                    if not res.ok:
                        # Later turns would carry a history the server never
                        # answered: they are not sent, and counted as skipped.
                        for later in range(turn + 1, len(s.turns)):
                            skipped = Result(idx, later, False, "skipped", f"turn {turn} of the session failed",
                                             start_s=time.perf_counter() - t0)
                            results.append(skipped)
                            if progress:
                                progress(skipped)
                        break
                    history.append({"role": "assistant", "content": res.text})

        await asyncio.gather(*(worker() for _ in range(min(opts.concurrency, len(sessions)) or 1)))
        duration = time.perf_counter() - t0
        after = await scrape_async(client, opts.url)
    hits = hit_rates(before, after) if before is not None and after is not None else None
    results.sort(key=lambda r: (r.start_s, r.session, r.turn))
    report = BenchReport(opts.label, asdict(opts), results, duration, hits)
    report.summary = summarize(results, duration)
    return report


def run(sessions: list[Session], opts: BenchOptions, progress: Callable[[Result], None] | None = None) -> BenchReport:
    return asyncio.run(run_async(sessions, opts, progress))


# --- workloads ---------------------------------------------------------------


def load_workload(path: str, max_sessions: int | None = None, max_turns: int | None = None) -> list[Session]:
    """QA JSONL (``{"question": ...}`` per line) or ShareGPT JSON (a list of
    ``{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}``).

    For ShareGPT, each human turn becomes a turn; the recorded answers are
    dropped (the server's real answers are carried instead).
    """
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(1)
            f.seek(0)
            if head == "[":
                data = json.load(f)
                bad = next((i for i, item in enumerate(data) if not isinstance(item, dict)), None)
                if bad is not None:
                    raise ConfigError("--dataset", path, f"item {bad} is not a conversation (an object with "
                                                         "'conversations' or 'messages')")
                sessions = [_sharegpt_session(item) for item in data]
            else:
                sessions = []
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                        q = rec["question"] if "question" in rec else rec["prompt"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ConfigError("--dataset", path, f"line {n} is not a QA record with 'question'") \
                            from None
                    sessions.append(Session([str(q)]))
    except FileNotFoundError:
        raise ConfigError("--dataset", path, "no such file") from None
    except json.JSONDecodeError as err:
        raise ConfigError("--dataset", path, f"not valid JSON: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("--dataset", path, getattr(err, "strerror", None) or str(err)) from None
    sessions = [s for s in sessions if s.turns]
    if max_turns:
        sessions = [Session(s.turns[:max_turns], s.system) for s in sessions]
    if max_sessions:
        sessions = sessions[:max_sessions]
    if not sessions:
        raise ConfigError("--dataset", path, "holds no usable request")
    return sessions


def _sharegpt_session(item: dict) -> Session:
    turns = []
    system = None
    for msg in item.get("conversations") or item.get("messages") or []:
        if not isinstance(msg, dict):
            continue
        role = msg.get("from") or msg.get("role")
        text = msg.get("value") if "value" in msg else msg.get("content")
        if not isinstance(text, str):
            continue
        if role in ("human", "user"):
            turns.append(text)
        elif role == "system":
            system = text
    return Session(turns, system)
