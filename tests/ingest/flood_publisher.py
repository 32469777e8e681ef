"""A KV-event flood in its own process (for the fairness test).

``python flood_publisher.py PORT RATE SECONDS`` binds an XPUB on 127.0.0.1:PORT, prints
``ready``, waits for a subscriber, then publishes pre-encoded vLLM 0.33 batches (block size
16, shared prefixes and LRU evictions, see :func:`cortex.bench.ingest.make_workload`) at
RATE block events per second for SECONDS and exits. No replay endpoint: a gap it causes is
the ingest's to handle.
"""

from __future__ import annotations

import random
import sys
import time

import zmq

from cortex.bench.ingest import make_workload, stamp
from cortex.kvevents.frames import pub_frames


def main(port: int, rate: float, seconds: float) -> None:
    workload = make_workload(random.Random(1), block_size=16, capacity=20_000,
                             target_blocks=60_000)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(f"tcp://127.0.0.1:{port}")
    print("ready", flush=True)
    pub.recv()  # the subscription
    seq = sent = 0
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        for payload, blocks in zip(workload.payloads, workload.blocks, strict=True):
            ahead = sent - rate * (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead / rate)
            pub.send_multipart(pub_frames(b"", seq, stamp(payload)), copy=False)
            seq += 1
            sent += blocks
    print(f"sent {seq} batches, {sent} block events in {elapsed:.1f} s", flush=True)
    pub.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
