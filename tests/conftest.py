"""Shared fixtures: a fake hub on loopback and a small real checkpoint."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from bodypaths import body_path

from shardsync.network import S3Config
from shardsync.s3_direct import direct_target
from shardsync.testing import Checkpoint, FakeHub, build_checkpoint
from shardsync.testing.nginx import find_nginx
from shardsync.testing.seaweedfs import S3Server, S3ServerUnavailable, run_seaweedfs

__all__ = ["body_path"]  # a fixture every test module may take

# huggingface_hub reads its environment once, at import: settle it before any test imports it.
# No test may reach huggingface.co or send a developer's own token anywhere.
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"
os.environ["HF_HUB_DISABLE_XET"] = "1"
for _name in ("HF_HUB_ENABLE_HF_TRANSFER", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
    os.environ.pop(_name, None)
os.environ.pop("HF_OIDC_RESOURCE", None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``nginx`` skips where nginx is not installed."""
    if item.get_closest_marker("nginx") is not None and find_nginx() is None:
        pytest.skip("nginx is not installed (apt-get install nginx)")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """A 3-shard safetensors checkpoint of ~384 KiB with config and tokenizer files."""
    return build_checkpoint(
        tmp_path_factory.mktemp("checkpoint"), total_bytes=384 * 1024, n_shards=3
    )


@pytest.fixture
async def fake_hub() -> AsyncIterator[FakeHub]:
    """A started `FakeHub` on the test's event loop."""
    async with FakeHub() as hub:
        yield hub


@pytest.fixture
def hf_cache(tmp_path: Path) -> Path:
    """An empty huggingface_hub cache directory."""
    path = tmp_path / "hf-cache"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def s3server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real SeaweedFS S3 gateway for the session (skips when `weed` is absent or stuck)."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(run_seaweedfs(tmp_path_factory.mktemp("seaweedfs")))
        except S3ServerUnavailable as exc:
            pytest.skip(str(exc))
        yield server


@pytest.fixture
def s3bucket(s3server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh, empty bucket on `s3server`, named after the test."""
    return s3server.new_bucket(request.node.name)


@pytest.fixture
def aws_env(s3server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The standard AWS chain points at the test store's full-rights identity, and at
    nothing of this machine's (no ~/.aws files, no instance metadata)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3server.secret_key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(params=["direct", "botocore"])
def aws_reads(
    request: pytest.FixtureRequest,
    aws_env: None,
    s3server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> str:
    """``aws_env``, read both ways ``S3Client`` reads: signed by ``s3_direct`` (credentials in
    the environment), and by botocore (the same credentials in the shared credentials file,
    which only botocore reads)."""
    if request.param == "botocore":
        credentials = tmp_path / "aws-credentials"
        credentials.write_text(
            f"[default]\naws_access_key_id = {s3server.access_key}\n"
            f"aws_secret_access_key = {s3server.secret_key}\n"
        )
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = S3Config(s3server.endpoint, s3server.region, "path")
    assert (direct_target(store, os.environ) is None) is (request.param == "botocore")
    return str(request.param)
