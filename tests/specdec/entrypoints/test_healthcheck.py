"""specdec.entrypoints.healthcheck: the exec probe containers run every few seconds."""

from __future__ import annotations

import subprocess
import sys


def test_the_probe_does_not_import_torch_or_transformers():
    """A probe that imports torch takes ~2 s of a 5 s probe timeout; specdec's package imports are lazy."""
    code = ("import sys, specdec.entrypoints.healthcheck; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; import specdec; assert specdec.SamplingParams.__name__ == 'SamplingParams'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_probe_reports_an_unreachable_service(capsys):
    from specdec.entrypoints.healthcheck import main

    assert main(["127.0.0.1:1"]) != 0
    assert "127.0.0.1:1" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# against TLS and mutual-TLS servers (a real loopback server, SERVING)


def _serving_server(credentials):
    from specdec.serving.server import start_server

    handle = start_server(lambda server: None, ["test.Svc"], "127.0.0.1", 0, credentials=credentials)
    handle.set_serving(True)
    return handle


def test_the_probe_speaks_tls_given_the_ca(pki, capsys):
    from specdec.entrypoints.healthcheck import main
    from specdec.serving.tls import server_credentials
    from tests.tls_helpers import SERVER_NAME

    handle = _serving_server(server_credentials(pki.server_cert, pki.server_key))
    address = f"127.0.0.1:{handle.port}"
    try:
        assert main([address, "--tls-ca-file", pki.ca]) == 0
        assert main([f"localhost:{handle.port}", "test.Svc", "--tls-ca-file", pki.ca]) == 0
        # a container probes localhost while its certificate names the service
        assert main([address, "--tls-ca-file", pki.ca, "--tls-server-name", SERVER_NAME]) == 0
        assert "SERVING" in capsys.readouterr().out
        assert main([address]) == 1  # plaintext against TLS
        assert main([address, "--tls-ca-file", pki.other_ca]) == 1  # a CA that did not sign it
        assert main([address, "--tls-ca-file", pki.ca, "--tls-server-name", "someone-else"]) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        handle.stop(0)


def test_the_probe_presents_a_client_certificate_under_mutual_tls(pki, monkeypatch):
    from specdec.entrypoints.healthcheck import main
    from specdec.serving.tls import server_credentials

    handle = _serving_server(server_credentials(pki.server_cert, pki.server_key, pki.ca))
    address = f"127.0.0.1:{handle.port}"
    try:
        assert main([address, "--tls-ca-file", pki.ca]) == 1
        assert main([address, "--tls-ca-file", pki.ca, "--tls-cert-file", pki.client_cert,
                     "--tls-key-file", pki.client_key]) == 0
        # the same from the environment (what a container's probe command inherits)
        monkeypatch.setenv("SPECDEC_HEALTHCHECK_TLS_CA_FILE", pki.ca)
        monkeypatch.setenv("SPECDEC_HEALTHCHECK_TLS_CERT_FILE", pki.client_cert)
        monkeypatch.setenv("SPECDEC_HEALTHCHECK_TLS_KEY_FILE", pki.client_key)
        assert main([address]) == 0
    finally:
        handle.stop(0)


def test_bad_probe_tls_settings_exit_2(pki, capsys):
    from specdec.entrypoints.healthcheck import main

    assert main(["127.0.0.1:1", "--tls-cert-file", pki.client_cert]) == 2
    assert "--tls-cert-file needs --tls-key-file" in capsys.readouterr().err
