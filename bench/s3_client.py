"""S3 client benchmark: which client should move a checkpoint's bytes out of S3?

    python bench/s3_client.py [--size 1GB] [--files 4] [--rounds 3]
                              [--json bench/results/s3_client.json]
                              [--variants shardsync,aiobotocore,...] [--work-dir DIR]

Starts its own SeaweedFS on loopback (``shardsync.testing.seaweedfs``), uploads a
random safetensors checkpoint (``--files`` shards of random bytes, each with a
``ChecksumSHA256``, plus ``model.safetensors.index.json``) under ``s3://BUCKET/bench/model/``,
then downloads every object of that prefix with each variant, each in a fresh child process:

- ``shardsync``: ``shardsync.prefetch.prefetch("s3://BUCKET/bench/model/", config)``:
  aiobotocore lists, HEADs (the store's SHA-256) and presigns; shardsync's fetcher moves the
  bytes (8 Range GETs of 16 MiB per file, pwritev, streaming sha256 + xxh3, fsync, publish);
  ``shardsync-1conn`` is the same with one connection per file, to compare like with like.
- ``aiobotocore``: one ``get_object`` per file, all files at once, the body streamed to disk
  in 1 MiB chunks with sha256 computed while streaming; ``aiobotocore-nohash`` is the same
  without the hash.
- ``aiobotocore-ranged``: per file 8 concurrent ``get_object(Range=...)`` of 16 MiB each,
  written with ``os.pwrite``, sha256 in a second pass over the files (hand-written parallel).
- ``boto3``: ``download_file`` per file (s3transfer: 10 threads, 8 MiB parts), then sha256.
- ``obstore``: ``obstore.get_range_async`` (Rust object_store), 8 concurrent 16 MiB ranges
  per file, ``os.pwrite``, then sha256.

Every variant lists the prefix itself and compares each file's sha256 with the expected one
(shardsync with the store's checksum, the others with the digests of the upload), except
``aiobotocore-nohash``. The children import their libraries before their clock starts; the
table shows that timed section (median and range of the rounds), its CPU seconds per GB
(``getrusage`` of the child itself), the whole child's CPU (``wait4``), its peak RSS
(``VmHWM``) and the CPU the SeaweedFS process burned meanwhile (``/proc/PID/stat``). Rounds
interleave the variants (the order rotates each round) so a slow moment hits all alike.
After each run (not timed) the parent hashes every delivered file against the upload, then
deletes them.

By default SeaweedFS's data and the downloads live on a tmpfs (``/dev/shm``) so that no disk
decides the result; ``--work-dir`` moves both. The server shares the machine's cores with
the client: on a small box it is the largest CPU consumer and caps every variant alike, so
absolute MB/s are machine-bound and the CPU columns matter more than the rates. boto3 and
obstore come with the ``bench`` extra; a variant whose library is missing is skipped with a
note. The exit status is 1 only if a variant failed or delivered wrong bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from common import (  # bench/common.py, beside this script
    RESULTS,
    cpu_model,
    git_revision,
    package_version,
    server_cpu_seconds,
    size_arg,
)
from common import weed_version as seaweedfs_version

from shardsync.testing.seaweedfs import S3Server, run_seaweedfs

MiB = 1024 * 1024
PREFIX = "bench/model/"
INDEX = "model.safetensors.index.json"
RANGE_CHUNK = 16 * MiB
RANGES_PER_FILE = 8
STREAM_CHUNK = 1 * MiB
RUN_TIMEOUT_S = 1800.0
VARIANTS = (
    "shardsync",
    "shardsync-1conn",
    "aiobotocore",
    "aiobotocore-nohash",
    "aiobotocore-ranged",
    "boto3",
    "obstore",
)
LABELS = {
    "shardsync": "(a) shardsync prefetch",
    "shardsync-1conn": "(a') same, 1 conn/file",
    "aiobotocore": "(b) aiobotocore get_object",
    "aiobotocore-nohash": "(b') same, no sha256",
    "aiobotocore-ranged": "(c) aiobotocore 8x16MiB",
    "boto3": "(d) boto3 download_file",
    "obstore": "(e) obstore 8x16MiB",
}
NEEDS = {"boto3": "boto3", "obstore": "obstore"}
"""Variant -> module it needs beyond shardsync's own dependencies."""
SHA256 = {
    "shardsync": "streaming, vs store",
    "shardsync-1conn": "streaming, vs store",
    "aiobotocore": "streaming",
    "aiobotocore-nohash": "no",
    "aiobotocore-ranged": "2nd pass",
    "boto3": "2nd pass",
    "obstore": "2nd pass",
}
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Spec:
    """What a child needs: where the objects are and what they must hash to."""

    endpoint: str
    region: str
    bucket: str
    prefix: str
    files: Mapping[str, tuple[int, str]]
    """Path under the prefix -> (size, sha256)."""

    @property
    def total_size(self) -> int:
        return sum(size for size, _ in self.files.values())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        raw = json.loads(text)
        files = {path: (int(s), str(h)) for path, (s, h) in raw.pop("files").items()}
        return cls(files=files, **raw)


@dataclass(frozen=True, slots=True)
class ChildResult:
    """What a child reports about its timed section."""

    seconds: float
    cpu_seconds: float
    root: str
    """The directory holding the delivered files, by their path under the prefix."""
    sha256_checked: bool
    """The variant itself compared every file's sha256 (and all matched)."""
    peak_rss_bytes: int
    """VmHWM at the end: the peak of this process's own memory (``ru_maxrss`` would carry
    the parent's peak over fork + exec)."""
    note: str = ""


@dataclass(frozen=True, slots=True)
class Run:
    """One variant in one round, as the parent saw it."""

    variant: str
    round: int
    seconds: float
    """The child's timed section (imports done before it)."""
    cpu_seconds: float
    """The child's own CPU in the timed section (user + system, every thread)."""
    process_seconds: float
    process_cpu_seconds: float
    peak_rss_bytes: int
    server_cpu_seconds: float
    bytes: int
    sha256_checked: bool
    ok: bool
    error: str | None


@dataclass(frozen=True, slots=True)
class Row:
    """One variant over every round; None where a run failed."""

    variant: str
    seconds: float | None
    seconds_min: float | None
    seconds_max: float | None
    mb_per_s: float | None
    cpu_s_per_gb: float | None
    process_cpu_s_per_gb: float | None
    server_cpu_s_per_gb: float | None
    peak_rss_mb: float | None
    sha256: str
    ok: bool
    time_vs_shardsync: float | None
    cpu_vs_shardsync: float | None


@dataclass(frozen=True, slots=True)
class Settings:
    size: int
    files: int
    rounds: int
    variants: tuple[str, ...]
    work_dir: Path
    json_path: Path


# ---------------------------------------------------------------------------------------------
# Command line


def _variants(text: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
    unknown = [item for item in items if item not in VARIANTS]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"choose from {','.join(VARIANTS)}, got {text!r}")
    return items


def _default_work_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        description="Time S3 clients downloading the same objects from a local SeaweedFS."
    )
    parser.add_argument("--size", type=size_arg, default="1GB", help="total bytes (default 1GB)")
    parser.add_argument("--files", type=int, default=4, help="number of shards (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians count (default 3)")
    parser.add_argument(
        "--json",
        type=Path,
        dest="json_path",
        default=RESULTS / "s3_client.json",
        help="the results (default bench/results/s3_client.json)",
    )
    parser.add_argument(
        "--variants", type=_variants, default=VARIANTS, help=",".join(VARIANTS) + " (default all)"
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=_default_work_dir(),
        help="SeaweedFS data and downloads (default /dev/shm, else the temp dir)",
    )
    args = parser.parse_args(argv)
    if args.files < 1 or args.rounds < 1 or args.size < args.files * MiB:
        parser.error("--files and --rounds must be positive, --size at least 1 MiB per file")
    return Settings(
        size=args.size,
        files=args.files,
        rounds=args.rounds,
        variants=args.variants,
        work_dir=args.work_dir,
        json_path=args.json_path,
    )


def available(variants: Sequence[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The variants whose libraries import, and a note for each one skipped."""
    kept, skipped = [], {}
    for variant in variants:
        module = NEEDS.get(variant)
        if module is not None and find_spec(module) is None:
            skipped[variant] = f"{module} is not installed (pip install -e '.[bench]')"
            continue
        kept.append(variant)
    return tuple(kept), skipped


# ---------------------------------------------------------------------------------------------
# The objects


def shard_bytes(size: int, tensor: str) -> bytes:
    """A valid safetensors file of exactly ``size`` bytes: one U8 tensor of random bytes."""
    header = b""
    for _ in range(3):  # the header's length depends on the payload's, which depends on it
        payload = size - 8 - len(header)
        meta = {tensor: {"dtype": "U8", "shape": [payload], "data_offsets": [0, payload]}}
        text = json.dumps(meta, separators=(",", ":")).encode()
        header = text + b" " * (-len(text) % 8)
    payload = size - 8 - len(header)
    body = bytearray(len(header).to_bytes(8, "little") + header)
    for start in range(0, payload, 64 * MiB):
        body += os.urandom(min(64 * MiB, payload - start))
    return bytes(body)


def upload(server: S3Server, settings: Settings) -> tuple[Spec, bool]:
    """Put the checkpoint into a fresh bucket, every object with its ChecksumSHA256.

    Returns the spec and whether the store gives the SHA-256 back on HEAD (else shardsync
    would trust the bytes on first use instead of verifying them).
    """
    import botocore.session

    client = botocore.session.get_session().create_client("s3", **server.client_kwargs())
    bucket = server.new_bucket("bench")
    names = [
        f"model-{i:05d}-of-{settings.files:05d}.safetensors" for i in range(1, 1 + settings.files)
    ]
    sizes = [settings.size // settings.files] * settings.files
    sizes[-1] += settings.size - sum(sizes)
    files: dict[str, tuple[int, str]] = {}
    weight_map = {}
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        data = shard_bytes(size, f"w{i}")
        digest = hashlib.sha256(data).digest()
        _put(client, bucket, PREFIX + name, data, digest)
        files[name] = (size, digest.hex())
        weight_map[f"w{i}"] = name
        log(f"uploaded {name}: {size / 1e6:.0f} MB")
        del data
    index = json.dumps({"metadata": {"total_size": settings.size}, "weight_map": weight_map})
    data = index.encode()
    digest = hashlib.sha256(data).digest()
    _put(client, bucket, PREFIX + INDEX, data, digest)
    files[INDEX] = (len(data), digest.hex())
    head = client.head_object(Bucket=bucket, Key=PREFIX + names[0], ChecksumMode="ENABLED")
    store_sha256 = (
        head.get("ChecksumSHA256") == base64.b64encode(bytes.fromhex(files[names[0]][1])).decode()
    )
    client.close()
    spec = Spec(server.endpoint, server.region, bucket, PREFIX, files)
    return spec, store_sha256


def _put(client: Any, bucket: str, key: str, data: bytes, digest: bytes) -> None:
    checksum = base64.b64encode(digest).decode()
    client.put_object(Bucket=bucket, Key=key, Body=data, ChecksumSHA256=checksum)


# ---------------------------------------------------------------------------------------------
# The variants, each run inside a child process (``--child VARIANT``)


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _second_pass(spec: Spec, root: Path) -> bool:
    """What a hand-written client does after downloading: hash each file, compare."""
    return all(_sha256_file(root / path) == digest for path, (_, digest) in spec.files.items())


def _aio_client_config(pool: int) -> Any:
    from aiobotocore.config import AioConfig

    # Checksums exactly as the variant computes them: botocore's own response validation
    # ("when_supported") would add a CRC/sha256 pass on top of full-object GETs only.
    return AioConfig(
        s3={"addressing_style": "path"},
        max_pool_connections=pool,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


async def _aio_list(client: Any, spec: Spec) -> list[tuple[str, int]]:
    found = []
    async for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=spec.bucket, Prefix=spec.prefix
    ):
        found += [(o["Key"], int(o["Size"])) for o in page.get("Contents", ())]
    return found


def child_shardsync(
    spec: Spec, dest: Path, *, connections: int | None = None
) -> Callable[[], tuple[Path, bool, str]]:
    from shardsync.config import Config, S3Config
    from shardsync.prefetch import prefetch
    from shardsync.records import FetchConfig

    fetch = FetchConfig() if connections is None else FetchConfig(connections_per_file=connections)
    config = Config(
        cache_dir=dest / "cache",
        fetch=fetch,
        s3=S3Config(endpoint=spec.endpoint, region=spec.region, addressing="path"),
    )

    def run() -> tuple[Path, bool, str]:
        result = asyncio.run(prefetch(f"s3://{spec.bucket}/{spec.prefix}", config))
        how = sorted({f.verified for f in result.files})
        checked = how == ["sha256"] and len(result.files) == len(spec.files)
        return result.snapshot_path, checked, "verified: " + ",".join(how)

    return run


def child_aiobotocore(spec: Spec, dest: Path, *, hash_it: bool) -> Callable[[], Any]:
    from aiobotocore.session import get_session

    async def one(client: Any, key: str) -> bool:
        path = dest / key[len(spec.prefix) :]
        path.parent.mkdir(parents=True, exist_ok=True)
        answer = await client.get_object(Bucket=spec.bucket, Key=key)
        hasher = hashlib.sha256() if hash_it else None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            async with answer["Body"] as body:
                async for chunk in body.iter_chunks(STREAM_CHUNK):
                    os.write(fd, chunk)
                    if hasher is not None:
                        hasher.update(chunk)
        finally:
            os.close(fd)
        return hasher is None or hasher.hexdigest() == spec.files[key[len(spec.prefix) :]][1]

    async def main() -> bool:
        async with get_session().create_client(
            "s3", endpoint_url=spec.endpoint, region_name=spec.region, config=_aio_client_config(64)
        ) as client:
            keys = [key for key, _ in await _aio_list(client, spec)]
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(client, key)) for key in keys]
        return all(t.result() for t in tasks)

    def run() -> tuple[Path, bool, str]:
        matched = asyncio.run(main())
        return dest, hash_it and matched, "" if hash_it else "no hash"

    return run


def child_aiobotocore_ranged(spec: Spec, dest: Path) -> Callable[[], Any]:
    from aiobotocore.session import get_session

    async def one(client: Any, key: str, size: int) -> None:
        path = dest / key[len(spec.prefix) :]
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        limit = asyncio.Semaphore(RANGES_PER_FILE)

        async def part(start: int) -> None:
            end = min(start + RANGE_CHUNK, size) - 1
            async with limit:
                answer = await client.get_object(
                    Bucket=spec.bucket, Key=key, Range=f"bytes={start}-{end}"
                )
                async with answer["Body"] as body:
                    data = await body.read()
            if len(data) != end - start + 1:
                raise RuntimeError(f"{key}: {len(data)} bytes for bytes={start}-{end}")
            os.pwrite(fd, data, start)

        try:
            async with asyncio.TaskGroup() as tg:
                for start in range(0, size, RANGE_CHUNK):
                    tg.create_task(part(start))
        finally:
            os.close(fd)

    async def main() -> None:
        async with get_session().create_client(
            "s3", endpoint_url=spec.endpoint, region_name=spec.region, config=_aio_client_config(64)
        ) as client:
            objects = await _aio_list(client, spec)
            async with asyncio.TaskGroup() as tg:
                for key, size in objects:
                    tg.create_task(one(client, key, size))

    def run() -> tuple[Path, bool, str]:
        asyncio.run(main())
        return dest, _second_pass(spec, dest), ""

    return run


def child_boto3(spec: Spec, dest: Path) -> Callable[[], Any]:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=spec.endpoint,
        region_name=spec.region,
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )

    def run() -> tuple[Path, bool, str]:
        keys = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=spec.bucket, Prefix=spec.prefix
        ):
            keys += [o["Key"] for o in page.get("Contents", ())]
        for key in keys:  # s3transfer parallelizes inside each file (10 threads)
            path = dest / key[len(spec.prefix) :]
            path.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(spec.bucket, key, str(path))
        return dest, _second_pass(spec, dest), ""

    return run


def child_obstore(spec: Spec, dest: Path) -> Callable[[], Any]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        spec.bucket,
        endpoint=spec.endpoint,
        region=spec.region,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, "timeout": "600s"},
    )

    async def one(key: str, size: int) -> None:
        path = dest / key[len(spec.prefix) :]
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        limit = asyncio.Semaphore(RANGES_PER_FILE)

        async def part(start: int) -> None:
            end = min(start + RANGE_CHUNK, size)
            async with limit:
                data = await obstore.get_range_async(store, key, start=start, end=end)
            view = memoryview(data)
            if len(view) != end - start:
                raise RuntimeError(f"{key}: {len(view)} bytes for [{start}, {end})")
            os.pwrite(fd, view, start)

        try:
            async with asyncio.TaskGroup() as tg:
                for start in range(0, size, RANGE_CHUNK):
                    tg.create_task(part(start))
        finally:
            os.close(fd)

    async def main() -> None:
        listed = await obstore.list(store, prefix=spec.prefix).collect_async()
        async with asyncio.TaskGroup() as tg:
            for meta in listed:
                tg.create_task(one(meta["path"], int(meta["size"])))

    def run() -> tuple[Path, bool, str]:
        asyncio.run(main())
        return dest, _second_pass(spec, dest), ""

    return run


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_main(variant: str, spec_path: Path, dest: Path, result_path: Path) -> int:
    """Import the variant's libraries, then time only its download (and its own check)."""
    spec = Spec.from_json(spec_path.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    factories: dict[str, Callable[[], Callable[[], tuple[Path, bool, str]]]] = {
        "shardsync": lambda: child_shardsync(spec, dest),
        "shardsync-1conn": lambda: child_shardsync(spec, dest, connections=1),
        "aiobotocore": lambda: child_aiobotocore(spec, dest, hash_it=True),
        "aiobotocore-nohash": lambda: child_aiobotocore(spec, dest, hash_it=False),
        "aiobotocore-ranged": lambda: child_aiobotocore_ranged(spec, dest),
        "boto3": lambda: child_boto3(spec, dest),
        "obstore": lambda: child_obstore(spec, dest),
    }
    run = factories[variant]()
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    root, checked, note = run()
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = ChildResult(seconds, cpu, str(root), checked, peak_rss(), note)
    result_path.write_text(json.dumps(dataclasses.asdict(result)))
    return 0


# ---------------------------------------------------------------------------------------------
# Running and checking (the parent)


def child_env(server: S3Server, home: Path) -> dict[str, str]:
    """Credentials from the environment only: no config files, no instance metadata."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _PROXY_VARS and not key.startswith(("AWS_", "SHARDSYNC_"))
    }
    env.update(
        AWS_ACCESS_KEY_ID=server.access_key,
        AWS_SECRET_ACCESS_KEY=server.secret_key,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(home / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(home / "no-aws-credentials"),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    return env


def run_once(
    variant: str, round_no: int, server: S3Server, spec_path: Path, spec: Spec, scratch: Path
) -> Run:
    """One child in a fresh directory; its rusage by wait4; its files checked, then deleted."""
    work = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=scratch))
    result_path = work / "result.json"
    log_path = work / "child.log"
    dest = work / "out"
    argv = [sys.executable, __file__, "--child", variant, "--spec", str(spec_path)]
    argv += ["--dest", str(dest), "--result", str(result_path)]
    try:
        server_before = server_cpu_seconds(server.pid)
        started = time.perf_counter()
        with log_path.open("wb") as child_log:
            proc = subprocess.Popen(
                argv, env=child_env(server, work), stdout=child_log, stderr=subprocess.STDOUT
            )
            timer = threading.Timer(RUN_TIMEOUT_S, proc.kill)
            timer.start()
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            finally:
                timer.cancel()
            proc.returncode = os.waitstatus_to_exitcode(status)
        process_seconds = time.perf_counter() - started
        server_cpu = server_cpu_seconds(server.pid) - server_before
        process_cpu = usage.ru_utime + usage.ru_stime
        rss = usage.ru_maxrss * 1024  # at least the parent's peak: replaced by the child's

        def failed(error: str) -> Run:
            return Run(
                variant=variant,
                round=round_no,
                seconds=process_seconds,
                cpu_seconds=process_cpu,
                process_seconds=process_seconds,
                process_cpu_seconds=process_cpu,
                peak_rss_bytes=rss,
                server_cpu_seconds=server_cpu,
                bytes=0,
                sha256_checked=False,
                ok=False,
                error=error,
            )

        if proc.returncode != 0 or not result_path.is_file():
            tail = log_path.read_bytes()[-2000:].decode(errors="replace").strip()
            return failed(f"exit {proc.returncode}: {tail}")
        child = ChildResult(**json.loads(result_path.read_text()))
        problems = check_delivery(Path(child.root), spec)
        return Run(
            variant=variant,
            round=round_no,
            seconds=child.seconds,
            cpu_seconds=child.cpu_seconds,
            process_seconds=process_seconds,
            process_cpu_seconds=process_cpu,
            peak_rss_bytes=child.peak_rss_bytes,
            server_cpu_seconds=server_cpu,
            bytes=spec.total_size,
            sha256_checked=child.sha256_checked,
            ok=not problems,
            error="; ".join(problems) or None,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_delivery(root: Path, spec: Spec) -> list[str]:
    """Every uploaded object must be there with the uploaded sha256 (followed symlinks)."""
    problems = []
    for path, (size, digest) in sorted(spec.files.items()):
        target = root / path
        if not target.is_file():
            problems.append(f"missing {path}")
        elif target.stat().st_size != size or _sha256_file(target) != digest:
            problems.append(f"{path}: bytes differ from the upload")
    return problems


def run_all(settings: Settings, variants: Sequence[str]) -> tuple[Spec, bool, list[Run], str]:
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="shardsync-s3bench-", dir=settings.work_dir))
    runs: list[Run] = []
    try:
        with run_seaweedfs(scratch / "weed", timeout=60) as server:
            log(f"SeaweedFS at {server.endpoint} (data in {scratch / 'weed'})")
            spec, store_sha256 = upload(server, settings)
            if not store_sha256:
                log("the store does not return ChecksumSHA256: shardsync will say tofu")
            spec_path = scratch / "spec.json"
            spec_path.write_text(spec.to_json())
            runs_dir = scratch / "runs"
            runs_dir.mkdir()
            for round_no in range(settings.rounds):
                shift = round_no % len(variants)
                for variant in (*variants[shift:], *variants[:shift]):
                    run = run_once(variant, round_no, server, spec_path, spec, runs_dir)
                    state = "ok" if run.ok else f"FAILED: {run.error}"
                    log(
                        f"round {round_no + 1} {LABELS[variant]}: {run.seconds:.2f} s, "
                        f"cpu {run.cpu_seconds:.2f} s, server cpu {run.server_cpu_seconds:.2f}"
                        f" s, rss {run.peak_rss_bytes / 1e6:.0f} MB, {state}"
                    )
                    runs.append(run)
            weed_version = seaweedfs_version()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return spec, store_sha256, runs, weed_version


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(runs: Sequence[Run], variants: Sequence[str]) -> list[Row]:
    medians: dict[str, dict[str, float] | None] = {}
    for variant in variants:
        mine = [r for r in runs if r.variant == variant]
        if not mine or not all(r.ok for r in mine):
            medians[variant] = None
            continue
        gb = mine[0].bytes / 1e9
        medians[variant] = {
            "seconds": statistics.median(r.seconds for r in mine),
            "min": min(r.seconds for r in mine),
            "max": max(r.seconds for r in mine),
            "bytes": mine[0].bytes,
            "cpu": statistics.median(r.cpu_seconds for r in mine) / gb,
            "process_cpu": statistics.median(r.process_cpu_seconds for r in mine) / gb,
            "server_cpu": statistics.median(r.server_cpu_seconds for r in mine) / gb,
            "rss": max(r.peak_rss_bytes for r in mine) / 1e6,
            "checked": float(all(r.sha256_checked for r in mine)),
        }
    base = medians.get("shardsync")
    rows = []
    for variant in variants:
        m = medians[variant]
        if m is None:
            rows.append(Row(variant, *([None] * 8), SHA256[variant], False, None, None))
            continue
        checked = SHA256[variant] if m["checked"] or SHA256[variant] == "no" else "MISMATCH"
        rows.append(
            Row(
                variant=variant,
                seconds=m["seconds"],
                seconds_min=m["min"],
                seconds_max=m["max"],
                mb_per_s=m["bytes"] / 1e6 / m["seconds"],
                cpu_s_per_gb=m["cpu"],
                process_cpu_s_per_gb=m["process_cpu"],
                server_cpu_s_per_gb=m["server_cpu"],
                peak_rss_mb=m["rss"],
                sha256=checked,
                ok=True,
                time_vs_shardsync=m["seconds"] / base["seconds"] if base else None,
                cpu_vs_shardsync=m["cpu"] / base["cpu"] if base else None,
            )
        )
    return rows


def _cell(value: float | None, spec: str, width: int, suffix: str = "") -> str:
    text = "-" if value is None else format(value, spec) + suffix
    return text.rjust(width)


def print_report(
    rows: Sequence[Row], runs: Sequence[Run], skipped: Mapping[str, str], spec: Spec
) -> None:
    header = (
        f"{'variant':<28} {'seconds':>7} {'range':>13} {'MB/s':>7} {'CPU s/GB':>8} "
        f"{'proc':>6} {'server':>7} {'RSS MB':>7} {'sha256':<19} {'time/(a)':>8} {'CPU/(a)':>7}"
    )
    print()
    print(header)
    print("-" * len(header))
    for row in rows:
        span = "-" if row.seconds_min is None else f"{row.seconds_min:.2f}-{row.seconds_max:.2f}"
        print(
            f"{LABELS[row.variant]:<28} {_cell(row.seconds, '.2f', 7)} {span:>13} "
            f"{_cell(row.mb_per_s, '.0f', 7)} {_cell(row.cpu_s_per_gb, '.2f', 8)} "
            f"{_cell(row.process_cpu_s_per_gb, '.2f', 6)} "
            f"{_cell(row.server_cpu_s_per_gb, '.2f', 7)} {_cell(row.peak_rss_mb, '.0f', 7)} "
            f"{row.sha256:<19} {_cell(row.time_vs_shardsync, '.2f', 8, 'x')} "
            f"{_cell(row.cpu_vs_shardsync, '.2f', 7, 'x')}"
        )
    print(
        f"({len(spec.files)} objects, {spec.total_size / 1e6:.0f} MB; seconds: median of the "
        "timed section, imports excluded; CPU s/GB: the client's own CPU in it; proc: the whole "
        "child incl. interpreter start; server: SeaweedFS's CPU meanwhile; x/(a): this variant "
        "divided by shardsync, below 1 is less)"
    )
    print(
        f"NOTE: SeaweedFS runs on loopback on the same {os.cpu_count()} cores and is itself a "
        "large CPU consumer (see the server column): it caps every variant alike, so MB/s "
        "are machine-bound; compare the CPU columns and the ratios."
    )
    for variant, why in skipped.items():
        print(f"SKIPPED {LABELS[variant]}: {why}")
    for run in runs:
        if not run.ok:
            print(f"FAILED run: {LABELS[run.variant]} round {run.round + 1}: {run.error}")


# ---------------------------------------------------------------------------------------------
# Results file


def write_json(
    path: Path,
    settings: Settings,
    spec: Spec,
    store_sha256: bool,
    runs: Sequence[Run],
    rows: Sequence[Row],
    skipped: Mapping[str, str],
    weed_version: str | None,
) -> None:
    packages = ("shardsync", "aiobotocore", "botocore", "aiohttp", "boto3", "s3transfer")
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "python bench/s3_client.py " + " ".join(sys.argv[1:]),
        "machine": {
            "git": git_revision(),
            "nproc": os.cpu_count(),
            "cpu": cpu_model(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "work_dir": str(settings.work_dir),
            "versions": {
                **{name: package_version(name) for name in (*packages, "obstore")},
                "seaweedfs": weed_version,
            },
        },
        "settings": {
            "size": settings.size,
            "files": settings.files,
            "rounds": settings.rounds,
            "variants": list(settings.variants),
            "range_chunk": RANGE_CHUNK,
            "ranges_per_file": RANGES_PER_FILE,
            "stream_chunk": STREAM_CHUNK,
        },
        "objects": {
            "count": len(spec.files),
            "bytes": spec.total_size,
            "store_returns_sha256": store_sha256,
        },
        "skipped": dict(skipped),
        "runs": [dataclasses.asdict(run) for run in runs],
        "summary": [dataclasses.asdict(row) for row in rows],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def log(message: str) -> None:
    print(f"[s3_client] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--child"]:
        child = argparse.ArgumentParser()
        child.add_argument("--child", choices=VARIANTS, required=True)
        child.add_argument("--spec", type=Path, required=True)
        child.add_argument("--dest", type=Path, required=True)
        child.add_argument("--result", type=Path, required=True)
        parsed = child.parse_args(args)
        return child_main(parsed.child, parsed.spec, parsed.dest, parsed.result)
    settings = parse_args(args)
    variants, skipped = available(settings.variants)
    for variant, why in skipped.items():
        log(f"skipping {LABELS[variant]}: {why}")
    if not variants:
        log("nothing to run")
        return 1
    spec, store_sha256, runs, weed_version = run_all(settings, variants)
    rows = summarize(runs, variants)
    print_report(rows, runs, skipped, spec)
    settings.json_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(settings.json_path, settings, spec, store_sha256, runs, rows, skipped, weed_version)
    log(f"wrote {settings.json_path}")
    return 0 if all(run.ok for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
