"""Rewrite references to moved gateway modules (issue #25: the gateway in subpackages).

``python tools/gateway_moves.py [PATH ...]`` rewrites, in every text file under the paths
(default: the repository), each dotted module name ``cortex.gateway.<old>`` and each file path
``cortex/gateway/<old>.py`` to its new place (after the merges of one stage's halves, the
module that holds its code now), in one pass (a name already rewritten is never
rewritten again). Run it on a branch written against the flat layout to rebase it onto the
subpackages. ``--move`` also performs the ``git mv`` (once, on the branch that made the move).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

GATEWAY = Path("services/gateway/cortex/gateway")

# old module (flat) -> new module (dotted, under cortex.gateway)
MOVES: Mapping[str, str] = {
    "admin": "api.admin",
    "admission": "http.admission",
    "answers": "tokens.answers",
    "attempt": "dispatch.attempt",
    "auth": "http.auth",
    "breaker": "fleet.breaker",
    "config": "config.gateway",
    "decision_headers": "api.decision_headers",
    "disagg": "dispatch.pd.dispatcher",
    "dispatch": "dispatch.dispatcher",
    "edge": "http.middleware",
    "edgeconfig": "config.middleware",
    "encoder": "tokens.parallel",
    "engine_info": "fleet.engine_info",
    "epp": "epp.picker",
    "epp_server": "epp.server",
    "handoff": "dispatch.pd.handoff",
    "health": "fleet.health",
    "heavylane": "tokens.heavylane",
    "http": "http.messages",
    "index_client": "ledger.index_client",
    "inference": "api.inference",
    "legs": "dispatch.pd.legs",
    "limits": "request.limits",
    "listener": "http.listener",
    "load": "fleet.load",
    "matching": "ledger.matching",
    "ops": "api.ops",
    "pairing": "routing.pairing",
    "payload": "request.payload",
    "plan": "dispatch.plan",
    "pool": "fleet.pool",
    "predicted": "routing.predicted",
    "relay": "api.relay",
    "replica_client": "ledger.replica_client",
    "router": "routing.router",
    "scoring": "routing.scoring",
    "seeding": "fleet.seeding",
    "segments": "tokens.segments",
    "servingconfig": "config.serving",
    "sse": "upstream.sse",
    "tokencache": "tokens.cache",
    "tokenize": "tokens.prompt",
    "tokenize_endpoints": "api.tokenize",
    "tokenizing": "tokens.service",
    "types": "http.asgi",
    "upstream": "upstream.client",
}

# The names of the first move (commit "gateway: subpackages by stage") that the renames of
# near-twins changed after it: for a branch already rebased onto that commit.
RENAMED: Mapping[str, str] = {
    "api.tokenize_endpoints": "api.tokenize",
    "config.edgeconfig": "config.middleware",
    "config.servingconfig": "config.serving",
    "dispatch.pd.disagg": "dispatch.pd.dispatcher",
    "http.edge": "http.middleware",
    "tokens.encoder": "tokens.parallel",
    "tokens.tokencache": "tokens.cache",
    "tokens.tokenize": "tokens.prompt",
    "tokens.tokenizing": "tokens.service",
}

# The merges of one stage's halves into its main module (code moved, not rewritten), after the
# moves and renames: a branch written before them is rewritten to the main module.
MERGED: Mapping[str, str] = {
    "api.decision_headers": "api.inference",
    "fleet.breaker": "fleet.pool",
    "fleet.progress": "fleet.pool",
    "http.connection": "http.admission",
    "http.middleware": "http.messages",
    "ledger.matching": "ledger.replica_client",
    "request.limits": "request.payload",
    "routing.observer": "routing.router",
    "routing.pairing": "routing.scoring",
    "routing.predicted": "routing.placement",
    "routing.routed": "routing.router",
    "tokens.cache": "tokens.prompt",
    "tokens.segments": "tokens.prompt",
}

# What each stage is: the docstring of its package.
STAGES: Mapping[str, str] = {
    "http": "HTTP in front of everything: the ASGI contract, the request view and responses, "
            "the listener, client auth, CORS, the access log, admission control.",
    "api": "The endpoints: inference, passthrough relay, admin, operations, tokenize, "
           "and the decision headers every answer carries.",
    "epp": "The Envoy endpoint picker (ext_proc) answered by Cortex's own routing.",
    "request": "Request bodies into validated requests, and a model's request bounds (pure).",
    "tokens": "Prompt text into the exact token ids the engine will see: the tokenizer core, "
              "its segment cache, the parallel encoder, the heavy lane, the answers' tokens.",
    "routing": "The routing decision: prompt blocks, ledger match, predicted blocks, scoring, "
               "prefill/decode pairing.",
    "ledger": "The gateway's view of the ledger: the in-process replica, the index over gRPC, "
              "and what a match answered.",
    "dispatch": "Running a routing decision against workers up to the first byte: the plan "
                "(pure), the attempt, the dispatcher; prefill/decode in ``pd``.",
    "dispatch/pd": "Prefill/decode dispatch: the pair's legs, the handoff on the wire, "
                   "the dispatcher.",
    "upstream": "Calls to workers: the HTTP client and SSE framing.",
    "fleet": "The live worker pool and what keeps it true: breakers, health probes, "
             "engine-reported load, seeding by URL, engine limits.",
    "config": "The gateway's one configuration object and its sections (frozen, validated).",
}


def _patterns(moves: Mapping[str, str]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    names = "|".join(re.escape(old) for old in sorted(moves, key=len, reverse=True))
    # A name followed by one of the new modules is already moved (``http.messages``): the
    # rewrite is idempotent, so a half-rebased branch can be run through it again.
    leaves = {part for new in moves.values() for part in new.split(".")[1:]}
    moved = "|".join(sorted(leaves, key=len, reverse=True))
    dotted = re.compile(rf"\bcortex\.gateway\.({names})(?![A-Za-z0-9_])(?!\.(?:{moved})\b)")
    paths = "|".join(re.escape(old.replace(".", "/"))
                     for old in sorted(moves, key=len, reverse=True))
    path = re.compile(rf"\bcortex/gateway/({paths})\.py\b")
    return dotted, path


# Names that left a module after the moves: (module, name) -> the module that has it now.
MOVED_NAMES: Mapping[tuple[str, str], str] = {
    ("routing.router", "Placement"): "routing.placement",
}


def _split_from_imports(text: str) -> str:
    """``from cortex.gateway.<module> import a, b`` lines whose names moved, split so each
    name is imported from where it is now (single-line imports only)."""
    def split(m: re.Match[str]) -> str:
        module, names = m.group(1), [n.strip() for n in m.group(2).split(",")]
        homes: dict[str, list[str]] = {}
        for name in names:
            homes.setdefault(MOVED_NAMES.get((module, name), module), []).append(name)
        return "\n".join(f"from cortex.gateway.{home} import {', '.join(ns)}"
                         for home, ns in homes.items())
    return re.sub(r"^from cortex\.gateway\.([\w.]+) import ([\w, ]+)$", split, text,
                  flags=re.M)


def rewrite_text(text: str, moves: Mapping[str, str] | None = None) -> str:
    """``text`` with every old module name and file path of ``moves`` (default: the flat
    names, the first move's renamed ones and the merged ones) replaced, in one pass."""
    if moves is None:
        moves = {old: MERGED.get(new, new) for old, new in {**MOVES, **RENAMED}.items()}
        moves.update(MERGED)
    dotted, path = _patterns(moves)
    text = _split_from_imports(dotted.sub(lambda m: "cortex.gateway." + moves[m.group(1)], text))
    return path.sub(
        lambda m: "cortex/gateway/" + moves[m.group(1).replace("/", ".")].replace(".", "/") + ".py",
        text)


_SKIP = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".json", ".sh", ""}


def _files(roots: Iterable[Path]) -> Iterable[Path]:
    for root in roots:
        candidates = [root] if root.is_file() else root.rglob("*")
        for p in candidates:
            if (p.is_file() and not _SKIP.intersection(p.parts) and p.suffix in _SUFFIXES
                    and not any(part.endswith(".egg-info") for part in p.parts)):
                yield p


def rewrite(roots: Iterable[Path]) -> list[Path]:
    """Rewrite the files under ``roots`` in place; return those that changed."""
    changed = []
    for p in _files(roots):
        try:
            old = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        new = rewrite_text(old)
        if new != old:
            p.write_text(new)
            changed.append(p)
    return changed


def move() -> None:
    """``git mv`` each flat module into its stage, and write each stage's ``__init__``."""
    for stage, doc in STAGES.items():
        init = GATEWAY / stage / "__init__.py"
        init.parent.mkdir(parents=True, exist_ok=True)
        init.write_text('"""' + textwrap.fill(doc, 96, subsequent_indent="") + '\n"""\n')
        subprocess.run(["git", "add", str(init)], check=True)
    for old, new in MOVES.items():
        target = GATEWAY / (new.replace(".", "/") + ".py")
        subprocess.run(["git", "mv", str(GATEWAY / f"{old}.py"), str(target)], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[Path(".")])
    parser.add_argument("--move", action="store_true", help="git mv the modules first")
    args = parser.parse_args(argv)
    if args.move:
        move()
    for p in rewrite(args.paths):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
