"""``shardsync prefetch`` as users run it: real processes, kill -9, concurrency, full disks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import assert_snapshot_matches, assert_store_verified, kill_when, serving, tmpfs

from shardsync.testing import Bandwidth, Checkpoint, FakeHub, build_checkpoint
from shardsync.testing.nginx import access_log, serve_directory

REPO = "acme/cli"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt"), total_bytes=40 << 20, n_shards=4, seed=2
    )


@pytest.fixture
def hub(checkpoint: Checkpoint) -> Iterator[FakeHub]:
    with serving({REPO: checkpoint}) as running:
        yield running


def _config(tmp_path: Path) -> Path:
    """Small write buffers and frequent resume records: a kill -9 loses little."""
    path = tmp_path / "shardsync.toml"
    path.write_text(
        '[download]\nconnections_per_file = 2\nchunk_size = "1MiB"\nwrite_size = "128KiB"\n'
        'read_size = "64KiB"\nsidecar_interval = 0.1\n'
        "[retry]\nbase_delay = 0.01\nmax_delay = 0.1\n"
    )
    return path


def _cmd(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "shardsync.cli", "--config", str(_config(tmp_path)), *args]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(tmp_path, *args), capture_output=True, text=True, timeout=120)


def _shard_bytes(checkpoint: Checkpoint) -> int:
    return sum(checkpoint.path(s).stat().st_size for s in checkpoint.shards)


def test_a_cache_dir_given_as_tilde_is_the_users_home(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """``--cache-dir=~/c`` reaches the command unexpanded (a shell expands ``~`` only at a
    word's start): it made a cache in a folder named ``~`` under the working directory, as
    ``$SHARDSYNC_CACHE_DIR`` and ``cache.dir`` never did."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    done = subprocess.run(
        [*_cmd(tmp_path, "prefetch", REPO, "--endpoint", hub.endpoint, "--cache-dir=~/c")],
        capture_output=True, text=True, timeout=120, cwd=work,
        env={**os.environ, "HOME": str(home), "SHARDSYNC_SOCKET": str(tmp_path / "none.sock")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_snapshot_matches(Path(done.stdout.strip().splitlines()[-1]), checkpoint)
    assert Path(done.stdout.strip().splitlines()[-1]).is_relative_to(home / "c")
    assert list(work.iterdir()) == []


def test_prefetch_prints_the_snapshot_path(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    out = _run(tmp_path, "prefetch", REPO, "--endpoint", hub.endpoint, "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr
    snapshot = Path(out.stdout.strip())
    assert snapshot.parent == cache / "hub" / "models--acme--cli" / "snapshots"
    assert_snapshot_matches(snapshot, checkpoint)
    # not a TTY: plain log lines, one per file
    assert out.stderr.count("verified=sha256") == len(checkpoint.shards)


def test_json_and_offline(hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    common = ("--endpoint", hub.endpoint, "--cache-dir", str(cache), "--json")
    first = json.loads(_run(tmp_path, "prefetch", REPO, *common).stdout)
    assert first["bytes_downloaded"] == first["total_size"] > 0
    assert {f["source"] for f in first["files"]} == {"network"}
    hub.reset_log()
    offline = _run(tmp_path, "prefetch", REPO, *common, "--offline")
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["snapshot_path"] == first["snapshot_path"]
    assert hub.log == []


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("acme/missing",), 3, "RepoNotFound"),
        ((REPO, "--revision", "nope"), 3, "RevisionNotFound"),
        (("not a repo!",), 2, "invalid repo id"),
        ((REPO, "--offline"), 10, "not complete"),
    ],
)
def test_errors_are_one_clear_line(
    hub: FakeHub, tmp_path: Path, args: tuple[str, ...], code: int, needle: str
) -> None:
    out = _run(
        tmp_path, "prefetch", *args, "--endpoint", hub.endpoint, "--cache-dir", str(tmp_path / "c")
    )
    assert out.returncode == code
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardsync: error:"), out.stderr
    assert needle in lines[0]


def test_kill_9_then_rerun_refetches_little(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    total = _shard_bytes(checkpoint)
    cache = tmp_path / "cache"
    rule = hub.faults.add(Bandwidth(1_500_000))  # 8 connections: ~12 MB/s, ~3.5 s in all
    proc = subprocess.Popen(
        _cmd(
            tmp_path,
            "prefetch",
            REPO,
            "--endpoint",
            hub.endpoint,
            "--cache-dir",
            str(cache),
            "--quiet",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_when(proc, lambda: hub.bytes_served("*.safetensors") >= total * 0.5)
    assert not (cache / "hub" / "models--acme--cli" / "refs" / "main").exists()
    assert_store_verified(cache, checkpoint)
    hub.faults.remove(rule)
    out = _run(
        tmp_path, "prefetch", REPO, "--endpoint", hub.endpoint, "--cache-dir", str(cache), "--json"
    )
    assert out.returncode == 0, out.stderr
    # Bytes served twice over both runs: what the kill cost (unwritten buffers, the last
    # resume-record interval), not a restart from zero.
    refetched = hub.bytes_served("*.safetensors") - total
    assert refetched < 0.10 * total, f"re-fetched {refetched} of {total} bytes"
    result = json.loads(out.stdout)
    assert sum(f["resumed"] for f in result["files"]) > 0
    assert_snapshot_matches(Path(result["snapshot_path"]), checkpoint)
    assert not list((cache / "partial").iterdir())  # no orphan temp files after a clean run


def test_two_concurrent_prefetches_download_each_byte_once(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    hub.faults.add(Bandwidth(2_000_000))
    cmd = _cmd(
        tmp_path, "prefetch", REPO, "--endpoint", hub.endpoint, "--cache-dir", str(cache), "--quiet"
    )
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    assert outs[0][0] == outs[1][0]
    served = hub.bytes_served("*.safetensors")
    assert served < 1.1 * _shard_bytes(checkpoint), served
    assert_snapshot_matches(Path(outs[0][0].strip()), checkpoint)


def test_disk_full_is_a_clear_error_and_keeps_the_partial(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    cache = tmp_path / "small"
    with tmpfs(cache, "size=10m"):
        out = _run(
            tmp_path, "prefetch", REPO, "--endpoint", hub.endpoint, "--cache-dir", str(cache)
        )
        assert out.returncode == 8, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("shardsync: error: no space left on device"), out.stderr
        assert "partial download is kept" in last
        partials = [p for p in (cache / "partial").iterdir() if p.suffix == ".part"]
        assert partials and any(p.stat().st_blocks > 0 for p in partials)
        assert_store_verified(cache, checkpoint)
        assert not (cache / "hub" / "models--acme--cli" / "refs" / "main").exists()


@pytest.mark.nginx
def test_plain_http_origin_with_nginx(checkpoint: Checkpoint, tmp_path: Path) -> None:
    work = tmp_path / "nginx"
    cache = tmp_path / "cache"
    with serve_directory(checkpoint.directory, work) as base:
        out = _run(tmp_path, "prefetch", base, "--cache-dir", str(cache), "--json")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert {f["verified"] for f in result["files"]} == {"tofu"}
        weights = [f["path"] for f in result["files"] if f["path"].endswith(".safetensors")]
        assert weights == list(checkpoint.shards)
        snapshot = Path(result["snapshot_path"])
        for rel in ("model.safetensors.index.json", *checkpoint.shards, "config.json"):
            assert (snapshot / rel).read_bytes() == checkpoint.path(rel).read_bytes()
        ranged = [line for line in access_log(work) if '" 206 ' in line]
        assert len(ranged) >= len(checkpoint.shards) * 2
        before = len(access_log(work))
        again = _run(tmp_path, "prefetch", base, "--cache-dir", str(cache), "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["snapshot_path"] == result["snapshot_path"]
        new = access_log(work)[before:]
        assert not any(line.split('"')[1].startswith("GET") for line in new), new


def test_local_directory_origin(checkpoint: Checkpoint, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = _run(tmp_path, "prefetch", str(checkpoint.directory), "--cache-dir", str(cache), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert_snapshot_matches(Path(result["snapshot_path"]), checkpoint)
    assert {f["source"] for f in result["files"]} == {"local"}
    again = json.loads(
        _run(
            tmp_path, "prefetch", str(checkpoint.directory), "--cache-dir", str(cache), "--json"
        ).stdout
    )
    assert {f["source"] for f in again["files"]} == {"cache"}


def test_a_prefetch_from_elsewhere_than_the_hub_imports_no_hub_client(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """huggingface_hub serves Hub sources only: a local directory (or a URL, an ``s3://``
    prefix) is fetched without importing it, 0.06-0.12 s of a small model's prefetch."""
    probe = (
        "import sys\n"
        "from shardsync.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print('huggingface_hub' in sys.modules, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    argv = ["--config", str(_config(tmp_path)), "prefetch", str(checkpoint.directory)]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--quiet", "--no-daemon"]
    out = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "False"


def test_the_command_leaves_what_it_imported_out_of_garbage_collection(tmp_path: Path) -> None:
    """``shardsync`` (the console script and ``python -m shardsync.cli``) freezes what its
    imports built: every full collection, and those at exit, would walk it again. ``main``,
    which tests and embedders call in their own process, does not."""
    probe = (
        "import atexit, gc, sys\n"
        "import shardsync.cli as cli\n"
        "atexit.register(lambda: print(gc.get_freeze_count()))\n"
        "sys.argv = ['shardsync', 'ls', '--json', '--cache-dir', sys.argv[1]]\n"
        "cli.{entry}()\n"
    )
    counts = {}
    for entry in ("run", "main"):
        out = subprocess.run(
            [sys.executable, "-c", probe.format(entry=entry), str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        counts[entry] = int(out.stdout.strip().splitlines()[-1])
    assert counts["run"] > 10_000  # the modules' objects
    assert counts["main"] == 0
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="shardsync")
    assert script.value == "shardsync.cli:run"


@pytest.mark.parametrize("command", ["prefetch", "load"])
def test_help_names_every_kind_of_source(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from shardsync.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for kind in ("ORG/NAME", "http(s)", "s3://", "directory"):
        assert kind in shown


_RUN = """\
import atexit, sys, threading, time
from pathlib import Path
from shardsync import cli
marks, late_thread, argv = Path(sys.argv[1]), sys.argv[2] == "thread", sys.argv[3:]
atexit.register(lambda: (marks / "atexit").write_text("ran"))
def late():
    time.sleep(0.3)
    (marks / "thread").write_text("done")
def main(_argv=None):
    code = real(argv)
    if late_thread:
        threading.Thread(target=late).start()
    return code
real, cli.main = cli.main, main
cli.run()
"""


@pytest.mark.parametrize("thread", [False, True], ids=["alone", "a-thread-still-working"])
def test_the_command_ends_with_its_output_its_code_and_its_exit_handlers(
    tmp_path: Path, checkpoint: Checkpoint, thread: bool
) -> None:
    """``run`` ends the process without the interpreter's teardown: what the command wrote
    to a pipe, its exit status and the atexit handlers all survive, and a thread still
    working when the command returns finishes first."""
    local = ["ls", "--json", "--cache-dir"]
    cache = tmp_path / "cache"
    cached = ["--cache-dir", str(cache), "--quiet"]
    fetched = subprocess.run(
        [sys.executable, "-m", "shardsync.cli", "prefetch", str(checkpoint.directory), *cached],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fetched.returncode == 0, fetched.stderr
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's
    for argv, code in ([[*local, str(cache)], 0], [[*local, str(tmp_path / "nowhere")], 9]):
        marks = tmp_path / f"marks-{code}"
        marks.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", _RUN, str(marks), "thread" if thread else "-", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env=buffered,
        )
        assert done.returncode == code, done.stderr
        assert (marks / "atexit").read_text() == "ran"
        assert (marks / "thread").exists() == thread
        if code == 0:
            listing = json.loads(done.stdout)  # the whole of it, flushed
            assert [r["repo"] for r in listing["repos"]] == [str(checkpoint.directory)], listing
        else:
            assert done.stderr.startswith("shardsync: error:"), done.stderr
