"""The gateway's encoder choice (tokenize.encoder): config, /admin/models, the metric."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from cortex.gateway.config.gateway import TokenizeConfig
from cortex.gateway.errors import ConfigError

from ..conftest import TOKEN, StartGateway


def test_the_setting_takes_auto_hf_or_fastokens() -> None:
    assert TokenizeConfig().encoder == "auto"
    assert TokenizeConfig(encoder="hf", pool="processes").pool == "processes"
    with pytest.raises(ConfigError, match="must be auto, hf or fastokens"):
        TokenizeConfig(encoder="rust")
    with pytest.raises(ConfigError, match=r"'threads' is now tokenize\.pool"):
        TokenizeConfig(encoder="threads")
    with pytest.raises(ConfigError, match=r"tokenize\.pool: must be threads or processes"):
        TokenizeConfig(pool="fibers")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["auto", "hf"])
async def test_admin_models_and_the_metric_say_which_encoder_and_why(
        setting: str, start_gateway: StartGateway, http: aiohttp.ClientSession) -> None:
    gw = await start_gateway(tokenize=TokenizeConfig(encoder=setting))
    expected = ("fastokens", "parity probe passed (auto)") if setting == "auto" else (
        "hf", "configured: hf")
    seen = []
    for _ in range(600):  # auto: hf at once, fastokens once the background probe passed
        async with http.get(gw.url + "/admin/models",
                            headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200
            (model,) = (await resp.json())["models"]
        seen.append((model["encoder"], model["encoder_reason"]))
        if seen[-1] == expected:
            break
        await asyncio.sleep(0.05)
    if setting == "auto":  # serving at once, before the probe (unless it was very quick)
        assert set(seen) <= {("hf", "auto: the fastokens probe is running"), expected}
    assert seen[-1] == expected
    assert model["segmented"] is True and model["chunk_chars"] > 0
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    assert f'cortex_gateway_tokenize_encoder{{encoder="{expected[0]}",model="cortex-sim"}} 1.0' \
        in text
    if setting == "auto":
        assert 'cortex_gateway_tokenize_encoder{encoder="hf",model="cortex-sim"} 0.0' in text
    async with http.post(gw.url + "/admin/models",
                         headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status == 405
