"""The means of what ``tools/ttftsplit`` wrote (see its ``sitecustomize.py``)::

    .venv/bin/python tools/ttftsplit/summary.py /tmp/split.jsonl
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="the CORTEX_TTFTSPLIT_OUT file")
    args = parser.parse_args()
    with open(args.file, encoding="utf-8") as f:
        for line in f:
            process = json.loads(line)
            print(f"gateway pid {process['pid']}")
            rows = sorted(process["sums"].items(), key=lambda row: row[0])
            for name, (count, seconds) in rows:
                print(f"  {name:40s} {count:8.0f}  mean {seconds / count * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
