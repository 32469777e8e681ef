"""``report.md``, ``report.json`` and the plots of ``cortex bench routing``.

The markdown is generated from the numbers alone (no hand-tuned prose), so a rerun rewrites
it completely; the targets are evaluated here, from the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cortex.bench.report import table
from cortex.bench.routing.contenders import CONTENDERS
from cortex.bench.routing.metrics import RunSummary
from cortex.bench.routing.results import Target, WorkloadResult, fmt_ms, or_nan
from cortex.bench.routing.sections import (
    variant_json,
    variant_sections,
    variant_targets,
    write_replica_plot,
)

PEERS = tuple(c for c in CONTENDERS if not c.startswith("cortex"))
"""The other routers Cortex is compared with."""

__all__ = ["PEERS", "Target", "WorkloadResult", "evaluate_targets", "report_json",
           "report_markdown", "ttft_values_ms", "write_plots"]

def evaluate_targets(results: Sequence[WorkloadResult]) -> list[Target]:
    """The issue's targets, per workload, from the runs present."""
    out: list[Target] = []
    for res in results:
        name = res.workload.name
        cx, rr = res.runs.get("cortex"), res.runs.get("sglang_round_robin")
        if cx is None:
            continue
        # a peer that answered nothing (it does not serve the path: sglang-router and
        # /v1/messages) is no yardstick; its failures show in "every run verified"
        peers = {c: r for c, r in res.runs.items() if c in PEERS and r.requests_ok}
        if peers:
            best = max(peers, key=lambda c: peers[c].hit_rate)
            out.append(Target(name, "hit rate >= the best peer's",
                              cx.hit_rate >= peers[best].hit_rate,
                              f"{cx.hit_rate:.2%} vs {peers[best].hit_rate:.2%} ({best})"))
            for i, label in ((0, "p50"), (1, "p90")):
                best = min(peers, key=lambda c: peers[c].ttft_ms[i])
                out.append(Target(
                    name, f"TTFT {label} < the best peer's",
                    cx.ttft_ms[i] < peers[best].ttft_ms[i],
                    f"{fmt_ms(cx.ttft_ms[i])} ms vs {fmt_ms(peers[best].ttft_ms[i])} ms"
                    f" ({best})"))
        if name == "shared_prefix" and rr is not None:
            ratio = cx.hit_rate / rr.hit_rate if rr.hit_rate else math.inf
            out.append(Target(name, "hit rate >= 2x round robin", ratio >= 2,
                              f"{ratio:.2f}x ({cx.hit_rate:.1%} vs {rr.hit_rate:.1%})"))
        share = cx.hit_rate / res.infinite_bound if res.infinite_bound else 1.0
        if res.capacity_allows:
            out.append(Target(name, ">= 90% of the infinite-cache bound", share >= 0.9,
                              f"{share:.1%} ({cx.hit_rate:.1%} of {res.infinite_bound:.1%})"))
        else:
            out.append(Target(
                name, ">= 90% of the infinite-cache bound", None,
                f"capacity does not allow it (pooled LRU {res.pooled_bound:.1%} < "
                f"{res.infinite_bound:.1%}); cortex reaches {share:.1%} of the bound"))
        if name.startswith("agents"):
            gap = res.infinite_bound - cx.hit_rate
            out.append(Target(name, "hit rate within 2 points of the infinite-cache bound",
                              gap <= 0.02, f"{cx.hit_rate:.1%} vs {res.infinite_bound:.1%}"))
            spread = cx.imbalance("uncached_tokens")
            out.append(Target(name, "imbalance of uncached prefill tokens <= 1.5",
                              spread <= 1.5, f"max/mean {spread:.2f}"))
        if cx.reuse is not None:
            r = cx.reuse
            out.append(Target(name, "delivered <= captured <= available on every request",
                              r.holds, f"{r.requests:,} requests: captured > available on"
                              f" {r.captured_over_available}, delivered > captured on"
                              f" {r.delivered_over_captured}"))
        if cx.prediction is not None:
            p = cx.prediction
            out.append(Target(name, "over-predicted hits on < 1% of requests",
                              p.over_fraction < 0.01,
                              f"{p.over} of {p.requests} ({p.over_fraction:.2%})"))
        out.append(Target(name, "every run verified", all(r.verified for r in res.runs.values()),
                          "; ".join(f"{c}: {', '.join(r.problems)}" for c, r in res.runs.items()
                                    if r.problems) or "all requests sent, answered and counted"))
    return out + variant_targets(results)


# ---- JSON -----------------------------------------------------------------------------------


def _num(value: float, digits: int = 4) -> float | None:
    return None if math.isnan(value) else round(value, digits)


def _run_json(run: RunSummary) -> dict[str, Any]:
    p = run.prediction
    return {
        "workload": run.workload, "contender": run.contender,
        "requests_sent": run.requests_sent, "requests_ok": run.requests_ok,
        "prompt_tokens": run.prompt_tokens, "cached_tokens": run.cached_tokens,
        "hit_rate": round(run.hit_rate, 4),
        "ttft_p50_ms": _num(run.ttft_ms[0], 2), "ttft_p90_ms": _num(run.ttft_ms[1], 2),
        "ttft_p99_ms": _num(run.ttft_ms[2], 2),
        "throughput_rps": round(run.throughput_rps, 3),
        "requests_expected": run.requests_expected, "failures": dict(run.failures),
        "e2e_p50_ms": _num(run.e2e_ms[0], 2), "e2e_p90_ms": _num(run.e2e_ms[1], 2),
        "e2e_p99_ms": _num(run.e2e_ms[2], 2),
        "duration_s": round(run.duration_s, 3), "output_tokens": run.output_tokens,
        "verified": run.verified, "problems": run.problems,
        "digest_mismatches": run.digest_mismatches,
        "prompt_token_mismatches": run.prompt_mismatches,
        "completion_token_mismatches": run.completion_mismatches,
        "send_lag_p99_ms": _num(run.send_lag_p99_ms, 2),
        "imbalance_requests": round(run.imbalance("requests"), 3),
        "imbalance_uncached_tokens": round(run.imbalance("uncached_tokens"), 3),
        "workers": {w: {"requests": t.requests, "prompt_tokens": t.prompt_tokens,
                        "cached_tokens": t.cached_tokens, "evicted_blocks": t.evicted_blocks}
                    for w, t in run.workers.items()},
        "reuse": None if run.reuse is None else {
            "requests": run.reuse.requests, "available": run.reuse.available,
            "captured": run.reuse.captured, "delivered": run.reuse.delivered,
            "captured_over_available": run.reuse.captured_over_available,
            "delivered_over_captured": run.reuse.delivered_over_captured},
        "prediction": None if p is None else {
            "requests": p.requests, "exact": p.exact, "under": p.under, "over": p.over,
            "over_fraction": round(p.over_fraction, 5), "over_tokens": p.over_tokens,
            "mean_abs_error_tokens": round(p.mean_abs_error, 2)},
        "stages": [{"rate": s.rate, "requests": s.requests, "ok": s.ok,
                    "hit_rate": round(s.hit_rate, 4), "ttft_p50_ms": _num(s.ttft_p50_ms, 2),
                    "ttft_p90_ms": _num(s.ttft_p90_ms, 2)} for s in run.stages],
        **dict(run.extra),
    }


def report_json(results: Sequence[WorkloadResult], config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "runs": [_run_json(run) for res in results for c in CONTENDERS
                 if (run := res.runs.get(c)) is not None],
        "bounds": {res.workload.name: round(res.infinite_bound, 4) for res in results},
        "pooled_lru_bounds": {res.workload.name: round(res.pooled_bound, 4) for res in results},
        "workloads": {res.workload.name: {
            "title": res.workload.title, "source": res.workload.source,
            "requests": len(res.workload.requests), "digest": res.workload.digest(),
            "prompt_tokens": res.prompt_tokens, "unique_pages": res.unique_pages,
            "kv_capacity_blocks_per_worker": res.capacity_blocks,
            "offered_prefill_load": round(res.offered_prefill_load, 3),
            "params": dict(res.workload.params)} for res in results},
        "targets": [{"workload": t.workload, "target": t.name, "met": t.met,
                     "detail": t.detail} for t in evaluate_targets(results)],
        "variants": variant_json(results),
        "config": dict(config),
    }


# ---- markdown --------------------------------------------------------------------------------


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("**met**" if met else "**missed**")


def _workload_section(res: WorkloadResult) -> list[str]:
    w = res.workload
    params = ", ".join(f"{k} {v}" for k, v in w.params.items() if v is not None)
    lines = [
        f"### {w.title} (`{w.name}`)", "",
        f"Source: {w.source}. Scaled here: {params}."
        + (f" The sims imitate {w.engine} for this workload (its conversion of the API is"
           " the one Cortex models; the timing model is the same)." if w.engine else ""), "",
        f"{len(w.requests):,} requests, {res.prompt_tokens:,} prompt tokens; request-list"
        f" digest `{w.digest()[:16]}` (every contender got exactly this list). Working set"
        f" {res.unique_pages:,} distinct prompt pages; each worker holds"
        f" {res.capacity_blocks:,}. Offered prefill load without any cache hit:"
        f" {res.offered_prefill_load:.0%} of the cluster's prefill capacity.", "",
        f"Bounds: infinite single cache **{res.infinite_bound:.1%}**; one LRU cache as large as"
        f" the whole cluster {res.pooled_bound:.1%}"
        f" ({'capacity allows the bound' if res.capacity_allows else 'capacity-limited'});"
        f" one worker's pool alone, fed every request, {res.single_worker_bound:.1%}.", "",
    ]
    rows: list[tuple[str, ...]] = []
    for c in CONTENDERS:
        run = res.runs.get(c)
        if run is None:
            continue
        t, e = run.ttft_ms, run.e2e_ms
        evicted = sum(x.evicted_blocks for x in run.workers.values())
        cpu = run.extra.get("cpu", {})
        reps = "; ".join(f"{r['hit_rate']:.1%}, {fmt_ms(r['ttft_p50_ms'])} /"
                         f" {fmt_ms(r['ttft_p90_ms'])}" for r in run.extra.get("repeats", []))
        flag = "" if run.verified else " ⚠"
        rows.append((
            c, f"{run.requests_sent:,} / {run.requests_ok:,}{flag}", f"{run.hit_rate:.1%}",
            f"{fmt_ms(t[0])} / {fmt_ms(t[1])} / {fmt_ms(t[2])}",
            f"{fmt_ms(e[0])} / {fmt_ms(e[1])} / {fmt_ms(e[2])}", f"{run.throughput_rps:.1f}",
            f"{run.imbalance('requests'):.2f} · {run.imbalance('uncached_tokens'):.2f}",
            f"{evicted:,}", _stale_cell(run.extra.get("stale")),
            fmt_ms(or_nan(run.extra.get("idle_ttft_p50_ms"))),
            f"{or_nan(cpu.get('ours_cores')):.2f} · {or_nan(cpu.get('foreign_cores')):.2f}",
            reps))
    lines += table(("contender", "sent / ok", "hit rate", "TTFT p50 / p90 / p99 ms",
                    "E2E p50 / p90 / p99 ms", "req/s", "imbalance req · uncached",
                    "evicted blocks", "stale sends", "idle TTFT ms", "CPU cores ours · foreign",
                    "per repetition: hit, TTFT p50 / p90"), rows)
    preds = [(c, r.prediction) for c, r in res.runs.items() if r.prediction is not None]
    if preds:
        lines += ["", "Cortex's predicted hit (`x-cortex-cache-hit-tokens`) against the engine's"
                  " `cached_tokens`:", "",
                  *table(("contender", "requests", "exact", "under", "over",
                          "over-predicted tokens", "mean abs error (tokens)"),
                         [(c, f"{p.requests:,}", f"{p.exact_fraction:.1%}", f"{p.under:,}",
                           f"{p.over:,} ({p.over_fraction:.2%})", f"{p.over_tokens:,}",
                           f"{p.mean_abs_error:.1f}") for c, p in preds if p is not None])]
    reuse_rows = []
    for c in CONTENDERS:
        run = res.runs.get(c)
        if run is None:
            continue
        r = run.reuse
        reuse_rows.append((
            c, f"{r.available:,}" if r else "—", f"{r.captured:,}" if r else "—",
            f"{run.cached_tokens:,}", f"{run.prompt_tokens:,}",
            f"{r.captured_over_available} · {r.delivered_over_captured}" if r else "—"))
    if any(run.reuse is not None for run in res.runs.values()):
        lines += ["", "Reuse accounting (tokens; available and captured from Cortex's"
                  " `x-cortex-reuse`, not measurable behind the peers; delivered = the"
                  " engines' `cached_tokens`):", "",
                  *table(("contender", "available", "captured", "delivered", "prompt",
                          "requests with captured > available · delivered > captured"),
                         reuse_rows)]
    split = [(c, run.extra["ttft_mean_ms"], run.extra["engine_ttft_mean_ms"])
             for c, run in ((c, res.runs[c]) for c in CONTENDERS if c in res.runs)
             if run.extra.get("ttft_mean_ms") is not None
             and run.extra.get("engine_ttft_mean_ms") is not None]
    if split:
        lines += ["", "Where the time to first token goes (mean ms): the client's TTFT, the"
                  " engines' share (a request reaching a sim's HTTP handler to its first token:"
                  " parsing, tokenizing, queueing, prefill) and the rest (the router and the"
                  " network, both ways):", ""]
        lines += table(("contender", "client TTFT", "engines", "router + network"),
                       [(c, f"{t:.1f}", f"{e:.1f}", f"{t - e:.1f}") for c, t, e in split])
    for c in CONTENDERS:
        run = res.runs.get(c)
        gateway = run.extra.get("gateway") if run is not None else None
        if run is not None and gateway:
            decided = ", ".join(f"{k} {v:,}" for k, v in gateway["decisions"].items())
            timing = ", ".join(f"{k} {v:.2f}" for k, v in gateway["routing_ms_mean"].items())
            note = (" (with alpha 0 the labels only say whether the chosen worker happened to"
                    " hold a prefix: load alone chose it)" if c == "cortex_load_only" else "")
            p50 = gateway.get("routing_ms_p50")
            median = (f"; routing time per request p50 {p50:.2f} ms (histogram)"
                      if p50 is not None else "")
            client, out = run.extra.get("ttft_mean_ms"), gateway["routing_ms_mean"].get(
                "first token out")
            outside = (f"; the client's mean TTFT minus the gateway's first token out (the"
                       f" connection, the HTTP server, the client): {client - out:.2f} ms"
                       if client is not None and out is not None else "")
            lines += ["", f"{c}: gateway decisions (mode/reason){note} {decided}; mean routing"
                      f" time per request inside the gateway (ms): {timing}{median}{outside}."]
    if w.stages:
        ran = [c for c in CONTENDERS if c in res.runs]
        lines += ["", "Per step of the rate ladder (TTFT p50 / p90 ms, hit rate):", ""]
        lines += table(("offered req/s", *ran), [
            (f"{rate:g}", *(f"{fmt_ms(s.ttft_p50_ms)} / {fmt_ms(s.ttft_p90_ms)},"
                            f" {s.hit_rate:.0%}" for s in (res.runs[c].stages[k] for c in ran)))
            for k, rate in enumerate(w.stages)])
    noisy = [(c, d) for c, r in res.runs.items() for d in r.extra.get("discarded_noisy_runs", [])]
    if noisy:
        lines += ["", "Runs discarded because other work on the machine took too much CPU"
                  " (each was run again):"]
        lines += [f"- {c}: other work {d['foreign_cores']} cores; it measured hit"
                  f" {d['hit_rate']:.1%}, TTFT p50 / p90 {fmt_ms(d['ttft_p50_ms'])} /"
                  f" {fmt_ms(d['ttft_p90_ms'])} ms" for c, d in noisy]
    problems = [(c, r.problems) for c, r in res.runs.items() if r.problems]
    if problems:
        lines += ["", "Runs that do not count:"] + [f"- {c}: {'; '.join(p)}"
                                                   for c, p in problems]
    return [*lines, ""]


def _stale_cell(stale: Mapping[str, int] | None) -> str:
    """Stale sends (of requests sent to the last holder of their prefix) as a table cell."""
    if not stale:
        return "—"
    return f"{stale['stale']:,} of {stale['affine']:,}"


def _peer_wins(results: Sequence[WorkloadResult]) -> list[str]:
    lines = []
    for res in results:
        cx = res.runs.get("cortex")
        if cx is None:
            continue
        for c, run in res.runs.items():
            if c == "cortex":
                continue
            wins = []
            if run.hit_rate > cx.hit_rate:
                wins.append(f"hit rate {run.hit_rate:.1%} vs {cx.hit_rate:.1%}")
            for i, label in ((0, "TTFT p50"), (1, "TTFT p90"), (2, "TTFT p99")):
                if run.ttft_ms[i] < cx.ttft_ms[i]:
                    wins.append(f"{label} {fmt_ms(run.ttft_ms[i])} vs {fmt_ms(cx.ttft_ms[i])}"
                                " ms")
            if run.e2e_ms[1] < cx.e2e_ms[1]:
                wins.append(f"E2E p90 {fmt_ms(run.e2e_ms[1])} vs {fmt_ms(cx.e2e_ms[1])} ms")
            if run.imbalance("requests") < cx.imbalance("requests"):
                wins.append(f"request imbalance {run.imbalance('requests'):.2f} vs"
                            f" {cx.imbalance('requests'):.2f}")
            if wins:
                lines.append(f"- `{res.workload.name}`, {c}: " + "; ".join(wins) + ".")
    return lines or ["- none: Cortex is ahead on every measured axis of every workload."]


def _noise_rule(config: Mapping[str, Any]) -> str:
    if not config.get("quiet_wait_s") and config.get("max_foreign_cores") is None:
        return "this run took no measure against other work on it (quick mode)."
    return (f"before each run the benchmark waits (up to {config['quiet_wait_s']:g} s) for other"
            f" work to drop under {config['quiet_cores']:g} cores, and a run during which other"
            f" work took more than {config['max_foreign_cores']:g} cores is discarded and run"
            " once more (listed under its workload).")


def report_markdown(results: Sequence[WorkloadResult], config: Mapping[str, Any]) -> str:
    targets = evaluate_targets(results)
    scale = round(512 / config["profile"]["tokens_per_block"])
    lines = [
        "# Routing quality: Cortex vs sglang-router and vllm-router, plain and in deployment",
        "",
        f"`{config['command']}` — {config['date']}, {config['duration_min']:.1f} min on"
        f" {config['machine']}."
        + ("" if config.get("complete", True) else
           " **Interrupted: only the workloads below were measured.**"), "",
        "Every contender runs in front of its own fresh set of"
        f" {config['workers']} `cortex sim` SGLang workers (page size {config['block_size']}"
        f" tokens, finite KV pool, prefill {config['prefill_ms_per_token']:g} ms per *uncached*"
        f" prompt token + {config['prefill_overhead_ms']:g} ms, one prefill at a time per"
        f" worker, decode {config['decode_ms_per_token']:g} ms per output token). Same request"
        " list, same arrival schedule, same seeds for every contender. "
        + (f"Cores: each contender's routing tier (Cortex's gateway, index, ingest and Redis;"
           f" or sglang-router) runs alone on CPU {config['pinned']['routing tier']}, the sims"
           f" and this load generator on CPU {config['pinned']['workers and load generator']}"
           " — in production a router does not share cores with the engines, and the sims'"
           " CPU (tokenizing every prompt again, streaming every token) is an artifact of"
           " simulating them. "
           if config.get("pinned") else
           "Every process (sims, gateway, index, ingest, Redis, sglang-router and this load"
           " generator) shares the machine's cores. ")
        + "Prompts are text that the DeepSeek-V4 tokenizer (the sims' and the"
        " gateway's) encodes as exactly one token per word, sent streamed to"
        " `/v1/completions` (chat for the multi-turn workload): sglang-router's cache-aware"
        " policy matches text, Cortex matches tokens, both see what they were built for."
        + (" The multimodal workload runs on vLLM sims instead, serving a Qwen2.5-VL-shaped"
           " model (the Qwen3.5 tokenizer and template, Qwen2.5-VL's image processor"
           " settings): each image is expanded to its placeholder run and keyed by its bytes,"
           " as vLLM does; its prompts are the Qwen3.5 tokenizer's one-token words."
           if any(r.workload.name == "multimodal" for r in results) else "")
        + " TTFT is the time to the first chunk with generated text; each request opens its own"
        " connection (with keep-alive, sglang-router 0.3.2 holds every streamed response"
        " ~40 ms here — a delayed-ACK artifact unrelated to routing — so it would lose TTFT for"
        " the wrong reason). *idle TTFT* is the p50 of a few sequential uncacheable one-token"
        " requests on the idle deployment: what the proxy path alone costs.", "",
        f"Scale: one benchmark token stands for {scale} real tokens (a Mooncake 512-token"
        f" block is {config['profile']['tokens_per_block']} tokens here; the llm-d and"
        f" multi-turn sizes are divided by {scale} too), so"
        f" {config['prefill_ms_per_token']:g} ms per benchmark token is"
        f" {config['prefill_ms_per_token'] * 1000 / scale:.1f} µs per real token"
        f" (~{scale / config['prefill_ms_per_token']:.0f}k real tokens/s of prefill per"
        " worker). Each worker's KV pool is a fixed fraction"
        f" ({config['profile']['capacity_fraction']:g}) of the workload's distinct prompt"
        " pages unless the workload prescribes one, so that no single worker can hold a"
        " workload's working set but the cluster can.", "",
        f"Each (workload, contender) ran {config['repeats']} time(s), each time on fresh"
        " processes, the contender order reversed every other repetition; the numbers pool"
        " the requests of all repetitions (the last column shows each one alone). The machine"
        f" is shared: {_noise_rule(config)} Hit rate ="
        " Σ engine-reported `cached_tokens` / Σ prompt tokens over answered requests."
        " Imbalance = max / mean per worker, of requests and of uncached prompt tokens (the"
        " prefill work). CPU cores: CPU seconds per second of the run spent by the"
        " deployment's processes and the load generator (*ours*) and by everything else on"
        " the machine (*foreign*: other work sharing the cores, i.e. noise)."
        f" {config['cortex_weights_note']}", "",
        "## Targets", "",
        *table(("workload", "target", "result", "detail"),
               [(t.workload, t.name, _verdict(t.met), t.detail) for t in targets]),
    ]

    def summary(run: RunSummary | None) -> str:
        return ("—" if run is None else f"{run.hit_rate:.1%} / {fmt_ms(run.ttft_ms[0])} /"
                f" {fmt_ms(run.ttft_ms[1])} ms")

    lines += ["", "## Summary", ""]
    lines += table(("workload", "bound", *(f"{c} hit / TTFT p50 / p90" for c in CONTENDERS)),
                   [(res.workload.name, f"{res.infinite_bound:.1%}",
                     *(summary(res.runs.get(c)) for c in CONTENDERS)) for res in results])
    lines += ["", "![hit rate](hit_rate.png)", "", "![TTFT](ttft.png)", ""]
    if any(res.workload.stages for res in results):
        lines += ["![shared-prefix ladder](ladder.png)", ""]
    lines += ["![TTFT distribution](ttft_cdf.png)", "", *variant_sections(results),
              "## Workloads", ""]
    for res in results:
        lines += _workload_section(res)
    lines += [
        "## Where a peer does better", "", *_peer_wins(results), "",
        "See [../../benchmarks.md](../../benchmarks.md) for the discussion of these numbers.",
        "", "## Reproduce", "", f"```sh\n{config['command']}\n```", "",
        "`report.json` holds every number above (and per-worker counts); the request lists"
        " are regenerated from the traces and seeds, their digests above must match.", ""]
    return "\n".join(lines)


# ---- plots -----------------------------------------------------------------------------------


_COLORS = {"cortex": "#1f6feb", "cortex_load_only": "#8cb4f5", "cortex_gpu_only": "#5a7fb8",
           "sglang_cache_aware": "#d1495b", "sglang_round_robin": "#edae49",
           "vllm_cache_aware": "#2e933c", "vllm_consistent_hash": "#7b9e3c",
           "cortex_no_agents": "#3d5a80"}


def write_plots(results: Sequence[WorkloadResult], out: Path) -> list[Path]:
    """``hit_rate.png``, ``ttft.png``, ``ttft_cdf.png`` and, with a ladder, ``ladder.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    names = [res.workload.name for res in results]
    present = [c for c in CONTENDERS if any(c in res.runs for res in results)]
    width = 0.8 / max(len(present), 1)

    fig, ax = plt.subplots(figsize=(9, 4.2))
    for j, c in enumerate(present):
        xs = [i + (j - (len(present) - 1) / 2) * width for i in range(len(results))]
        ax.bar(xs, [res.runs[c].hit_rate if c in res.runs else 0 for res in results], width,
               label=c, color=_COLORS[c])
    for i, res in enumerate(results):
        ax.hlines(res.infinite_bound, i - 0.45, i + 0.45, colors="black", linestyles="--",
                  label="infinite cache" if i == 0 else "_")
        ax.hlines(res.pooled_bound, i - 0.45, i + 0.45, colors="gray", linestyles=":",
                  label="pooled LRU (cluster memory)" if i == 0 else "_")
    ax.set_xticks(range(len(results)), names)
    ax.set_ylabel("cache hit rate (cached / prompt tokens)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("Cache hit rate per workload")
    fig.tight_layout()
    written.append(_save(fig, out / "hit_rate.png"))

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.8), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        cs = [c for c in present if c in res.runs]
        for k, (q, alpha) in enumerate(((0, 1.0), (1, 0.45))):
            ax.bar([i + (k - 0.5) * 0.4 for i in range(len(cs))],
                   [res.runs[c].ttft_ms[q] for c in cs], 0.4, alpha=alpha,
                   color=[_COLORS[c] for c in cs], label=("p50", "p90")[k])
        ax.set_xticks(range(len(cs)), [c.replace("_", "\n", 1) for c in cs], fontsize=7)
        ax.set_yscale("log")
        ax.set_title(res.workload.name, fontsize=9)
        ax.set_ylabel("TTFT ms (p50 solid, p90 light)", fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out / "ttft.png"))

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.4), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        for c in present:
            values = sorted(res.ttfts_ms.get(c, []))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                        label=c, color=_COLORS[c])
        ax.set_xscale("log")
        ax.set_title(res.workload.name, fontsize=9)
        ax.set_xlabel("TTFT ms", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out / "ttft_cdf.png"))

    laddered = [res for res in results if res.workload.stages]
    if laddered:
        res = laddered[0]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for c in present:
            run = res.runs.get(c)
            if run is None:
                continue
            rates = [s.rate for s in run.stages]
            ax1.plot(rates, [s.ttft_p50_ms for s in run.stages], "o-", color=_COLORS[c],
                     label=f"{c} p50")
            ax1.plot(rates, [s.ttft_p90_ms for s in run.stages], "o--", color=_COLORS[c],
                     alpha=0.5)
            ax2.plot(rates, [s.hit_rate for s in run.stages], "o-", color=_COLORS[c], label=c)
        ax1.set_yscale("log")
        ax1.set_xlabel("offered req/s")
        ax1.set_ylabel("TTFT ms (p50 solid, p90 dashed)")
        ax1.legend(fontsize=7)
        ax2.set_xlabel("offered req/s")
        ax2.set_ylabel("hit rate")
        ax2.set_ylim(0, 1)
        fig.suptitle(f"{res.workload.title}: rate ladder", fontsize=10)
        fig.tight_layout()
        written.append(_save(fig, out / "ladder.png"))
    replicas = write_replica_plot(results, out, _COLORS)
    return written + ([replicas] if replicas is not None else [])


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_values_ms(values_s: Sequence[float | None]) -> list[float]:
    """TTFTs in ms, unanswered ones dropped (for the CDF)."""
    return [v * 1e3 for v in values_s if v is not None]
