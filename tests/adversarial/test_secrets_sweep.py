"""Promise 12 against failures: a download that fails through a signed URL leaks no secret.

Three places hand the fetcher URLs that carry credentials: the fleet tier and an ``s3://``
source (presigned S3 GETs: ``X-Amz-Credential`` names the access key, ``X-Amz-Signature``
signs, ``X-Amz-Security-Token`` is the session token itself) and the Hub's CDN (signed,
expiring redirects; the Hub itself gets a bearer token). Each source is made to fail in
every way the fetcher can fail (an error status until the retries or relocations run out,
an error body quoting the signed request, a redirect loop, a reset, a cut body, a stall, a
flipped byte); then every output a user or an operator can see is swept:
the exception and its whole ``__cause__``/``__context__`` chain, every log record, the job's
events (typed and as NDJSON), the daemon's job, status, cache and ``/metrics`` answers, and
the CLI's ``--json`` output and stderr, and the small files left in the cache (records,
resume records, the journal). None may hold a secret that the servers really
received (recorded by the fault gate and the fake hub, never guessed) in any encoding.

Each case also proves it failed the way it meant to (the fault fired; the error is the one
that fault gives; the tier fell back to the origin), so no case passes by not failing. S3
goes through ``faultgate.FaultGate`` in front of the session's SeaweedFS: verbatim for the
tier (SeaweedFS checks the signatures), and for the ``s3://`` source with a session token,
which the gate checks and strips (SeaweedFS refuses tokens it did not issue).

A new failure mode is one line of ``FAILURES``; a new source one ``Rig`` branch.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import sys
import traceback
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus, unquote, urlencode

import aiohttp
import pytest
from daemons import daemon_in_loop, short_tmp
from faultgate import FaultGate, GateFault, Identity
from helpers import fast_config

from shardsync.api import error_code, result_to_json
from shardsync.client import Client
from shardsync.config import Config, S3Config, TierConfig
from shardsync.errors import (
    AuthError,
    EntryNotFoundError,
    IntegrityError,
    ProtocolError,
    ShardsyncError,
    TransferError,
    redact,
)
from shardsync.events import JobDone, JobEvent, JobFailed
from shardsync.prefetch import prefetch
from shardsync.records import PrefetchResult
from shardsync.retry import RetryPolicy
from shardsync.testing import (
    Checkpoint,
    CutBody,
    FakeHub,
    FlipByte,
    Stall,
    Status,
    build_checkpoint,
)
from shardsync.testing.faults import Fault, Rule
from shardsync.testing.seaweedfs import S3Server
from shardsync.tier_claims import blob_key

REPO = "acme/secret-model"
S3_PREFIX = "models/secret/"
TIER_PREFIX = "fleet/"
HF_TOKEN = "hf_" + secrets.token_urlsafe(24)
# shaped like an STS token: base64, so "/", "+" and "=" that URLs must percent-encode
SESSION_TOKEN = "IQoJb3JpZ2luX2Vj" + base64.b64encode(secrets.token_bytes(45)).decode() + "+/="
READ_TIMEOUT = 0.4
HUB_STALL_S = 0.8  # the fake hub then drops the connection; the pump gives up before that
Outputs = dict[str, str]


@dataclass(frozen=True, slots=True)
class Failure:
    """One way a download fails: the fake hub's CDN knob (None: it has none), the gate's
    fault on S3 object GETs, and the errors a download from the origin may end in (the Hub
    CDN's ``HEAD`` meets a status fault too, so a 403 there is an ``AuthError``)."""

    name: str
    hub: Fault | None
    gate: GateFault
    raises: tuple[type[ShardsyncError], ...]


GIVES_UP = (TransferError,)  # retries, relocations or restarts ran out
FAILURES = (
    Failure("403", Status(403, times=None), GateFault("status", 403), (AuthError, *GIVES_UP)),
    Failure("403-echo", None, GateFault("status", 403, echo="text"), GIVES_UP),
    Failure("503-echo-json", None, GateFault("status", 503, echo="json"), GIVES_UP),
    Failure("redirect-loop", None, GateFault("redirect"), (ProtocolError,)),
    Failure("404", Status(404, times=None), GateFault("status", 404), (EntryNotFoundError,)),
    Failure("503", Status(503, times=None), GateFault("status", 503), GIVES_UP),
    Failure("reset", CutBody(at=0, times=None), GateFault("reset"), GIVES_UP),
    Failure("cut", CutBody(times=None), GateFault("cut"), GIVES_UP),
    Failure("stall", Stall(HUB_STALL_S, times=None), GateFault("stall"), GIVES_UP),
    Failure("flip", FlipByte(times=None), GateFault("flip"), (IntegrityError,)),
)
BY_NAME = {f.name: f for f in FAILURES}
SOURCES = ("hub", "hub-direct", "s3", "tier")
"""``hub``: shards over 1 MiB (HEAD, then Range requests read by the pump threads);
``hub-direct``: small shards (one GET whose CDN redirect the fetcher follows by hand, read
by aiohttp); ``s3``: an ``s3://`` prefix with a session token; ``tier``: the fleet tier
(the Hub behind it), whose failures cost a warning and the job goes on from the origin."""
CASES = [
    pytest.param(source, failure, id=f"{source}-{failure.name}")
    for source in SOURCES
    for failure in FAILURES
    if failure.hub is not None or source in ("s3", "tier")
]


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Two shards of ~1.2 MiB: more than SMALL_FILE, so each is located, then ranged."""
    return build_checkpoint(tmp_path_factory.mktemp("secrets"), total_bytes=2400 << 10, n_shards=2)


# ---------------------------------------------------------------------------------- rigs


@dataclass(eq=False)
class Rig:
    """One source of signed URLs, ready to fail: what to prefetch, how to configure it, and
    what the servers saw."""

    kind: str
    source: str
    hub: FakeHub
    gate: FaultGate | None
    server: S3Server | None
    bucket: str  # the S3 source's or the tier's ("" for the Hub alone)
    known: set[str]  # secrets the test handed out: keys, tokens
    rules: list[Rule] = field(default_factory=list)

    def config(self, cache_dir: Path) -> Config:
        base = fast_config(
            cache_dir,
            self.hub.endpoint,
            read_timeout=READ_TIMEOUT,
            max_verify_attempts=2,
            retry=RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01),
        )
        if self.gate is None or self.server is None:
            return base
        s3 = S3Config(endpoint=self.gate.endpoint, region=self.server.region, addressing="path")
        tier = TierConfig(url=f"s3://{self.bucket}/{TIER_PREFIX}")
        return replace(base, s3=s3, tier=tier if self.kind == "tier" else base.tier)

    def toml(self) -> str:
        """The same configuration for a ``shardsync`` process."""
        text = (
            f'[download]\nconnections_per_file = 4\nchunk_size = "256KiB"\n'
            f"read_timeout = {READ_TIMEOUT}\nmax_verify_attempts = 2\n"
            "[retry]\nmax_attempts = 3\nbase_delay = 0.001\nmax_delay = 0.01\n"
        )
        if self.gate is not None and self.server is not None:
            text += (
                f'[s3]\nendpoint = "{self.gate.endpoint}"\nregion = "{self.server.region}"\n'
                'addressing = "path"\n'
            )
        if self.kind == "tier":
            text += f'[tier]\nurl = "s3://{self.bucket}/{TIER_PREFIX}"\n'
        return text

    def inject(self, failure: Failure) -> None:
        if self.kind in ("s3", "tier"):
            assert self.gate is not None
            self.gate.fault = failure.gate
        else:
            assert failure.hub is not None
            self.rules.append(self.hub.faults.add(replace(failure.hub, path="*.safetensors")))

    def fired(self) -> int:
        if self.gate is not None:
            return self.gate.fired
        return sum(rule.fired for rule in self.rules)

    def secrets(self) -> set[str]:
        """What must never reach an output: the keys and tokens handed out, and every
        signed query, signature and token the servers received."""
        found = set(self.known)
        for record in self.hub.log:
            scheme, _, token = record.headers.get("Authorization", "").partition(" ")
            if scheme.lower() == "bearer" and token:
                found.add(token)
            if "Signature" in record.query:
                found.add(record.query["Signature"])
                found.add(urlencode(record.query))
        if self.gate is not None:
            found |= self.gate.secrets()
        return found


@contextlib.asynccontextmanager
async def rig(
    kind: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    large: Checkpoint,
    small: Checkpoint,
) -> AsyncIterator[Rig]:
    """The fake Hub (a private repo: it wants ``HF_TOKEN``), and for S3 kinds the gate in
    front of the session's SeaweedFS with the objects in place."""
    model = small if kind == "hub-direct" else large
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)  # the daemon and the CLI find it there
    async with contextlib.AsyncExitStack() as stack:
        hub = await stack.enter_async_context(FakeHub())
        hub.add_checkpoint(REPO, model, token=HF_TOKEN)
        if kind in ("hub", "hub-direct"):
            yield Rig(kind, REPO, hub, None, None, "", {HF_TOKEN})
            return
        server: S3Server = request.getfixturevalue("s3server")
        bucket: str = request.getfixturevalue("s3bucket")
        request.getfixturevalue("aws_env")
        known = {HF_TOKEN, server.access_key, server.secret_key}
        client = _store(server)
        identity = None
        if kind == "s3":
            for rel in model.files:
                data = model.path(rel).read_bytes()
                checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
                client.put_object(
                    Bucket=bucket, Key=S3_PREFIX + rel, Body=data, ChecksumSHA256=checksum
                )
            monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
            identity = Identity(server.access_key, server.secret_key, SESSION_TOKEN, server.region)
            known.add(SESSION_TOKEN)
        else:
            for shard in model.shards:
                data = model.path(shard).read_bytes()
                key = blob_key(TIER_PREFIX, hashlib.sha256(data).hexdigest())
                client.put_object(Bucket=bucket, Key=key, Body=data)
        gate = await stack.enter_async_context(FaultGate(server.endpoint, identity=identity))
        source = f"s3://{bucket}/{S3_PREFIX}" if kind == "s3" else REPO
        yield Rig(kind, source, hub, gate, server, bucket, known)


_CLIENTS: dict[str, Any] = {}


def _store(server: S3Server) -> Any:
    """A blocking client straight to SeaweedFS (no gate, no token), for setting up."""
    import botocore.session

    if server.endpoint not in _CLIENTS:
        session = botocore.session.get_session()
        _CLIENTS[server.endpoint] = session.create_client("s3", **server.client_kwargs())
    return _CLIENTS[server.endpoint]


# ---------------------------------------------------------------------------------- outputs


def exception_texts(exc: BaseException) -> list[str]:
    """The traceback a user sees, and str/repr/args of every exception in the chain."""
    texts = ["".join(traceback.format_exception(exc))]
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        texts += [str(current), repr(current), repr(current.args)]
        texts += [str(note) for note in getattr(current, "__notes__", ())]
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        if isinstance(current, BaseExceptionGroup):
            pending += current.exceptions
    return texts


_FORMAT = logging.Formatter("%(levelname)s %(name)s %(message)s")


def log_texts(records: Iterable[logging.LogRecord]) -> list[str]:
    """Each record as a handler writes it (traceback included), and its raw arguments."""
    texts: list[str] = []
    for record in records:
        texts += [_FORMAT.format(record), repr(record.msg), repr(record.args)]
        args = record.args if isinstance(record.args, tuple) else ()
        for arg in args:
            if isinstance(arg, BaseException):
                texts += exception_texts(arg)
    return texts


def needles(found: set[str]) -> set[str]:
    """Each secret as it may be written: raw, percent-decoded, percent-encoded."""
    out: set[str] = set()
    for value in found:
        for form in (value, unquote(value), quote(value, safe=""), quote_plus(value)):
            if len(form) >= 8:  # shorter is no secret (an empty Expires, a bare "=")
                out.add(form)
    return out


def assert_no_secret(outputs: Outputs, found: set[str]) -> None:
    assert found, "no secret was recorded: the sweep would prove nothing"
    every = needles(found)
    leaks = sorted(
        f"{where}: ...{text[max(text.find(n) - 80, 0) : text.find(n) + len(n) + 20]}..."
        for where, text in outputs.items()
        for n in every
        if n in text
    )
    assert not leaks, "secrets reached an output:\n" + "\n".join(leaks)


def add_cache_files(outputs: Outputs, root: Path) -> None:
    """Every small file a run leaves under its cache (records, resume records, the journal,
    the access log, locks), which other users of a shared cache may read."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.stat().st_size <= 64 << 10:
            outputs[f"cache file {path.relative_to(root)}"] = path.read_bytes().decode(
                "utf-8", "replace"
            )


def add_exception(outputs: Outputs, where: str, exc: BaseException) -> None:
    for i, text in enumerate(exception_texts(exc)):
        outputs[f"{where} [{i}]"] = text


async def _raw(socket_path: Path, method: str, path: str, body: object = None) -> str:
    connector = aiohttp.UnixConnector(path=str(socket_path))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.request(method, "http://daemon" + path, json=body) as resp,
    ):
        return await resp.text()


async def run_in_process(rig: Rig, cache_dir: Path, outputs: Outputs) -> PrefetchResult | None:
    """``shardsync.prefetch`` in this process: its result, or its exception and chain."""
    try:
        result = await prefetch(rig.source, rig.config(cache_dir))
    except ShardsyncError as exc:
        add_exception(outputs, "prefetch raised", exc)
        outputs["prefetch error code"] = error_code(exc)
        return None
    outputs["prefetch result json"] = json.dumps(result_to_json(result))
    outputs["prefetch result repr"] = repr(result)
    return result


async def run_in_daemon(rig: Rig, cache_dir: Path, outputs: Outputs) -> list[JobEvent]:
    """The same job in a daemon (in this loop): its events typed and on the wire, the
    client's error, and the daemon's job, jobs, status, cache and metrics answers."""
    with short_tmp() as tmp:
        sock = tmp / "shardsync" / "d.sock"
        async with daemon_in_loop(rig.config(cache_dir), sock):
            submitted = await _raw(sock, "POST", "/v1/jobs", {"source": rig.source})
            outputs["daemon submit"] = submitted
            job_id = json.loads(submitted)["id"]
            async with Client(socket=sock, fallback="error") as client:
                handle = await client.job(job_id)
                events = [event async for event in handle.events()]
                try:
                    await handle.wait()
                except ShardsyncError as exc:
                    add_exception(outputs, "client raised", exc)
            outputs["events typed"] = "\n".join(repr(e) for e in events)
            outputs["events json"] = "\n".join(json.dumps(e.to_json()) for e in events)
            for path in (
                f"/v1/jobs/{job_id}/events",
                f"/v1/jobs/{job_id}",
                "/v1/jobs",
                "/v1/status",
                "/v1/cache",
                "/metrics",
            ):
                outputs[f"daemon GET {path}"] = await _raw(sock, "GET", path)
    return events


async def run_cli(rig: Rig, workdir: Path, outputs: Outputs) -> tuple[int, str, str]:
    """``shardsync prefetch SOURCE --json`` as a process: exit code, stdout, stderr."""
    conf = workdir / "shardsync.toml"
    conf.write_text(rig.toml())
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shardsync.cli", "--config", str(conf), "prefetch", rig.source,
        "--endpoint", rig.hub.endpoint, "--cache-dir", str(workdir / "cache"), "--no-daemon",
        "--json", env=dict(os.environ), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(120):
        out, err = await proc.communicate()
    outputs["cli stdout"], outputs["cli stderr"] = out.decode(), err.decode()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# ---------------------------------------------------------------------------------- checks


def assert_failed_as_meant(
    rig: Rig, failure: Failure, outputs: Outputs, result: PrefetchResult | None
) -> None:
    """The fault fired; from an origin the download failed with the error it gives; the
    tier was given up on (counted) and the job went on from the Hub."""
    assert rig.fired() > 0, f"the {failure.name} fault never fired: the case proves nothing"
    assert rig.gate is None or not rig.gate.errors, rig.gate.errors
    if rig.kind == "tier":
        assert result is not None, outputs.get("prefetch raised [1]")
        assert result.tier is not None
        counted = result.tier.corrupt_objects if failure.name == "flip" else result.tier.errors
        assert counted >= 1, result.tier
        assert result.tier.hits == 0
        assert {f.source for f in result.files if f.path.endswith(".safetensors")} == {"network"}
        return
    assert result is None, f"{rig.kind} {failure.name}: the download succeeded anyway"
    codes = {error_code(cls("")) for cls in failure.raises}
    assert outputs["prefetch error code"] in codes, outputs["prefetch raised [1]"]
    if rig.kind == "s3":  # the URLs that failed carried the session token, signed right
        faulted = [s for s in rig.gate.seen if s.fault != "none"] if rig.gate else []
        assert faulted and all(s.token == SESSION_TOKEN and s.verified for s in faulted)


def assert_daemon_agrees(rig: Rig, failure: Failure, events: list[JobEvent]) -> None:
    last = events[-1]
    if rig.kind == "tier":
        assert isinstance(last, JobDone), last
        return
    assert isinstance(last, JobFailed), last
    assert last.error.code in {error_code(cls("")) for cls in failure.raises}, last.error


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("kind", "failure"), CASES)
async def test_a_failing_signed_url_leaks_no_secret(
    kind: str,
    failure: Failure,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    large: Checkpoint,
    checkpoint: Checkpoint,
    tmp_path: Path,
) -> None:
    caplog.set_level(logging.DEBUG, logger="shardsync")
    outputs: Outputs = {}
    async with rig(kind, request, monkeypatch, large, checkpoint) as r:
        r.inject(failure)
        result = await run_in_process(r, tmp_path / "in-process", outputs)
        assert_failed_as_meant(r, failure, outputs, result)
        events = await run_in_daemon(r, tmp_path / "daemon", outputs)
        assert_daemon_agrees(r, failure, events)
        add_cache_files(outputs, tmp_path)
        for i, text in enumerate(log_texts(caplog.records)):
            outputs[f"log {i}"] = text
        assert_no_secret(outputs, r.secrets())


@pytest.mark.parametrize(
    ("kind", "failure"),
    [("hub", BY_NAME["403"]), ("s3", BY_NAME["403-echo"]), ("tier", BY_NAME["503"])],
    ids=["hub-403", "s3-403-echo", "tier-503"],
)
async def test_the_cli_says_no_secret_in_json_or_on_stderr(
    kind: str,
    failure: Failure,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    large: Checkpoint,
    checkpoint: Checkpoint,
    tmp_path: Path,
) -> None:
    outputs: Outputs = {}
    async with rig(kind, request, monkeypatch, large, checkpoint) as r:
        r.inject(failure)
        code, out, err = await run_cli(r, tmp_path, outputs)
        add_cache_files(outputs, tmp_path / "cache")
        assert r.fired() > 0, f"the {failure.name} fault never fired"
        if kind == "tier":
            assert code == 0, err
            report = json.loads(out)
            assert report["tier"]["errors"] >= 1 and report["tier"]["hits"] == 0, report
        else:
            assert code != 0 and out == "", (code, out)
            assert err.splitlines()[-1].startswith("shardsync: error:"), err
        assert_no_secret(outputs, r.secrets())


@pytest.mark.parametrize("kind", SOURCES)
async def test_a_clean_download_through_each_rig_is_real(
    kind: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    large: Checkpoint,
    checkpoint: Checkpoint,
    tmp_path: Path,
) -> None:
    """Without a fault each source works, through signed URLs the servers accepted (the
    sweep above is not passing because nothing reaches the servers), and its result and
    logs are clean too."""
    caplog.set_level(logging.DEBUG, logger="shardsync")
    outputs: Outputs = {}
    async with rig(kind, request, monkeypatch, large, checkpoint) as r:
        result = await run_in_process(r, tmp_path / "c", outputs)
        add_cache_files(outputs, tmp_path / "c")
        assert result is not None, outputs.get("prefetch raised [1]")
        shards = {f.source for f in result.files if f.path.endswith(".safetensors")}
        assert shards == {"tier" if kind == "tier" else "network"}
        if r.gate is not None:
            gets = [s for s in r.gate.seen if s.presigned and s.method == "GET"]
            assert gets and all(s.status in (200, 206) for s in gets)
            if kind == "s3":  # the token reached the gate in every presigned URL, and verified
                assert all(s.token == SESSION_TOKEN and s.verified for s in gets)
        else:
            cdn = [rec for rec in r.hub.log if rec.server == "cdn" and rec.method == "GET"]
            assert cdn and all("Signature" in rec.query for rec in cdn)
        for i, text in enumerate(log_texts(caplog.records)):
            outputs[f"log {i}"] = text
        assert_no_secret(outputs, r.secrets())


@pytest.mark.parametrize(
    ("text", "kept", "gone"),
    [
        ("403 refused: GET /b/k?X-Amz-Credential=AK/x&X-Amz-Signature=f00d", "GET /b/k?", "f00d"),
        (
            "see https://u:pw@cdn.example:8443/a/b?Signature=s1gn#frag now",
            "cdn.example:8443/a/b",
            "s1gn",
        ),
        (
            "Credential=AKXYZ/20260101/us-east-1/s3/aws4_request, Signature=beef",
            "Credential=",
            "AKXYZ",
        ),
        ('{"x-amz-security-token": "t"} X-Amz-Security-Token=T0KEN/+= tail', "tail", "T0KEN"),
        ("Authorization: Bearer hf_abcdefgh12345", "Authorization: Bearer", "hf_abcdefgh"),
        ("https://u:pw@host/p", "https://host/p", "pw"),
        # a password with '/', '?' or '#' unencoded is no userinfo to urlsplit
        ("via http://alice:Tr0ub4dor/x?y@proxy.corp:3128 now", "http://proxy.corp:3128", "Tr0ub"),
        ("https://u:pa#ss@mirror.example/h", "https://mirror.example/h", "pa#ss"),
        # a proxy's error page quoting the request it refused
        ("GET / | Proxy-Authorization: Basic YWxpY2U6aHVudGVyMg==", "Basic", "YWxpY2U6"),
        ("Authorization: NTLM TlRMTVNTUAABAAAAB4IIog==\r\nHost: h", "NTLM", "TlRMTVNT"),
        ('{"Proxy-Authorization": "Basic YWxpY2U6VHIwdWI0ZG9y"}', "Basic", "YWxpY2U6"),
        ("<td>Proxy-Authorization</td><td>Basic dXNlcjpwYXNz</td>", "Basic", "dXNlcjpw"),
        # an '@' in a path or a query is no userinfo: the host stays
        ("GET https://cdn.example.com/m/llama@v2/x failed", "cdn.example.com/m/llama@v2/x", "?"),
        (
            "403 from https://f.example.com/get?owner=bob@corp.com",
            "https://f.example.com/get",
            "bob",
        ),
    ],
)
def test_redact_keeps_the_words_and_drops_the_credentials(text: str, kept: str, gone: str) -> None:
    redacted = redact(text)
    assert kept in redacted and gone not in redacted, redacted


@pytest.mark.parametrize(
    "text",
    [
        "HTTP 404: Not Found",
        "AccessDenied: the URL signature does not match",
        "why? no",
        "authorization: denied by policy",
        "HTTP 401: Basic authentication required",
        'Basic realm="corp"',
    ],
)
def test_redact_leaves_plain_messages_alone(text: str) -> None:
    assert redact(text) == text


async def test_the_gate_refuses_a_bad_signature_or_token(s3server: S3Server, s3bucket: str) -> None:
    """The gate really checks what it stands in for: a URL signed with another key, or
    with another token, is refused like S3 would refuse it."""
    identity = Identity(s3server.access_key, s3server.secret_key, SESSION_TOKEN, s3server.region)
    _store(s3server).put_object(Bucket=s3bucket, Key="k", Body=b"data")
    async with FaultGate(s3server.endpoint, identity=identity) as gate:
        import botocore.session
        from botocore.config import Config as BotoConfig

        def presign(secret: str, token: str) -> str:
            client = botocore.session.get_session().create_client(
                "s3",
                endpoint_url=gate.endpoint,
                aws_access_key_id=s3server.access_key,
                aws_secret_access_key=secret,
                aws_session_token=token,
                region_name=s3server.region,
                config=BotoConfig(signature_version="s3v4", s3={"addressing_style": "path"}),
            )
            params = {"Bucket": s3bucket, "Key": "k"}
            return str(client.generate_presigned_url("get_object", Params=params, ExpiresIn=60))

        async with aiohttp.ClientSession() as session:
            answers = []
            for secret, token in (
                (s3server.secret_key, SESSION_TOKEN),
                ("wrong" + s3server.secret_key, SESSION_TOKEN),
                (s3server.secret_key, SESSION_TOKEN + "x"),
            ):
                async with session.get(presign(secret, token)) as resp:
                    answers.append((resp.status, await resp.read()))
    assert answers[0] == (200, b"data")
    assert answers[1][0] == 403 and b"SignatureDoesNotMatch" in answers[1][1]
    assert answers[2][0] == 403 and b"InvalidToken" in answers[2][1]
