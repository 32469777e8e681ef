"""``cortex workers`` and ``cortex ingest`` command lines (real Redis for the registry)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from cortex.edge.main import main
from cortex.ingest.cli import build_config, register
from cortex.ingest.errors import ConfigError
from cortex.ingest.shard import ShardSpec, shard_of
from cortex.sim.process import SimProcess
from cortex.testing import RedisServer, free_port

ADD = ["workers", "add", "--id", "w1", "--url", "http://10.0.0.5:30000", "--engine", "sglang",
       "--model", "qwen", "--kv-events", "tcp://10.0.0.5:5557", "--replay", "tcp://*:5558",
       "--role", "prefill", "--bootstrap-port", "8998", "--dp-size", "2", "--block-size", "16",
       "--label", "zone=b", "--topic", "kv", "--no-discover"]


def listed(redis: RedisServer, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    capsys.readouterr()
    assert main(["workers", "list", "--redis", redis.url, "--json"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def test_add_list_rm(redis_server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ADD, "--redis", redis_server.url, "--ttl", "30"]) == 0
    assert "registered w1 (lease 30s)" in capsys.readouterr().out
    data = listed(redis_server, capsys)
    workers = data["workers"]
    assert isinstance(workers, list) and len(workers) == 1
    worker: dict[str, Any] = workers[0]
    assert worker["id"] == "w1" and worker["engine"] == "sglang" and worker["dp_size"] == 2
    assert worker["labels"] == {"zone": "b"} and worker["bootstrap_port"] == 8998
    assert 0 < worker["ttl_s"] <= 30
    assert main(["workers", "list", "--redis", redis_server.url]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["ID", "ENGINE", "ROLE"]
    assert "w1" in table and "tcp://10.0.0.5:5557" in table
    assert main(["workers", "rm", "w1", "--redis", redis_server.url]) == 0
    assert main(["workers", "rm", "w1", "--redis", redis_server.url]) == 1
    assert "no worker 'w1'" in capsys.readouterr().err
    assert listed(redis_server, capsys)["workers"] == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--engine", "tgi"], "unknown engine 'tgi'"),
        (["--url", "10.0.0.5:30000"], "url:"),
        (["--kv-events", "tcp://h:70000"], "port 70000"),
        (["--replay", "tcp://h"], "replay: bad endpoint"),
        (["--bootstrap-port", "0"], "bootstrap_port"),
        (["--role", "boss"], "role:"),
        (["--label", "novalue"], "KEY=VALUE"),
        (["--ttl", "-1"], "--ttl"),
    ],
)
def test_invalid_specs_write_nothing(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], change: list[str],
    message: str,
) -> None:
    argv = [*ADD, "--redis", redis_server.url]
    flag = change[0]
    if flag in argv:
        argv[argv.index(flag) + 1] = change[1]
    else:
        argv += change
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert listed(redis_server, capsys)["workers"] == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_add_by_url_learns_the_spec_from_the_engine(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], engine: str,
) -> None:
    with SimProcess("--engine", engine, "--port", "0", "--kv-events-port", "0",
                    "--replay-port", "0", "--dp-size", "2", "--block-size", "32",
                    "--model", "org/m", "--max-model-len", "8192", "--topic", "kv",
                    "--zero-cost") as sim:
        assert main(["workers", "add", "--redis", redis_server.url, "--url", sim.url,
                     "--label", "zone=a", "--ttl", "0"]) == 0
        err = capsys.readouterr().err
        assert "discovered: block_size = 32" in err
        worker = listed(redis_server, capsys)["workers"][0]  # type: ignore[index]
        port = sim.url.rsplit(":", 1)[1]
        assert worker == {
            "v": 1, "id": f"127.0.0.1-{port}", "url": sim.url, "engine": engine,
            "role": "regular", "model": "org/m", "dp_size": 2, "block_size": 32,
            "context_length": 8192, "topic": "kv",
            "kv_events": f"tcp://127.0.0.1:{sim.info['kv_events_port']}",
            "replay": f"tcp://127.0.0.1:{sim.info['replay_port']}",
            "bootstrap_port": None, "ttl_s": None,
            # vLLM says how it hashes blocks (prefix_caching_hash_algo): ingest checks with it
            "labels": {"zone": "a", **({"hash_algo": "sha256"} if engine == "vllm" else {})},
        }
        # explicit flags win over what the engine says
        assert main(["workers", "add", "--redis", redis_server.url, "--url", sim.url,
                     "--id", "w2", "--model", "alias", "--block-size", "64"]) == 0
        by_id = {w["id"]: w for w in listed(redis_server, capsys)["workers"]}  # type: ignore[attr-defined]
        assert (by_id["w2"]["model"], by_id["w2"]["block_size"]) == ("alias", 64)
        assert by_id["w2"]["dp_size"] == 2


@pytest.mark.timeout(30)
def test_add_by_url_of_an_unreachable_worker_names_what_is_missing(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["workers", "add", "--redis", redis_server.url, "--url", url,
                 "--discovery-timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert f"could not learn engine, model from {url}" in err
    assert "cannot connect" in err and "(--engine, --model)" in err
    assert listed(redis_server, capsys)["workers"] == []
    # supplied explicitly, the worker registers without its engine's help (it may start later)
    assert main(["workers", "add", "--redis", redis_server.url, "--url", url, "--engine",
                 "vllm", "--model", "m", "--discovery-timeout", "2"]) == 0
    assert "not learned: engine, model, role, dp_size, kv_events" in capsys.readouterr().err
    worker = listed(redis_server, capsys)["workers"][0]  # type: ignore[index]
    assert (worker["engine"], worker["kv_events"], worker["block_size"]) == ("vllm", None, None)


def test_unreachable_redis_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main([*ADD, "--redis", url, "--timeout", "0.3"]) == 1
    assert "registry unavailable" in capsys.readouterr().err
    assert main(["workers", "list", "--redis", url, "--timeout", "0.3"]) == 1


def test_redis_url_is_required(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("CORTEX_REDIS_URL", raising=False)
    assert main(["workers", "list"]) == 2
    assert "--redis" in capsys.readouterr().err


def parse_run(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["ingest", "run", *argv])


def test_ingest_run_config_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORTEX_INGEST_INDEX", "10.0.0.1:50051, 10.0.0.2:50051")
    config = build_config(parse_run(["--redis", "redis://r:6379/0", "--shard", "1/3",
                                     "--metrics-port", "-1", "--hash-algo", "sha256_cbor"]))
    assert [str(t) for t in config.index] == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert config.shard == ShardSpec(1, 3) and config.metrics_port is None
    assert config.ingest_id.startswith("ingest-1of3@")
    assert config.hash_algo == "sha256_cbor"


def test_ingest_run_generated_flags_and_old_spellings_agree() -> None:
    old = build_config(parse_run(["--redis", "redis://r", "--index", "i:1", "--index", "j:2",
                                  "--max-pending", "7", "--queue-max", "9", "--heartbeat",
                                  "0.5", "--no-channel", "--max-pending-bytes", "2MiB"]), {})
    new = build_config(parse_run(["--redis-url", "redis://r", "--index", "i:1,j:2",
                                  "--max-pending-batches", "7", "--forwarder-queue-max-updates",
                                  "9", "--forwarder-heartbeat-s", "0.5", "--no-use-channel",
                                  "--max-pending-bytes", "2097152", "--ingest-id",
                                  old.ingest_id]), {})
    assert old == new
    assert new.max_pending_batches == 7 and new.forwarder.queue_max_updates == 9
    assert new.forwarder.heartbeat_s == 0.5 and not new.use_channel
    assert new.max_pending_bytes == 2 << 20


def test_ingest_run_old_variables_still_work_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {"CORTEX_REDIS_URL": "redis://old", "CORTEX_INDEX": "i:1",
           "CORTEX_INGEST_FORWARDER_QUEUE_MAX_UPDATES": "5"}
    with caplog.at_level("WARNING", logger="cortex.edge.settings"):
        config = build_config(parse_run([]), env)
    assert config.redis_url == "redis://old" and [str(t) for t in config.index] == ["i:1"]
    assert config.forwarder.queue_max_updates == 5
    assert "CORTEX_INDEX is deprecated: set CORTEX_INGEST_INDEX instead" in caplog.text
    assert "CORTEX_REDIS_URL is deprecated: set CORTEX_INGEST_REDIS_URL instead" in caplog.text
    new = build_config(parse_run([]), {**env, "CORTEX_INGEST_REDIS_URL": "redis://new"})
    assert new.redis_url == "redis://new"  # the new name wins over its alias


def test_ingest_run_reads_its_token_file_at_start(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.token"
    argv = ["ingest", "run", "--redis", "redis://127.0.0.1:1", "--index", "i:1",
            "--index-token-file", str(missing), "--metrics-port", "-1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cortex ingest: invalid configuration:" in err and str(missing) in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--index", "i:1"], "--redis"),
        (["--redis", "redis://r"], "--index"),
        (["--redis", "redis://r", "--index", "nohost"], "HOST:PORT"),
        (["--redis", "redis://r", "--index", "i:1", "--shard", "2/2"], "shard"),
        (["--redis", "redis://r", "--index", "i:1", "--poll-interval", "5"], "<= 1 s"),
        (["--redis", "redis://r", "--index", "i:1", "--hash-algo", "md5"], "hash_algo"),
        (["--redis", "redis://r", "--index", "i:1", "--index", "i:1"], "distinct"),
        (["--redis", "http://r", "--index", "i:1"], "redis_url"),
    ],
)
def test_ingest_run_rejects_bad_settings(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("CORTEX_INDEX", "CORTEX_REDIS_URL", "CORTEX_INGEST_INDEX",
                 "CORTEX_INGEST_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=message):
        build_config(parse_run(argv))
    assert main(["ingest", "run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_shard_of(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ingest", "shard-of", "--shards", "2", "gpu-0", "gpu-2"]) == 0
    assert capsys.readouterr().out.split() == ["gpu-0", "1/2", "gpu-2", "0/2"]
    assert shard_of("gpu-2", 2) == 0
    assert all(ShardSpec(0, 1).owns(w) for w in ("a", "b"))


def test_ingest_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    """A tiny ``cortex bench ingest``: the tool works (no timing is asserted)."""
    argv = ["bench", "ingest", "--workers", "2", "--events", "3000", "--burst-events", "3000",
            "--rates", "50000,0", "--restarts", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = (tmp_path / "ingest.md").read_text()
    assert "| sustained block events/s into one ingest" in report
    assert "| NO |" not in report and "| yes |" in report


def test_rm_writes_a_tombstone_that_add_lifts(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str],
) -> None:
    url = ["--redis", redis_server.url]
    assert main([*ADD, *url, "--ttl", "30"]) == 0
    assert main(["workers", "rm", "w1", *url, "--for", "600", "--reason", "drained"]) == 0
    assert "a tombstone keeps it out" in capsys.readouterr().out
    stones = listed(redis_server, capsys)["tombstones"]
    assert isinstance(stones, list) and len(stones) == 1
    assert stones[0]["id"] == "w1" and stones[0]["reason"] == "drained"
    assert 0 < stones[0]["ttl_s"] <= 600
    assert main(["workers", "list", *url]) == 0
    assert "removed: w1 (drained; for" in capsys.readouterr().out
    assert main(["workers", "rm", "w1", *url, "--for", "0"]) == 2
    assert main([*ADD, *url]) == 0  # an explicit add lifts it
    assert listed(redis_server, capsys)["tombstones"] == []
    assert main(["workers", "rm", "w1", *url, "--no-tombstone"]) == 0
    assert listed(redis_server, capsys) == {"workers": [], "invalid": {}, "tombstones": []}
