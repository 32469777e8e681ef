"""What an engine serves about itself, one pure parser per answer (no sockets).

The shapes are the engines' own, checked against real ones (vLLM 0.32 on this project's
machines, SGLang from its source and golden payloads):

- **SGLang** ``GET /server_info`` (old alias ``/get_server_info``): ``served_model_name`` /
  ``model_path``, ``page_size``, ``dp_size``, ``context_length``, ``disaggregation_mode``
  with ``disaggregation_bootstrap_port``, and the KV-event publisher, either as the recent
  ``kv_events`` block (``publisher``, ``endpoint_host``, ``endpoint_port_base``, ``topic``,
  ``block_size``, ``dp_size``, ``replay_endpoint_port_base``) or as the ``kv_events_config``
  JSON string it was launched with (``publisher``, ``endpoint``, ``topic``,
  ``replay_endpoint``).
- **vLLM** ``GET /v1/models`` (``id``, ``root``, ``parent``, ``max_model_len``,
  ``owned_by``); ``GET /kv_event_sources``, a JSON *object keyed by DP rank* (``"0"``,
  ``"1"``, …) whose values are the publisher's resolved ``KVEventsConfig`` (``endpoint``,
  ``replay_endpoint``, ``topic``, ``publisher``, ``enable_kv_cache_events``, ``buffer_steps``,
  ``hwm``, …; rank r's ports already offset by r), ``{}`` when nothing publishes
  (``EngineClient.get_kv_event_sources() -> dict[int, KVEventsConfig]`` in 0.32 and 0.33);
  the ``vllm:cache_config_info`` info gauge on ``GET /metrics`` (``block_size``,
  ``enable_prefix_caching``, ``prefix_caching_hash_algo``, ``num_gpu_blocks`` as label
  strings) and ``vllm:num_requests_{running,waiting}`` (the load the gateway polls);
  ``GET /load`` (``{"server_load": N}``, requests in flight, with
  ``--enable-server-load-tracking``); ``GET /server_info?config_format=json`` in dev mode
  (``system_env.vllm_version``, which decides what PD pairs).
- **SGLang** load: ``GET /v1/loads`` (``{loads: [{num_running_reqs, num_waiting_reqs, …}]}``),
  the older ``GET /get_load`` (``[{num_reqs, num_waiting_reqs, …}]``), summed over DP ranks;
  ``/server_info``'s server args say its speculative lookahead.
- **Work marks** (:data:`WorkMark`, the gateway's wedge watch): what in a load answer moves
  while the engine computes. vLLM: ``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total``
  (counters: a prompt's tokens at its first token, every generated token at the step that
  made it, ``vllm/v1/metrics``); SGLang, whose scheduler answers the load itself between
  batches: each rank's KV tokens in use (``num_used_tokens``, allocated token by token as it
  decodes; ``num_tokens`` in ``/get_load``) and running requests.

Engines report their ZMQ publishers as *bind* addresses (``tcp://*:5557``): a subscriber
reaches them at the worker's own host (:meth:`cortex.registry.Endpoint.at_host`).

Discovery (:mod:`cortex.registry.engine_probe`) and the gateway's fleet code (engine info,
the load poller) both read engines through these functions; neither parses an answer itself.
Each ``parse_*`` of a self-description returns the spec fields it carries (a field set to
``None`` means "the engine says there is none", e.g. no replay endpoint; a field left out
means "not said here"); :class:`cortex.registry.Discovery` merges them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cortex.hashing import Engine
from cortex.registry.spec import WorkerRole

__all__ = [
    "SGLANG_DEFAULT_BOOTSTRAP_PORT",
    "Learned",
    "LoadFormatError",
    "VllmMetrics",
    "WorkMark",
    "adapters_from_models",
    "context_length_from_models",
    "kv_capacity_from_sglang_server_info",
    "kv_capacity_from_vllm_metrics",
    "kv_device_blocks_from_vllm_metrics",
    "looks_like_sglang",
    "metric_lines",
    "parse_sglang_get_load",
    "parse_sglang_loads",
    "parse_sglang_server_info",
    "parse_v1_models",
    "parse_vllm_kv_event_sources",
    "parse_vllm_load",
    "parse_vllm_metrics",
    "sglang_lookahead_from_server_info",
    "sglang_work_from_get_load",
    "sglang_work_from_loads",
    "vllm_version_from_server_info",
    "vllm_work_from_metrics",
]

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998  # what an SGLang prefill listens on when not told
_SGLANG_DEFAULT_ENDPOINT = "tcp://*:5557"  # the zmq publisher's default bind
_OFF = (None, "", "null", "none")  # SGLang's "no publisher" spellings
_CACHE_CONFIG = re.compile(r'^vllm:cache_config_info\{(?P<labels>[^}]*)\}', re.MULTILINE)
_LABEL = re.compile(r'(?P<key>[A-Za-z_][A-Za-z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')
_SGLANG_EAGLE: frozenset[str] = frozenset({"EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NEXTN"})

Learned = dict[str, Any]
"""Spec fields one answer carries (``None``: the engine says there is none)."""


def _int(value: object, low: int = 1) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return None
    return value


def _name(value: object) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def _tcp(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def looks_like_sglang(info: object) -> bool:
    """Whether a ``/server_info`` body is SGLang's (vLLM's dev-mode ``/server_info`` is a
    different object that shares the path)."""
    return isinstance(info, Mapping) and ("page_size" in info or "model_path" in info)


def parse_sglang_server_info(info: Mapping[str, Any]) -> Learned:
    """The spec fields of an SGLang ``/server_info`` body."""
    learned: Learned = {"engine": Engine.SGLANG}
    model = _name(info.get("served_model_name")) or _name(info.get("model_path"))
    if model is not None:
        learned["model"] = model
    if (tokenizer := _name(info.get("tokenizer_path")) or _name(info.get("model_path"))):
        learned["tokenizer"] = tokenizer
    mode = info.get("disaggregation_mode")
    role = WorkerRole.REGULAR if mode in _OFF else {
        "prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}.get(str(mode))
    if role is not None:
        learned["role"] = role
        port = _int(info.get("disaggregation_bootstrap_port"))
        learned["bootstrap_port"] = (
            (port or SGLANG_DEFAULT_BOOTSTRAP_PORT) if role is WorkerRole.PREFILL else None)
    if (context := _int(info.get("context_length"))) is not None:
        learned["context_length"] = context
    block = info.get("kv_events")
    block = block if isinstance(block, Mapping) else {}
    # the kv_events block is what the engine computed; page_size is the launch argument
    for name, value in (("dp_size", block.get("dp_size", info.get("dp_size"))),
                        ("block_size", block.get("block_size", info.get("page_size")))):
        if (number := _int(value)) is not None:
            learned[name] = number
    learned.update(_sglang_events(block, info.get("kv_events_config")))
    return learned


def _sglang_events(block: Mapping[str, Any], launch_config: object) -> Learned:
    """Endpoints from the ``kv_events`` block, else from the launch ``kv_events_config``."""
    config: Mapping[str, Any] | None = None
    if isinstance(launch_config, Mapping):
        config = launch_config
    elif isinstance(launch_config, str) and launch_config.strip():
        try:
            decoded = json.loads(launch_config)
        except ValueError:
            decoded = None
        config = decoded if isinstance(decoded, Mapping) else None
    if block:
        if block.get("publisher") in _OFF:
            return {"kv_events": None, "replay": None, "topic": ""}
        host, port = block.get("endpoint_host"), _int(block.get("endpoint_port_base"))
        if not isinstance(host, str) or not host or port is None:
            return {}
        replay_port = _int(block.get("replay_endpoint_port_base"))
        learned: Learned = {"kv_events": _tcp(host, port)}
        if replay_port is not None:
            learned["replay"] = _tcp(host, replay_port)
        elif config is not None:  # the block of some releases omits it; the launch has it
            learned["replay"] = _name(config.get("replay_endpoint"))
        else:
            learned["replay"] = None
        if isinstance(block.get("topic"), str):
            learned["topic"] = block["topic"]
        return learned
    if launch_config in _OFF:
        return {"kv_events": None, "replay": None, "topic": ""}
    if config is None:
        return {}
    if config.get("publisher", "null") in _OFF:
        return {"kv_events": None, "replay": None, "topic": ""}
    learned = {"kv_events": _name(config.get("endpoint")) or _SGLANG_DEFAULT_ENDPOINT,
               "replay": _name(config.get("replay_endpoint"))}
    if isinstance(config.get("topic", ""), str):
        learned["topic"] = config.get("topic", "")
    return learned


def parse_v1_models(body: Mapping[str, Any]) -> tuple[Learned, tuple[str, ...]]:
    """``(fields, every served model id)`` of an OpenAI ``/v1/models`` body.

    The model is the first base model (``parent`` null: LoRA adapters name their parent);
    ``max_model_len`` (vLLM, SGLang) is its context length; ``owned_by`` names the engine.
    """
    data = body.get("data")
    cards = [c for c in data if isinstance(c, Mapping) and _name(c.get("id"))] \
        if isinstance(data, list) else []
    ids = tuple(str(c["id"]).strip() for c in cards)
    base = next((c for c in cards if c.get("parent") is None), cards[0] if cards else None)
    learned: Learned = {}
    if base is None:
        return learned, ids
    learned["model"] = str(base["id"]).strip()
    if (root := _name(base.get("root"))) is not None:
        learned["tokenizer"] = root  # where the engine loaded the model (and its tokenizer)
    if (context := _int(base.get("max_model_len"))) is not None:
        learned["context_length"] = context
    owner = base.get("owned_by")
    if owner in ("vllm", "sglang"):
        learned["engine"] = Engine(owner)
    return learned, ids


def parse_vllm_kv_event_sources(body: object) -> tuple[Learned, str | None]:
    """``(fields, problem)`` of vLLM's ``/kv_event_sources``: an object keyed by DP rank.

    The spec holds endpoint *bases* (rank r on port + r, which is how vLLM offsets them):
    ranks whose ports do not follow that rule cannot be described, and are reported as a
    problem instead (so is a port 0, which the engine leaves for the OS to choose and then
    does not report). A problem leaves the fields empty.
    """
    if not isinstance(body, Mapping):
        return {}, "not a JSON object keyed by DP rank"
    ranks: dict[int, Mapping[str, Any]] = {}
    for key, entry in body.items():
        rank = int(key) if isinstance(key, str) and key.isdigit() else None
        if rank is None or not isinstance(entry, Mapping):
            return {}, f"entry {key!r} is not a DP rank's publisher config"
        if entry.get("publisher", "zmq") in _OFF or entry.get("enable_kv_cache_events") is False:
            continue  # this rank publishes nothing
        ranks[rank] = entry
    if not ranks:  # the engine publishes no KV events
        return {"kv_events": None, "replay": None, "topic": ""}, None
    if sorted(ranks) != list(range(len(ranks))):
        return {}, f"DP ranks {sorted(ranks)} are not 0..{len(ranks) - 1}"
    learned: Learned = {"dp_size": len(ranks)}
    for name, key in (("kv_events", "endpoint"), ("replay", "replay_endpoint")):
        values = [ranks[r].get(key) for r in range(len(ranks))]
        if all(v is None for v in values):
            learned[name] = None
            continue
        base = _consecutive([v if isinstance(v, str) else "" for v in values])
        if base is None:
            return {}, f"the {key}s {values} are not one base port + DP rank"
        learned[name] = base
    if learned.get("kv_events") is None and learned.get("replay") is not None:
        return {}, "a replay endpoint without an event endpoint"
    topic = ranks[0].get("topic", "")
    learned["topic"] = topic if isinstance(topic, str) else ""
    return learned, None


def _consecutive(endpoints: list[str]) -> str | None:
    """The base endpoint when rank r is ``host:(port0 + r)`` for every r, else ``None``."""
    parts = [endpoint.rpartition(":") for endpoint in endpoints]
    if not all(sep and port.isdigit() and host.startswith("tcp://") for host, sep, port in parts):
        return None
    hosts = {host for host, _, _ in parts}
    ports = [int(port) for _, _, port in parts]
    if len(hosts) != 1 or ports[0] == 0 or ports != list(range(ports[0], ports[0] + len(ports))):
        return None
    return endpoints[0]


def metric_lines(text: str, prefix: str) -> Iterator[str]:
    """The lines of a Prometheus text that start with ``prefix`` (a trailing ``\\r``
    dropped), found with ``str.find``: the gateway reads a vLLM ``/metrics`` (~50 KB, a few
    hundred lines) on every load poll and needs a handful of them; splitting and testing every
    line cost ~0.7 ms of CPU per poll, per worker."""
    needle = "\n" + prefix
    at = 0 if text.startswith(prefix) else text.find(needle) + 1
    if at == 0 and not text.startswith(prefix):
        return
    while True:
        end = text.find("\n", at)
        if end < 0:
            yield text[at:].removesuffix("\r")
            return
        yield text[at:end].removesuffix("\r")
        at = text.find(needle, end) + 1
        if at == 0:
            return


def _cache_config_info(text: str) -> Iterator[re.Match[str]]:
    """The ``vllm:cache_config_info`` samples (their ``labels``), in order."""
    for line in metric_lines(text, "vllm:cache_config_info{"):
        match = _CACHE_CONFIG.match(line)
        if match is not None:
            yield match


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """What a vLLM ``/metrics`` text says: the spec fields of its ``vllm:cache_config_info``
    labels and the problem with them (``None``: none), and its load (``None``: no readable
    ``vllm:num_requests_*`` sample)."""

    learned: Learned
    problem: str | None
    load: tuple[int, int] | None
    """(running, waiting), summed over label sets."""


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """A vLLM ``/metrics`` text: discovery reads its cache config, the gateway its load."""
    learned, problem = _cache_config(text)
    return VllmMetrics(learned, problem, _requests(text))


def _cache_config(text: str) -> tuple[Learned, str | None]:
    """``(fields, problem)`` from the ``vllm:cache_config_info`` labels:
    ``block_size`` (tokens) and ``hash_algo`` (``prefix_caching_hash_algo``, what the
    engine hashes blocks with). The problem says when the gauge is missing or prefix caching
    is off (the engine then never reuses a block, so no prediction can hold)."""
    for match in _cache_config_info(text):
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(match["labels"])}
        learned: Learned = {}
        size = labels.get("block_size", "")
        if size.isdigit() and int(size) >= 1:
            learned["block_size"] = int(size)
        if (algo := _name(labels.get("prefix_caching_hash_algo"))) is not None:
            learned["hash_algo"] = algo
        if labels.get("enable_prefix_caching") == "False":
            return learned, "prefix caching is off (enable_prefix_caching=\"False\")"
        return learned, None if "block_size" in learned else "no block_size label"
    return {}, "no vllm:cache_config_info"


def _requests(text: str) -> tuple[int, int] | None:
    """(running, waiting) from ``vllm:num_requests_{running,waiting}``, summed over label
    sets; ``None`` without a sample or with an unreadable one."""
    totals = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    seen = False
    for line in metric_lines(text, "vllm:num_requests_"):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            try:
                totals[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                return None
            seen = True
    if not seen:
        return None
    return int(totals["vllm:num_requests_running"]), int(totals["vllm:num_requests_waiting"])


def parse_vllm_load(body: object) -> int | None:
    """Requests in flight from a ``/load`` body (``{"server_load": N}``), else ``None``."""
    load = body.get("server_load") if isinstance(body, Mapping) else None
    return _int(load, low=0)


class LoadFormatError(ValueError):
    """An engine's load report has an unexpected shape."""


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LoadFormatError(f"not a count: {value!r}")
    return int(value)


def parse_sglang_loads(obj: Any) -> tuple[int, int]:
    """SGLang ``/v1/loads`` → (running, waiting) summed over DP ranks."""
    loads = obj.get("loads") if isinstance(obj, dict) else None
    if not isinstance(loads, list):
        raise LoadFormatError("no 'loads' list")
    running = waiting = 0
    for rank in loads:
        if not isinstance(rank, dict):
            raise LoadFormatError("a 'loads' entry is not an object")
        running += _count(rank.get("num_running_reqs", 0))
        waiting += _count(rank.get("num_waiting_reqs", 0))
    return running, waiting


def parse_sglang_get_load(obj: Any) -> tuple[int, int]:
    """SGLang ``/get_load`` (a list per DP rank, or one object) → (running, waiting)."""
    ranks = obj if isinstance(obj, list) else [obj]
    running = waiting = 0
    for rank in ranks:
        if not isinstance(rank, dict):
            raise LoadFormatError("a load entry is not an object")
        running += _count(rank.get("num_reqs", 0))
        waiting += _count(rank.get("num_waiting_reqs", 0))
    return running, waiting


WorkMark = tuple[float, ...]
"""What an engine's load answer says of the work it did: equal marks from two polls mean it
computed nothing in between, a different one that it did (compared, never ordered)."""

_WORK_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def vllm_work_from_metrics(text: str) -> WorkMark | None:
    """Prompt plus generated tokens so far (``vllm:prompt_tokens_total``,
    ``vllm:generation_tokens_total``, summed over label sets); ``None`` without a sample or
    with an unreadable one."""
    total = 0.0
    seen = False
    for line in (line for name in _WORK_COUNTERS for line in metric_lines(text, name)):
        if line.split("{", 1)[0].split(" ", 1)[0] not in _WORK_COUNTERS:
            continue  # vllm:prompt_tokens_total_by_source… and the like
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            return None
        if not math.isfinite(value):
            return None
        total += value
        seen = True
    return (total,) if seen else None


def sglang_work_from_loads(obj: Any) -> WorkMark | None:
    """Each rank's KV tokens in use and running requests from ``/v1/loads``; ``None`` when
    a rank does not say its ``num_used_tokens``."""
    loads = obj.get("loads") if isinstance(obj, dict) else None
    return _sglang_work(loads, "num_used_tokens", "num_running_reqs")


def sglang_work_from_get_load(obj: Any) -> WorkMark | None:
    """The same from the older ``/get_load`` (``num_tokens``, ``num_reqs``)."""
    return _sglang_work(obj if isinstance(obj, list) else [obj], "num_tokens", "num_reqs")


def _sglang_work(ranks: object, tokens: str, requests: str) -> WorkMark | None:
    if not isinstance(ranks, list) or not ranks:
        return None
    mark: list[float] = []
    for rank in ranks:
        if not isinstance(rank, dict) or tokens not in rank:
            return None
        try:
            mark += [_count(rank[tokens]), _count(rank.get(requests, 0))]
        except LoadFormatError:
            return None
    return tuple(mark)


def context_length_from_models(obj: Any, model: str) -> int | None:
    """``max_model_len`` of ``model`` in an OpenAI ``/v1/models`` answer (the only entry
    when the served name differs)."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    entries = [e for e in data if isinstance(e, dict)]
    named = [e for e in entries if e.get("id") == model] or (entries if len(entries) == 1
                                                             else [])
    return _int(named[0].get("max_model_len")) if named else None


def adapters_from_models(obj: Any, model: str) -> frozenset[str] | None:
    """LoRA adapters of ``model`` in a ``/v1/models`` answer: the entries whose ``parent`` is
    ``model`` (vLLM ``serving_models.py::show_available_models``, SGLang
    ``http_server.py::available_models`` list each loaded adapter so). ``None``: no list."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    return frozenset(e["id"] for e in data if isinstance(e, dict) and e.get("parent") == model
                     and isinstance(e.get("id"), str) and e["id"])


def vllm_version_from_server_info(obj: Any) -> str | None:
    """vLLM ``/server_info``'s ``system_env.vllm_version``."""
    env = obj.get("system_env") if isinstance(obj, dict) else None
    version = env.get("vllm_version") if isinstance(env, dict) else None
    return version.strip() or None if isinstance(version, str) else None


def sglang_lookahead_from_server_info(obj: Any) -> int | None:
    """Lookahead tokens of an SGLang worker's cache keys: 1 with an EAGLE radix cache, 0
    without speculative decoding or radix cache, ``None`` when its answer does not say
    (no server info, an algorithm registered by a plugin)."""
    if not isinstance(obj, dict) or "speculative_algorithm" not in obj:
        return None
    if obj.get("disable_radix_cache") is True:
        return 0
    algorithm = obj.get("speculative_algorithm")
    if algorithm is None or (isinstance(algorithm, str) and algorithm.upper() == "NONE"):
        return 0
    if not isinstance(algorithm, str):
        return None
    name = algorithm.upper()
    if name in _SGLANG_EAGLE:
        return 1
    return 0 if name in {"STANDALONE", "NGRAM", "DFLASH", "UNO", "DSPARK"} else None


def kv_capacity_from_vllm_metrics(text: str) -> int | None:
    """Blocks a vLLM engine (one DP rank) can hold: ``vllm:cache_config_info``'s
    ``num_gpu_blocks`` plus ``num_cpu_blocks`` when that is a number (``"None"`` without a
    CPU pool); ``None`` when the gauge or its GPU count is missing."""
    for match in _cache_config_info(text):
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(match["labels"])}
        gpu, cpu = labels.get("num_gpu_blocks", ""), labels.get("num_cpu_blocks", "")
        if gpu.isdigit():
            return int(gpu) + (int(cpu) if cpu.isdigit() else 0)
    return None


def kv_device_blocks_from_vllm_metrics(text: str) -> int | None:
    """Device blocks a vLLM engine (one DP rank) can hold: ``vllm:cache_config_info``'s
    ``num_gpu_blocks`` alone (its device ledger tier's bound); ``None`` when missing."""
    for match in _cache_config_info(text):
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(match["labels"])}
        gpu = labels.get("num_gpu_blocks", "")
        return int(gpu) if gpu.isdigit() else None
    return None


def kv_capacity_from_sglang_server_info(info: object) -> int | None:
    """Blocks an SGLang engine (one DP rank) can hold: ``/server_info``'s
    ``max_total_num_tokens`` (the scheduler's KV pool in tokens) over ``page_size``."""
    if not isinstance(info, Mapping):
        return None
    tokens, page = _int(info.get("max_total_num_tokens")), _int(info.get("page_size")) or 1
    return None if tokens is None else math.ceil(tokens / page)
