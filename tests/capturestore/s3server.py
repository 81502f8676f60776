"""A real S3 API for the object-storage tests: moto's server on 127.0.0.1 over HTTP.

Nothing is mocked in-process: the store talks to the server through s3fs/aiobotocore exactly as
it would to AWS or MinIO, configured by the standard AWS_* variables (set by ``s3_env``)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint():
    """``http://127.0.0.1:PORT`` of a moto server running for the test session, in its own process:
    moto's server is a Flask app, and with Flask imported in the test process vLLM's engine start
    (later tests) fails with "Working outside of application context"."""
    with _moto_server({}) as url:
        yield url


AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


@pytest.fixture
def s3_env(moto_endpoint, monkeypatch):
    """The AWS_* variables pointing at the moto server (inherited by subprocesses and Dask workers)."""
    for k, v in (("AWS_ENDPOINT_URL", moto_endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                 ("AWS_SECRET_ACCESS_KEY", "testing-secret"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_endpoint


def make_bucket() -> str:
    """A new bucket on the server AWS_ENDPOINT_URL names; returns its name."""
    import boto3

    name = f"cs-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def bucket_keys(bucket: str) -> list[str]:
    import boto3

    out, token = [], None
    client = boto3.client("s3")
    while True:
        kw = {"Bucket": bucket, **({"ContinuationToken": token} if token else {})}
        page = client.list_objects_v2(**kw)
        out += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return sorted(out)
        token = page["NextContinuationToken"]


@pytest.fixture
def s3_url(s3_env) -> str:
    """``s3://<fresh bucket>/store``: a store URL of its own per test."""
    return f"s3://{make_bucket()}/store"


@contextmanager
def auth_moto_server():
    """A moto server in its own process that checks credentials (INITIAL_NO_AUTH_ACTION_COUNT=0):
    any key it has not issued is refused, as AWS refuses a wrong one."""
    with _moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as url:
        yield url


@contextmanager
def _moto_server(extra_env: dict):
    port = free_port()
    env = {**os.environ, **extra_env}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the moto server ({extra_env or 'no auth'}) did not start") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
