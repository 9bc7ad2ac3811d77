"""The committed bindings in mesh/core/proto/ must equal a fresh protoc run on station.proto."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

ROOT = Path(__file__).resolve().parents[1]

# The generator stamps its own version into the bindings as the oldest grpcio / protobuf runtime they need; a
# newer grpcio-tools from the registry raises the stamp without changing what the proto means, so the
# comparison leaves the stamps out (the import test below checks that the committed ones load).
_VERSION_STAMPS = (
    (re.compile(r"GRPC_GENERATED_VERSION = '[^']*'"), "GRPC_GENERATED_VERSION = <stamp>"),
    (re.compile(r"# Protobuf Python Version: \S+"), "# Protobuf Python Version: <stamp>"),
    (re.compile(r"(_runtime_version\.Domain\.PUBLIC,\n)(\s*\d+,\n){3}"), r"\1<stamp>\n"),
)


def _without_version_stamps(text: str) -> str:
    for pattern, placeholder in _VERSION_STAMPS:
        text = pattern.sub(placeholder, text)
    return text


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
        assert _without_version_stamps(committed) == _without_version_stamps(fresh), (
            f"mesh/core/proto/{name} is stale: run `python proto/generate.py`")


def test_the_comparison_ignores_only_the_generator_version_stamps() -> None:
    committed = (ROOT / "mesh" / "core" / "proto" / "station_pb2.py").read_text()
    restamped = re.sub(r"Domain\.PUBLIC,\n(\s*)\d+,", r"Domain.PUBLIC,\n\g<1>99,", committed)
    restamped = restamped.replace("# Protobuf Python Version: ", "# Protobuf Python Version: 99.")
    assert restamped != committed
    assert _without_version_stamps(restamped) == _without_version_stamps(committed)
    grpc_text = (ROOT / "mesh" / "core" / "proto" / "station_pb2_grpc.py").read_text()
    bumped = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.9.9'", grpc_text)
    assert bumped != grpc_text and _without_version_stamps(bumped) == _without_version_stamps(grpc_text)
    changed = grpc_text.replace("/wavemesh.v1.Station/Forward'", "/wavemesh.v1.Station/Forward2'", 1)
    assert changed != grpc_text and _without_version_stamps(changed) != _without_version_stamps(grpc_text)


def test_grpc_module_imports_from_package() -> None:
    from mesh.core.proto import station_pb2, station_pb2_grpc

    assert station_pb2_grpc.wavemesh_dot_v1_dot_station__pb2 is station_pb2
    assert hasattr(station_pb2_grpc, "StationStub") and hasattr(station_pb2_grpc, "StationServicer")
    names = set(station_pb2.DESCRIPTOR.services_by_name["Station"].methods_by_name)
    assert names == {"Forward", "ForwardSteps", "EndSteps", "Release", "Info", "ExportKV", "ImportKV"}
