"""Station internal auth: the cluster token on every station RPC (health open), and optional mutual TLS.

The HTTP side (API key on every route but /health and /metrics) is covered by
tests/test_api.py::test_api_key_guards_every_route_but_health_and_metrics.
"""
from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.control.cluster_yaml import load_mesh_config
from mesh.control.mesh_config import ClusterConfig
from mesh.core.transport import StationTls, address_host, host_port
from mesh.core.config import ConfigError, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2_grpc
from mesh.core.wave import WaveEntry
from mesh.core.wire import encode_forward
from station.client import StationCallError, StationClient
from station.server import start_server
from station.step import Station

TOKEN = "s3cret-cluster-token"
GREEDY = SamplingParams(max_tokens=1, ignore_eos=True)
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def station(tiny_llama):
    return Station(tiny_llama, StationSpec(layers=(0, 6)))


@pytest.fixture(scope="module")
def authed(station):
    """A token-guarded server over a whole-model station."""
    server = start_server(station, token=TOKEN)
    try:
        yield server
    finally:
        server.stop(grace=0)


def _calls(client: StationClient) -> dict:
    """One call of each Station RPC through a client."""
    return {"Forward": lambda: client.forward(0, (WaveEntry(1, 0, 3, GREEDY),), token_ids=[1, 2, 3]),
            "Release": lambda: client.release([1]),
            "Info": client.info}


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1], " " + TOKEN])
def test_every_station_rpc_needs_the_token(authed, station, token):
    with StationClient(authed.address, timeout_s=10, token=token) as client:
        for method, call in _calls(client).items():
            with pytest.raises(StationCallError) as info:
                call()
            assert info.value.code == UNAUTH, method
            assert "cluster token" in info.value.details
        assert client.health() and client.health("wavemesh.v1.Station")  # probes need no secret
    assert station.stats().kv.sequences == 0  # the refused Forward never reached the station


def test_raw_metadata_variants_are_refused(authed):
    request = encode_forward(0, (WaveEntry(2, 0, 1),), [5], None)
    with grpc.insecure_channel(authed.address) as channel:
        stub = station_pb2_grpc.StationStub(channel)
        for metadata in ((("authorization", TOKEN),), (("authorization", f"Basic {TOKEN}"),),
                         (("authorization", f"bearer  {TOKEN}"),), (("x-token", f"Bearer {TOKEN}"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Forward(request, timeout=10, metadata=metadata)
            assert info.value.code() == UNAUTH, metadata
        # a method the server does not have is refused the same way: nothing is learned without the token
        unknown = channel.unary_unary("/wavemesh.v1.Station/Nope", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            unknown(b"", timeout=10)
        assert info.value.code() == UNAUTH
        with pytest.raises(grpc.RpcError) as info:
            unknown(b"", timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_health_check_with_garbage_bytes_is_invalid_argument(authed):
    """The open health service refuses bytes that are no HealthCheckRequest as the Station methods do."""
    with grpc.insecure_channel(authed.address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        for garbage in (b"\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\xff" * 11):
            with pytest.raises(grpc.RpcError) as info:
                check(garbage, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (garbage, info.value.details())
            assert "not a valid protobuf message" in info.value.details()
        assert check(b"", timeout=10).status == health_pb2.HealthCheckResponse.SERVING  # still serving


def test_with_the_token_every_rpc_works(authed):
    with StationClient(authed.address, timeout_s=30, token=TOKEN, hidden_size=64, vocab_size=512) as client:
        calls = _calls(client)
        assert calls["Forward"]().samples[0] is not None
        assert calls["Info"]().sequences == 1
        assert calls["Release"]() == 1
        assert client.health()


def test_no_token_server_accepts_any_client(station):
    with start_server(station) as server, StationClient(server.address, timeout_s=10, token=TOKEN) as client:
        assert client.info().layer_end == 6  # metadata the server does not ask for is ignored


@pytest.mark.parametrize("bad", ["", "tok\nen", "tökén", 7])
def test_unsendable_tokens_are_refused_early(station, bad):
    with pytest.raises(ValueError):
        start_server(station, token=bad)
    with pytest.raises(ValueError):
        StationClient("127.0.0.1:1", token=bad)
    with pytest.raises(ConfigError, match=r"^cluster\.token: "):  # the YAML refuses it by the same rule
        ClusterConfig(token=bad)


@pytest.mark.parametrize("host, address", [("127.0.0.1", "127.0.0.1:7"), ("station-3.local", "station-3.local:7"),
                                           ("::1", "[::1]:7"), ("fe80::1%eth0", "[fe80::1%eth0]:7")])
def test_host_port_brackets_ipv6(host, address):
    assert host_port(host, 7) == address
    assert address_host(address) == host  # the inverse: where a station's relay link is dialled


# ---- mutual TLS -----------------------------------------------------------------------------------

def _pki(root: Path) -> dict[str, Path]:
    """A CA, a station cert (SAN DNS:wavemesh-station) and a client cert signed by it, and a rogue CA's client."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    files: dict[str, Path] = {}

    def name(cn: str):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, cert, key) -> None:
        files[f"{stem}.crt"] = root / f"{stem}.crt"
        files[f"{stem}.key"] = root / f"{stem}.key"
        files[f"{stem}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{stem}.key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))

    def issue(cn: str, issuer=None, issuer_key=None, *, ca: bool = False, usage=None, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn))
             .issuer_name(issuer.subject if issuer else name(cn)).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
        return b.sign(issuer_key or key, hashes.SHA256()), key

    ca, ca_key = issue("wavemesh test CA", ca=True)
    write("ca", ca, ca_key)
    write("station", *issue("station", ca, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH, san="wavemesh-station"))
    write("orchestrator", *issue("orchestrator", ca, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    write("shared", *issue("cluster", ca, ca_key, san="wavemesh-station"))  # one cert for both sides, no EKU
    rogue_ca, rogue_key = issue("rogue CA", ca=True)
    write("rogue", *issue("orchestrator", rogue_ca, rogue_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return _pki(tmp_path_factory.mktemp("pki"))


def test_mutual_tls_with_token(station, pki):
    server_tls = StationTls.from_files(pki["station.crt"], pki["station.key"], pki["ca.crt"])
    cfg = ClusterConfig(token=TOKEN, tls_cert=str(pki["orchestrator.crt"]), tls_key=str(pki["orchestrator.key"]),
                        tls_ca=str(pki["ca.crt"]))
    with start_server(station, token=TOKEN, tls=server_tls) as server:
        with StationClient(server.address, timeout_s=30, token=cfg.token, tls=cfg.tls()) as client:
            assert client.health()
            assert client.forward(0, (WaveEntry(3, 0, 2, GREEDY),), token_ids=[4, 5]).samples[0] is not None
            assert client.release([3]) == 1
        with StationClient(server.address, timeout_s=30, tls=cfg.tls()) as client:  # TLS alone is not the token
            with pytest.raises(StationCallError) as info:
                client.info()
            assert info.value.code == UNAUTH
        rogue = StationTls.from_files(pki["rogue.crt"], pki["rogue.key"], pki["ca.crt"])
        no_cert = StationTls(b"", b"", pki["ca.crt"].read_bytes())
        for tls in (None, rogue):  # plaintext, or a certificate the cluster CA did not sign
            with StationClient(server.address, timeout_s=5, token=TOKEN, tls=tls) as client:
                with pytest.raises(StationCallError) as info:
                    client.info()
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
                assert not client.health()  # under mTLS the probe needs a certificate too
        with (pytest.raises((StationCallError, ValueError)),
              StationClient(server.address, timeout_s=5, token=TOKEN, tls=no_cert) as client):
            client.info()  # no client certificate at all


def test_one_cluster_config_serves_both_sides(station, pki):
    """The simple deployment: ClusterConfig names one cert (SAN wavemesh-station) that stations and orchestrator share."""
    cfg = ClusterConfig(token=TOKEN, tls_cert=str(pki["shared.crt"]), tls_key=str(pki["shared.key"]),
                        tls_ca=str(pki["ca.crt"]))
    with (start_server(station, token=cfg.token, tls=cfg.tls()) as server,
          StationClient(server.address, timeout_s=30, token=cfg.token, tls=cfg.tls()) as client):
        assert client.health() and client.info().layer_end == 6


def test_cluster_tls_config_all_or_none(pki, tmp_path):
    paths = {"tls_cert": str(pki["orchestrator.crt"]), "tls_key": str(pki["orchestrator.key"]),
             "tls_ca": str(pki["ca.crt"])}
    tls = ClusterConfig(**paths).tls()
    assert tls.ca == pki["ca.crt"].read_bytes() and tls.server_name == "wavemesh-station"
    assert ClusterConfig().tls() is None
    with pytest.raises(ConfigError, match=r"^cluster\.tls_cert: needs tls_ca too \(mutual TLS takes"):
        ClusterConfig(tls_cert=paths["tls_cert"], tls_key=paths["tls_key"])
    with pytest.raises(ConfigError, match=r"cluster\.tls_key: .*no-such\.key is not a file"):
        ClusterConfig(**{**paths, "tls_key": str(tmp_path / "no-such.key")})
    with pytest.raises(ConfigError, match=r"cluster\.token: must be printable ASCII"):
        ClusterConfig(token="a\tb")
    yaml = tmp_path / "mesh.yaml"
    yaml.write_text("model: {preset: tiny}\ncluster: {token: t, " + ", ".join(f"{k}: {v}" for k, v in paths.items())
                    + "}\n")
    assert load_mesh_config(yaml).cluster.tls_ca == paths["tls_ca"]
    yaml.write_text("model: {preset: tiny}\ncluster: {tls_cert: " + paths["tls_cert"] + "}\n")
    with pytest.raises(ConfigError, match=r"mesh\.yaml: cluster\.tls_cert: needs tls_key and tls_ca too"):
        load_mesh_config(yaml)
