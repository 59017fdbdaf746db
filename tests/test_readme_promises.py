"""What a new user trips over (issue 15): each sentence of the README or docs/ that did not
hold, as a test.

Every test here runs the real parts (the CLI in a process, the fake Hub on loopback) and would
fail if the sentence it is named after became false again.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import fast_config, kill_when, serving

from shardsync.testing import Bandwidth, Checkpoint, FakeHub, build_checkpoint

REPO = "acme/newuser"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt"), total_bytes=16 << 20, n_shards=4, seed=15
    )


@pytest.fixture
def hub(checkpoint: Checkpoint) -> Iterator[FakeHub]:
    with serving({REPO: checkpoint}) as running:
        yield running


def _config(tmp_path: Path) -> Path:
    """Small write buffers and frequent resume records, no daemon: a kill -9 leaves partials."""
    path = tmp_path / "shardsync.toml"
    path.write_text(
        '[download]\nconnections_per_file = 2\nchunk_size = "1MiB"\nwrite_size = "64KiB"\n'
        'read_size = "64KiB"\nsidecar_interval = 0.1\n'
        f'[daemon]\nsocket = "{tmp_path / "no-daemon" / "d.sock"}"\n'
    )
    return path


def _cli(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "shardsync.cli", "--config", str(_config(tmp_path)), *args]


def _run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _cli(tmp_path, *args), capture_output=True, text=True, timeout=120, env=env
    )


def _unique_bytes_on_disk(root: Path) -> int:
    """What ``du`` says of the files under ``root``: each inode's blocks once."""
    seen: dict[tuple[int, int], int] = {}
    for top, _dirs, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(top, name))
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


def _partial_blocks(cache: Path) -> int:
    """Blocks of the partials now; one published between the listing and its stat counts 0."""
    total = 0
    for path in (cache / "partial").glob("*.part"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_blocks * 512
    return total


# ------------------------------------------------------------------ 1. every blob counted once


def test_ls_and_prune_count_an_interrupted_download_once(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """docs/cache.md, prune: "Sizes are bytes on disk with every blob counted once": a partial and
    the private name a kill -9 left of it in tmp/ are one file, and du agrees with ls."""
    cache = tmp_path / "cache"
    hub.faults.add(Bandwidth(400_000))
    proc = subprocess.Popen(
        _cli(tmp_path, "prefetch", REPO, "--endpoint", hub.endpoint, "--cache-dir", str(cache)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_when(proc, lambda: _partial_blocks(cache) >= 2 << 20)
    assert list((cache / "tmp").iterdir()), "the killed download left its private names"

    listing = json.loads(_run(tmp_path, "ls", "--json", "--cache-dir", str(cache)).stdout)
    du = _unique_bytes_on_disk(cache)
    assert listing["partial_bytes"] >= 2 << 20
    assert listing["bytes_on_disk"] <= du
    assert listing["junk_bytes"] == 0  # the tmp/ names are the partials themselves

    # A limit just above what is really there is met without evicting anything.
    limit = str(listing["bytes_on_disk"] + 1)
    pruned = _run(
        tmp_path, "prune", "--dry-run", "--json", "--max-size", limit, "--cache-dir", str(cache)
    )
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    report = json.loads(pruned.stdout)
    assert report["before"]["bytes_on_disk"] == listing["bytes_on_disk"]
    assert report["evicted"] == []


# ------------------------------------------------------------ 2. a lease lives with the stream


def test_a_stream_holds_its_lease_until_the_with_block_ends(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """docs/cache.md, leases: "while a `shardsync.load`/`stream` is open, the snapshots of that repo
    are leased": consuming the last tensor does not end it, leaving the block does."""
    import shardsync
    from shardsync.cache import CacheStore
    from shardsync.prune import prune_cache
    from shardsync.prune_plan import Limits
    from shardsync.snapshot_use import Leases

    config = fast_config(tmp_path / "cache", hub.endpoint)
    cache = CacheStore(config.cache_dir)
    with shardsync.stream(REPO, device_map="cpu", config=config) as tensors:
        consumed = dict(tensors)  # every tensor: the stream is exhausted
        assert len(consumed) == sum(len(h.tensors) for h in tensors.headers.values())
        assert [lease.repo for lease in Leases(cache).live()] == [REPO]
        report = prune_cache(cache, Limits(max_size=0))
        assert report.evicted == ()
        assert {p.reason for p in report.protected} == {"leased"}
        first = next(iter(consumed.values()))
        before = first.clone()
    assert Leases(cache).live() == ()
    assert prune_cache(cache, Limits(max_size=0)).evicted != ()
    assert torch_equal(first, before)  # a mapped tensor outlives the eviction: prune unlinks


def test_a_stream_never_closed_holds_its_lease_until_it_is_collected(
    hub: FakeHub, tmp_path: Path
) -> None:
    import gc

    import shardsync
    from shardsync.cache import CacheStore
    from shardsync.snapshot_use import Leases

    config = fast_config(tmp_path / "cache", hub.endpoint)
    cache = CacheStore(config.cache_dir)
    tensors = shardsync.stream(REPO, device_map="cpu", config=config)
    for _ in tensors:
        pass
    assert len(Leases(cache).live()) == 1
    del tensors
    gc.collect()
    assert Leases(cache).live() == ()


def torch_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return bool(torch.equal(a, b))


# ----------------------------------------------- 3. load and a daemon: the cache the user named


async def test_load_with_a_cache_of_its_own_does_not_go_through_the_daemon(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """docs/loading.md, through the daemon: `load` uses the daemon unless
    `--cache-dir`/`cache_dir=`, `$SHARDSYNC_CACHE_DIR` or the endpoint name another cache or
    Hub than the daemon's, the same rule as `prefetch`; then it downloads into the cache the
    user named, complete."""
    import asyncio
    from dataclasses import replace

    from daemons import daemon_in_loop, short_tmp

    import shardsync
    from shardsync.cache import CacheStore
    from shardsync.config import DaemonConfig
    from shardsync.records import RepoRef

    fake_hub.add_checkpoint(REPO, checkpoint)
    mine = tmp_path / "mine"
    with short_tmp() as work:
        socket_path = work / "shardsync" / "d.sock"
        async with daemon_in_loop(fast_config(work / "dc", fake_hub.endpoint), socket_path) as d:
            config = replace(
                fast_config(tmp_path / "unused", fake_hub.endpoint),
                daemon=DaemonConfig(socket=socket_path),
            )
            got = await asyncio.to_thread(
                shardsync.load, REPO, device_map="cpu", config=config, cache_dir=mine
            )
            env = {**os.environ, "SHARDSYNC_SOCKET": str(socket_path)}
            cli_cache = tmp_path / "cli"
            out = await asyncio.to_thread(
                subprocess.run,
                [
                    sys.executable,
                    "-m",
                    "shardsync.cli",
                    "load",
                    REPO,
                    "--device-map",
                    "cpu",
                    "--endpoint",
                    fake_hub.endpoint,
                    "--cache-dir",
                    str(cli_cache),
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
            )
            submitted = d.statistics().jobs_submitted
    assert isinstance(got, dict) and got
    assert out.returncode == 0, out.stderr
    assert submitted == 0
    for root in (mine, cli_cache):  # the whole snapshot, in the cache the user named
        assert CacheStore(root).find_complete(RepoRef("hub", REPO), "main") is not None
    assert not (tmp_path / "unused").exists()


# -------------------------------------------------- 4. a mistyped --cache-dir creates nothing


@pytest.mark.parametrize(
    "command", [("ls",), ("verify",), ("prune", "--dry-run"), ("prune", "--max-size", "1G")]
)
@pytest.mark.parametrize("how", ["missing", "not-a-cache", "env"])
def test_a_path_that_is_not_a_cache_is_exit_9_and_nothing_is_created(
    tmp_path: Path,
    command: tuple[str, ...],
    how: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/cache.md: `ls`, `verify` and `prune` on a path that is not a shardsync cache exit 9,
    name where the path came from, and create nothing there."""
    from shardsync.cli import main

    target = tmp_path / "typo" / "cache"
    if how == "not-a-cache":
        target.mkdir(parents=True)
        (target / "notes.txt").write_text("mine")
    before = sorted(tmp_path.rglob("*"))
    if how == "env":
        monkeypatch.setenv("SHARDSYNC_CACHE_DIR", str(target))
    args = command if how == "env" else (*command, "--cache-dir", str(target))
    assert main(list(args)) == 9
    assert sorted(tmp_path.rglob("*")) == before
    err = capsys.readouterr().err
    assert str(target) in err
    assert ("SHARDSYNC_CACHE_DIR" if how == "env" else "--cache-dir") in err


# ---------------------------------------------------------------------- 5. shardsync demo


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--size", "big"), "--size"),
        (("--size", "0"), "--size"),
        (("--bandwidth", "fast"), "--bandwidth"),
        (("--bandwidth", "0"), "--bandwidth"),
        (("--shards", "0"), "--shards"),
        (("--shards", "-3"), "--shards"),
    ],
)
def test_demo_bad_flags_are_exit_2_naming_the_flag(
    args: tuple[str, ...], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardsync.cli import main

    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardsync: error:") and flag in err[0]


def test_demo_prints_a_snapshot_path_only_when_it_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cli.md: `shardsync demo` prints the snapshot path on stdout only with `--cache-dir`
    (a temporary cache is removed, and so would the path be)."""
    from shardsync.cli import main

    assert main(["demo", "--size", "2MiB", "--shards", "2"]) == 0
    assert capsys.readouterr().out == ""
    kept = tmp_path / "kept"
    assert main(["demo", "--size", "2MiB", "--shards", "2", "--cache-dir", str(kept)]) == 0
    snapshot = Path(capsys.readouterr().out.strip())
    assert snapshot.is_dir() and snapshot.is_relative_to(kept)
    assert {p.name for p in snapshot.iterdir()} >= {"model.safetensors.index.json"}


# ------------------------------------------------- 6. errors name what the user typed


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SHARDSYNC_MAX_FILES": "abc"}, "SHARDSYNC_MAX_FILES"),
        ({"SHARDSYNC_MAX_FILES": "0"}, "SHARDSYNC_MAX_FILES"),
        ({"SHARDSYNC_CONNECTIONS_PER_FILE": "-1"}, "SHARDSYNC_CONNECTIONS_PER_FILE"),
        ({"SHARDSYNC_CHUNK_SIZE": "foo"}, "SHARDSYNC_CHUNK_SIZE"),
        ({"SHARDSYNC_CHUNK_SIZE": "0"}, "SHARDSYNC_CHUNK_SIZE"),
        ({"SHARDSYNC_MAX_BANDWIDTH": "fast"}, "SHARDSYNC_MAX_BANDWIDTH"),
        ({"SHARDSYNC_MAX_BANDWIDTH": "10"}, "SHARDSYNC_MAX_BANDWIDTH"),
        ({"SHARDSYNC_FALLBACK": "never"}, "SHARDSYNC_FALLBACK"),
        ({"HF_ENDPOINT": "ftp://hub"}, "HF_ENDPOINT"),
        ({"HF_ENDPOINT": "huggingface.co"}, "HF_ENDPOINT"),
    ],
)
def test_an_invalid_environment_variable_is_named(
    env: dict[str, str], named: str, tmp_path: Path
) -> None:
    """docs/configuration.md: "An invalid value gives one error naming the key": the
    variable the user set, never a config-file key they did not write."""
    from shardsync.config import load_config
    from shardsync.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(None, env, cache_dir=tmp_path)
    assert str(caught.value).startswith(named)


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[download]\nmax_files = 0\n", "download.max_files"),
        ('[download]\nchunk_size = "lots"\n', "download.chunk_size"),
        ("[retry]\nmax_delay = -1\n", "retry.max_delay"),
        ('[hub]\nendpoint = "nope"\n', "hub.endpoint"),
        ('[daemon]\nfallback = "never"\n', "daemon.fallback"),
        ('[prune]\nmax_age = "soon"\n', "prune.max_age"),
        ("[cache]\nsize = 1\n", "cache.size"),
    ],
)
def test_an_invalid_config_file_value_names_the_file_and_key(
    toml: str, key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardsync.cli import main

    path = tmp_path / "my.toml"
    path.write_text(toml)
    assert main(["--config", str(path), "ls", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and key in err


@pytest.mark.parametrize("endpoint", ["foo", "ftp://hub", "http://"])
def test_an_invalid_endpoint_flag_is_named(
    endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardsync.cli import main

    args = ["prefetch", "acme/x", "--endpoint", endpoint, "--cache-dir", str(tmp_path)]
    assert main([*args, "--no-daemon"]) == 2
    assert "--endpoint" in capsys.readouterr().err


# ------------------------------------------------------ 7. a private repo: exit 3, and a hint


@pytest.mark.parametrize("token", [None, "hf_wrong"])
def test_a_private_repo_without_access_is_exit_3_saying_how_to_log_in(
    checkpoint: Checkpoint, tmp_path: Path, token: str | None
) -> None:
    """README's exit table: 3 for a private repo asked for without a token that has access
    (the Hub's 404), with a message that says how to log in."""
    from shardsync.testing import serve_in_thread

    fake = FakeHub()
    fake.add_checkpoint(REPO, checkpoint, token="hf_right")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_TOKEN_PATH")}
    env["HF_TOKEN_PATH"] = str(tmp_path / "no-token")
    if token is not None:
        env["HF_TOKEN"] = token
    with serve_in_thread(fake):
        cache = ("--cache-dir", str(tmp_path / "c"))
        out = _run(tmp_path, "prefetch", REPO, "--endpoint", fake.endpoint, *cache, env=env)
        assert out.returncode == 3, out.stderr
        assert "HF_TOKEN" in out.stderr and "hf auth login" in out.stderr
        env["HF_TOKEN"] = "hf_right"
        ok = _run(
            tmp_path,
            "prefetch",
            REPO,
            "--endpoint",
            fake.endpoint,
            "--cache-dir",
            str(tmp_path / "c"),
            env=env,
        )
    assert ok.returncode == 0, ok.stderr


# ------------------------------------------------ 8. --config after the verb, for every verb


@pytest.mark.parametrize(
    "verb", ["prefetch", "load", "daemon", "status", "prune", "verify", "ls", "demo"]
)
def test_every_subcommand_takes_config_after_the_verb(verb: str, tmp_path: Path) -> None:
    """README: `shardsync --config PATH ...`, and all subcommands take `--config PATH` after
    the verb too (one rule for all)."""
    from shardsync.cli import _parser

    path = tmp_path / "c.toml"
    extra = ["acme/x"] if verb in ("prefetch", "load") else []
    args = _parser().parse_args([verb, *extra, "--config", str(path)])
    assert args.config == path


async def test_the_daemons_cache_usage_is_current_right_after_a_job(
    fake_hub: FakeHub, checkpoint: Checkpoint
) -> None:
    """docs/daemon.md, `shardsync status`/`GET /v1/cache`/`/metrics`: the cache usage is rescanned
    when a job fetched files, not up to 10 s later."""
    from daemons import api, daemon_in_loop, short_tmp

    import shardsync
    from shardsync.config import DaemonConfig

    fake_hub.add_checkpoint(REPO, checkpoint)
    with short_tmp() as work:
        socket_path = work / "shardsync" / "d.sock"
        config = fast_config(work / "dc", fake_hub.endpoint)
        async with daemon_in_loop(config, socket_path):
            _, before = await api(socket_path, "GET", "/v1/cache")
            assert before["blobs"] == 0
            client_config = replace(config, daemon=DaemonConfig(socket=socket_path))
            async with shardsync.Client(client_config, fallback="error") as client:
                await (await client.prefetch(REPO)).wait()
            _, after = await api(socket_path, "GET", "/v1/cache")
            _, metrics = await api(socket_path, "GET", "/metrics")
    assert after["blobs"] == len(checkpoint.files)
    assert f"shardsync_cache_blobs {len(checkpoint.files)}" in metrics
