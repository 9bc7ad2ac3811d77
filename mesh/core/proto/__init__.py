"""Generated gRPC/protobuf bindings for proto/wavemesh/v1/station.proto (see proto/generate.py)."""
