"""Training checkpoints from any origin: choose one, fetch one rank's files of it.

``prefetch_checkpoint`` is what ``shardsync prefetch SOURCE --checkpoint latest`` runs: the
engine's usual job (locks, verification, atomic publish, resume, leases), with its files
decided by ``shardsync.training`` instead of a weights index. ``latest`` says what would be
chosen without downloading anything but the small files the choice reads.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardsync.api import result_from_json, result_to_json
from shardsync.config import Config, load_config
from shardsync.errors import DaemonError, EntryNotFoundError
from shardsync.fetch import Fetcher, Sleep
from shardsync.manifest import Listing, Manifest, ManifestEntry, RemoteFile
from shardsync.origins import Origin
from shardsync.prefetch import Engine, PrefetchResult, ProgressSink, Select
from shardsync.training import (
    Choice,
    Format,
    Need,
    RankSelection,
    Skipped,
    choose,
    select_rank,
)

__all__ = [
    "CheckpointPlan",
    "CheckpointResult",
    "DCPReader",  # noqa: F822 - built on first use by the module __getattr__
    "ReaderStatistics",
    "alatest",
    "checkpoint_result",
    "checkpoint_result_from_json",
    "latest",
    "prefetch_checkpoint",
    "resolve",
    "selector",
]


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    """A training checkpoint (or one rank's part of it) complete in the cache.

    ``path`` is the local folder a framework is pointed at, laid out like the remote one
    (the checkpoint folder; for DeepSpeed and Megatron the run folder with the pointer file).
    """

    prefetch: PrefetchResult
    checkpoint: str
    format: Format
    step: int | None
    path: Path
    skipped: tuple[Skipped, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """``prefetch --json`` plus ``checkpoint``, ``format``, the checkpoint's folder as
        ``snapshot_path`` (the whole snapshot as ``snapshot_root``), and what was skipped."""
        return {
            **result_to_json(self.prefetch),
            "checkpoint": self.checkpoint,
            "format": self.format,
            "step": self.step,
            "snapshot_path": str(self.path),
            "snapshot_root": str(self.prefetch.snapshot_path),
            "skipped": [{"name": s.name, "reason": s.reason} for s in self.skipped],
            "notes": list(self.notes),
        }


def checkpoint_result_from_json(obj: Mapping[str, Any]) -> CheckpointResult:
    """Inverse of ``CheckpointResult.to_json`` (a daemon job's ``job_done`` result)."""
    try:
        prefetch = result_from_json({**obj, "snapshot_path": obj["snapshot_root"]})
        return CheckpointResult(
            prefetch=prefetch,
            checkpoint=str(obj["checkpoint"]),
            format=obj["format"],
            step=None if obj["step"] is None else int(obj["step"]),
            path=Path(obj["snapshot_path"]),
            skipped=tuple(Skipped(str(s["name"]), str(s["reason"])) for s in obj["skipped"]),
            notes=tuple(str(n) for n in obj["notes"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DaemonError(f"malformed checkpoint result from the daemon: {exc!r}") from exc


async def resolve(
    origin: Origin, fetcher: Fetcher, listing: Listing, checkpoint: str = "latest"
) -> Choice:
    """``training.choose`` over an origin: the small files it asks for are read by range
    (pass a listing made with ``hidden=True``: a DCP ``.metadata`` is a hidden file)."""
    pairs = [(f.path, f.size) for f in listing.files]
    contents: dict[str, bytes | None] = {}
    while isinstance(step := choose(pairs, checkpoint, contents), Need):
        contents[step.path] = await _read_small(origin, fetcher, listing.commit, step)
    return step


async def _read_small(
    origin: Origin, fetcher: Fetcher, commit: str | None, need: Need
) -> bytes | None:
    try:
        return await origin.read_range(
            fetcher, commit, RemoteFile(need.path, None, None), 0, need.limit + 1
        )
    except EntryNotFoundError:
        return None


@dataclass(slots=True)
class CheckpointPlan:
    """What the ``selector`` hook decided, once the job is prepared."""

    choice: Choice | None = None
    selection: RankSelection | None = None


def selector(
    origin: Origin,
    fetcher: Fetcher,
    checkpoint: str,
    rank: int | None,
    world_size: int | None,
    plan: CheckpointPlan,
) -> Select:
    """The ``Job.prepare(select=...)`` hook: the chosen checkpoint's files for one rank."""

    async def select(listing: Listing) -> Manifest:
        choice = await resolve(origin, fetcher, listing, checkpoint)
        selection = select_rank(choice, rank, world_size)
        listed = {f.path: f for f in listing.files}
        entries = tuple(
            ManifestEntry.from_remote(listed[path], "shard")
            if path in listed
            else ManifestEntry(path, size, None, None, "shard")
            for path, size in selection.files
        )
        plan.choice, plan.selection = choice, selection
        return Manifest(commit=listing.commit, entries=entries, weight_map={})

    return select


async def prefetch_checkpoint(
    source: str,
    config: Config,
    *,
    checkpoint: str = "latest",
    rank: int | None = None,
    world_size: int | None = None,
    token: str | None = None,
    progress: ProgressSink | None = None,
    environ: Mapping[str, str] | None = None,
    sleep: Sleep = asyncio.sleep,
) -> CheckpointResult:
    """Make ``checkpoint`` of the training run at ``source`` (or rank ``rank``'s part of it)
    complete in the cache and return where it is."""
    started = time.monotonic()
    engine = Engine(config, sleep=sleep, environ=environ)
    origin = engine.origin(source, token=token)
    plan = CheckpointPlan()
    async with engine:
        job = engine.job(origin, sink=progress)
        await job.prepare(
            select=selector(origin, engine.fetcher, checkpoint, rank, world_size, plan)
        )
        files = await job.download()
        elapsed = time.monotonic() - started
        stats = engine.fetcher.statistics()
        tier = engine.tier
    result = PrefetchResult(
        repo=origin.repo,
        revision=job.revision,
        commit=job.commit,
        snapshot_path=job.snapshot_path,
        files=files,
        bytes_downloaded=sum(f.downloaded for f in files),
        elapsed=elapsed,
        fetch=stats,
        tier=tier.statistics() if tier is not None else None,
    )
    assert plan.choice is not None and plan.selection is not None
    return checkpoint_result(result, plan.choice, plan.selection)


def checkpoint_result(
    result: PrefetchResult, choice: Choice, selection: RankSelection
) -> CheckpointResult:
    return CheckpointResult(
        prefetch=result,
        checkpoint=choice.name,
        format=choice.format,
        step=choice.step,
        path=local_folder(result.snapshot_path, choice.root),
        skipped=choice.skipped,
        notes=selection.notes,
    )


def local_folder(snapshot: Path, root: str) -> Path:
    return snapshot.joinpath(*posixpath.normpath(root).split("/")) if root else snapshot


async def alatest(
    source: str,
    *,
    checkpoint: str = "latest",
    config: Config | None = None,
    cache_dir: Path | None = None,
    token: str | None = None,
) -> Choice:
    """What ``--checkpoint latest`` (or ``checkpoint``) would choose at ``source``, with the
    checkpoints passed over and why; downloads nothing but the small files it reads."""
    config = config or load_config(None, cache_dir=cache_dir)
    engine = Engine(config)
    origin = engine.origin(source, token=token)
    async with engine:
        listing = await origin.list_files(engine.fetcher, origin.default_revision, hidden=True)
        return await resolve(origin, engine.fetcher, listing, checkpoint)


def latest(
    source: str,
    *,
    checkpoint: str = "latest",
    config: Config | None = None,
    cache_dir: Path | None = None,
    token: str | None = None,
) -> Choice:
    """Blocking ``alatest`` (not from inside a running event loop)."""
    return asyncio.run(
        alatest(source, checkpoint=checkpoint, config=config, cache_dir=cache_dir, token=token)
    )


# ------------------------------------------------------------------------------ DCP reader


@dataclass(frozen=True, slots=True)
class ReaderStatistics:
    """What a ``DCPReader`` moved: bytes read from the origin, in how many ranges."""

    bytes_read: int
    ranges: int
    checkpoint: str | None


def _coalesce(spans: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted, merged ``[start, end)`` ranges; ranges closer than ``gap`` become one."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def __getattr__(name: str) -> Any:
    """``DCPReader`` is built on first use, so importing this module never imports torch."""
    if name == "DCPReader":
        return _dcp_reader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_DCP_READER: Any = None


def _dcp_reader_class() -> Any:
    global _DCP_READER
    if _DCP_READER is not None:
        return _DCP_READER
    import io

    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.storage import StorageReader
    from torch.futures import Future

    from shardsync.errors import LoadError

    class DCPReader(StorageReader):
        """A ``torch.distributed.checkpoint`` reader of a training run at ``source`` (an
        ``s3://`` prefix, a directory, any origin): ``dcp.load(state_dict,
        storage_reader=DCPReader("s3://bucket/run/"))`` reads only the byte ranges its load
        plan names (close ranges merged), straight from the origin, several at once."""

        def __init__(
            self,
            source: str,
            checkpoint: str = "latest",
            *,
            cache_dir: Path | None = None,
            config: Config | None = None,
            token: str | None = None,
            origin: Origin | None = None,
            merge_gap: int = 64 << 10,
        ) -> None:
            super().__init__()
            self.source = source
            self.checkpoint = checkpoint
            self.config = config or load_config(None, cache_dir=cache_dir)
            self.token = token
            self._origin = origin  # injected (tests count what it serves)
            self.merge_gap = merge_gap
            self.choice: Choice | None = None
            self.storage_data: dict[Any, Any] = {}
            self._bytes = 0
            self._ranges = 0

        # -- the StorageReader protocol

        def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
            if checkpoint_id:
                self.source = str(checkpoint_id)
            self.storage_data = {}

        @property
        def checkpoint_id(self) -> str:
            return self.source

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
            return False

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            choice = asyncio.run(self._with_origin(self._resolve))
            if choice.dcp is None or choice.dcp_dir is None:
                raise LoadError(f"{self.source}: {choice.name} is not a DCP checkpoint")
            self.choice = choice
            metadata = choice.dcp.metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            return metadata  # type: ignore[no-any-return]

        def set_up_storage_reader(
            self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
        ) -> None:
            self.storage_data = dict(metadata.storage_data)

        def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
            return plan

        def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
            return plans

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                if info.transform_descriptors:
                    raise LoadError(f"{info.relative_path}: transformed (compressed) entries")
                per_file.setdefault(info.relative_path, []).append(item)
            spans = {
                rel: _coalesce(
                    [
                        (
                            self.storage_data[i.storage_index].offset,
                            self.storage_data[i.storage_index].offset
                            + self.storage_data[i.storage_index].length,
                        )
                        for i in items
                    ],
                    self.merge_gap,
                )
                for rel, items in per_file.items()
            }
            data = asyncio.run(self._with_origin(lambda o, f: self._fetch(o, f, spans)))
            for rel, items in per_file.items():
                for item in items:
                    info = self.storage_data[item.storage_index]
                    start, blob = next(
                        (s, b)
                        for (s, e), b in zip(spans[rel], data[rel], strict=True)
                        if s <= info.offset and info.offset + info.length <= e
                    )
                    view = blob[info.offset - start : info.offset - start + info.length]
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(view))
                        continue
                    tensor = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
                    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != tensor.size():
                        raise LoadError(
                            f"{item.storage_index}: size {tuple(tensor.size())} in the "
                            f"checkpoint, {tuple(target.size())} in the state dict"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
            done: Future[None] = Future()
            done.set_result(None)
            return done

        # -- ours

        def statistics(self) -> ReaderStatistics:
            return ReaderStatistics(
                self._bytes, self._ranges, self.choice.name if self.choice else None
            )

        async def _with_origin(self, work: Any) -> Any:
            engine = Engine(self.config)
            origin = self._origin or engine.origin(self.source, token=self.token)
            async with engine:
                return await work(origin, engine.fetcher)

        async def _resolve(self, origin: Origin, fetcher: Fetcher) -> Choice:
            listing = await origin.list_files(fetcher, origin.default_revision, hidden=True)
            return await resolve(origin, fetcher, listing, self.checkpoint)

        async def _fetch(
            self, origin: Origin, fetcher: Fetcher, spans: Mapping[str, list[tuple[int, int]]]
        ) -> dict[str, list[bytes]]:
            assert self.choice is not None and self.choice.dcp_dir is not None
            folder = self.choice.dcp_dir
            sizes = dict(self.choice.files)
            limit = asyncio.Semaphore(self.config.max_files * 2)

            async def one(rel: str, start: int, end: int) -> bytes:
                path = f"{folder}/{rel}" if folder else rel
                entry = RemoteFile(path, sizes.get(path), None)
                async with limit:
                    blob = await origin.read_range(fetcher, None, entry, start, end)
                if len(blob) != end - start:
                    raise LoadError(f"{path}: {len(blob)} bytes at {start}, wanted {end - start}")
                self._bytes += len(blob)
                self._ranges += 1
                return blob

            async with asyncio.TaskGroup() as tg:
                tasks = {
                    rel: [tg.create_task(one(rel, s, e)) for s, e in ranges]
                    for rel, ranges in spans.items()
                }
            return {rel: [t.result() for t in ts] for rel, ts in tasks.items()}

    _DCP_READER = DCPReader
    return DCPReader
