"""The prefill/decode config section, from a file and from the environment."""

from __future__ import annotations

from typing import Any

import pytest

from cortex.gateway.config.gateway import (
    GatewayConfig,
    PDConfig,
    load_config,
)
from cortex.gateway.errors import ConfigError


def test_pd_config_from_file_and_env(tmp_path: Any) -> None:
    file = tmp_path / "gw.toml"
    file.write_text('[[models]]\nname = "m"\n[pd]\nprefill_timeout_s = 20\n'
                    "local_prefill_max_tokens = 2048\n")
    config = load_config(file, {"CORTEX_GATEWAY_PD_LOCAL_PREFILL_MAX_RATIO": "0.7",
                                "CORTEX_GATEWAY_PD_FALLBACK_TO_REGULAR": "false"})
    assert config.pd == PDConfig(prefill_timeout_s=20, local_prefill_max_tokens=2048,
                                 local_prefill_max_ratio=0.7, fallback_to_regular=False)
    for bad, fragment in (({"prefill_timeout_s": 0}, "pd.prefill_timeout_s"),
                          ({"local_prefill_max_ratio": 2}, "pd.local_prefill_max_ratio"),
                          ({"max_attempt": 2}, "unknown key")):
        with pytest.raises(ConfigError, match=fragment):
            GatewayConfig.from_mapping({"models": [{"name": "m"}], "pd": bad})
