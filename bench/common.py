"""What the benchmarks share: the checkpoint, the servers in front of it, the machine's record.

Every script of ``bench/`` imports this module as a sibling (``import common``: Python looks
for modules in a script's own folder first); no script imports another. The real servers the
tests use too come from the package: ``shardsync.testing.seaweedfs`` (SeaweedFS) and
``shardsync.testing.daemons`` (a daemon process).

- the origin checkpoint: ``ensure_origin`` builds one per (size, shards) with ``python -m
  shardsync.testing build`` and keeps it (``data_dir_for``), with the sha256 of every file;
- the origin's servers, as the real Hub is built: ``serve_hub_cdn`` runs the fake Hub in its
  own process, redirecting every LFS file to a real nginx (``serve_nginx``, ``sendfile on``,
  an optional ``limit_rate`` per connection) that serves the blobs by their sha256
  (``cdn_directory``); ``read_cdn`` reads what nginx's access log says it sent;
  ``serve_scenario`` starts both for a ``Scenario``; ``serve_hub`` is the fake Hub serving
  every byte itself;
- the clients' environment: ``clean_env`` (loopback only, none of the user's ``HF_`` or
  ``SHARDSYNC_`` settings), ``host_env`` (plus a SeaweedFS tier's credentials),
  ``shardsync_invocation``, ``compile_shardsync``;
- CPU and the machine: ``process_cpu_s``, ``server_cpu_seconds``, ``children_cpu_s``,
  ``run_timed``, ``hash_costs``, ``mean_costs``, ``beyond_hashes``, ``machine_info``,
  ``git_revision``, ``cpu_model``, ``fs_type``, ``nginx_version``, ``weed_version``;
- ``RESULTS`` (``bench/results/``), where every script writes by default.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from shardsync.config import parse_size
from shardsync.testing.nginx import run_nginx
from shardsync.testing.seaweedfs import S3Server, find_weed

REPO_ID = "bench/model"
RESULTS = Path(__file__).resolve().parent / "results"
"""``bench/results/``: every script's default output folder, and the committed results."""
HUB_READY_TIMEOUT_S = 600.0
"""The hub hashes every file before it listens: a few seconds per GB."""
HASH_BUFFER = 256 << 20
"""``hash_costs`` times one pass of each hash over this many random bytes."""
_DIGESTS_NAME = "sha256.json"
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
NGINX_FORMAT = '$msec $request_time $status $body_bytes_sent "$request_method $uri"'
LOG_LINE = re.compile(r'^(\S+) (\S+) (\d+) (\d+) "(\S+) (\S+)"$')


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Scenario:
    """How the origin shapes every response, and where the tools write."""

    name: str
    bandwidth: float | None
    """Bytes/s per connection (nginx ``limit_rate``), None for no cap."""
    latency: float | None
    """Seconds before each fake-Hub answer (API, resolve), None for none."""
    disk: bool = False
    """Destination on the real disk (``--disk-dir``) rather than the tmpfs."""


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

    @property
    def lfs(self) -> dict[str, tuple[int, str]]:
        """The files the Hub redirects to its CDN: the shards."""
        return {p: v for p, v in self.files.items() if p.endswith(".safetensors")}


@dataclass(frozen=True, slots=True)
class Invocation:
    """One tool run: the command, its environment, and where its files end up."""

    argv: list[str]
    env: dict[str, str]
    locate: Callable[[str], Path]
    """Maps the run's stdout to the directory holding the downloaded files."""


@dataclass(frozen=True, slots=True)
class Nginx:
    """A running ``serve_nginx``: its base URL, its access log (``NGINX_FORMAT``), its pid."""

    url: str
    access_log: Path
    pid: int


# ---------------------------------------------------------------------------------------------
# Command line


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def data_dir_for(size_label: str, shards: int) -> Path:
    """Where a checkpoint of ``size_label`` in ``shards`` shards is built and kept between
    runs (``--data-dir`` overrides it): one per (size, shards), shared by the scripts."""
    label = f"{size_label.strip().replace(' ', '')}-{shards}"
    return Path(tempfile.gettempdir()) / "shardsync-bench-data" / label


# ---------------------------------------------------------------------------------------------
# The origin checkpoint


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def ensure_origin(data_dir: Path, size: int, shards: int, size_label: str) -> Origin:
    """Build the checkpoint of ``size`` bytes in ``shards`` shards under ``data_dir`` once and
    reuse it: building 2 GB takes a while.

    The digest file is written last, so a half-built directory is never mistaken for a
    finished one. It lives beside the checkpoint, not in it: the hub serves every file there.
    """
    directory = data_dir / "origin"
    digests = data_dir / _DIGESTS_NAME
    if digests.is_file() and directory.is_dir():
        raw = json.loads(digests.read_text())
        return Origin(directory, {path: (int(s), str(h)) for path, (s, h) in raw.items()})
    remove_tree(directory)
    log(f"building a {size_label} checkpoint in {shards} shards: {directory}")
    command = [sys.executable, "-m", "shardsync.testing", "build", "--out", str(directory)]
    command += ["--total-bytes", str(size), "--shards", str(shards)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    files = {
        path.relative_to(directory).as_posix(): (path.stat().st_size, sha256_file(path))
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    digests.write_text(json.dumps(files, indent=1) + "\n")
    return Origin(directory, files)


def cdn_directory(origin: Origin, root: Path) -> Path:
    """A directory of the LFS files named by their sha256 (hard links, else copies)."""
    remove_tree(root)
    root.mkdir(parents=True)
    for rel, (_, digest) in origin.lfs.items():
        source = origin.directory / rel
        try:
            os.link(source, root / digest)
        except OSError:
            shutil.copyfile(source, root / digest)
    return root


# ---------------------------------------------------------------------------------------------
# The servers: nginx for the bytes, the fake Hub for the API and the resolves, SeaweedFS


@contextmanager
def serve_nginx(root: Path, work: Path, bandwidth: float | None) -> Iterator[Nginx]:
    """nginx (``shardsync.testing.nginx``) on a free loopback port serving ``root``: sendfile,
    a rate cap per connection when ``bandwidth`` is set, an access log of the bytes each
    request sent (``NGINX_FORMAT``). Stopped on the way out whatever happens."""
    remove_tree(work)
    cap = f"limit_rate {int(bandwidth)};" if bandwidth else ""
    fast = "sendfile on;\n    tcp_nopush on;\n    keepalive_requests 100000;"
    with run_nginx(
        work, f"root {root};\n        {cap}", http=fast, log_format=NGINX_FORMAT, workers=2
    ) as url:
        pidfile, deadline = work / "nginx.pid", time.monotonic() + 5
        while not pidfile.exists() and time.monotonic() < deadline:  # written as it starts
            time.sleep(0.01)
        yield Nginx(url, work / "access.log", int(pidfile.read_text().split()[0]))


def read_cdn(access_log: Path, offset: int, digests: set[str]) -> tuple[int, int, int]:
    """(requests, bytes sent) for LFS files that nginx logged after byte ``offset`` of its log,
    and the new offset. nginx writes a line when a request ends, with what it really sent."""
    try:
        with access_log.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return 0, 0, offset
    complete = data[: data.rfind(b"\n") + 1]
    requests = sent = 0
    for line in complete.decode(errors="replace").splitlines():
        match = LOG_LINE.match(line)
        if match is not None and match.group(6).strip("/") in digests:
            requests += 1
            sent += int(match.group(4))
    return requests, sent, offset + len(complete)


@contextmanager
def serve_hub_cdn(
    origin: Origin, cdn_url: str, latency: float | None, work: Path
) -> Iterator[tuple[str, int]]:
    """The fake Hub in its own process, redirecting LFS files to ``cdn_url``; yields
    (endpoint, pid)."""
    ready = work / "hub.ready"
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-m", "shardsync.testing", "serve"]
    command += ["--checkpoint", str(origin.directory), "--repo", REPO_ID]
    command += ["--ready-file", str(ready), "--cdn-base", cdn_url]
    if latency:
        command += ["--latency", str(latency)]
    stderr_path = work / "hub.log"
    with stderr_path.open("wb") as stderr:
        hub = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        yield _wait_ready(hub, ready, stderr_path), hub.pid
    finally:
        _stop(hub)


@contextmanager
def serve_hub(origin: Origin, scenario: Scenario, scratch: Path) -> Iterator[str]:
    """The fake Hub serving every byte itself, shaped by ``scenario`` (its own bandwidth cap
    and first-byte latency); yields its endpoint. ``bench/load.py`` uses it; the others
    serve the LFS bytes from nginx instead (``serve_hub_cdn``)."""
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


@dataclass
class Servers:
    """One scenario's nginx and fake hub, and where the last run's log reading stopped."""

    endpoint: str
    hub_pid: int
    nginx: Nginx
    digests: set[str]
    log_offset: int = 0

    def cdn_since_last(self) -> tuple[int, int]:
        requests, sent, self.log_offset = read_cdn(
            self.nginx.access_log, self.log_offset, self.digests
        )
        return requests, sent


@contextmanager
def serve_scenario(origin: Origin, scenario: Scenario, data_dir: Path) -> Iterator[Servers]:
    """nginx (the CDN, capped at the scenario's bandwidth) and the fake Hub in front of it
    (its latency), their files under ``data_dir``."""
    cdn = cdn_directory(origin, data_dir / "cdn")
    work = data_dir / "servers" / scenario.name
    with contextlib.ExitStack() as stack:
        nginx = stack.enter_context(serve_nginx(cdn, work / "nginx", scenario.bandwidth))
        endpoint, hub_pid = stack.enter_context(
            serve_hub_cdn(origin, nginx.url, scenario.latency, work)
        )
        digests = {digest for _, digest in origin.lfs.values()}
        yield Servers(endpoint, hub_pid, nginx, digests)


def warm_bucket(s3: S3Server, bucket: str) -> None:
    """Write and delete one small object outside the tier's prefix: SeaweedFS grows the new
    bucket's first volume on its first write (a second or so), which a fleet's long-lived
    tier bucket has long done; the round should not time it."""
    status, body = s3.signed_request("PUT", f"/{bucket}/warm-up", body=b"x")
    if status != 200:
        raise RuntimeError(f"warming bucket {bucket} answered {status}: {body[:200]!r}")
    s3.signed_request("DELETE", f"/{bucket}/warm-up")


# ---------------------------------------------------------------------------------------------
# CPU


def _own_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of one process, every thread, from /proc (OSError if
    gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process, every thread, from /proc (OSError if gone)."""
    return sum(_own_times(pid))


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process and its live children (nginx's workers)."""
    try:
        total = _own_cpu_s(pid)
        children = Path(f"/proc/{pid}/task/{pid}/children")
        for child in children.read_text().split() if children.exists() else ():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += _own_cpu_s(int(child))
        return total
    except (OSError, ValueError, IndexError):
        return None


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (every thread) so far: SeaweedFS, a daemon; NaN once
    it is gone."""
    try:
        return _own_cpu_s(pid)
    except OSError:
        return float("nan")


def server_system_seconds(pid: int) -> float:
    """The system (kernel) part of ``server_cpu_seconds``."""
    try:
        return _own_times(pid)[1]
    except OSError:
        return float("nan")


def children_cpu_s() -> float:
    """User + system CPU of this process's reaped children (a timed tool, its own included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _children_system_s() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime


@dataclass(frozen=True, slots=True)
class Timed:
    """One tool run by the wall clock a user sees."""

    result: subprocess.CompletedProcess[str] | None
    """None: killed at the timeout."""
    seconds: float
    cpu_s: float
    """The child's user + system CPU, its own children included."""
    system_s: float = 0.0
    """The system (kernel) part of ``cpu_s``."""


def run_timed(argv: list[str], env: Mapping[str, str], timeout: float) -> Timed:
    """``argv`` as a child process, its output captured, timed and its CPU counted."""
    cpu_before, system_before = children_cpu_s(), _children_system_s()
    started = time.perf_counter()
    try:
        result: subprocess.CompletedProcess[str] | None = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        result = None
    seconds = time.perf_counter() - started
    return Timed(
        result, seconds, children_cpu_s() - cpu_before, _children_system_s() - system_before
    )


def hash_costs(
    functions: Mapping[str, Callable[[bytes], object]] | None = None,
) -> dict[str, float]:
    """CPU-s per GB of each hash on this machine (sha256 and xxh3-128 unless told), one pass
    over a 256 MiB buffer each: what a verified download cannot skip, measured in the same run."""
    import xxhash

    if functions is None:
        functions = {
            "sha256": lambda data: hashlib.sha256(data).digest(),
            "xxh3_128": lambda data: xxhash.xxh3_128(data).digest(),
        }
    buffer = os.urandom(HASH_BUFFER)
    costs = {}
    for name, function in functions.items():
        started = time.process_time()
        function(buffer)
        costs[name] = (time.process_time() - started) / (HASH_BUFFER / 1e9)
    return costs


def mean_costs(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Each hash's cost as the mean of two ``hash_costs`` (a run's start and its end: this
    VM's costs move within minutes)."""
    return {name: (cost + after[name]) / 2 for name, cost in before.items()}


def beyond_hashes(cpu_s_per_gb: float, costs: Mapping[str, float], hashes: Iterable[str]) -> float:
    """CPU-s/GB less this machine's cost of the hashes a tool computes over every byte: what a
    verified download costs beyond what it cannot skip."""
    return cpu_s_per_gb - sum(costs[name] for name in hashes)


# ---------------------------------------------------------------------------------------------
# The clients' environment


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


def host_env(work: Path, hub: str, s3: S3Server | None) -> dict[str, str]:
    """clean_env (loopback only, no HF_/SHARDSYNC_ settings) plus the tier's credentials."""
    env = {k: v for k, v in clean_env(work, hub).items() if not k.startswith("AWS_")}
    if s3 is not None:
        env.update(
            AWS_ACCESS_KEY_ID=s3.access_key,
            AWS_SECRET_ACCESS_KEY=s3.secret_key,
            AWS_EC2_METADATA_DISABLED="true",
            AWS_CONFIG_FILE=str(work / "no-aws-config"),
            AWS_SHARED_CREDENTIALS_FILE=str(work / "no-aws-credentials"),
        )
    return env


def last_line(stdout: str) -> Path:
    lines = stdout.strip().splitlines()
    if not lines:
        raise RuntimeError("the tool printed no output path")
    return Path(lines[-1])


def shardsync_invocation(
    endpoint: str, work: Path, origin: Origin, config: Path | None
) -> Invocation:
    """``shardsync prefetch``: it verifies sha256 and publishes (fsync) into its cache, all
    timed; ``--no-daemon`` so a daemon someone runs on the box cannot take the job."""
    executable = Path(sys.executable).with_name("shardsync")
    argv = [str(executable)] if executable.exists() else [sys.executable, "-m", "shardsync.cli"]
    if config is not None:
        argv += ["--config", str(config)]
    argv += ["prefetch", REPO_ID, "--endpoint", endpoint, "--cache-dir", str(work / "cache")]
    argv += ["--quiet", "--no-daemon"]
    return Invocation(argv, clean_env(work, endpoint), last_line)


def compile_shardsync() -> None:
    """Byte-compile shardsync's modules before any clock starts, as ``pip install`` does. An
    editable checkout has no current bytecode for a module until a run writes it, and with
    ``PYTHONDONTWRITEBYTECODE`` set (as on this VM) no run ever does: every timed ``shardsync``
    compiled each such module again; all of them from a fresh clone, 0.35-0.38 s to import
    against 0.25 s."""
    spec = importlib.util.find_spec("shardsync")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        compileall.compile_dir(folder, quiet=1)


# ---------------------------------------------------------------------------------------------
# The machine, for the results files


def cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return None


def package_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _first_line(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return lines[0].strip() if lines else None


def _aria2_version() -> str | None:
    first = _first_line(["aria2c", "--version"])
    return first.removeprefix("aria2 version ").strip() if first else None


def nginx_version() -> str | None:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    try:
        out = subprocess.run([nginx, "-v"], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return out.stderr.strip().removeprefix("nginx version: ") or None


def weed_version() -> str | None:
    weed = find_weed()
    if weed is None:
        return None
    out = subprocess.run([weed, "version"], capture_output=True, text=True, check=False)
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def git_revision() -> str | None:
    """The commit measured: the checkout shardsync is imported from, with "+dirty" when its
    shardsync/ has uncommitted changes; for an exported tree (``git archive``) without .git,
    the commit named in its ``COMMIT`` file."""
    import shardsync

    root = Path(shardsync.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        stamp = root / "COMMIT"
        return stamp.read_text().strip() + " (exported tree)" if stamp.is_file() else None
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
        "git": git_revision(),
        "shardsync_from": _shardsync_location(),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "shardsync": package_version("shardsync"),
            "huggingface_hub": package_version("huggingface_hub"),
            "aiohttp": package_version("aiohttp"),
            "aria2c": _aria2_version(),
            "nginx": _first_line(["nginx", "-v"]) or _first_line(["/usr/sbin/nginx", "-v"]),
            "openssl": _first_line(["openssl", "version"]),
        },
    }


def _shardsync_location() -> str:
    import shardsync

    return str(Path(shardsync.__file__).resolve().parent)


def fs_type(path: Path) -> str | None:
    """The file system type of the mount holding ``path`` (longest matching mount point)."""
    path = path.resolve()
    best, kind = "", None
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(
                mount
            ) > len(best):
                best, kind = mount, fields[2]
    return kind


# ---------------------------------------------------------------------------------------------
# Plumbing


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def tail(path: Path, limit: int = 2000) -> str:
    return path.read_text(errors="replace")[-limit:] if path.is_file() else ""


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
