"""``cortex workers``: add, list and remove worker registrations (Redis leases).

``add --url URL`` asks the worker's engine about itself first (:func:`cortex.registry.discover`:
engine, model, block size, event and replay endpoints, DP size, context length); flags given
explicitly win. It validates the whole spec before touching Redis: a bad URL, engine or port,
or a field neither the engine nor a flag supplied, is a clear error and nothing is written.
Exit codes: 0 done, 1 registry unavailable or worker not found, 2 invalid input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from cortex.hashing import Engine
from cortex.registry import (
    DEFAULT_NAMESPACE,
    DEFAULT_TTL_S,
    DiscoveryError,
    LeaseKeeper,
    RedisRegistry,
    RegistryUnavailable,
    SpecError,
    WorkerSpec,
    default_worker_id,
    discover,
)

__all__ = ["register"]

_ENV_REDIS = "CORTEX_REDIS_URL"


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "workers", help="manage the worker registry (Redis leases)",
        description="Add, list and remove workers in the Cortex registry.",
    )
    parser.set_defaults(func=lambda _args: _usage(parser))
    sub = parser.add_subparsers(dest="workers_command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--redis", default=os.environ.get(_ENV_REDIS),
                       help=f"Redis URL (default: ${_ENV_REDIS})")
        p.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                       help="registry key prefix (default: %(default)s)")
        p.add_argument("--timeout", type=float, default=2.0, metavar="S",
                       help="Redis operation timeout in seconds (default: %(default)s)")

    add = sub.add_parser(
        "add", help="register a worker (or replace its entry), learning its spec from its URL",
        description="Register a worker. Its engine, model, block size, KV-event and replay "
                    "endpoints, DP size and context length are read from the engine's own "
                    "endpoints (SGLang /server_info; vLLM /v1/models, /kv_event_sources, "
                    "/metrics); a flag given here wins over what the engine says.")
    common(add)
    add.add_argument("--url", required=True, help="worker base URL, e.g. http://10.0.0.5:30000")
    add.add_argument("--id", help="worker id, unique in the fleet (default: HOST-PORT of --url)")
    add.add_argument("--no-discover", action="store_true",
                     help="do not ask the worker: take the spec from the flags alone "
                          "(--engine and --model are then required)")
    add.add_argument("--discovery-timeout", type=float, default=5.0, metavar="S",
                     help="per-request timeout of discovery (default: %(default)s)")
    add.add_argument("--engine", help="sglang | vllm")
    add.add_argument("--role", help="regular | prefill | decode (default: what the engine says,"
                                    " else regular)")
    add.add_argument("--model", help="served model name")
    add.add_argument("--kv-events", metavar="tcp://HOST:PORT",
                     help="KV-event PUB endpoint base (DP rank r uses PORT+r)")
    add.add_argument("--replay", metavar="tcp://HOST:PORT", help="replay ROUTER endpoint base")
    add.add_argument("--topic", help="KV-event topic (default: the engine's, else empty)")
    add.add_argument("--block-size", type=int, metavar="B",
                     help="tokens per KV block (default: the engine's, else learned from events)")
    add.add_argument("--kv-lookahead", type=int, metavar="L",
                     help="speculative decoding: tokens after a block its reuse needs (vLLM"
                          " EAGLE 1, MTP: speculative tokens; SGLang EAGLE 1; 0: none)")
    add.add_argument("--kv-eagle-drop", action="store_true",
                     help="vLLM EAGLE with legacy block hashes (a KV connector configured):"
                          " the engine does not reuse the last block it matches")
    add.add_argument("--dp-size", type=int, metavar="N",
                     help="data-parallel ranks (default: the engine's, else 1)")
    add.add_argument("--bootstrap-port", type=int, metavar="N",
                     help="SGLang prefill bootstrap port")
    add.add_argument("--context-length", type=int, metavar="T",
                     help="the engine's context length in tokens")
    add.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                     help="a label (repeatable)")
    add.add_argument("--ttl", type=float, default=DEFAULT_TTL_S, metavar="S",
                     help="lease in seconds, renewed by gateways whose health probe succeeds"
                          " (default: %(default)s; 0 = static entry without expiry)")
    add.add_argument("--keep", action="store_true",
                     help="stay in the foreground renewing the lease until interrupted")
    add.set_defaults(func=_cmd_add)

    ls = sub.add_parser("list", help="list registered workers")
    common(ls)
    ls.add_argument("--json", action="store_true", help="print JSON (one object)")
    ls.set_defaults(func=_cmd_list)

    rm = sub.add_parser("rm", help="remove a worker for good (a tombstone)",
                        description="Drop the worker's lease and write a tombstone, so that no "
                                    "gateway brings it back while it stays reachable. "
                                    "`cortex workers add` lifts the tombstone.")
    common(rm)
    rm.add_argument("worker_id", metavar="ID")
    rm.add_argument("--for", dest="for_s", type=float, default=None, metavar="S",
                    help="the tombstone expires after S seconds (default: until re-added)")
    rm.add_argument("--reason", default="cortex workers rm", help="kept with the tombstone")
    rm.add_argument("--no-tombstone", action="store_true",
                    help="only drop the lease: a gateway that still reaches the worker "
                         "registers it again")
    rm.set_defaults(func=_cmd_rm)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _registry(args: argparse.Namespace) -> RedisRegistry:
    if not args.redis:
        raise SpecError(f"--redis URL is required (or set ${_ENV_REDIS})")
    return RedisRegistry(args.redis, namespace=args.namespace, op_timeout_s=args.timeout)


def _labels(items: Sequence[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"labels: {item!r} must be KEY=VALUE")
        labels[key] = value
    return labels


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The spec fields given as flags (``None``: not given)."""
    engine = args.engine.lower() if args.engine else None
    if engine is not None and engine not in {e.value for e in Engine}:
        raise SpecError(f"engine: unknown engine {args.engine!r} (expected sglang or vllm)")
    return {
        "engine": engine, "role": args.role, "model": args.model, "dp_size": args.dp_size,
        "kv_events": args.kv_events, "topic": args.topic, "replay": args.replay,
        "bootstrap_port": args.bootstrap_port, "block_size": args.block_size,
        "context_length": args.context_length, "labels": _labels(args.label) or None,
        "kv_lookahead": args.kv_lookahead, "kv_eagle_drop": args.kv_eagle_drop or None,
    }


_FLAGS = {"engine": "--engine", "model": "--model", "block_size": "--block-size",
          "kv_events": "--kv-events"}


def _spec(args: argparse.Namespace) -> WorkerSpec:
    overrides = _overrides(args)
    if args.no_discover:
        given = {k: v for k, v in overrides.items() if v is not None}
        missing = [_FLAGS[name] for name in ("engine", "model") if name not in given]
        if missing:
            raise SpecError(f"--no-discover needs {' and '.join(missing)}")
        return WorkerSpec.from_dict({"id": args.id or default_worker_id(args.url),
                                     "url": args.url, **given})
    found = asyncio.run(discover(args.url, timeout_s=args.discovery_timeout))
    for line in found.report():
        print(f"discovered: {line}", file=sys.stderr)
    try:
        return found.spec(overrides, worker_id=args.id)
    except DiscoveryError as exc:
        flags = ", ".join(_FLAGS.get(name, "--" + name.replace("_", "-"))
                          for name in exc.missing)
        raise SpecError(f"{exc} ({flags})") from None


def _cmd_add(args: argparse.Namespace) -> int:
    try:
        if args.ttl < 0:
            raise SpecError("--ttl must be >= 0")
        if args.keep and args.ttl == 0:
            raise SpecError("--keep needs a lease (--ttl > 0)")
        spec = _spec(args)
        registry = _registry(args)
    except SpecError as exc:
        return _fail(str(exc), 2)
    try:
        return asyncio.run(_add(registry, spec, args.ttl, args.keep))
    except RegistryUnavailable as exc:
        return _fail(f"registry unavailable: {exc}", 1)
    except KeyboardInterrupt:
        return 0


async def _add(registry: RedisRegistry, spec: WorkerSpec, ttl: float, keep: bool) -> int:
    async with registry:
        if not keep:
            await registry.register(spec, ttl)
            lease = "no expiry" if ttl == 0 else f"lease {ttl:g}s"
            print(f"registered {spec.id} ({lease})")
            return 0
        async with LeaseKeeper(registry, spec, ttl_s=ttl):
            print(f"registered {spec.id}; renewing every {ttl / 3:g}s (Ctrl-C to remove)")
            await asyncio.Event().wait()  # until interrupted
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    try:
        registry = _registry(args)
    except SpecError as exc:
        return _fail(str(exc), 2)
    try:
        listing = asyncio.run(_list(registry))
    except RegistryUnavailable as exc:
        return _fail(f"registry unavailable: {exc}", 1)
    workers = sorted(listing.workers.values(), key=lambda s: s.id)
    stones = sorted(listing.tombstones.values(), key=lambda t: t.worker_id)
    if args.json:
        print(json.dumps({
            "workers": [{**s.to_dict(), "ttl_s": listing.ttl_s.get(s.id)} for s in workers],
            "invalid": dict(listing.invalid),
            "tombstones": [t.to_dict() for t in stones],
        }, indent=2, sort_keys=True))
        return 0
    rows = [("ID", "ENGINE", "ROLE", "MODEL", "DP", "BLOCK", "KV-EVENTS", "REPLAY", "TTL")]
    for s in workers:
        ttl = listing.ttl_s.get(s.id)
        rows.append((
            s.id, s.engine.value, s.role.value, s.model, str(s.dp_size),
            str(s.block_size or "-"), s.kv_events or "-", s.replay or "-",
            "static" if ttl is None else f"{ttl:.1f}s",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip())
    for stone in stones:
        expiry = "until re-added" if stone.ttl_s is None else f"for {stone.ttl_s:.0f}s more"
        print(f"removed: {stone.worker_id} ({stone.reason or 'no reason'}; {expiry})")
    for worker_id, reason in sorted(listing.invalid.items()):
        print(f"warning: unreadable entry {worker_id}: {reason}", file=sys.stderr)
    return 0


async def _list(registry: RedisRegistry) -> Any:
    async with registry:
        return await registry.list()


def _cmd_rm(args: argparse.Namespace) -> int:
    try:
        registry = _registry(args)
    except SpecError as exc:
        return _fail(str(exc), 2)
    if args.for_s is not None and not args.for_s > 0:
        return _fail("--for must be > 0 seconds", 2)
    try:
        found = asyncio.run(_rm(registry, args))
    except RegistryUnavailable as exc:
        return _fail(f"registry unavailable: {exc}", 1)
    kept_out = "" if args.no_tombstone else "; a tombstone keeps it out"
    if not found:
        return _fail(f"no worker {args.worker_id!r} in the registry{kept_out}", 1)
    print(f"removed {args.worker_id}{kept_out}")
    return 0


async def _rm(registry: RedisRegistry, args: argparse.Namespace) -> bool:
    async with registry:
        if args.no_tombstone:
            return await registry.deregister(args.worker_id)
        return await registry.remove(args.worker_id, tombstone_ttl_s=args.for_s,
                                     reason=args.reason)
