"""The official OpenAI Python SDK against a real gateway and sims, with an API key, as an
application would use it (default settings but the base URL and the key)."""

from __future__ import annotations

import openai
import pytest

from cortex.gateway.config.middleware import AuthConfig
from cortex.gateway.http.auth import KeyDigest, hash_key

from ..conftest import MODEL, StartGateway, StartSim, spec_of

KEY = "sk-sdk-test-0123456789abcdef"


async def test_the_openai_sdk_lists_retrieves_streams_and_embeds(
    start_sim: StartSim, start_gateway: StartGateway,
) -> None:
    sims = [await start_sim(max_model_len=65536), await start_sim(max_model_len=65536)]
    gw = await start_gateway([spec_of(s, f"w{i}") for i, s in enumerate(sims)],
                             auth=AuthConfig(keys=(KeyDigest("sdk", hash_key(KEY)),)))
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0,
                                  timeout=30) as client:
        models = [m async for m in client.models.list()]
        assert [m.id for m in models] == [MODEL]
        model = await client.models.retrieve(MODEL)
        assert model.id == MODEL and model.owned_by == "cortex"
        assert (model.model_extra or {})["max_model_len"] == 65536
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-9")

        stream = await client.chat.completions.create(
            model=MODEL, max_tokens=8, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": "You are brief. " * 30},
                      {"role": "user", "content": "Say something."}])
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert text and usage is not None and usage.completion_tokens > 0

        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert raw.headers["x-cortex-match-mode"] in ("exact_kv", "load_aware")
        assert raw.parse().choices[0].message.content

        embeddings = await client.embeddings.create(model=MODEL, input=["a", "b c"])
        assert [len(e.embedding) for e in embeddings.data] == [8, 8]

    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-wrong",
                                  max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as refused:
            await wrong.models.list()
        assert refused.value.code == "unauthorized"
