"""Credentials both ways: client API keys at the gateway, worker API keys sent upstream.

Real sims started with an API key (as ``vllm --api-key``), a real gateway, real HTTP.
"""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from cortex.gateway.config.gateway import GatewayConfig, load_config
from cortex.gateway.config.middleware import AuthConfig
from cortex.gateway.errors import ConfigError
from cortex.gateway.http.auth import (
    ApiKeys,
    KeyDigest,
    WorkerCredentials,
    hash_key,
    parse_key_lines,
)
from cortex.registry import SpecError, WorkerSpec

from ..conftest import MODEL, TOKEN, StartGateway, StartSim, spec_of

CLIENT_KEY = "sk-client-0123456789abcdef"
OTHER_KEY = "sk-other-fedcba9876543210"
WORKER_KEY = "worker-secret-5f2c9a1e7b"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def chat(text: str) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


# ---- pure parts ----


def test_a_key_is_accepted_by_its_digest_and_named_by_its_id() -> None:
    keys = ApiKeys([KeyDigest("team-a", hash_key(CLIENT_KEY)),
                    KeyDigest("team-b", hash_key(OTHER_KEY))])
    assert keys.check(f"Bearer {CLIENT_KEY}") == "team-a"
    assert keys.check(f"bearer  {OTHER_KEY} ") == "team-b"
    for bad in (None, "", "Bearer", f"Basic {CLIENT_KEY}", f"Bearer {CLIENT_KEY}x",
                "Bearer sha256:" + hash_key(CLIENT_KEY)[7:]):
        assert keys.check(bad) is None, bad
    assert not ApiKeys([]).enabled


def test_key_digests_and_key_files_are_validated() -> None:
    with pytest.raises(ConfigError, match="sha256"):
        KeyDigest("team-a", CLIENT_KEY)  # the key itself, not its digest
    with pytest.raises(ConfigError, match="key id"):
        KeyDigest("bad id", hash_key(CLIENT_KEY))
    text = (f"# keys\nteam-a {hash_key(CLIENT_KEY)}  # rotated 2026-11\n\n"
            f"team-b {hash_key(OTHER_KEY)}\n")
    assert [k.id for k in parse_key_lines(text, "keys")] == ["team-a", "team-b"]
    with pytest.raises(ConfigError, match="keys:2"):
        parse_key_lines(f"team-a {hash_key(CLIENT_KEY)}\nteam-b\n", "keys")
    with pytest.raises(ConfigError, match="duplicate"):
        ApiKeys(parse_key_lines(f"a {hash_key('x')}\na {hash_key('y')}\n", "keys"))


def test_keys_come_from_the_file_the_table_and_the_environment(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"team-b {hash_key(OTHER_KEY)}\n")
    config = load_config(None, {
        "CORTEX_GATEWAY_MODELS": '[{"name": "m"}]',
        "CORTEX_GATEWAY_AUTH_KEYS": f"team-a={hash_key(CLIENT_KEY)}",
        "CORTEX_GATEWAY_AUTH_KEYS_FILE": str(keys_file),
    })
    keys = config.auth.load()
    assert len(keys) == 2
    assert keys.check(f"Bearer {OTHER_KEY}") == "team-b"
    assert CLIENT_KEY not in repr(config) and OTHER_KEY not in repr(config)
    with pytest.raises(ConfigError, match=r"auth\.keys_file"):
        GatewayConfig.from_mapping({"models": [{"name": "m"}],
                                    "auth": {"keys_file": str(tmp_path / "missing")}})


def test_a_worker_spec_references_its_credential_and_never_holds_it(tmp_path: Path) -> None:
    base = {"id": "w", "url": "http://127.0.0.1:1", "engine": "vllm", "model": "m"}
    spec = WorkerSpec.from_dict({**base, "credential": "env:VLLM_API_KEY"})
    assert spec.to_dict()["credential"] == "env:VLLM_API_KEY"
    assert "credential" not in WorkerSpec.from_dict(base).to_dict()  # older readers unchanged
    for bad in (WORKER_KEY, "env:", "env:1X", "file:relative/path", "vault:x"):
        with pytest.raises(SpecError, match="credential"):
            WorkerSpec.from_dict({**base, "credential": bad})
    with pytest.raises(SpecError, match="credentials"):
        WorkerSpec.from_dict({**base, "url": f"http://user:{WORKER_KEY}@127.0.0.1:1"})
    secret = tmp_path / "key"
    secret.write_text(WORKER_KEY + "\n")
    now = [0.0]
    creds = WorkerCredentials({"VLLM_API_KEY": "from-env"}, reread_s=10.0, clock=lambda: now[0])
    assert creds.headers(spec) == {"Authorization": "Bearer from-env"}
    by_file = spec.with_changes(credential=f"file:{secret}")
    assert creds.headers(by_file) == {"Authorization": f"Bearer {WORKER_KEY}"}
    secret.write_text("rotated")
    assert creds.headers(by_file) == {"Authorization": f"Bearer {WORKER_KEY}"}  # cached
    now[0] = 11.0
    assert creds.headers(by_file) == {"Authorization": "Bearer rotated"}
    assert creds.headers(spec.with_changes(credential="env:UNSET")) == {}


# ---- end to end ----


async def test_inference_needs_a_key_and_workers_get_theirs(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    env_sim = await start_sim(api_key=WORKER_KEY)
    file_sim = await start_sim(api_key=WORKER_KEY)
    secret = tmp_path / "worker-key"
    secret.write_text(WORKER_KEY)
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"team-b {hash_key(OTHER_KEY)}\n")
    gw = await start_gateway(
        [spec_of(env_sim, "w-env", credential="env:SIM_KEY"),
         spec_of(file_sim, "w-file", credential=f"file:{secret}")],
        environ={"SIM_KEY": WORKER_KEY},
        auth=AuthConfig(keys=(KeyDigest("team-a", hash_key(CLIENT_KEY)),), keys_file=keys_file))
    url = gw.url + "/v1/chat/completions"

    for headers, message in (({}, "missing API key"),
                             ({"Authorization": "Bearer sk-wrong"}, "invalid API key"),
                             ({"Authorization": f"Basic {CLIENT_KEY}"}, "invalid API key")):
        async with http.post(url, json=chat("hi"), headers=headers) as resp:
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            error = (await resp.json())["error"]
            assert error["type"] == "authentication_error" and error["code"] == "unauthorized"
            assert message in error["message"]
    async with http.get(gw.url + "/v1/models") as resp:
        assert resp.status == 401

    served = set()
    for i, key in enumerate((CLIENT_KEY, OTHER_KEY) * 3):
        async with http.post(url, json=chat(f"question {i}"),
                             headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200, await resp.text()
            served.add(resp.headers["x-cortex-assigned-worker"])
    assert served <= {"w-env", "w-file"}

    for path in ("/health", "/health/live", "/health/ready", "/metrics"):
        async with http.get(gw.url + path) as resp:
            assert resp.status == 200, path
    async with http.get(gw.url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'cortex_gateway_key_requests_total{key="team-a"} 3.0' in metrics
    assert 'cortex_gateway_key_requests_total{key="team-b"} 3.0' in metrics
    assert 'cortex_gateway_auth_failures_total{reason="missing"} 2.0' in metrics
    assert 'cortex_gateway_load_polls_total{result="ok"}' in metrics  # /v1/loads needs the key
    async with http.get(gw.url + "/admin/workers", headers=ADMIN) as resp:
        workers = {w["id"]: w for w in (await resp.json())["workers"]}
        listing = await resp.text()
    assert workers["w-env"]["spec"]["credential"] == "env:SIM_KEY"
    assert workers["w-env"]["engine_running"] is not None  # its load polls got through
    assert {w["health"] for w in workers.values()} == {"healthy"}

    everything = listing + metrics + "\n".join(
        f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    for secret_text in (WORKER_KEY, CLIENT_KEY, OTHER_KEY):
        assert secret_text not in everything
    access = [r for r in caplog.records if r.name == "cortex.gateway.access"]
    assert {getattr(r, "key_id", None) for r in access} >= {"team-a", "team-b", None}


async def test_a_worker_whose_credential_does_not_resolve_refuses_and_is_not_used(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    locked = await start_sim(api_key=WORKER_KEY)
    gw = await start_gateway([spec_of(locked, "w-locked", credential="env:NOT_SET")])
    async with http.post(gw.url + "/v1/chat/completions", json=chat("hi")) as resp:
        # the engine's 401 is the request refused: relayed as an error, never a 200
        assert resp.status == 401
        assert WORKER_KEY not in await resp.text()
