"""TLS when USE_SSL=true: the instance certificate (/etc/instance.crt and .key), obtained as start_server.sh does,
and the listening site's SSL context."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

import aiohttp
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa

log = logging.getLogger("glmflash.vast")

SIGN_CERT_URL = "https://console.vast.ai/api/v0/sign_cert/"
INSTANCE_CERT, INSTANCE_KEY = Path("/etc/instance.crt"), Path("/etc/instance.key")


def server_ssl_context(cert: Path = INSTANCE_CERT, key: Path = INSTANCE_KEY) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    return context


def _cert_matches(cert_pem: bytes, key: rsa.RSAPrivateKey) -> bool:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return False
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt)


def instance_csr(key: rsa.RSAPrivateKey) -> bytes:
    """start_server.sh's request: CN=pyworker.vast.ai, C=US, ST=CA, SAN IP 0.0.0.0, not a CA, PEM."""
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
                         x509.NameAttribute(NameOID.STATE_OR_PROVINCE_NAME, "CA"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "pyworker.vast.ai")])
    usage = x509.KeyUsage(digital_signature=True, content_commitment=True, key_encipherment=True,
                          data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                          encipher_only=False, decipher_only=False)
    csr = (x509.CertificateSigningRequestBuilder().subject_name(subject)
           .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=False)
           .add_extension(usage, critical=False)
           .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("0.0.0.0"))]),
                          critical=False)
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


async def ensure_instance_cert(container_id: int | str, *, cert: Path = INSTANCE_CERT, key: Path = INSTANCE_KEY,
                               sign_url: str = SIGN_CERT_URL, attempts: int = 5, backoff_s: float = 2.0) -> bool:
    """Make sure the instance certificate exists (what start_server.sh does when USE_SSL=true, and the base image
    may already have done): a fresh key, its CSR signed by Vast's console, installed only once it parses and
    matches the key. False when it could not be had (serve plain HTTP then, with USE_SSL=false)."""
    if cert.exists() and key.exists():
        try:
            private = serialization.load_pem_private_key(key.read_bytes(), password=None)
            if isinstance(private, rsa.RSAPrivateKey) and _cert_matches(cert.read_bytes(), private):
                return True
        except ValueError:
            pass
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csr = instance_csr(private)
    url = f"{sign_url}?instance_id={container_id}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for attempt in range(1, attempts + 1):
            try:
                async with session.post(url, data=csr, headers={"Content-Type": "application/octet-stream"}) as r:
                    r.raise_for_status()
                    signed = await r.read()
                if _cert_matches(signed, private):
                    break
                log.warning("event=vast_cert_unusable attempt=%d", attempt)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("event=vast_cert_sign_failed attempt=%d error=%r", attempt, exc)
            if attempt < attempts:
                await asyncio.sleep(backoff_s)
        else:
            return False
    key_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                    serialization.NoEncryption())
    _write_atomic(key, key_pem, 0o600)
    _write_atomic(cert, signed, 0o644)
    return True


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
