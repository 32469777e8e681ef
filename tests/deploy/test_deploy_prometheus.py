"""deploy/prometheus through Prometheus's own checker: the configuration and the rules parse,
and the rules' unit tests (alerts_test.yml: every alert firing and silent on synthetic
series) pass. ``promtool`` comes with Debian's ``prometheus`` package (.ci/run installs it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cortex.testing.prometheus import INSTALL_HINT, prometheus_binary

KIT = Path(__file__).resolve().parents[2] / "deploy/prometheus"
ALERTS: dict[str, Any] = yaml.safe_load((KIT / "alerts.yml").read_text())
UNIT_TESTS: dict[str, Any] = yaml.safe_load((KIT / "alerts_test.yml").read_text())


def promtool(*args: str) -> str:
    binary = prometheus_binary("promtool")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"promtool not found on PATH in CI: {INSTALL_HINT}")
        pytest.skip(f"promtool not found on PATH: {INSTALL_HINT}")
    done = subprocess.run([binary, *args], cwd=KIT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_configuration_and_its_rule_file_pass_promtool_check() -> None:
    out = promtool("check", "config", "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in out
    rules = sum(len(group["rules"]) for group in ALERTS["groups"])
    assert f"SUCCESS: {rules} rules found" in promtool("check", "rules", "alerts.yml")


def test_the_alert_unit_tests_pass() -> None:
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    """A case fires when it expects alerts, is silent when it expects none; every alert of
    alerts.yml has both (promtool checks that the expectation holds)."""
    assert UNIT_TESTS["rule_files"] == ["alerts.yml"]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in UNIT_TESTS["tests"]:
        for expectation in case.get("alert_rule_test", []):
            name = expectation["alertname"]
            (firing if expectation.get("exp_alerts") else silent).add(name)
    alerts = {rule["alert"] for group in ALERTS["groups"] for rule in group["rules"]}
    assert alerts - firing == set(), "alerts without a firing case"
    assert alerts - silent == set(), "alerts without a silent case"
    assert (firing | silent) <= alerts, "cases for alerts that do not exist"
