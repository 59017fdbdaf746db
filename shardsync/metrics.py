"""What the daemon reports: its statistics (``GET /v1/status``, ``shardsync status``) and
the same in the Prometheus text format (``GET /metrics``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardsync.records import TierStatistics

if TYPE_CHECKING:
    from shardsync.scheduler import Scheduler

__all__ = ["DaemonStatistics", "render_metrics"]


@dataclass(frozen=True, slots=True)
class DaemonStatistics:
    """What ``GET /v1/status`` and ``shardsync status`` report."""

    version: str
    api: int
    pid: int
    uptime_s: float
    socket: str
    tcp: str | None
    cache_dir: str
    endpoint: str | None
    stopping: bool
    jobs: Mapping[str, int]
    jobs_submitted: int
    jobs_deduplicated: int
    files_waiting: int
    api_requests: int
    bytes_downloaded: int
    files_fetched: int
    active_connections: int
    retries: Mapping[str, int]
    verify_failures: int
    max_bandwidth: int
    tier: TierStatistics | None = None  # the shared tier's counters, when one is configured


def render_metrics(stats: DaemonStatistics, scheduler: Scheduler, cache: Mapping[str, Any]) -> str:
    """The Prometheus text exposition format (0.0.4), written by hand: a few counters do not
    justify a dependency."""
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP shardsync_{name} {help_text}")
        out.append(f"# TYPE shardsync_{name} {kind}")
        for labels, value in samples:
            out.append(f"shardsync_{name}{labels} {_number(value)}")

    metric("uptime_seconds", "gauge", "Seconds since the daemon started.", [("", stats.uptime_s)])
    metric(
        "bytes_downloaded_total",
        "counter",
        "Bytes received from origins.",
        [("", stats.bytes_downloaded)],
    )
    metric("files_fetched_total", "counter", "Files downloaded.", [("", stats.files_fetched)])
    metric(
        "active_connections",
        "gauge",
        "HTTP requests to origins in flight.",
        [("", stats.active_connections)],
    )
    metric(
        "api_requests",
        "gauge",
        "API requests in flight (event streams too).",
        [("", stats.api_requests)],
    )
    metric(
        "retries_total",
        "counter",
        "Transfer retries by cause.",
        [(_labels(cause=c), n) for c, n in sorted(stats.retries.items())],
    )
    metric(
        "verify_failures_total",
        "counter",
        "Downloads whose hash did not match.",
        [("", stats.verify_failures)],
    )
    metric("cache_size_bytes", "gauge", "Bytes of verified blobs.", [("", cache["bytes"])])
    metric("cache_blobs", "gauge", "Verified blobs in the cache.", [("", cache["blobs"])])
    metric(
        "partial_bytes", "gauge", "Disk used by partial downloads.", [("", cache["partial_bytes"])]
    )
    metric(
        "jobs",
        "gauge",
        "Jobs the daemon knows, by state.",
        [(_labels(state=s), n) for s, n in sorted(stats.jobs.items())],
    )
    metric(
        "jobs_submitted_total", "counter", "Job requests received.", [("", stats.jobs_submitted)]
    )
    metric(
        "jobs_deduplicated_total",
        "counter",
        "Job requests answered by a job already running.",
        [("", stats.jobs_deduplicated)],
    )
    metric(
        "bandwidth_limit_bytes_per_second",
        "gauge",
        "Global download cap (0: none).",
        [("", stats.max_bandwidth)],
    )
    if stats.tier is not None:
        t = stats.tier
        for name, kind, help_text, value in (
            ("tier_hits_total", "counter", "Blobs read from the shared tier.", t.hits),
            (
                "tier_misses_total",
                "counter",
                "Blobs fetched from the origin for the fleet.",
                t.misses,
            ),
            ("tier_bytes_total", "counter", "Bytes read from the shared tier.", t.bytes_from_tier),
            ("tier_uploads_total", "counter", "Blobs uploaded to the shared tier.", t.uploads),
            (
                "tier_uploaded_bytes_total",
                "counter",
                "Bytes uploaded to the shared tier.",
                t.bytes_uploaded,
            ),
            ("tier_claims_won_total", "counter", "Single-flight claims won.", t.claims_won),
            (
                "tier_claims_waited_total",
                "counter",
                "Blobs waited for while another host fetched them.",
                t.claims_waited,
            ),
            (
                "tier_claims_taken_over_total",
                "counter",
                "Claims of dead holders taken over.",
                t.claims_taken_over,
            ),
            (
                "tier_stalled_fallbacks_total",
                "counter",
                "Waits given up on a stalled claim.",
                t.stalled_fallbacks,
            ),
            (
                "tier_corrupt_objects_total",
                "counter",
                "Tier objects that failed verification.",
                t.corrupt_objects,
            ),
            ("tier_errors_total", "counter", "Tier requests that failed.", t.errors),
            (
                "tier_bytes_from_parts_total",
                "counter",
                "Bytes taken-over downloads resumed from a dead holder's parts.",
                t.bytes_from_parts,
            ),
        ):
            metric(name, kind, help_text, [("", value)])
    hist = scheduler.latency
    out.append("# HELP shardsync_job_duration_seconds Seconds from submission to a complete job.")
    out.append("# TYPE shardsync_job_duration_seconds histogram")
    for bound, count in hist.cumulative():
        out.append(f'shardsync_job_duration_seconds_bucket{{le="{_number(bound)}"}} {count}')
    out.append(f'shardsync_job_duration_seconds_bucket{{le="+Inf"}} {hist.count}')
    out.append(f"shardsync_job_duration_seconds_sum {_number(hist.sum)}")
    out.append(f"shardsync_job_duration_seconds_count {hist.count}")
    return "\n".join(out) + "\n"


def _labels(**labels: str) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
