"""The committed protobuf / grpclib code is what tools/gen_proto.py generates; drift is
caught."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gen_proto.py"

pytestmark = pytest.mark.timeout(60)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # .venv/bin deliberately off PATH: the script must find protoc's plugin by itself.
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
        check=False,
    )


def test_committed_code_is_fresh() -> None:
    done = _run("--check")
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout


def test_check_reports_drift_and_regeneration_repairs_it(tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    shutil.copytree(REPO / "proto" / "gen", gen, ignore=shutil.ignore_patterns("__pycache__"))
    module = gen / "cortex" / "api" / "index" / "v1" / "index_grpc.py"
    module.write_text(module.read_text().replace("class IndexStub", "class IndexStubOld"))
    (gen / "cortex" / "api" / "index" / "__init__.py").unlink()
    extra = gen / "cortex" / "api" / "gone" / "v9" / "__init__.py"
    extra.parent.mkdir(parents=True)
    extra.write_text("# a package whose .proto was deleted\n")

    done = _run("--check", "--gen-root", str(gen))
    assert done.returncode == 1
    report = done.stderr
    assert "changed  cortex/api/index/v1/index_grpc.py" in report
    assert "missing  cortex/api/index/__init__.py" in report
    assert "extra    cortex/api/gone/v9/__init__.py" in report
    assert "+class IndexStub:" in report
    assert "make proto" in report

    done = _run("--gen-root", str(gen))
    assert done.returncode == 0, done.stderr
    assert not (gen / "cortex" / "api" / "gone").exists()
    assert _run("--check", "--gen-root", str(gen)).returncode == 0
    for rel in ("__init__.py", "index/__init__.py", "index/v1/index_grpc.py"):
        committed = REPO / "proto" / "gen" / "cortex" / "api" / rel
        assert (gen / "cortex" / "api" / rel).read_text() == committed.read_text()
    assert not (gen / "cortex" / "__init__.py").exists()  # cortex stays a namespace


def test_toolchain_failure_is_exit_2(tmp_path: Path) -> None:
    protos = tmp_path / "proto" / "cortex" / "broken" / "v1"
    protos.mkdir(parents=True)
    (protos / "broken.proto").write_text('syntax = "proto3";\nmessage {\n')
    done = _run("--check", "--proto-root", str(tmp_path / "proto"), "--gen-root", str(tmp_path))
    assert done.returncode == 2
    assert "protoc failed" in done.stderr
