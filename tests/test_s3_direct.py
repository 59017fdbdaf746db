"""S3 reads without botocore's client: signatures as botocore makes them, the settings they
are used for (and those left to botocore), and a listing of more than one page."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

import pytest
from helpers import s3

from shardsync.names import S3Location
from shardsync.network import S3Config
from shardsync.s3 import S3Client
from shardsync.s3_direct import direct_target
from shardsync.s3_sigv4 import Credentials, presign, sign
from shardsync.testing.seaweedfs import S3Server

NOW = datetime(2026, 12, 8, 1, 2, 3, tzinfo=UTC)
KEYS = ("AKIDEXAMPLE", "wJalr/XUtnFEMI+K7MDENG", "to+ken/=")
URLS = (
    "http://127.0.0.1:9000/bucket/a%20b/c~d%2Be.safetensors?attributes",
    "https://bucket.store.example/models/x%C3%A9/model.safetensors",
    "http://[::1]:9000/bucket/?list-type=2&encoding-type=url&prefix=a%2Fb%2F&continuation-token=x%2By%3D",
    "https://store.example:443/bucket/k",
)


def _botocore(now: datetime) -> mock._patch[object]:
    return mock.patch("botocore.auth.get_current_datetime", return_value=now.replace(tzinfo=None))


@pytest.mark.parametrize("token", [None, KEYS[2]])
@pytest.mark.parametrize("url", URLS)
def test_signed_headers_are_botocores(url: str, token: str | None) -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    headers = {"x-amz-checksum-mode": "ENABLED", "x-amz-request-payer": "requester"}
    ours = sign("HEAD", url, headers, Credentials(KEYS[0], KEYS[1], token), "eu-west-1", NOW)
    theirs = AWSRequest(method="HEAD", url=url, headers=dict(headers))
    theirs.headers["x-amz-content-sha256"] = ours["x-amz-content-sha256"]
    with _botocore(NOW):
        S3SigV4Auth(BotoCredentials(KEYS[0], KEYS[1], token), "s3", "eu-west-1").add_auth(theirs)
    assert ours["authorization"] == theirs.headers["Authorization"]


@pytest.mark.parametrize("token", [None, KEYS[2]])
@pytest.mark.parametrize("url", [u.partition("?")[0] for u in URLS])
def test_presigned_urls_are_botocores(url: str, token: str | None) -> None:
    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    payer = {"x-amz-request-payer": "requester"}
    ours = presign(url, Credentials(KEYS[0], KEYS[1], token), "me-south-1", NOW, expires=3600,
                   headers=payer)  # fmt: skip
    theirs = AWSRequest(method="GET", url=url, headers=dict(payer))
    with _botocore(NOW):
        credentials = BotoCredentials(KEYS[0], KEYS[1], token)
        S3SigV4QueryAuth(credentials, "s3", "me-south-1", expires=3600).add_auth(theirs)
    assert ours == theirs.url


ENV = {"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "secret"}
STORE = S3Config(endpoint="http://127.0.0.1:9000", region="us-east-1", addressing="path")


@pytest.mark.parametrize(
    ("config", "env", "direct"),
    [
        (STORE, ENV, True),
        (S3Config(), {**ENV, "AWS_ENDPOINT_URL": "http://10.0.0.5:9000"}, True),  # auto: an IP
        (STORE, {**ENV, "AWS_CA_BUNDLE": "/ca.pem"}, True),  # http: no TLS to trust
        (S3Config(), ENV, False),  # AWS's own hosts: botocore's rules
        (S3Config(endpoint="http://minio:9000"), ENV, False),  # auto picks the style
        (S3Config(endpoint="http://127.0.0.1:9000", profile="models"), ENV, False),
        (STORE, {"AWS_ACCESS_KEY_ID": "AKID"}, False),  # the rest of the chain
        (STORE, {**ENV, "AWS_CREDENTIAL_EXPIRATION": "2026-12-08T02:00:00Z"}, False),
        (
            S3Config(endpoint="https://s.example", addressing="path"),
            {**ENV, "AWS_CA_BUNDLE": "c"},
            False,
        ),
        (
            S3Config(),
            {
                **ENV,
                "AWS_ENDPOINT_URL": "http://10.0.0.5",
                "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true",
            },
            False,
        ),
    ],
)
def test_reads_go_without_botocore_only_where_it_would_read_the_same(
    config: S3Config, env: dict[str, str], direct: bool, tmp_path: Path
) -> None:
    env = {"AWS_CONFIG_FILE": str(tmp_path / "none"), **env}
    assert (direct_target(config, env) is not None) is direct


def test_a_config_file_that_may_name_the_region_is_left_to_botocore(tmp_path: Path) -> None:
    """Without a region set, botocore reads the profile's; with no file, it signs for
    us-east-1, as the direct reads do."""
    endpoint_only = S3Config(endpoint="http://127.0.0.1:9000", addressing="path")
    config_file = tmp_path / "config"
    env = {**ENV, "AWS_CONFIG_FILE": str(config_file)}
    target = direct_target(endpoint_only, env)
    assert target is not None and target.region == "us-east-1"
    config_file.write_text("[default]\nregion = eu-west-1\n")
    assert direct_target(endpoint_only, env) is None
    assert direct_target(endpoint_only, {**env, "AWS_DEFAULT_REGION": "eu-west-1"}) is not None


async def test_a_listing_of_more_than_a_page_is_read_to_its_end(
    s3server: S3Server, s3bucket: str, aws_reads: str
) -> None:
    """A store answers 1000 keys a page: the next pages are asked for by their token."""
    client = s3(s3server)
    names = [f"many/{i:05d}+x y" for i in range(1003)]
    for name in names:
        client.put_object(Bucket=s3bucket, Key=name, Body=b"")
    reader = S3Client(S3Config(s3server.endpoint, s3server.region, "path"))
    try:
        found = await reader.list(S3Location(s3bucket, "many/"), max_keys=5000)
    finally:
        await reader.aclose()
    assert sorted(o.key for o in found) == names
