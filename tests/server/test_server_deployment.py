"""vLLM's deployment flags on a real server and client: CORS (--allowed-*), TLS (--ssl-*), --root-path,
--enable-log-requests / --max-log-len, and bad values as one line before the model loads."""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import pagedmoe
from pagedmoe.cli import main
from server_utils import MAX_MODEL_LEN, MODEL_NAME, ServerThread, make_engine

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, max_num_seqs=4)


def _self_signed(folder: Path, name: str = "server") -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files: (certfile, keyfile), made with the
    cryptography package (the dev extra's)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    certfile, keyfile = folder / f"{name}.crt", folder / f"{name}.key"
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(certfile), str(keyfile)


# -- CORS ------------------------------------------------------------------------------------------------------
def test_cors_defaults_answer_a_preflight_without_the_api_key(engine):
    with ServerThread(engine, api_key="sekret") as s:
        pre = httpx.options(s.base_url + "/v1/completions", headers=PREFLIGHT, timeout=10)
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in pre.headers
        # the request itself still needs the key; the 401 carries the CORS header, so a page can read it
        denied = httpx.post(s.base_url + "/v1/completions", json=BODY, headers={"Origin": ORIGIN}, timeout=30)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert denied.headers["access-control-allow-origin"] == "*"
        ok = httpx.post(s.base_url + "/v1/completions", json=BODY, timeout=30,
                        headers={"Origin": ORIGIN, "Authorization": "Bearer sekret"})
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-origin"] == "*"


def test_cors_origin_list_refuses_other_origins(engine):
    with ServerThread(engine, allowed_origins=[ORIGIN], allowed_methods=["GET", "POST"],
                      allowed_headers=["authorization", "content-type"], allowed_credentials=True) as s:
        pre = httpx.options(s.base_url + "/v1/completions", headers=PREFLIGHT, timeout=10)
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert pre.headers["access-control-allow-credentials"] == "true"
        evil = {**PREFLIGHT, "Origin": "https://evil.example"}
        refused = httpx.options(s.base_url + "/v1/completions", headers=evil, timeout=10)
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        # a method outside the list is refused too
        put = httpx.options(s.base_url + "/v1/completions", timeout=10,
                            headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"})
        assert put.status_code == 400
        # a simple request from another origin is answered (CORS is the browser's check) but without the header
        other = httpx.get(s.base_url + "/v1/models", headers={"Origin": "https://evil.example"}, timeout=10)
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
        mine = httpx.get(s.base_url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
        assert mine.headers["access-control-allow-origin"] == ORIGIN


# -- TLS -------------------------------------------------------------------------------------------------------
def test_tls_serves_https_verified_against_the_certificate(engine, tmp_path):
    certfile, keyfile = _self_signed(tmp_path)
    with ServerThread(engine, uvicorn_kwargs={"ssl_certfile": certfile, "ssl_keyfile": keyfile}) as s:
        assert s.base_url.startswith("https://")
        trusted = ssl.create_default_context(cafile=certfile)
        with httpx.Client(verify=trusted, timeout=30) as client:
            assert client.get(s.base_url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME
            out = client.post(s.base_url + "/v1/completions", json=BODY)
            assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.ConnectError):  # the system's CAs do not know a self-signed certificate
            httpx.get(s.base_url + "/health", timeout=10)
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(s.base_url.replace("https://", "http://") + "/health", timeout=10)


def test_tls_check_loads_the_files(tmp_path):
    from pagedmoe.server.deployment import check_tls

    certfile, keyfile = _self_signed(tmp_path)
    other_cert, other_key = _self_signed(tmp_path, "other")
    assert check_tls(keyfile, certfile, None, 0) == {"ssl_keyfile": keyfile, "ssl_certfile": certfile,
                                                     "ssl_ca_certs": None, "ssl_cert_reqs": 0}
    assert check_tls(None, None, None, 0) == {}
    assert check_tls(keyfile, certfile, other_cert, 2)["ssl_cert_reqs"] == 2
    with pytest.raises(ValueError, match="cannot load the certificate and its key"):
        check_tls(other_key, certfile, None, 0)
    with pytest.raises(ValueError, match="cannot load the CA certificates"):
        check_tls(keyfile, certfile, keyfile, 2)


# -- --root-path -----------------------------------------------------------------------------------------------
def test_root_path_answers_with_and_without_the_prefix(engine):
    with ServerThread(engine, root_path="/llm", api_key="sekret") as s:
        auth = {"Authorization": "Bearer sekret"}
        # a proxy that forwards the prefix, and one that strips it: the same routes
        for prefix in ("/llm", ""):
            assert httpx.get(s.base_url + prefix + "/v1/models", headers=auth, timeout=10).status_code == 200
            out = httpx.post(s.base_url + prefix + "/v1/completions", json=BODY, headers=auth, timeout=30)
            assert out.status_code == 200, out.text
            # the open paths stay open under the prefix; the others keep needing the key
            assert httpx.get(s.base_url + prefix + "/health", timeout=10).status_code == 200
            assert httpx.get(s.base_url + prefix + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(s.base_url + "/other/v1/models", headers=auth, timeout=10).status_code == 404
        assert httpx.get(s.base_url + "/llmx/health", timeout=10).status_code == 401  # not the prefix: not open


# -- --enable-log-requests -------------------------------------------------------------------------------------
def _logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pagedmoe.server.requests"]


def test_log_requests_one_line_per_request(engine, caplog):
    caplog.set_level(logging.INFO, logger="pagedmoe.server.requests")
    with ServerThread(engine, enable_log_requests=True) as s:
        a = httpx.post(s.base_url + "/v1/completions", json=BODY, timeout=30).json()
        b = httpx.post(s.base_url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
            "temperature": 0.5}).json()
        c = httpx.post(s.base_url + "/v1/completions", json={**BODY, "prompt": [[1, 2, 3], [4, 5]]}, timeout=30).json()
    lines = _logged(caplog)
    assert len(lines) == 3, lines
    for line, resp in zip(lines, (a, b, c)):
        assert line.startswith(f"received request {resp['id']}: "), line
        assert "max_tokens=2" in line and "hello" not in line  # no prompt text without --max-log-len
    assert "temperature=0.5" in lines[1]
    assert f"1 prompt(s) of {a['usage']['prompt_tokens']} tokens" in lines[0]
    assert "2 prompt(s) of 3, 2 tokens" in lines[2]


def test_log_requests_max_log_len_and_off_by_default(engine, caplog):
    caplog.set_level(logging.INFO, logger="pagedmoe.server.requests")
    with ServerThread(engine) as s:
        assert httpx.post(s.base_url + "/v1/completions", json=BODY, timeout=30).status_code == 200
    assert _logged(caplog) == []
    with ServerThread(engine, enable_log_requests=True, max_log_len=5) as s:
        for prompt in (["hello there", "world"], [7, 8, 9, 10, 11, 12]):
            assert httpx.post(s.base_url + "/v1/completions", json={**BODY, "prompt": prompt},
                              timeout=30).status_code == 200
    text, ids = _logged(caplog)
    assert text.endswith("prompt(s): ['hello', 'world']"), text
    assert ids.endswith("prompt(s): [[7, 8, 9, 10, 11]]"), ids  # a prompt sent as token ids: its first ids


# -- the flags through `pagedmoe serve` ------------------------------------------------------------------------
@pytest.fixture
def no_load(monkeypatch):
    from pagedmoe.engine import llm_engine

    def never(*_args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_engine, "start_engine", never)


@pytest.mark.parametrize("flags, expected", [
    (["--allowed-origins", "*"], "--allowed-origins must be a JSON list of strings"),
    (["--allowed-methods", '["GET", 1]'], "--allowed-methods must be a JSON list of strings"),
    (["--allowed-headers", '{"a": 1}'], "--allowed-headers must be a JSON list of strings"),
    (["--ssl-keyfile", "/no/such.key", "--ssl-certfile", "/no/such.crt"], "--ssl-keyfile /no/such.key: no such file"),
    (["--ssl-keyfile", "@KEY"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "@CERT"], "--ssl-certfile needs --ssl-keyfile"),
    (["--ssl-certfile", "@CERT", "--ssl-keyfile", "@CERT"], "--ssl-certfile @CERT / --ssl-keyfile @CERT: cannot load"),
    (["--ssl-certfile", "@CERT", "--ssl-keyfile", "@KEY", "--ssl-cert-reqs", "2"],
     "--ssl-cert-reqs 2 (CERT_REQUIRED) needs --ssl-ca-certs"),
    (["--ssl-cert-reqs", "3"], "--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got 3"),
    (["--ssl-ca-certs", "@CERT"], "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
    (["--root-path", "llm"], "--root-path must start with '/', got 'llm'"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0, got -1"),
])
def test_bad_flags_are_one_line_before_the_model_loads(capsys, no_load, tmp_path, flags, expected):
    certfile, keyfile = _self_signed(tmp_path)
    names = {"@CERT": certfile, "@KEY": keyfile}
    flags = [names.get(f, f) for f in flags]
    expected = expected.replace("@CERT", certfile)
    assert main(["serve", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"pagedmoe serve: error: {expected}"), err


def test_bad_cors_variable_is_one_line(capsys, no_load, monkeypatch):
    monkeypatch.setenv("PAGEDMOE_ALLOWED_ORIGINS", "https://a.example")
    assert main(["serve", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pagedmoe serve: error: --allowed-origins must be a JSON list of strings, e.g. '[\"*\"]', got " \
                  "'https://a.example'", err


def test_serve_with_every_deployment_flag(tiny_model_dir, tmp_path):
    """`pagedmoe serve` in a subprocess: https under a root path, an origin list, and the request log."""
    certfile, keyfile = _self_signed(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    src = str(Path(pagedmoe.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "PAGEDMOE_ENABLE_LOG_REQUESTS": "1"}
    log_path = tmp_path / "server.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedmoe.cli", "--log-level", "INFO", "serve", str(tiny_model_dir),
             "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--served-model-name", MODEL_NAME,
             "--port", str(port), "--ssl-certfile", certfile, "--ssl-keyfile", keyfile, "--root-path", "/llm/",
             "--allowed-origins", f'["{ORIGIN}"]', "--uvicorn-log-level", "warning", "--max-log-len", "3"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"https://127.0.0.1:{port}/llm"
        try:
            with httpx.Client(verify=ssl.create_default_context(cafile=certfile), timeout=30) as client:
                deadline = time.monotonic() + 120
                while True:
                    assert proc.poll() is None, "the server exited early:\n" + log_path.read_text()
                    try:
                        if client.get(base + "/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, "the server did not come up"
                    time.sleep(0.2)
                out = client.post(base + "/v1/completions", json=BODY, headers={"Origin": ORIGIN})
                assert out.status_code == 200, out.text
                assert out.headers["access-control-allow-origin"] == ORIGIN
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        text = log_path.read_text()
    assert f"serving {MODEL_NAME} on https://127.0.0.1:{port}" in text, text
    assert f"received request {out.json()['id']}: 1 prompt(s) of " in text and "prompt(s): ['hel']" in text, text
    assert "POST /llm/v1/completions" not in text, text  # uvicorn's access log (INFO) under --uvicorn-log-level warning
