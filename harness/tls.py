"""A throwaway certificate authority for tests: a CA, a server certificate for loopback addresses
and a client certificate, written as PEM files (``cryptography``; nothing leaves the directory).

    pki = make_pki(tmp_path)              # server cert valid for 127.0.0.1 and localhost
    etcd --cert-file pki.server_cert --key-file pki.server_key --trusted-ca-file pki.ca_cert

A second ``make_pki`` in another directory is an unrelated CA: its certificates do not verify
against the first one's, which is how a test provokes a wrong-CA failure.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
    key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
    decipher_only=False,
)  # fmt: skip
Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str | None) -> x509.Name:
    if common_name is None:
        return x509.Name([])
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: Key, path: Path) -> Path:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def make_pki(
    directory: Path,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    client_name: str | None = None,
) -> Pki:
    """A CA and two leaf certificates signed by it, valid for one day. The server certificate
    names ``hosts`` (IPs and DNS names) in its alternative names only, and may also act as a client
    (etcd's JSON gateway dials etcd's own gRPC port with it)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("mooncake-vllm test CA"))
        .issuer_name(_name("mooncake-vllm test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        common_name: str | None, usages: list, names: list | None
    ) -> tuple[x509.Certificate, Key]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    def general_name(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    # No common name on the server certificate: etcd's JSON gateway presents it to etcd itself,
    # and etcd 3.4 with authentication on refuses every gateway request whose certificate has
    # one ("CommonName of client sending a request against gateway will be ignored").
    server_cert, server_key = leaf(
        None,
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        [general_name(h) for h in hosts],
    )
    client_cert, client_key = leaf(client_name, [ExtendedKeyUsageOID.CLIENT_AUTH], None)
    return Pki(
        ca_cert=_write_cert(ca_cert, directory / "ca.pem"),
        server_cert=_write_cert(server_cert, directory / "server.pem"),
        server_key=_write_key(server_key, directory / "server-key.pem"),
        client_cert=_write_cert(client_cert, directory / "client.pem"),
        client_key=_write_key(client_key, directory / "client-key.pem"),
    )
