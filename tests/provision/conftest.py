"""Fixtures for the provisioning tests (the S3 endpoint itself is in tests/conftest.py)."""

from __future__ import annotations

from itertools import count

import pytest

_bucket_counter = count()


@pytest.fixture
def bucket(s3):
    name = f"snapshots-{next(_bucket_counter)}"
    s3.create_bucket(Bucket=name)
    return name


