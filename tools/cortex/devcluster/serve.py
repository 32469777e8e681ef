"""``cortex serve``: Cortex in front of workers that already run, in one command.

``cortex serve --worker-urls URL…`` (and ``--prefill URL [BOOTSTRAP_PORT]`` /
``--decode URL`` for a prefill/decode pool) asks every worker's engine about itself
(:func:`cortex.registry.discover`), then starts the index, the ingest and the gateway as one
process group with a private Redis (or ``--redis-url``) through
:class:`cortex.devcluster.cluster.LocalCluster`, waits until every worker is routable, prints what
runs where, and runs until Ctrl-C / SIGTERM. The flags follow sglang-router's where a knob
means the same (``--host``, ``--port``, ``--api-key``, ``--max-concurrent-requests``,
``--queue-size``, ``--queue-timeout-secs``, ``--tokenizer-path``, ``--chat-template``,
``--policy``, ``--request-timeout-secs``,
``--worker-startup-timeout-secs``); the table is in ``docs/operations.md``.
Exit codes: 0 after a clean stop, 1 when it could not start, 2 on invalid arguments or
workers that could not be described.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["WorkerArg", "gateway_sections", "register", "run", "worker_args"]

REQUIRED = ("engine", "model", "block_size")
"""What the gateway cannot route without (block size: the hash domain of the model)."""

LEDGER_GRACE_S = 10.0
"""How long start-up waits for a worker's ledger once the gateway routes it; then the
worker is served by load until its ledger is READY (said in the summary)."""

_POLICIES = ("cache_aware",)
_FLAG = {"engine": "--engine", "model": "--model", "block_size": "--block-size"}


@dataclass(frozen=True, slots=True)
class WorkerArg:
    """One worker of the command line: its URL, the role its flag gave (``None``: what the
    engine says) and, for ``--prefill URL PORT``, the bootstrap port."""

    url: str
    role: str | None = None
    bootstrap_port: int | None = None


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    from cortex.devcluster.cluster import DEFAULT_GATEWAY_PORT, LOOPBACK, ClusterSpec

    defaults = ClusterSpec()
    parser = subparsers.add_parser(
        "serve", help="run Cortex (index, ingest, gateway) in front of running workers",
        description="Learn each worker's spec from its engine, start a private Redis, the "
                    "index, the ingest and the gateway in front of them, wait until every "
                    "worker is routable, and stop it all on Ctrl-C / SIGTERM.")
    workers = parser.add_argument_group("workers (engines that already run)")
    workers.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                         help="regular workers (role: what the engine says, else regular)")
    workers.add_argument("--prefill", nargs="+", action="append", default=[],
                         metavar="URL [BOOTSTRAP_PORT]",
                         help="a prefill worker (repeat the flag per worker); SGLang: its "
                              "bootstrap port over what the engine says ('none' or omitted: "
                              "the engine's)")
    workers.add_argument("--decode", nargs="+", action="append", default=[], metavar="URL",
                         help="decode worker(s)")
    workers.add_argument("--pd-disaggregation", action="store_true",
                         help="accepted for sglang-router compatibility: --prefill/--decode "
                              "form the prefill/decode pool by themselves")
    workers.add_argument("--engine", choices=["sglang", "vllm"],
                         help="for workers whose endpoints do not say their engine")
    workers.add_argument("--model", help="served model name, over what the engines say")
    workers.add_argument("--block-size", type=int, metavar="B",
                         help="tokens per KV block, for workers that do not say it (vLLM "
                              "without vllm:cache_config_info)")
    workers.add_argument("--discovery-timeout", type=float, default=5.0, metavar="S",
                         help="per-request timeout when asking a worker (default %(default)s)")
    gateway = parser.add_argument_group("gateway (sglang-router's flags where they mean the "
                                        "same)")
    gateway.add_argument("--host", default=LOOPBACK,
                         help="bind address (0.0.0.0 to serve other machines; default "
                              "%(default)s)")
    gateway.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT,
                         help="listening port (0 = a free port; default %(default)s)")
    gateway.add_argument("--api-key", default=None, metavar="KEY",
                         help="as sglang-router's: inference clients must send "
                              "Authorization: Bearer KEY (gateway config auth.keys holds its "
                              "digest), and the workers are called with it")
    gateway.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                         help="inference requests in service at once, more wait in the "
                              "admission queue (-1 or 0 = no limit; default: the gateway's)")
    gateway.add_argument("--queue-size", type=int, default=None, metavar="N",
                         help="requests waiting for a slot; one more gets 429 (default: the "
                              "gateway's)")
    gateway.add_argument("--queue-timeout-secs", type=float, default=None, metavar="S",
                         help="longest wait for a slot, then 503 (default: the gateway's)")
    gateway.add_argument("--tokenizer-path", type=Path, default=None, metavar="PATH",
                         help="the model's tokenizer.json or its directory (exact KV matching "
                              "needs the engines' tokenizer)")
    gateway.add_argument("--model-path", type=Path, default=None, metavar="DIR",
                         help="a local model directory: its tokenizer (and chat template) "
                              "are used unless --tokenizer-path says otherwise")
    gateway.add_argument("--chat-template", type=Path, default=None, metavar="PATH",
                         help="a Jinja chat template (default: the tokenizer's)")
    gateway.add_argument("--policy", choices=_POLICIES, default="cache_aware",
                         help="routing policy: Cortex scores KV-cache hits against load "
                              "(cache_aware, the only one; see docs/gateway.md)")
    gateway.add_argument("--request-timeout-secs", type=float, default=None, metavar="S",
                         help="bound of one request, routing included (default: the "
                              "gateway's upstream.request_timeout_s)")
    gateway.add_argument("--gateways", type=int, default=1, metavar="N",
                         help="gateway replicas on PORT, PORT+1, ... (default %(default)s)")
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis instead of starting a private redis-server")
    parser.add_argument("--lease-ttl", type=float, default=defaults.lease_ttl_s, metavar="S",
                        help="worker registry lease (s), renewed by the gateways' probes "
                             "(default %(default)s)")
    parser.add_argument("--log-dir", default=None,
                        help="where each process logs (default: a new temporary directory)")
    parser.add_argument("--state-file", default=None, metavar="FILE",
                        help="write a JSON description of every process here once ready")
    parser.add_argument("--worker-startup-timeout-secs", "--ready-timeout", type=float,
                        dest="ready_timeout", default=defaults.ready_timeout_s, metavar="S",
                        help="give up if the workers are not routable by then "
                             "(default %(default)s)")
    parser.set_defaults(func=run)


def worker_args(args: argparse.Namespace) -> list[WorkerArg]:
    """The workers of the command line (``ValueError`` for a malformed ``--prefill``)."""
    found = [WorkerArg(url) for url in args.worker_urls]
    for group in args.prefill:
        port_text = group[1].lower() if len(group) == 2 else "none"
        if len(group) > 2 or not (port_text.isdigit() or port_text == "none"):
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {' '.join(group)}")
        port = int(port_text) if port_text.isdigit() else None  # none: what the engine says
        found.append(WorkerArg(group[0], "prefill", port))
    found += [WorkerArg(url, "decode") for group in args.decode for url in group]
    if not found:
        raise ValueError("no workers: pass --worker-urls URL... (or --prefill / --decode)")
    urls = [w.url.rstrip("/") for w in found]
    if len(set(urls)) != len(urls):
        raise ValueError(f"a worker URL is given twice: {urls}")
    return found


async def _discover_all(workers: Sequence[WorkerArg], args: argparse.Namespace) -> list[Any]:
    from cortex.registry import discover

    authorization = f"Bearer {args.api_key}" if args.api_key else None
    return list(await asyncio.gather(*(
        discover(w.url, timeout_s=args.discovery_timeout, authorization=authorization)
        for w in workers)))


def describe(workers: Sequence[WorkerArg], args: argparse.Namespace) -> list[Any]:
    """Each worker's :class:`WorkerSpec`, learned from its engine under the flags; raises
    ``ValueError`` naming every worker and field that nobody supplied."""
    from cortex.registry import SpecError

    found = asyncio.run(_discover_all(workers, args))
    specs, errors = [], []
    for worker, discovery in zip(workers, found, strict=True):
        for line in discovery.report():
            print(f"cortex serve: {worker.url}: {line}", flush=True)
        overrides = {"model": args.model, "role": worker.role,
                     "bootstrap_port": worker.bootstrap_port}
        for name in ("engine", "block_size"):  # defaults for workers that do not say them
            if discovery.learned.get(name) is None:
                overrides[name] = getattr(args, name)
        try:
            spec = discovery.spec(overrides, require=REQUIRED)
        except SpecError as exc:  # DiscoveryError names the fields nobody supplied
            errors.append(_explain(exc, worker.url))
            continue
        if spec.kv_events is None:
            print(f"cortex serve: warning: {worker.url} publishes no KV events that it told "
                  "of: it is routed by load only", file=sys.stderr, flush=True)
        specs.append(spec)
    if errors:
        raise ValueError("\n".join(errors))
    if args.tokenizer_path is None:
        hints = sorted({d.tokenizer for d in found if d.tokenizer and Path(d.tokenizer).exists()})
        print("cortex serve: warning: no --tokenizer-path: prompts are tokenized with the "
              "default (DeepSeek) tokenizer, and KV hits need the engines' own"
              + (f"; the engines loaded theirs from {', '.join(hints)}, which exists here"
                 if hints else ""), file=sys.stderr, flush=True)
    return specs


def _explain(exc: Exception, url: str) -> str:
    missing = getattr(exc, "missing", None)
    if missing is None:
        return f"{url}: {exc}"
    flags = ", ".join(_FLAG.get(name, "--" + name.replace("_", "-")) for name in missing)
    return f"{exc} ({flags})"


WORKER_KEY_ENV = "CORTEX_SERVE_WORKER_API_KEY"


def gateway_sections(specs: Sequence[Any], args: argparse.Namespace) -> dict[str, Any]:
    """The gateway config sections the command line implies: one model entry per served
    model (its workers must agree on engine and block size), admission, auth, timeouts."""
    models: dict[str, dict[str, Any]] = {}
    for spec in specs:
        entry = {"name": spec.model, "engine": spec.engine.value,
                 "block_size": spec.block_size}
        if args.tokenizer_path is not None:
            entry["tokenizer"] = str(args.tokenizer_path)
        if args.chat_template is not None:
            entry["chat_template"] = str(args.chat_template)
        seen = models.setdefault(spec.model, entry)
        if (seen["engine"], seen["block_size"]) != (entry["engine"], entry["block_size"]):
            raise ValueError(
                f"model {spec.model!r}: workers disagree on engine / block size "
                f"({seen['engine']}/{seen['block_size']} vs {entry['engine']}/"
                f"{entry['block_size']} at {spec.url}); one model is one hash domain")
    sections: dict[str, Any] = {"models": list(models.values())}
    admission: dict[str, Any] = {}
    if args.max_concurrent_requests is not None:
        if args.max_concurrent_requests < -1:
            raise ValueError("--max-concurrent-requests: must be >= -1")
        admission["max_concurrent_requests"] = max(args.max_concurrent_requests, 0)
    if args.queue_size is not None:
        admission["queue_size"] = args.queue_size
    if args.queue_timeout_secs is not None:
        admission["queue_timeout_s"] = args.queue_timeout_secs
    if admission:
        sections["admission"] = admission
    if args.request_timeout_secs is not None:
        if not args.request_timeout_secs > 0:
            raise ValueError("--request-timeout-secs: must be > 0")
        # a streaming client sends nothing while it reads: the listener must wait longer
        sections["upstream"] = {"request_timeout_s": args.request_timeout_secs}
        sections["server"] = {"read_timeout_s": args.request_timeout_secs + 60.0}
    if args.api_key:
        from cortex.gateway import hash_key

        # the gateway keeps only the digest; the key itself reaches it in the environment
        sections["auth"] = {"keys": [{"id": "serve", "hash": hash_key(args.api_key)}]}
    return sections


def with_worker_key(specs: Sequence[Any], args: argparse.Namespace) -> list[Any]:
    """As sglang-router's ``--api-key``, the key also authenticates the gateway to the
    workers: specs without a credential of their own name :data:`WORKER_KEY_ENV`, which
    :func:`run` sets for the children (never on a command line or in a file)."""
    if not args.api_key:
        return list(specs)
    return [s if s.credential else dataclasses.replace(s, credential=f"env:{WORKER_KEY_ENV}")
            for s in specs]


def cluster_spec(specs: Sequence[Any], sections: Mapping[str, Any],
                 args: argparse.Namespace) -> Any:
    from cortex.devcluster.cluster import ClusterSpec

    first = specs[0]
    return ClusterSpec(
        workers=0, engine=first.engine, gateways=args.gateways, port=args.port,
        host=args.host, redis_url=args.redis_url, model=first.model,
        block_size=first.block_size, lease_ttl_s=args.lease_ttl, gateway_config=sections,
        external=tuple(specs), ready_timeout_s=args.ready_timeout,
        ledger_grace_s=LEDGER_GRACE_S)


def run(args: argparse.Namespace) -> int:
    from cortex.devcluster.up import launch

    try:
        workers = worker_args(args)
        if args.tokenizer_path is None and args.model_path is not None:
            if not args.model_path.is_dir():
                raise ValueError(f"--model-path: {args.model_path} is not a local directory (a "
                                 "hub id is not fetched: download it, or pass --tokenizer-path)")
            args.tokenizer_path = args.model_path  # sglang-router loads its tokenizer there
    except ValueError as exc:
        print(f"cortex serve: invalid arguments: {exc}", file=sys.stderr)
        return 2
    print(f"cortex serve: asking {len(workers)} worker(s) about themselves ...", flush=True)
    try:
        specs = with_worker_key(describe(workers, args), args)
        spec = cluster_spec(specs, gateway_sections(specs, args), args)
    except ValueError as exc:
        print(f"cortex serve: {exc}", file=sys.stderr)
        return 2
    if args.api_key:
        os.environ[WORKER_KEY_ENV] = args.api_key  # inherited by the gateways only as a value
    return launch(spec, args, command="cortex serve")
