"""Regenerate the committed Python bindings in mesh/core/proto/ from proto/wavemesh/v1/station.proto.

    python proto/generate.py            # writes mesh/core/proto/station_pb2{.py,.pyi,_grpc.py}

protoc names the gRPC module's import after the proto path (`from wavemesh.v1 import
station_pb2`); the bindings live in the `mesh.core.proto` package, so that one import line
is rewritten. tests/test_proto_generated.py regenerates into a temp dir and compares.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the -I include root
PROTO_FILE = "wavemesh/v1/station.proto"
DEFAULT_OUT = PROTO_ROOT.parent / "mesh" / "core" / "proto"
GENERATED = ("station_pb2.py", "station_pb2.pyi", "station_pb2_grpc.py")
_PROTOC_IMPORT = "from wavemesh.v1 import station_pb2 as"
_PACKAGE_IMPORT = "from mesh.core.proto import station_pb2 as"


def generate(out_dir: str | Path) -> list[Path]:
    """Run grpc_tools.protoc on station.proto and write the three binding files into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}",
               f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}",
               str(PROTO_ROOT / PROTO_FILE)]
        subprocess.run(cmd, check=True)
        src = Path(tmp) / Path(PROTO_FILE).parent
        written = []
        for name in GENERATED:
            text = (src / name).read_text()
            if name == "station_pb2_grpc.py":
                if text.count(_PROTOC_IMPORT) != 1:
                    raise RuntimeError(f"{name}: expected one line starting {_PROTOC_IMPORT!r}")
                text = text.replace(_PROTOC_IMPORT, _PACKAGE_IMPORT)
            dest = out / name
            dest.write_text(text)
            written.append(dest)
    return written


if __name__ == "__main__":
    for path in generate(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT):
        print(path)
