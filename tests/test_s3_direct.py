"""S3 reads without botocore's client: signatures as botocore makes them, the settings they
are used for (and those left to botocore), and a listing of more than one page."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

import pytest
from aiohttp import web
from helpers import s3

from shardsync.errors import ProtocolError, TransferError
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
        (S3Config(endpoint="http://127.0.0.1:9000", addressing="virtual"), ENV, False),
        (S3Config("https://s3.eu-west-1.amazonaws.com", "eu-west-1", "path"), ENV, False),
        (STORE, {**ENV, "AWS_PROFILE": "models"}, False),  # what it names, or that it is none
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
    env = {
        "AWS_CONFIG_FILE": str(tmp_path / "c"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "s"),
        **env,
    }
    assert (direct_target(config, env) is not None) is direct


@pytest.mark.parametrize("variable", ["AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"])
def test_an_aws_config_or_credentials_file_is_left_to_botocore(
    variable: str, tmp_path: Path
) -> None:
    """botocore reads a region (and a CA bundle, endpoint rules) from either file's profile;
    with neither and no region set it signs for us-east-1, as the direct reads do."""
    endpoint_only = S3Config(endpoint="http://127.0.0.1:9000", addressing="path")
    files = {"AWS_CONFIG_FILE": tmp_path / "c", "AWS_SHARED_CREDENTIALS_FILE": tmp_path / "s"}
    env = {**ENV, **{name: str(path) for name, path in files.items()}}
    target = direct_target(endpoint_only, env)
    assert target is not None and target.region == "us-east-1"
    files[variable].write_text("[default]\nregion = eu-west-1\n")
    assert direct_target(endpoint_only, env) is None
    assert direct_target(STORE, env) is None


@pytest.mark.parametrize(
    "tokens",
    [{"AWS_SESSION_TOKEN": "ses"}, {"AWS_SECURITY_TOKEN": "sec", "AWS_SESSION_TOKEN": "ses"},
     {"AWS_SECURITY_TOKEN": "", "AWS_SESSION_TOKEN": "ses"}, {}],
)  # fmt: skip
def test_the_session_token_is_the_one_botocore_reads(
    tokens: dict[str, str], tmp_path: Path
) -> None:
    from botocore.credentials import EnvProvider

    env = {**ENV, **tokens, "AWS_CONFIG_FILE": str(tmp_path / "c"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "s")}  # fmt: skip
    target = direct_target(STORE, env)
    theirs = EnvProvider(environ=env).load()
    assert target is not None and theirs is not None
    assert target.credentials.token == (theirs.token or None)


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


@contextlib.asynccontextmanager
async def _store(answer: Callable[[web.Request], web.Response]) -> AsyncIterator[S3Client]:
    """A client of a one-handler store on loopback, reading without botocore."""

    async def handle(request: web.Request) -> web.Response:
        return answer(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    client = S3Client(
        S3Config(f"http://127.0.0.1:{runner.addresses[0][1]}", "us-east-1", "path"), attempts=1
    )
    try:
        assert client._reads() is not None
        yield client
    finally:
        await client.aclose()
        await runner.cleanup()


def _page(keys: list[str], token: str | None, *, echo: bool) -> web.Response:
    contents = "".join(
        f'<Contents><Key>{k}</Key><Size>1</Size><ETag>"e"</ETag></Contents>' for k in keys
    )
    more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>"
    body = (
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        + ("<EncodingType>url</EncodingType>" if echo else "")
        + contents
        + (more if token else "<IsTruncated>false</IsTruncated>")
        + "</ListBucketResult>"
    )
    return web.Response(text=body, content_type="application/xml")


@pytest.mark.parametrize("echo", [True, False])
async def test_listed_keys_are_decoded_only_where_the_store_says_it_encoded_them(
    echo: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A store that ignores ``encoding-type=url`` sends its keys as they are: ``a+b%41`` is
    that key, not ``a bA`` (botocore decodes only where the answer says ``url``)."""
    for name, value in {**ENV, "AWS_CONFIG_FILE": str(tmp_path / "c"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "s")}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    sent = "m/a%2Bb%2541" if echo else "m/a+b%41"
    async with _store(lambda _: _page([sent], None, echo=echo)) as client:
        found = await client.list(S3Location("bucket", "m/"), max_keys=10)
    assert [o.key for o in found] == ["m/a+b%41"]


async def test_a_listing_whose_pages_do_not_move_on_is_the_stores_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A next page named by the token just sent would be asked for ever."""
    for name, value in {**ENV, "AWS_CONFIG_FILE": str(tmp_path / "c"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "s")}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    async with _store(lambda _: _page([], "same", echo=True)) as client:
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(client.list(S3Location("bucket", "m/"), max_keys=10), 10)


async def test_a_busy_store_is_busy_whatever_its_error_body_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A 503 whose body no XML parser reads (an unknown encoding) is still the store's
    transient refusal, not an error of another kind."""
    for name, value in {**ENV, "AWS_CONFIG_FILE": str(tmp_path / "c"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "s")}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    garbled = '<?xml version="1.0" encoding="x-nope"?><Error><Code>SlowDown</Code></Error>'
    async with _store(lambda _: web.Response(status=503, text=garbled)) as client:
        with pytest.raises(TransferError):
            await client.list(S3Location("bucket", "m/"), max_keys=10)
