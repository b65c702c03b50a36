"""TLS and mutual TLS for the gRPC hops: server credentials from the ``--tls-*`` flags, channel
credentials from the clients' ``--backend-tls-*`` flags (and the health probe's ``--tls-*``).

Files are PEM. Every file is read, and every certificate/key pair checked, when the server or the
client is built, so a wrong path or a key that does not match its certificate stops start-up with a
message naming the flag, instead of failing each handshake later.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from specdec.errors import ConfigError


_SERVER_TLS_HELP = {
    "tls_cert_file": "PEM certificate (chain) of this gRPC server; with --tls-key-file its port speaks TLS only",
    "tls_key_file": "PEM private key of --tls-cert-file",
    "tls_client_ca_file": "PEM CA bundle: clients must present a certificate signed by it (mutual TLS)",
}


def server_tls_field(name: str) -> Any:
    """The dataclass field of one server TLS setting (``tls_cert_file``, ``tls_key_file``,
    ``tls_client_ca_file``), declared alike by every service's config."""
    return field(default=None, metadata={"help": _SERVER_TLS_HELP[name]})


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag}: {path!r} is not a PEM file")
    return data


def _check_pair(cert_file: str, key_file: str, cert_flag: str, key_flag: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ConfigError(f"{cert_flag} {cert_file!r} and {key_flag} {key_file!r} do not make a certificate "
                          f"and its key: {exc.reason or exc}") from None


def _check_ca(ca_file: str, flag: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise ConfigError(f"{flag}: {ca_file!r} holds no usable CA certificate: {exc.reason or exc}") from None


def check_ca_file(ca_file: str, flag: str) -> None:
    """A readable PEM file holding at least one CA certificate, else a ConfigError naming ``flag``."""
    _read(ca_file, flag)
    _check_ca(ca_file, flag)


def check_key_pair(cert_file: str | None, key_file: str | None, cert_flag: str, key_flag: str) -> bool:
    """Whether TLS is on (both given and matching); one without the other is a ConfigError."""
    if cert_file is None and key_file is None:
        return False
    if cert_file is None or key_file is None:
        given, missing = (cert_flag, key_flag) if cert_file else (key_flag, cert_flag)
        raise ConfigError(f"{given} needs {missing} too")
    _read(cert_file, cert_flag)
    _read(key_file, key_flag)
    _check_pair(cert_file, key_file, cert_flag, key_flag)
    return True


def server_credentials(cert_file: str | None, key_file: str | None, client_ca_file: str | None = None,
                       flag_prefix: str = "--tls") -> grpc.ServerCredentials | None:
    """TLS credentials of a gRPC server (None: plaintext). With ``client_ca_file`` clients must present a
    certificate that CA signed (mutual TLS)."""
    cert_flag, key_flag, ca_flag = f"{flag_prefix}-cert-file", f"{flag_prefix}-key-file", f"{flag_prefix}-client-ca-file"
    if not check_key_pair(cert_file, key_file, cert_flag, key_flag):
        if client_ca_file is not None:
            raise ConfigError(f"{ca_flag} needs {cert_flag} and {key_flag} (mutual TLS is TLS first)")
        return None
    client_ca = None
    if client_ca_file is not None:
        client_ca = _read(client_ca_file, ca_flag)
        _check_ca(client_ca_file, ca_flag)
    return grpc.ssl_server_credentials([(_read(key_file, key_flag), _read(cert_file, cert_flag))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


def server_credentials_from(config: Any) -> grpc.ServerCredentials | None:
    """``server_credentials`` of a config with the three ``server_tls_field`` settings."""
    return server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches a gRPC server: plaintext (``credentials`` None) or TLS, optionally with a
    client certificate, and the name the server's certificate must carry when it is not the address's host."""

    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        options = list(options)
        if self.credentials is None:
            return grpc.insecure_channel(address, options=options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.secure_channel(address, self.credentials, options=options)


PLAINTEXT = ChannelSecurity()


def channel_security(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                     server_name: str | None = None, flag_prefix: str = "--backend-tls") -> ChannelSecurity:
    """A client's TLS from its flags: on when any file is given. ``ca_file``: the CA that signed the
    servers' certificates (default: the system's roots); ``cert_file`` + ``key_file``: the client
    certificate a mutual-TLS server asks for."""
    cert_flag, key_flag, ca_flag = f"{flag_prefix}-cert-file", f"{flag_prefix}-key-file", f"{flag_prefix}-ca-file"
    client_pair = check_key_pair(cert_file, key_file, cert_flag, key_flag)
    if ca_file is None and not client_pair:
        if server_name:
            raise ConfigError(f"{flag_prefix}-server-name needs TLS: give {ca_flag}")
        return PLAINTEXT
    root = None
    if ca_file is not None:
        root = _read(ca_file, ca_flag)
        _check_ca(ca_file, ca_flag)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=_read(key_file, key_flag) if client_pair else None,
        certificate_chain=_read(cert_file, cert_flag) if client_pair else None,
    )
    return ChannelSecurity(credentials, server_name or None)
