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

PROTO_PATH = Path(__file__).resolve().parents[3].joinpath("proto/cortex/index/v1/index.proto")
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
    """Generate (into ``out_dir``) and load the grpcio service module of ``proto``.

    The messages are the project's generated ``index_pb2`` (protobuf's descriptor pool
    takes a .proto file once per process, and a grpcio client of another scheduler uses the
    same official classes); only ``index_pb2_grpc`` is generated here, with its import of
    the messages pointed at them. Loaded once per process.
    """
    from cortex.api.index.v1 import index_pb2

    loaded = sys.modules.get(_GRPC)
    if loaded is not None:
        return GrpcioStubs(index_pb2, loaded)
    from grpc_tools import protoc  # type: ignore[import-untyped]  # dev dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    code = protoc.main([
        "grpc_tools.protoc",
        f"-I{proto.parent}",
        f"--grpc_python_out={out_dir}",
        str(proto),
    ])
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed ({code}) on {proto}")
    path = out_dir / f"{_GRPC}.py"
    path.write_text(path.read_text().replace(
        f"import {_PB2} as", "from cortex.api.index.v1 import index_pb2 as"))
    return GrpcioStubs(index_pb2, _load(_GRPC, path))
