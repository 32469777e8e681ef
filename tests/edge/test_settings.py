"""cortex.edge.settings: one loader generated from a frozen config dataclass."""

from __future__ import annotations

import argparse
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cortex.edge.settings import SettingsError, SettingsSpec

pytestmark = pytest.mark.timeout(10)


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclass(frozen=True, slots=True)
class Shard:
    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, sep, count = text.partition("/")
        if not sep or not index.isdigit() or not count.isdigit():
            raise ValueError(f"shard {text!r} must be i/K")
        return cls(int(index), int(count))


@dataclass(frozen=True, slots=True)
class Queue:
    max_updates: int = 100
    """Updates queued per replica."""
    max_bytes: int = 1 << 20
    heartbeat_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Config:
    redis_url: str | None = None
    """Registry Redis URL."""
    port: int = 50051
    metrics_port: int | None = 9465
    use_channel: bool = True
    data_dir: Path = Path("/var/lib/x")
    mode: Mode = Mode.SAFE
    peers: tuple[str, ...] = ()
    shard: Shard = field(default_factory=Shard)
    queue: Queue = field(default_factory=Queue)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")


SPEC = SettingsSpec(Config, "demo", aliases={"DEMO_REDIS": "redis_url"},
                    flag_names={"redis_url": ("--redis",), "queue.max_updates": ("--queue-max",)})


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    SPEC.add_arguments(parser)
    return parser.parse_args(argv)


def test_names_are_generated_from_the_paths() -> None:
    setting = SPEC.settings["queue.max_updates"]
    assert setting.env == "CORTEX_DEMO_QUEUE_MAX_UPDATES"
    assert setting.flag == "--queue-max-updates"
    assert setting.help == "Updates queued per replica."
    assert SPEC.settings["redis_url"].help == "Registry Redis URL."
    assert SPEC.load() == Config()


def test_later_sources_win_file_then_env_then_flag(tmp_path: Path) -> None:
    file = tmp_path / "demo.toml"
    file.write_text('port = 1\nmetrics_port = 2\npeers = ["a:1", "b:2"]\n'
                    '[queue]\nmax_updates = 7\nheartbeat_s = 0.5\n')
    env = {"CORTEX_DEMO_CONFIG": str(file), "CORTEX_DEMO_PORT": "10",
           "CORTEX_DEMO_QUEUE_MAX_UPDATES": "70"}
    config = SPEC.load(parse("--port", "100"), env)
    assert config.port == 100  # flag over env over file
    assert config.queue.max_updates == 70  # env over file
    assert config.metrics_port == 2 and config.queue.heartbeat_s == 0.5  # the file's
    assert config.peers == ("a:1", "b:2")
    json_file = tmp_path / "demo.json"
    json_file.write_text(json.dumps({"queue": {"max_bytes": "2MiB"}}))
    assert SPEC.load(parse("--config", str(json_file)), env).queue.max_bytes == 2 << 20


def test_extra_option_strings_and_repeatable_lists() -> None:
    config = SPEC.load(parse("--redis", "redis://r", "--queue-max", "3", "--peers", "a:1",
                             "--peers", "b:2,c:3", "--no-use-channel"), {})
    assert config.redis_url == "redis://r" and config.queue.max_updates == 3
    assert config.peers == ("a:1", "b:2", "c:3") and config.use_channel is False


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("1", True), ("yes", True), ("ON", True),
    ("false", False), ("0", False), ("no", False), ("off", False),
])
def test_bools(text: str, value: bool) -> None:
    assert SPEC.load(None, {"CORTEX_DEMO_USE_CHANNEL": text}).use_channel is value


def test_conversions_of_text() -> None:
    config = SPEC.load(None, {"CORTEX_DEMO_MODE": "fast", "CORTEX_DEMO_DATA_DIR": "/d",
                              "CORTEX_DEMO_SHARD": "1/3", "CORTEX_DEMO_PEERS": "a:1, b:2",
                              "CORTEX_DEMO_QUEUE_HEARTBEAT_S": "0.25",
                              "CORTEX_DEMO_QUEUE_MAX_BYTES": "64KiB"})
    assert config.mode is Mode.FAST and config.data_dir == Path("/d")
    assert config.shard == Shard(1, 3) and config.peers == ("a:1", "b:2")
    assert config.queue.heartbeat_s == 0.25 and config.queue.max_bytes == 64 << 10


@pytest.mark.parametrize(("text", "size"), [
    ("65536", 65536), ("64KiB", 64 << 10), ("32MiB", 32 << 20), ("1GiB", 1 << 30),
    ("8M", 8 << 20), ("2KB", 2 << 10),
])
def test_sizes(text: str, size: int) -> None:
    assert SPEC.load(parse("--queue-max-bytes", text), {}).queue.max_bytes == size


@pytest.mark.parametrize("text", ["off", "none", "OFF", "-1"])
def test_none_is_spelled_off_and_minus_one_for_ints(text: str) -> None:
    assert SPEC.load(parse("--metrics-port", text), {}).metrics_port is None
    assert SPEC.load(None, {"CORTEX_DEMO_METRICS_PORT": text}).metrics_port is None


def test_an_empty_variable_is_unset_except_for_text() -> None:
    assert SPEC.load(None, {"CORTEX_DEMO_PORT": ""}).port == 50051
    assert SPEC.load(None, {"CORTEX_DEMO_REDIS_URL": ""}).redis_url is None

    @dataclass(frozen=True)
    class Text:
        name: str = "x"

    assert SettingsSpec(Text, "text").load(None, {"CORTEX_TEXT_NAME": ""}).name == ""


@pytest.mark.parametrize(("argv", "env", "fragment"), [
    ((), {"CORTEX_DEMO_PORT": "x"}, "CORTEX_DEMO_PORT: must be an integer, got 'x'"),
    (("--port", "x"), {}, "--port: must be an integer"),
    ((), {"CORTEX_DEMO_USE_CHANNEL": "maybe"}, "CORTEX_DEMO_USE_CHANNEL: must be true or false"),
    ((), {"CORTEX_DEMO_MODE": "slow"}, "CORTEX_DEMO_MODE: must be one of fast, safe"),
    ((), {"CORTEX_DEMO_SHARD": "2"}, "CORTEX_DEMO_SHARD: shard '2' must be i/K"),
    (("--queue-max-bytes", "lots"), {}, "--queue-max-bytes: 'lots' is not a size"),
    ((), {"CORTEX_DEMO_NOPE": "1"}, "CORTEX_DEMO_NOPE: unknown setting"),
    ((), {"CORTEX_DEMO_PORT": "70000"}, "config: port must be in 0..65535"),
])
def test_errors_name_the_key_and_its_source(argv: tuple[str, ...], env: dict[str, str],
                                             fragment: str) -> None:
    with pytest.raises(SettingsError) as caught:
        SPEC.load(parse(*argv), env)
    assert fragment in str(caught.value)


def test_unknown_file_keys_are_named_with_the_file(tmp_path: Path) -> None:
    file = tmp_path / "demo.toml"
    file.write_text("[queue]\nmax_update = 1\n")
    with pytest.raises(SettingsError, match=r"demo.toml: queue.max_update: unknown key"):
        SPEC.load(None, {}, file)
    file.write_text('port = "x"\n')
    with pytest.raises(SettingsError, match=r"demo.toml: port: must be an integer"):
        SPEC.load(None, {}, file)
    file.write_text("queue = 3\n")
    with pytest.raises(SettingsError, match=r"demo.toml: queue: must be a table"):
        SPEC.load(None, {}, file)
    with pytest.raises(SettingsError, match="cannot read config file"):
        SPEC.load(None, {}, tmp_path / "absent.toml")


@pytest.mark.parametrize(("var", "value"), [
    ("CORTEX_DEMO_SERVICE_HOST", "10.96.0.7"),
    ("CORTEX_DEMO_SERVICE_PORT", "80"),
    ("CORTEX_DEMO_SERVICE_PORT_GRPC", "50051"),
    ("CORTEX_DEMO_PORT_80_TCP_ADDR", "10.96.0.7"),
    ("CORTEX_DEMO_PORT", "tcp://10.96.0.7:80"),  # a real setting's name, a link's value
])
def test_kubernetes_service_links_get_an_error_naming_the_fix(var: str, value: str) -> None:
    with pytest.raises(SettingsError) as caught:
        SPEC.load(None, {var: value})
    message = str(caught.value)
    assert message.startswith(var + ":") and "service link" in message
    assert "cortex-demo" in message and "enableServiceLinks: false" in message


def test_a_deprecated_alias_works_and_warns_naming_the_new_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="cortex.edge.settings"):
        assert SPEC.load(None, {"DEMO_REDIS": "redis://old"}).redis_url == "redis://old"
    assert "DEMO_REDIS is deprecated: set CORTEX_DEMO_REDIS_URL instead" in caplog.text
    both = {"DEMO_REDIS": "redis://old", "CORTEX_DEMO_REDIS_URL": "redis://new"}
    assert SPEC.load(None, both).redis_url == "redis://new"


def test_other_variables_and_the_reserved_ones_pass() -> None:
    env = {"HOME": "/root", "CORTEX_OTHER_X": "1", "CORTEX_DEMO_LOG_LEVEL": "debug",
           "CORTEX_DEMO_LOG_FORMAT": "json"}
    assert SPEC.load(None, env) == Config()


@dataclass(frozen=True)
class Needs:
    url: str
    port: int = 1


@dataclass(frozen=True)
class Server:
    port: int = 1


@dataclass(frozen=True)
class Clash:
    server_port: int = 2
    server: Server = field(default_factory=Server)


def test_a_required_setting_names_its_variable_and_flag() -> None:
    with pytest.raises(SettingsError, match=r"CORTEX_NEEDS_URL: required \(--url"):
        SettingsSpec(Needs, "needs").load(None, {})
    assert SettingsSpec(Needs, "needs").load(None, {"CORTEX_NEEDS_URL": "u"}).url == "u"


def test_two_paths_that_map_to_one_name_are_refused() -> None:
    with pytest.raises(TypeError, match=r"server_port and server\.port both map to "
                                        r"CORTEX_CLASH_SERVER_PORT"):
        SettingsSpec(Clash, "clash")
    with pytest.raises(TypeError, match="alias CORTEX_DEMO_PORT"):
        SettingsSpec(Config, "demo", aliases={"CORTEX_DEMO_PORT": "metrics_port"})
