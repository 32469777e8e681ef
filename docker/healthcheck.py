"""Container health checks (exit 0 healthy, 1 not), with the probes ``cortex up`` uses.

    python /opt/cortex/healthcheck.py http URL               # any 2xx
    python /opt/cortex/healthcheck.py grpc HOST:PORT [SVC]   # grpc.health.v1 SERVING
"""

from __future__ import annotations

import sys

from cortex.edge.probes import probe_grpc_health, probe_http


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "http":
        return 0 if probe_http(argv[1], timeout=3.0) else 1
    if len(argv) >= 2 and argv[0] == "grpc":
        host, _, port = argv[1].rpartition(":")
        service = argv[2] if len(argv) > 2 else ""
        return 0 if probe_grpc_health(host, int(port), service, timeout=3.0) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
