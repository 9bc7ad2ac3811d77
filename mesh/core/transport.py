"""What every hop between the orchestrator and the stations carries: the cluster token and mutual-TLS material.

The token travels as gRPC metadata (`authorization: Bearer <token>`); `StationTls` holds PEM bytes, read
from the files the cluster YAML names. No YAML here: the YAML module builds these from its fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mesh.core.config import ConfigError


def token_travels(token: object) -> bool:
    """True when `token` can travel as gRPC metadata: a non-empty string of printable ASCII."""
    return isinstance(token, str) and token != "" and token.isascii() and token.isprintable()


def check_token(token: object) -> str:
    """The token itself if it can travel as gRPC metadata (`token_travels`), else ValueError."""
    if not token_travels(token):
        raise ValueError("cluster token: must be a non-empty string of printable ASCII")
    return token


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC and HTTP clients take it: an IPv6 host in brackets (`[::1]:50051`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def address_host(address: str) -> str:
    """The host of a `host:port` address, an IPv6 host without its brackets: host_port's inverse for the host."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata a call carries for `token` (none without one); ValueError for a token that cannot travel."""
    return (("authorization", f"Bearer {check_token(token)}"),) if token is not None else ()


@dataclass(frozen=True, slots=True)
class StationTls:
    """PEM bytes for mutual TLS between orchestrator and stations: this side's cert and key, the cluster CA.

    A station presents a certificate for `server_name` (a DNS SAN), which the client checks in place of
    the address's host, so one certificate serves stations on any node; both sides must chain to `ca`.
    """

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str = "wavemesh-station"

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, ca: str | Path) -> StationTls:
        """Read the three PEM files (ConfigError naming the one that cannot be read)."""
        pems = []
        for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
            try:
                pems.append(Path(path).expanduser().read_bytes())
            except OSError as e:
                raise ConfigError(f"cluster.{name}: cannot read {path}: {e.strerror or e}") from None
        return cls(*pems)
