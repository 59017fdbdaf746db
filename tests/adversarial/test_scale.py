"""Scale: 10 000 small files and a 1 000-shard checkpoint, with memory and descriptors bounded.

Each prefetch runs as ``shardsync prefetch`` in a child process that caps its own open files
with ``RLIMIT_NOFILE`` (a descriptor leak of one per file ends in EMFILE long before the
last file) and reports its peak RSS (``VmHWM``) over what it used once imported, and the
most descriptors it was seen holding. The fake hub serves from a thread of the test process,
so the child's numbers are the client's alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_snapshot_matches, assert_store_verified, fast_config
from safetensors.numpy import save_file

from shardsync.testing import Checkpoint, FakeHub, serve_in_thread

MiB = 1 << 20
N_FILES = 10_000
N_SHARDS = 1_000
NOFILE = 256
"""Descriptor limit of the child: the engine needs a few dozen (sockets, partials, locks)."""
RSS_GROWTH = 200 * MiB
"""Peak RSS allowed over the child's RSS once imported; per-file state leaking a 1 MiB read
buffer, or holding every response, would cost gigabytes here."""

_MEASURED = textwrap.dedent(
    """
    import json, os, resource, sys, threading

    limit = int(os.environ["SCALE_NOFILE"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    from shardsync.cli import main

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(field)

    baseline = status("VmRSS")
    most_fds = [len(os.listdir("/proc/self/fd"))]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.005):
            most_fds[0] = max(most_fds[0], len(os.listdir("/proc/self/fd")))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code = main(sys.argv[1:])
    finally:
        stop.set()
        sampler.join()
        report = {"baseline_rss": baseline, "peak_rss": status("VmHWM"), "max_fds": most_fds[0]}
        with open(os.environ["SCALE_REPORT"], "w") as out:
            json.dump(report, out)
    sys.exit(code)
    """
)


@dataclass(frozen=True, slots=True)
class Measured:
    """What a measured ``shardsync`` child printed and what it used."""

    result: dict[str, object]
    seconds: float
    baseline_rss: int
    peak_rss: int
    max_fds: int

    def assert_bounded(self) -> None:
        assert self.peak_rss - self.baseline_rss < RSS_GROWTH, self.describe()
        # The limit already enforced this (EMFILE fails the run); the sample says by how much.
        assert self.max_fds < NOFILE, self.describe()

    def describe(self) -> str:
        return (
            f"{self.seconds:.1f} s, peak RSS {self.peak_rss / MiB:.0f} MiB "
            f"(+{(self.peak_rss - self.baseline_rss) / MiB:.0f} MiB), at most {self.max_fds} fds"
        )


def _measured_prefetch(tmp_path: Path, *args: str) -> Measured:
    """``shardsync prefetch ARGS`` in a measured child, in-process (never via a daemon)."""
    report = tmp_path / "measured.json"
    env = {**os.environ, "SCALE_NOFILE": str(NOFILE), "SCALE_REPORT": str(report)}
    config = str(_config(tmp_path))
    cmd = [sys.executable, "-c", _MEASURED, "--config", config, "prefetch", *args]
    cmd += ["--no-daemon", "--quiet", "--json"]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    usage = json.loads(report.read_text())
    return Measured(json.loads(done.stdout), seconds, **usage)


def _config(tmp_path: Path) -> Path:
    """Fast retries; the daemon socket points nowhere so none is ever used."""
    path = tmp_path / "shardsync.toml"
    path.write_text(
        "[retry]\nbase_delay = 0.01\nmax_delay = 0.1\n"
        f'[daemon]\nsocket = "{tmp_path / "no-daemon" / "d.sock"}"\n'
    )
    return path


def _tiny_weights(directory: Path, name: str, index: int) -> Path:
    """A real safetensors file with two small tensors named after ``index``."""
    rng = np.random.default_rng(index)
    tensors: dict[str, np.ndarray[Any, Any]] = {
        f"model.layers.{index}.weight": rng.standard_normal((16, 16)).astype(np.float16),
        f"model.layers.{index}.bias": rng.standard_normal(16).astype(np.float32),
    }
    path = directory / name
    save_file(tensors, str(path))
    return path


# ------------------------------------------------------------------------- 10 000 small files


def _small_file(n: int) -> bytes:
    """Distinct contents of a few sizes; one empty file and one duplicate of another."""
    if n == 0:
        return b""
    if n == 1:
        return _small_file(2)
    return f"file {n:05d}\n".encode() * (n % 9 + 1)


@pytest.fixture(scope="module")
def many_files(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    root = tmp_path_factory.mktemp("many")
    _tiny_weights(root, "model.safetensors", 0)
    (root / "config.json").write_text('{"model_type": "llama"}\n')
    for n in range(N_FILES):
        path = root / "data" / f"{n % 100:02d}" / f"{n:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_small_file(n))
    return Checkpoint.scan(root)


@pytest.fixture
def many_hub(many_files: Checkpoint) -> Iterator[FakeHub]:
    hub = FakeHub()
    hub.add_repo("acme/many", {rel: many_files.path(rel).read_bytes() for rel in many_files.files})
    with serve_in_thread(hub) as running:
        yield running


def test_ten_thousand_small_files(
    many_hub: FakeHub, many_files: Checkpoint, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    measured = _measured_prefetch(
        tmp_path,
        "acme/many",
        "--endpoint",
        many_hub.endpoint,
        "--cache-dir",
        str(cache),
        "--include",
        "data/*",
        "--include",
        "*.json",
    )
    files = measured.result["files"]
    assert isinstance(files, list)
    assert sorted(f["path"] for f in files) == sorted(many_files.files)
    snapshot = Path(str(measured.result["snapshot_path"]))
    assert_snapshot_matches(snapshot, many_files)
    assert sum(1 for p in snapshot.rglob("*") if not p.is_dir()) == len(many_files.files)
    blobs = list((cache / "store" / "sha256").glob("*/*"))
    assert len(blobs) == len(many_files.files) - 1  # the duplicate is stored once
    assert_store_verified(cache, many_files)
    assert not list((cache / "partial").iterdir())
    measured.assert_bounded()


# ------------------------------------------------------------------------- 1 000 shards


def _shard_name(n: int) -> str:
    return f"model-{n:05d}-of-{N_SHARDS:05d}.safetensors"


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Shard ``n`` holds layer ``n``'s two tensors; a real index maps each to its shard."""
    root = tmp_path_factory.mktemp("shards")
    weight_map: dict[str, str] = {}
    for n in range(1, N_SHARDS + 1):
        _tiny_weights(root, _shard_name(n), n)
        weight_map[f"model.layers.{n}.weight"] = _shard_name(n)
        weight_map[f"model.layers.{n}.bias"] = _shard_name(n)
    total = sum((root / name).stat().st_size for name in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text('{"model_type": "llama"}\n')
    return Checkpoint.scan(root)


@pytest.fixture
def shards_hub(many_shards: Checkpoint) -> Iterator[FakeHub]:
    hub = FakeHub()
    hub.add_checkpoint("acme/shards", many_shards)
    with serve_in_thread(hub) as running:
        yield running


def test_a_thousand_shards_prefetch_and_load(
    shards_hub: FakeHub,
    many_shards: Checkpoint,
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    import shardsync

    cache = tmp_path / "cache"
    measured = _measured_prefetch(
        tmp_path, "acme/shards", "--endpoint", shards_hub.endpoint, "--cache-dir", str(cache)
    )
    files = measured.result["files"]
    assert isinstance(files, list)
    weights = [f["path"] for f in files if f["path"].endswith(".safetensors")]
    assert weights == [_shard_name(n) for n in range(1, N_SHARDS + 1)]  # index order
    assert {f["verified"] for f in files if f["path"] in weights} == {"sha256"}
    snapshot = Path(str(measured.result["snapshot_path"]))
    assert_snapshot_matches(snapshot, many_shards)
    assert_store_verified(cache, many_shards)
    assert not list((cache / "partial").iterdir())
    measured.assert_bounded()

    fds_before = len(os.listdir("/proc/self/fd"))
    tensors = shardsync.load(
        "acme/shards", device_map="cpu", config=fast_config(cache, shards_hub.endpoint)
    )
    fds_held = len(os.listdir("/proc/self/fd")) - fds_before
    assert isinstance(tensors, dict)
    assert len(tensors) == 2 * N_SHARDS
    for n in range(1, N_SHARDS + 1):
        expected = load_file(str(many_shards.path(_shard_name(n))))
        for name, tensor in expected.items():
            got = tensors[name]
            assert got.device.type == "cpu" and got.dtype == tensor.dtype
            assert got.shape == tensor.shape and bool((got == tensor).all()), name
    assert fds_held < 16, f"the loaded tensors hold {fds_held} descriptors"  # mmaps only


def test_the_fake_hub_pages_a_ten_thousand_file_tree(many_hub: FakeHub) -> None:
    """huggingface_hub walks the ``Link`` pages of the tree listing to every file.

    (shardsync itself lists a Hub repo with one ``revision?blobs=true`` call, whose
    ``siblings`` the fake hub never truncates, so the prefetch above pages nothing.)
    """
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    entries = list(HfApi(endpoint=many_hub.endpoint).list_repo_tree("acme/many", recursive=True))
    files = sorted(e.path for e in entries if isinstance(e, RepoFile))
    assert len(files) == N_FILES + 2 and files[0] == "config.json"
    # No page holds more than tree_page_size entries: every "next" link was followed. (The
    # log may still lack the last page: the hub records a request once its handler returns,
    # which can be after the client read the body.)
    assert len(entries) > 10 * many_hub.tree_page_size
    assert sum("/tree/" in r.path for r in many_hub.log) >= 10
