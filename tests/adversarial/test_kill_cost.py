"""A ``kill -9`` costs what was in flight, not what was written (promise 9).

A real ``shardsync prefetch`` process is killed once 40% of the model is on its disk; its
resume records must then claim about all of it, and the rerun must fetch little more than
the rest: from the Hub, and from an S3 store on both body paths, where the rerun must also
check each object's CRC over the bytes of both runs. bench/kill.py measures the same at full
size.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_snapshot_matches, kill_when, serving, upload_as_uploaders_do

from shardsync.testing import Bandwidth, Checkpoint, build_checkpoint, serve_in_thread
from shardsync.testing.relay import Relay
from shardsync.testing.seaweedfs import S3Server

REPO = "acme/kill"
MiB = 1 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(tmp_path_factory.mktemp("kill"), total_bytes=32 * MiB, n_shards=4)


def on_disk(cache: Path, model: Checkpoint) -> int:
    """Bytes of the model the client has in its files: 64 KiB blocks of each partial equal
    to the same block of the shard it downloads (partials are preallocated: their size says
    nothing), and published shards."""
    shards = [model.path(s).read_bytes() for s in model.shards]
    total = 0
    for path in (cache / "partial").glob("*.part"):
        data = path.read_bytes()
        total += max(
            (_same_blocks(data, shard) for shard in shards if len(shard) == len(data)), default=0
        )
    return total + sum(
        p.stat().st_size for p in (cache / "store" / "sha256").glob("*/*") if p.stat().st_size > MiB
    )


def _same_blocks(data: bytes, shard: bytes, block: int = 64 * 1024) -> int:
    return sum(
        min(block, len(shard) - at)
        for at in range(0, len(shard), block)
        if data[at : at + block] == shard[at : at + block] and any(shard[at : at + block])
    )


def recorded(cache: Path) -> int:
    """Bytes the resume records claim, and published shards."""
    total = 0
    for path in (cache / "partial").glob("*.json"):
        text = path.read_bytes()
        if text.strip():  # a record never saved yet is empty: it claims nothing
            total += sum(end - start for start, end in json.loads(text)["done"])
    return total + sum(
        p.stat().st_size for p in (cache / "store" / "sha256").glob("*/*") if p.stat().st_size > MiB
    )


# small writes and frequent resume records: what a kill may lose is bounded by these
# (16 connections x one 64 KiB write, 4 files x 256 KiB, 0.05 s at ~16 MB/s)
DOWNLOAD = (
    '[download]\nconnections_per_file = 4\nchunk_size = "2MiB"\nwrite_size = "64KiB"\n'
    'read_size = "64KiB"\nsidecar_bytes = "256KiB"\nsidecar_interval = 0.05\n'
)


@pytest.mark.parametrize("moved", [False, True], ids=["same-commit", "branch-moved"])
def test_a_kill_at_40_percent_loses_only_what_was_in_flight(
    model: Checkpoint, tmp_path: Path, moved: bool
) -> None:
    """With ``branch-moved``, ``main`` gets a new commit between the runs that adds only a
    note (pushed right after the weights, as often happens): the shards are the same
    objects (sha256, size, ETag) under another commit's URL, and resume as well."""
    size = sum(model.path(s).stat().st_size for s in model.shards)
    conf = tmp_path / "c.toml"
    conf.write_text(DOWNLOAD)
    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "shardsync.cli", "--config", str(conf), "prefetch", REPO,
            "--cache-dir", str(cache), "--no-daemon", "--quiet"]  # fmt: skip
    with serving({REPO: model}) as hub:
        hub.faults.add(Bandwidth(1_000_000))  # 16 connections: about 2 s for the model
        proc = subprocess.Popen(
            [*args, "--endpoint", hub.endpoint],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while hub.bytes_served("*.safetensors") < 0.4 * size:
            assert proc.poll() is None and time.monotonic() < deadline, "finished before 40%"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        written, claimed = on_disk(cache, model), recorded(cache)
        assert claimed >= written - 3 * MiB, (written, claimed)

        hub.faults.clear()
        if moved:
            files = {rel: model.path(rel) for rel in model.files}
            hub.add_repo(REPO, {**files, "NOTES.md": b"a note, pushed after the weights\n"})
        done = subprocess.run(
            [*args, "--endpoint", hub.endpoint], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        snapshot = Path(done.stdout.strip())
        assert_snapshot_matches(snapshot, model)
        assert (snapshot / "NOTES.md").is_file() == moved  # the new commit's snapshot
        served = hub.bytes_served("*.safetensors")
    # what the kill cost: the unrecorded tail plus what was in flight (socket buffers,
    # batches not yet written)
    assert served <= size + (written - claimed) + 4 * MiB, served / size


@pytest.mark.parametrize("via", ["direct", "proxy"])
def test_a_kill_at_40_percent_of_an_s3_download_loses_only_what_was_in_flight(
    s3server: S3Server,
    s3bucket: str,
    aws_env: None,
    model: Checkpoint,
    tmp_path: Path,
    via: str,
) -> None:
    """Objects as boto3 uploads them (multipart, a CRC32 per part), read through a relay that
    counts the body bytes the store's answers carry: ``direct`` as the store's endpoint (the
    pump), ``proxy`` as a forward proxy (the aiohttp path). The rerun resumes each partial,
    bound to its object's ETag, and checks each object's composite CRC over all its bytes."""
    upload_as_uploaders_do(s3server, s3bucket, model, "kill", "CRC32", multipart=True)
    total = sum(model.path(rel).stat().st_size for rel in model.files)
    with contextlib.ExitStack() as stack:
        upstream = None if via == "proxy" else s3server.endpoint
        relay = stack.enter_context(serve_in_thread(Relay(upstream=upstream, rate=1_000_000)))
        endpoint = s3server.endpoint if via == "proxy" else relay.url
        conf = tmp_path / "c.toml"
        conf.write_text(
            f'{DOWNLOAD}[s3]\nendpoint = "{endpoint}"\nregion = "{s3server.region}"\n'
            'addressing = "path"\nconnections_per_file = 4\nchunk_size = "2MiB"\n'
        )
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy")}
        if via == "proxy":
            env["http_proxy"] = relay.url
        cache = tmp_path / "cache"
        source = f"s3://{s3bucket}/kill/"
        args = [sys.executable, "-m", "shardsync.cli", "--config", str(conf), "prefetch",
                source, "--cache-dir", str(cache), "--no-daemon", "--json"]  # fmt: skip
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kill_when(proc, lambda: relay.body_bytes >= 0.4 * total)
        written, claimed = on_disk(cache, model), recorded(cache)
        assert written >= 0.2 * total, "too little on disk at the kill for the rerun to show"
        assert claimed >= written - 3 * MiB, (written, claimed)
        before = relay.body_bytes

        relay.rate = 0
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        rerun = relay.body_bytes - before
    result = json.loads(done.stdout)
    assert_snapshot_matches(Path(result["snapshot_path"]), model)
    shards = {f["path"]: f for f in result["files"] if f["path"] in model.shards}
    assert {f["verified"] for f in shards.values()} == {"crc32"}
    # the rerun fetched what was not on disk, plus what the records had not claimed yet, plus
    # the listing, the small files and each object's parts
    lost = max(0, written - claimed)
    assert rerun <= total - claimed + lost + 2 * MiB, (rerun, total, claimed)
