"""Plain grpcio stubs of ``index.proto``, generated on demand (tests, benchmarks).

Other schedulers talk to the index with grpcio clients generated from the same proto; this
module reproduces that: ``grpc_tools.protoc`` writes ``index_pb2.py`` / ``index_pb2_grpc.py``
into a directory, and they are loaded by file path under private module names, so they never
clash with the installed ``cortex`` namespace. Needs the dev extra (grpcio-tools).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["PROTO_PATH", "GrpcioStubs", "load_grpcio_stubs"]

PROTO_PATH = Path(__file__).resolve().parents[4].joinpath("proto/cortex/index/v1/index.proto")
_PB2 = "index_pb2"
_GRPC = "index_pb2_grpc"


@dataclass(frozen=True, slots=True)
class GrpcioStubs:
    """``pb2``: the message module; ``grpc``: ``IndexStub`` / ``IndexServicer`` /
    ``add_IndexServicer_to_server``."""

    pb2: ModuleType
    grpc: ModuleType


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_grpcio_stubs(out_dir: Path, proto: Path = PROTO_PATH) -> GrpcioStubs:
    """Generate (into ``out_dir``) and load the grpcio modules of ``proto``.

    Loaded once per process: protobuf's descriptor pool accepts a file only once, so later
    calls return the modules already loaded.
    """
    loaded_pb2, loaded_grpc = sys.modules.get(_PB2), sys.modules.get(_GRPC)
    if loaded_pb2 is not None and loaded_grpc is not None:
        return GrpcioStubs(loaded_pb2, loaded_grpc)
    from grpc_tools import protoc  # type: ignore[import-untyped]  # dev dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    code = protoc.main([
        "grpc_tools.protoc",
        f"-I{proto.parent}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto),
    ])
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed ({code}) on {proto}")
    pb2 = _load(_PB2, out_dir / f"{_PB2}.py")
    grpc_module = _load(_GRPC, out_dir / f"{_GRPC}.py")  # does `import index_pb2`
    return GrpcioStubs(pb2, grpc_module)
