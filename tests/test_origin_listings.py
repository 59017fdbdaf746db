"""What an origin lists and serves when its directory or server is not a tidy checkpoint:
files rewritten in place, odd names beside the weights, links out of the tree, files coming
and going while it is listed, servers that answer 403 for what they do not hold.

Every check compares the snapshot with the bytes the origin held when it was fetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from helpers import assert_snapshot_matches, assert_store_verified, fast_config, s3

from shardsync.config import S3Config
from shardsync.errors import AuthError, HeaderError, ManifestError, UnsafeNameError
from shardsync.origins import LocalOrigin
from shardsync.prefetch import prefetch
from shardsync.testing import Checkpoint, FakeHub
from shardsync.testing.seaweedfs import S3Server


def copy_of(checkpoint: Checkpoint, into: Path) -> Path:
    shutil.copytree(checkpoint.directory, into)
    return into


def test_local_file_rewritten_in_place_with_its_mtime_kept_is_fetched_again(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """``cp -p`` or ``rsync --inplace -t``: same inode, size and mtime, new bytes."""
    src = copy_of(checkpoint, tmp_path / "src")
    config = fast_config(tmp_path / "cache")
    asyncio.run(prefetch(str(src), config))
    shard = src / checkpoint.shards[0]
    before = shard.stat()
    new = bytearray(shard.read_bytes())
    new[-1] ^= 0xFF  # the same size; the last byte is tensor data, so the header still parses
    with shard.open("r+b") as f:
        f.write(new)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    snapshot = asyncio.run(prefetch(str(src), config)).snapshot_path
    assert (snapshot / checkpoint.shards[0]).read_bytes() == bytes(new)
    assert_store_verified(tmp_path / "cache", src, checkpoint)


# --- names no path or URL may be built from, beside the weights ------------------------------

NFD_NAME = "examples/Re\u0301sume\u0301.png"  # as a Mac writes it: not NFC
ODD_NAME = "logs/eval #3 (100%).txt"  # '#' and '%' change a URL's meaning
SECRET = b"bytes from outside the checkpoint directory"


def warned_of(caplog: pytest.LogCaptureFixture, *names: str) -> bool:
    """Some warning names each of ``names`` (escaped: what a terminal can show safely)."""
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return all(any(ascii(n) in w for w in warnings) for n in names)


async def test_hub_files_with_unsafe_names_are_left_out_and_never_requested(
    checkpoint: Checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    odd = {NFD_NAME: b"an example picture", ODD_NAME: b"eval log"}
    async with FakeHub() as hub:
        hub.add_repo("acme/odd", {**{f: checkpoint.path(f) for f in checkpoint.files}, **odd})
        config = fast_config(tmp_path / "cache", hub.endpoint)
        result = await prefetch("acme/odd", config, include=["*"])
        assert {r.file for r in hub.log} <= {None, *checkpoint.files}
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert {f.path for f in result.files} == set(checkpoint.files)
    assert_store_verified(config.cache_dir, checkpoint)
    assert warned_of(caplog, NFD_NAME, ODD_NAME)


@pytest.mark.parametrize("linked", [False, True], ids=["file", "symlink"])
def test_a_local_shard_that_does_not_start_as_one_is_refused_unpublished(
    checkpoint: Checkpoint, tmp_path: Path, linked: bool
) -> None:
    """A local directory keeps no checksum either: a shard cut to a stub or overwritten by a
    text file (a failed ``git lfs pull`` leaves its pointer) is refused as the remote origins'
    are, also where the shard is a link to a file named by its hash (DVC, git-annex), and
    the next run, once the real file is back, copies it."""
    src = copy_of(checkpoint, tmp_path / "src")
    shard = src / checkpoint.shards[0]
    real = shard.read_bytes()
    if linked:
        (src / ".objects").mkdir()
        target = src / ".objects" / "a1b2c3"
        shard.rename(target)
        shard.symlink_to(Path(".objects") / "a1b2c3")
    shard.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64)
    config = fast_config(tmp_path / "cache")
    with pytest.raises(HeaderError):
        asyncio.run(prefetch(str(src), config))
    assert_store_verified(config.cache_dir, checkpoint)  # only the origin's real files, if any
    shard.write_bytes(real)
    result = asyncio.run(prefetch(str(src), config))
    assert_snapshot_matches(result.snapshot_path, checkpoint)


def test_local_files_with_unsafe_names_are_left_out(
    checkpoint: Checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = copy_of(checkpoint, tmp_path / "src")
    (src / "logs").mkdir()
    (src / ODD_NAME).write_bytes(b"eval log")
    config = fast_config(tmp_path / "cache")
    result = asyncio.run(prefetch(str(src), config))
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert {f.path for f in result.files} == set(checkpoint.files)
    assert_store_verified(config.cache_dir, checkpoint)
    assert warned_of(caplog, ODD_NAME)


def test_an_index_naming_an_unsafe_file_is_still_refused(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Left out of the listing is not let in: the index that needs such a file fails."""
    src = copy_of(checkpoint, tmp_path / "src")
    index = src / "model.safetensors.index.json"
    body = json.loads(index.read_bytes())
    odd = "model #1.safetensors"
    (src / checkpoint.shards[0]).rename(src / odd)
    body["weight_map"] = {
        k: odd if v == checkpoint.shards[0] else v for k, v in body["weight_map"].items()
    }
    index.write_text(json.dumps(body))
    with pytest.raises(UnsafeNameError):
        asyncio.run(prefetch(str(src), fast_config(tmp_path / "cache")))
    assert_store_verified(tmp_path / "cache", index)  # the index at most: no shard


def test_s3_keys_with_unsafe_names_are_left_out_and_never_requested(
    s3server: S3Server, s3bucket: str, checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    client = s3(s3server)
    for rel in checkpoint.files:
        client.put_object(Bucket=s3bucket, Key=f"m/{rel}", Body=checkpoint.path(rel).read_bytes())
    for name in (ODD_NAME, "sub/..%2f..%2fescape.json"):
        client.put_object(Bucket=s3bucket, Key=f"m/{name}", Body=b"{}")
    base = fast_config(tmp_path / "cache")
    config = replace(base, s3=S3Config(s3server.endpoint, s3server.region, "path"))
    result = asyncio.run(prefetch(f"s3://{s3bucket}/m/", config, include=["*"]))
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert {f.path for f in result.files} == set(checkpoint.files)
    assert_store_verified(config.cache_dir, checkpoint)
    assert not list(tmp_path.rglob("escape.json"))


# --- links out of the directory, files coming and going ---------------------------------------


def test_a_link_out_of_the_directory_is_left_out(
    checkpoint: Checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = copy_of(checkpoint, tmp_path / "src")
    outside = tmp_path / "secret.txt"
    outside.write_bytes(SECRET)
    (src / "notes.txt").symlink_to(outside)
    (src / "inside.txt").symlink_to(src / "config.json")  # a link within the tree still counts
    config = fast_config(tmp_path / "cache")
    result = asyncio.run(prefetch(str(src), config))
    assert {f.path for f in result.files} == {*checkpoint.files, "inside.txt"}
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert (result.snapshot_path / "inside.txt").read_bytes() == checkpoint.path(
        "config.json"
    ).read_bytes()
    assert_store_verified(config.cache_dir, checkpoint)  # never the secret's bytes
    assert warned_of(caplog, "notes.txt")


def test_a_local_listing_while_files_come_and_go_lists_what_stays(tmp_path: Path) -> None:
    """A checkpoint still being written: temporary files appear and vanish during the walk
    (another process writes them, so the two really run at once)."""
    root = tmp_path / "src"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"weights")
    origin = LocalOrigin.from_path(str(root))
    churn = (
        "import os, sys\n"
        "names = [os.path.join(sys.argv[1], f'tmp{i}.json') for i in range(200)]\n"
        "while True:\n"
        "    for n in names:\n"
        "        open(n, 'wb').close()\n"
        "    for n in names:\n"
        "        os.unlink(n)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", churn, str(root)])
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            listing = asyncio.run(origin.list_files(None, "main"))  # type: ignore[arg-type]
            assert "model.safetensors" in {f.path for f in listing.files}
    finally:
        writer.kill()
        writer.wait()


# --- a plain URL: servers that refuse what they do not hold, pickle checkpoints ---------------

ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
)


@contextlib.asynccontextmanager
async def serve_files(
    files: dict[str, Path], *, absent: int = 404, refused: tuple[str, ...] = ()
) -> AsyncIterator[tuple[str, list[str]]]:
    """``files`` under ``/ckpt/`` on loopback; any other name (and those in ``refused``)
    answers ``absent``, as an S3 website or a bucket without ListBucket answers 403. Yields
    the base URL and the names asked for with a GET."""
    got: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        rel = request.match_info["rel"]
        if rel not in files or rel in refused:
            return web.Response(status=absent, body=ACCESS_DENIED, content_type="application/xml")
        if request.method == "GET":
            got.append(rel)
        return web.FileResponse(files[rel])

    app = web.Application()
    app.router.add_route("*", "/ckpt/{rel:.+}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/ckpt/", got
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("absent", [403, 401])
async def test_a_server_that_refuses_absent_files_still_serves_the_checkpoint(
    checkpoint: Checkpoint, tmp_path: Path, absent: int
) -> None:
    files = {rel: checkpoint.path(rel) for rel in checkpoint.files}
    async with serve_files(files, absent=absent) as (base, got):
        config = fast_config(tmp_path / "cache")
        result = await prefetch(base, config)
    fetched = {f.path for f in result.files}  # what it probes for, or the index names
    assert {"model.safetensors.index.json", "config.json", *checkpoint.shards} <= fetched
    assert fetched <= set(checkpoint.files) and set(got) <= fetched
    for rel in fetched:
        assert (result.snapshot_path / rel).read_bytes() == checkpoint.path(rel).read_bytes()
    assert_store_verified(config.cache_dir, checkpoint)


async def test_a_server_that_refuses_the_weights_is_still_an_auth_error(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Only a name the server may simply not hold counts as absent: refused weights are not."""
    files = {rel: checkpoint.path(rel) for rel in checkpoint.files}
    weights = ("model.safetensors.index.json", *checkpoint.shards)
    async with serve_files(files, absent=403, refused=weights) as (base, got):
        with pytest.raises(AuthError):
            await prefetch(base, fast_config(tmp_path / "cache"))
    assert got == []


async def test_a_pickle_checkpoint_from_a_plain_url(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model-00001-of-00001.bin").write_bytes(b"PK pickled weights")
    index = {"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    files = {p.name: p for p in src.iterdir()}
    async with serve_files(files) as (base, _):
        with pytest.raises(ManifestError):  # refused by default, as from any origin
            await prefetch(base, fast_config(tmp_path / "refused"))
        config = fast_config(tmp_path / "cache")
        result = await prefetch(base, config, allow_pickle=True)
    for name, path in files.items():
        assert (result.snapshot_path / name).read_bytes() == path.read_bytes()
    assert_store_verified(config.cache_dir, src)


@pytest.mark.parametrize(
    "source",
    [
        "http://alice:s3cretpw@127.0.0.1:9/models/tiny/",
        "http://[::1/models/",
        "http://127.0.0.1:port/models/",
    ],
    ids=["credentials", "bad-ipv6", "bad-port"],
)
def test_a_url_source_that_cannot_be_one_is_refused_as_such(tmp_path: Path, source: str) -> None:
    """A password in a base URL (``user:password@``) would be kept wherever the source is:
    job lists, the daemon's journal, logs, the cache's folder names; a URL that does not
    parse was a traceback. Each is refused (exit 2, one line) before any request, and no
    output shows the password."""
    done = subprocess.run(
        [sys.executable, "-m", "shardsync.cli", "prefetch", source, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "SHARDSYNC_CACHE_DIR": str(tmp_path / "cache")},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "s3cretpw" not in done.stdout + done.stderr
    assert not any("s3cretpw" in str(p) for p in tmp_path.rglob("*"))
