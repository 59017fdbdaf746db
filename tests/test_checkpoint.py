"""`shardsync.checkpoint.DCPReader`: `dcp.load` straight from a run's origin, reading only the
byte ranges its plan names (counted by a wrapper around the origin, and on SeaweedFS)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from helpers import fast_config
from test_training import WORLD, dcp_expected, load_equal, runs  # noqa: F401 - fixture

from shardsync.cache import RepoRef
from shardsync.checkpoint import DCPReader
from shardsync.fetch import FetchedBlob, Fetcher
from shardsync.manifest import Listing, ManifestEntry
from shardsync.origins import LocalOrigin, Slot
from shardsync.origins.base import Entry, Progress


@dataclass
class CountingOrigin:
    """A local directory that counts the bytes it serves by range."""

    inner: LocalOrigin
    served: dict[str, int] = field(default_factory=dict)

    @property
    def repo(self) -> RepoRef:
        return self.inner.repo

    @property
    def default_revision(self) -> str:
        return self.inner.default_revision

    @property
    def caller_only(self) -> bool:
        return True

    async def list_files(self, fetcher: Fetcher, revision: str, *, hidden: bool = False) -> Listing:
        return await self.inner.list_files(fetcher, revision, hidden=hidden)

    async def version(self, fetcher: Fetcher, entry: Entry) -> str | None:
        return await self.inner.version(fetcher, entry)

    async def read_range(
        self, fetcher: Fetcher, commit: str | None, entry: Entry, start: int, end: int
    ) -> bytes:
        data = await self.inner.read_range(fetcher, commit, entry, start, end)
        self.served[entry.path] = self.served.get(entry.path, 0) + len(data)
        return data

    async def download(
        self, fetcher: Fetcher, commit: str | None, entry: ManifestEntry, slot: Slot,
        progress: Progress,
    ) -> FetchedBlob:  # fmt: skip
        raise AssertionError("the reader never downloads whole files")

    async def aclose(self) -> None:
        return None


def _load(reader: Any, template: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    state = {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in template.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _data_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob("*.distcp"))


def test_dcp_reader_loads_exactly_what_was_saved_and_reads_only_what_the_plan_needs(
    runs: dict[str, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    config = fast_config(tmp_path / "cache")
    root = runs["dcp"]
    expected = dcp_expected(200)

    counting = CountingOrigin(LocalOrigin.from_path(str(root)))
    reader = DCPReader(str(root), config=config, origin=counting)
    load_equal(_load(reader, expected), expected)
    data = {p: n for p, n in counting.served.items() if p.endswith(".distcp")}
    whole = _data_bytes(root / "step-200")
    assert reader.statistics().checkpoint == "step-200"
    assert sum(data.values()) == reader.statistics().bytes_read <= whole

    one_rank = {"rank1.w": expected["rank1.w"]}  # what one rank of 4 would hold: ~1/4
    counting = CountingOrigin(LocalOrigin.from_path(str(root)))
    reader = DCPReader(str(root), config=config, origin=counting)
    load_equal(_load(reader, one_rank), one_rank)
    moved = sum(n for p, n in counting.served.items() if p.endswith(".distcp"))
    share = moved / whole
    print(f"DCPReader: 1 of {len(expected)} entries moved {moved} of {whole} bytes ({share:.0%})")
    assert moved == reader.statistics().bytes_read
    assert expected["rank1.w"].numel() * 4 <= moved < 0.35 * whole
    assert set(counting.served) <= {
        "step-200/.metadata",
        *(f"step-200/{p.name}" for p in (root / "step-200").glob("__1_*")),
    }

    older = DCPReader(str(root), "step-100", config=config)
    load_equal(_load(older, dcp_expected(100)), dcp_expected(100))


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
    config = s3_config(tmp_path / "cache", s3server)
    expected = dcp_expected(200)
    reader = DCPReader(f"s3://{s3bucket}/run/", config=config)
    load_equal(_load(reader, expected), expected)
    stats = reader.statistics()
    assert stats.checkpoint == "step-200"
    part = DCPReader(f"s3://{s3bucket}/run/", config=config)
    load_equal(
        _load(part, {"shared.emb": expected["shared.emb"]}), {"shared.emb": expected["shared.emb"]}
    )
    assert part.statistics().bytes_read < 0.25 * stats.bytes_read
    assert WORLD == 2
