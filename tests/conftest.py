"""Fixtures shared by several test folders: a real S3 endpoint (moto's threaded server) and its client."""

from __future__ import annotations

import os
import socket

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors, so CI checks them too.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 API on localhost (moto's server in a thread of this process)."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch):
    """Dummy credentials and region for boto3 (also inherited by subprocesses)."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture
def s3(moto_endpoint, aws_env):
    import boto3

    return boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
