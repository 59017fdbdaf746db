"""What the commands print for a person: a prefetch's result line, and the lines of
``status``, ``prune``, ``verify`` and ``ls`` (``--json`` prints the objects instead).

Each ``*_lines`` function turns one command's report into text and prints nothing;
``print_result`` prints a prefetch's summary (stderr) and snapshot path (stdout).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

from shardsync.progress import format_bytes
from shardsync.records import PrefetchResult

if TYPE_CHECKING:  # the reports' modules are imported by the commands that make them
    from shardsync.inventory import Inventory
    from shardsync.prune import PruneReport
    from shardsync.verify import VerifyReport

__all__ = ["ls_lines", "print_result", "prune_lines", "status_lines", "verify_lines"]


def status_lines(
    status: dict[str, Any], jobs: list[dict[str, Any]], cache: dict[str, Any]
) -> list[str]:
    def size(value: Any) -> str:
        return "?" if value is None else format_bytes(value)

    counts = ", ".join(f"{n} {state}" for state, n in status["jobs"].items() if n)
    retries = ", ".join(f"{cause}={n}" for cause, n in status["retries"].items())
    lines = [
        f"shardsync daemon {status['version']} (pid {status['pid']}), up "
        f"{status['uptime_s']:.0f}s, socket {status['socket']}",
        f"cache {cache['root']}: {cache['blobs']} blobs, {size(cache['bytes'])} "
        f"(+{size(cache['partial_bytes'])} partial), {size(cache['disk_free'])} free",
        f"downloaded {size(status['bytes_downloaded'])} in {status['files_fetched']} files; "
        f"{status['active_connections']} origin requests in flight; "
        f"retries: {retries or 'none'}; verify failures: {status['verify_failures']}",
        f"jobs: {counts or 'none'}",
    ]
    tier = status.get("tier")
    if tier:
        state = (
            " (off: credentials refused)"
            if tier["disabled"]
            else (" (reading only: writes refused)" if tier["read_only"] else "")
        )
        lines.insert(
            -1,
            f"tier {tier['url']}{state}: {tier['hits']} hits ({size(tier['bytes_from_tier'])}), "
            f"{tier['misses']} fetched for the fleet, {tier['uploads']} uploads "
            f"({size(tier['bytes_uploaded'])}), {tier['claims_waited']} waits, "
            f"{tier['claims_taken_over']} takeovers, {tier['stalled_fallbacks']} stalls, "
            f"{tier['corrupt_objects']} corrupt, {tier['errors']} errors",
        )
    for job in jobs:
        files, done = job["files"], job["bytes"]
        lines.append(
            f"  {job['id']}  {job['state']:<11} {job['repo']}@{job['revision']}  "
            f"{files['verified']}/{files['total'] or '?'} files  "
            f"{size(done['done'])}/{size(done['total'])}  "
            f"priority {job['priority']}, {job['clients']} client(s)"
        )
    return lines


def print_result(result: PrefetchResult, *, as_json: bool, quiet: bool, path: bool = True) -> None:
    if as_json:
        from shardsync.api import result_to_json

        print(json.dumps(result_to_json(result), indent=2))
        return
    if not quiet:
        kinds = Counter(f.verified for f in result.files)
        tofu = kinds.pop("tofu", 0)
        note = f", {tofu} trusted on first use (the origin keeps no checksum)" if tofu else ""
        by = ", ".join(f"{n} by {kind}" for kind, n in sorted(kinds.items()))
        rate = result.bytes_downloaded / max(result.elapsed, 1e-9)
        print(
            f"{len(result.files)} files, {format_bytes(result.total_size)} verified"
            f"{f' ({by})' if by else ''}; "
            f"downloaded {format_bytes(result.bytes_downloaded)} in {result.elapsed:.1f}s "
            f"({format_bytes(rate)}/s){note}",
            file=sys.stderr,
        )
    if path:
        print(result.snapshot_path)


def prune_lines(report: PruneReport) -> list[str]:
    if report.skipped:
        return ["prune: skipped: another prune is running (--no-wait)"]
    free = "" if report.free_after is None else f", {format_bytes(report.free_after)} free"
    lines = [
        f"{'dry run: would free' if report.dry_run else 'freed'} "
        f"{format_bytes(report.freed_bytes)}; cache {format_bytes(report.size_before)} -> "
        f"{format_bytes(report.size_after)}{free}"
    ]
    for repo, (count, nbytes) in report.by_repo().items():
        commits = ", ".join(
            f"{e.commit[:12]} ({e.reason})" for e in report.evicted if e.repo == repo
        )
        lines.append(f"  {repo}: {format_bytes(nbytes)} in {count} snapshot(s): {commits}")
    for label, count, nbytes in (
        ("abandoned partial downloads", report.partials, report.partial_bytes),
        ("unreferenced blobs", report.orphans, report.orphan_bytes),
        ("tmp/quarantine entries", report.junk, report.junk_bytes),
    ):
        if count:
            lines.append(f"  {label}: {count}, {format_bytes(nbytes)}")
    kept = sorted({f"{p.repo} ({p.reason})" for p in report.protected})
    if kept:
        lines.append("untouched: " + ", ".join(kept))
    if report.unmet:
        lines.append(
            "limits not met: " + ", ".join(report.unmet) + " (what is left is pinned, kept, "
            "leased or recently used partials)"
        )
    return lines


def verify_lines(report: VerifyReport) -> list[str]:
    what = "sha256 + xxh3-128" if report.full else "xxh3-128"
    count = len(report.problems)
    lines = [
        f"verified {report.blobs} blobs ({format_bytes(report.bytes_hashed)}, {what}) of "
        f"{report.snapshots} snapshots: "
        + ("all intact" if report.ok else f"{count} problem{'s' if count != 1 else ''}")
    ]
    for p in report.problems:
        where = f" -> quarantined to {p.quarantined}" if p.quarantined else ""
        lines.append(f"  {p.kind:<8} {p.repo}@{p.commit[:12]} {p.path}: {p.detail}{where}")
    if report.incomplete:
        lines.append("incomplete now; `shardsync prefetch` downloads just what is missing:")
        lines.extend(f"  {repo}@{commit}" for repo, commit in report.incomplete)
    return lines


def ls_lines(inv: Inventory) -> list[str]:
    rows = [("REPO", "REFS", "COMMIT", "SIZE", "COMPLETE", "LAST USED", "FLAGS")]
    for repo in inv.repos:
        for s in repo.snapshots:
            flags = [
                f
                for f, on in (("pinned", s.pinned), ("leased", s.leased), ("foreign", s.foreign))
                if on
            ]
            rows.append(
                (
                    repo.repo,
                    ",".join(s.refs) or "-",
                    s.commit[:12],
                    format_bytes(s.nbytes),
                    "yes" if s.complete else "no",
                    _ago(s.last_used, inv.scanned_at),
                    ",".join(flags) or "-",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    free = "?" if inv.disk_free is None else format_bytes(inv.disk_free)
    lines.append(
        f"{len(inv.repos)} repos, {format_bytes(inv.total_bytes)} on disk (shared blobs counted "
        f"once; {format_bytes(inv.partial_bytes)} in partial downloads); {free} free"
    )
    return lines


def _ago(when: float | None, now: float) -> str:
    if when is None:
        return "never"
    seconds = max(now - when, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return "just now"
