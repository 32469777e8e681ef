"""What one turn of a long agent conversation costs the router, in process, two trees side
by side: for when a change to the request path should make an agent's turn cheaper.

    flock /tmp/cortex-heavy.lock .venv/bin/python tools/agent_turns.py \\
        --before /tmp/benchwt/.venv/bin/python --rounds 3 --out /tmp/agent_turns.md

Run with the *after* tree's interpreter; ``--before`` is another checkout's (with its own
``make venv``; the same file runs there, through that tree's packages). Each round runs
both trees in turn (the order alternates), each in its own process: ``Router.route`` on a
real in-process ledger replica (8 workers, each holding other prompts; block size 16; the
DeepSeek-V4 tokenizer with ``fastokens``), ``--sessions`` agent conversations interleaved
turn by turn, each a ``--system`` -token system prompt and task, then ``--turns`` turns that
append the previous answer (~300 tokens) and a tool result (~200 tokens). After each turn
the chosen worker's ledger stores the prompt's blocks (as its engine's KV events would) and
the answer is encoded into the tokenizer's cache (as the gateway feeds answers); with
``--whole``, every prompt is encoded whole (``tokenize.lazy: false``: the path of PD pools,
lookahead workers and a ledger over gRPC). Per turn
from the fifth on: the wall time and the thread's CPU time of parsing the request body
(``parse_request``) and of ``Router.route`` (recorded, as a served request). Medians per
round and tree; compare within rounds. Not a test: a measuring tool for docs/bench. It builds
its router as ``cortex bench tokenize`` does rather than calling a shared helper: the older
tree it runs against has only what both trees have.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ANSWER_TOKENS = 300
TOOL_TOKENS = 200
WARM_TURNS = 4


async def _turns(system: int, sessions: int, turns: int, lazy: bool = True
                 ) -> dict[str, list[float]]:
    """This tree's samples: ``{"parse_ms", "parse_cpu_ms", "route_ms", "route_cpu_ms"}``."""
    from cortex.bench.tokenize import Prose
    from cortex.chat import EncoderChoice, RenderArgs
    from cortex.gateway import (
        EngineLoad,
        GatewayConfig,
        GatewayMetrics,
        Health,
        InferencePath,
        ModelConfig,
        Router,
        TokenizeConfig,
        WorkerPool,
        next_turn,
        parse_request,
    )
    from cortex.gateway.tokens.prompt import PromptTokenizer
    from cortex.hashing import Engine
    from cortex.ledger.model import LedgerState, Source
    from cortex.ledger.replica import LedgerReplica
    from cortex.registry import WorkerSpec

    block = 16
    model = ModelConfig(name="m", block_size=block, engine=Engine.SGLANG)
    config = GatewayConfig(models=(model,), tokenize=TokenizeConfig(encoder="fastokens",
                                                                     lazy=lazy))
    workers = [f"w{i}" for i in range(8)]
    pool = WorkerPool(config.breaker)
    pool.sync({w: WorkerSpec(id=w, url=f"http://127.0.0.1:{9000 + i}", engine=Engine.SGLANG,
                             model="m", block_size=block) for i, w in enumerate(workers)})
    for worker in pool:
        worker.health = Health.HEALTHY
        worker.engine = EngineLoad(0, 0, time.monotonic() + 3600)
    tok = PromptTokenizer.load(None, None, encoder=EncoderChoice.FASTOKENS)
    replica = LedgerReplica()
    domain = model.domain
    for w in workers:
        replica.view.attach(Source(w), domain, LedgerState.READY)
    prose = Prose(tok.chat, seed=5)
    for i, w in enumerate(workers):  # every worker holds other prompts (a realistic tree)
        replica.view.store(Source(w), domain.root_key(),
                           domain.keys(tok.encode(prose.text(4_000), False)), i)

    class Synced:  # the router's view of a synced replica (the stream is not run here)
        usable = True

        def __init__(self) -> None:
            self.replica = replica

    router = Router(config, pool, {"m": tok}, None, GatewayMetrics(), Synced())
    conversations = [[{"role": "system", "content": prose.text(system)},
                      {"role": "user", "content": prose.text(100)}] for _ in range(sessions)]
    out: dict[str, list[float]] = {"parse_ms": [], "parse_cpu_ms": [], "route_ms": [],
                                   "route_cpu_ms": []}
    version = 100
    try:
        for turn in range(turns):
            for messages in conversations:
                body = {"model": "m", "messages": messages, "max_tokens": ANSWER_TOKENS}
                wall, cpu = time.perf_counter(), time.thread_time()
                req = parse_request(InferencePath.CHAT, body, config)
                parsed, parsed_cpu = time.perf_counter(), time.thread_time()
                routed = await router.route(req, time.monotonic() + 60)
                done, done_cpu = time.perf_counter(), time.thread_time()
                if turn >= WARM_TURNS:
                    out["parse_ms"].append((parsed - wall) * 1e3)
                    out["parse_cpu_ms"].append((parsed_cpu - cpu) * 1e3)
                    out["route_ms"].append((done - parsed) * 1e3)
                    out["route_cpu_ms"].append((done_cpu - parsed_cpu) * 1e3)
                version += 1  # the engine caches the whole prompt (a walk keys only a prefix)
                args = RenderArgs.of(Engine.SGLANG, messages)
                replica.view.store(Source(routed.decision.chosen.worker_id), domain.root_key(),
                                   domain.keys(tok.encode_prompt(tok.prompt(args))), version)
                answer = {"role": "assistant", "content": prose.text(ANSWER_TOKENS)}
                tok.encode_prompt(tok.prompt(next_turn(args, answer)))  # the answer fed
                messages += [answer, {"role": "user", "content": prose.text(TOOL_TOKENS)}]
    finally:
        router.close()
    return out


def _child(args: argparse.Namespace) -> None:
    samples = asyncio.run(_turns(args.system, args.sessions, args.turns, not args.whole))
    print(json.dumps(samples))


def _run(python: str, args: argparse.Namespace) -> dict[str, list[float]]:
    done = subprocess.run(
        [python, __file__, "--child", "--system", str(args.system), "--sessions",
         str(args.sessions), "--turns", str(args.turns), *(["--whole"] if args.whole else [])],
        check=True, capture_output=True, text=True)
    result: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _rev(python: Path) -> str:
    """The commit of the checkout whose ``.venv/bin/python`` this is."""
    done = subprocess.run(["git", "-C", str(python.parent.parent.parent), "rev-parse",
                           "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def _report(args: argparse.Namespace, rounds: list[dict[str, dict[str, list[float]]]]) -> str:
    lines = [f"# Agent turns through `Router.route`, two trees ({time.strftime('%Y-%m-%d')})",
             "", f"`{' '.join(sys.argv)}`", "",
             f"before: `{args.before}` at {_rev(Path(args.before))}; after: "
             f"`{sys.executable}` at {_rev(Path(sys.executable))}.", "",
             f"{args.sessions} conversations interleaved, a {args.system:,}-token system prompt, "
             f"{args.turns} turns (+{ANSWER_TOKENS} answer and +{TOOL_TOKENS} tool tokens "
             f"each){'; every prompt encoded whole (`tokenize.lazy: false`)' if args.whole else ''}"
             f"; medians of turns {WARM_TURNS + 1}..{args.turns}, ms per turn.", "",
             "| round | tree | parse wall | parse CPU | route wall | route CPU |",
             "|---|---|---:|---:|---:|---:|"]
    for i, trees in enumerate(rounds, 1):
        for tree, s in trees.items():
            lines.append(f"| {i} | {tree} | " + " | ".join(
                f"{statistics.median(s[key]):.3f}"
                for key in ("parse_ms", "parse_cpu_ms", "route_ms", "route_cpu_ms")) + " |")
    ratios = [statistics.median(r["after"]["route_cpu_ms"])
              / statistics.median(r["before"]["route_cpu_ms"]) for r in rounds]
    lines += ["", "Route CPU after / before, per round: "
              + ", ".join(f"{r:.2f}" for r in ratios)
              + f" (median {statistics.median(ratios):.2f})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the other tree's Python")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system", type=int, default=16_000,
                        help="system prompt tokens (default 16000)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--whole", action="store_true",
                        help="tokenize.lazy false: every prompt encoded whole (as for PD)")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if not args.before:
        parser.error("--before is required")
    rounds = []
    for i in range(args.rounds):
        order = [("before", args.before), ("after", sys.executable)]
        trees = {name: _run(python, args) for name, python in (order[::-1] if i % 2 else order)}
        rounds.append(trees)
    report = _report(args, rounds)
    if args.out:
        args.out.write_text(report, encoding="utf-8")
    print(report)


if __name__ == "__main__":
    main()
