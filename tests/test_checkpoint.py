"""`shardsync.dcp_reader.DCPReader`: `dcp.load` from a run's origin through the cache.

It reads only the byte ranges its plan names (counted by a wrapper around the origin, and
on SeaweedFS); a second load from the same cache moves no checkpoint bytes, and neither
does a load of a checkpoint `prefetch --checkpoint` put there; pieces of a file that
changed at the origin, or that no longer hash right on disk, are never used; copies into
tensors start while other ranges are still being read, within the reader's window.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import WrappedOrigin, fast_config, open_under
from test_training import WORLD, dcp_expected, load_equal, runs  # noqa: F401 - fixture
from torch.distributed.checkpoint.api import CheckpointException

from shardsync.cache import CacheStore, RepoRef
from shardsync.checkpoint import prefetch_checkpoint
from shardsync.checkpoint_cache import KeptFile, RangeCache
from shardsync.dcp_metadata import parse_dcp_metadata
from shardsync.dcp_reader import DCPReader
from shardsync.errors import LoadError, OriginError
from shardsync.fetch.fetcher import Fetcher
from shardsync.origins import LocalOrigin
from shardsync.origins.base import Entry


@dataclass
class CountingOrigin(WrappedOrigin):
    """A local directory that counts the bytes it serves by range (and can hold reads of
    one file back until a gate opens)."""

    served: dict[str, int] = field(default_factory=dict)
    gate: threading.Event | None = None
    gated: str | None = None

    async def read_range(
        self, fetcher: Fetcher, commit: str | None, entry: Entry, start: int, end: int
    ) -> bytes:
        if self.gate is not None and entry.path == self.gated:
            opened = await asyncio.to_thread(self.gate.wait, 30)
            assert opened, f"no tensor was copied while {entry.path} was being read"
        data = await self.inner.read_range(fetcher, commit, entry, start, end)
        self.served[entry.path] = self.served.get(entry.path, 0) + len(data)
        return data


def _load(reader: Any, template: dict[str, Any], planner: Any = None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    state = {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in template.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    return state


def _data_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob("*.distcp"))


def _counting(root: Path) -> CountingOrigin:
    return CountingOrigin(LocalOrigin.from_path(str(root)))


def test_dcp_reader_loads_exactly_what_was_saved_and_reads_only_what_the_plan_needs(
    runs: dict[str, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    root = runs["dcp"]
    expected = dcp_expected(200)

    counting = _counting(root)
    reader = DCPReader(str(root), config=fast_config(tmp_path / "c1"), origin=counting)
    load_equal(_load(reader, expected), expected)
    whole = _data_bytes(root / "step-200")
    stats = reader.statistics()
    assert stats.checkpoint == "step-200"
    assert sum(counting.served.values()) == stats.bytes_read  # .metadata counted too
    data = sum(n for p, n in counting.served.items() if p.endswith(".distcp"))
    assert data <= whole and stats.bytes_cached == 0

    one_rank = {"rank1.w": expected["rank1.w"]}  # what one rank of 4 would hold: ~1/4
    counting = _counting(root)
    reader = DCPReader(str(root), config=fast_config(tmp_path / "c2"), origin=counting)
    load_equal(_load(reader, one_rank), one_rank)
    moved = sum(n for p, n in counting.served.items() if p.endswith(".distcp"))
    share = moved / whole
    print(f"DCPReader: 1 of {len(expected)} entries moved {moved} of {whole} bytes ({share:.0%})")
    assert sum(counting.served.values()) == reader.statistics().bytes_read
    assert expected["rank1.w"].numel() * 4 <= moved < 0.35 * whole
    assert set(counting.served) <= {
        "step-200/.metadata",
        *(f"step-200/{p.name}" for p in (root / "step-200").glob("__1_*")),
    }

    older = DCPReader(str(root), "step-100", config=fast_config(tmp_path / "c3"))
    load_equal(_load(older, dcp_expected(100)), dcp_expected(100))


def _dcp_save(state: dict[str, Any], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def test_a_trainer_checkpoint_with_model_and_optimizer_folders_loads_the_model(
    tmp_path: Path,
) -> None:
    """accelerate's FSDP layout in a Trainer checkpoint: ``pytorch_model_fsdp_0`` beside
    ``optimizer_0``, two DCP checkpoints. The reader loads the model's, tensors and bytes
    of the same folder; with two models it names them instead of picking one."""
    model = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8)}
    optim = {"w": torch.full((64,), -1.0), "exp_avg": torch.full((64,), 7.0)}
    step = tmp_path / "run" / "checkpoint-10"
    _dcp_save(model, step / "pytorch_model_fsdp_0")
    _dcp_save(optim, step / "optimizer_0")
    (step / "trainer_state.json").write_text("{}")
    reader = DCPReader(str(tmp_path / "run"), config=fast_config(tmp_path / "c1"))
    load_equal(_load(reader, model), model)
    _dcp_save(model, step / "pytorch_model_fsdp_1")
    with pytest.raises(CheckpointException):  # its metadata cannot be read: which one?
        _load(DCPReader(str(tmp_path / "run"), config=fast_config(tmp_path / "c2")), model)


def test_data_files_changed_after_the_metadata_was_read_are_never_loaded(
    tmp_path: Path,
) -> None:
    """The run saves the same step again (DCP overwrites) while ranks plan: the load reads
    the ``.metadata`` of one save and must not copy the other save's bytes by its offsets
    (here the same sizes in another order: every tensor would be another's)."""
    first = {"a": torch.full((256,), 1.0), "b": torch.full((256,), 2.0)}
    second = {"b": torch.full((256,), 20.0), "a": torch.full((256,), 10.0)}
    step = tmp_path / "run" / "step-100"
    _dcp_save(first, step)

    class SavedAgainMeanwhile(DCPReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = super().read_metadata(*args, **kwargs)
            _dcp_save(second, step)
            return metadata

    reader = SavedAgainMeanwhile(str(tmp_path / "run"), config=fast_config(tmp_path / "c"))
    with pytest.raises(CheckpointException) as failed:  # DCP wraps what a reader raises
        _load(reader, first)
    ((cause, _where),) = failed.value.failures.values()
    assert isinstance(cause, LoadError), cause


def test_a_second_load_from_the_same_cache_moves_no_bytes(
    runs: dict[str, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    root = runs["dcp"]
    config = fast_config(tmp_path / "cache")
    expected = dcp_expected(200)
    first_origin = _counting(root)
    first = DCPReader(str(root), config=config, origin=first_origin)
    load_equal(_load(first, expected), expected)
    once = first.statistics()
    assert once.bytes_read > _data_bytes(root / "step-200") * 0.9
    assert once.bytes_kept == once.bytes_read  # no gap between the ranges: all of it kept

    again_origin = _counting(root)
    again = DCPReader(str(root), config=config, origin=again_origin)
    load_equal(_load(again, expected), expected)
    twice = again.statistics()
    print(
        f"DCPReader: first load {once.bytes_read} bytes from the origin, second {twice.bytes_read}"
    )
    assert again_origin.served == {} and twice.bytes_read == twice.ranges == 0
    assert twice.bytes_cached == once.bytes_read

    # A subset of what was loaded before is local too.
    part = DCPReader(str(root), config=config, origin=_counting(root))
    subset = {"shared.emb": expected["shared.emb"]}
    load_equal(_load(part, subset), subset)
    assert part.statistics().bytes_read == 0


def test_a_checkpoint_prefetched_into_the_cache_is_read_from_it(
    runs: dict[str, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    root = runs["dcp"]
    expected = dcp_expected(200)
    config = fast_config(tmp_path / "whole")
    asyncio.run(prefetch_checkpoint(str(root), config))
    counting = _counting(root)
    reader = DCPReader(str(root), config=config, origin=counting)
    load_equal(_load(reader, expected), expected)
    assert counting.served == {} and reader.statistics().bytes_read == 0
    assert reader.statistics().bytes_kept == 0  # blobs are read as they are, not copied

    # Rank 1's files only: rank 1's own tensor is local, rank 0's come by range.
    config = fast_config(tmp_path / "rank1")
    asyncio.run(prefetch_checkpoint(str(root), config, rank=1, world_size=WORLD))
    counting = _counting(root)
    reader = DCPReader(str(root), config=config, origin=counting)
    own = {"rank1.w": expected["rank1.w"]}
    load_equal(_load(reader, own), own)
    assert counting.served == {}
    counting = _counting(root)
    reader = DCPReader(str(root), config=config, origin=counting)
    load_equal(_load(reader, expected), expected)
    assert set(counting.served) == {f"step-200/{p.name}" for p in (root / "step-200").glob("__0_*")}


def _kept_sidecar(cache: Path, repo: RepoRef, path: str) -> Path:
    store = CacheStore(cache)
    return store.layout.partial(RangeCache(store, repo).key(path))[1]


def test_kept_pieces_of_a_changed_file_or_gone_bad_on_disk_are_never_used(
    runs: dict[str, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    shutil.copytree(runs["dcp"], root)
    config = fast_config(tmp_path / "cache")
    expected = dcp_expected(200)
    load_equal(_load(DCPReader(str(root), config=config), expected), expected)

    # A kept piece whose bytes changed on disk: read again from the origin, and only it.
    repo = LocalOrigin.from_path(str(root)).repo
    sidecar = _kept_sidecar(tmp_path / "cache", repo, "step-200/__1_0.distcp")
    start, end, _ = max(json.loads(sidecar.read_bytes())["pieces"], key=lambda p: p[1] - p[0])
    with sidecar.with_suffix(".part").open("r+b") as f:
        f.seek((start + end) // 2)  # inside the tensor's data
        byte = f.read(1)
        f.seek((start + end) // 2)  # inside the tensor's data
        f.write(bytes([byte[0] ^ 0x40]))
    counting = _counting(root)
    reader = DCPReader(str(root), config=config, origin=counting)
    load_equal(_load(reader, expected), expected)
    assert counting.served == {"step-200/__1_0.distcp": end - start}

    # The origin's files change (same names, same sizes, another step's bytes): what was
    # kept for the old version must not be used, not even the .metadata.
    for name in os.listdir(root / "step-100"):
        old, new = root / "step-200" / name, root / "step-100" / name
        assert old.stat().st_size == new.stat().st_size
        mtime = old.stat().st_mtime_ns
        shutil.copyfile(new, old)
        os.utime(old, ns=(mtime + 10**9, mtime + 10**9))  # a new version, however coarse the clock
    counting = _counting(root)
    reader = DCPReader(str(root), config=config, origin=counting)
    load_equal(_load(reader, dcp_expected(100)), dcp_expected(100))
    assert reader.statistics().bytes_cached == 0
    assert "step-200/.metadata" in counting.served


@dataclass
class FailingVersion(WrappedOrigin):
    """A local directory that cannot say the version of ``path`` when the load opens it
    (after its plan pinned it, and once ``after`` is set): the load fails while it opens
    its other files."""

    path: str = ""
    after: threading.Event = field(default_factory=threading.Event)
    planned: bool = False

    async def version(self, fetcher: Fetcher, entry: Entry) -> str | None:
        if entry.path == self.path and not self.planned:
            self.planned = True
        elif entry.path == self.path:
            await asyncio.to_thread(self.after.wait, 10)
            raise OriginError(f"{entry.path}: the test's unanswered version")
        return await self.inner.version(fetcher, entry)


def test_a_load_failing_while_a_file_is_opened_leaves_no_descriptor_open(
    runs: dict[str, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file's kept pieces are opened in a thread a cancel cannot stop: when the load fails
    meanwhile, what that thread opened is closed (else its descriptor stays open for the
    life of the process, one more for every failed load)."""
    root = runs["dcp"]
    cache = tmp_path / "cache"
    expected = dcp_expected(200)
    load_equal(_load(DCPReader(str(root), config=fast_config(cache)), expected), expected)
    held, failing = "step-200/__1_0.distcp", "step-200/__0_0.distcp"
    opening, opened = threading.Event(), threading.Event()
    real_open = RangeCache.open

    def held_open(self: RangeCache, path: str, size: int, version: str) -> KeptFile:
        if path != held:
            return real_open(self, path, size, version)
        opening.set()
        time.sleep(0.5)  # the other file's version fails the load meanwhile
        try:
            return real_open(self, path, size, version)  # its kept pieces: a file opened
        finally:
            opened.set()

    monkeypatch.setattr(RangeCache, "open", held_open)
    origin = FailingVersion(LocalOrigin.from_path(str(root)), failing, opening)
    with pytest.raises(CheckpointException) as failed:
        _load(DCPReader(str(root), config=fast_config(cache), origin=origin), expected)
    ((cause, _where),) = failed.value.failures.values()  # one rank: this process
    assert isinstance(cause, OriginError), cause
    assert opened.wait(10)
    assert open_under(cache) == []


def test_copies_start_while_reads_are_in_flight_and_stay_within_the_window(
    runs: dict[str, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    root = runs["dcp"]
    expected = dcp_expected(200)
    copied = threading.Event()

    class Planner(DefaultLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            super().commit_tensor(read_item, tensor)
            copied.set()

    # Rank 1's file is held back until a tensor of rank 0's file was copied: a reader that
    # reads everything before copying anything would wait for ever (the gate gives up).
    counting = _counting(root)
    counting.gate, counting.gated = copied, "step-200/__1_0.distcp"
    reader = DCPReader(str(root), config=fast_config(tmp_path / "c1"), origin=counting)
    load_equal(_load(reader, expected, Planner()), expected)

    # A window smaller than one tensor: one range at a time, whatever the plan.
    meta = parse_dcp_metadata((root / "step-200" / ".metadata").read_bytes()).metadata
    largest = max(info.length for info in meta.storage_data.values())
    reader = DCPReader(str(root), config=fast_config(tmp_path / "c2"), window=16 << 10)
    load_equal(_load(reader, expected), expected)
    stats = reader.statistics()
    assert largest < stats.bytes_read / 2
    assert stats.peak_buffered == largest


def test_dcp_reader_from_s3(
    s3server: Any,
    s3bucket: str,
    aws_env: None,
    runs: dict[str, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    from test_s3_origin import s3_config
    from test_training import _upload_tree

    _upload_tree(s3server, s3bucket, runs["dcp"], "run")
    url = f"s3://{s3bucket}/run/"
    config = s3_config(tmp_path / "cache", s3server)
    expected = dcp_expected(200)
    reader = DCPReader(url, config=config)
    load_equal(_load(reader, expected), expected)
    stats = reader.statistics()
    assert stats.checkpoint == "step-200" and stats.bytes_read > 0
    again = DCPReader(url, config=config)
    load_equal(_load(again, expected), expected)
    assert again.statistics().bytes_read == 0
    assert again.statistics().bytes_cached == stats.bytes_read

    part = DCPReader(url, config=s3_config(tmp_path / "part", s3server))
    load_equal(
        _load(part, {"shared.emb": expected["shared.emb"]}), {"shared.emb": expected["shared.emb"]}
    )
    assert part.statistics().bytes_read < 0.25 * stats.bytes_read

    # Prefetched: the blobs the listing's sha256 names are read, nothing else.
    prefetched = s3_config(tmp_path / "prefetched", s3server)
    asyncio.run(prefetch_checkpoint(url, prefetched))
    local = DCPReader(url, config=prefetched)
    load_equal(_load(local, expected), expected)
    assert local.statistics().bytes_read == 0

    # New objects under the same keys (new ETags): nothing kept for the old ones is used.
    for p in (runs["dcp"] / "step-100").iterdir():
        _put(s3server, s3bucket, f"run/step-200/{p.name}", p.read_bytes())
    changed = DCPReader(url, config=config)
    load_equal(_load(changed, dcp_expected(100)), dcp_expected(100))
    assert changed.statistics().bytes_cached == 0 and changed.statistics().bytes_read > 0


def _put(server: Any, bucket: str, key: str, data: bytes) -> None:
    from test_s3_origin import put

    put(server, bucket, key, data, True)


def test_writers_of_one_version_add_to_the_same_kept_file_in_any_order(tmp_path: Path) -> None:
    """Two loads on one host (two ranks) that opened the same file before either kept
    anything: both sets of pieces stay, whichever commits last. Another version's writer
    starts the file afresh: the old pieces are gone for new readers of either version."""
    store = CacheStore(tmp_path / "cache")
    ranges = RangeCache(store, RepoRef("local", str(tmp_path / "run")))
    data = os.urandom(4096)
    a = ranges.open("step/__0_0.distcp", 4096, "v1")
    b = ranges.open("step/__0_0.distcp", 4096, "v1")
    a.add(0, data[:1000])
    b.add(2000, data[2000:3000])
    assert b.commit() == 1000 and a.commit() == 1000
    a.close()
    b.close()
    c = ranges.open("step/__0_0.distcp", 4096, "v1")
    assert c.read(0, 1000) == data[:1000] and c.read(2000, 3000) == data[2000:3000]
    assert c.read(0, 999) is None  # only whole pieces, as they were kept

    other = ranges.open("step/__0_0.distcp", 4096, "v2")
    assert not other.has(0, 1000)
    other.add(0, b"x" * 1000)
    assert other.commit() == 1000
    assert c.read(0, 1000) == data[:1000]  # what it had open still reads (the old file)
    assert not ranges.open("step/__0_0.distcp", 4096, "v1").has(0, 1000)
    assert ranges.open("step/__0_0.distcp", 4096, "v2").read(0, 1000) == b"x" * 1000
