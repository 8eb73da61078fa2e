"""Deployment flags with vLLM's names: CORS, TLS, --root-path, --uvicorn-log-level, request logging.

The checks run in `pagedmoe serve` before the model loads, so a bad value costs one line, not a load."""
from __future__ import annotations

import json
import logging
import os
import ssl
from typing import Optional

request_logger = logging.getLogger("pagedmoe.server.requests")

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
CERT_REQS = {0: "CERT_NONE", 1: "CERT_OPTIONAL", 2: "CERT_REQUIRED"}


def json_str_list(flag: str, text: str) -> list[str]:
    """A CORS flag's value: a JSON list of strings, as vLLM reads it (`'["https://a.example"]'`)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def check_root_path(text: str) -> str:
    """--root-path: '' (none) or a path starting with '/'; a trailing '/' is dropped."""
    if not text:
        return ""
    if not text.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {text!r}")
    return text.rstrip("/")


def check_tls(keyfile: Optional[str], certfile: Optional[str], ca_certs: Optional[str],
              cert_reqs: int) -> dict:
    """The TLS flags as uvicorn.Config keywords ({} without TLS). The files are loaded here once, so a missing file,
    a key that does not match the certificate or a bad CA file is an error before the model loads."""
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}")
    if certfile is None:
        if keyfile is not None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate to serve with the key)")
        if ca_certs is not None or cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile (TLS)")
        return {}
    if keyfile is None:
        raise ValueError("--ssl-certfile needs --ssl-keyfile (the certificate's private key)")
    if cert_reqs and ca_certs is None:
        raise ValueError(f"--ssl-cert-reqs {cert_reqs} ({CERT_REQS[cert_reqs]}) needs --ssl-ca-certs to check "
                         "client certificates against")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load the certificate and "
                         f"its key ({e})") from None
    if ca_certs is not None:
        try:
            ctx.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-ca-certs {ca_certs}: cannot load the CA certificates ({e})") from None
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile, "ssl_ca_certs": ca_certs, "ssl_cert_reqs": cert_reqs}


def check_max_log_len(value: Optional[int]) -> None:
    if value is not None and value < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {value}")


def log_request(response_id: str, prompts: list[tuple[Optional[str], list[int]]], params,
                max_log_len: Optional[int]) -> None:
    """--enable-log-requests: one INFO line per accepted request: its id, prompt lengths in tokens and sampling
    parameters; the prompts' first `max_log_len` characters (token ids for a prompt sent as ids) only when
    --max-log-len is given."""
    lengths = ", ".join(str(len(ids)) for _, ids in prompts)
    line = f"received request {response_id}: {len(prompts)} prompt(s) of {lengths} tokens, params: {params!r}"
    if max_log_len:
        shown = [text[:max_log_len] if text is not None else ids[:max_log_len] for text, ids in prompts]
        line += f", prompt(s): {shown!r}"
    request_logger.info("%s", line)
