"""The pure parts of ``cortex bench routing --real-engines``: the row a contender's shots
make, the seeded conversations, and the report built from the rows of separate runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cortex.bench.procstat import cpu_s, session_cpu_s
from cortex.bench.routing import command as routing
from cortex.bench.routing.real import (
    ENGINE_TIMES,
    GATEWAY_TIMES,
    KV_BLOCKS,
    LONGEST_PROMPT,
    REAL_MODELS,
    Client,
    Conversations,
    Occupancy,
    Shot,
    _histogram_totals,
    _workload,
    bench_engines,
    engine_max_len,
    fastokens_chosen,
    pooled_cpu,
    served_by,
    summarise,
    time_split,
    write_report,
)
from cortex.testing import wait_until
from cortex.testing.vllm_engines import (
    BLOCK_SIZE,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    MODELS,
    VllmEngine,
    VllmInstall,
    native_dtype,
)

CPU = {"wall_s": 10.0, "processes": {"gateway-0": 0.3, "index": 0.1, "load generator": 5.0}}


def test_a_row_counts_the_engines_hits_and_cortex_predictions() -> None:
    shots = [Shot(0.05, 100, 0, 0), Shot(0.03, 200, 160, 176), Shot(0.01, 100, 96, 96),
             Shot(0.02, 100, 96, 96)]
    row = summarise("cortex", shots, CPU)
    assert row["hit_rate"] == round(352 / 500, 4)
    assert (row["over_predictions"], row["exact"]) == (1, 3)
    assert (row["ttft_p50_ms"], row["ttft_p90_ms"]) == (30.0, 50.0)
    # per request, routing tier only: the load generator is not charged
    assert row["cpu_ms_per_request"] == {"gateway-0": 75.0, "index": 25.0}
    assert row["routing_cpu_ms_per_request"] == 100.0
    peer = summarise("round_robin", [Shot(0.01, 100, 0, -1)], CPU)
    assert (peer["over_predictions"], peer["exact"]) == (None, None)  # nothing predicted


def test_conversations_grow_and_restart_near_their_limit() -> None:
    chats = Conversations(2, seed=7, max_tokens=50)
    i, messages = chats.next()
    assert [m["role"] for m in messages] == ["system", "user"]
    chats.answered(i, messages, "answer", size=10)
    assert Conversations(2, seed=7).chats == Conversations(2, seed=7).chats  # seeded
    while (n := chats.next())[0] != i:
        pass
    assert [m["role"] for m in n[1]] == ["system", "user", "assistant", "user"]
    chats.answered(i, n[1], "again", size=60)  # past the limit: a fresh opening next time
    while (n := chats.next())[0] != i:
        pass
    assert [m["role"] for m in n[1]] == ["system", "user"]


def test_the_report_joins_runs_in_contender_order(tmp_path: Path) -> None:
    for name in ("round_robin", "cortex"):
        row = summarise(name, [Shot(0.02, 100, 50, 50 if name == "cortex" else -1)], CPU)
        row.update(model="model-qwen-slow", kv_blocks=256)
        (tmp_path / f"real-{name}.json").write_text(json.dumps(row))
    text = write_report(tmp_path, "cortex bench routing --real-engines").read_text()
    first_table = text.split("## TTFT by uncached")[0]
    rows = [line for line in first_table.splitlines() if line.startswith("| cortex")
            or line.startswith("| round_robin")]
    assert [r.split(" | ")[0] for r in rows] == ["| cortex", "| round_robin"]
    assert "| 0 (1 of 1) |" in rows[0] and "| — |" in rows[1]
    assert "`model-qwen-slow`" in text and "256-block KV caches" in text
    # one shot of 50 uncached tokens: the cheapest band, at its TTFT
    assert "| cortex | 50 | 1, 20 | 0, — | 0, — |" in text
    assert (tmp_path / "real-engines.png").stat().st_size > 0
    assert "## Engine changes" not in text  # no request's engine is known
    assert "pinned" not in text  # the OS placed the engines
    row.update(pinned=True)
    (tmp_path / "real-cortex.json").write_text(json.dumps(row))
    text = write_report(tmp_path, "cortex bench routing --real-engines").read_text()
    assert "each engine's processes pinned to a core of their own" in text


def test_the_engine_that_served_a_request_is_the_one_whose_work_grew() -> None:
    assert served_by([10.0, 20.0], [10.0, 35.0]) == 1
    assert served_by([10.0, 20.0], [10.0, 20.0]) == -1  # nothing read
    assert served_by([10.0, 20.0], [11.0, 21.0]) == -1  # both worked: not one request's


def test_the_report_counts_engine_changes_and_their_cold_requests(tmp_path: Path) -> None:
    shots = [Shot(0.30, 900, 0, -1, 0, -1),  # a window's first request: unknown
             Shot(0.40, 900, 0, -1, 1, 1), Shot(0.50, 900, 0, -1, 0, 1),
             Shot(0.20, 900, 0, -1, 0, 0), Shot(0.05, 900, 800, -1, 0, 0)]
    row = summarise("round_robin", shots, CPU)
    (tmp_path / "real-round_robin.json").write_text(json.dumps(row))
    text = write_report(tmp_path, "cortex bench routing --real-engines").read_text()
    assert "| round_robin | 2 / 4 | 2 / 3 | 500 / 500 | 200 / 200 |" in text


@contextlib.contextmanager
def _served(server: ThreadingHTTPServer) -> Iterator[str]:
    """``server`` answering on a thread for the block: its URL."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _Answers(BaseHTTPRequestHandler):
    """Answers every GET with :meth:`body`, the connection kept alive."""

    protocol_version = "HTTP/1.1"

    def body(self) -> bytes:
        raise NotImplementedError

    def do_GET(self) -> None:
        body = self.body()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


_ENGINE_METRICS = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.1
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.3
vllm:request_prefill_time_seconds_created{engine="0",model_name="m"} 1.7e9
cortex_gateway_routing_seconds_sum{stage="tokenize"} 0.25
cortex_gateway_routing_seconds_sum{stage="total"} 0.5
cortex_gateway_routing_seconds_count{stage="total"} 2.0
"""


def test_the_time_to_first_token_is_split_by_the_engines_histograms() -> None:
    class Metrics(_Answers):
        def body(self) -> bytes:
            return _ENGINE_METRICS.encode()

    with _served(ThreadingHTTPServer(("127.0.0.1", 0), Metrics)) as url:
        totals = _histogram_totals([url, url], ENGINE_TIMES)  # two engines, summed
        gateway_totals = _histogram_totals([url], GATEWAY_TIMES)
    assert totals["vllm:time_to_first_token_seconds_count"] == 4.0
    assert totals["vllm:time_to_first_token_seconds_sum"] == 1.0
    # a selector counts its stage only, not every stage's samples
    assert gateway_totals['cortex_gateway_routing_seconds_sum{stage="total"}'] == 0.5
    shots = [Shot(0.30, 100, 0, -1), Shot(0.40, 100, 0, -1), Shot(0.20, 100, 0, -1),
             Shot(0.30, 100, 0, -1)]
    split = time_split(shots, totals, {})
    assert split == {"client_ttft_ms": 300.0, "engine_ttft_ms": 250.0, "engine_queue_ms": 50.0,
                     "engine_prefill_ms": 150.0, "routing_ms": None,
                     "upstream_first_byte_ms": None, "path_ms": 50.0}
    gateway = {'cortex_gateway_routing_seconds_sum{stage="total"}': 0.008,
               'cortex_gateway_routing_seconds_count{stage="total"}': 4.0,
               "cortex_gateway_upstream_first_byte_seconds_sum": 1.04,
               "cortex_gateway_upstream_first_byte_seconds_count": 4.0}
    assert time_split(shots, totals, gateway)["routing_ms"] == 2.0
    assert time_split([], {}, {})["client_ttft_ms"] is None  # nothing measured: no mean


def test_the_report_says_where_the_time_to_first_token_went(tmp_path: Path) -> None:
    row = summarise("cortex", [Shot(0.30, 100, 0, -1)], CPU)
    row["time_split"] = {"client_ttft_ms": 300.0, "engine_ttft_ms": 250.0,
                         "engine_queue_ms": 50.0, "engine_prefill_ms": 150.0,
                         "routing_ms": 2.0, "upstream_first_byte_ms": 260.0, "path_ms": 50.0}
    (tmp_path / "real-cortex.json").write_text(json.dumps(row))
    text = write_report(tmp_path, "cortex bench routing --real-engines").read_text()
    assert "| cortex | 300.0 | 250.0 | 50.0 | 150.0 | 50.0 | 2.0 | 260.0 | — |" in text
    row["stacked_share"] = 0.25
    (tmp_path / "real-cortex.json").write_text(json.dumps(row))
    text = write_report(tmp_path, "cortex bench routing --real-engines").read_text()
    assert "| 260.0 | 25% |" in text


class _Load(_Answers):
    """vLLM's ``GET /load``: ``server_load`` is the class's ``load``."""

    load = 0

    def body(self) -> bytes:
        return json.dumps({"server_load": type(self).load}).encode()


def test_occupancy_counts_requests_stacked_on_one_engine_while_another_idles() -> None:
    class Busy(_Load):
        load = 2

    class Idle(_Load):
        load = 0

    handlers: list[type[_Load]] = [Busy, Idle]
    with (_served(ThreadingHTTPServer(("127.0.0.1", 0), handlers[0])) as busy,
          _served(ThreadingHTTPServer(("127.0.0.1", 0), handlers[1])) as idle):
        with Occupancy([busy, idle], interval_s=0.002) as occupancy:
            wait_until(lambda: occupancy.crowded >= 5, 10, 0.01, "five crowded samples")
            handlers[0].load = handlers[1].load = 1  # one each: crowded, not stacked
            stacked = occupancy.stacked
            wait_until(lambda: occupancy.crowded >= stacked + 5, 10, 0.01, "five more")
            handlers[0].load = handlers[1].load = 0  # nothing at once: not counted
            crowded, stacked = occupancy.crowded, occupancy.stacked
        assert stacked >= 5 and crowded >= stacked + 4
    occupancy.count([0, 1])
    occupancy.count([3, 0])
    assert (occupancy.crowded, occupancy.stacked) == (crowded + 1, stacked + 1)


class _ClosesAfterEachAnswer(BaseHTTPRequestHandler):
    """Answers one streamed chat, then closes the connection without saying so, as a server
    whose keep-alive timeout ran out between two requests does."""

    protocol_version = "HTTP/1.1"
    answer = (b'data: {"choices": [{"delta": {"content": "hi"}}], "usage": {"prompt_tokens": 3,'
              b' "prompt_tokens_details": {"cached_tokens": 1}}}\n\ndata: [DONE]\n\n')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.answer)))
        self.send_header("x-cortex-assigned-worker", "vllm-1")
        self.send_header("x-cortex-match-mode", "exact_kv")
        self.send_header("x-cortex-match-reason", "hit")
        self.end_headers()
        self.wfile.write(self.answer)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def test_the_client_sends_again_on_a_connection_the_server_closed() -> None:
    closed = threading.Semaphore(0)

    class Server(ThreadingHTTPServer):
        def shutdown_request(self, request: object) -> None:
            super().shutdown_request(request)  # type: ignore[arg-type]
            closed.release()

    client = Client()
    with _served(Server(("127.0.0.1", 0), _ClosesAfterEachAnswer)) as url:
        try:
            sent = []
            for _ in range(2):
                shot, text = client.stream(url, {"messages": []})
                assert (text, shot.prompt_tokens, shot.cached_tokens) == ("hi", 3, 1)
                assert shot.worker == "vllm-1"  # what Cortex says it chose
                assert shot.decision == "exact_kv/hit"  # and why
                assert shot.sent_s < shot.done_s
                sent.append(shot.sent_s)
                assert closed.acquire(timeout=10)  # the server closed that connection
            assert 0 <= sent[0] < sent[1]  # since the client began
        finally:
            client.close()


def test_clients_send_at_once_each_its_own_share() -> None:
    pairs = threading.Barrier(2, timeout=10)  # every request waits for another in flight

    class Paired(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # connections kept alive, as an engine keeps them

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            try:
                pairs.wait()
                answer, status = _ClosesAfterEachAnswer.answer, 200
            except threading.BrokenBarrierError:
                answer, status = b"alone", 503
            self.send_response(status)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    with _served(ThreadingHTTPServer(("127.0.0.1", 0), Paired)) as url:
        shots = _workload([url], 4, 4, 0, clients=2)
    assert [s.prompt_tokens for s in shots] == [3] * 4
    assert sorted(s.client for s in shots) == [0, 0, 1, 1]
    assert all(s.decision == "" for s in shots)  # no Cortex headers: a peer


def test_windows_pool_their_seconds_and_weigh_their_cores_by_wall_time() -> None:
    first = {"wall_s": 10.0, "processes": {"gateway-0": 0.3, "load generator": 1.0},
             "ours_cores": 0.2, "engines_cores": 1.0, "foreign_cores": 0.1}
    second = {"wall_s": 30.0, "processes": {"gateway-0": 0.9, "load generator": 2.0},
              "ours_cores": 0.4, "engines_cores": 1.4, "foreign_cores": 0.5}
    pooled = pooled_cpu([first, second])
    assert pooled["wall_s"] == 40.0
    assert pooled["processes"] == {"gateway-0": 1.2, "load generator": 3.0}
    assert (pooled["ours_cores"], pooled["engines_cores"], pooled["foreign_cores"]) == (
        0.35, 1.3, 0.4)


def test_the_report_shows_each_repetition_and_the_discarded_windows(tmp_path: Path) -> None:
    row = summarise("cortex", [Shot(0.02, 100, 50, 50)] * 2, CPU)
    row["cpu"] = {"engines_cores": 1.5, "foreign_cores": 0.12}
    row["repetitions"] = [
        {"repetition": 0, "hit_rate": 0.5, "ttft_p50_ms": 20.0, "ttft_p90_ms": 20.0,
         "routing_cpu_ms_per_request": 1.0, "foreign_cores": 0.9, "discarded": True},
        {"repetition": 0, "hit_rate": 0.5, "ttft_p50_ms": 21.0, "ttft_p90_ms": 22.0,
         "routing_cpu_ms_per_request": 1.0, "foreign_cores": 0.1, "discarded": False}]
    (tmp_path / "real-cortex.json").write_text(json.dumps(row))
    line = next(line for line in write_report(tmp_path, "x").read_text().splitlines()
                if line.startswith("| cortex | 2 |"))
    assert "| 1.5 · 0.12 |" in line
    assert line.endswith("| 50.0%, 20.0 / 20.0 (0.9, discarded); 50.0%, 21.0 / 22.0 (0.1) |")


def test_a_session_is_metered_with_the_processes_its_leader_started() -> None:
    """The engines fork their workers: their CPU counts against the engine's session, so it
    is not read as other work on the machine."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable,"
         " '-c', 'import time\\nend = time.monotonic() + 30\\nwhile time.monotonic() < end:"
         " pass']).wait()"], start_new_session=True)
    try:
        wait_until(lambda: session_cpu_s(leader.pid) >= 0.3, 20, 0.05,
                   "the session's busy child to spend 0.3 s of CPU")
        assert (cpu_s(leader.pid) or 0.0) < 0.2  # the leader itself only waits for it
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_a_profiled_row_adds_its_top_frames_to_the_report(tmp_path: Path) -> None:
    row = summarise("cortex", [Shot(0.02, 100, 50, 50)], CPU)
    row["profile"] = {"process": "gateway-0", "samples": 1234, "frames": [
        {"name": "route (gateway/routing/router)", "self_pct": 12.5, "total_pct": 40.0}]}
    (tmp_path / "real-cortex.json").write_text(json.dumps(row))
    text = write_report(tmp_path, "cortex bench routing --real-engines --profile").read_text()
    assert "## Where cortex's gateway-0 spends its time (py-spy)" in text
    assert "1,234 samples" in text
    assert "| `route (gateway/routing/router)` | 12.5 | 40.0 |" in text


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    routing.register(parser.add_subparsers())
    return parser.parse_args(["routing", "--real-engines", *argv])


def test_the_model_is_picked_from_the_installs_models() -> None:
    assert (_parse().real_model, _parse().kv_blocks) == ("model-qwen-slow", KV_BLOCKS)
    assert _parse("--real-model", "model-qwen").real_model == "model-qwen"
    assert set(REAL_MODELS) <= set(MODELS)
    with pytest.raises(SystemExit):
        _parse("--real-model", "model-qwen-vl")


def _config(tmp_path: Path, name: str, **body: int | dict[str, int]) -> None:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(body))


def test_kv_caches_are_sized_in_blocks_of_the_model_served(tmp_path: Path) -> None:
    install = VllmInstall(tmp_path)
    # make_models.py's bodies: 2 layers x 2 KV heads x 32, 6 layers x 4 KV heads x 64
    _config(tmp_path, "model-qwen", num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
            hidden_size=128, num_attention_heads=4)
    _config(tmp_path, "model-qwen-slow", num_hidden_layers=6, num_key_value_heads=4,
            head_dim=64, hidden_size=512, num_attention_heads=8)
    assert install.kv_bytes_per_token("model-qwen") == 512  # bf16 K and V, every layer
    assert install.kv_bytes_per_token("model-qwen-slow") == 6144
    # the tiny model's 512 blocks are the size the benchmark always gave it
    assert KV_BLOCKS * BLOCK_SIZE * install.kv_bytes_per_token() == KV_CACHE_BYTES // 2
    # no head_dim: hidden / heads; a multimodal config's text part
    _config(tmp_path, "vl", text_config={"num_hidden_layers": 2, "num_key_value_heads": 2,
                                         "hidden_size": 128, "num_attention_heads": 4})
    assert install.kv_bytes_per_token("vl") == 512


def test_pinned_engines_each_run_on_a_core_of_their_own(tmp_path: Path) -> None:
    install = VllmInstall(tmp_path)
    _config(tmp_path, "model-qwen", num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
            hidden_size=128, num_attention_heads=4)
    cores = sorted(os.sched_getaffinity(0))
    pinned = bench_engines(install, tmp_path, "model-qwen", KV_BLOCKS, pin=True)
    assert [e.cpus for e in pinned] == [frozenset({cores[i % len(cores)]}) for i in range(2)]
    assert all(not e.cpus for e in bench_engines(install, tmp_path, "model-qwen", KV_BLOCKS))
    # the engine's start-up hook puts the process it starts (and so its children) there
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        preexec_fn=pinned[1]._setup_child(), capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str([cores[1 % len(cores)]])


def test_the_fastokens_choice_is_read_whatever_the_label_order() -> None:
    chosen = ('# TYPE cortex_gateway_tokenize_encoder gauge\n'
              'cortex_gateway_tokenize_encoder{encoder="hf",model="m"} 0.0\n'
              'cortex_gateway_tokenize_encoder{encoder="fastokens",model="m"} 1.0\n')
    assert fastokens_chosen(chosen)
    assert fastokens_chosen('cortex_gateway_tokenize_encoder{model="m",encoder="fastokens"} 1.0')
    assert not fastokens_chosen(chosen.replace("} 1.0", "} 0.0"))  # the probe still running
    assert not fastokens_chosen(chosen.replace("} 0.0", "} 1.0").replace('"fastokens"', '"x"'))


def test_engines_compute_in_bf16_only_where_the_cpu_does() -> None:
    def cpu(flags: str) -> str:
        return f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\n"

    assert native_dtype(cpu("avx512f avx512_bf16")) == "bfloat16"
    assert native_dtype(cpu("amx_bf16 amx_tile")) == "bfloat16"
    assert native_dtype(cpu("avx512f avx512bw")) == "float32"  # AVX-512 without BF16
    assert native_dtype(cpu("")) == "float32"  # AVX2 only: vLLM would emulate bf16


def test_float32_kv_takes_twice_the_bytes(tmp_path: Path) -> None:
    _config(tmp_path, "model-qwen", num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
            hidden_size=128, num_attention_heads=4)
    install = VllmInstall(tmp_path)
    assert install.kv_bytes_per_token("model-qwen", "float32") == 1024
    assert install.kv_bytes_per_token("model-qwen", "bfloat16") == 512


def test_an_engine_started_in_a_relative_directory_finds_its_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the benchmark's --out is relative to where it was run
    engine = VllmEngine(VllmInstall(tmp_path), Path("out/logs"))
    script = Path(engine.argv()[1])
    assert script.is_absolute() and script == tmp_path / "out/logs/vllm_engine_main.py"


def test_an_engine_with_few_kv_blocks_gets_a_context_its_cache_holds() -> None:
    assert engine_max_len(512) == MAX_MODEL_LEN
    # vLLM refused 256 blocks (4,096 tokens) at a 4,096-token context: it keeps one spare
    assert engine_max_len(256) == 255 * BLOCK_SIZE
    fewest = LONGEST_PROMPT // BLOCK_SIZE + 1
    assert engine_max_len(fewest) >= LONGEST_PROMPT
    with pytest.raises(SystemExit, match=f"use at least {fewest}"):
        engine_max_len(fewest - 1)
