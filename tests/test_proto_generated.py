"""The committed bindings in mesh/core/proto/ must equal a fresh protoc run on station.proto."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

ROOT = Path(__file__).resolve().parents[1]


def _load_generate():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_bindings_match_proto(tmp_path: Path) -> None:
    gen = _load_generate()
    written = gen.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(gen.GENERATED)
    for name in gen.GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "mesh" / "core" / "proto" / name).read_text()
        assert committed == fresh, f"mesh/core/proto/{name} is stale: run `python proto/generate.py`"


def test_grpc_module_imports_from_package() -> None:
    from mesh.core.proto import station_pb2, station_pb2_grpc

    assert station_pb2_grpc.wavemesh_dot_v1_dot_station__pb2 is station_pb2
    assert hasattr(station_pb2_grpc, "StationStub") and hasattr(station_pb2_grpc, "StationServicer")
    names = set(station_pb2.DESCRIPTOR.services_by_name["Station"].methods_by_name)
    assert names == {"Forward", "ForwardSteps", "EndSteps", "Release", "Info", "ExportKV", "ImportKV"}
