"""Download benchmark: shardsync against huggingface_hub and aria2c, the bytes from a real nginx.

    python bench/download.py [--size 2GB] [--shards 4] [--bandwidth 25MB] [--latency 0.02]
                             [--repeat 2] [--out bench/results]
                             [--tools shardsync,hf,aria2,aria2-sha256,aria2-sync]
                             [--scenarios uncapped,capped,disk] [--data-dir DIR]
                             [--tmpfs-dir DIR] [--disk-dir DIR] [--shardsync-config PATH]

The origin is built like the real Hub's: the fake Hub (``python -m shardsync.testing serve
--cdn-base URL``, its own process) answers the API and the resolves and redirects every LFS
file with a 302 to a real nginx that serves the blobs named by their sha256 (``sendfile on``).
Small files (config, index) come from the fake Hub itself, as on the Hub. So no tool is
measured against a Python server's ceiling. Scenarios:

- ``uncapped``: loopback at nginx's full speed, destination on a tmpfs: the clients' own CPU
  cost decides.
- ``capped``: nginx ``limit_rate`` of ``--bandwidth`` (25 MB/s) per connection, like one CDN
  connection over the internet; stock nginx has no first-byte delay, so ``--latency`` (20 ms)
  delays every fake-Hub answer (API calls and resolves) instead. Destination on a tmpfs.
- ``disk``: uncapped, destination on the machine's real disk (``--disk-dir``): shardsync, which
  fsyncs every blob and directory before it publishes, against aria2c followed by ``sync``.

Tools, each a subprocess timed by the wall clock a user would see (interpreter start included):
``shardsync`` (``prefetch --no-daemon``: sha256 verified, published into its cache),
``hf`` (``snapshot_download``, defaults), ``aria2`` (``aria2c -x16 -s16 -j4``, one input-file
entry per file, no verification), ``aria2-sha256`` (the same, then ``openssl dgst -sha256`` of
every file compared with the checkpoint's digests, inside the clock) and ``aria2-sync`` (the
same, then ``sync``; disk scenario only). CPU is the child's ``getrusage(RUSAGE_CHILDREN)``
delta (user + system, its own children included), per GB delivered; nginx's CPU and the bytes
it sent (its access log) are recorded per run too, so a run that bypassed the CDN would show.

Each run downloads into a fresh empty directory; afterwards (not timed) every delivered file is
compared by sha256 with the checkpoint, then deleted. ``--repeat N`` rounds interleave the tools;
a row reports the best time and the range. The table, the issue's targets as PASS/FAIL,
``<out>/download.json`` (every run, the machine, the configuration) and ``<out>/download.png``
(needs the ``bench`` extra: matplotlib) come out. The exit status is 1 only if a tool failed or
delivered wrong bytes; a missed target is a result, reported as FAIL, not an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common import (  # bench/common.py, beside this script
    REPO_ID,
    RESULTS,
    Invocation,
    Origin,
    Scenario,
    Servers,
    beyond_hashes,
    clean_env,
    compile_shardsync,
    cpu_model,
    data_dir_for,
    ensure_origin,
    fs_type,
    hash_costs,
    last_line,
    log,
    machine_info,
    mean_costs,
    process_cpu_s,
    remove_tree,
    run_timed,
    serve_scenario,
    sha256_file,
    shardsync_invocation,
    size_arg,
)

from shardsync.config import load_config

TOOLS = ("shardsync", "hf", "aria2", "aria2-sha256", "aria2-sync")
TOOL_LABELS = {
    "shardsync": "shardsync",
    "hf": "snapshot_download",
    "aria2": "aria2c",
    "aria2-sha256": "aria2c + sha256",
    "aria2-sync": "aria2c + sync",
}
SCENARIOS = ("uncapped", "capped", "disk")
TMPFS_TOOLS = ("shardsync", "hf", "aria2", "aria2-sha256")
DISK_TOOLS = ("shardsync", "aria2-sync")
BASELINE = {"uncapped": "aria2", "capped": "aria2", "disk": "aria2-sync"}
HASHED = {"shardsync": ("sha256", "xxh3_128"), "aria2-sha256": ("sha256",)}
"""The hashes each tool computes: its CPU beyond them is what the table's last column shows."""
TARGET_RATIO = {"uncapped": 1.0, "capped": 1.0, "disk": 1.1}
"""What shardsync's time is compared with in each scenario (the issue's targets)."""
TARGET_CPU_S_PER_GB = 2.0
RUN_TIMEOUT_S = 900.0

_HF_SCRIPT = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "print(snapshot_download(sys.argv[1], endpoint=sys.argv[2], cache_dir=sys.argv[3]))\n"
)
_ARIA2 = ["aria2c", "--no-conf", "-x16", "-s16", "-j4", "--file-allocation=none"]
_ARIA2 += ["--console-log-level=warn", "--summary-interval=0"]


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run and what the check after it found."""

    scenario: str
    tool: str
    repeat: int
    seconds: float
    bytes: int
    files: int
    ok: bool
    error: str | None
    cpu_s: float | None = None
    """The child's user + system CPU seconds (its own children included)."""
    cdn_bytes: int | None = None
    """What nginx's access log says it sent for LFS files during the run."""
    cdn_requests: int | None = None
    nginx_cpu_s: float | None = None
    hub_cpu_s: float | None = None

    @property
    def cpu_s_per_gb(self) -> float | None:
        return None if self.cpu_s is None or not self.bytes else self.cpu_s / (self.bytes / 1e9)


@dataclass(frozen=True, slots=True)
class Row:
    """One (scenario, tool) pair over its runs; None where any of its runs failed."""

    scenario: str
    tool: str
    seconds: float | None
    """Best of the runs."""
    worst_s: float | None
    mb_per_s: float | None
    """At the best time."""
    cpu_s_per_gb: float | None
    """Median of the runs."""
    cpu_range: tuple[float, float] | None
    vs_baseline: float | None
    """Best time over the scenario's baseline's best time (aria2c; aria2c + sync on disk)."""
    nginx_cpu_s_per_gb: float | None
    runs: int


@dataclass(frozen=True, slots=True)
class Check:
    """One target from the issue, evaluated on the rows."""

    scenario: str
    target: str
    status: Literal["PASS", "FAIL", "SKIP"]
    detail: str


@dataclass(frozen=True, slots=True)
class Settings:
    """The command line, parsed and validated."""

    size: int
    size_label: str
    shards: int
    bandwidth: float
    latency: float
    repeat: int
    out: Path
    tools: tuple[str, ...]
    scenarios: tuple[str, ...]
    data_dir: Path
    shardsync_config: Path | None
    tmpfs_dir: Path = Path("/dev/shm/shardsync-bench")
    disk_dir: Path = Path("/var/tmp/shardsync-bench")


# ---------------------------------------------------------------------------------------------
# Command line


def _csv(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}, got {text!r}")
        return items

    return parse


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        description="Time shardsync, huggingface_hub and aria2c on the same checkpoint, "
        "the bytes served by nginx."
    )
    parser.add_argument("--size", default="2GB", help="checkpoint size (default 2GB)")
    parser.add_argument("--shards", type=int, default=4, help="number of shards (default 4)")
    parser.add_argument(
        "--bandwidth", type=size_arg, default="25MB", help="capped: nginx limit_rate per connection"
    )
    parser.add_argument(
        "--latency", type=float, default=0.02, help="capped: delay of each fake-Hub answer (s)"
    )
    parser.add_argument("--repeat", type=int, default=2, help="rounds; the best time counts")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--tools", type=_csv(TOOLS), default=TOOLS, help=",".join(TOOLS))
    parser.add_argument(
        "--scenarios", type=_csv(SCENARIOS), default=SCENARIOS, help=",".join(SCENARIOS)
    )
    parser.add_argument("--data-dir", type=Path, help="where the checkpoint is built and kept")
    parser.add_argument(
        "--tmpfs-dir",
        type=Path,
        default=Path("/dev/shm/shardsync-bench"),
        help="downloads of the uncapped and capped scenarios (a tmpfs)",
    )
    parser.add_argument(
        "--disk-dir",
        type=Path,
        default=Path("/var/tmp/shardsync-bench"),
        help="downloads of the disk scenario (a real disk)",
    )
    parser.add_argument("--shardsync-config", type=Path, help="TOML passed as shardsync --config")
    args = parser.parse_args(argv)
    size = size_arg(args.size)
    if args.shards < 1 or args.repeat < 1 or size <= 0:
        parser.error("--size, --shards and --repeat must be positive")
    if args.shardsync_config is not None and not args.shardsync_config.is_file():
        parser.error(f"--shardsync-config {args.shardsync_config} is not a file")
    return Settings(
        size=size,
        size_label=args.size,
        shards=args.shards,
        bandwidth=float(args.bandwidth),
        latency=args.latency,
        repeat=args.repeat,
        out=args.out,
        tools=args.tools,
        scenarios=args.scenarios,
        data_dir=args.data_dir or data_dir_for(args.size, args.shards),
        shardsync_config=args.shardsync_config,
        tmpfs_dir=args.tmpfs_dir,
        disk_dir=args.disk_dir,
    )


def scenarios(settings: Settings) -> list[Scenario]:
    table = {
        "uncapped": Scenario("uncapped", None, None),
        "capped": Scenario("capped", settings.bandwidth, settings.latency or None),
        "disk": Scenario("disk", None, None, disk=True),
    }
    return [table[name] for name in settings.scenarios]


def scenario_tools(scenario: Scenario, tools: Sequence[str]) -> list[str]:
    allowed = DISK_TOOLS if scenario.disk else TMPFS_TOOLS
    return [tool for tool in tools if tool in allowed]


# ---------------------------------------------------------------------------------------------
# The tools


def hf_invocation(endpoint: str, work: Path, origin: Origin, config: Path | None) -> Invocation:
    """huggingface_hub's ``snapshot_download`` with its defaults (8 workers, one stream each).

    The fake hub sends no ``X-Xet-Hash``, so the plain HTTP path is taken; HF_HUB_DISABLE_XET
    makes sure of it even if that changed.
    """
    env = clean_env(work, endpoint)
    env["HF_HUB_DISABLE_XET"] = "1"
    argv = [sys.executable, "-c", _HF_SCRIPT, REPO_ID, endpoint, str(work / "hf-cache")]
    return Invocation(argv, env, last_line)


def _aria2_argv(endpoint: str, work: Path, origin: Origin) -> tuple[list[str], Path]:
    """aria2c with 16 connections per file and 4 files at once, no checksum.

    Each file is asked for at its Hub resolve URL, so aria2 pays for the 302 to the CDN like
    the other tools do. The URLs come from an input file, one entry per file with its ``out=``
    name, so each is its own download, which is what ``-Z`` does for URLs on the command line
    (without either, several URLs are taken as mirrors of one file). ``-Z`` itself is not
    passed: aria2 1.36 then ignores ``out=`` and names each shard after the CDN's sha256 URL.
    """
    out = work / "aria2"
    urls = work / "urls.txt"
    entries = [
        f"{endpoint}/{REPO_ID}/resolve/main/{path}\n  out={path}\n" for path in sorted(origin.files)
    ]
    urls.write_text("".join(entries))
    return [*_ARIA2, "-d", str(out), "-i", str(urls)], out


def aria2_invocation(endpoint: str, work: Path, origin: Origin, config: Path | None) -> Invocation:
    """aria2c alone: nothing verified (its ``checksum=`` option is not used)."""
    argv, out = _aria2_argv(endpoint, work, origin)
    return Invocation(argv, clean_env(work, endpoint), lambda _stdout: out)


def aria2_sha256_invocation(
    endpoint: str, work: Path, origin: Origin, config: Path | None
) -> Invocation:
    """aria2c, then ``openssl dgst -sha256`` of every file (one process, file after file, as a
    user would check them), compared with the checkpoint's digests; all inside the clock.
    openssl, not coreutils ``sha256sum``: it uses the CPU's SHA extensions (4x faster here)."""
    argv, out = _aria2_argv(endpoint, work, origin)
    expected = work / "sha256.expected"
    names = sorted(origin.files)
    expected.write_text("".join(f"{origin.files[n][1]} *{n}\n" for n in names))
    script = (
        f"{shlex.join(argv)} && cd {shlex.quote(str(out))} && "
        f"openssl dgst -sha256 -r {shlex.join(names)} | cmp -s - {shlex.quote(str(expected))}"
    )
    return Invocation(["sh", "-c", script], clean_env(work, endpoint), lambda _stdout: out)


def aria2_sync_invocation(
    endpoint: str, work: Path, origin: Origin, config: Path | None
) -> Invocation:
    """aria2c, then ``sync``: the data is durable when the clock stops, as shardsync's is."""
    argv, out = _aria2_argv(endpoint, work, origin)
    script = f"{shlex.join(argv)} && sync"
    return Invocation(["sh", "-c", script], clean_env(work, endpoint), lambda _stdout: out)


INVOCATIONS: dict[str, Callable[[str, Path, Origin, Path | None], Invocation]] = {
    "shardsync": shardsync_invocation,
    "hf": hf_invocation,
    "aria2": aria2_invocation,
    "aria2-sha256": aria2_sha256_invocation,
    "aria2-sync": aria2_sync_invocation,
}


def available_tools(tools: Sequence[str]) -> tuple[str, ...]:
    """Drop the aria2 rows with a note when it is not installed, rather than failing."""
    if shutil.which("aria2c") is None:
        log("aria2c is not on PATH: skipping it (apt-get install aria2 to include it)")
        return tuple(tool for tool in tools if not tool.startswith("aria2"))
    if "aria2-sha256" in tools and shutil.which("openssl") is None:
        log("openssl is not on PATH: skipping aria2c + sha256")
        return tuple(tool for tool in tools if tool != "aria2-sha256")
    return tuple(tools)


# ---------------------------------------------------------------------------------------------
# Running and checking


def run_once(
    tool: str, scenario: Scenario, repeat: int, servers: Servers, origin: Origin, settings: Settings
) -> Run:
    """Time one tool in a fresh directory, check its files, delete them."""
    work = Path(tempfile.mkdtemp(prefix=f"{tool}-", dir=scratch_dir(settings, scenario)))
    name = scenario.name
    try:
        invocation = INVOCATIONS[tool](servers.endpoint, work, origin, settings.shardsync_config)
        os.sync()  # the previous run's writeback must not land on this run's clock
        time.sleep(0.2)  # and let nginx log the previous run's last requests
        servers.cdn_since_last()
        nginx_before = process_cpu_s(servers.nginx.pid)
        hub_before = process_cpu_s(servers.hub_pid)
        timed = run_timed(invocation.argv, invocation.env, RUN_TIMEOUT_S)
        result, seconds, cpu = timed.result, timed.seconds, timed.cpu_s
        if result is None:
            timeout = f"killed after {RUN_TIMEOUT_S:.0f} s"
            return Run(name, tool, repeat, RUN_TIMEOUT_S, 0, 0, False, timeout)
        nginx_cpu = _delta(nginx_before, process_cpu_s(servers.nginx.pid))
        hub_cpu = _delta(hub_before, process_cpu_s(servers.hub_pid))
        time.sleep(0.2)  # nginx writes a request's line as it ends: let the last ones land
        cdn_requests, cdn_bytes = servers.cdn_since_last()
        extra = {
            "cpu_s": cpu,
            "cdn_bytes": cdn_bytes,
            "cdn_requests": cdn_requests,
            "nginx_cpu_s": nginx_cpu,
            "hub_cpu_s": hub_cpu,
        }
        if result.returncode != 0:
            failure = f"exit {result.returncode}: {result.stderr.strip()[-2000:]}"
            return Run(name, tool, repeat, seconds, 0, 0, False, failure, **extra)
        delivered, problems = verify(invocation.locate(result.stdout), origin)
        if cdn_bytes < sum(size for size, _ in origin.lfs.values()):
            problems.append(f"nginx sent only {cdn_bytes} B of the LFS files: bypassed the CDN?")
        size = sum(origin.files[path][0] for path in delivered)
        error = "; ".join(problems) if problems else None
        return Run(name, tool, repeat, seconds, size, len(delivered), not problems, error, **extra)
    finally:
        remove_tree(work)


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def verify(root: Path, origin: Origin) -> tuple[list[str], list[str]]:
    """Return (files delivered, problems): every file must be an origin file with its sha256,
    and the weights and JSON files must all be there."""
    if not root.is_dir():
        return [], [f"{root} is not a directory"]
    delivered, problems = [], []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel not in origin.files:
            problems.append(f"unexpected file {rel}")
        elif sha256_file(path) != origin.files[rel][1]:
            problems.append(f"{rel}: sha256 differs from the origin")
        else:
            delivered.append(rel)
    missing = sorted(origin.required - set(delivered))
    problems += [f"missing {rel}" for rel in missing]
    return delivered, problems


def run_all(origin: Origin, settings: Settings, tools: Sequence[str]) -> list[Run]:
    """Every scenario, every round, every tool; tools interleave so drift hits all alike."""
    runs: list[Run] = []
    for scenario in scenarios(settings):
        mine = scenario_tools(scenario, tools)
        if not mine:
            continue
        with serve_scenario(origin, scenario, settings.data_dir) as servers:
            log(f"{scenario.name}: fake hub at {servers.endpoint}, nginx at {servers.nginx.url}")
            for repeat in range(settings.repeat):
                for tool in mine:
                    run = run_once(tool, scenario, repeat, servers, origin, settings)
                    status = "ok" if run.ok else f"FAILED: {run.error}"
                    cpu = "-" if run.cpu_s_per_gb is None else f"{run.cpu_s_per_gb:.2f}"
                    log(
                        f"{scenario.name} {TOOL_LABELS[tool]} #{repeat + 1}: {run.seconds:.2f} s, "
                        f"{cpu} CPU-s/GB, nginx sent {(run.cdn_bytes or 0) / 1e6:.0f} MB "
                        f"in {run.cdn_requests} requests: {status}"
                    )
                    runs.append(run)
    return runs


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(runs: Sequence[Run], settings: Settings, tools: Sequence[str]) -> list[Row]:
    best: dict[tuple[str, str], Row] = {}
    for scenario in scenarios(settings):
        for tool in scenario_tools(scenario, tools):
            mine = [r for r in runs if r.scenario == scenario.name and r.tool == tool]
            if not mine or not all(r.ok for r in mine):
                best[scenario.name, tool] = Row(
                    scenario.name, tool, None, None, None, None, None, None, None, len(mine)
                )
                continue
            fastest = min(mine, key=lambda r: r.seconds)
            cpus = [r.cpu_s_per_gb for r in mine if r.cpu_s_per_gb is not None]
            nginx = [r.nginx_cpu_s / (r.bytes / 1e9) for r in mine if r.nginx_cpu_s is not None]
            best[scenario.name, tool] = Row(
                scenario=scenario.name,
                tool=tool,
                seconds=fastest.seconds,
                worst_s=max(r.seconds for r in mine),
                mb_per_s=fastest.bytes / 1e6 / fastest.seconds,
                cpu_s_per_gb=statistics.median(cpus) if cpus else None,
                cpu_range=(min(cpus), max(cpus)) if cpus else None,
                vs_baseline=None,
                nginx_cpu_s_per_gb=statistics.median(nginx) if nginx else None,
                runs=len(mine),
            )
    rows = []
    for (scenario, _tool), row in best.items():
        base = best.get((scenario, BASELINE[scenario]))
        ratio = None
        if row.seconds is not None and base is not None and base.seconds is not None:
            ratio = row.seconds / base.seconds
        rows.append(dataclasses.replace(row, vs_baseline=ratio))
    return rows


def target_checks(rows: Sequence[Row]) -> list[Check]:
    """The issue's targets: shardsync, verified and published, no slower than unverified
    aria2c on a tmpfs (capped and uncapped), at most 2 CPU-s/GB, and on the real disk within
    1.1x of aria2c followed by ``sync``."""
    table = {(r.scenario, r.tool): r for r in rows}
    checks = []
    for scenario in ("uncapped", "capped", "disk"):
        baseline = BASELINE[scenario]
        ratio = TARGET_RATIO[scenario]
        target = f"shardsync <= {ratio:.1f} x {TOOL_LABELS[baseline]} (best of runs)"
        mine, theirs = table.get((scenario, "shardsync")), table.get((scenario, baseline))
        if mine is None or theirs is None:
            if mine is not None or theirs is not None:
                checks.append(Check(scenario, target, "SKIP", "tool not run"))
        elif mine.seconds is None or theirs.seconds is None:
            checks.append(Check(scenario, target, "FAIL", "a run failed"))
        else:
            detail = (
                f"{mine.seconds:.2f} s vs {theirs.seconds:.2f} s "
                f"({mine.seconds / theirs.seconds:.2f}x)"
            )
            status: Literal["PASS", "FAIL"] = (
                "PASS" if mine.seconds <= ratio * theirs.seconds else "FAIL"
            )
            checks.append(Check(scenario, target, status, detail))
        if scenario != "disk" and mine is not None:
            target = f"shardsync <= {TARGET_CPU_S_PER_GB:.1f} CPU-s/GB (median)"
            if mine.cpu_s_per_gb is None:
                checks.append(Check(scenario, target, "FAIL", "a run failed"))
            else:
                status = "PASS" if mine.cpu_s_per_gb <= TARGET_CPU_S_PER_GB else "FAIL"
                checks.append(Check(scenario, target, status, f"{mine.cpu_s_per_gb:.2f} CPU-s/GB"))
    return checks


def _cell(value: float | None, spec: str, width: int, suffix: str = "") -> str:
    text = "-" if value is None else format(value, spec) + suffix
    return text.rjust(width)


def tool_beyond_hashes(
    tool: str, cpu_s_per_gb: float | None, costs: Mapping[str, float]
) -> float | None:
    """A tool's CPU-s/GB less what this machine spends on the hashes it computes."""
    if cpu_s_per_gb is None:
        return None
    return beyond_hashes(cpu_s_per_gb, costs, HASHED.get(tool, ()))


def print_report(
    rows: Sequence[Row],
    checks: Sequence[Check],
    runs: Sequence[Run],
    costs: Mapping[str, float],
) -> None:
    print(
        f"machine: {cpu_model() or '?'}, {os.cpu_count()} cores; CPU-s/GB of sha256 "
        f"{costs['sha256']:.2f}, xxh3-128 {costs['xxh3_128']:.2f} (measured in this run)"
    )
    header = (
        f"{'scenario':<9} {'tool':<18} {'best s':>7} {'range s':>12} {'MB/s':>7} "
        f"{'CPU-s/GB':>9} {'CPU range':>11} {'vs base':>8} {'nginx CPU/GB':>13} "
        f"{'beyond hash':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = "-" if row.seconds is None else f"{row.seconds:.2f}-{row.worst_s:.2f}"
        cpu_spread = "-" if row.cpu_range is None else "{:.2f}-{:.2f}".format(*row.cpu_range)
        print(
            f"{row.scenario:<9} {TOOL_LABELS[row.tool]:<18} {_cell(row.seconds, '.2f', 7)} "
            f"{spread:>12} {_cell(row.mb_per_s, '.0f', 7)} {_cell(row.cpu_s_per_gb, '.2f', 9)} "
            f"{cpu_spread:>11} {_cell(row.vs_baseline, '.2f', 8, 'x')} "
            f"{_cell(row.nginx_cpu_s_per_gb, '.2f', 13)} "
            f"{_cell(tool_beyond_hashes(row.tool, row.cpu_s_per_gb, costs), '.2f', 12)}"
        )
    print("(vs base: best time over aria2c's, aria2c + sync's on disk; below 1 is faster;")
    print(" beyond hash: CPU-s/GB less this machine's cost of the hashes the tool computes:")
    print(" sha256 + xxh3-128 for shardsync, sha256 for aria2c + sha256, none for the others)")
    print()
    for check in checks:
        print(f"{check.status:<4}  {check.scenario:<9} {check.target:<46} {check.detail}")
    for run in runs:
        if not run.ok:
            print(
                f"FAILED run: {run.scenario} {TOOL_LABELS[run.tool]} #{run.repeat + 1}: {run.error}"
            )


# ---------------------------------------------------------------------------------------------
# Results files


def shardsync_settings(config: Path | None) -> dict[str, object]:
    """The effective shardsync tuning (the file's keys over the defaults), for the record."""
    loaded = load_config(config, {}, cache_dir=Path("per-run"))
    return {
        "config_file": str(config) if config else None,
        "config_text": config.read_text() if config else None,
        "max_files": loaded.max_files,
        "fetch": dataclasses.asdict(loaded.fetch),
    }


def write_json(
    path: Path,
    settings: Settings,
    origin: Origin,
    runs: Sequence[Run],
    rows: Sequence[Row],
    checks: Sequence[Check],
    costs: Mapping[str, float],
) -> None:
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine_info(), "cpu": cpu_model(), "hash_cpu_s_per_gb": dict(costs)},
        "settings": {
            "size": settings.size,
            "shards": settings.shards,
            "bandwidth_per_connection": settings.bandwidth,
            "bandwidth_how": "nginx limit_rate (capped only)",
            "latency_s": settings.latency,
            "latency_how": "fake Hub answers (API, resolve) in the capped scenario",
            "repeat": settings.repeat,
            "tools": list(settings.tools),
            "scenarios": list(settings.scenarios),
            "tmpfs_dir": str(settings.tmpfs_dir),
            "tmpfs_dir_fs": fs_type(settings.tmpfs_dir),
            "disk_dir": str(settings.disk_dir),
            "disk_dir_fs": fs_type(settings.disk_dir),
            "shardsync": shardsync_settings(settings.shardsync_config),
            "hf": {"max_workers": 8, "xet": "disabled"},
            "aria2c": " ".join(_ARIA2),
        },
        "checkpoint": {
            "files": len(origin.files),
            "bytes": origin.total_size,
            "lfs_bytes": sum(size for size, _ in origin.lfs.values()),
        },
        "runs": [{**dataclasses.asdict(run), "cpu_s_per_gb": run.cpu_s_per_gb} for run in runs],
        "summary": [dataclasses.asdict(row) for row in rows],
        "checks": [dataclasses.asdict(check) for check in checks],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_png(path: Path, rows: Sequence[Row], settings: Settings) -> None:
    """Best time (bars, range as whiskers) and CPU-s/GB per tool and scenario; skipped with a
    note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return
    tools = list(dict.fromkeys(row.tool for row in rows))
    names = list(dict.fromkeys(row.scenario for row in rows))
    width = 0.8 / max(len(tools), 1)
    fig, (ax_time, ax_cpu) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, tool in enumerate(tools):
        mine = {row.scenario: row for row in rows if row.tool == tool}
        xs = [n + (i - (len(tools) - 1) / 2) * width for n in range(len(names))]
        present = [(x, mine[n]) for x, n in zip(xs, names, strict=True) if n in mine]
        if not present:
            continue
        px = [x for x, _ in present]
        times = [r.seconds or 0.0 for _, r in present]
        spread = [((r.worst_s or 0.0) - (r.seconds or 0.0)) for _, r in present]
        bars = ax_time.bar(
            px, times, width, yerr=[[0] * len(spread), spread], capsize=2, label=TOOL_LABELS[tool]
        )
        ax_time.bar_label(
            bars,
            labels=["failed" if r.seconds is None else f"{r.seconds:.1f}" for _, r in present],
            fontsize=7,
            padding=2,
        )
        cpus = [r.cpu_s_per_gb or 0.0 for _, r in present]
        bars = ax_cpu.bar(px, cpus, width, label=TOOL_LABELS[tool])
        ax_cpu.bar_label(
            bars,
            labels=["" if r.cpu_s_per_gb is None else f"{r.cpu_s_per_gb:.1f}" for _, r in present],
            fontsize=7,
            padding=2,
        )
    ax_cpu.axhline(TARGET_CPU_S_PER_GB, color="grey", linestyle=":", linewidth=1)
    for ax, label in (
        (ax_time, "seconds, best of runs (lower is better)"),
        (ax_cpu, "client CPU-s per GB (lower is better)"),
    ):
        ax.set_xticks(range(len(names)), [_scenario_label(n, settings) for n in names])
        ax.set_ylabel(label)
        ax.margins(y=0.12)
    fig.suptitle(
        f"{settings.size_label} in {settings.shards} shards, bytes from nginx (sendfile), "
        f"{os.cpu_count()} CPUs, {settings.repeat} rounds",
        fontsize=10,
    )
    handles, labels = ax_time.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=len(tools), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _scenario_label(name: str, settings: Settings) -> str:
    if name == "capped":
        return f"capped, tmpfs\n({settings.bandwidth / 1e6:g} MB/s per connection)"
    if name == "uncapped":
        return "uncapped, tmpfs"
    return "uncapped, real disk\n(durable: fsync / sync)"


# ---------------------------------------------------------------------------------------------
# Plumbing


def scratch_dir(settings: Settings, scenario: Scenario | None = None) -> Path:
    """Where a scenario's runs write: the tmpfs, or the real disk for ``disk``; each run's
    directory is deleted after its check."""
    path = settings.disk_dir if scenario is not None and scenario.disk else settings.tmpfs_dir
    path = path / "work"
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_directories(settings: Settings) -> None:
    """Say so when the tmpfs is not one, or the disk is a tmpfs: the rows would mislead."""
    names = set(settings.scenarios)
    if names & {"uncapped", "capped"}:
        kind = fs_type(settings.tmpfs_dir.parent)
        if kind != "tmpfs":
            log(f"warning: --tmpfs-dir {settings.tmpfs_dir} is on {kind}, not a tmpfs")
    if "disk" in names:
        kind = fs_type(settings.disk_dir.parent)
        if kind in ("tmpfs", "ramfs"):
            log(f"warning: --disk-dir {settings.disk_dir} is on {kind}, not a disk")


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    if shutil.which("nginx") is None and not os.access("/usr/sbin/nginx", os.X_OK):
        log("nginx is not installed (apt-get install nginx): it serves the bytes")
        return 2
    tools = available_tools(settings.tools)
    check_directories(settings)
    origin = ensure_origin(settings.data_dir, settings.size, settings.shards, settings.size_label)
    log(f"checkpoint: {len(origin.files)} files, {origin.total_size / 1e6:.0f} MB")
    compile_shardsync()
    costs = hash_costs()
    try:
        runs = run_all(origin, settings, tools)
    finally:
        remove_tree(settings.tmpfs_dir / "work")
        remove_tree(settings.disk_dir / "work")
    rows = summarize(runs, settings, tools)
    checks = target_checks(rows)
    costs = mean_costs(costs, hash_costs())
    print_report(rows, checks, runs, costs)
    settings.out.mkdir(parents=True, exist_ok=True)
    write_json(settings.out / "download.json", settings, origin, runs, rows, checks, costs)
    write_png(settings.out / "download.png", rows, settings)
    log(f"results in {settings.out}/download.json and download.png")
    return 0 if all(run.ok for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
