"""TLS, mutual TLS and bearer tokens: the right client gets in and decodes exactly, the wrong ones are refused
with the right status, health stays open, and a session belongs to whoever opened it."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.drafters import NoDrafter, make_drafter
from client.loop.decode import generate
from client.net.endpoint import Endpoint
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from server.limits import ServerLimits
from server.security import server_credentials
from server.service import build_server
from shared.auth import read_tokens
from shared.errors import SplitspecError
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

PROMPT = [5, 9, 14, 5, 9, 21, 33]
TOKENS = {"alice": "a" * 32, "bob": "b" * 32}


def make_pki(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 it signed, a client certificate it signed, and a stranger CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    files = {}

    def write(name: str, key, cert) -> None:
        files[name + ".key"] = folder / f"{name}.key"
        files[name + ".crt"] = folder / f"{name}.crt"
        files[name + ".key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))  # fmt: skip
        files[name + ".crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def certificate(name: str, issuer_key=None, issuer=None, ca: bool = False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        write(name, key, cert)
        return key, cert

    ca_key, ca = certificate("ca", ca=True)
    certificate("server", ca_key, ca.subject, san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    certificate("client-a", ca_key, ca.subject)
    certificate("stranger", ca=True)
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def plain(tiny_target) -> list[int]:
    return generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, 16).token_ids


@pytest.fixture
def secure_server(tiny_target, pki, tmp_path):
    """Start a TLS server (mutual when asked) with ``tokens``; yields the address's factory."""
    started = []

    def start(tokens=None, mutual: bool = False) -> str:
        credentials = server_credentials(pki["server.crt"], pki["server.key"], pki["ca.crt"] if mutual else None)
        server, port, service = build_server(tiny_target, "127.0.0.1", 0, ServerLimits(max_sessions=4),
                                             credentials=credentials, tokens=tokens)  # fmt: skip
        server.start()
        started.append((server, service))
        return f"127.0.0.1:{port}"

    yield start
    for server, service in started:
        server.stop(grace=None)
        service.close()


def token_file(folder: Path, lines: list[str]) -> Path:
    path = folder / "tokens"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tls_with_a_token_decodes_exactly_and_the_wrong_clients_are_refused(secure_server, pki, tmp_path, plain):
    address = secure_server(tokens={t: n for n, t in TOKENS.items()})
    ca = pki["ca.crt"]
    good = Endpoint.from_files(address, ca=ca, token_file=token_file(tmp_path, [f"alice {TOKENS['alice']}"]))
    verifier = RemoteVerifier(good)
    try:
        assert generate(verifier, make_drafter("prompt-lookup"), PROMPT, 16).token_ids == plain
    finally:
        verifier.shutdown()
    with pytest.raises(SplitspecError, match="UNAUTHENTICATED"):
        RemoteVerifier(Endpoint.from_files(address, ca=ca))  # no token
    with pytest.raises(SplitspecError, match="UNAUTHENTICATED"):
        RemoteVerifier(Endpoint(address, tls=True, ca=ca.read_bytes(), token="c" * 32))  # a token nobody issued
    with pytest.raises(SplitspecError, match="cannot reach"):  # the server's certificate is not the stranger's
        RemoteVerifier(Endpoint.from_files(address, ca=pki["stranger.crt"]), connect_timeout_s=2)
    with pytest.raises(SplitspecError, match="cannot reach"):  # plain text to a TLS port
        RemoteVerifier(Endpoint(address, token=TOKENS["alice"]), connect_timeout_s=2)
    with Endpoint(address, tls=True, ca=ca.read_bytes()).channel() as channel:  # health needs no token
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_session_belongs_to_the_token_that_opened_it(secure_server, pki):
    address = secure_server(tokens={t: n for n, t in TOKENS.items()})
    ca = pki["ca.crt"].read_bytes()
    stubs = {}
    channels = []
    for name, token in TOKENS.items():
        channels.append(Endpoint(address, tls=True, ca=ca, token=token).channel())
        stubs[name] = pb_grpc.SplitSpecStub(channels[-1])
    try:
        opened = stubs["alice"].OpenSession(pb.OpenSessionRequest(prompt_ids=PROMPT), timeout=10)
        request = pb.VerifyRequest(session_id=opened.session_id, length=opened.length)
        for call in (lambda: stubs["bob"].Verify(request, timeout=10),
                     lambda: stubs["bob"].CloseSession(pb.CloseSessionRequest(session_id=opened.session_id),
                                                       timeout=10)):  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert stubs["alice"].Verify(request, timeout=10).length == opened.length + 1  # untouched by bob
        stubs["alice"].CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=10)
    finally:
        for channel in channels:
            channel.close()


def test_mutual_tls_wants_a_client_certificate_the_ca_signed(secure_server, pki, plain):
    address = secure_server(mutual=True)
    with pytest.raises(SplitspecError, match="cannot reach"):
        RemoteVerifier(Endpoint.from_files(address, ca=pki["ca.crt"]), connect_timeout_s=2)
    client = Endpoint.from_files(address, ca=pki["ca.crt"], cert=pki["client-a.crt"], key=pki["client-a.key"])
    verifier = RemoteVerifier(client)
    try:
        assert generate(verifier, NoDrafter(), PROMPT, 16).token_ids == plain
    finally:
        verifier.shutdown()


def test_token_files_are_checked(tmp_path):
    assert read_tokens(token_file(tmp_path, ["# comment", "", f"alice {'a' * 32}", "b" * 20])) == {
        "a" * 32: "alice", "b" * 20: read_tokens(token_file(tmp_path, ["b" * 20]))["b" * 20]}  # fmt: skip
    with pytest.raises(SplitspecError, match="too easy to guess"):
        read_tokens(token_file(tmp_path, ["short"]))
    with pytest.raises(SplitspecError, match="lists no token"):
        read_tokens(token_file(tmp_path, ["# nothing"]))
