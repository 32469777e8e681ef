"""Golden vectors: the key values this build must produce, and a self-check.

``golden/keys_v<HASH_VERSION>.json`` pins the Cortex keys of the current
:data:`~cortex.hashing.keys.HASH_VERSION` (u64 values as decimal strings, so any
language can read them). A service can call :func:`self_check` at start-up: a
replica whose xxhash build or code disagrees with the fleet would otherwise
route every request as a cache miss, silently.

Regenerate (only together with a ``HASH_VERSION`` bump; an existing file is
never overwritten without ``--force``)::

    python -m cortex.hashing.vectors write
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from cortex.hashing.engines import engine_event_ints, vllm_none_hash
from cortex.hashing.keys import HASH_VERSION, Engine, HashDomain, block_keys

__all__ = [
    "ENGINE_VECTORS",
    "build_key_vectors",
    "check_engine_vectors",
    "check_key_vectors",
    "key_vectors_name",
    "key_vectors_path",
    "load_key_vectors",
    "self_check",
]

GOLDEN_PACKAGE = "cortex.hashing.golden"

_DOMAINS: tuple[tuple[str, int, Engine], ...] = (
    ("meta-llama/Llama-3.1-8B-Instruct", 16, Engine.SGLANG),
    ("meta-llama/Llama-3.1-8B-Instruct", 16, Engine.VLLM),
    ("meta-llama/Llama-3.1-8B-Instruct", 64, Engine.SGLANG),
    ("Qwen/Qwen2.5-7B-Instruct", 1, Engine.SGLANG),
    ("deepseek-ai/DeepSeek-V3", 32, Engine.VLLM),
    ("модель/ünïcode", 16, Engine.VLLM),
)

_EXTRAS: tuple[tuple[str | None, str | None], ...] = (
    (None, None),
    ("adapter-a", None),
    (None, "tenant-1"),
    ("adapter-a", "tenant-1"),
    ("adapter-a\0", "tenant-1"),  # a NUL must not shift a field boundary
)


def _lcg_tokens(count: int, vocab: int, state: int) -> list[int]:
    # A fixed LCG rather than `random`: the inputs are stored in the file
    # anyway, but regenerating them must not depend on the Python version.
    out = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((state >> 33) % vocab)
    return out


_TOKEN_LISTS: tuple[tuple[str, list[int]], ...] = (
    ("empty", []),
    ("one-partial-token", [7]),
    ("tokens-1-32", list(range(1, 33))),
    ("tokens-1-40-partial-tail", list(range(1, 41))),
    ("large-ids", [2**32 - 1, 0, 2**31, 151643, 2**32 - 2, 1, 65535, 65536] * 5),
    ("lcg-300-vocab-152064", _lcg_tokens(300, 152064, 42)),
)


def _u64(value: int) -> str:
    return str(value)


def build_key_vectors() -> dict[str, Any]:
    """The golden document computed by this build (inputs are fixed in code)."""
    domains: list[dict[str, Any]] = []
    roots: list[dict[str, Any]] = []
    chains: list[dict[str, Any]] = []
    continuations: list[dict[str, Any]] = []
    for model, block_size, engine in _DOMAINS:
        domain = HashDomain(model, block_size, engine)
        spec = {"model": model, "block_size": block_size, "engine": engine.value}
        domains.append({**spec, "seed": _u64(domain.seed)})
        for lora_name, cache_salt in _EXTRAS:
            root = domain.root_key(lora_name, cache_salt)
            roots.append(
                {**spec, "lora_name": lora_name, "cache_salt": cache_salt, "root": _u64(root)}
            )
        for lora_name, cache_salt in _EXTRAS[:3]:
            for name, tokens in _TOKEN_LISTS:
                keys = domain.keys(tokens, lora_name, cache_salt)
                chains.append(
                    {
                        "name": name,
                        **spec,
                        "lora_name": lora_name,
                        "cache_salt": cache_salt,
                        "tokens": name,
                        "keys": [_u64(key) for key in keys],
                    }
                )
                if len(keys) >= 3:
                    # Chaining from the middle: what ingest does with a parent key.
                    cut = len(keys) // 2
                    tail = tokens[cut * block_size :]
                    tail_keys = block_keys(tail, block_size, keys[cut - 1])
                    continuations.append(
                        {
                            "name": f"{name}-from-block-{cut}",
                            "block_size": block_size,
                            "parent": _u64(keys[cut - 1]),
                            "tokens": tail,
                            "keys": [_u64(key) for key in tail_keys],
                        }
                    )
    return {
        "hash_version": HASH_VERSION,
        "about": (
            "Cortex block keys (docs/hashing.md). u64 values are decimal strings;"
            " chains[].tokens names an entry of token_lists."
        ),
        "token_lists": dict(_TOKEN_LISTS),
        "domains": domains,
        "roots": roots,
        "chains": chains,
        "continuations": continuations,
    }


def key_vectors_name(version: int = HASH_VERSION) -> str:
    """File name of the golden vectors of a hash version."""
    return f"keys_v{version}.json"


def key_vectors_path(version: int = HASH_VERSION) -> Path:
    """Path of the golden file of ``version`` inside the installed package."""
    return Path(str(resources.files(GOLDEN_PACKAGE).joinpath(key_vectors_name(version))))


def load_key_vectors(version: int = HASH_VERSION) -> dict[str, Any]:
    """The committed golden document; ``FileNotFoundError`` if there is none."""
    doc: dict[str, Any] = json.loads(key_vectors_path(version).read_text(encoding="utf-8"))
    return doc


def check_key_vectors(doc: dict[str, Any]) -> list[str]:
    """Every disagreement between ``doc`` and this build (empty = all agree)."""
    problems: list[str] = []
    if doc.get("hash_version") != HASH_VERSION:
        problems.append(f"golden hash_version {doc.get('hash_version')} != {HASH_VERSION}")
    for case in doc["domains"]:
        domain = HashDomain(case["model"], case["block_size"], case["engine"])
        if _u64(domain.seed) != case["seed"]:
            problems.append(f"domain seed {case['model']}/{case['block_size']}/{case['engine']}")
    for case in doc["roots"]:
        domain = HashDomain(case["model"], case["block_size"], case["engine"])
        if _u64(domain.root_key(case["lora_name"], case["cache_salt"])) != case["root"]:
            problems.append(
                f"root {case['model']}/{case['block_size']}/{case['engine']}"
                f" lora={case['lora_name']!r} salt={case['cache_salt']!r}"
            )
    for case in doc["chains"]:
        domain = HashDomain(case["model"], case["block_size"], case["engine"])
        tokens = doc["token_lists"][case["tokens"]]
        keys = domain.keys(tokens, case["lora_name"], case["cache_salt"])
        if [_u64(key) for key in keys] != case["keys"]:
            problems.append(
                f"chain {case['name']} {case['model']}/{case['block_size']}/{case['engine']}"
                f" lora={case['lora_name']!r} salt={case['cache_salt']!r}"
            )
    for case in doc["continuations"]:
        keys = block_keys(case["tokens"], case["block_size"], int(case["parent"]))
        if [_u64(key) for key in keys] != case["keys"]:
            problems.append(f"continuation {case['name']}")
    return problems


ENGINE_VECTORS: tuple[dict[str, Any], ...] = (
    # spec/kv-events.md §3, reproduced by the engines' own code.
    {"engine": "vllm", "algo": "sha256", "block_size": 16, "tokens": (1, 32),
     "none_hash": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
     "ints": [1403909460543360175, 1643945449041937783]},
    {"engine": "vllm", "algo": "sha256_cbor", "block_size": 16, "tokens": (1, 32),
     "none_hash": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
     "ints": [8866452693264111234, 807986237951177663]},
    {"engine": "vllm", "algo": "sha256", "seed": "0",
     "none_hash": "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c"},
    {"engine": "sglang", "block_size": 16, "tokens": (1, 48),
     "ints": [8635429971592222890, 1256577331724852459, 5689809685380680247]},
    {"engine": "sglang", "block_size": 16, "tokens": (1, 16), "cache_salt": "s1",
     "ints": [2241309735000630258]},
)  # fmt: skip


def check_engine_vectors() -> list[str]:
    """Disagreements between the engine replicas and :data:`ENGINE_VECTORS`."""
    problems: list[str] = []
    for case in ENGINE_VECTORS:
        label = f"{case['engine']} algo={case.get('algo')} seed={case.get('seed')}"
        if "none_hash" in case:
            got = vllm_none_hash(case["algo"], case.get("seed")).hex()
            if got != case["none_hash"]:
                problems.append(f"{label}: NONE_HASH {got}")
        if "ints" in case:
            first, last = case["tokens"]
            options = {"cache_salt": case.get("cache_salt")}
            if case["engine"] == "vllm":
                options["algo"] = case["algo"]
            ints = engine_event_ints(
                case["engine"], list(range(first, last + 1)), case["block_size"], **options
            )
            if ints != case["ints"]:
                problems.append(f"{label} tokens {first}..{last}: {ints}")
    return problems


def self_check() -> list[str]:
    """Check this build against every golden vector; an empty list means it agrees."""
    try:
        doc = load_key_vectors()
    except FileNotFoundError:
        return [f"no golden vectors {key_vectors_name()} for HASH_VERSION {HASH_VERSION}"]
    return check_key_vectors(doc) + check_engine_vectors()


def write_key_vectors(path: Path, *, force: bool = False) -> None:
    """Write :func:`build_key_vectors` to ``path``; refuses to overwrite unless ``force``."""
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists: golden vectors are never rewritten in place")
    path.write_text(_format(build_key_vectors()), encoding="utf-8")


def _format(doc: dict[str, Any]) -> str:
    # One case per line: reviewable diffs without a line per token.
    def dump(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    parts = []
    for name, value in doc.items():
        if isinstance(value, list):
            body = ",\n".join(f"  {dump(item)}" for item in value)
            parts.append(f" {dump(name)}: [\n{body}\n ]")
        elif isinstance(value, dict):
            body = ",\n".join(f"  {dump(key)}: {dump(item)}" for key, item in value.items())
            parts.append(f" {dump(name)}: {{\n{body}\n }}")
        else:
            parts.append(f" {dump(name)}: {dump(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cortex.hashing.vectors")
    sub = parser.add_subparsers(dest="action", required=True)
    write = sub.add_parser("write", help="write golden/keys_v<HASH_VERSION>.json")
    write.add_argument("--force", action="store_true", help="overwrite an existing file")
    write.add_argument("--out", type=Path, help="another path (default: inside the package)")
    sub.add_parser("check", help="check this build against the golden vectors")
    args = parser.parse_args(argv)
    if args.action == "write":
        path = args.out or key_vectors_path()
        try:
            write_key_vectors(path, force=args.force)
        except FileExistsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(path)
        return 0
    problems = self_check()
    for problem in problems:
        print(f"mismatch: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
