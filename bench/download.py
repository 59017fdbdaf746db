"""Download benchmark: shardsync against huggingface_hub and aria2c, same files, same server.

    python bench/download.py [--size 2GB] [--shards 4] [--bandwidth 25MB] [--latency 0.02]
                             [--repeat 1] [--out bench/results] [--tools shardsync,hf,aria2]
                             [--scenarios capped,uncapped] [--data-dir DIR]
                             [--shardsync-config PATH]

Every tool runs as its own process against one fake Hub process (``python -m shardsync.testing
serve``), so client and server never share an interpreter and each timing is the wall clock a
user would see, interpreter start-up included. Scenarios:

- ``capped``: each connection is capped at ``--bandwidth`` with ``--latency`` before the first
  byte, like a CDN link on the internet: parallel connections pay off here.
- ``uncapped``: loopback at full speed, so the client's own CPU cost is what is measured.

Each run downloads into a fresh empty directory; its files are checked afterwards (not timed)
against the origin's sha256, then deleted, so disk use stays at the checkpoint plus one copy.
The table, the issue's target checks, ``<out>/download.json`` (every raw timing, the machine and
the configuration) and ``<out>/download.png`` (needs the ``bench`` extra: matplotlib) come out.
The exit status is 1 only if a tool failed or delivered wrong bytes; a missed target is a
result, reported as FAIL, not an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from shardsync.config import load_config, parse_size

REPO_ID = "bench/model"
TOOLS = ("shardsync", "hf", "aria2")
TOOL_LABELS = {"shardsync": "shardsync", "hf": "snapshot_download", "aria2": "aria2c"}
SCENARIOS = ("capped", "uncapped")
RESULTS = Path(__file__).resolve().parent / "results"
RUN_TIMEOUT_S = 3600.0
HUB_READY_TIMEOUT_S = 600.0
"""The hub hashes every file before it listens: a few seconds per GB."""

_DIGESTS_NAME = "sha256.json"
_HF_SCRIPT = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "print(snapshot_download(sys.argv[1], endpoint=sys.argv[2], cache_dir=sys.argv[3]))\n"
)
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Scenario:
    """How the fake hub shapes every response."""

    name: str
    bandwidth: float | None
    """Bytes/s per connection, None for no cap."""
    latency: float | None
    """Seconds before the first byte of each response, None for none."""


@dataclass(frozen=True, slots=True)
class Origin:
    """The checkpoint on disk and the digest of each of its files, computed once."""

    directory: Path
    files: Mapping[str, tuple[int, str]]
    """Relative path -> (size, sha256)."""

    @property
    def total_size(self) -> int:
        return sum(size for size, _ in self.files.values())

    @property
    def required(self) -> frozenset[str]:
        """What every tool must deliver: the weights and the JSON files (index, config)."""
        return frozenset(p for p in self.files if p.endswith((".safetensors", ".json")))


@dataclass(frozen=True, slots=True)
class Invocation:
    """One tool run: the command, its environment, and where its files end up."""

    argv: list[str]
    env: dict[str, str]
    locate: Callable[[str], Path]
    """Maps the run's stdout to the directory holding the downloaded files."""


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


@dataclass(frozen=True, slots=True)
class Row:
    """The median of one (scenario, tool) pair; None when any of its runs failed."""

    scenario: str
    tool: str
    seconds: float | None
    mb_per_s: float | None
    vs_aria2: float | None
    vs_hf: float | None


@dataclass(frozen=True, slots=True)
class Check:
    """One target from the issue, evaluated on the medians."""

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


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        description="Time shardsync, huggingface_hub and aria2c on the same checkpoint."
    )
    parser.add_argument("--size", default="2GB", help="checkpoint size (default 2GB)")
    parser.add_argument("--shards", type=int, default=4, help="number of shards (default 4)")
    parser.add_argument("--bandwidth", type=_size, default="25MB", help="capped: bytes/s per conn")
    parser.add_argument("--latency", type=float, default=0.02, help="capped: first-byte delay (s)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per tool; the median counts")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--tools", type=_csv(TOOLS), default=TOOLS, help="shardsync,hf,aria2")
    parser.add_argument(
        "--scenarios", type=_csv(SCENARIOS), default=SCENARIOS, help="capped,uncapped"
    )
    parser.add_argument("--data-dir", type=Path, help="checkpoint cache and scratch space")
    parser.add_argument("--shardsync-config", type=Path, help="TOML passed as shardsync --config")
    args = parser.parse_args(argv)
    size = _size(args.size)
    if args.shards < 1 or args.repeat < 1 or size <= 0:
        parser.error("--size, --shards and --repeat must be positive")
    if args.shardsync_config is not None and not args.shardsync_config.is_file():
        parser.error(f"--shardsync-config {args.shardsync_config} is not a file")
    label = f"{args.size.strip().replace(' ', '')}-{args.shards}"
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
        data_dir=args.data_dir or Path(tempfile.gettempdir()) / "shardsync-bench-data" / label,
        shardsync_config=args.shardsync_config,
    )


def scenarios(settings: Settings) -> list[Scenario]:
    table = {
        "capped": Scenario("capped", settings.bandwidth, settings.latency),
        "uncapped": Scenario("uncapped", None, None),
    }
    return [table[name] for name in settings.scenarios]


# ---------------------------------------------------------------------------------------------
# The origin checkpoint


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def ensure_origin(settings: Settings) -> Origin:
    """Build the checkpoint once per (size, shards) and reuse it: building 2 GB takes a while.

    The digest file is written last, so a half-built directory is never mistaken for a
    finished one. It lives beside the checkpoint, not in it: the hub serves every file there.
    """
    directory = settings.data_dir / "origin"
    digests = settings.data_dir / _DIGESTS_NAME
    if digests.is_file() and directory.is_dir():
        raw = json.loads(digests.read_text())
        return Origin(directory, {path: (int(s), str(h)) for path, (s, h) in raw.items()})
    remove_tree(directory)
    log(f"building a {settings.size_label} checkpoint in {settings.shards} shards: {directory}")
    command = [sys.executable, "-m", "shardsync.testing", "build", "--out", str(directory)]
    command += ["--total-bytes", str(settings.size), "--shards", str(settings.shards)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    files = {
        path.relative_to(directory).as_posix(): (path.stat().st_size, sha256_file(path))
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    digests.write_text(json.dumps(files, indent=1) + "\n")
    return Origin(directory, files)


# ---------------------------------------------------------------------------------------------
# The fake hub process


@contextmanager
def serve_hub(origin: Origin, scenario: Scenario, scratch: Path) -> Iterator[str]:
    """Run the fake hub in its own process for one scenario; yield its endpoint.

    It is terminated (then killed) on the way out whatever happens, so a failed or
    interrupted benchmark never leaves a server behind.
    """
    ready = scratch / f"hub-{scenario.name}.ready"
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-m", "shardsync.testing", "serve"]
    command += ["--checkpoint", str(origin.directory), "--repo", REPO_ID]
    command += ["--ready-file", str(ready)]
    if scenario.bandwidth is not None:
        command += ["--bandwidth", str(scenario.bandwidth)]
    if scenario.latency is not None:
        command += ["--latency", str(scenario.latency)]
    stderr_path = scratch / f"hub-{scenario.name}.log"
    with stderr_path.open("wb") as stderr:
        hub = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            yield _wait_ready(hub, ready, stderr_path)
        finally:
            _stop(hub)


def _wait_ready(hub: subprocess.Popen[bytes], ready: Path, stderr_path: Path) -> str:
    deadline = time.monotonic() + HUB_READY_TIMEOUT_S
    while not ready.is_file():
        if hub.poll() is not None:
            raise RuntimeError(f"fake hub exited with {hub.returncode}: {tail(stderr_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"fake hub not ready after {HUB_READY_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    endpoint = json.loads(ready.read_text())["endpoint"]
    if not isinstance(endpoint, str):
        raise RuntimeError(f"fake hub ready line has no endpoint: {ready.read_text()!r}")
    return endpoint


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ---------------------------------------------------------------------------------------------
# The tools


def clean_env(home: Path, endpoint: str) -> dict[str, str]:
    """An environment that keeps every tool on loopback and away from the user's settings.

    Proxies are dropped (they would be asked for 127.0.0.x), HF_HOME points at the run's own
    directory (no token file, no shared xet cache), and shardsync's env overrides are removed
    so only ``--shardsync-config`` tunes it.
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _PROXY_VARS and not key.startswith(("HF_", "SHARDSYNC_", "HUGGING"))
    }
    env.update(
        HF_HOME=str(home / "hf-home"),
        HF_ENDPOINT=endpoint,
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_UPDATE_CHECK="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
        NO_PROXY="127.0.0.1,127.0.0.2,localhost",
        no_proxy="127.0.0.1,127.0.0.2,localhost",
    )
    return env


def _last_line(stdout: str) -> Path:
    lines = stdout.strip().splitlines()
    if not lines:
        raise RuntimeError("the tool printed no output path")
    return Path(lines[-1])


def shardsync_invocation(
    endpoint: str, work: Path, origin: Origin, config: Path | None
) -> Invocation:
    """``shardsync prefetch``: it verifies sha256 and publishes into its cache, all timed."""
    executable = Path(sys.executable).with_name("shardsync")
    argv = [str(executable)] if executable.exists() else [sys.executable, "-m", "shardsync.cli"]
    if config is not None:
        argv += ["--config", str(config)]
    argv += ["prefetch", REPO_ID, "--endpoint", endpoint, "--cache-dir", str(work / "cache")]
    argv.append("--quiet")
    return Invocation(argv, clean_env(work, endpoint), _last_line)


def hf_invocation(endpoint: str, work: Path, origin: Origin, config: Path | None) -> Invocation:
    """huggingface_hub's ``snapshot_download`` with its defaults (8 workers, one stream each).

    The fake hub sends no ``X-Xet-Hash``, so the plain HTTP path is taken; HF_HUB_DISABLE_XET
    makes sure of it even if that changed.
    """
    env = clean_env(work, endpoint)
    env["HF_HUB_DISABLE_XET"] = "1"
    argv = [sys.executable, "-c", _HF_SCRIPT, REPO_ID, endpoint, str(work / "hf-cache")]
    return Invocation(argv, env, _last_line)


def aria2_invocation(endpoint: str, work: Path, origin: Origin, config: Path | None) -> Invocation:
    """aria2c with 16 connections per file, 4 files at once, sha256 checked by aria2 itself.

    Each file is asked for at its Hub resolve URL, so aria2 pays for the 302 to the CDN like
    the other tools do.
    """
    out = work / "aria2"
    urls = work / "urls.txt"
    entries = [
        f"{endpoint}/{REPO_ID}/resolve/main/{path}\n  out={path}\n  checksum=sha-256={digest}\n"
        for path, (_, digest) in sorted(origin.files.items())
    ]
    urls.write_text("".join(entries))
    argv = ["aria2c", "--no-conf", "-x16", "-s16", "-j4", "--file-allocation=none"]
    argv += ["--console-log-level=warn", "--summary-interval=0", "-d", str(out), "-i", str(urls)]
    return Invocation(argv, clean_env(work, endpoint), lambda _stdout: out)


INVOCATIONS: dict[str, Callable[[str, Path, Origin, Path | None], Invocation]] = {
    "shardsync": shardsync_invocation,
    "hf": hf_invocation,
    "aria2": aria2_invocation,
}


def available_tools(tools: Sequence[str]) -> tuple[str, ...]:
    """Drop aria2 with a note when it is not installed, rather than failing the benchmark."""
    if "aria2" in tools and shutil.which("aria2c") is None:
        log("aria2c is not on PATH: skipping it (apt-get install aria2 to include it)")
        return tuple(tool for tool in tools if tool != "aria2")
    return tuple(tools)


# ---------------------------------------------------------------------------------------------
# Running and checking


def run_once(
    tool: str, scenario: str, repeat: int, endpoint: str, origin: Origin, settings: Settings
) -> Run:
    """Time one tool in a fresh directory, check its files, delete them."""
    work = Path(tempfile.mkdtemp(prefix=f"{tool}-", dir=scratch_dir(settings)))
    try:
        invocation = INVOCATIONS[tool](endpoint, work, origin, settings.shardsync_config)
        os.sync()  # the previous run's writeback must not land on this run's clock
        started = time.perf_counter()
        try:
            result = subprocess.run(
                invocation.argv,
                env=invocation.env,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            timeout = f"killed after {RUN_TIMEOUT_S:.0f} s"
            return Run(scenario, tool, repeat, RUN_TIMEOUT_S, 0, 0, False, timeout)
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            failure = f"exit {result.returncode}: {result.stderr.strip()[-2000:]}"
            return Run(scenario, tool, repeat, seconds, 0, 0, False, failure)
        delivered, problems = verify(invocation.locate(result.stdout), origin)
        size = sum(origin.files[path][0] for path in delivered)
        error = "; ".join(problems) if problems else None
        return Run(scenario, tool, repeat, seconds, size, len(delivered), not problems, error)
    finally:
        remove_tree(work)


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
    """Every scenario, every repeat, every tool; tools interleave so drift hits all alike."""
    runs: list[Run] = []
    for scenario in scenarios(settings):
        with serve_hub(origin, scenario, scratch_dir(settings)) as endpoint:
            log(f"{scenario.name}: fake hub at {endpoint}")
            for repeat in range(settings.repeat):
                for tool in tools:
                    run = run_once(tool, scenario.name, repeat, endpoint, origin, settings)
                    status = "ok" if run.ok else f"FAILED: {run.error}"
                    log(
                        f"{scenario.name} {TOOL_LABELS[tool]} #{repeat + 1}: {run.seconds:.2f} s "
                        f"{status}"
                    )
                    runs.append(run)
    return runs


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(runs: Sequence[Run], settings: Settings, tools: Sequence[str]) -> list[Row]:
    medians: dict[tuple[str, str], tuple[float, int] | None] = {}
    for scenario in settings.scenarios:
        for tool in tools:
            mine = [r for r in runs if r.scenario == scenario and r.tool == tool]
            if mine and all(r.ok for r in mine):
                seconds = statistics.median(r.seconds for r in mine)
                medians[scenario, tool] = (seconds, max(r.bytes for r in mine))
            else:
                medians[scenario, tool] = None
    rows = []
    for (scenario, tool), median in medians.items():
        aria2 = medians.get((scenario, "aria2"))
        hf = medians.get((scenario, "hf"))
        if median is None:
            rows.append(Row(scenario, tool, None, None, None, None))
            continue
        seconds, size = median
        rows.append(
            Row(
                scenario,
                tool,
                seconds,
                size / 1e6 / seconds,
                seconds / aria2[0] if aria2 else None,
                seconds / hf[0] if hf else None,
            )
        )
    return rows


def target_checks(rows: Sequence[Row]) -> list[Check]:
    """The issue's targets: near aria2c when capped, far ahead of snapshot_download, and never
    behind it on an uncapped link."""
    seconds = {(r.scenario, r.tool): r.seconds for r in rows}
    checks = []
    scenario_names = {r.scenario for r in rows}
    if "capped" in scenario_names:
        checks.append(
            _check(
                seconds, "capped", "aria2", "shardsync <= 1.2 x aria2c", lambda s, o: s <= 1.2 * o
            )
        )
        checks.append(
            _check(
                seconds,
                "capped",
                "hf",
                "shardsync >= 4x faster than snapshot_download",
                lambda s, o: o >= 4 * s,
            )
        )
    if "uncapped" in scenario_names:
        checks.append(
            _check(seconds, "uncapped", "hf", "shardsync <= snapshot_download", lambda s, o: s <= o)
        )
    return checks


def _check(
    seconds: Mapping[tuple[str, str], float | None],
    scenario: str,
    other: str,
    target: str,
    passes: Callable[[float, float], bool],
) -> Check:
    mine, theirs = seconds.get((scenario, "shardsync")), seconds.get((scenario, other))
    if (scenario, "shardsync") not in seconds or (scenario, other) not in seconds:
        return Check(scenario, target, "SKIP", "tool not run")
    if mine is None or theirs is None:
        return Check(scenario, target, "FAIL", "a run failed")
    detail = f"{mine:.2f} s vs {theirs:.2f} s ({theirs / mine:.2f}x)"
    return Check(scenario, target, "PASS" if passes(mine, theirs) else "FAIL", detail)


def _cell(value: float | None, spec: str, width: int, suffix: str = "") -> str:
    text = "-" if value is None else format(value, spec) + suffix
    return text.rjust(width)


def print_report(rows: Sequence[Row], checks: Sequence[Check], runs: Sequence[Run]) -> None:
    header = (
        f"{'scenario':<9} {'tool':<18} {'seconds':>8} {'MB/s':>8} {'vs aria2c':>10} {'vs hf':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.scenario:<9} {TOOL_LABELS[row.tool]:<18} {_cell(row.seconds, '.2f', 8)} "
            f"{_cell(row.mb_per_s, '.1f', 8)} {_cell(row.vs_aria2, '.2f', 10, 'x')} "
            f"{_cell(row.vs_hf, '.2f', 7, 'x')}"
        )
    print("(vs: this tool's time divided by the other's; below 1 is faster)")
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


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _aria2_version() -> str | None:
    if shutil.which("aria2c") is None:
        return None
    out = subprocess.run(["aria2c", "--version"], capture_output=True, text=True, check=False)
    first = out.stdout.splitlines()[:1]
    return first[0].removeprefix("aria2 version ").strip() if first else None


def _git_revision() -> str | None:
    """The commit measured, with "+dirty" when shardsync/ has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False
    )
    if head.returncode != 0:
        return None
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", "shardsync"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def machine_info() -> dict[str, object]:
    return {
        "git": _git_revision(),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "shardsync": _version("shardsync"),
            "huggingface_hub": _version("huggingface_hub"),
            "aiohttp": _version("aiohttp"),
            "aria2c": _aria2_version(),
        },
    }


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
) -> None:
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": {
            "size": settings.size,
            "shards": settings.shards,
            "bandwidth_per_connection": settings.bandwidth,
            "latency_s": settings.latency,
            "repeat": settings.repeat,
            "tools": list(settings.tools),
            "scenarios": list(settings.scenarios),
            "shardsync": shardsync_settings(settings.shardsync_config),
            "hf": {"max_workers": 8, "xet": "disabled"},
            "aria2c": "-x16 -s16 -j4 --file-allocation=none, sha-256 checksum per file",
        },
        "checkpoint": {"files": len(origin.files), "bytes": origin.total_size},
        "runs": [dataclasses.asdict(run) for run in runs],
        "summary": [dataclasses.asdict(row) for row in rows],
        "checks": [dataclasses.asdict(check) for check in checks],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_png(path: Path, rows: Sequence[Row], settings: Settings) -> None:
    """A grouped bar chart of throughput; skipped with a note when matplotlib is missing."""
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
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, tool in enumerate(tools):
        mine = {row.scenario: row for row in rows if row.tool == tool}
        xs = [n + (i - (len(tools) - 1) / 2) * width for n in range(len(names))]
        rates = [_bar_height(mine.get(name)) for name in names]
        bars = ax.bar(xs, rates, width, label=TOOL_LABELS[tool])
        labels = [_bar_label(mine.get(name)) for name in names]
        ax.bar_label(bars, labels=labels, fontsize=8, padding=2)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("MB/s (higher is better)")
    cap = f"{settings.bandwidth / 1e6:g} MB/s per connection, {settings.latency * 1000:g} ms"
    ax.set_title(
        f"{settings.size_label} in {settings.shards} shards, {os.cpu_count()} CPUs (capped: {cap})",
        fontsize=10,
    )
    ax.margins(y=0.12)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=len(tools), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bar_height(row: Row | None) -> float:
    return 0.0 if row is None or row.mb_per_s is None else row.mb_per_s


def _bar_label(row: Row | None) -> str:
    if row is None:
        return ""
    return "failed" if row.seconds is None else f"{row.seconds:.1f}s"


# ---------------------------------------------------------------------------------------------
# Plumbing


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def tail(path: Path, limit: int = 2000) -> str:
    return path.read_text(errors="replace")[-limit:] if path.is_file() else ""


def scratch_dir(settings: Settings) -> Path:
    """Runs happen beside the checkpoint: same file system, deleted after each check."""
    path = settings.data_dir / "work"
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_tree(path: Path) -> None:
    """Delete a tree even where the tool made files or directories read-only."""

    def make_writable(func: Callable[[str], object], name: str, _exc: object) -> None:
        parent = os.path.dirname(name)
        os.chmod(parent, 0o700)
        if os.path.isdir(name) and not os.path.islink(name):
            os.chmod(name, 0o700)
        func(name)

    if path.exists():
        shutil.rmtree(path, onerror=make_writable)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    tools = available_tools(settings.tools)
    origin = ensure_origin(settings)
    log(f"checkpoint: {len(origin.files)} files, {origin.total_size / 1e6:.0f} MB")
    try:
        runs = run_all(origin, settings, tools)
    finally:
        remove_tree(settings.data_dir / "work")
    rows = summarize(runs, settings, tools)
    checks = target_checks(rows)
    print_report(rows, checks, runs)
    settings.out.mkdir(parents=True, exist_ok=True)
    write_json(settings.out / "download.json", settings, origin, runs, rows, checks)
    write_png(settings.out / "download.png", rows, settings)
    log(f"results in {settings.out}/download.json and download.png")
    return 0 if all(run.ok for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
