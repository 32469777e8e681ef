"""CPU-time profiles of running Cortex services, for when a sampling profiler cannot tell
CPU from waiting (a service sharing its cores with busy engines is often runnable but not
running, and py-spy counts those samples as busy).

Put this directory on ``PYTHONPATH`` and name the services in ``CORTEX_CPUPROF`` (a comma
list of ``gateway``, ``ingest``, ``index``) and the output directory in
``CORTEX_CPUPROF_DIR``; every Python process started that way whose command line is
``cortex.edge.main <service>`` for a named service runs under ``cProfile`` timed by its
thread's CPU clock (``time.thread_time``: waiting costs nothing, the main thread only).
``kill -USR1 <pid>`` writes what was profiled since the previous signal to
``<dir>/<service>.<n>.<unix time>.pstats`` and starts afresh, so a benchmark's window can be
cut out of a run::

    CORTEX_CPUPROF=gateway,ingest CORTEX_CPUPROF_DIR=/tmp/prof PYTHONPATH=tools/cpuprof \\
        .venv/bin/cortex bench routing --real-engines ...
    # meanwhile: every few seconds, kill -USR1 $(pgrep -f "cortex.edge.main gateway")

The profiler adds its own cost to every call (about 2-3x the CPU of a Python-heavy
service), so compare shares within one profile, not times across runs. Not imported by
anything else; a measuring aid for docs/bench.
"""

from __future__ import annotations

import os
import sys


def _install() -> None:
    command = " ".join(sys.orig_argv)
    wanted = os.environ.get("CORTEX_CPUPROF", "").split(",")
    out = os.environ.get("CORTEX_CPUPROF_DIR")
    service = next((name for name in ("gateway", "ingest", "index")
                    if f"cortex.edge.main {name}" in command and name in wanted), None)
    if service is None or not out:
        return
    import cProfile
    import signal
    import time

    state = {"profile": cProfile.Profile(time.thread_time), "n": 0}
    state["profile"].enable()

    def rotate(signum: int, frame: object) -> None:
        profile = state["profile"]
        profile.disable()
        profile.dump_stats(os.path.join(out, f"{service}.{state['n']:03d}.{time.time():.0f}"
                                             ".pstats"))
        state["n"] += 1
        state["profile"] = cProfile.Profile(time.thread_time)
        state["profile"].enable()

    signal.signal(signal.SIGUSR1, rotate)


_install()
