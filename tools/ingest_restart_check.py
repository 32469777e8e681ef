"""Ingest restarted mid-workload over simulated vLLM engines: is any request over-predicted?

A dev cluster (``cortex.devcluster``: Redis, index, ingest, one gateway, two ``cortex sim
--engine vllm`` workers with a small KV pool, so they evict) serves a paced multi-turn chat
workload. The ingest is killed, left dead for ``--dead-s`` (requests keep coming), started
again and the workload goes on. Every request's prediction (``x-cortex-cache-hit-tokens``)
is compared with the engine's ``usage.prompt_tokens_details.cached_tokens``; the report
lists each over-prediction with its time after the kill, next to the index's log lines
that tell when the old ingest was declared lost and when the new one connected.

Choose the unlucky moments with ``--grace`` (the index's ``--ingest-grace-s``) against the
ingest's start-up time (~1.5-4 s here): a grace shorter than ``--dead-s`` plus start-up
makes the index lose the ingest before the new one connects (issue #28). Over-predictions
*while* the ingest is dead are expected (a dead ingest's ledger keeps its credit for the
grace); those after the new ingest connected are the bug class this tool looks for.

    .venv/bin/python tools/ingest_restart_check.py --dead-s 1.5 --grace 1.2
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.hashing import Engine

WORDS = ["cache", "prefix", "worker", "block", "token", "ledger", "route", "replica", "event"]


class Chats:
    """Conversations growing turn by turn, chosen at random; sequential and paced."""

    def __init__(self, url: str, model: str, conversations: int, pace_s: float) -> None:
        self.url, self.model, self.pace_s = url, model, pace_s
        self.rng = random.Random(28)
        self.chats = [self._opening(i) for i in range(conversations)]
        self.outcomes: list[dict[str, Any]] = []

    def _words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randrange(lo, hi)))

    def _opening(self, number: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"[chat {number}] {self._words(150, 700)}"}]

    def step(self) -> None:
        time.sleep(self.pace_s)  # the previous request's events reach the gateway first
        i = self.rng.randrange(len(self.chats))
        if sum(len(m["content"]) for m in self.chats[i]) > 12_000:
            self.chats[i] = self._opening(i)
        messages = [*self.chats[i], {"role": "user", "content": self._words(10, 120)}]
        body = {"model": self.model, "messages": messages, "temperature": 0,
                "max_tokens": self.rng.randrange(4, 24), "ignore_eos": True}
        request = urllib.request.Request(self.url + "/v1/chat/completions",
                                         json.dumps(body).encode(),
                                         {"content-type": "application/json"})
        sent = time.time()
        with urllib.request.urlopen(request, timeout=30) as answer:
            headers, reply = answer.headers, json.loads(answer.read())
        usage = reply["usage"]
        self.chats[i] = [*messages, reply["choices"][0]["message"]]
        self.outcomes.append({
            "at": sent, "worker": headers.get("x-cortex-assigned-worker"),
            "predicted": int(headers.get("x-cortex-cache-hit-tokens", "0")),
            "cached": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)})

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step()


def index_events(log: Path, since: float) -> list[str]:
    """The index's lines about ingest liveness, with their time after ``since`` (s)."""
    out = []
    for line in log.read_text().splitlines():
        if re.search(r"silent for over|sync stream from ingest|is back", line):
            stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
            at = stamp + int(line[20:23]) / 1000 - since
            out.append(f"{at:+.3f}s {line[24:].strip()[:110]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dead-s", type=float, default=1.5, help="ingest dead this long")
    parser.add_argument("--grace", type=float, default=1.2, help="index --ingest-grace-s")
    parser.add_argument("--kv-blocks", type=int, default=300, help="each sim's KV pool")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--warm", type=int, default=40, help="requests before the kill")
    parser.add_argument("--after-s", type=float, default=8.0, help="workload after restart")
    parser.add_argument("--pace-s", type=float, default=0.06, help="pause between requests")
    args = parser.parse_args()
    spec = ClusterSpec(workers=2, gateways=1, port=0, zero_cost=True, engine=Engine.VLLM,
                       kv_capacity_blocks=args.kv_blocks, lease_ttl_s=3.0,
                       ready_timeout_s=60.0, ingest_args=("--heartbeat", "0.2"),
                       index_args=("--ingest-grace-s", str(args.grace)))
    with tempfile.TemporaryDirectory() as logs, LocalCluster(spec, logs) as cluster:
        chats = Chats(cluster.gateway_urls[0], spec.model, args.conversations, args.pace_s)
        for _ in range(args.warm):
            chats.step()
        killed = time.time()
        cluster.kill("ingest")
        chats.run_for(args.dead_s)
        cluster.restart("ingest")
        chats.run_for(args.after_s)
        over = [o for o in chats.outcomes if o["predicted"] > o["cached"]]
        print(json.dumps({
            "requests": len(chats.outcomes),
            "over_predictions": [f"{o['at'] - killed:+.3f}s {o['worker']} predicted "
                                 f"{o['predicted']} cached {o['cached']}" for o in over],
            "index": index_events(Path(logs) / "index.log", killed),
        }, indent=1))
        # the ingest's ledger sizes (each sim's /sim/cache lists what it holds)
        url = f"{cluster.ingest_url}/metrics"
        ingest = urllib.request.urlopen(url).read().decode()
        print([line for line in ingest.splitlines()
               if line.startswith("cortex_ingest_ledger_blocks")])


if __name__ == "__main__":
    main()
