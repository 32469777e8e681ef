"""``cortex hash``: compute Cortex keys and engine block hashes from the shell.

- ``cortex hash keys``: Cortex block keys (unsigned decimal), one per line.
- ``cortex hash engine``: the ints an engine publishes in ``BlockStored``.
- ``cortex hash check``: this build against the golden vectors.

Exit codes: 0 ok, 1 golden mismatch, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any, TextIO

from cortex.hashing.engines import (
    VLLM_HASH_ALGOS,
    sglang_event_int,
    sglang_page_hashes,
    vllm_block_hashes,
    vllm_event_int,
    vllm_extra_keys,
)
from cortex.hashing.keys import HASH_VERSION, Engine, HashDomain
from cortex.hashing.packing import MAX_TOKEN
from cortex.hashing.vectors import self_check

__all__ = ["MAX_TOKENS", "parse_tokens", "register"]

MAX_TOKENS = 16_000_000
"""Cap on the tokens one ``--tokens`` spec may expand to (a typo must not eat memory)."""

_ENGINES = tuple(engine.value for engine in Engine)
_SEPARATORS = re.compile(r"[\s,]+")
_ITEM = re.compile(r"(\d+)(?:-(\d+))?")


class InputError(ValueError):
    """Bad command-line input: reported as one line on stderr, exit code 2."""


def parse_tokens(spec: str, high: int = MAX_TOKEN) -> list[int]:
    """Expand ``"1-16,40,41"`` into token ids (ranges inclusive; commas or spaces).

    Raises :class:`InputError` for anything else, a token above ``high``, a
    descending range or more than :data:`MAX_TOKENS` tokens.
    """
    tokens: list[int] = []
    for item in _SEPARATORS.split(spec.strip()):
        if not item:
            continue
        match = _ITEM.fullmatch(item)
        if match is None:
            raise InputError(f"bad token {item!r}: expected an id like 42 or a range like 1-32")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise InputError(f"bad token range {item!r}: the end is below the start")
        if last > high:
            raise InputError(f"token {last} is above the largest id {high}")
        if len(tokens) + last - first + 1 > MAX_TOKENS:
            raise InputError(f"--tokens expands to more than {MAX_TOKENS} tokens")
        tokens.extend(range(first, last + 1))
    return tokens


def _read_tokens(spec: str, stdin: TextIO, high: int) -> list[int]:
    return parse_tokens(stdin.read() if spec == "-" else spec, high)


def _block_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"bad --block-size {text!r}: expected a positive integer") from None
    if not 1 <= value <= MAX_TOKEN:
        raise InputError(f"bad --block-size {value}: expected 1..{MAX_TOKEN} tokens")
    return value


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InputError(f"bad {flag} {value!r}: expected one of {', '.join(choices)}")
    return value


def _print_lines(values: list[Any]) -> None:
    if values:
        sys.stdout.write("\n".join(str(value) for value in values) + "\n")


def _run_keys(args: argparse.Namespace) -> int:
    engine = _choice("--engine", args.engine, _ENGINES)
    block_size = _block_size(args.block_size)
    if not args.model:
        raise InputError("--model must be a non-empty name")
    tokens = _read_tokens(args.tokens, sys.stdin, MAX_TOKEN)
    domain = HashDomain(args.model, block_size, Engine(engine))
    _print_lines(domain.keys(tokens, args.lora_name, args.cache_salt))
    return 0


def _run_engine(args: argparse.Namespace) -> int:
    engine = Engine(_choice("--engine", args.engine, _ENGINES))
    block_size = _block_size(args.block_size)
    # Engines take 64-bit token ids (SGLang has a wide form for them).
    tokens = _read_tokens(args.tokens, sys.stdin, 2**64 - 1)
    to_int: Callable[[bytes], int]
    if engine is Engine.SGLANG:
        if args.algo is not None or args.seed is not None:
            raise InputError("--algo and --seed apply to --engine vllm only")
        if args.lora_name is not None:
            raise InputError("--lora-name has no effect on SGLang's event hashes")
        digests = sglang_page_hashes(tokens, block_size, cache_salt=args.cache_salt)
        to_int = sglang_event_int
    else:
        algo = _choice("--algo", args.algo or "sha256", VLLM_HASH_ALGOS)
        extra = vllm_extra_keys(
            len(tokens) // block_size, lora_name=args.lora_name, cache_salt=args.cache_salt
        )
        digests = vllm_block_hashes(tokens, block_size, algo=algo, seed=args.seed, extra_keys=extra)
        to_int = vllm_event_int
    _print_lines([d.hex() if args.digests else to_int(d) for d in digests])
    return 0


def _run_check(args: argparse.Namespace) -> int:
    problems = self_check()
    for problem in problems:
        print(f"cortex hash: mismatch: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: this build reproduces the golden vectors of hash version {HASH_VERSION}")
    return 0


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def func(args: argparse.Namespace) -> int:
        try:
            code: int = run(args)
        except ValueError as exc:  # InputError included: bad input, never a traceback
            print(f"cortex hash: error: {exc}", file=sys.stderr)
            return 2
        return code

    return func


def _add_token_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--block-size",
        required=True,
        metavar="B",
        help="tokens per block (vLLM block size / SGLang page size)",
    )
    parser.add_argument(
        "--tokens",
        required=True,
        metavar="SPEC",
        help="token ids: 1,2,3 and inclusive ranges 1-32 (e.g. 1-16,40,41); '-' reads stdin",
    )
    parser.add_argument("--cache-salt", metavar="S", help="the request's cache_salt")


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``cortex hash`` and its actions to the umbrella command."""
    parser = subparsers.add_parser(
        "hash",
        help="Cortex block keys and engine block hashes",
        description="Compute Cortex block keys or an engine's own block hashes.",
    )
    actions = parser.add_subparsers(dest="hash_action", metavar="ACTION", required=True)

    keys = actions.add_parser(
        "keys",
        help="Cortex block keys, one unsigned decimal per full block",
        description="Print the Cortex key of every full block (a partial tail is not keyed).",
    )
    keys.add_argument("--model", required=True, metavar="M", help="served model name")
    keys.add_argument(
        "--engine", default="sglang", metavar="ENGINE", help="sglang (default) | vllm"
    )
    keys.add_argument("--lora-name", metavar="N", help="the request's LoRA adapter name")
    _add_token_args(keys)
    keys.set_defaults(func=_guarded(_run_keys))

    engine = actions.add_parser(
        "engine",
        help="the ints an engine publishes in BlockStored.block_hashes",
        description="Print the engine's event int of every full block, chained from the start.",
    )
    engine.add_argument("--engine", required=True, metavar="ENGINE", help="sglang | vllm")
    engine.add_argument(
        "--algo",
        metavar="ALGO",
        help=f"vLLM --prefix-caching-hash-algo: {', '.join(VLLM_HASH_ALGOS)}",
    )
    engine.add_argument(
        "--seed", metavar="S", help="vLLM's PYTHONHASHSEED (default: unset = 'vllm-none-hash')"
    )
    engine.add_argument("--lora-name", metavar="N", help="vLLM: the request's LoRA adapter name")
    engine.add_argument(
        "--digests", action="store_true", help="print the full hex digests instead of event ints"
    )
    _add_token_args(engine)
    engine.set_defaults(func=_guarded(_run_engine))

    check = actions.add_parser(
        "check",
        help="verify this build against the golden vectors",
        description="Recompute every golden key and engine vector; exit 1 on any mismatch.",
    )
    check.set_defaults(func=_guarded(_run_check))
