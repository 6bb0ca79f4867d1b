"""A real S3-compatible server on localhost for the --storage tests: moto's server mode (the `dev` extra),
with the AWS_* variables pyarrow.fs and the workers read pointed at it, and one empty bucket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

BUCKET = "distrain-test"


@pytest.fixture
def s3_bucket(monkeypatch, tmp_path) -> Iterator[str]:
    """s3://BUCKET on a moto server of this test's own; downloads of URIs cached under tmp_path."""
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "DISTRAIN_STORAGE_CACHE": str(tmp_path / "storage-cache"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    try:
        yield f"s3://{BUCKET}"
    finally:
        server.stop()
