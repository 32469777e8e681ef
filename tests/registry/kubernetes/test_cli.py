"""``cortex discover-pods``: settings from flags, the environment and the service account."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex.edge.main import build_parser, main
from cortex.registry.kubernetes import cli


def parse(*argv: str) -> object:
    return build_parser(["discover-pods", *argv]).parse_args(["discover-pods", *argv])


def test_in_a_pod_everything_comes_from_the_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, text in (("namespace", "llm\n"), ("token", "t"), ("ca.crt", "pem")):
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(cli, "SERVICE_ACCOUNT", tmp_path)
    config = cli.build_config(parse("--redis", "redis://r:6379/0"),  # type: ignore[arg-type]
                              {"KUBERNETES_SERVICE_HOST": "fd00::1",
                               "KUBERNETES_SERVICE_PORT": "6443"})
    assert config.api_url == "https://[fd00::1]:6443" and config.namespace == "llm"
    assert config.token_file == str(tmp_path / "token")
    assert config.ca_file == str(tmp_path / "ca.crt")
    assert config.discovered_by == "kubernetes:llm:cortex/engine"


def test_outside_a_pod_the_api_and_namespace_must_be_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cli, "SERVICE_ACCOUNT", tmp_path / "absent")
    for key in ("KUBERNETES_SERVICE_HOST", "CORTEX_REDIS_URL", "CORTEX_DISCOVERY_REDIS_URL",
                "CORTEX_DISCOVERY_NAMESPACE"):
        monkeypatch.delenv(key, raising=False)
    assert main(["discover-pods"]) == 2
    assert "--redis URL is required" in capsys.readouterr().err
    assert main(["discover-pods", "--redis", "redis://r"]) == 2
    assert "--api-url is required outside a pod" in capsys.readouterr().err
    assert main(["discover-pods", "--redis", "redis://r", "--api-url", "http://127.0.0.1:1"]) == 2
    assert "--namespace is required outside a pod" in capsys.readouterr().err
    assert main(["discover-pods", "--redis", "redis://r", "--api-url", "ftp://x",
                 "--namespace", "llm"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err
    assert main(["discover-pods", "--redis", "redis://r", "--api-url", "http://127.0.0.1:1",
                 "--namespace", "llm", "--lease-ttl", "0"]) == 2
    assert "lease_ttl_s: must be > 0" in capsys.readouterr().err
