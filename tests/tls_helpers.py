"""A throw-away PKI for the TLS tests, made at test time with ``cryptography`` (no files in the repository).

``make_pki(folder)`` writes PEM files: a CA, a server certificate it signed (names ``localhost``,
``127.0.0.1`` and ``SERVER_NAME``), a client certificate it signed, and a second CA with a client
certificate of its own (what a mutual-TLS server must refuse), and a "pod" certificate that serves and
dials alike (server and client auth, the server certificate's names), as one the Helm chart mounts in
every pod. EC P-256 keys: made in milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

SERVER_NAME = "specdec-test-server"  # a name only the server certificate carries (for --*-server-name)


@dataclass(frozen=True)
class Pki:
    ca: str  # PEM certificate of the CA
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # another CA, and a client certificate it signed
    other_client_cert: str
    other_client_key: str
    pod_cert: str  # server and client auth, the server certificate's names
    pod_key: str
    folder: Path


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _certificate(subject: str, key, issuer_name, issuer_key, ca: bool = False, server: bool = False,
                 client: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject))
               .issuer_name(issuer_name or _name(subject))
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        if client or not server:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.DNSName(SERVER_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _write(folder: Path, name: str, cert=None, key=None) -> str:
    from cryptography.hazmat.primitives import serialization

    path = folder / name
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(path)


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, other_ca_key = _key(), _key()
    ca = _certificate("specdec test CA", ca_key, None, None, ca=True)
    other_ca = _certificate("another CA", other_ca_key, None, None, ca=True)
    server_key, client_key, other_client_key, pod_key = _key(), _key(), _key(), _key()
    server = _certificate("localhost", server_key, ca.subject, ca_key, server=True)
    client = _certificate("specdec-gateway", client_key, ca.subject, ca_key)
    other_client = _certificate("intruder", other_client_key, other_ca.subject, other_ca_key)
    pod = _certificate("specdec-pod", pod_key, ca.subject, ca_key, server=True, client=True)
    return Pki(
        ca=_write(folder, "ca.pem", ca),
        server_cert=_write(folder, "server.pem", server), server_key=_write(folder, "server.key", key=server_key),
        client_cert=_write(folder, "client.pem", client), client_key=_write(folder, "client.key", key=client_key),
        other_ca=_write(folder, "other-ca.pem", other_ca),
        other_client_cert=_write(folder, "other-client.pem", other_client),
        other_client_key=_write(folder, "other-client.key", key=other_client_key),
        pod_cert=_write(folder, "pod.pem", pod), pod_key=_write(folder, "pod.key", key=pod_key),
        folder=folder,
    )
