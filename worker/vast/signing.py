"""The router's signature: the serverless public key and the check of a request's `auth_data.signature`.

As backend.py `__check_signature`: RSA PKCS#1 v1.5 / SHA-256 over
`json.dumps({"url": auth_data.url}, indent=4, sort_keys=True)` (skipped when UNSECURED=true, by the caller).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa


def load_public_key(text: str | bytes) -> rsa.RSAPublicKey:
    """The key served at `{REPORT_ADDR}/pubkey/`: PEM (SPKI or PKCS#1), DER or OpenSSH, as pycryptodome's
    `RSA.import_key` (the framework's parser) accepts."""
    data = text.strip().encode() if isinstance(text, str) else text.strip()
    loaders = (serialization.load_pem_public_key, serialization.load_der_public_key,
               serialization.load_ssh_public_key)
    for load in loaders:
        try:
            key = load(data)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue
        if isinstance(key, rsa.RSAPublicKey):
            return key
        raise ValueError(f"the serverless public key is not an RSA key ({type(key).__name__})")
    raise ValueError("the serverless public key could not be parsed")


def signed_message(url: Any) -> bytes:
    """The bytes Vast's router signs: only the worker url (backend.py `__check_signature`), so the signature says
    "the router sent this to this worker" and nothing about the payload, cost or reqnum."""
    return json.dumps({"url": url}, indent=4, sort_keys=True).encode()


def verify_signature(key: rsa.RSAPublicKey, url: Any, signature: Any) -> bool:
    """RSA PKCS#1 v1.5 / SHA-256 of `signed_message(url)`, the signature base64 (as the framework checks it)."""
    try:
        raw = base64.b64decode(signature)
        key.verify(raw, signed_message(url), padding.PKCS1v15(), hashes.SHA256())
        return True
    except (InvalidSignature, binascii.Error, ValueError, TypeError):
        return False
