"""The engine end to end against the fake hub: clean runs, faults, hostile input, HF interop."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import (
    SleepRecorder,
    assert_snapshot_matches,
    assert_store_verified,
    fast_config,
    open_under,
    until,
)
from huggingface_hub import snapshot_download

from shardsync.digest import Digest
from shardsync.errors import (
    AuthError,
    IntegrityError,
    ManifestError,
    OfflineError,
    RepoNotFoundError,
    RevisionNotFoundError,
    UnsafeNameError,
)
from shardsync.manifest import RemoteFile
from shardsync.prefetch import Engine, prefetch
from shardsync.records import FileOutcome
from shardsync.store import AsyncStore
from shardsync.testing import (
    Bandwidth,
    ChangeEtag,
    Checkpoint,
    CutBody,
    FakeHub,
    Fault,
    FlipByte,
    IgnoreRange,
    Latency,
    SlowDrip,
    Stall,
    Status,
    WrongContentRange,
    build_checkpoint,
)

REPO = "acme/tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt"), total_bytes=6 << 20, n_shards=3, seed=1
    )


@pytest.fixture
async def hub(checkpoint: Checkpoint) -> AsyncIterator[FakeHub]:
    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, checkpoint)
        yield hub


async def test_clean_prefetch_is_byte_identical(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    result = await prefetch(REPO, fast_config(tmp_path, hub.endpoint))
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert_store_verified(tmp_path, checkpoint)
    shards = [f for f in result.files if f.path.endswith(".safetensors")]
    assert [f.path for f in shards] == list(checkpoint.shards)  # index order
    assert {f.verified for f in shards} == {"sha256"}
    assert {f.verified for f in result.files if not f.path.endswith(".safetensors")} == {"git-sha1"}
    # several Range requests per shard, all from the CDN host
    ranged = [r for r in hub.log if r.server == "cdn" and r.range]
    assert len(ranged) >= 3 * 4


async def test_the_first_shards_are_located_while_the_index_downloads(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Each shard's resolve (and the CDN's HEAD) goes out while the slow index downloads,
    not after it, and once: the download takes the answer instead of asking again."""
    hub.faults.add(Latency(0.5, path="*.index.json", server="hub", times=None))
    result = await prefetch(REPO, fast_config(tmp_path, hub.endpoint))
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    log = hub.log
    index_got = next(
        i for i, r in enumerate(log) if r.method == "GET" and r.file == checkpoint.index
    )
    for shard in checkpoint.shards:
        resolves = [i for i, r in enumerate(log) if r.method == "HEAD" and r.server == "hub"
                    and r.file == shard]  # fmt: skip
        assert len(resolves) == 1, shard
        assert resolves[0] < index_got, shard  # answered before the index was


@pytest.mark.parametrize("revision", [None, "main", "refs/pr/1", "v1.0 beta", "a" * 40])
@pytest.mark.parametrize(
    "path",
    [
        "model-00001-of-00002.safetensors",
        "sub dir/file (1).json",
        "ünï/cøde.bin",
        "a b+c=d&e;f@g.bin",
    ],
)
def test_a_resolve_url_is_the_one_huggingface_hub_builds(path: str, revision: str | None) -> None:
    """The resolve URL is built by hand (``hf_hub_url``'s module costs 7 ms to import before
    the first request): it must stay what huggingface_hub itself asks for."""
    import huggingface_hub

    from shardsync.origins.hub import HubOrigin

    for endpoint in ("http://127.0.0.1:8080", "https://hub.example.com/mirror"):
        origin = HubOrigin.create("org/model-x", endpoint=endpoint, token="t")
        mine = origin.request_for(revision, RemoteFile(path, 10, None)).url
        theirs = huggingface_hub.hf_hub_url(
            "org/model-x", path, revision=revision, endpoint=endpoint
        )
        assert mine == theirs


async def test_a_shard_located_ahead_is_not_handed_to_another_token(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """In the daemon one fetcher serves every client: what one token found is never what
    another token's download uses."""
    import aiohttp

    from shardsync.fetch.fetcher import Fetcher
    from shardsync.origins.hub import HubOrigin

    shard = checkpoint.shards[0]
    entry = RemoteFile(shard, checkpoint.path(shard).stat().st_size, None)
    mine = HubOrigin.create(REPO, endpoint=hub.endpoint, token="token-a")
    theirs = HubOrigin.create(REPO, endpoint=hub.endpoint, token="token-b")
    async with aiohttp.ClientSession() as session:
        fetcher = Fetcher(session, fast_config(tmp_path).fetch)
        forget = mine.locate_ahead(fetcher, None, entry)
        await fetcher._locate_first(theirs.request_for(None, entry))
        await fetcher._locate_first(mine.request_for(None, entry))
        forget()
    tokens = sorted(
        r.headers.get("Authorization", "")
        for r in hub.log
        if r.method == "HEAD" and r.server == "hub" and r.file == shard
    )
    assert tokens == ["Bearer token-a", "Bearer token-b"]  # b asked itself; a took its own


async def test_second_run_downloads_no_shard(hub: FakeHub, tmp_path: Path) -> None:
    config = fast_config(tmp_path, hub.endpoint)
    first = await prefetch(REPO, config)
    hub.reset_log()
    second = await prefetch(REPO, config)
    assert second.snapshot_path == first.snapshot_path
    assert hub.bytes_served() == 0
    assert {f.source for f in second.files} == {"cache"}
    assert [r.server for r in hub.log] == ["hub"]  # one API call, nothing else


async def test_offline_makes_no_request(hub: FakeHub, tmp_path: Path) -> None:
    config = fast_config(tmp_path, hub.endpoint)
    with pytest.raises(OfflineError, match="not complete"):
        await prefetch(REPO, config, offline=True)
    online = await prefetch(REPO, config)
    hub.reset_log()
    offline = await prefetch(REPO, config, offline=True)
    assert offline.snapshot_path == online.snapshot_path
    assert hub.log == []


async def test_identical_bytes_are_stored_once(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    hub.add_checkpoint("acme/tiny-copy", checkpoint)
    config = fast_config(tmp_path, hub.endpoint)
    await prefetch(REPO, config)
    hub.reset_log()
    copy = await prefetch("acme/tiny-copy", config)
    assert hub.bytes_served("*.safetensors") == 0
    shard = copy.snapshot_path / checkpoint.shards[0]
    assert shard.stat().st_nlink == 3  # store + two repos' blobs/


FAULTS: list[tuple[str, list[Fault]]] = [
    ("cut-body", [CutBody(times=6)]),
    ("503-storm", [Status(503, times=12)]),
    ("429-retry-after", [Status(429, retry_after="2", times=3)]),
    ("range-ignored", [IgnoreRange(times=2)]),
    ("wrong-content-range", [WrongContentRange(times=3)]),
    ("stalled", [Stall(30, times=2)]),
    ("etag-changed", [CutBody(times=1, path="model-00002*"), ChangeEtag(path="model-00002*")]),
]


@pytest.mark.parametrize(("name", "faults"), FAULTS, ids=[n for n, _ in FAULTS])
async def test_faults_end_byte_identical(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, name: str, faults: list[Fault]
) -> None:
    for fault in faults:
        hub.faults.add(fault)
    sleep = SleepRecorder()
    config = fast_config(tmp_path, hub.endpoint, read_timeout=0.5)
    result = await prefetch(REPO, config, sleep=sleep)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert_store_verified(tmp_path, checkpoint)
    assert all(rule.exhausted for rule in hub.faults.rules if rule.fault.times is not None)
    if name == "429-retry-after":
        assert max(sleep.delays) >= 2.0  # the server's Retry-After was honoured
    if name != "range-ignored":
        # partial progress was kept: far less than one extra copy was transferred
        assert hub.bytes_served("*.safetensors") < 1.5 * _shard_bytes(checkpoint)


async def test_slow_drip_trips_the_watchdog(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    hub.faults.add(SlowDrip(2000, times=1))
    config = fast_config(tmp_path, hub.endpoint, min_throughput=50_000, throughput_window=0.3)
    result = await prefetch(REPO, config, sleep=SleepRecorder())
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert result.fetch is not None and result.fetch.retries.get("stalled", 0) >= 1


async def test_an_api_answer_that_trickles_trips_the_watchdog(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """The revision listing (1.4 KB) at 20 B/s, in small writes that each beat the read
    timeout: a mirror like that held the job for ever, where a shard's body is given up
    on under ``min_throughput``. The listing is asked again and the job completes."""
    hub.faults.add(SlowDrip(20, server="hub", path="*", times=1))
    config = fast_config(tmp_path, hub.endpoint, min_throughput=50_000, throughput_window=0.3)
    async with asyncio.timeout(30):
        result = await prefetch(REPO, config, sleep=SleepRecorder())
    assert_snapshot_matches(result.snapshot_path, checkpoint)


async def test_flipped_byte_refetches_only_that_file(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    bad = checkpoint.shards[1]
    hub.faults.add(FlipByte(times=1, path=bad))
    result = await prefetch(REPO, fast_config(tmp_path, hub.endpoint))
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert_store_verified(tmp_path, checkpoint)
    size = checkpoint.path(bad).stat().st_size
    assert hub.bytes_served(bad) == 2 * size
    for other in checkpoint.shards:
        if other != bad:
            assert hub.bytes_served(other) == checkpoint.path(other).stat().st_size
    assert result.fetch is not None and result.fetch.verify_failures == 1


async def test_persistent_corruption_is_a_clear_error(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    bad = checkpoint.shards[0]
    hub.faults.add(FlipByte(path=bad, times=None))
    with pytest.raises(IntegrityError, match=f"{bad}: hash mismatch after 3 downloads"):
        await prefetch(REPO, fast_config(tmp_path, hub.endpoint))
    assert_store_verified(tmp_path, checkpoint)
    assert not (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").exists()


async def test_token_goes_to_the_hub_never_to_the_cdn(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    async with FakeHub() as hub:
        hub.add_checkpoint("acme/private", checkpoint, gated=True, token="hf_secret")
        config = fast_config(tmp_path, hub.endpoint)
        with pytest.raises(AuthError):
            await prefetch("acme/private", config, token="hf_wrong")
        hub.reset_log()
        result = await prefetch("acme/private", config, token="hf_secret")
        assert_snapshot_matches(result.snapshot_path, checkpoint)
        hub_requests = [r for r in hub.log if r.server == "hub"]
        cdn_requests = [r for r in hub.log if r.server == "cdn"]
        assert hub_requests and cdn_requests
        assert all(r.headers.get("Authorization") == "Bearer hf_secret" for r in hub_requests)
        assert not any("Authorization" in r.headers for r in cdn_requests)


async def test_missing_repo_and_revision(hub: FakeHub, tmp_path: Path) -> None:
    config = fast_config(tmp_path, hub.endpoint)
    with pytest.raises(RepoNotFoundError):
        await prefetch("acme/nope", config)
    with pytest.raises(RevisionNotFoundError):
        await prefetch(REPO, config, revision="v9")


async def test_pr_revision(hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path) -> None:
    commit = hub.add_checkpoint(REPO, checkpoint, revision="refs/pr/1")
    result = await prefetch(REPO, fast_config(tmp_path, hub.endpoint), revision="refs/pr/1")
    assert result.commit == commit
    ref = tmp_path / "hub" / "models--acme--tiny" / "refs" / "refs" / "pr" / "1"
    assert ref.read_text() == commit


@pytest.mark.parametrize(
    "evil",
    [
        "../evil.safetensors",
        "/etc/evil.safetensors",
        "%2e%2e/evil.safetensors",
        "a/../../evil.safetensors",
    ],
)
async def test_hostile_weight_map_refused_before_any_request(
    checkpoint: Checkpoint, tmp_path: Path, evil: str
) -> None:
    index = {
        "metadata": {},
        "weight_map": {"a.weight": "model-00001-of-00001.safetensors", "b.weight": evil},
    }
    files = {
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00001.safetensors": checkpoint.path(checkpoint.shards[0]).read_bytes(),
    }
    async with FakeHub() as hub:
        hub.add_repo("acme/hostile", files)
        with pytest.raises(UnsafeNameError):
            await prefetch("acme/hostile", fast_config(tmp_path, hub.endpoint))
        assert not any("evil.safetensors" in r.path for r in hub.log)
        # the API call, the index, and the listed shard located while the index downloaded
        # (HEADs only): no body byte of a shard was asked for
        asked = {(r.file, r.method) for r in hub.log if r.file != "model.safetensors.index.json"}
        assert asked <= {(None, "GET"), ("model-00001-of-00001.safetensors", "HEAD")}


async def test_an_index_larger_than_any_is_refused_before_a_byte_of_it(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """The listing gives the index's size: one over 64 MiB (a hostile repo's, 65 MiB here)
    is a ``ManifestError`` (exit 5) before it is fetched, not gigabytes downloaded, stored
    and linked, then a ``CacheError``."""
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}
    padded = json.dumps(index).encode() + b" " * (65 << 20)
    files = {
        "model.safetensors.index.json": padded,
        "model-00001-of-00001.safetensors": checkpoint.path(checkpoint.shards[0]).read_bytes(),
    }
    async with FakeHub() as hub:
        hub.add_repo("acme/huge-index", files)
        with pytest.raises(ManifestError):
            await prefetch("acme/huge-index", fast_config(tmp_path, hub.endpoint))
        assert hub.bytes_served("*.index.json") == 0


async def test_hf_reads_our_cache_offline(hub: FakeHub, tmp_path: Path) -> None:
    result = await prefetch(REPO, fast_config(tmp_path, hub.endpoint))
    script = f"""
import json, warnings
warnings.simplefilter("error")
from huggingface_hub import scan_cache_dir, snapshot_download, hf_hub_download
info = scan_cache_dir()
assert not info.warnings, info.warnings
path = snapshot_download({REPO!r})
index = hf_hub_download({REPO!r}, "model.safetensors.index.json")
from safetensors.torch import load_file
shards = sorted(set(json.load(open(index))["weight_map"].values()))
n = sum(len(load_file(path + "/" + s)) for s in shards)
print(json.dumps({{"path": path, "repos": [r.repo_id for r in info.repos], "tensors": n}}))
"""
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",  # would fail loudly if anything went online
    }
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["path"] == str(result.snapshot_path)
    assert answer["repos"] == [REPO]
    assert answer["tensors"] > 0


def _shard_bytes(checkpoint: Checkpoint) -> int:
    return sum(checkpoint.path(s).stat().st_size for s in checkpoint.shards)


async def test_single_file_checkpoint(tmp_path: Path) -> None:
    single = build_checkpoint(tmp_path / "single", total_bytes=2 << 20, n_shards=1, seed=3)
    assert "model.safetensors" in single.files
    async with FakeHub() as hub:
        hub.add_checkpoint("acme/single", single)
        result = await prefetch("acme/single", fast_config(tmp_path / "cache", hub.endpoint))
    assert_snapshot_matches(result.snapshot_path, single)
    assert result.files[0].path == "model.safetensors"


async def test_include_and_exclude(hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path) -> None:
    config = fast_config(tmp_path, hub.endpoint)
    result = await prefetch(
        REPO, config, include=["config.json", "tokenizer*"], exclude=["tokenizer_config.json"]
    )
    got = {f.path for f in result.files}
    assert got == {
        "model.safetensors.index.json",
        *checkpoint.shards,
        "config.json",
        "tokenizer.json",
    }
    assert not (result.snapshot_path / "README.md").exists()
    # a later run asking for more files reuses every shard
    hub.reset_log()
    more = await prefetch(REPO, config)
    assert hub.bytes_served("*.safetensors") == 0
    assert_snapshot_matches(more.snapshot_path, checkpoint)


async def test_blob_pruned_between_check_and_reuse_is_downloaded(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add_checkpoint("acme/twin", checkpoint)
    config = fast_config(tmp_path, hub.endpoint)
    await prefetch(REPO, config)
    hashed = AsyncStore.hash_blob
    gone: list[Path] = []

    async def pruned_meanwhile(self: AsyncStore, sha256: str) -> Digest:
        if not gone:  # a concurrent prune unlinks the first shared blob we look at
            path = self.sync.blob_path(sha256)
            path.unlink()
            gone.append(path)
        return await hashed(self, sha256)

    monkeypatch.setattr(AsyncStore, "hash_blob", pruned_meanwhile)
    hub.reset_log()
    twin = await prefetch("acme/twin", config)
    assert_snapshot_matches(twin.snapshot_path, checkpoint)
    assert gone and gone[0].exists()  # downloaded again and republished
    assert hub.bytes_served("*.safetensors") == gone[0].stat().st_size


class _Finished:
    """A progress sink that lists files in the order they are done."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def add_file(self, path: str, size: int | None) -> None:
        return None

    def advance(self, path: str, nbytes: int) -> None:
        return None

    def file_done(self, outcome: FileOutcome) -> None:
        self.order.append(outcome.path)


async def test_small_files_do_not_wait_behind_the_shards(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Configs and tokenizers cost round trips, not bandwidth: with one file at a time they
    waited until every shard was in (0.5 s at the end of a 2 GB download)."""
    hub.faults.add(Bandwidth(2_000_000, path="*.safetensors"))  # 2 MB shards: about 0.5 s each
    finished = _Finished()
    config = fast_config(tmp_path, hub.endpoint)
    result = await prefetch(REPO, replace(config, max_files=1), progress=finished)
    shards = set(checkpoint.shards)
    first_shard = min(finished.order.index(s) for s in shards)
    small = [p for p in finished.order if p not in shards]
    assert small and all(finished.order.index(p) < first_shard for p in small), finished.order
    assert_snapshot_matches(result.snapshot_path, checkpoint)


class _Turns:
    """A progress sink that notes, as each file is verified, the bytes every file has got."""

    def __init__(self) -> None:
        self.got: dict[str, int] = {}
        self.at_verified: list[tuple[str, dict[str, int]]] = []

    def add_file(self, path: str, size: int | None) -> None:
        return None

    def advance(self, path: str, nbytes: int) -> None:
        self.got[path] = self.got.get(path, 0) + nbytes

    def file_done(self, outcome: FileOutcome) -> None:
        self.at_verified.append((outcome.path, dict(self.got)))


@pytest.mark.parametrize("in_order", [True, False])
async def test_a_stream_gets_each_shard_in_its_turn_with_every_connection(
    tmp_path: Path, in_order: bool
) -> None:
    """For a consumer that reads the shards in index order: side by side at equal rates
    every shard was verified at the end, and a stream could place none before. In their turn
    they are verified in index order, shard k before any byte of shard k+2 arrived, and a
    shard holds more than ``connections_per_file`` connections (those of ``max_files``
    files). The next shard starts at the tail of the one before, on the connections it lets
    go of. Without ``in_order`` the files keep going side by side, each within its own
    connections (a prefetch's fastest way on a host with many cores)."""
    model = build_checkpoint(tmp_path / "ckpt", total_bytes=8 << 20, n_shards=4, seed=7)
    turns = _Turns()
    most: Counter[str] = Counter()
    together: set[tuple[str, str]] = set()  # two files' bodies streaming at once
    config = fast_config(tmp_path / "cache", connections_per_file=2)
    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, model)
        hub.faults.add(Bandwidth(1_000_000, path="*.safetensors"))  # per connection
        config = replace(config, endpoint=hub.endpoint)

        async def watch() -> None:
            while True:
                now = hub.in_flight()
                together.update(itertools.pairwise(sorted(p for p, n in now.items() if n)))
                for path, n in now.items():
                    most[path] = max(most[path], n)
                await asyncio.sleep(0.01)

        async with Engine(config) as engine:
            job = engine.job(engine.origin(REPO), sink=turns, in_order=in_order)
            watcher = asyncio.create_task(watch())
            try:
                await job.prepare()
                await job.download()
            finally:
                watcher.cancel()
        assert_snapshot_matches(job.snapshot_path, model)
    shards = list(model.shards)
    verified = [(path, got) for path, got in turns.at_verified if path in model.shards]
    order = [path for path, _ in verified]
    after_next = [got.get(shards[k + 2], 0) for k, (_, got) in enumerate(verified[:-2])]
    early = not any(after_next)  # shard k verified before shard k+2 got a byte
    # the next shard starts at the tail of the one before, not after it: its bytes arrive
    # before the one before is verified, or (under load, when that one's last ranges end
    # within moments of each other) the two are seen streaming at once
    overlapped = any(got.get(shards[k + 1], 0) for k, (_, got) in enumerate(verified[:-1]))
    overlapped = overlapped or any(pair in together for pair in itertools.pairwise(shards))
    cap = config.fetch.connections_per_file
    if in_order:
        assert order == list(model.shards)
        assert early and overlapped, turns.at_verified
        assert max(most[s] for s in model.shards) > cap, most
    else:
        assert not early  # all four side by side: the test can tell the two apart
        assert max(most[s] for s in model.shards) <= cap, most


async def test_a_small_file_is_one_get_that_follows_its_redirect(tmp_path: Path) -> None:
    """A file of at most ``SMALL_FILE`` with a known hash costs one GET per hop: no HEAD
    before it (the index's was a round trip before every shard's first byte), no Range, the
    CDN's redirect followed by the GET itself, and still verified against the listing."""
    tiny = build_checkpoint(tmp_path / "ckpt", total_bytes=1 << 20, n_shards=2, seed=5)
    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, tiny)
        result = await prefetch(REPO, fast_config(tmp_path / "cache", hub.endpoint))
        log = hub.log
    assert_snapshot_matches(result.snapshot_path, tiny)
    assert {f.verified for f in result.files} == {"sha256", "git-sha1"}
    for path in tiny.files:
        asked = [(r.server, r.method, r.range) for r in log if r.file == path]
        if path.endswith(".safetensors"):  # in LFS: the Hub redirects to the CDN
            assert asked == [("hub", "GET", None), ("cdn", "GET", None)], path
        else:
            assert asked == [("hub", "GET", None)], path


async def test_cancels_during_a_downloads_cleanup_leave_no_thread_or_descriptor(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A cancel that lands while a cancelled download still waits for its threads (a task
    group's abort, then a stray second one) does not stop that cleanup halfway: no pump
    thread still runs and no descriptor of the partial stays open."""
    import threading

    import aiohttp

    from shardsync.cache import CacheStore
    from shardsync.fetch.fetcher import Fetcher
    from shardsync.origins.hub import HubOrigin

    def pumps() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "shardsync-pump"]

    assert pumps() == []
    shard = checkpoint.shards[0]
    entry = RemoteFile(shard, checkpoint.path(shard).stat().st_size, None)
    origin = HubOrigin.create(REPO, endpoint=hub.endpoint, token=None)
    store = AsyncStore(CacheStore(tmp_path / "cache"))
    hub.faults.add(Latency(0.5, server="cdn"))  # each answer's head: threads wait that long
    async with aiohttp.ClientSession() as session:
        fetcher = Fetcher(session, fast_config(tmp_path).fetch)
        async with await store.slot("blob") as slot:
            task = asyncio.create_task(fetcher.fetch(origin.request_for(None, entry), slot))
            await until(lambda: any(r.server == "cdn" and r.method == "HEAD" for r in hub.log))
            await asyncio.sleep(0.2)  # the first range requests wait for their answers
            while not task.done():  # again and again: some land during the cleanup
                task.cancel()
                await asyncio.sleep(0.002)
            with pytest.raises(asyncio.CancelledError):
                await task
    assert pumps() == []
    assert open_under(tmp_path) == []


async def test_an_engine_keeps_a_bounded_number_of_origins(tmp_path: Path) -> None:
    """A daemon asks its engine for the origin of each source a client names, one that does
    not exist included; every one used to be kept for the daemon's life (600 requests, 600
    origins). The recent ones still are."""
    import gc

    from shardsync.origins.hub import HubOrigin

    def hub_origins() -> int:
        gc.collect()
        return sum(type(o) is HubOrigin for o in gc.get_objects())

    before = hub_origins()
    async with Engine(fast_config(tmp_path / "cache", "http://127.0.0.1:9")) as engine:
        for i in range(1000):
            engine.origin(f"acme/model-{i}")
        assert hub_origins() - before <= 100
        assert engine.origin("acme/model-999") is engine.origin("acme/model-999")


async def test_a_job_that_read_its_branch_first_and_ends_last_sets_no_branch_back(
    hub: FakeHub, tmp_path: Path
) -> None:
    """Two jobs for ``main``: the first reads it, the branch moves, the second reads the new
    commit and ends first. The first, ending last, wrote its older commit into ``refs/main``:
    huggingface_hub offline then read the old model (found through the daemon, whose jobs
    for one branch with other selections run side by side)."""
    newer_model = build_checkpoint(tmp_path / "v2", total_bytes=1 << 20, n_shards=2, seed=7)
    cache = tmp_path / "cache"
    async with Engine(fast_config(cache, hub.endpoint)) as engine:
        older = engine.job(engine.origin(REPO))
        await older.prepare()
        newer_commit = hub.add_checkpoint(REPO, newer_model)  # main moves
        newer = engine.job(engine.origin(REPO))
        await newer.prepare()
        await newer.download()
        await older.download()
    snapshot = await asyncio.to_thread(
        snapshot_download, REPO, cache_dir=cache / "hub", local_files_only=True
    )
    assert Path(snapshot).name == newer_commit
    assert_snapshot_matches(Path(snapshot), newer_model)
