"""Pruning: the pure planner (table-driven), then ``prune_cache`` on real caches and processes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import (
    OnFileDone,
    assert_snapshot_matches,
    assert_store_verified,
    fast_config,
    sha256_file,
    tmpfs,
)
from huggingface_hub import hf_hub_download, scan_cache_dir

from shardsync.cache import CacheStore
from shardsync.config import PruneConfig, load_config, parse_duration
from shardsync.errors import CacheError, ConfigError, DiskFullError
from shardsync.inventory import scan
from shardsync.prefetch import prefetch
from shardsync.prune import (
    PruneReport,
    ensure_free,
    limits_from_config,
    needs_prune,
    prune_cache,
)
from shardsync.prune_plan import Blob, CacheView, Leftover, Limits, Unit, matches, plan_prune
from shardsync.records import PrefetchResult, RepoRef
from shardsync.removal import CacheRemoval
from shardsync.snapshot_use import AccessLog, Leases, prune_gate
from shardsync.testing import Checkpoint, FakeHub, build_checkpoint, serve_in_thread
from shardsync.verify import verify_cache

# --------------------------------------------------------------------------- the planner

NOW = 10_000.0
DAY = 86400.0


def unit(name: str, used: float, blobs: str, **kw: object) -> Unit:
    """A snapshot named ``name`` (its commit too), last used at ``used``, holding ``blobs``
    (one letter per blob)."""
    return Unit(
        dirname=f"models--o--{name}",
        commit=name * 40 if len(name) == 1 else name,
        repo=f"o/{name}",
        complete=bool(kw.get("complete", True)),
        last_used=used,
        blobs=frozenset(blobs),
        protected=kw.get("protected"),  # type: ignore[arg-type]
    )


def blobs(**sizes: int) -> tuple[Blob, ...]:
    return tuple(Blob(name, size, NOW) for name, size in sizes.items())


@dataclass(frozen=True)
class Case:
    name: str
    view: CacheView
    limits: Limits
    evicted: list[tuple[str, str]]  # (repo, reason) in eviction order
    unmet: tuple[str, ...] = ()
    orphans: tuple[str, ...] = ()
    leftovers: tuple[str, ...] = ()


THREE = (unit("a", 1, "x"), unit("b", 2, "y"), unit("c", 3, "z"))
SIZES = blobs(x=100, y=100, z=100)

CASES = [
    Case("no limits: nothing goes", CacheView(NOW, THREE, SIZES), Limits(), []),
    Case(
        "cap fits one: least recently used go first",
        CacheView(NOW, THREE, SIZES),
        Limits(max_size=100),
        [("o/a", "max_size"), ("o/b", "max_size")],
    ),
    Case(
        "LRU is by last use, not by name",
        CacheView(NOW, (unit("a", 9, "x"), unit("b", 2, "y"), unit("c", 3, "z")), SIZES),
        Limits(max_size=100),
        [("o/b", "max_size"), ("o/c", "max_size")],
    ),
    Case(
        "a blob shared with a kept snapshot frees nothing until both go",
        CacheView(NOW, (unit("a", 1, "xs"), unit("b", 2, "ys")), blobs(x=100, y=100, s=50)),
        Limits(max_size=150),
        [("o/a", "max_size")],
    ),
    Case(
        "pinned, kept and leased are never touched, even when the cap is missed",
        CacheView(
            NOW,
            (
                unit("a", 1, "x", protected="pinned"),
                unit("b", 2, "y", protected="leased"),
                unit("c", 3, "z", protected="keep"),
            ),
            SIZES,
        ),
        Limits(max_size=0),
        [],
        unmet=("max_size",),
    ),
    Case(
        "the oldest is pinned: the next ones go",
        CacheView(NOW, (unit("a", 1, "x", protected="pinned"), *THREE[1:]), SIZES),
        Limits(max_size=100),
        [("o/b", "max_size"), ("o/c", "max_size")],
    ),
    Case(
        "a snapshot whose bytes a pinned one holds frees nothing: skipped",
        CacheView(
            NOW,
            (unit("a", 1, "x"), unit("b", 2, "xy", protected="pinned"), unit("c", 3, "z")),
            SIZES,
        ),
        Limits(max_size=200),
        [("o/c", "max_size")],
    ),
    Case(
        "max_age evicts what was unused that long, whatever the size",
        CacheView(NOW, (unit("a", NOW - 2 * DAY, "x"), unit("b", NOW - 10, "y")), SIZES),
        Limits(max_age=DAY),
        [("o/a", "max_age")],
    ),
    Case(
        "min_free: evict until the filesystem has enough",
        CacheView(NOW, THREE, SIZES, free_bytes=50),
        Limits(min_free=200),
        [("o/a", "min_free"), ("o/b", "min_free")],
    ),
    Case(
        "min_free without a free-space reading cannot be judged",
        CacheView(NOW, THREE, SIZES, free_bytes=None),
        Limits(min_free=10**9),
        [],
    ),
    Case(
        "both limits: the first unmet one is the reason",
        CacheView(NOW, THREE, SIZES, free_bytes=0),
        Limits(max_size=250, min_free=150),
        [("o/a", "max_size"), ("o/b", "min_free")],
    ),
    Case(
        "stale incomplete snapshots go without limits, fresh ones stay",
        CacheView(
            NOW + 2 * DAY,
            (
                unit("a", NOW, "x", complete=False),
                unit("b", NOW + 2 * DAY - 5, "y", complete=False),
            ),
            blobs(x=100, y=100),
        ),
        Limits(),
        [("o/a", "stale")],
    ),
    Case(
        "a complete snapshot never counts as stale",
        CacheView(NOW + 2 * DAY, (unit("a", 0, "x"),), blobs(x=100)),
        Limits(),
        [],
    ),
    Case(
        "stale orphan blobs and leftovers go; fresh ones stay",
        CacheView(
            NOW,
            (unit("a", 1, "x"),),
            (Blob("x", 100, 0), Blob("o", 7, NOW - 2 * DAY), Blob("n", 7, NOW)),
            leftovers=(
                Leftover("partial", "old", 10, NOW - 2 * DAY),
                Leftover("partial", "new", 10, NOW - 60),
                Leftover("tmp", "write.1.ab", 1, NOW - 2 * DAY),
            ),
        ),
        Limits(),
        [],
        orphans=("o",),
        leftovers=("old", "write.1.ab"),
    ),
    Case(
        "a live lease older than a stale orphan: a running job may link it yet",
        CacheView(
            NOW,
            (unit("a", 1, "x"),),
            (Blob("x", 100, 0), Blob("o", 7, NOW - 2 * DAY), Blob("p", 7, NOW - 3 * DAY)),
            leased_since=NOW - 2.5 * DAY,
        ),
        Limits(),
        [],
        orphans=("p",),
    ),
    Case(
        "a blob a live lease names outlives its last snapshot and is no orphan",
        CacheView(
            NOW,
            (unit("a", 1, "xy"),),
            (Blob("x", 100, 0), Blob("y", 100, 0), Blob("o", 7, NOW - 2 * DAY)),
            leased_blobs=frozenset({"y", "o"}),
        ),
        Limits(max_size=0),
        [("o/a", "max_size")],
        unmet=("max_size",),
    ),
    Case(
        "a limit takes the blobs nothing refers to before a snapshot: a killed prune's",
        CacheView(
            NOW,
            (unit("a", 1, "x"), unit("b", 2, "y")),
            (Blob("x", 100, 0), Blob("y", 100, 0), Blob("k", 100, NOW - 60)),
        ),
        Limits(max_size=200),
        [],
        orphans=("k",),
    ),
    Case(
        "... but not one newer than a live lease: a running job may link it yet",
        CacheView(
            NOW,
            (unit("a", 1, "x"), unit("b", 2, "y")),
            (Blob("x", 100, 0), Blob("y", 100, 0), Blob("k", 100, NOW - 60)),
            leased_since=NOW - 120,
        ),
        Limits(max_size=200),
        [("o/a", "max_size")],
    ),
    Case(
        "ties are broken by folder and commit, so plans are reproducible",
        CacheView(NOW, (unit("b", 1, "y"), unit("a", 1, "x")), blobs(x=100, y=100)),
        Limits(max_size=100),
        [("o/a", "max_size")],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan(case: Case) -> None:
    plan = plan_prune(case.view, case.limits)
    assert [(e.repo, e.reason) for e in plan.evictions] == case.evicted
    assert plan.unmet == case.unmet
    assert plan.orphans == case.orphans
    assert tuple(x.name for x in plan.leftovers) == case.leftovers
    assert plan.size_after == case.view.total_bytes - plan.freed_bytes
    evicted = {(e.dirname, e.commit) for e in plan.evictions}
    kept_blobs = {
        b for u in case.view.units if (u.dirname, u.commit) not in evicted for b in u.blobs
    }
    kept_blobs |= case.view.leased_blobs
    assert not kept_blobs & set(plan.blobs), "a blob a kept snapshot or a lease names would go"


def test_plan_accounts_each_blob_to_the_eviction_that_frees_it() -> None:
    view = CacheView(NOW, (unit("a", 1, "xs"), unit("b", 2, "ys")), blobs(x=10, y=20, s=5))
    plan = plan_prune(view, Limits(max_size=0))
    assert [(e.repo, e.blobs, e.freed_bytes) for e in plan.evictions] == [
        ("o/a", ("x",), 10),
        ("o/b", ("s", "y"), 25),
    ]
    assert plan.size_after == 0 and plan.unmet == ()


@pytest.mark.parametrize(
    "kwargs", [{"max_size": -1}, {"min_free": -1}, {"max_age": -1.0}, {"stale_age": -1.0}]
)
def test_limits_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Limits(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30d", 30 * DAY),
        ("12h", 43200.0),
        ("90m", 5400.0),
        ("45s", 45.0),
        ("2w", 14 * DAY),
        ("1.5d", 1.5 * DAY),
        (60, 60.0),
        ("0", 0.0),
    ],
)
def test_parse_duration(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "d", "3y", "-1d", "1e999", "nan", True])
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)  # type: ignore[arg-type]


def test_prune_config_section(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[prune]\nmax_size = "500G"\nmin_free = "50G"\nmax_age = "30d"\n'
        'pin = ["acme/*", "org/model"]\nstale_partial_age = "2h"\nhigh_water = "600G"\n'
    )
    config = load_config(path, {}, cache_dir=tmp_path)
    assert config.prune == PruneConfig(
        max_size=500 * 1000**3,
        min_free=50 * 1000**3,
        max_age=30 * DAY,
        pin=("acme/*", "org/model"),
        stale_partial_age=7200.0,
        high_water=600 * 1000**3,
    )
    assert load_config(None, {}, cache_dir=tmp_path).prune == PruneConfig()
    limits = limits_from_config(config.prune, max_size=1)
    assert (limits.max_size, limits.min_free, limits.stale_age) == (1, 50 * 1000**3, 7200.0)


@pytest.mark.parametrize(
    "body",
    [
        "[prune]\nmax_size = -3\n",
        '[prune]\nmax_age = "soon"\n',
        '[prune]\npin = "acme/x"\n',
        "[prune]\nbogus = 1\n",
        '[prune]\nmax_size = "10G"\nhigh_water = "5G"\n',
    ],
)
def test_prune_config_errors(tmp_path: Path, body: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match="prune"):
        load_config(path, {}, cache_dir=tmp_path)


# --------------------------------------------------------------------------- real caches

NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    """Three different small checkpoints; their small files (README, tokenizer) are identical,
    so those blobs are shared across the three repos."""
    return {
        name: build_checkpoint(
            tmp_path_factory.mktemp(f"model-{name}"), total_bytes=160 * 1024, n_shards=2, seed=i
        )
        for i, name in enumerate(NAMES)
    }


@pytest.fixture
def hub(models: dict[str, Checkpoint]) -> Iterator[FakeHub]:
    fake = FakeHub()
    for name, checkpoint in models.items():
        fake.add_checkpoint(f"acme/{name}", checkpoint)
    with serve_in_thread(fake) as running:
        yield running


def fill(cache_dir: Path, hub: FakeHub, names: tuple[str, ...] = NAMES) -> dict[str, Path]:
    """Prefetch ``acme/<name>`` in this order; returns the snapshot paths."""
    config = fast_config(cache_dir, hub.endpoint)
    results: dict[str, PrefetchResult] = {
        name: asyncio.run(prefetch(f"acme/{name}", config)) for name in names
    }
    return {name: r.snapshot_path for name, r in results.items()}


def use(cache_dir: Path, name: str) -> None:
    """What any use through shardsync does: an offline prefetch records the access."""
    asyncio.run(prefetch(f"acme/{name}", fast_config(cache_dir), offline=True))


def repo_bytes(cache: CacheStore, name: str) -> int:
    return scan(cache).find_repo(f"acme/{name}").nbytes


def remaining(cache: CacheStore) -> list[str]:
    return [r.repo for r in scan(cache).repos]


def assert_hf_clean(cache_dir: Path) -> None:
    info = scan_cache_dir(cache_dir / "hub")
    assert info.warnings == [], info.warnings


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root``: (inode, size, mtime_ns), without following links."""
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(top, name))
            out[os.path.relpath(os.path.join(top, name), root)] = (
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
            )
    return out


def test_lru_with_a_cap_that_fits_one(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    snapshots = fill(cache_dir, hub)
    use(cache_dir, "a")  # a: most recently used now; b is the least
    cache = CacheStore(cache_dir)
    report = prune_cache(cache, Limits(max_size=repo_bytes(cache, "a")))
    assert [(e.repo, e.reason) for e in report.evicted] == [
        ("acme/b", "max_size"),
        ("acme/c", "max_size"),
    ]
    assert report.satisfied and report.size_after <= repo_bytes(cache, "a")
    assert remaining(cache) == ["acme/a"]
    assert_snapshot_matches(snapshots["a"], models["a"])  # shared small blobs stayed
    assert not snapshots["b"].exists() and not (cache_dir / "hub" / "models--acme--b").exists()
    assert_store_verified(cache_dir, *models.values())
    assert_hf_clean(cache_dir)
    offline = hf_hub_download(
        "acme/a", "config.json", cache_dir=cache_dir / "hub", local_files_only=True
    )
    assert Path(offline).read_bytes() == models["a"].path("config.json").read_bytes()
    # the access log was compacted to the snapshots that are left
    assert set(AccessLog(cache).last_used()) == {("models--acme--a", snapshots["a"].name)}


def test_pinned_kept_and_leased_survive(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    snapshots = fill(cache_dir, hub)
    cache = CacheStore(cache_dir)
    with Leases(cache).hold(RepoRef("hub", "acme/b"), snapshots["b"].name, owner="test"):
        report = prune_cache(cache, Limits(max_size=0), pin=["acme/a*"])
        assert [e.repo for e in report.evicted] == ["acme/c"]
        assert {(p.repo, p.reason) for p in report.protected} == {
            ("acme/a", "pinned"),
            ("acme/b", "leased"),
        }
        assert report.unmet == ("max_size",)
    report = prune_cache(cache, Limits(max_size=0), pin=["acme/a"], keep=["acme/b"])
    assert report.evicted == () and remaining(cache) == ["acme/a", "acme/b"]
    report = prune_cache(cache, Limits(max_size=0), pin=["acme/a"])
    assert [e.repo for e in report.evicted] == ["acme/b"]  # its lease ended
    assert_hf_clean(cache_dir)


def test_dry_run_changes_nothing(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub)
    cache = CacheStore(cache_dir)
    (cache_dir / "partial" / "deadbeef.part").write_bytes(b"x" * 10)
    os.utime(cache_dir / "partial" / "deadbeef.part", (0, 0))
    before = tree(cache_dir)
    with _held(cache):  # a dry run takes no lock: it would time out here otherwise
        report = prune_cache(cache, Limits(max_size=0), dry_run=True, timeout=5)
    assert report.dry_run and [e.repo for e in report.evicted] == ["acme/a", "acme/b", "acme/c"]
    assert report.partials == 1 and report.size_after < report.size_before
    assert tree(cache_dir) == before


def test_a_second_prune_waits_or_skips(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub, ("a",))
    cache = CacheStore(cache_dir)
    with _held(cache):
        assert prune_cache(cache, Limits(max_size=0), wait=False).skipped
        with pytest.raises(CacheError, match="timed out"):
            prune_cache(cache, Limits(max_size=0), timeout=0.05)
    assert [e.repo for e in prune_cache(cache, Limits(max_size=0), wait=False).evicted] == [
        "acme/a"
    ]


class _held:
    """Hold the prune gate exclusively, as a running prune does."""

    def __init__(self, cache: CacheStore) -> None:
        self.lock = prune_gate(cache, shared=False)

    def __enter__(self) -> None:
        assert self.lock.try_acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


TORN = "part.0badc0de.4242-17.0123456789abcdef"  # a download's private file, another host's


def test_stale_partials_orphans_and_junk(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub, ("a",))
    cache = CacheStore(cache_dir)
    partial = cache_dir / "partial"
    for key in ("old", "busy", "fresh"):
        (partial / f"{key}.part").write_bytes(os.urandom(5000))
        (partial / f"{key}.json").write_text("{}")
    (cache_dir / "tmp" / TORN).write_bytes(b"torn")
    orphan = cache_dir / "partial" / "orphan.part"
    orphan.write_bytes(b"no snapshot refers to me")
    orphan_sha = hashlib.sha256(orphan.read_bytes()).hexdigest()
    cache.publish_blob(orphan, orphan_sha)
    later = time.time() + 3 * DAY
    for key in ("old", "busy"):
        for ext in ("part", "json"):
            os.utime(partial / f"{key}.{ext}", (0, 0))
    os.utime(cache_dir / "tmp" / TORN, (0, 0))
    for ext in ("part", "json"):  # written a minute ago, as the clock of this prune reads
        os.utime(partial / f"fresh.{ext}", (later - 60, later - 60))
    busy = cache.lock("busy")
    assert busy.try_acquire()  # a download is writing it
    try:
        report = prune_cache(cache, Limits(stale_age=DAY), clock=lambda: later)
    finally:
        busy.release()
    assert sorted(p.name for p in partial.iterdir()) == [
        "busy.json",
        "busy.part",
        "fresh.json",
        "fresh.part",
    ]
    assert not cache.has_blob(orphan_sha)
    assert list((cache_dir / "tmp").iterdir()) == []
    assert report.orphans == 1 and report.junk == 1 and report.evicted == ()
    assert remaining(cache) == ["acme/a"]  # complete and unused for 3 days: no max_age given


def test_what_shardsync_did_not_make_a_prune_leaves_and_still_prunes(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """A name shardsync never writes in ``tmp/`` or ``quarantine/`` (a core dump, a user's
    file), or an entry of ``snapshots/`` that is no commit (a user's ``cp -a`` of one), is not
    ours: left as it is, with what it links to, and the prune does the rest. Each of them used
    to fail every prune (from a timer: no report, nothing freed)."""
    cache_dir = tmp_path / "cache"
    paths = fill(cache_dir, hub, ("a", "b"))
    cache = CacheStore(cache_dir)
    strays = [
        cache_dir / "tmp" / name for name in ("core dump", "core", "core.12345", "notes.txt")
    ] + [cache_dir / "quarantine" / name for name in ("\u00fc.bin", "model.safetensors.bak")]
    for stray in strays:
        stray.parent.mkdir(exist_ok=True)
        stray.write_bytes(b"not ours")
        os.utime(stray, (0, 0))
    backup = paths["b"].parent / "backup"
    shutil.copytree(paths["b"], backup, symlinks=True)
    later = time.time() + 3 * DAY
    report = prune_cache(cache, Limits(max_age=DAY, stale_age=DAY), clock=lambda: later)
    assert sorted(e.repo for e in report.evicted) == ["acme/a", "acme/b"]
    assert all(stray.read_bytes() == b"not ours" for stray in strays)
    assert not paths["b"].exists()
    assert_snapshot_matches(backup, models["b"])  # the blobs the copy links to are kept
    again = prune_cache(cache, Limits(max_age=DAY, stale_age=DAY), clock=lambda: later)
    assert again.evicted == ()


def test_a_prune_on_a_full_disk_reports_what_it_could_not_meet(
    hub: FakeHub, tmp_path: Path
) -> None:
    """The access log's rewrite needs room a full disk does not have; the prune still
    reports (``unmet``), as a full disk is when it is run."""
    with tmpfs(tmp_path / "small", "size=4m") as small:
        cache_dir = small / "cache"
        fill(cache_dir, hub, ("a",))
        use(cache_dir, "a")
        cache = CacheStore(cache_dir)
        prune_cache(cache, Limits())  # its lock files are made while there is room
        with (small / "filler").open("wb", buffering=0) as filler, pytest.raises(OSError):
            while True:
                filler.write(bytes(64 << 10))
        report = prune_cache(cache, Limits(max_size=1), pin=("acme/*",))
    assert report.evicted == () and report.unmet == ("max_size",)


@pytest.mark.parametrize("marked", [True, False], ids=["abandoned", "another-tools"])
def test_stale_incomplete_snapshot_is_removed_if_shardsync_made_it(
    hub: FakeHub, tmp_path: Path, marked: bool
) -> None:
    """A download killed before its record leaves its snapshot marked as being made: stale
    after a day, it goes. One with no mark is another tool's: huggingface_hub, asked for a
    pinned commit whose files shardsync's blobs hold, builds its snapshot from them and
    writes no ref. That one is kept (a reader offline needs it)."""
    cache_dir = tmp_path / "cache"
    snapshots = fill(cache_dir, hub, ("a", "b"))
    cache = CacheStore(cache_dir)
    record = cache_dir / "state" / "snapshots" / "models--acme--b" / f"{snapshots['b'].name}.json"
    record.unlink()  # b has no record and no ref
    if marked:  # as a download killed before its record leaves it
        record.with_suffix(".pending").touch()
    (cache_dir / "hub" / "models--acme--b" / "refs" / "main").unlink()
    assert prune_cache(cache, Limits()).evicted == ()  # not stale yet
    report = prune_cache(cache, Limits(), clock=lambda: time.time() + 2 * DAY)
    if marked:
        assert [(e.repo, e.reason) for e in report.evicted] == [("acme/b", "stale")]
        assert remaining(cache) == ["acme/a"]
    else:
        assert report.evicted == ()
        assert sorted(remaining(cache)) == ["acme/a", "acme/b"]
        assert snapshots["b"].is_dir() and any(snapshots["b"].iterdir())
    assert_hf_clean(cache_dir)


def test_a_quarantined_snapshot_waits_for_its_prefetch_not_for_a_prune(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """``verify`` quarantines one corrupt shard and says the next prefetch downloads just
    that; a prune a day later, with no limit set, took the snapshot for an abandoned download
    and deleted every good blob of it."""
    cache_dir = tmp_path / "cache"
    snapshot = fill(cache_dir, hub, ("a",))["a"]
    cache = CacheStore(cache_dir)
    shard = models["a"].shards[0]
    blob = cache.blob_path(sha256_file(snapshot / shard))
    blob.chmod(0o644)
    with blob.open("r+b") as f:  # one flipped byte
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 1]))
    assert verify_cache(cache).incomplete
    report = prune_cache(cache, Limits(), clock=lambda: time.time() + 2 * DAY)
    assert report.evicted == ()
    assert report.junk == 1 and list((cache_dir / "quarantine").iterdir()) == []
    before = hub.bytes_served()
    fill(cache_dir, hub, ("a",))
    assert hub.bytes_served() - before == models["a"].path(shard).stat().st_size
    assert_snapshot_matches(snapshot, models["a"])


def test_a_prune_killed_between_a_record_and_its_folder_is_finished_by_the_next(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eviction drops the record, then moves the folder away: killed between the two, it
    left a snapshot with neither record nor mark, which counts as another tool's and was
    kept for ever, its blobs with it. The snapshot is marked shardsync's before its record
    goes, so the next prune finishes the eviction."""
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub, ("a",))
    cache = CacheStore(cache_dir)

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # where a SIGKILL would stop the process

    with monkeypatch.context() as patched:
        patched.setattr(type(CacheRemoval(cache).fs), "discard", killed)
        with pytest.raises(KeyboardInterrupt):
            prune_cache(cache, Limits(max_size=0))
    report = prune_cache(cache, Limits(max_size=0))
    assert [e.repo for e in report.evicted] == ["acme/a"]
    assert remaining(cache) == [] and not list((cache_dir / "store").rglob("*/*/*"))


def test_notes_of_files_found_again_go_with_their_blobs(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A file no digest named leaves a note of the blob it became (``partial/<key>.done``):
    once a prune removed that blob, the note goes too, not left one per file for ever."""
    cache = CacheStore(tmp_path / "cache")
    asyncio.run(prefetch(str(checkpoint.directory), fast_config(tmp_path / "cache")))
    assert list((tmp_path / "cache" / "partial").glob("*.done"))
    prune_cache(cache, Limits(max_size=0))
    assert list((tmp_path / "cache" / "partial").glob("*.done")) == []


@pytest.mark.parametrize("begun_by_us", [False, True], ids=["hf-alone", "hf-finished-ours"])
def test_a_snapshot_huggingface_hub_made_from_our_blobs_is_not_ours_to_prune(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path, begun_by_us: bool
) -> None:
    """A commit that changed only a README, fetched by huggingface_hub into the shared cache:
    it links shardsync's blobs and writes ``refs/main``, and has no record of ours. A prune
    took it for our abandoned download and deleted it and the ref, and huggingface_hub
    offline found nothing. So too where a shardsync download of that commit was killed
    (its mark stays) and huggingface_hub then finished the snapshot: the ref says whose."""
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub, ("a",))
    model = models["a"]
    files: dict[str, bytes | Path] = {rel: model.path(rel) for rel in model.files}
    files["README.md"] = b"# edited\n"
    commit = hub.add_repo("acme/a", files)
    if begun_by_us:
        (cache_dir / "state" / "snapshots" / "models--acme--a" / f"{commit}.pending").touch()
    assert model.index is not None
    for name in ("config.json", model.index, *model.shards):
        hf_hub_download("acme/a", name, cache_dir=cache_dir / "hub", endpoint=hub.endpoint)
    later = time.time() + 2 * DAY
    report = prune_cache(CacheStore(cache_dir), Limits(), clock=lambda: later)
    assert report.evicted == ()
    for name in (model.index, *model.shards):
        offline = hf_hub_download(
            "acme/a", name, cache_dir=cache_dir / "hub", local_files_only=True
        )
        assert commit in offline
        assert Path(offline).read_bytes() == model.path(name).read_bytes()


def test_a_repo_folder_symlinked_from_elsewhere_is_left_and_the_rest_pruned(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """A repo folder moved to another disk and linked back (to make room) is someone's
    arrangement: left as it is. Every prune used to stop at it (exit 9) and free nothing."""
    cache_dir = tmp_path / "cache"
    paths = fill(cache_dir, hub, ("a", "b"))
    repo = cache_dir / "hub" / "models--acme--a"
    moved = tmp_path / "bigdisk" / repo.name
    moved.parent.mkdir()
    repo.rename(moved)
    repo.symlink_to(moved)
    report = prune_cache(CacheStore(cache_dir), Limits(max_size=1))
    assert [e.repo for e in report.evicted] == ["acme/b"]
    assert_snapshot_matches(paths["a"], models["a"])


class _Killed(BaseException):
    """Stands in for a ``kill -9`` of a prune: nothing after it runs."""


def test_a_prune_killed_before_its_blobs_leaves_the_next_one_the_same_choice(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prune killed after it unlinked the evicted snapshots' links, before their store
    blobs: those blobs, refreshed by the unlinks, were no orphans for a day, and the next
    prune met its cap by evicting the snapshot used last."""
    cache_dir = tmp_path / "cache"
    paths = fill(cache_dir, hub)
    use(cache_dir, "a")
    cache = CacheStore(cache_dir)
    cap = repo_bytes(cache, "a")

    def killed(self: CacheRemoval, sha256: str) -> int:
        raise _Killed

    with monkeypatch.context() as patched:
        patched.setattr(CacheRemoval, "remove_blob", killed)
        with pytest.raises(_Killed):
            prune_cache(cache, Limits(max_size=cap))
    report = prune_cache(cache, Limits(max_size=cap))
    assert report.evicted == () and report.unmet == ()
    assert remaining(cache) == ["acme/a"]
    assert_snapshot_matches(paths["a"], models["a"])


MMAP_READER = r"""
import hashlib, mmap, sys
with open(sys.argv[1], "rb") as f:
    view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
print("ready", flush=True)
for line in sys.stdin:
    print(hashlib.sha256(view).hexdigest(), flush=True)
"""


def test_mmap_reader_keeps_valid_bytes_through_a_prune(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    snapshots = fill(cache_dir, hub, ("a",))
    shard = models["a"].shards[0]
    expected = models["a"].path(shard).read_bytes()
    want = hashlib.sha256(expected).hexdigest()
    with subprocess.Popen(
        [sys.executable, "-c", MMAP_READER, str(snapshots["a"] / shard)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as reader:
        assert reader.stdin is not None and reader.stdout is not None

        def ask() -> str:
            assert reader.stdin is not None and reader.stdout is not None
            reader.stdin.write("hash\n")
            reader.stdin.flush()
            return reader.stdout.readline().strip()

        assert reader.stdout.readline() == "ready\n"
        assert ask() == want
        report = prune_cache(CacheStore(cache_dir), Limits(max_size=0))
        assert [e.repo for e in report.evicted] == ["acme/a"]
        assert not (cache_dir / "store" / "sha256" / want[:2] / want).exists()
        for _ in range(3):  # the unlinked inode still serves every byte: no SIGBUS, no zeros
            assert ask() == want
        reader.stdin.close()
        assert reader.wait(timeout=30) == 0


def test_concurrent_prunes_from_the_command_line(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub)
    cmd = [
        sys.executable,
        "-m",
        "shardsync.cli",
        "prune",
        "--cache-dir",
        str(cache_dir),
        "--max-size",
        "0",
        "--json",
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    reports = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    evicted = sorted(e["repo"] for r in reports for e in r["evicted"])
    assert evicted == ["acme/a", "acme/b", "acme/c"]  # each exactly once
    assert all(r["satisfied"] for r in reports)
    assert remaining(CacheStore(cache_dir)) == []
    assert_hf_clean(cache_dir)


PRUNE_KEYS = {
    "dry_run",
    "skipped",
    "satisfied",
    "unmet",
    "limits",
    "before",
    "after",
    "freed_bytes",
    "evicted",
    "repos",
    "partials",
    "orphan_blobs",
    "junk",
    "leases_reaped",
    "protected",
}


def test_cli_json_shape_and_exit_codes(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub, ("a", "b"))
    config = tmp_path / "c.toml"
    config.write_text('[prune]\npin = ["acme/a"]\n')
    base = [sys.executable, "-m", "shardsync.cli", "--config", str(config), "prune"]
    base += ["--cache-dir", str(cache_dir)]
    out = subprocess.run([*base, "--max-size", "1k", "--json"], capture_output=True, text=True)
    assert out.returncode == 8, out.stderr  # acme/a is pinned: the cap cannot be met
    report = json.loads(out.stdout)
    assert set(report) == PRUNE_KEYS
    assert set(report["limits"]) == {"max_size", "min_free", "max_age_s", "stale_age_s"}
    assert set(report["before"]) == set(report["after"]) == {"bytes_on_disk", "disk_free"}
    assert [set(e) for e in report["evicted"]] == [
        {"repo", "dir", "commit", "reason", "freed_bytes"}
    ]
    assert report["repos"] == [
        {"repo": "acme/b", "snapshots": 1, "freed_bytes": report["evicted"][0]["freed_bytes"]}
    ]
    assert set(report["partials"]) == {"files", "freed_bytes"}
    assert report["protected"][0] == {
        "repo": "acme/a",
        "commit": report["protected"][0]["commit"],
        "reason": "pinned",
    }
    assert report["unmet"] == ["max_size"] and report["satisfied"] is False
    text = subprocess.run([*base, "--max-age", "0s"], capture_output=True, text=True)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("freed ") and "untouched: acme/a (pinned)" in text.stdout
    for flag, value in (("--max-age", "soon"), ("--max-size", "5GG"), ("--min-free", "-1")):
        bad = subprocess.run([*base, flag, value], capture_output=True, text=True)
        assert bad.returncode == 2 and flag in bad.stderr, (flag, bad.stderr)  # names the flag


def test_keep_and_pin_match_a_source_as_it_was_typed(tmp_path: Path) -> None:
    """A source is stored by its normal name (a directory's absolute path, an ``s3://``
    prefix with its trailing slash); ``--keep`` and ``prune.pin`` as a user types them
    (``origin/b/``, ``s3://models/llama``) must protect it all the same."""
    build_checkpoint(tmp_path / "origin" / "b", total_bytes=64 * 1024, n_shards=1)
    cache_dir = tmp_path / "cache"
    base = [sys.executable, "-m", "shardsync.cli", "prune", "--cache-dir", str(cache_dir)]
    fetch = ["prefetch", "origin/b/", "--cache-dir", str(cache_dir), "--no-daemon", "--quiet"]
    fetched = subprocess.run(
        [sys.executable, "-m", "shardsync.cli", *fetch],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert fetched.returncode == 0, fetched.stderr
    for keep in ("origin/b/", "./origin/b", str(tmp_path / "origin" / "b") + "/"):
        out = subprocess.run(
            [*base, "--max-size", "0", "--dry-run", "--json", "--keep", keep],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        report = json.loads(out.stdout)
        assert report["evicted"] == [], keep
        assert [p["reason"] for p in report["protected"]] == ["keep"], keep
    (tmp_path / "pin.toml").write_text('[prune]\npin = ["origin/b/"]\n')
    listed = subprocess.run(
        [*base[:3], "ls", "--json", "--config", "pin.toml", "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert [r["pinned"] for r in json.loads(listed.stdout)["repos"]] == [True]  # as prune has it
    assert matches(["s3://models/llama"], "s3://models/llama/")
    assert matches(["s3://models/*"], "s3://models/llama/")
    assert not matches(["s3://models/llama"], "s3://models/llama-2/")


def test_ensure_free(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub)
    cache = CacheStore(cache_dir)
    total = scan(cache).total_bytes
    # plenty of disk and no cap: nothing to do
    assert ensure_free(cache, 1 << 20).evicted == ()
    # a cap the cache is at: room for one more byte evicts the least recently used
    report = ensure_free(cache, 1, Limits(max_size=total))
    assert [e.repo for e in report.evicted] == ["acme/a"]
    # more than the filesystem can ever hold: everything evictable goes, then a clear error
    with pytest.raises(DiskFullError, match="not enough disk space"):
        ensure_free(cache, 1 << 62, pin=["acme/c"])
    assert remaining(cache) == ["acme/c"]


def test_needs_prune(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    fill(cache_dir, hub, ("a",))
    cache = CacheStore(cache_dir)
    size = scan(cache).total_bytes
    assert not needs_prune(cache, PruneConfig())
    assert needs_prune(cache, PruneConfig(max_size=size - 1))
    assert not needs_prune(cache, PruneConfig(max_size=size - 1, high_water=size))
    assert needs_prune(cache, PruneConfig(min_free=1 << 62))


async def test_a_blob_a_content_named_job_reuses_outlives_its_other_snapshot(
    tmp_path: Path,
) -> None:
    """A job whose snapshot is named by its content (a local directory, S3, a URL) links its
    files only at its end. A blob it found in the store, held by another repo's snapshot,
    must survive a prune that evicts that snapshot meanwhile: the job is running."""
    first = build_checkpoint(tmp_path / "first", total_bytes=40_000, n_shards=1, extras=False)
    second = tmp_path / "second"
    shutil.copytree(first.directory, second)
    (second / "README.md").write_text("the same weights, another folder\n")
    (first.directory / "README.md").write_text("what an eviction of the first frees\n")
    config = fast_config(tmp_path / "cache")
    cache = CacheStore(config.cache_dir)
    await prefetch(str(first.directory), config)
    pruning = OnFileDone("model.safetensors", lambda: prune_cache(cache, Limits(max_size=0)))
    result = await prefetch(str(second), config, progress=pruning)
    (report,) = pruning.results
    assert isinstance(report, PruneReport)
    assert [e.repo for e in report.evicted] == [str(first.directory)]
    for f in result.files:
        assert (result.snapshot_path / f.path).read_bytes() == (second / f.path).read_bytes()


async def test_a_prune_between_a_jobs_prepare_and_download_breaks_no_snapshot(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """The daemon prepares a job, then waits (for room, for a job it follows) before the
    download; a prune meanwhile (the timer's, another job's tidy) may evict the repo's last
    snapshot, the index that ``prepare`` obtained with it. The download still ends with a
    complete snapshot holding every file the origin serves."""
    from shardsync.prefetch import Engine

    cache_dir = tmp_path / "cache"
    await asyncio.to_thread(fill, cache_dir, hub, ("a",))
    cache = CacheStore(cache_dir)
    async with Engine(fast_config(cache_dir, hub.endpoint)) as engine:
        job = engine.job(engine.origin("acme/a"))
        await job.prepare()
        report = await asyncio.to_thread(prune_cache, cache, Limits(max_size=0))
        assert [e.repo for e in report.evicted] == ["acme/a"]
        result = job.result(await job.download(), 0.0)
    assert cache.find_complete(result.repo, result.commit) is not None
    assert_snapshot_matches(result.snapshot_path, models["a"])
    assert_store_verified(cache_dir, models["a"])


async def test_the_daemons_own_prune_keeps_a_jobs_repo_by_its_name_not_as_a_pattern(
    tmp_path: Path,
) -> None:
    """The daemon's prunes keep the repo of the job that asked for them: by its name. A
    folder or S3 prefix named ``run[1]`` read as a pattern matches nothing of its own (the
    brackets are a character class), and its snapshot would be evicted from under the job."""
    from shardsync.config import PruneConfig
    from shardsync.prune import CacheRoom
    from shardsync.store import AsyncStore

    odd = build_checkpoint(tmp_path / "run[1]", total_bytes=40_000, n_shards=1, extras=False)
    config = fast_config(tmp_path / "cache")
    result = await prefetch(str(odd.directory), config)
    cache = CacheStore(config.cache_dir)
    room = CacheRoom(AsyncStore(cache), PruneConfig(max_size=0))
    await room.tidy(keep=str(odd.directory))
    await room.make([], keep=str(odd.directory), on_short=lambda missing, free: None)
    assert remaining(cache) == [str(odd.directory)]
    for f in result.files:
        assert (result.snapshot_path / f.path).read_bytes() == odd.path(f.path).read_bytes()
