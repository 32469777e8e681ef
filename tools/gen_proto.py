"""Generate the protobuf and grpclib code of Cortex's gRPC contracts, or check it is up to date.

    python tools/gen_proto.py            # rewrite proto/gen/cortex/api/** (`make proto`)
    python tools/gen_proto.py --check    # exit 1 with a diff summary if stale (`make proto-check`)

Every ``proto/cortex/**/*.proto`` is compiled by ``grpc_tools.protoc`` into the official
protobuf messages (``*_pb2.py`` with ``*_pb2.pyi`` types; the upb runtime parses and
serializes them in C) and grpclib's service stubs (``*_grpc.py``, grpclib's own plugin, taken
from the directory of the running interpreter, so ``.venv/bin`` need not be on PATH). protoc
names its output after the .proto path (``cortex/index/v1/``); that is moved under
``cortex/api/`` because the proto package ``cortex.index`` would shadow the index service's
own ``cortex.index`` package, and the stubs' imports are rewritten to match. Every package
gets an ``__init__.py`` docstring (``cortex`` itself is a namespace package spread over
several source roots). The output is a function of the .proto files and the toolchain
versions (grpcio-tools, grpclib) and nothing else.

Exit codes: 0 done / up to date, 1 stale (``--check``), 2 the toolchain failed.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
GEN_ROOT = REPO / "proto" / "gen"
PLUGIN = "protoc-gen-grpclib_python"
API_DOC = (
    '"""Generated gRPC contracts (protobuf messages, grpclib stubs). Regenerate with'
    ' `make proto`."""\n'
)
TOOLCHAIN = ("grpcio-tools", "grpclib")
GENERATED = (".py", ".pyi")
DIFF_LINES = 40  # per file, in the --check summary

__all__ = ["GenerationError", "generate", "main", "stale_files"]


class GenerationError(RuntimeError):
    """protoc or the plugin is missing or failed; the message says which and why."""


def _protos(proto_root: Path) -> list[Path]:
    gen = proto_root / "gen"
    return sorted(p for p in (proto_root / "cortex").rglob("*.proto") if gen not in p.parents)


def _plugin() -> Path:
    plugin = Path(sys.executable).parent / PLUGIN
    if not plugin.exists():
        raise GenerationError(
            f"{plugin} not found: run this with the project's virtualenv python "
            "(grpclib installs it)"
        )
    return plugin


def _protoc(args: list[str]) -> None:
    """Run grpc_tools' protoc in a child process; its include dir of well-known types added."""
    if importlib.util.find_spec("grpc_tools") is None:
        raise GenerationError("grpc_tools is not installed: install the dev extra")
    done = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise GenerationError(f"protoc failed ({done.returncode}):\n{done.stderr.strip()}")


def generate(proto_root: Path = PROTO_ROOT) -> dict[str, str]:
    """The generated tree: path relative to the gen root -> file text."""
    protos = _protos(proto_root)
    if not protos:
        raise GenerationError(f"no .proto files under {proto_root / 'cortex'}")
    with tempfile.TemporaryDirectory(prefix="cortex-proto-") as tmp:
        out = Path(tmp)
        _protoc(
            [
                f"-I{proto_root}",
                f"--plugin={PLUGIN}={_plugin()}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpclib_python_out={out}",
                *(str(p) for p in protos),
            ]
        )
        produced = {
            p.relative_to(out).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(out.rglob("*"))
            if p.suffix in GENERATED
        }
    files: dict[str, str] = {"cortex/api/__init__.py": API_DOC}
    modules = sorted(
        (rel.removesuffix(".py").replace("/", ".") for rel in produced if rel.endswith(".py")),
        key=len, reverse=True,
    )
    for rel, text in produced.items():
        if not rel.startswith("cortex/"):
            continue
        for module in modules:  # named by their proto path: they move under cortex.api
            text = text.replace(module, "cortex.api." + module.removeprefix("cortex."))
        files["cortex/api/" + rel.removeprefix("cortex/")] = text
    # Every package between cortex.api and the modules says which proto packages it holds.
    packages = {
        str(Path(rel).parent) for rel in files if rel != "cortex/api/__init__.py"
    }
    for package in sorted(packages):
        parts = Path(package).parts
        for depth in range(3, len(parts) + 1):
            rel = "/".join(parts[:depth]) + "/__init__.py"
            below = sorted(
                "cortex." + "/".join(Path(p).parts[2:]).replace("/", ".")
                for p in packages
                if Path(p).parts[:depth] == parts[:depth]
            )
            files.setdefault(rel, f'"""Generated: {", ".join(below)}."""\n')
    return dict(sorted(files.items()))


def _committed(gen_root: Path) -> dict[str, str]:
    api = gen_root / "cortex" / "api"
    if not api.is_dir():
        return {}
    return {
        p.relative_to(gen_root).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(api.rglob("*"))
        if p.suffix in GENERATED
    }


def stale_files(expected: dict[str, str], gen_root: Path) -> dict[str, str]:
    """Files whose committed state differs: path -> ``changed`` | ``missing`` | ``extra``."""
    committed = _committed(gen_root)
    stale: dict[str, str] = {}
    for rel, text in expected.items():
        if rel not in committed:
            stale[rel] = "missing"
        elif committed[rel] != text:
            stale[rel] = "changed"
    for rel in committed.keys() - expected.keys():
        stale[rel] = "extra"
    return dict(sorted(stale.items()))


def _toolchain() -> str:
    versions = []
    for name in TOOLCHAIN:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (missing)")
    return ", ".join(versions)


def _summary(expected: dict[str, str], stale: dict[str, str], gen_root: Path) -> str:
    lines = [f"{gen_root} is stale ({len(stale)} file(s)); run `make proto`:"]
    committed = _committed(gen_root)
    for rel, why in stale.items():
        lines.append(f"  {why:8} {rel}")
    for rel, why in stale.items():
        if why != "changed":
            continue
        diff = list(
            difflib.unified_diff(
                committed[rel].splitlines(),
                expected[rel].splitlines(),
                f"committed/{rel}",
                f"generated/{rel}",
                lineterm="",
            )
        )
        lines.extend(diff[:DIFF_LINES])
        if len(diff) > DIFF_LINES:
            lines.append(f"... {len(diff) - DIFF_LINES} more diff lines")
    lines.append(
        f"toolchain here: {_toolchain()} (a diff in generated code only means the toolchain"
        " differs from the one that generated the committed code)"
    )
    return "\n".join(lines)


def _write(expected: dict[str, str], stale: dict[str, str], gen_root: Path) -> None:
    for rel, why in stale.items():
        path = gen_root / rel
        if why == "extra":
            path.unlink()
            for parent in path.parents:
                if parent == gen_root / "cortex" or any(parent.iterdir()):
                    break
                parent.rmdir()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(expected[rel], encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the code is stale")
    parser.add_argument("--proto-root", type=Path, default=PROTO_ROOT, help="(tests)")
    parser.add_argument("--gen-root", type=Path, default=GEN_ROOT, help="(tests)")
    args = parser.parse_args(argv)
    try:
        expected = generate(args.proto_root)
    except GenerationError as exc:
        print(f"gen_proto: {exc}", file=sys.stderr)
        return 2
    stale = stale_files(expected, args.gen_root)
    if args.check:
        if stale:
            print(_summary(expected, stale, args.gen_root), file=sys.stderr)
            return 1
        print(f"gen_proto: {args.gen_root} is up to date ({len(expected)} files)")
        return 0
    _write(expected, stale, args.gen_root)
    print(f"gen_proto: {len(stale)} file(s) rewritten, {len(expected) - len(stale)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
