"""Plant known bugs in the transfer code, one at a time, and check that the tests catch each.

Each mutant is a small text patch (exact ``old`` -> ``new`` replacements) to one module of
``shardsync``. The script copies ``shardsync/``, ``tests/`` and ``pyproject.toml`` into a
temporary directory, applies the patch there (the working tree is never touched), runs the
mutant's test files against the copy, and reports CAUGHT (some test failed) or MISSED::

    python tools/mutants.py                 # every mutant
    python tools/mutants.py git-blob-id     # some, by name
    python tools/mutants.py --list          # names, files and what each plants

A mutant that no longer applies (the code moved) is reported STALE: update its ``old`` text.
``tests/test_mutants.py`` checks in the normal suite that the list is well formed and that a
patch that applies still parses (one whose text is gone is skipped there, with its name: an
edit of the code must not fail the suite when the behavioural tests pass). Running the
mutants takes a few minutes. Exit status: 0 when every mutant is caught.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INTEGRITY = "tests/adversarial/test_transfer_integrity.py"
FRAMING = "tests/adversarial/test_framing.py"
MID_LOAD = "tests/adversarial/test_mid_load_change.py"
SWEEP = "tests/adversarial/test_secrets_sweep.py"
KILL = "tests/adversarial/test_kill_cost.py"
LOADER_INPUTS = "tests/test_loader_inputs.py"
S3_INTEGRITY = "tests/adversarial/test_s3_integrity.py"
TRAINING = "tests/test_training.py"
DAEMON_S3_KILL = (
    "tests/test_s3_origin.py::test_a_daemon_killed_mid_s3_job_resumes_it_after_a_restart"
)


@dataclass(frozen=True, slots=True)
class Mutant:
    """One planted bug: replacements in `file`, and the test files that must catch it."""

    name: str
    file: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    """pytest arguments: test files or node ids (``-k`` too)."""
    plants: str

    def apply(self, source: str) -> str:
        """`source` with the bug planted; ValueError if an ``old`` text is not there once."""
        for old, new in self.edits:
            count = source.count(old)
            if count != 1:
                raise ValueError(f"{self.name}: expected one {old!r} in {self.file}, found {count}")
            source = source.replace(old, new)
        return source


MUTANTS: tuple[Mutant, ...] = (
    # --- the five bugs of issue 14
    Mutant(
        "git-blob-id",
        "shardsync/fetch/transfer.py",
        (
            (
                'verified = "git-sha1" if git_sha1 == request.git_blob_id else None',
                'verified = "git-sha1"',
            ),
        ),
        (INTEGRITY,),
        "the git blob id of a small Hub file is not compared",
    ),
    Mutant(
        "206-starts-early",
        "shardsync/fetch/answers.py",
        (
            (
                "if cr is None or cr.start != start or cr.end >= end or cr.total != state.size:",
                "if cr is None or cr.start > start or cr.end >= end or cr.total != state.size:",
            ),
        ),
        (INTEGRITY, S3_INTEGRITY),
        "a 206 whose Content-Range starts before the asked offset is accepted",
    ),
    Mutant(
        "no-if-range-etag-ignored",
        "shardsync/fetch/answers.py",
        (
            (
                "        headers[validator] = state.etag\n",
                "        pass\n",
            ),
            (
                "if state.tag is not None and tag is not None and tag != state.tag:",
                "if False:",
            ),
        ),
        (INTEGRITY,),
        "If-Range is not sent and a 206 with another ETag is accepted",
    ),
    Mutant(
        "resume-etag-ignored",
        "shardsync/slot.py",
        (('                and raw.get("etag") == what.etag\n', ""),),
        (INTEGRITY,),
        "the resume record's ETag is not compared with the server's on the next run",
    ),
    Mutant(
        "200-written-at-offset",
        "shardsync/fetch/answers.py",
        (
            (
                "    if status == 200:\n        # Range ignored",
                "    if status == 200:\n        return end\n    if False:\n        # Range ignored",
            ),
        ),
        (INTEGRITY, S3_INTEGRITY),
        "a 200 answer to a Range request is written at the range's offset",
    ),
    Mutant(
        "wire-range-unchecked",
        "shardsync/fetch/body_wire.py",
        (
            (
                "                check_range_answer(head.status, head.get, label, state, "
                "start, end)\n",
                "                pass\n",
            ),
        ),
        (INTEGRITY, S3_INTEGRITY),
        "a body read by a worker thread is written wherever its range says, unchecked",
    ),
    # --- more of the same family
    Mutant(
        "sha256-skipped",
        "shardsync/fetch/transfer.py",
        (
            (
                'verified = "sha256" if digest == request.sha256 else None',
                'verified = "sha256"',
            ),
        ),
        (INTEGRITY, "tests/test_prefetch.py"),
        "the sha256 of an LFS file is not compared",
    ),
    Mutant(
        "206-start-unchecked",
        "shardsync/fetch/answers.py",
        (
            (
                "if cr is None or cr.start != start or cr.end >= end or cr.total != state.size:",
                "if cr is None or cr.end >= end or cr.total != state.size:",
            ),
        ),
        (INTEGRITY, S3_INTEGRITY),
        "where a 206 starts is not checked at all",
    ),
    Mutant(
        "content-range-total-unchecked",
        "shardsync/fetch/answers.py",
        (
            (
                "if cr is None or cr.start != start or cr.end >= end or cr.total != state.size:",
                "if cr is None or cr.start != start or cr.end >= end:",
            ),
        ),
        (INTEGRITY,),
        "the total of a 206's Content-Range is not compared with the size",
    ),
    Mutant(
        "short-partial-trusted",
        "shardsync/slot.py",
        (("                and st.st_size == what.size\n", ""),),
        (INTEGRITY,),
        "a partial file shorter than its resume record says is resumed",
    ),
    Mutant(
        "origin-version-ignored",
        "shardsync/prefetch.py",
        (
            (
                "        return version == hint.origin_etag\n",
                "        return True\n",
            ),
        ),
        (INTEGRITY,),
        "a tofu file is reused from the last snapshot without asking the origin's version",
    ),
    Mutant(
        "read-only-partial-reopened",
        "shardsync/slot.py",
        (("            os.chmod(path, 0o644)\n", "            pass\n"),),
        ("tests/adversarial/test_crash_consistency.py", "-k", "wedges"),
        "a read-only partial left by a crash inside publishing is not made writable again",
    ),
    # --- issue 27: each resume check alone, the second body path, framing, mid-load changes
    Mutant(
        "validator-not-sent",
        "shardsync/fetch/answers.py",
        (("        headers[validator] = state.etag\n", "        pass\n"),),
        (INTEGRITY, "tests/test_s3_origin.py", "-k", "stripping or 412"),
        "neither If-Range nor If-Match is sent (each 206's ETag is still checked)",
    ),
    Mutant(
        "206-etag-unchecked",
        "shardsync/fetch/answers.py",
        (
            (
                "if state.tag is not None and tag is not None and tag != state.tag:",
                "if False:",
            ),
        ),
        (INTEGRITY, "-k", "ignoring_if_range"),
        "a 206 carrying another object's ETag is accepted (If-Range is still sent)",
    ),
    Mutant(
        "length-beside-chunked-trusted",
        "shardsync/fetch/wire.py",
        (
            (
                'if length is not None and ("," in length or head.get("transfer-encoding") '
                "is not None):",
                "if False:",
            ),
        ),
        (FRAMING,),
        "the pump reads a body by its Content-Length beside Transfer-Encoding: chunked",
    ),
    Mutant(
        "chunk-trusted-before-its-end",
        "shardsync/fetch/body_aiohttp.py",
        (("                if framed or chunk_ended:\n", "                if True:\n"),),
        (FRAMING,),
        "a chunked body's bytes count as done before the parser saw their chunk end",
    ),
    Mutant(
        "aiohttp-body-read-unbounded",
        "shardsync/fetch/body_aiohttp.py",
        (
            (
                "async with asyncio.timeout(cfg.read_timeout):  # see ``_chunk_ends``",
                "async with contextlib.nullcontext():",
            ),
        ),
        (f"{FRAMING}::test_a_misframed_answer_that_passes_ends_byte_exact", "-o", "timeout=30"),
        "a body read on the aiohttp path waits for ever once aiohttp's parser has failed",
    ),
    Mutant(
        "malformed-answer-not-retried",
        "shardsync/fetch/fetcher.py",
        (("            exc = malformed(exc, label)\n", "            pass\n"),),
        (FRAMING,),
        "an answer aiohttp cannot parse ends the download at once instead of being retried",
    ),
    Mutant(
        "unframed-asked-twice",
        "shardsync/fetch/body_wire.py",
        (("                    self._unframed = True", "                    pass"),),
        ("tests/adversarial/test_hostile_server.py", "-k", "byte_per"),
        "every range of a server that sends no Content-Length is requested twice",
    ),
    Mutant(
        "aiohttp-request-without-timeout",
        "shardsync/fetch/session.py",
        (
            (
                "timeout=self._metadata_timeout() if metadata else self._timeout,",
                "timeout=self._metadata_timeout() if metadata else None,",
            ),
        ),
        (INTEGRITY, "-k", "silent_server"),
        "a request on the aiohttp path is sent with timeout=None: no read timeout at all",
    ),
    Mutant(
        "mid-load-version-unchecked",
        "shardsync/dcp_reader.py",
        (("            if now != f.version:", "            if False:"),),
        (MID_LOAD,),
        "a checkpoint file replaced at the origin between two reads of one load is used",
    ),
    Mutant(
        "mid-load-pieces-kept",
        "shardsync/dcp_reader.py",
        (("                    f.kept.close()", "                    f.kept.commit()"),),
        (MID_LOAD,),
        "the ranges read from a file that changed mid-load are kept in the cache",
    ),
    # --- issue 27: no secret in any output (tests/adversarial/test_secrets_sweep.py)
    Mutant(
        "redacted-url-keeps-its-query",
        "shardsync/fetch/request.py",
        (('    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))', "    return url"),),
        (SWEEP,),
        "the URL in a message keeps its query (a presigned URL's signature and token)",
    ),
    Mutant(
        "status-error-names-the-url",
        "shardsync/fetch/session.py",
        (
            (
                "raise status_error(resp.status, resp.headers.get, body, label, "
                "relocatable=relocatable)",
                'raise status_error(resp.status, resp.headers.get, body, f"{label} {resp.url}", '
                "relocatable=relocatable)",
            ),
        ),
        (SWEEP,),
        "an HTTP error's message names the signed URL it failed on",
    ),
    Mutant(
        "error-body-quoted-raw",
        "shardsync/fetch/answers.py",
        (("        return redact(text)[:300]", "        return text[:300]"),),
        (SWEEP,),
        "a server's error body that quotes the refused request is copied into the message",
    ),
    Mutant(
        "tier-logs-its-presigned-url",
        "shardsync/tier.py",
        (
            (
                "            url, headers = await client.presign_get(bucket, key)\n",
                "            url, headers = await client.presign_get(bucket, key)\n"
                '            log.debug("reading %s from the tier", url)\n',
            ),
        ),
        (SWEEP,),
        "the tier logs the presigned URL it reads a blob from",
    ),
    Mutant(
        "daemon-lets-everyone-in",
        "shardsync/daemon.py",
        (
            (
                "if uid in (0, os.geteuid()) or uid in cfg.allowed_uids or gid in "
                "cfg.allowed_gids:",
                "if True:",
            ),
        ),
        ("tests/test_daemon.py::test_peer_credentials_decide_who_may_connect_without_root",),
        "the daemon's peer-credential check lets every uid in",
    ),
    Mutant(
        "store-checksum-ignored",
        "shardsync/fetch/transfer.py",
        (
            (
                "store = located.checksum if request.sha256 is None else None",
                "store = None",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_a_flipped_byte_in_a_crc_checked_object_is_never_"
            "published",
        ),
        "an S3 object's CRC (or other checksum the store keeps) is never checked: tofu",
    ),
    Mutant(
        "composite-parts-uncounted",
        "shardsync/digest.py",
        (("if self._over or len(self._digests) != checksum.parts:", "if False:"),),
        ("tests/test_checksums.py::test_composite_checksums_are_checked_part_by_part",),
        "a composite checksum matches bytes that run past (or stop short of) its parts",
    ),
    # --- issue 25: a dead claim holder's parts (tests/test_tier_parts.py)
    Mutant(
        "taker-ignores-parts",
        "shardsync/tier.py",
        (("            there = await self._seed(claim, slot)", "            there = RangeSet()"),),
        ("tests/test_tier_parts.py::test_a_taker_resumes_from_the_dead_holders_parts",),
        "a host taking over a dead holder's claim downloads the whole blob again",
    ),
    Mutant(
        "seeded-partial-refused",
        "shardsync/slot.py",
        (("                    seeded  # bound to the content", "                    False  #"),),
        ("tests/test_tier_parts.py::test_a_taker_resumes_from_the_dead_holders_parts",),
        "a seeded partial (bound to its sha256 alone) is never resumed",
    ),
    Mutant(
        "seeded-parts-uploaded-again",
        "shardsync/tier_parts.py",
        (
            (
                "    decided = RangeSet() if there is None else there.copy()",
                "    decided = RangeSet()",
            ),
        ),
        ("tests/test_tier_parts.py::test_a_taker_never_uploads_again_the_parts_it_resumed_from",),
        "a taker uploads the parts it resumed from a second time",
    ),
    Mutant(
        "claims-without-courtesy",
        "shardsync/tier.py",
        (
            (
                "            if stale is not None or not self._held or not courtesy:",
                "            if True:",
            ),
        ),
        ("tests/test_tier.py::test_hosts_that_start_together_each_win_a_claim",),
        "the first host to start wins every claim, and its death costs the whole model's progress",
    ),
    Mutant(
        "parts-tails-never-flushed",
        "shardsync/tier_parts.py",
        (
            (
                "                flush = held or looks % round(_FLUSH_S / _LOOK_S) == 0",
                "                flush = False",
            ),
        ),
        (
            "tests/test_tier_parts.py::"
            "test_a_holder_killed_mid_download_leaves_parts_the_taker_resumes_from[16MiB]",
        ),
        "a holder on a slow link publishes nothing until a piece fills, and its death costs it all",
    ),
    Mutant(
        "pump-throttle-asked-once",
        "shardsync/fetch/pump.py",
        (("            pause = self._throttle(0)", "            pause = 0.0"),),
        (
            "tests/adversarial/test_transfer_integrity.py::"
            "test_a_throttle_holds_every_read_until_it_says_go_on_every_body_path",
        ),
        "a throttle cannot hold the pump's reads: one pause per read, then on",
    ),
    Mutant(
        "aiohttp-throttle-asked-once",
        "shardsync/fetch/body_aiohttp.py",
        (
            (
                "                        pause = self._throttle(0)",
                "                        pause = 0.0",
            ),
        ),
        (
            "tests/adversarial/test_transfer_integrity.py::"
            "test_a_throttle_holds_every_read_until_it_says_go_on_every_body_path",
        ),
        "a throttle cannot hold aiohttp's reads (chunked bodies, proxies): one pause per read",
    ),
    Mutant(
        "held-pump-deaf-to-aborts",
        "shardsync/fetch/pump.py",
        (
            (
                "        while pause > 0 and not (self._aborted or self._closing):",
                "        while pause > 0:",
            ),
        ),
        ("tests/test_tier_parts.py::test_a_held_download_is_cancelled_at_once",),
        "a cancelled job whose download a throttle holds waits out the throttle",
    ),
    Mutant(
        "s3-ranges-sized-by-download",
        "shardsync/fetch/transfer.py",
        (
            (
                "        most = request.chunk_size or self.config.chunk_size",
                "        most = self.config.chunk_size",
            ),
        ),
        ("tests/test_s3_origin.py::test_s3_ranges_are_as_large_as_the_s3_section_says",),
        "an object store is asked for the CDN's small ranges, each one a request it pays for",
    ),
    Mutant(
        "s3-tail-cut-finer",
        "shardsync/fetch/transfer.py",
        (
            (
                "        whole = state.single_stream or request.chunk_size is not None",
                "        whole = state.single_stream",
            ),
        ),
        ("tests/test_s3_origin.py::test_s3_ranges_are_as_large_as_the_s3_section_says",),
        "an object's last ranges are cut in four as a CDN's are: more requests the store pays for",
    ),
    Mutant(
        "holder-runs-ahead-of-its-parts",
        "shardsync/tier_parts.py",
        (
            (
                "            if self._free or self._read - self._settled <= self.limit:",
                "            if True:",
            ),
        ),
        ("tests/test_tier_parts.py::test_a_holder_stays_within_its_lead_of_a_slow_tier",),
        "a holder outruns a slow tier, and its death costs the fleet all it had not published",
    ),
    Mutant(
        "tier-retries-with-botocores-backoff",
        "shardsync/s3.py",
        (
            (
                '"total_max_attempts": self.attempts if self.retry_wait is None else 1,',
                '"max_attempts": self.attempts if self.retry_wait is None else 1,',
            ),
        ),
        ("tests/test_tier.py::test_a_dead_tier_is_asked_at_most_twice_per_request",),
        "botocore retries a dead tier's requests with up to a second of backoff each",
    ),
    Mutant(
        "bad-part-fails-the-job",
        "shardsync/tier.py",
        (
            (
                "            except IntegrityError:\n                if not seeded:",
                "            except ZeroDivisionError:\n                if not seeded:",
            ),
        ),
        (
            "tests/test_tier_parts.py::test_a_corrupt_part_costs_one_download_and_never_a_wrong_blob",
        ),
        "a flipped byte in a dead holder's part fails the taker's job instead of one download",
    ),
    Mutant(
        "streams-side-by-side",
        "shardsync/prefetch.py",
        (("if queue is large and self.in_order:", "if queue is large and not self:"),),
        (
            "tests/test_prefetch.py::test_a_stream_gets_each_shard_in_its_turn_with_every_connection",
            "tests/test_loader.py::test_a_stream_gets_the_first_shard_before_the_last_one_downloads",
        ),
        "a stream's shards download side by side again: all verified at the end",
    ),
    Mutant(
        "turn-without-its-share",
        "shardsync/fetch/transfer.py",
        (("most *= max(1, turn.share)", "most *= 1"),),
        (
            "tests/test_prefetch.py::test_a_stream_gets_each_shard_in_its_turn_with_every_connection",
        ),
        "a file in its turn keeps one file's connections: one at a time is slower",
    ),
    Mutant(
        "next-in-turn-after-the-last-byte",
        "shardsync/fetch/transfer.py",
        (
            (
                "            state.at_tail()  # this connection is free: the next file may have it",
                "            pass",
            ),
        ),
        (
            "tests/test_prefetch.py::test_a_stream_gets_each_shard_in_its_turn_with_every_connection",
        ),
        "a stream's next file starts only when the one before has ended, not at its tail",
    ),
    Mutant(
        "exit-without-flush",
        "shardsync/cli.py",
        (("        sys.stdout.flush()\n        sys.stderr.flush()\n", "        pass\n"),),
        (
            "tests/test_cli.py::test_the_command_ends_with_its_output_its_code_and_its_exit_handlers",
        ),
        "the command ends without flushing: a piped stdout loses the JSON it was given",
    ),
    Mutant(
        "daemon-client-loads-the-engine",
        "shardsync/daemon_transport.py",
        (("import h11\n", "import aiohttp  # noqa: F401\nimport h11\n"),),
        ("tests/test_daemon.py::test_a_prefetch_the_daemon_runs_loads_no_engine_in_the_command",),
        "a command the daemon serves imports aiohttp again (0.15 s of a small model's prefetch)",
    ),
    # --- issue 26: siblings stay siblings
    Mutant(
        "scheduler-on-top-of-the-engine",
        "shardsync/scheduler.py",
        (
            (
                "from shardsync.engine_api import EngineJob, FileGate, Room, Runner\n",
                "from shardsync.engine_api import EngineJob, FileGate, Room, Runner\n"
                "from shardsync.prefetch import Engine  # noqa: F401\n",
            ),
        ),
        ("tests/test_structure.py::test_the_longest_chain_of_imports_is_short",),
        "the scheduler imports the engine again: the chain of imports grows past 9",
    ),
    Mutant(
        "failed-copy-left-behind",
        "shardsync/slot.py",
        (
            (
                "        except BaseException as exc:\n            self.suspend()\n",
                "        except BaseException as exc:\n",
            ),
        ),
        ("tests/test_slot.py::test_a_copy_that_fills_the_disk_fails_clearly_and_leaves_nothing",),
        "a local origin's copy that fails halfway leaves its private file in the cache's tmp/",
    ),
    Mutant(
        "presigned-for-the-clients-region",
        "shardsync/s3.py",
        (
            (
                "            if region is not None and region != client.meta.region_name:",
                "            if False:",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_a_bucket_in_another_region_gets_urls_signed_for_its_region",
            "tests/test_tier.py::test_a_tier_bucket_in_another_region_is_filled_and_read",
        ),
        "presigned GETs of a bucket in another region are signed for the client's (S3: 400)",
    ),
    Mutant(
        "presigned-for-the-global-host",
        "shardsync/s3_botocore.py",
        (('builtins["AWS::Region"] = region', "pass"),),
        ("tests/test_s3_origin.py::test_presigned_urls_point_at_the_buckets_own_region",),
        "presigned URLs name the global host, which refuses the regions opened since 2019",
    ),
    Mutant(
        "expired-token-is-fatal",
        "shardsync/fetch/answers.py",
        (
            (
                "    if status == 400 and relocatable and code in _TOKEN_EXPIRED:",
                "    if False:",
            ),
        ),
        ("tests/test_s3_origin.py::test_a_url_whose_session_token_expired_is_signed_again",),
        "a URL whose session token expired (S3: 400 ExpiredToken) fails the file",
    ),
    Mutant(
        "archived-object-signed-again",
        "shardsync/fetch/answers.py",
        (('    if code == "InvalidObjectState":', "    if False:"),),
        ("tests/test_s3_origin.py::test_an_archived_object_fails_at_once_without_new_urls",),
        "an archived object's 403 is taken for an expired URL and signed again and again",
    ),
    Mutant(
        "no-credentials-no-public-buckets",
        "shardsync/s3.py",
        (
            (
                'signature_version=UNSIGNED if self._unsigned else "s3v4",',
                'signature_version="s3v4",',
            ),
        ),
        ("tests/test_s3_origin.py::test_a_public_bucket_is_read_unsigned_without_credentials",),
        "without credentials even a public bucket is refused (botocore: NoCredentialsError)",
    ),
    Mutant(
        "requester-pays-not-said",
        "shardsync/s3.py",
        (('register("before-parameter-build.s3", req', 'register("never-emitted", req'),),
        (
            "tests/test_s3_origin.py::test_a_requester_pays_bucket_is_read_when_the_config_says_so",
            "tests/test_tier.py::test_a_requester_pays_tier_bucket_is_filled_and_read",
        ),
        "[s3] requester_pays is ignored: a Requester Pays bucket refuses every request (403)",
    ),
    Mutant(
        "requester-pays-header-not-sent",
        "shardsync/s3.py",
        (("run), signed\n", "run), {}\n"),),
        (
            "tests/test_s3_origin.py::test_a_requester_pays_bucket_is_read_when_the_config_says_so",
            "tests/test_tier.py::test_a_requester_pays_tier_bucket_is_filled_and_read",
        ),
        "presigned GETs signed with x-amz-request-payer go without it (the store: 403)",
    ),
    Mutant(
        "load-via-daemon-lists-itself",
        "shardsync/loader.py",
        (("        client = await _daemon(request)\n", "        client = None\n"),),
        ("tests/test_loader.py::test_load_goes_through_a_running_daemon",),
        "a load with a daemon running lists the origin and reads the headers in its own process",
    ),
    Mutant(
        "prepared-headers-of-other-files",
        "shardsync/prepared.py",
        (("        if set(headers) != wanted:\n", "        if not wanted <= set(headers):\n"),),
        ("tests/test_prepared.py",),
        "a daemon's prepared answer with a header for a file that is no shard is taken",
    ),
    Mutant(
        "prepare-404-not-tolerated",
        "shardsync/daemon_transport.py",
        (
            (
                '        if status == 404 and info is not None and info.code == "not_found":\n',
                "        if False:\n",
            ),
        ),
        ("tests/test_loader.py::test_a_daemon_older_than_prepare_still_serves_the_load",),
        "a daemon older than POST /v1/prepare fails every load instead of serving its download",
    ),
    Mutant(
        "prepare-cut-at-a-requests-timeout",
        "shardsync/daemon_transport.py",
        (
            (
                '            "POST", "/v1/prepare", request.to_json(), _PREPARE_TIMEOUT_S\n',
                '            "POST", "/v1/prepare", request.to_json()\n',
            ),
        ),
        ("tests/test_loader.py::test_a_prepare_slower_than_a_plain_request_still_serves_the_load",),
        "a prepare waiting on a slow origin is cut off at a plain request's timeout",
    ),
    Mutant(
        "header-with-its-length-prefix",
        "shardsync/shard_headers.py",
        (
            (
                "        return entry.path, prefix[8 : 8 + n]\n",
                "        return entry.path, prefix[: 8 + n]\n",
            ),
        ),
        ("tests/test_daemon.py::test_prepare_answers_the_origins_headers_and_downloads_no_shard",),
        "a header read by Range keeps the 8-byte length prefix",
    ),
    Mutant(
        "cached-copy-checked-by-a-new-head",
        "shardsync/prefetch.py",
        (
            (
                "version = entry.version or await self.origin.version(self.fetcher, entry)",
                "version = await self.origin.version(self.fetcher, entry)",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_a_cached_model_costs_the_listing_alone_and_a_replaced_object_is_fetched",
        ),
        "a cached copy is checked by a new HEAD though the listing said its ETag",
    ),
    Mutant(
        "any-listed-version-matches",
        "shardsync/prefetch.py",
        (
            (
                "        return version == hint.origin_etag\n",
                "        return entry.version is not None or version == hint.origin_etag\n",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_a_cached_model_costs_the_listing_alone_and_a_replaced_object_is_fetched",
        ),
        "a cached copy is reused whatever ETag the listing saw",
    ),
    # --- a kill -9 mid-download on the S3 path: the resume records on both body paths, and
    # a resumed object's store checksum over the bytes of both runs
    Mutant(
        "pump-records-nothing",
        "shardsync/fetch/body_wire.py",
        (("            landing.recorded(first, stop)\n", "            pass\n"),),
        (KILL, DAEMON_S3_KILL),
        "the pump never tells the resume record what landed: a kill loses the whole partial",
    ),
    Mutant(
        "aiohttp-path-records-nothing",
        "shardsync/fetch/body_aiohttp.py",
        (("        landing.recorded(*claim)\n", "        pass\n"),),
        (f"{KILL}::test_a_kill_at_40_percent_of_an_s3_download_loses_only_what_was_in_flight",),
        "the aiohttp body path never tells the resume record what landed",
    ),
    Mutant(
        "resumed-prefix-skips-store-checksum",
        "shardsync/fetch/transfer.py",
        (
            (
                "        hashed = 0\n",
                "        hashed = state.done.contiguous_prefix() if store is not None else 0\n",
            ),
        ),
        (
            f"{KILL}::test_a_kill_at_40_percent_of_an_s3_download_loses_only_what_was_in_flight",
            DAEMON_S3_KILL,
        ),
        "a resumed object's store checksum (and name) skip the bytes of the earlier run",
    ),
    # --- a local file changed while it is copied, and copies cancelled with their job
    Mutant(
        "local-copy-version-unchecked",
        "shardsync/origins/local.py",
        (("        if now != version:\n", "        if False:\n"),),
        (f"{INTEGRITY}::test_a_local_file_changed_while_it_is_copied_is_never_published",),
        "a local file changed while it was copied is published (bytes of both versions)",
    ),
    Mutant(
        "refused-copy-left-in-tmp",
        "shardsync/slot.py",
        (
            (
                "            self.suspend()  # what was made and not published goes",
                "            pass  #",
            ),
        ),
        (
            f"{INTEGRITY}::test_a_local_file_changed_while_it_is_copied_is_never_published",
            f"{INTEGRITY}::test_a_copy_cancelled_before_its_check_leaves_nothing_in_tmp",
        ),
        "a whole copy its origin refused, or cancelled at its check, stays in tmp/",
    ),
    Mutant(
        "cancelled-copy-left-in-tmp",
        "shardsync/fetch/fetcher.py",
        (("            copying.add_done_callback(self._drop_copy)\n", ""),),
        (f"{INTEGRITY}::test_a_copy_cancelled_in_its_thread_goes_when_the_thread_ends",),
        "a copy cancelled with its job is finished by its thread and left in tmp/",
    ),
    Mutant(
        "cancelled-commit-never-runs",
        "shardsync/store.py",
        (
            (
                "await to_the_end(asyncio.to_thread(slot.commit, file))",
                "await asyncio.to_thread(slot.commit, file)",
            ),
        ),
        ("tests/test_slot.py::test_a_commit_cancelled_before_its_thread_starts_still_publishes",),
        "a commit cancelled before its thread starts never runs: the file stays in tmp/",
    ),
    Mutant(
        "seeding-closed-under-its-writes",
        "shardsync/tier_parts.py",
        (
            (
                "await to_the_end(asyncio.to_thread(seeding.write, start, data))",
                "await asyncio.to_thread(seeding.write, start, data)",
            ),
        ),
        (
            "tests/test_tier_parts.py::"
            "test_a_cancelled_seeding_closes_its_partial_only_after_its_writes",
        ),
        "a cancelled seeding closes the partial's descriptor while a part's write still runs",
    ),
    Mutant(
        "kept-file-closed-under-its-write",
        "shardsync/dcp_reader.py",
        (("await to_the_end(asyncio.to_thread(write))", "await asyncio.to_thread(write)"),),
        (
            f"{MID_LOAD}::"
            "test_a_load_failing_while_a_range_is_kept_closes_the_kept_file_after_the_write",
        ),
        "a failing DCP load closes a kept file while a range's write into it still runs",
    ),
    Mutant(
        "seeded-partial-left-open",
        "shardsync/tier_parts.py",
        (
            (
                "await opened(asyncio.to_thread(slot.seed, size, sha256), Seeding.close)",
                "await asyncio.to_thread(slot.seed, size, sha256)",
            ),
        ),
        (
            "tests/test_tier_parts.py::"
            "test_a_seeding_cancelled_while_its_partial_is_made_leaves_no_descriptor_open",
        ),
        "a seeding cancelled while its partial is made leaves that partial's descriptors open",
    ),
    Mutant(
        "kept-file-left-open",
        "shardsync/dcp_reader.py",
        (("await opened(opening, KeptFile.close)", "await opening"),),
        (
            "tests/test_checkpoint.py::"
            "test_a_load_failing_while_a_file_is_opened_leaves_no_descriptor_open",
        ),
        "a DCP load failing while a file's kept pieces open leaves their descriptor open",
    ),
    Mutant(
        "planned-shard-unchecked",
        "shardsync/loader.py",
        (
            (
                "_check_planned(entry.path, file, header, self._raw_headers[entry.path])",
                "pass",
            ),
        ),
        (
            "tests/test_s3_origin.py::"
            "test_a_shard_replaced_between_the_daemons_plan_and_its_download_is_never_placed",
            f"{LOADER_INPUTS}::"
            "test_an_s3_shard_replaced_between_its_plan_and_its_download_is_refused",
            f"{LOADER_INPUTS}::test_a_local_shard_replaced_between_its_plan_and_its_copy_is_refused",
            f"{LOADER_INPUTS}::test_a_plain_url_shard_must_end_where_its_header_says",
        ),
        "a shard replaced between the plan and its download is cut at the old offsets",
    ),
    Mutant(
        "complex64-unmapped",
        "shardsync/placement.py",
        (('    "C64": "complex64",\n', ""),),
        (f"{LOADER_INPUTS}::test_every_dtype_this_torch_has_loads_bit_exact",),
        "a complex64 tensor, which torch has, is refused as unsupported",
    ),
    Mutant(
        "default-device-followed",
        "shardsync/placement.py",
        (
            (
                'torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)',
                "torch.empty(0, dtype=torch.uint8).set_(storage)",
            ),
        ),
        (f"{LOADER_INPUTS}::test_tensors_load_to_the_cpu_whatever_the_callers_default_device",),
        "a load under the caller's meta (or CUDA) default device fails",
    ),
    Mutant(
        "dtype-refused-after-download",
        "shardsync/placement.py",
        (
            (
                "            stored = _torch_dtype(info)  # refused now",
                "            stored = None  # refused now",
            ),
        ),
        (
            f"{LOADER_INPUTS}::"
            "test_what_torch_or_a_module_cannot_hold_is_refused_before_the_download",
        ),
        "a dtype torch lacks is found only once its shard was downloaded",
    ),
    Mutant(
        "non-module-name-crashes",
        "shardsync/placement.py",
        (("            if not is_module_path(info.name):", "            if False:"),),
        (
            f"{LOADER_INPUTS}::"
            "test_what_torch_or_a_module_cannot_hold_is_refused_before_the_download",
        ),
        "a tensor name with an empty dotted part ends the load in a ValueError",
    ),
    Mutant(
        "stray-junk-fails-prune",
        "shardsync/inventory.py",
        (
            (
                "        if not layout.is_junk_name(kind, name):\n            continue",
                "        pass",
            ),
        ),
        ("tests/test_prune.py::test_what_shardsync_did_not_make_a_prune_leaves_and_still_prunes",),
        "a file of a name shardsync never writes in tmp/ fails every prune",
    ),
    Mutant(
        "stray-snapshot-fails-prune",
        "shardsync/inventory.py",
        ((" or not is_commit(commit)", ""),),
        ("tests/test_prune.py::test_what_shardsync_did_not_make_a_prune_leaves_and_still_prunes",),
        "an entry of snapshots/ that is no commit fails every prune",
    ),
    Mutant(
        "full-disk-fails-prune",
        "shardsync/prune.py",
        (("except DiskFullError as exc:  # the log", "except ZeroDivisionError as exc:  #"),),
        ("tests/test_prune.py::test_a_prune_on_a_full_disk_reports_what_it_could_not_meet",),
        "a prune on a full disk fails at the access log's rewrite instead of reporting",
    ),
    Mutant(
        "starting-daemon-socket-stolen",
        "shardsync/listeners.py",
        (("    lock = _hold_lock(path)\n", '    lock = os.open("/dev/null", os.O_RDONLY)\n'),),
        ("tests/test_daemon.py::test_a_daemon_still_starting_keeps_its_socket",),
        "a second daemon takes the socket of one still starting, and both run its journal",
    ),
    Mutant(
        "follower-cancelled-with-its-leader",
        "shardsync/scheduler.py",
        (("if error.code != error_code(JobCancelledError()):", "if True:"),),
        (
            "tests/test_scheduler.py::"
            "test_a_follower_goes_on_alone_when_the_job_it_follows_is_cancelled",
        ),
        "cancelling a job cancels the other clients' job that follows its download",
    ),
    Mutant(
        "cancelled-job-joined",
        "shardsync/scheduler.py",
        (("        self._release(job)  # a request from now on starts a job", "        pass  #"),),
        (
            "tests/test_scheduler.py::"
            "test_a_request_while_a_job_is_being_cancelled_starts_a_new_job",
        ),
        "a request made while a job is being cancelled joins it and ends cancelled",
    ),
    Mutant(
        "since-unicode-digit-500",
        "shardsync/daemon.py",
        (("since_text.isascii() and since_text.isdigit()", "since_text.isdigit()"),),
        ("tests/test_daemon.py::test_a_since_that_is_no_event_number_is_a_400",),
        "an event stream asked from a Unicode digit (?since=\u00b2) is a 500, not a 400",
    ),
    Mutant(
        "event-stream-without-heartbeat",
        "shardsync/daemon.py",
        (("timeout=_HEARTBEAT_S", "timeout=None"),),
        ("tests/test_daemon.py::test_an_event_stream_its_client_left_ends_without_an_event",),
        "an event stream whose client left holds its handler until the job's next event",
    ),
    Mutant(
        "stream-leased-in-its-own-cache",
        "shardsync/loader.py",
        (("lease = await client.hold(request.source)", "lease = None"),),
        ("tests/test_loader.py::test_a_stream_through_a_daemon_is_leased_in_the_daemons_cache",),
        "a stream a daemon serves leases its own cache, and a prune of the daemon's evicts it",
    ),
    Mutant(
        "stop-waits-for-a-stuck-step",
        "shardsync/daemon.py",
        (
            (
                "threading.Timer(_STOP_TIMEOUT + _EXIT_GRACE, _exit_now)",
                "threading.Timer(3600, _exit_now)",
            ),
        ),
        (
            "tests/test_daemon.py::test_a_stop_ends_the_process_even_with_a_publish_that_never_returns",
        ),
        "a daemon told to stop waits for a publish a stalled disk holds, past its 10 s",
    ),
    Mutant(
        "silent-connections-kept",
        "shardsync/daemon.py",
        ((", keepalive_timeout=_IDLE_S", ""),),
        ("tests/test_daemon.py::test_connections_that_send_nothing_are_closed",),
        "connections that send nothing hold the daemon's descriptors for an hour each",
    ),
    Mutant(
        "a-scan-per-scrape",
        "shardsync/daemon.py",
        (("if memo is None or failed or", "if True or memo is None or failed or"),),
        ("tests/test_daemon.py::test_scrapes_at_once_share_one_scan_of_the_cache",),
        "a burst of scrapes starts one walk of the whole cache each",
    ),
    Mutant(
        "every-origin-kept",
        "shardsync/prefetch.py",
        (("        if len(self._origins) > _ORIGINS:", "        if False:"),),
        ("tests/test_prefetch.py::test_an_engine_keeps_a_bounded_number_of_origins",),
        "a daemon keeps an origin for every source it was ever asked for",
    ),
    Mutant(
        "superscript-digit-read-as-number",
        "shardsync/fetch/wire.py",
        (("    return text.isascii() and text.isdigit()", "    return text.isdigit()"),),
        (f"{FRAMING}::test_a_misframed_answer_that_passes_ends_byte_exact",),
        "a status or Content-Length of a latin-1 \u00b2 ends the download in a ValueError",
    ),
    Mutant(
        "infinite-size-crashes",
        "shardsync/config.py",
        (('    if not math.isfinite(number):  # "1e400"', "    if False:  #"),),
        (
            "tests/test_config.py::test_parse_size_rejects",
            "tests/test_config.py::test_bad_env_value",
        ),
        "a size of 1e400 in the config or the environment ends in an OverflowError traceback",
    ),
    Mutant(
        "nan-timeout-accepted",
        "shardsync/config.py",
        (("        if not math.isfinite(value):  # TOML has nan", "        if False:  #"),),
        ("tests/test_config.py::test_invalid_config_names_the_key",),
        "a timeout of nan (every read times out at once) or inf (none ever does) is taken",
    ),
    Mutant(
        "failed-taker-keeps-renewing",
        "shardsync/tier.py",
        (
            (
                "except BaseException:\n            await self._release(upload)\n",
                "except BaseException:\n",
            ),
        ),
        ("tests/test_tier_parts.py::test_a_taker_cancelled_while_it_seeds_lets_go_of_the_claim",),
        "a job that fails or is cancelled after it won a claim renews that claim for ever",
    ),
    Mutant(
        "refused-delete-turns-the-tier-off",
        "shardsync/tier.py",
        (('doing in ("claim", "write", "delete")', 'doing in ("claim", "write")'),),
        (
            "tests/test_tier.py::"
            "test_a_read_only_identity_meeting_a_corrupt_object_still_reads_the_rest",
        ),
        "a read-only identity refused the delete of a corrupt object reads nothing more",
    ),
    Mutant(
        "listing-head-error-escapes",
        "shardsync/origins/s3.py",
        (("            raise_first(group)", "            raise"),),
        (
            "tests/test_s3_origin.py::"
            "test_an_object_gone_between_the_listing_and_its_head_is_one_clear_error",
        ),
        "an object gone between the listing and its HEAD ends the job in a bare ExceptionGroup",
    ),
    Mutant(
        "local-read-error-taken-for-the-tier",
        "shardsync/s3.py",
        (
            (
                '        return path.open("rb")\n    except OSError',
                '        return path.open("rb")\n    except ZeroDivisionError',
            ),
        ),
        (
            "tests/test_tier.py::test_a_blob_gone_before_its_upload_is_a_local_error_not_a_dead_tier",
        ),
        "a blob gone before its upload is taken for a dead tier (one PUT) or escapes (multipart)",
    ),
    Mutant(
        "tilde-cache-dir-taken-literally",
        "shardsync/cli.py",
        (("    return Path(text).expanduser()", "    return Path(text)"),),
        ("tests/test_cli.py::test_a_cache_dir_given_as_tilde_is_the_users_home",),
        "--cache-dir=~/c makes a cache in a folder named ~ under the working directory",
    ),
    Mutant(
        "unreadable-link-called-missing",
        "shardsync/verify.py",
        (("        if exc.errno != errno.EINVAL:", "        if False:"),),
        ("tests/test_verify.py::test_a_snapshot_it_may_not_read_is_an_error_not_missing_files",),
        "verify reports a snapshot it may not read as missing files, exit 13",
    ),
    Mutant(
        "hidden-holder-taken-for-dead",
        "shardsync/layout.py",
        (
            (
                "        try:\n            os.kill(pid, 0)",
                '        if Path("/proc/self/stat").exists():\n'
                "            return False\n"
                "        try:\n"
                "            os.kill(pid, 0)",
            ),
        ),
        (
            "tests/test_snapshot_use.py::"
            "test_another_users_lease_is_live_where_proc_hides_their_processes",
        ),
        "under /proc's hidepid another user's running holder counts as dead",
    ),
    Mutant(
        "found-blob-not-kept",
        "shardsync/prefetch.py",
        (("        await self._keep(sha)\n", ""),),
        (
            "tests/test_s3_origin.py::"
            "test_a_blob_an_s3_job_finds_in_the_store_outlives_a_prune_of_its_other_snapshot",
        ),
        "a content-named job's blob found in the store goes with another repo's eviction",
    ),
    Mutant(
        "copied-blob-not-kept",
        "shardsync/prefetch.py",
        (("            await self._keep(fetched.sha256)\n", ""),),
        (
            "tests/test_prune.py::"
            "test_a_blob_a_content_named_job_reuses_outlives_its_other_snapshot",
        ),
        "a content-named job's copied blob, the same as another repo's, goes with its eviction",
    ),
    Mutant(
        "leased-blob-no-reference",
        "shardsync/prune_plan.py",
        (("    refs.update(b for b in view.leased_blobs if b in sizes)", "    pass"),),
        (
            "tests/test_prune.py::test_plan",
            "tests/test_prune.py::"
            "test_a_blob_a_content_named_job_reuses_outlives_its_other_snapshot",
        ),
        "a prune deletes a blob a live lease names once its last snapshot is evicted",
    ),
    Mutant(
        "trainer-first-dcp-folder",
        "shardsync/training.py",
        (
            (
                "one = metas if len(metas) == 1 else models if len(models) == 1 else []",
                "one = metas[:1]",
            ),
        ),
        (
            "tests/test_checkpoint.py::"
            "test_a_trainer_checkpoint_with_model_and_optimizer_folders_loads_the_model",
        ),
        "a Trainer's FSDP checkpoint loads its optimizer's tensors into the model",
    ),
    Mutant(
        "data-version-unpinned",
        "shardsync/dcp_reader.py",
        (("        if choice.dcp is not None:  # each data file", "        if False:  #"),),
        (
            "tests/test_checkpoint.py::"
            "test_data_files_changed_after_the_metadata_was_read_are_never_loaded",
        ),
        "a step saved again after its .metadata was read loads tensors at the other's offsets",
    ),
    Mutant(
        "pointer-fallback-without-pointer",
        "shardsync/training.py",
        (
            (
                '    if wanted == "latest":\n        if target is None',
                '    if wanted == "latest" and False:\n        if target is None',
            ),
        ),
        (f"{TRAINING}::test_a_deepspeed_pointer_outside_the_prefix_or_at_a_torn_tag",),
        "a pointer naming a torn checkpoint gives an older one without the pointer",
    ),
    Mutant(
        "expert-rank-ignored",
        "shardsync/training.py",
        (
            (
                "grid.add(tuple(int(g) for g in m.groups() if g is not None))",
                "grid.add((int(m.group(1)), int(m.group(2) or 0)))",
            ),
        ),
        (f"{TRAINING}::test_megatron_expert_rank_folders_make_a_full_grid_or_no_checkpoint",),
        "a Megatron checkpoint missing an expert rank's folder counts as complete",
    ),
    Mutant(
        "zero3-tag-unseen",
        "shardsync/training.py",
        (
            (
                "return bool(_DS_MODEL.fullmatch(name) or _DS_ZERO.fullmatch(name))",
                "return bool(_DS_MODEL.fullmatch(name))",
            ),
        ),
        (f"{TRAINING}::test_zero3_tags_are_checked_inside_a_trainer_checkpoint_and_alone",),
        "a Trainer checkpoint's torn ZeRO-3 tag is not checked; a ZeRO-3 run is not seen",
    ),
    Mutant(
        "step-from-basename",
        "shardsync/training.py",
        (("    depth = _step_depth(candidates)", "    depth = -1"),),
        (
            f"{TRAINING}::"
            "test_the_step_is_read_where_the_checkpoints_differ_and_an_unreadable_one_is_no_torn_one",
        ),
        "step-1000/model loses to step-200/model: the step is read from the folder's name",
    ),
    Mutant(
        "unreadable-dcp-taken-for-torn",
        "shardsync/training.py",
        (
            (
                "            _RANK_METADATA.fullmatch(posixpath.basename(p)) for p, _ in",
                "            False and _RANK_METADATA.fullmatch(posixpath.basename(p)) for p, _ in",
            ),
        ),
        (
            f"{TRAINING}::"
            "test_the_step_is_read_where_the_checkpoints_differ_and_an_unreadable_one_is_no_torn_one",
        ),
        "a DCP step saved without collectives is passed over for an older one as torn",
    ),
    Mutant(
        "pipeline-ranks-data-major",
        "shardsync/training.py",
        (("        if any(_DS_LAYER.fullmatch(n) for _, _, n in names):", "        if False:"),),
        (f"{TRAINING}::test_a_deepspeed_pipeline_rank_gets_every_zero_file",),
        "a DeepSpeed pipeline's rank fetches another stage's ZeRO files",
    ),
    Mutant(
        "save-state-split",
        "shardsync/training.py",
        (
            (
                "groups = {p for p in parents if _parts_of_one_step(kids[p])}",
                "groups = {p for p in parents if False}",
            ),
        ),
        (f"{TRAINING}::test_accelerates_save_state_folders_are_one_checkpoint_each",),
        "accelerate's save_state checkpoint is fetched as its model's folder alone",
    ),
    Mutant(
        "bytes-past-the-content-range",
        "shardsync/fetch/answers.py",
        (
            (
                "    if length is not None and "
                "(declared is None or declared > cr.end - cr.start + 1):",
                "    if False:",
            ),
        ),
        (
            "tests/adversarial/test_hostile_server.py::test_bytes_past_the_content_range_are_never_data",
        ),
        "a 206 body longer than its Content-Range is written as file data",
    ),
    Mutant(
        "chunked-past-the-content-range",
        "shardsync/fetch/body_aiohttp.py",
        (("end = check_range_answer(", "check_range_answer("),),
        (
            "tests/adversarial/test_hostile_server.py::test_bytes_past_the_content_range_are_never_data",
        ),
        "a chunked 206 body past its Content-Range is written as file data",
    ),
    Mutant(
        "whole-body-cut-to-size",
        "shardsync/fetch/body_aiohttp.py",
        (("    if over > 0:", "    if over < 0:"),),
        (
            "tests/adversarial/test_hostile_server.py::test_a_whole_body_longer_than_the_file_is_never_cut_to_size",
        ),
        "a whole chunked 200 longer than the file is cut to size and published",
    ),
    Mutant(
        "whole-get-of-another-etag",
        "shardsync/fetch/answers.py",
        (('    _same_object(state, header("ETag"), single_stream=True)', "    pass"),),
        (
            "tests/adversarial/test_hostile_server.py::test_a_whole_get_of_another_etag_than_located_is_asked_again",
        ),
        "a whole-file 200 of another ETag than the located one is published under the first",
    ),
    Mutant(
        "stream-priority-dropped",
        "shardsync/loader.py",
        (("                priority=request.priority,\n", ""),),
        ("tests/test_loader.py::test_load_goes_through_a_running_daemon",),
        "a load or stream through the daemon runs its job at priority 0, whatever it asked",
    ),
    Mutant(
        "vllm-priority-dropped",
        "shardsync/vllm_plugin.py",
        (("        priority=options.priority,  # the daemon's job for the stream\n", ""),),
        ("tests/test_vllm.py::test_vllm_through_the_daemon_downloads_once_per_host",),
        "vLLM's load through the daemon runs at priority 0 whatever the priority option says",
    ),
    Mutant(
        "prepared-files-not-rechecked",
        "shardsync/prefetch.py",
        (("        await self._recheck_prepared()\n", ""),),
        (
            "tests/test_prune.py::test_a_prune_between_a_jobs_prepare_and_download_breaks_no_snapshot",
        ),
        "a prune between a job's prepare and download leaves a 'complete' snapshot with no index",
    ),
    Mutant(
        "own-repo-kept-as-a-pattern",
        "shardsync/prune.py",
        (("    return (glob.escape(repo),)", "    return (repo,)"),),
        (
            "tests/test_prune.py::test_the_daemons_own_prune_keeps_a_jobs_repo_by_its_name_not_as_a_pattern",
        ),
        "the daemon's prune evicts the snapshot of a job whose repo is named like a pattern",
    ),
    Mutant(
        "parts-taken-for-equal",
        "shardsync/s3.py",
        (
            (
                "        sizes = tuple(t.result() for t in heads)",
                "        sizes = (heads[0].result(),) * (parts - 1) + (heads[-1].result(),)",
            ),
        ),
        (
            "tests/test_s3_parts.py::test_parts_of_unequal_sizes_are_checked_where_attributes_are_refused",
        ),
        "parts of 6, 5, 7 and 6 MiB are taken for four of 6: a good object fails as corrupt",
    ),
    Mutant(
        "attribute-sizes-trusted",
        "shardsync/s3.py",
        (("        if parts_fit(sizes, parts, size):", "        if len(sizes) == parts:"),),
        ("tests/test_s3_parts.py::test_attributes_a_store_lies_in_are_asked_of_the_parts",),
        "part sizes that do not add up drop the store's composite checksum: the file is tofu",
    ),
    Mutant(
        "replaced-before-parts-fails-the-job",
        "shardsync/origins/s3.py",
        (
            (
                "                head = None  # replaced since its HEAD\n                continue",
                "                raise",
            ),
        ),
        (
            "tests/test_s3_parts.py::test_an_object_replaced_before_its_parts_are_asked_is_located_again",
        ),
        "an object replaced between its HEAD and its parts' sizes fails the whole prefetch",
    ),
    Mutant(
        "listed-sha256-replaced-downloaded",
        "shardsync/origins/s3.py",
        (
            (
                "if entry.sha256 is not None and entry.version not in (None, head.etag):",
                "if False:",
            ),
        ),
        (
            "tests/test_s3_parts.py::test_an_object_replaced_since_its_sha256_was_listed_fails_before_its_body",
        ),
        "an object replaced since its SHA-256 was listed is downloaded thrice, blamed on the store",
    ),
    Mutant(
        "torch-device-refused",
        "shardsync/devicemap.py",
        (("        value = str(value)  #", "        pass  #"),),
        ("tests/test_loader_inputs.py::test_a_torch_device_is_a_device_as_in_accelerate",),
        "a torch.device in a device map (as accelerate takes it) is refused",
    ),
    Mutant(
        "negative-zero-read-as-zero",
        "shardsync/strict_json.py",
        (("parse_int=_integer", "parse_int=int"),),
        ("tests/test_safetensors_header.py::test_negative_zero_is_what_safetensors_refuses_too",),
        "a header with -0 (a float to safetensors, which refuses the file) is loaded",
    ),
    Mutant(
        "accelerate-models-taken-for-steps",
        "shardsync/training.py",
        (("len(numbers) > 1 and len({frozenset(n) for n in numbers.values()}) == 1", "False"),),
        ("tests/test_training.py::test_accelerates_save_state_folders_are_one_checkpoint_each",),
        "accelerate's second model's DCP folder is taken for a step: a torn step's part is chosen",
    ),
    Mutant(
        "dcp-run-taken-for-trainer",
        "shardsync/training.py",
        (("    if trainer and (not dcp or any(", "    if trainer and (True or any("),),
        ("tests/test_training.py::test_a_dcp_run_saved_in_checkpoint_n_folders_is_a_dcp_run",),
        "a DCP run saved in checkpoint-N/ folders is refused as a Trainer run without its state",
    ),
    Mutant(
        "pointer-not-pinned",
        "shardsync/checkpoint_selection.py",
        (
            (
                "    return replace(entry, sha256=hashlib.sha256(read).hexdigest())",
                "    return entry",
            ),
        ),
        (
            "tests/test_training.py::test_a_pointer_saved_again_during_the_fetch_is_no_checkpoint_fetched",
        ),
        "a pointer saved again after the choice lands naming a checkpoint that was not fetched",
    ),
    Mutant(
        "local-copy-sha256-unchecked",
        "shardsync/origins/local.py",
        (("if entry.sha256 is not None and fetched.sha256 != entry.sha256:", "if False:"),),
        (
            "tests/test_training.py::test_a_pointer_saved_again_during_the_fetch_is_no_checkpoint_fetched",
        ),
        "a local file copied with other bytes than the sha256 it was chosen by is published",
    ),
    Mutant(
        "weak-etags-not-compared",
        "shardsync/fetch/answers.py",
        (("    tag = opaque_tag(etag)\n", "    tag = etag if is_strong_etag(etag) else None\n"),),
        (
            "tests/adversarial/test_hostile_server.py::test_an_object_replaced_under_weak_etags_is_never_published_mixed",
        ),
        "an object replaced under weak ETags mid-download is published as a mix of both",
    ),
    Mutant(
        "aiohttp-throttle-counted-as-stall",
        "shardsync/fetch/body_aiohttp.py",
        (
            (
                "        watchdog = Watchdog(lambda: self._clock() - held, cfg)",
                "        watchdog = Watchdog(self._clock, cfg)",
            ),
        ),
        ("tests/test_fetch.py::test_a_throttle_hold_longer_than_the_timeouts_times_nothing_out",),
        "on aiohttp's body path the throttle's pauses count as a slow server: a cap is a stall",
    ),
    Mutant(
        "size-probe-not-retried",
        "shardsync/fetch/fetcher.py",
        (
            (
                "        return await self._retried(label, once)\n\n    def _open_body",
                "        return await once()\n\n    def _open_body",
            ),
        ),
        ("tests/test_fetch.py::test_the_size_probe_is_retried_as_every_request_of_a_file",),
        "one 503 to the one-byte GET that learns a file's size ends the file",
    ),
    Mutant(
        "url-credentials-kept",
        "shardsync/origins/http.py",
        (
            (
                "        if parts.username is not None or parts.password is not None:",
                "        if False:",
            ),
        ),
        (
            "tests/test_origin_listings.py::test_a_url_source_that_cannot_be_one_is_refused_as_such",
            "tests/test_daemon.py::test_malformed_requests_get_4xx_with_a_message",
        ),
        "a password in a base URL is kept in outputs, job lists and the cache's folder names",
    ),
    Mutant(
        "bad-url-a-traceback",
        "shardsync/origins/http.py",
        (("        except ValueError as exc:  #", "        except ZeroDivisionError as exc:  #"),),
        (
            "tests/test_origin_listings.py::test_a_url_source_that_cannot_be_one_is_refused_as_such",
            "tests/test_daemon.py::test_malformed_requests_get_4xx_with_a_message",
        ),
        "a URL that does not parse is a traceback (exit 1) and the daemon's 500",
    ),
    Mutant(
        "huge-index-fetched",
        "shardsync/manifest.py",
        (("and (weights.size or 0) > MAX_JSON_BYTES:", "and False:"),),
        ("tests/test_prefetch.py::test_an_index_larger_than_any_is_refused_before_a_byte_of_it",),
        "an index listed as over 64 MiB is downloaded, stored and linked before it is refused",
    ),
    Mutant(
        "gate-cancel-race",
        "shardsync/limits.py",
        (("                elif waiter in self._waiters:  #", "                else:  #"),),
        ("tests/test_scheduler.py::test_a_waiter_cancelled_as_a_slot_frees_stays_a_cancel",),
        "a job cancelled as its file's slot frees fails as 'internal' and leaves the journal",
    ),
    Mutant(
        "follower-revision-borrowed",
        "shardsync/scheduler.py",
        (
            (
                "job.result = replace(other.result, revision=job.revision)",
                "job.result = other.result",
            ),
        ),
        ("tests/test_scheduler.py::test_a_revision_naming_a_running_commit_follows_that_job",),
        "a job that follows another reports the other job's revision",
    ),
    Mutant(
        "journal-written-whole",
        "shardsync/journal.py",
        (("            if len(data) <= _MAX_SIZE or not kept:", "            if True:"),),
        ("tests/test_scheduler.py::test_a_journal_too_large_to_load_is_never_written",),
        "a journal past what load reads is written whole, set aside at restart: no job resumes",
    ),
    Mutant(
        "unsafe-names-shorten-the-cut",
        "shardsync/manifest.py",
        (
            (
                "cut = cut_at is not None and len(siblings) >= cut_at",
                "cut = cut_at is not None and len(files) >= cut_at",
            ),
        ),
        ("tests/test_fetch.py::test_a_large_repo_is_listed_through_the_paginated_tree",),
        "1000 siblings with one unsafe name are taken for a whole list: the weights past it hide",
    ),
    Mutant(
        "upload-waits-on-a-hung-tier",
        "shardsync/tier.py",
        (("within=self._allowed(upload.size),", "within=1e9,"),),
        ("tests/test_tier.py::test_a_tier_that_hangs_during_the_uploads_costs_seconds_at_the_end",),
        "a tier that takes the uploads and never answers holds the exit after the snapshot",
    ),
    Mutant(
        "tier-read-stalls-for-minutes",
        "shardsync/tier.py",
        (
            (
                "            async with asyncio.timeout(within):  # not the origin's",
                "            async with asyncio.timeout(None):  # not the origin's",
            ),
        ),
        (
            "tests/test_tier.py::test_a_tier_stalling_mid_read_costs_seconds_not_the_origins_retries",
        ),
        "a tier read that stalls after its head runs the origin's retries: minutes per file",
    ),
    Mutant(
        "seeded-mismatch-retried-quietly",
        "shardsync/tier.py",
        (("from_origin(counted, lead, seeded > 0)", "from_origin(counted, lead, False)"),),
        (
            "tests/test_tier_parts.py::test_a_corrupt_part_costs_one_download_and_never_a_wrong_blob",
        ),
        "with the shipped verify attempts a corrupt tier part stays for the next taker to seed",
    ),
    Mutant(
        "head-drips-for-ever",
        "shardsync/fetch/wire.py",
        (("    deadline = time.monotonic() + timeout", "    deadline = time.monotonic() + 1e9"),),
        ("tests/test_wire.py::test_a_head_that_drips_in_times_out_as_a_whole",),
        "a response head dripped a byte at a time gets a read timeout per byte",
    ),
    Mutant(
        "cancel-waits-for-the-head",
        "shardsync/fetch/body_wire.py",
        (("request.abort()  # a head still coming", "pass  # a head still coming"),),
        ("tests/test_wire.py::test_a_cancel_stops_a_request_whose_head_drips_in",),
        "a cancel waits for a request whose head is still coming",
    ),
    Mutant(
        "short-206-waits-its-tail",
        "shardsync/fetch/pump.py",
        (
            (
                "    left = min(t.end - t.pos, t.end if body is None else body)"
                " - t.stream.buffered_bytes()",
                "    left = t.end - t.pos - t.stream.buffered_bytes()",
            ),
        ),
        ("tests/test_wire.py::test_an_honest_short_206_is_read_to_its_end_without_a_wait",),
        "an honest short 206 waits a read timeout for its last bytes",
    ),
    Mutant(
        "relocations-spend-the-budget",
        "shardsync/fetch/fetcher.py",
        (
            (
                'if cause == "relocate" and tally.downloaded - landed >= self.config.read_size:',
                "if False:",
            ),
        ),
        (
            "tests/test_expiring_urls.py::test_relocations_that_each_make_progress_never_run_out_of_attempts",
        ),
        "a long file whose URL expires again and again runs out of attempts, each landing bytes",
    ),
    Mutant(
        "hold-counts-as-silence",
        "shardsync/fetch/pump.py",
        (("                    other.last = self._clock()", "                    pass"),),
        ("tests/test_fetch.py::test_a_throttle_hold_longer_than_the_timeouts_times_nothing_out",),
        "a throttle's hold times out the file's connections",
    ),
    Mutant(
        "hold-counts-as-slowness",
        "shardsync/fetch/body_wire.py",
        (
            (
                "watchdog = Watchdog(lambda: self._clock() - pump.held, self._config)",
                "watchdog = Watchdog(self._clock, self._config)",
            ),
        ),
        ("tests/test_fetch.py::test_a_throttle_hold_longer_than_the_timeouts_times_nothing_out",),
        "a throttle's hold counts against the connections' minimum throughput",
    ),
    Mutant(
        "ctime-ignored",
        "shardsync/origins/local.py",
        (('{st.st_mtime_ns}-{st.st_ctime_ns}"', '{st.st_mtime_ns}"'),),
        (
            "tests/test_origin_listings.py::test_local_file_rewritten_in_place_with_its_mtime_kept_is_fetched_again",
        ),
        "a local file rewritten in place with its mtime restored: its old bytes from the cache",
    ),
    Mutant(
        "odd-hub-name-refuses-all",
        "shardsync/manifest.py",
        (("    if isinstance(name, str) and not is_safe_name(name):", "    if False:"),),
        (
            "tests/test_origin_listings.py::test_hub_files_with_unsafe_names_are_left_out_and_never_requested",
            "tests/test_manifest.py::test_hub_listing_entries_with_unsafe_names_are_left_out",
        ),
        "one oddly named file in a Hub repo refuses the whole repo",
    ),
    Mutant(
        "odd-local-name-refuses-all",
        "shardsync/origins/local.py",
        (
            (
                "                if not is_safe_name(rel):",
                "                if not validate_name(rel):",
            ),
        ),
        ("tests/test_origin_listings.py::test_local_files_with_unsafe_names_are_left_out",),
        "one oddly named file in a folder refuses the whole folder",
    ),
    Mutant(
        "odd-s3-key-refuses-all",
        "shardsync/origins/s3.py",
        (("unsafe.append(rel)  # never a path, nor a key we ask for", "validate_name(rel)"),),
        (
            "tests/test_origin_listings.py::test_s3_keys_with_unsafe_names_are_left_out_and_never_requested",
        ),
        "one oddly named key under an S3 prefix refuses the whole prefix",
    ),
    Mutant(
        "link-out-followed",
        "shardsync/origins/local.py",
        (
            (
                "                if not full.resolve().is_relative_to(self.root):",
                "                if False:",
            ),
        ),
        ("tests/test_origin_listings.py::test_a_link_out_of_the_directory_is_left_out",),
        "a symlink out of a local folder is listed and fails the job",
    ),
    Mutant(
        "vanished-file-escapes",
        "shardsync/origins/local.py",
        (
            (
                "if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):",
                "if exc.errno in (errno.ENOTDIR, errno.ELOOP):",
            ),
        ),
        (
            "tests/test_origin_listings.py::test_a_local_listing_while_files_come_and_go_lists_what_stays",
        ),
        "a file gone while a folder is listed ends the job in a bare FileNotFoundError",
    ),
    Mutant(
        "refused-probe-refuses-all",
        "shardsync/origins/http.py",
        (
            (
                "        if refused and not any(f.path in WEIGHT_FILES for f in files):",
                "        if refused:",
            ),
        ),
        (
            "tests/test_origin_listings.py::test_a_server_that_refuses_absent_files_still_serves_the_checkpoint",
        ),
        "a plain URL server answering 403 for absent files refuses the checkpoint",
    ),
    Mutant(
        "missing-blob-twice",
        "shardsync/verify.py",
        (("problems=tuple(one.values()),", "problems=tuple(problems),"),),
        ("tests/test_verify.py::test_a_blob_gone_from_the_store_and_the_repo_view_is_one_problem",),
        "verify reports one missing blob twice",
    ),
    Mutant(
        "pickle-not-probed",
        "shardsync/origins/http.py",
        (
            (
                '    "pytorch_model.bin.index.json",'
                "  # pickle: listed, refused unless allow_pickle\n",
                "",
            ),
        ),
        ("tests/test_origin_listings.py::test_a_pickle_checkpoint_from_a_plain_url",),
        "a pickle checkpoint at a plain URL is never found",
    ),
    Mutant(
        "planned-shard-never-verified",
        "shardsync/loader.py",
        (
            (
                "            if self._done:  # the job's files",
                "            if False:  # the job's files",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_a_prefix_resharded_between_the_daemons_plan_and_its_download_fails_the_load",
        ),
        "a load through a daemon waits for ever for shards the job never verifies",
    ),
    Mutant(
        "frozen-daemon-waited-for",
        "shardsync/daemon_transport.py",
        (
            (
                "exchange.idle_s = _STREAM_IDLE_S  # the stream has no end to wait for",
                "exchange.idle_s = None",
            ),
        ),
        ("tests/test_client.py::test_a_daemon_that_freezes_mid_stream_is_lost_not_waited_for",),
        "a client follows a frozen daemon's event stream for ever",
    ),
    Mutant(
        "long-socket-path-is-an-error",
        "shardsync/daemon_transport.py",
        (("if exc.errno in _NOT_THERE or too_long:", "if exc.errno in _NOT_THERE:"),),
        ("tests/test_client.py::test_a_socket_path_too_long_for_af_unix_is_no_daemon",),
        "a socket path too long for AF_UNIX fails the client instead of falling back",
    ),
    Mutant(
        "ctrl-c-leaves-the-call-running",
        "shardsync/client.py",
        (
            (
                "if not call.outcome.done():  # interrupted while it runs",
                "if False:  # interrupted while it runs",
            ),
        ),
        (
            "tests/test_client.py::test_ctrl_c_while_a_sync_client_iterates_is_a_keyboard_interrupt",
            "--tb=native",
        ),
        "Ctrl-C in a SyncClient iteration is a RuntimeError and leaves the stream open",
    ),
    Mutant(
        "close-leaves-waiters",
        "shardsync/client.py",
        (("calls = list(self._calls)", "calls = []"),),
        (
            "tests/test_client.py::test_closing_a_sync_client_ends_the_calls_other_threads_wait_in",
            "--tb=native",
        ),
        "SyncClient.close() leaves another thread's call waiting for ever",
    ),
    Mutant(
        "stop-outranks-cancel",
        "shardsync/scheduler.py",
        (
            (
                "if job.stop_error is None or isinstance(error, JobCancelledError):",
                "if job.stop_error is None:",
            ),
        ),
        (
            "tests/test_scheduler.py::test_a_cancel_while_the_daemon_stops_is_not_undone_by_the_restart",
        ),
        "a DELETE while the daemon stops is undone: the job resumes after the restart",
    ),
    Mutant(
        "interrupted-job-not-cancelled",
        "shardsync/scheduler.py",
        (('if job.state == "interrupted":  # by a stop', "if False:  # by a stop"),),
        (
            "tests/test_scheduler.py::test_a_cancel_while_the_daemon_stops_is_not_undone_by_the_restart",
        ),
        "a DELETE of an interrupted job answers 200 and the job resumes",
    ),
    Mutant(
        "stream-ends-short",
        "shardsync/jobs.py",
        (("if following != count:", "if False:"),),
        (
            "tests/test_client.py::test_shards_of_a_stream_that_skips_repeats_or_invents_one_are_a_daemon_error",
        ),
        "shards() ends quietly with shards never handed out",
    ),
    Mutant(
        "shard-index-trusted",
        "shardsync/jobs.py",
        (("if not 0 <= index < count or index < following or index in ready:", "if False:"),),
        (
            "tests/test_client.py::test_shards_of_a_stream_that_skips_repeats_or_invents_one_are_a_daemon_error",
        ),
        "shards() takes a repeated or invented shard index",
    ),
    Mutant(
        "job-without-id",
        "shardsync/daemon_transport.py",
        (('if not isinstance(job.get("id"), str):', "if False:"),),
        ("tests/test_client.py::test_well_formed_answers_of_the_wrong_shape_are_daemon_errors",),
        "a daemon's job without an id is a KeyError",
    ),
    Mutant(
        "huge-event-time",
        "shardsync/events.py",
        (
            (
                "except OverflowError:  # an integer of hundreds of digits",
                "except ZeroDivisionError:",
            ),
        ),
        ("tests/test_events.py::test_a_time_too_large_for_a_float_is_a_daemon_error",),
        "an event time too large for a float is an OverflowError",
    ),
    Mutant(
        "deep-journal-stops-the-daemon",
        "shardsync/journal.py",
        (("UnicodeDecodeError, RecursionError) as exc:", "UnicodeDecodeError) as exc:"),),
        ("tests/test_scheduler.py::test_a_journal_nested_too_deep_to_read_is_set_aside",),
        "a journal nested too deep to read keeps the daemon from starting",
    ),
    Mutant(
        "impossible-priority-stops-the-daemon",
        "shardsync/scheduler.py",
        (("ValueError, OverflowError) as exc:", "ValueError) as exc:"),),
        (
            "tests/test_scheduler.py::test_a_journaled_job_with_an_impossible_number_is_dropped_alone",
        ),
        "a journaled job of priority 1e400 keeps the daemon from starting",
    ),
    Mutant(
        "follower-logs-twice",
        "shardsync/scheduler.py",
        (("if not self.counters.repeats(event):", "if True:"),),
        (
            "tests/test_scheduler.py::test_a_follower_logs_each_file_once_and_gives_its_clients_back",
        ),
        "a job that followed another counts and reports its files twice",
    ),
    Mutant(
        "follower-keeps-clients",
        "shardsync/scheduler.py",
        (("other.clients -= lent", "pass"),),
        (
            "tests/test_scheduler.py::test_a_follower_logs_each_file_once_and_gives_its_clients_back",
        ),
        "a followed job keeps the follower's clients after it ends",
    ),
    Mutant(
        "result-overflow-escapes",
        "shardsync/api.py",
        (("ValueError, OverflowError) as exc:  # int(1e400): inf", "ValueError) as exc:"),),
        ("tests/test_events.py::test_a_result_number_too_large_for_an_int_is_a_daemon_error",),
        "a job result with a size of 1e400 from a daemon is an OverflowError",
    ),
    Mutant(
        "event-log-keeps-every-step",
        "shardsync/job_log.py",
        (("                del self._events[old]", "                pass"),),
        ("tests/test_scheduler.py::test_the_event_log_of_a_long_download_holds_what_is_live",),
        "a job's event log keeps every progress step of a day-long download",
    ),
    Mutant(
        "daemon-stop-keeps-holds",
        "shardsync/daemon.py",
        (
            ("        for lease in self._holds:\n            lease.release()\n", "        pass\n"),
            (
                "            self._holds.discard(lease)\n            lease.release()\n",
                "            self._holds.discard(lease)\n",
            ),
        ),
        ("tests/test_daemon.py::test_a_lease_the_daemon_holds_ends_when_the_daemon_stops",),
        "a daemon that stops leaves the leases of its open lease requests",
    ),
    Mutant(
        "endpoint-keeps-credentials",
        "shardsync/config.py",
        (("        or parts.username is not None\n        or parts.password is not None\n", ""),),
        (
            "tests/test_config.py::test_a_hub_endpoint_with_credentials_is_refused_without_echoing_them",
        ),
        "a Hub or S3 endpoint with user:password@ is accepted and reported by status",
    ),
    Mutant(
        "client-trusts-any-socket",
        "shardsync/jobs.py",
        (("                doubt = socket_doubt(path)\n", "                doubt = None\n"),),
        ("tests/test_client.py::test_a_socket_other_users_could_have_planted_is_not_used",),
        "a client uses a daemon socket in a directory other users may write",
    ),
    Mutant(
        "pickle-always-mapped",
        "shardsync/placement.py",
        (("mmap=zipfile.is_zipfile(file)", "mmap=True"),),
        (
            "tests/test_loader.py::test_pickle_checkpoints_in_the_pre_zip_format_load_and_bad_names_are_refused",
        ),
        "a pre-zip pytorch_model.bin is read with mmap, which refuses it",
    ),
    Mutant(
        "pickle-names-unchecked",
        "shardsync/placement.py",
        (("            if not is_module_path(name):\n", "            if False:\n"),),
        (
            "tests/test_loader.py::test_pickle_checkpoints_in_the_pre_zip_format_load_and_bad_names_are_refused",
        ),
        "a pickle state dict key that is no module path escapes as a ValueError",
    ),
    Mutant(
        "dcp-fields-assumed",
        "shardsync/dcp_metadata.py",
        (
            (
                '        getattr(metadata, "state_dict_metadata", None), dict',
                "        metadata.state_dict_metadata, dict",
            ),
        ),
        ("tests/test_training.py::test_hostile_dcp_metadata_is_refused_without_running_it",),
        "a DCP .metadata whose Metadata lacks a field is an AttributeError",
    ),
    Mutant(
        "temp-owner-by-pid-alone",
        "shardsync/layout.py",
        (
            (
                '    start = None if found["start"] is None else int(found["start"])\n',
                "    start = None\n",
            ),
        ),
        ("tests/test_cache.py::test_sweep_orphans_removes_only_dead_writers_of_this_host",),
        "a tmp/ name is judged live by its pid alone: a restart as the same pid never resumes",
    ),
    Mutant(
        "resume-bound-to-url",
        "shardsync/slot.py",
        (
            (
                '                        (what.sha256 is not None or raw.get("url") == what.url)\n',
                '                        raw.get("url") == what.url\n',
            ),
        ),
        (
            "tests/adversarial/test_kill_cost.py::test_a_kill_at_40_percent_loses_only_what_was_in_flight",
        ),
        "a partial whose sha256 is known resumes only under the same URL",
    ),
    Mutant(
        "resume-bound-to-device",
        "shardsync/slot.py",
        (
            (
                "len(inode) == 2 and inode[1] == st.st_ino\n",
                "len(inode) == 2 and inode == [st.st_dev, st.st_ino]\n",
            ),
        ),
        ("tests/test_slot.py::test_a_partial_resumes_after_a_reboot_renumbered_its_device",),
        "a resume record must name the partial's device number, which a reboot may change",
    ),
    Mutant(
        "daemon-chowns-always",
        "shardsync/listeners.py",
        (
            (
                "    if group is not None and os.lstat(path).st_gid != group:\n",
                "    if group is not None:\n",
            ),
        ),
        ("tests/test_systemd.py::test_the_daemon_serves_under_the_units_system_call_filter",),
        "the daemon chowns its socket to daemon.group it already has, which the unit forbids",
    ),
    Mutant(
        "unit-cache-directory-ignored",
        "shardsync/config.py",
        (("    if unit:\n        return Path(unit)\n", ""),),
        ("tests/test_systemd.py::test_a_cache_dir_in_the_config_is_the_units_cache",),
        "the units' cache comes from an Environment= that overrides cache.dir",
    ),
    Mutant(
        "pin-slash-counts",
        "shardsync/prune_plan.py",
        (('fnmatchcase(name.rstrip("/"), p.rstrip("/"))', "fnmatchcase(name, p)"),),
        ("tests/test_prune.py::test_keep_and_pin_match_a_source_as_it_was_typed",),
        "a pin or --keep matches a source only with its stored trailing slash",
    ),
    Mutant(
        "keep-relative-path-unresolved",
        "shardsync/cli.py",
        (("    return str(Path(pattern).expanduser().resolve())\n", "    return pattern\n"),),
        ("tests/test_prune.py::test_keep_and_pin_match_a_source_as_it_was_typed",),
        "--keep origin/b/ spares nothing of the directory prefetched by that spelling",
    ),
    Mutant(
        "prune-flag-unnamed",
        "shardsync/cli.py",
        (('_flag_size("--max-size", args.max_size)', "parse_size(args.max_size)"),),
        ("tests/test_prune.py::test_cli_json_shape_and_exit_codes",),
        "a bad prune --max-size is refused without naming the flag",
    ),
    Mutant(
        "verify-trusts-copied-links",
        "shardsync/verify.py",
        (
            (
                "    if (seen.st_dev, seen.st_ino) != (verified.st_dev, verified.st_ino):\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/test_verify.py::test_a_cache_copied_without_its_hard_links_is_checked_where_readers_read",
        ),
        "verify passes a snapshot whose repo blobs are copies, not the store's hashed file",
    ),
    Mutant(
        "complete-with-copied-blobs",
        "shardsync/cache.py",
        (
            (
                "            if (st.st_dev, st.st_ino) != (blob.st_dev, blob.st_ino):\n",
                "            if False:\n",
            ),
        ),
        (
            "tests/test_verify.py::test_a_cache_copied_without_its_hard_links_is_checked_where_readers_read",
        ),
        "a snapshot whose repo blobs are copies counts as complete",
    ),
    Mutant(
        "every-gpu-asked",
        "shardsync/loader.py",
        (
            (
                "find_devices(self._request.max_memory, automatic=automatic)",
                "find_devices(self._request.max_memory, automatic=True)",
            ),
        ),
        (
            "tests/test_loader_inputs.py::test_a_map_that_names_its_devices_asks_no_gpu_for_its_free_memory",
        ),
        'a device_map="cpu" load asks every GPU for its free memory, a CUDA context each',
    ),
    Mutant(
        "sync-client-drops-rank",
        "shardsync/client.py",
        (("                rank=rank,\n", ""),),
        ("tests/test_training.py::test_the_sync_client_fetches_one_ranks_checkpoint",),
        "SyncClient.prefetch drops rank and world_size: every rank's files come",
    ),
    Mutant(
        "in-process-status-short",
        "shardsync/client.py",
        (('            "jobs_submitted": stats.jobs_submitted,\n', ""),),
        ("tests/test_client.py::test_sync_client_in_process",),
        "an in-process status lacks the job counters a daemon's reports",
    ),
    Mutant(
        "renewal-waits-forever",
        "shardsync/tier.py",
        (
            (
                "timeout(_ANSWER_S):  # a hung tier: the claim dies by its lease",
                "timeout(None):  # a hung tier: the claim dies by its lease",
            ),
        ),
        (
            "tests/test_tier.py::test_a_claim_renewal_the_tier_never_answers_is_given_up_and_renewals_go_on",
        ),
        "a claim renewal the tier never answers is waited on for ever: no renewal follows",
    ),
    Mutant(
        "transfer-coding-kept",
        "shardsync/fetch/answers.py",
        (('    if transfer not in ([""], ["chunked"]):\n', "    if False:\n"),),
        ("tests/adversarial/test_framing.py",),
        "a Transfer-Encoding: gzip, chunked answer is de-chunked and its gzip bytes written",
    ),
    Mutant(
        "success-status-is-a-crash",
        "shardsync/fetch/answers.py",
        (
            (
                "    if 200 <= status < 300:  # a success this request cannot use",
                "    if False:  # a success this request cannot use",
            ),
        ),
        ("tests/adversarial/test_hostile_server.py",),
        "a 202 answer to a Range GET is a ValueError traceback",
    ),
    Mutant(
        "bad-location-is-a-crash",
        "shardsync/fetch/answers.py",
        (
            (
                '        raise ProtocolError(f"a malformed URL from the server: ',
                '        raise\n        raise ProtocolError(f"a malformed URL from the server: ',
            ),
        ),
        ("tests/adversarial/test_hostile_server.py",),
        "a redirect to a port no URL can have is a ValueError traceback",
    ),
    Mutant(
        "route-flap-fatal",
        "shardsync/fetch/answers.py",
        (("    if isinstance(exc, OSError) and exc.errno in _ROUTE_GONE:\n", "    if False:\n"),),
        ("tests/test_wire.py::test_a_route_that_flaps_is_retried_on_the_pumps_path",),
        "EHOSTUNREACH on the pump's connection ends the file with no retry",
    ),
    Mutant(
        "api-trickle-unwatched",
        "shardsync/fetch/fetcher.py",
        (
            (
                "                        watchdog.count(len(piece))  # a trickle of small writes\n",
                "",
            ),
        ),
        ("tests/test_prefetch.py::test_an_api_answer_that_trickles_trips_the_watchdog",),
        "an API answer trickling in small writes is never given up on",
    ),
    Mutant(
        "load-token-to-daemon",
        "shardsync/loader.py",
        (
            (
                "    if origin.caller_only or request.token is not None:\n",
                "    if origin.caller_only:\n",
            ),
        ),
        ("tests/test_loader.py::test_a_token_given_to_a_load_is_used_though_a_daemon_answers",),
        "a load's token= is dropped whenever a daemon answers",
    ),
    Mutant(
        "empty-pointer-blocks-name",
        "shardsync/training.py",
        (
            (
                "        target = None  # one asked by name is fetched without a pointer",
                "        raise  # one asked by name is fetched without a pointer",
            ),
        ),
        (
            "tests/test_training.py::test_a_pointer_being_rewritten_leaves_a_checkpoint_named_to_be_fetched",
        ),
        "an empty DeepSpeed latest or Megatron tracker blocks a checkpoint asked for by name",
    ),
    Mutant(
        "lone-part-is-a-step",
        "shardsync/training.py",
        (("and posixpath.basename(d) in parts.get(posixpath.dirname(p), ())", "and False"),),
        ("tests/test_training.py::test_a_save_state_checkpoint_still_missing_a_part_is_torn",),
        "a save_state checkpoint with its model's DCP folder alone is chosen as latest",
    ),
    Mutant(
        "tied-name-missing",
        "shardsync/placement.py",
        (
            (
                "        return names | {a for n in names & aliases.keys() for a in aliases[n]}\n",
                "        return names\n",
            ),
        ),
        ("tests/test_loader.py::test_tied_weights_saved_once_fill_both_names_and_stay_tied",),
        "a tied weight saved once leaves its other name missing (strict refuses the load)",
    ),
    Mutant(
        "tie-broken-by-assign",
        "shardsync/placement.py",
        (
            (
                "            setattr(model.get_submodule(owner), leaf, parameter)\n",
                "            pass\n",
            ),
        ),
        ("tests/test_loader.py::test_tied_weights_saved_once_fill_both_names_and_stay_tied",),
        "assign=True gives each name of a tied weight a parameter of its own",
    ),
    Mutant(
        "blocks-in-text-order",
        "shardsync/devicemap.py",
        (
            (
                "        groups = _in_block_order(list(group_sizes))\n",
                "        groups = list(group_sizes)\n",
            ),
        ),
        (
            "tests/test_devicemap.py::test_blocks_fill_devices_in_their_numbers_order_whatever_the_index_order",
        ),
        "blocks fill devices in the index's text order (layers.10 before layers.2)",
    ),
    Mutant(
        "blip-drops-promised-upload",
        "shardsync/tier.py",
        (
            (
                "not self._usable() and (upload.claim is None or upload.claim.lost):",
                "not self._usable():",
            ),
        ),
        ("tests/test_tier.py::test_a_blip_at_the_holder_still_serves_its_waiters_from_the_tier",),
        "a holder that saw the tier blip gives up the upload its renewed claim promises",
    ),
    Mutant(
        "resumed-mismatch-blames-origin",
        "shardsync/fetch/fetcher.py",
        (("partials = bool(tally.resumed) and not request.seeded", "partials = False"),),
        (
            "tests/test_tier_parts.py::test_a_wrong_seeded_partial_never_costs_the_tier_a_good_object",
        ),
        "a mismatch after a resume is the origin's: a wrong seed deletes a good tier object",
    ),
    Mutant(
        "seeded-mismatch-forgiven",
        "shardsync/fetch/fetcher.py",
        (
            (
                "partials = bool(tally.resumed) and not request.seeded",
                "partials = bool(tally.resumed)",
            ),
        ),
        (
            "tests/test_tier_parts.py::test_a_corrupt_part_costs_one_download_and_never_a_wrong_blob",
        ),
        "a mismatch after seeding from the tier's parts is retried afresh: the bad parts stay",
    ),
    Mutant(
        "quarantined-snapshot-stale",
        "shardsync/prune.py",
        (("complete=s.recorded,  # once", "complete=s.complete,  # once"),),
        (
            "tests/test_prune.py::test_a_quarantined_snapshot_waits_for_its_prefetch_not_for_a_prune",
        ),
        "a snapshot verify quarantined a shard of is pruned a day later as an abandoned download",
    ),
    Mutant(
        "hf-snapshot-taken-for-ours",
        "shardsync/inventory.py",
        (
            (
                "foreign_here or linked or (record is None and commit in refs)",
                "foreign_here or linked",
            ),
        ),
        (
            "tests/test_prune.py::test_a_snapshot_huggingface_hub_made_from_our_blobs_is_not_ours_to_prune",
        ),
        "a snapshot huggingface_hub made from our blobs is pruned as stale, with its ref",
    ),
    Mutant(
        "any-plain-name-is-junk",
        "shardsync/layout.py",
        (
            ("return temp_purpose(name) in TEMP_BECOMES", 'return "/" not in name'),
            ("and _QUARANTINED_RE.fullmatch(name) is not None", 'and "/" not in name'),
        ),
        ("tests/test_prune.py::test_what_shardsync_did_not_make_a_prune_leaves_and_still_prunes",),
        "any plain name in tmp/ or quarantine/ is taken for shardsync's and removed",
    ),
    Mutant(
        "symlinked-repo-is-ours",
        "shardsync/inventory.py",
        (("linked = os.path.islink(repo_dir)", "linked = False"),),
        (
            "tests/test_prune.py::test_a_repo_folder_symlinked_from_elsewhere_is_left_and_the_rest_pruned",
        ),
        "a repo folder linked back from another disk is evicted: every prune stops there, exit 9",
    ),
    Mutant(
        "ls-pins-as-written",
        "shardsync/cli.py",
        (
            (
                "config), pin=tuple(_as_stored(p) for p in config.prune.pin)",
                "config), pin=config.prune.pin",
            ),
        ),
        ("tests/test_prune.py::test_keep_and_pin_match_a_source_as_it_was_typed",),
        "ls matches prune.pin as written: a directory prune spares is listed as not pinned",
    ),
    Mutant(
        "content-length-digits-unbounded",
        "shardsync/fetch/wire.py",
        (("if length is not None and len(length) > 19:", "if False:"),),
        ("tests/test_wire.py::test_a_malformed_head_is_a_protocol_error",),
        "a Content-Length of 5000 digits is parsed: Python int limit ValueError, a traceback",
    ),
    Mutant(
        "block-number-digits-unbounded",
        "shardsync/devicemap.py",
        ((" and len(tail) <= 18):", "):"),),
        ("tests/test_devicemap.py::test_a_block_number_past_any_model_is_a_name_not_a_crash",),
        "a tensor named layers.<5000 digits> ends device planning in a ValueError traceback",
    ),
    Mutant(
        "listed-size-unbounded",
        "shardsync/manifest.py",
        (("    if value > MAX_FILE_SIZE:\n", "    if False:\n"),),
        (
            "tests/test_manifest.py",
            "tests/adversarial/test_hostile_server.py::test_a_size_past_any_file_is_the_origins_lie_not_the_caches",
        ),
        "a listed size of 2**63 reaches ftruncate: OverflowError, a traceback",
    ),
    Mutant(
        "probed-size-unbounded",
        "shardsync/fetch/transfer.py",
        (("if size > MAX_FILE_SIZE:", "if False:"),),
        ("tests/test_fetch.py::test_a_probed_size_past_any_file_is_the_origins_lie",),
        "a probed Content-Range total of 10**19 - 1 reaches ftruncate: OverflowError",
    ),
    Mutant(
        "tree-pages-go-round",
        "shardsync/origins/hub.py",
        (("if page in seen or len(files)", "if len(files)"),),
        ("tests/test_fetch.py::test_a_tree_listing_that_goes_round_is_refused_at_once",),
        "a tree page linking back to a read one is read again: memory grows for 10 000 pages",
    ),
    Mutant(
        "s3-prefix-empty-segment",
        "shardsync/names.py",
        (('    if "" in parts:  # S3 keys', "    if False:  # S3 keys"),),
        ("tests/test_s3_origin.py::test_hostile_s3_urls_are_refused_before_any_request",),
        "s3://b/runs//llama/ is read as s3://b/runs/llama/: another prefix, maybe another model",
    ),
    Mutant(
        "attributes-without-etag-replaced",
        "shardsync/s3.py",
        (("if said is not None and _unquoted(str(said))", "if _unquoted(str(said))"),),
        ("tests/test_s3_parts.py::test_attributes_a_store_lies_in_are_asked_of_the_parts",),
        "attributes without the ETag asked for read as a replaced object, three times",
    ),
    Mutant(
        "attribute-pages-forever",
        "shardsync/s3.py",
        (
            (
                "for _ in range(-(-parts // 1000) + 1):  # pages of 1000 parts, and one to spare",
                "while True:",
            ),
            ("if following <= marker:", "if False:"),
        ),
        ("tests/test_s3_parts.py::test_attributes_a_store_lies_in_are_asked_of_the_parts",),
        "a truncated attributes page that lists nothing and does not move on is asked for ever",
    ),
    Mutant(
        "unreadable-checksum-tofu",
        "shardsync/checksums.py",
        (("    if unreadable:\n", "    if False:\n"),),
        (
            "tests/test_checksums.py",
            "tests/test_s3_parts.py::test_a_checksum_the_store_answers_unreadably_is_its_error_not_tofu",
        ),
        "a checksum the store answers mangled is taken for none: verified=tofu, nothing checked",
    ),
    Mutant(
        "killed-prune-orphans-wait-a-day",
        "shardsync/prune_plan.py",
        (("    if unmet():  # before any snapshot", "    if False:  # before any snapshot"),),
        (
            "tests/test_prune.py::test_plan",
            "tests/test_prune.py::test_a_prune_killed_before_its_blobs_leaves_the_next_one_the_same_choice",
        ),
        "blobs a killed prune left unlinked wait a day while the next prune evicts the last used",
    ),
    Mutant(
        "notify-blocks-the-loop",
        "shardsync/notify.py",
        (
            (
                "        return self.send(wait=0.0, STATUS=status)",
                "        return self.send(wait=None, STATUS=status)  # type: ignore[arg-type]",
            ),
            ("                sock.settimeout(wait)\n", ""),
        ),
        (
            "tests/test_daemon.py::test_a_service_manager_that_reads_nothing_holds_no_job_and_no_stop",
        ),
        "a status line to a manager that reads nothing blocks the loop: jobs, status and SIGTERM",
    ),
    Mutant(
        "plan-at-stored-dtype",
        "shardsync/placement.py",
        (
            (
                "sizes.append(TensorSize(info.name, nbytes))",
                "sizes.append(TensorSize(info.name, info.nbytes))",
            ),
        ),
        (
            "tests/test_loader_inputs.py::test_max_memory_holds_the_tensors_at_the_dtype_they_are_cast_to",
        ),
        "max_memory is planned at the stored dtype: bf16 loaded as float32 takes twice the budget",
    ),
    Mutant(
        "vllm-options-beside-key",
        "shardsync/vllm_plugin.py",
        (("    if beside:  # else a source", "    if False:  # else a source"),),
        ("tests/test_loader_inputs.py::test_the_vllm_plugins_options_outside_its_key_are_refused",),
        "vLLM loader options beside the shardsync key are dropped: --model weights load instead",
    ),
    Mutant(
        "any-api-version-daemon",
        "shardsync/jobs.py",
        (('if self.daemon_status.get("api") != API_VERSION:', "if False:"),),
        ("tests/test_client.py::test_a_daemon_of_another_api_version_is_not_used",),
        "a daemon of another API version is used: jobs go in, results fail late as KeyError",
    ),
    Mutant(
        "last-job-sets-ref",
        "shardsync/cache.py",
        (("resolved_at < _mtime(path) <= time.time():", "False:"),),
        (
            "tests/test_prefetch.py::test_a_job_that_read_its_branch_first_and_ends_last_sets_no_branch_back",
        ),
        "the job that ends last writes refs/main, though another read the moved branch after it",
    ),
    Mutant(
        "unchecked-page-published",
        "shardsync/fetch/fetcher.py",
        (('if file.verified != "tofu" or not name.endswith(".safetensors"):', "if True:"),),
        (
            "tests/adversarial/test_hostile_server.py::test_a_page_served_as_a_shard_is_refused_unpublished_and_not_kept",
            "tests/test_origin_listings.py::test_a_local_shard_that_does_not_start_as_one_is_refused_unpublished",
        ),
        "a .safetensors nothing vouches for is published as served: a login page, an LFS pointer",
    ),
    Mutant(
        "refused-page-kept",
        "shardsync/fetch/fetcher.py",
        (("                self._slot.abandon()\n                raise", "                raise"),),
        (
            "tests/adversarial/test_hostile_server.py::test_a_page_served_as_a_shard_is_refused_unpublished_and_not_kept",
        ),
        "a file refused for its shape stays a resumable partial: the page's bytes are kept",
    ),
    Mutant(
        "shape-without-brace",
        "shardsync/safetensors_header.py",
        (('        if prefix[8:9] != b"{":', "        if False:"),),
        ("tests/test_safetensors_header.py",),
        "the shape check takes a header that does not open a JSON object",
    ),
    Mutant(
        "hub-client-at-import",
        "shardsync/origins/hub.py",
        (
            (
                "from shardsync.errors import ConfigError, ManifestError",
                "import huggingface_hub  # noqa: F401\n"
                "from shardsync.errors import ConfigError, ManifestError",
            ),
        ),
        ("tests/test_cli.py::test_a_prefetch_from_elsewhere_than_the_hub_imports_no_hub_client",),
        "huggingface_hub is imported with the origins: every non-Hub prefetch pays for it",
    ),
    Mutant(
        "s3-trusts-botocore-bundle-only",
        "shardsync/s3_botocore.py",
        (("                context.load_default_certs()\n", "                pass\n"),),
        ("tests/test_network.py::test_s3_requests_trust_the_systems_cas_as_the_fetcher_does",),
        "S3 requests trust botocore's bundle only, not the system store the fetcher trusts",
    ),
    Mutant(
        "follower-writes-no-ref",
        "shardsync/scheduler.py",
        (
            (
                "            await job.engine_job.adopt()\n",
                "            pass\n",
            ),
        ),
        (
            "tests/test_scheduler.py::test_a_follower_at_another_revision_names_the_snapshot_by_it_too",
        ),
        "a job that followed another to the same commit writes no ref for its own revision",
    ),
    Mutant(
        "full-disk-publish-drops-partial",
        "shardsync/slot.py",
        (
            (
                "            if self._private is not None and os.path.lexists(self._private):",
                "            if False:",
            ),
        ),
        (
            "tests/test_slot.py::test_a_full_disk_while_publishing_keeps_the_verified_download_to_resume",
        ),
        "a full disk while publishing deletes the verified download that its error says is kept",
    ),
    Mutant(
        "shape-by-link-target",
        "shardsync/fetch/fetcher.py",
        (
            (
                "        return await self._shaped(file, name)",
                "        return await self._shaped(file, source.name)",
            ),
        ),
        (
            "tests/test_origin_listings.py::test_a_local_shard_that_does_not_start_as_one_is_refused_unpublished",
        ),
        "a local shard's shape is checked by its link target's name: a hash-named target skips it",
    ),
    Mutant(
        "userinfo-cut-at-first-slash",
        "shardsync/errors.py",
        (
            (
                '        elif "@" in rest and not _PORT.fullmatch(authority.partition(":")[2]):',
                "        elif False:",
            ),
        ),
        (
            "tests/adversarial/test_secrets_sweep.py::test_redact_keeps_the_words_and_drops_the_credentials",
        ),
        "a URL's userinfo is cut where urlsplit ends it: a password with '/', '?' or '#' is shown",
    ),
    Mutant(
        "proxy-url-path-taken",
        "shardsync/network.py",
        (
            (
                '        if parts.path not in ("", "/") or parts.query or parts.fragment:',
                "        if False:",
            ),
        ),
        (
            "tests/test_network.py::test_a_proxy_password_not_percent_encoded_is_refused_and_never_shown",
        ),
        "a proxy URL with a path is taken: a numeric password makes a proxy of the user name",
    ),
    Mutant(
        "redirect-userinfo-followed",
        "shardsync/fetch/answers.py",
        (('    if "@" in parts.netloc:  # credentials', "    if False:  # credentials"),),
        ("tests/test_fetch.py::test_dangerous_redirects_are_refused",),
        "a redirect whose Location carries user:password@ is followed with our Authorization",
    ),
    Mutant(
        "s3-407-store-error",
        "shardsync/s3.py",
        (
            (
                "    if status == 407:  # a proxy's answer",
                "    if False:  # a proxy's answer",
            ),
        ),
        (
            "tests/test_network.py::test_a_proxy_asking_for_credentials_of_s3_requests_is_one_auth_error",
        ),
        "a proxy's 407 to an S3 request on an http endpoint is the store's error (exit 6)",
    ),
    Mutant(
        "s3-connect-407-unreachable",
        "shardsync/s3.py",
        (
            (
                'and _status_of(exc.kwargs.get("error")) == 407:',
                "and False:",
            ),
        ),
        (
            "tests/test_network.py::test_a_proxy_asking_for_credentials_of_s3_requests_is_one_auth_error",
        ),
        "a proxy refusing CONNECT with 407 for an https S3 endpoint reads as an unreachable store",
    ),
    Mutant(
        "s3-proxy-for-a-guessed-endpoint",
        "shardsync/s3_botocore.py",
        (
            (
                "            proxy = network.proxy_for(url)",
                '            proxy = network.proxy_for("https://s3.amazonaws.com/")',
            ),
        ),
        ("tests/test_network.py::test_no_proxy_keeps_s3_requests_direct",),
        "S3 requests take the proxy chosen for a guessed endpoint, not for the URL each goes to",
    ),
    Mutant(
        "published-unnamed-file-forgotten",
        "shardsync/slot.py",
        (
            (
                "            self._remember(file)\n",
                "            pass\n",
            ),
        ),
        (
            "tests/adversarial/test_hostile_server.py::test_a_file_published_before_the_job_failed_is_not_downloaded_again",
        ),
        "a published file no digest named leaves no note: a failed job's files come again",
    ),
    Mutant(
        "unmarked-snapshot-is-ours",
        "shardsync/inventory.py",
        (
            (
                "            foreign_here = not cache.layout.pending(dirname, commit).exists()",
                "            foreign_here = False",
            ),
        ),
        ("tests/test_prune.py::test_stale_incomplete_snapshot_is_removed_if_shardsync_made_it",),
        "a record-less snapshot shardsync did not mark counts as its own abandoned download",
    ),
    Mutant(
        "snapshot-left-unmarked",
        "shardsync/cache.py",
        (("            self._mark_making(repo, commit)\n", ""),),
        (
            "tests/test_cache.py::test_a_snapshot_is_marked_as_being_made_from_its_first_link_to_its_record",
        ),
        "a snapshot is linked without its mark: a killed download's is kept as another tool's",
    ),
    Mutant(
        "eviction-unmarked-first",
        "shardsync/removal.py",
        (
            (
                "            self.fs.atomic_write(records, layout.pending_name(commit), "
                'b"", purpose="record")\n',
                "",
            ),
        ),
        (
            "tests/test_prune.py::test_a_prune_killed_between_a_record_and_its_folder_is_finished_by_the_next",
        ),
        "an eviction drops the record unmarked: a killed prune leaves the snapshot for ever",
    ),
    Mutant(
        "notes-outlive-blobs",
        "shardsync/prune.py",
        (("    forget_gone_blobs(cache.layout)\n", ""),),
        ("tests/test_prune.py::test_notes_of_files_found_again_go_with_their_blobs",),
        "a prune leaves the notes of blobs it removed: one file per path for ever",
    ),
    Mutant(
        "at-in-path-taken-for-userinfo",
        "shardsync/errors.py",
        (
            (
                '        elif "@" in rest and not _PORT.fullmatch(authority.partition(":")[2]):',
                '        elif "@" in rest:',
            ),
        ),
        (
            "tests/adversarial/test_secrets_sweep.py::test_redact_keeps_the_words_and_drops_the_credentials",
        ),
        "an '@' in a URL's path or query is taken for userinfo: messages name a host that is not",
    ),
    Mutant(
        "quoted-basic-shown",
        "shardsync/errors.py",
        (
            (
                '    return _SCHEME_TOKEN.sub(lambda m: f"{m[1]} {_REDACTED}", text)',
                "    return text",
            ),
        ),
        (
            "tests/adversarial/test_secrets_sweep.py::test_redact_keeps_the_words_and_drops_the_credentials",
        ),
        "a Basic credential quoted in JSON or HTML (not after 'Authorization:') is shown",
    ),
    Mutant(
        "full-state-write-speaks-of-partial",
        "shardsync/cache.py",
        ((", then=_STATE_THEN) from exc", ") from exc"),),
        ("tests/test_cache.py::test_a_lease_on_a_full_disk_does_not_speak_of_a_partial",),
        "a lease or journal write on a full disk says a partial download is kept, where none was",
    ),
    Mutant(
        "direct-region-not-learned",
        "shardsync/s3_direct.py",
        (
            (
                "                self.regions[bucket] = home\n                continue",
                "                raise StoreRefused(status, code)",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_a_bucket_in_another_region_gets_urls_signed_for_its_region",
            "tests/test_tier.py::test_a_tier_bucket_in_another_region_is_filled_and_read",
        ),
        'reads without botocore ignore the store\'s "wrong region": a bucket elsewhere fails',
    ),
    Mutant(
        "direct-presigned-for-clients-region",
        "shardsync/s3_direct.py",
        (
            (
                "self.regions.get(bucket, self.target.region),\n            self._clock(),",
                "self.target.region,\n            self._clock(),",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_a_bucket_in_another_region_gets_urls_signed_for_its_region",
            "tests/test_tier.py::test_a_tier_bucket_in_another_region_is_filled_and_read",
        ),
        "presigned GETs made without botocore are signed for the client's region (S3: 400)",
    ),
    Mutant(
        "direct-payer-not-presigned",
        "shardsync/s3_direct.py",
        (
            (
                "        headers = self._payer()\n        url = presign(",
                "        headers: dict[str, str] = {}\n        url = presign(",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_a_requester_pays_bucket_is_read_when_the_config_says_so",
            "tests/test_tier.py::test_a_requester_pays_tier_bucket_is_filled_and_read",
        ),
        "presigned GETs made without botocore do not say the reader pays (the store: 403)",
    ),
    Mutant(
        "sigv4-token-not-presigned",
        "shardsync/s3_sigv4.py",
        (
            (
                "    if credentials.token is not None:\n        params.append(",
                "    if False:\n        params.append(",
            ),
        ),
        ("tests/test_s3_direct.py::test_presigned_urls_are_botocores",),
        "a presigned URL leaves out the session token: temporary credentials are refused",
    ),
    Mutant(
        "sigv4-query-unsorted",
        "shardsync/s3_sigv4.py",
        (
            (
                "sorted((_quote(k), _quote(v)) for k, v in params)",
                "((_quote(k), _quote(v)) for k, v in params)",
            ),
        ),
        ("tests/test_s3_direct.py::test_signed_headers_are_botocores",),
        "the canonical query is not sorted: a listing's signature does not match (403)",
    ),
    Mutant(
        "direct-config-region-ignored",
        "shardsync/s3_direct.py",
        (
            (
                "        if Path(environ.get(variable) or default).expanduser().exists():",
                "        if False:",
            ),
        ),
        ("tests/test_s3_direct.py::test_an_aws_config_or_credentials_file_is_left_to_botocore",),
        "reads go without botocore though an AWS config file may name the region to sign for",
    ),
    Mutant(
        "direct-listing-one-page",
        "shardsync/s3.py",
        (
            (
                "                    if token is None:\n                        return",
                "                    return",
            ),
        ),
        ("tests/test_s3_direct.py::test_a_listing_of_more_than_a_page_is_read_to_its_end",),
        "a listing read without botocore stops after its first 1000 keys",
    ),
    Mutant(
        "direct-retry-backs-off",
        "shardsync/s3.py",
        (("            wait = self.retry_wait\n", "            wait = None\n"),),
        ("tests/test_tier.py::test_a_dead_tier_is_asked_at_most_twice_per_request",),
        "the tier's requests back off up to a second before their one retry, not 0.1 s",
    ),
    Mutant(
        "direct-small-get-first-read",
        "shardsync/s3_direct.py",
        (
            (
                "            async for chunk in resp.content.iter_any():\n",
                "            for chunk in [await resp.content.read(cap)]:\n",
            ),
        ),
        (
            "tests/test_tier_parts.py::test_a_wrong_seeded_partial_never_costs_the_tier_a_good_object",
        ),
        "a small GET keeps what its first read returned: a 5 MiB tier part arrives cut",
    ),
    Mutant(
        "ca-bundle-cached-forever",
        "shardsync/network.py",
        (
            (
                "(seen.st_mtime_ns, seen.st_size, seen.st_ino))",
                "None)",
            ),
        ),
        ("tests/test_network.py::test_a_ca_bundle_is_loaded_once_until_it_changes_on_disk",),
        "a CA bundle is loaded once per process: a rotated private CA is never trusted",
    ),
    Mutant(
        "direct-keys-always-decoded",
        "shardsync/s3_direct.py",
        (('encoded = (_text(root, "EncodingType") or "").lower() == "url"', "encoded = True"),),
        (
            "tests/test_s3_direct.py::test_listed_keys_are_decoded_only_where_the_store_says_it_encoded_them",
        ),
        "listed keys are URL-decoded though the store sent them as they are: a+b is read as a b",
    ),
    Mutant(
        "direct-listing-token-repeats",
        "shardsync/s3_direct.py",
        (
            (
                "if truncated and (not following or following == token):",
                "if truncated and not following:",
            ),
        ),
        ("tests/test_s3_direct.py::test_a_listing_whose_pages_do_not_move_on_is_the_stores_error",),
        "a listing whose next page is the one just read is asked for ever",
    ),
    Mutant(
        "direct-error-body-unparsed",
        "shardsync/s3_direct.py",
        (
            (
                "    with contextlib.suppress(Exception):  # not XML",
                "    with contextlib.suppress(ET.ParseError):  # not XML",
            ),
        ),
        ("tests/test_s3_direct.py::test_a_busy_store_is_busy_whatever_its_error_body_says",),
        "a 503 whose body names an unknown encoding escapes as another kind of error, unretried",
    ),
    Mutant(
        "direct-retries-every-5xx",
        "shardsync/s3.py",
        (
            (
                "                    again = exc.transient\n",
                "                    again = isinstance(error, TransferError)\n",
            ),
        ),
        (
            "tests/test_s3_parts.py::test_parts_of_unequal_sizes_are_checked_where_attributes_are_refused",
        ),
        "reads without botocore retry a 501 (GetObjectAttributes refused) 4 times with backoff",
    ),
    Mutant(
        "direct-credentials-file-ignored",
        "shardsync/s3_direct.py",
        (('    ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),\n', ""),),
        ("tests/test_s3_direct.py::test_an_aws_config_or_credentials_file_is_left_to_botocore",),
        "reads go without botocore though ~/.aws/credentials names the region to sign for",
    ),
    Mutant(
        "direct-token-order",
        "shardsync/s3_direct.py",
        (
            (
                '_TOKEN_VARIABLES = ("AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN")',
                '_TOKEN_VARIABLES = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")',
            ),
        ),
        ("tests/test_s3_direct.py::test_the_session_token_is_the_one_botocore_reads",),
        "with both token variables set, reads without botocore send the other one",
    ),
    Mutant(
        "direct-api-calls-carry-configured-headers",
        "shardsync/s3_direct.py",
        (
            (
                'sent = {"Accept-Encoding": "identity", "User-Agent": "shardsync/0.1", **headers}',
                "sent = {**self._network.extra_headers(url), **headers}",
            ),
        ),
        (
            "tests/test_s3_origin.py::test_configured_headers_go_with_the_bytes_not_with_the_api_calls",
        ),
        "[network] headers go with the listing and HEADs too, which never carried them",
    ),
    Mutant(
        "direct-reads-trust-the-import-time-store",
        "shardsync/s3_direct.py",
        (("ssl: Any = ssl_context(self._network) if https else True", "ssl: Any = True"),),
        ("tests/test_network.py::test_s3_requests_trust_the_systems_cas_as_the_fetcher_does",),
        "reads without botocore trust the system store as it was when aiohttp was imported",
    ),
    Mutant(
        "system-store-context-cached-forever",
        "shardsync/network.py",
        (
            (
                'system = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))',
                "system = ()",
            ),
        ),
        ("tests/test_network.py::test_s3_requests_trust_the_systems_cas_as_the_fetcher_does",),
        "the system store's TLS context is made once per process, whatever SSL_CERT_DIR says later",
    ),
    Mutant(
        "direct-reads-of-aws-hosts",
        "shardsync/s3_direct.py",
        (
            (
                'if parts.hostname.lower().rstrip(".").endswith(_AWS_HOSTS):',
                "if False:",
            ),
        ),
        (
            "tests/test_s3_direct.py::test_reads_go_without_botocore_only_where_it_would_read_the_same",
        ),
        "an endpoint under amazonaws.com is read without botocore (no move to a region's host)",
    ),
    Mutant(
        "proxy-credentials-always-in-connect",
        "shardsync/network.py",
        (('        tunnel = urlsplit(url).scheme != "http"', "        tunnel = True"),),
        (
            "tests/test_network.py::test_an_authenticating_squid_passes_plain_http_requests_with_the_credentials",
        ),
        "a proxy's credentials go only with a CONNECT: plain-http requests through it get 407",
    ),
)


def by_name(names: Sequence[str]) -> list[Mutant]:
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown mutant(s) {unknown}; --list shows them")
    return [known[n] for n in names] if names else list(MUTANTS)


def copy_tree(dest: Path) -> None:
    """What a test run needs, without the venv, caches or build outputs."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in ("shardsync", "tests", "systemd"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


@dataclass(frozen=True, slots=True)
class Outcome:
    mutant: Mutant
    verdict: str  # CAUGHT, MISSED or STALE
    failed: tuple[str, ...]
    seconds: float


def run_mutant(mutant: Mutant, python: str) -> Outcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # tests that run a child as another user import this copy
        copy_tree(work)
        target = work / mutant.file
        try:
            target.write_text(mutant.apply(target.read_text()))
        except ValueError as exc:
            return Outcome(mutant, "STALE", (str(exc),), time.monotonic() - started)
        env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
        where = subprocess.run(
            [python, "-c", "import shardsync; print(shardsync.__file__)"],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not where.startswith(str(work)):
            raise SystemExit(f"the copy is not what runs: shardsync comes from {where}")
        done = subprocess.run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *mutant.tests],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            check=False,
        )
    failed = tuple(re.findall(r"^FAILED (\S+)", done.stdout, flags=re.MULTILINE))
    if done.returncode == 1 and failed:
        verdict = "CAUGHT"
    elif done.returncode == 0:
        verdict = "MISSED"
    else:  # collection error, crash, timeout: the mutant broke the run, not a test
        verdict = "ERROR"
        failed = (done.stdout[-2000:] + done.stderr[-2000:],)
    return Outcome(mutant, verdict, failed, time.monotonic() - started)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--python", default=sys.executable, help="interpreter with pytest")
    args = parser.parse_args(argv)
    mutants = by_name(args.names)
    if args.list:
        for m in mutants:
            print(f"{m.name:32} {m.file:22} {m.plants}")
        return 0
    outcomes = []
    for mutant in mutants:
        outcome = run_mutant(mutant, args.python)
        outcomes.append(outcome)
        print(f"{outcome.verdict:7} {mutant.name:32} {outcome.seconds:5.1f}s", flush=True)
        if outcome.verdict == "CAUGHT":
            for test in outcome.failed:
                print(f"        failed: {test}", flush=True)
    bad = [o for o in outcomes if o.verdict != "CAUGHT"]
    print(f"\n{len(outcomes) - len(bad)}/{len(outcomes)} mutants caught")
    for o in bad:
        print(f"\n{o.verdict} {o.mutant.name}: {o.mutant.plants}\n" + "\n".join(o.failed))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
