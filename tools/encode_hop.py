"""What handing a piece of prompt text to a thread costs, against encoding it on the event loop.

    .venv/bin/python tools/encode_hop.py [--encoder fastokens|hf]

For texts of 256 .. 16,384 characters (random words, and the parity probe's random Unicode),
the CPU of the whole process (``time.process_time``) per piece: encoded inline, and encoded
on a one-thread pool awaited from a uvloop event loop (submit, the worker's wake-up, the GIL
handed over and back, the result's callback on the loop), as the gateway's feeder thread
does. The difference is the hop; where the inline encode costs about as much as the hop is
the default of ``tokenize.inline_rest_bytes`` (docs/bench/overhead.md). A measuring tool,
not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import random
import time

from cortex.chat import EncoderChoice
from cortex.chat.encoder import _random_text
from cortex.edge.loop import choose_loop
from cortex.gateway.tokens.prompt import PromptTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", default="fastokens", choices=("fastokens", "hf"))
    parser.add_argument("--pieces", type=int, default=100, help="per size and kind")
    args = parser.parse_args()
    tok = PromptTokenizer.load(None, None, encoder=EncoderChoice(args.encoder))
    rng = random.Random(1)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                          for _ in range(rng.randint(2, 10))) for _ in range(20_000)]

    def text(kind: str, size: int) -> str:
        if kind == "unicode":
            return _random_text(rng, size)[:size]
        return " ".join(rng.choice(vocabulary) for _ in range(size // 5))[:size]

    pool = concurrent.futures.ThreadPoolExecutor(1)

    async def measure() -> None:
        print("| encoder | text | chars | inline CPU (µs) | on a thread CPU (µs) | hop (µs) |")
        print("|---|---|---|---|---|---|")
        await asyncio.wrap_future(pool.submit(tok.encode_pieces, [("warm", False)]))
        for kind in ("words", "unicode"):
            for size in (256, 1024, 4096, 16384):
                pieces = [(text(kind, size), False) for _ in range(args.pieces)]
                start = time.process_time()
                for piece in pieces:
                    tok.encode_pieces([piece])
                inline = (time.process_time() - start) / len(pieces) * 1e6
                pieces = [(text(kind, size), False) for _ in range(args.pieces)]
                start = time.process_time()
                for piece in pieces:
                    await asyncio.wrap_future(pool.submit(tok.encode_pieces, [piece]))
                hop = (time.process_time() - start) / len(pieces) * 1e6
                print(f"| {args.encoder} | {kind} | {size} | {inline:.0f} | {hop:.0f} |"
                      f" {hop - inline:+.0f} |")

    try:
        choose_loop("auto").run(measure())
    finally:
        pool.shutdown()


if __name__ == "__main__":
    main()
