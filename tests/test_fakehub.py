"""The test helpers: checkpoint builder, fake hub protocol (checked with huggingface_hub itself
and with raw aiohttp requests), fault knobs and the ``python -m shardsync.testing`` CLI."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import http.client
import http.server
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import huggingface_hub as hf
import pytest
import torch
from huggingface_hub import errors as hf_errors
from safetensors.torch import load_file

from shardsync.testing import (
    Bandwidth,
    ChangeEtag,
    Checkpoint,
    ChunkedBody,
    CutBody,
    FakeHub,
    FlipByte,
    IgnoreIfRange,
    IgnoreRange,
    Latency,
    NoEtag,
    ReplaceObject,
    ShiftedRange,
    SlowDrip,
    Stall,
    Status,
    WrongContentRange,
    build_checkpoint,
    serve_in_thread,
)
from shardsync.testing.__main__ import main as cli_main
from shardsync.testing.faults import FaultPlan, FaultRequest, Pacer

REPO = "org/model"
TOKEN = "hf_test_token"
WEIGHTS = random.Random(1).randbytes(64 * 1024)
NOTES = b"0123456789" * 5
FILES: Mapping[str, bytes] = {
    "weights.safetensors": WEIGHTS,
    "notes.txt": NOTES,
    "sub/dir/extra.json": b'{"a": 1}',
}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes


async def fetch(
    session: aiohttp.ClientSession,
    url: str,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
) -> Reply:
    async with session.request(method, url, headers=headers, allow_redirects=False) as response:
        return Reply(response.status, response.headers, await response.read())


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # A bound on every request, so a broken fault fails its test instead of hanging it.
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(auto_decompress=False, timeout=timeout) as client:
        yield client


@pytest.fixture
async def hub(fake_hub: FakeHub) -> FakeHub:
    """The fake hub holding `FILES` as `REPO`."""
    fake_hub.add_repo(REPO, FILES)
    return fake_hub


async def cdn_url(hub: FakeHub, session: aiohttp.ClientSession, path: str) -> str:
    reply = await fetch(session, f"{hub.endpoint}/{REPO}/resolve/main/{path}", method="HEAD")
    assert reply.status == 302
    return reply.headers["Location"]


# --- checkpoint builder ------------------------------------------------------------------------


def test_checkpoint_has_n_shards_readable_by_safetensors(checkpoint: Checkpoint) -> None:
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert checkpoint.shards == tuple(names)
    assert checkpoint.index == "model.safetensors.index.json"
    for extra in ("config.json", "generation_config.json", "tokenizer.json", "README.md"):
        assert extra in checkpoint.files
    index = json.loads(checkpoint.path(checkpoint.index).read_text())
    seen: dict[str, str] = {}
    tensor_bytes = 0
    for name in names:
        tensors = load_file(checkpoint.path(name))
        assert tensors, f"{name} is empty"
        for key, tensor in tensors.items():
            seen[key] = name
            tensor_bytes += tensor.numel() * tensor.element_size()
            assert tensor.dtype == torch.float16
            assert bool(torch.isfinite(tensor).all())
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == tensor_bytes
    assert 0.8 * 384 * 1024 <= tensor_bytes <= 384 * 1024
    config = json.loads(checkpoint.path("config.json").read_text())
    hidden = config["hidden_size"]
    assert seen.keys() >= {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert f"model.layers.{config['num_hidden_layers'] - 1}.mlp.down_proj.weight" in seen
    embed = load_file(checkpoint.path(seen["model.embed_tokens.weight"]))
    assert embed["model.embed_tokens.weight"].shape == (config["vocab_size"], hidden)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_checkpoint_single_file_is_deterministic(tmp_path: Path, dtype: str) -> None:
    first = build_checkpoint(tmp_path / "a", total_bytes=40_000, n_shards=1, dtype=dtype)
    again = build_checkpoint(tmp_path / "b", total_bytes=40_000, n_shards=1, dtype=dtype)
    other = build_checkpoint(tmp_path / "c", total_bytes=40_000, n_shards=1, seed=1, dtype=dtype)
    assert first.shards == ("model.safetensors",)
    assert first.index is None
    data = first.path("model.safetensors").read_bytes()
    assert data == again.path("model.safetensors").read_bytes()
    assert data != other.path("model.safetensors").read_bytes()
    tensors = load_file(first.path("model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {getattr(torch, dtype)}
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())


def test_checkpoint_without_extras(tmp_path: Path) -> None:
    built = build_checkpoint(tmp_path, total_bytes=100_000, n_shards=5, extras=False)
    assert len(built.shards) == 5
    assert set(built.files) == {*built.shards, "model.safetensors.index.json"}
    assert built.total_size == sum(built.path(f).stat().st_size for f in built.files)


# --- huggingface_hub against the fake hub ------------------------------------------------------


@pytest.fixture
def threaded_hub(checkpoint: Checkpoint) -> Iterator[FakeHub]:
    """A fake hub serving `checkpoint` as a private `REPO` from its own thread."""
    fake = FakeHub()
    fake.add_checkpoint(REPO, checkpoint, token=TOKEN)
    with serve_in_thread(fake):
        yield fake


def test_snapshot_download_gets_identical_files(
    threaded_hub: FakeHub, checkpoint: Checkpoint, hf_cache: Path
) -> None:
    snapshot = Path(
        hf.snapshot_download(REPO, endpoint=threaded_hub.endpoint, cache_dir=hf_cache, token=TOKEN)
    )
    for rel in checkpoint.files:
        assert (snapshot / rel).read_bytes() == checkpoint.path(rel).read_bytes(), rel
    cdn = [r for r in threaded_hub.log if r.server == "cdn"]
    assert {r.file for r in cdn} == set(checkpoint.shards)
    assert all("Authorization" not in r.headers for r in cdn)
    assert all(r.headers["Authorization"] == f"Bearer {TOKEN}" for r in threaded_hub.log[:2])
    assert threaded_hub.bytes_served("model-*") == sum(
        checkpoint.path(s).stat().st_size for s in checkpoint.shards
    )
    info = hf.scan_cache_dir(hf_cache)
    assert not info.warnings
    assert info.size_on_disk == checkpoint.total_size


def test_hf_hub_download_one_shard_by_branch_and_commit(
    threaded_hub: FakeHub, checkpoint: Checkpoint, hf_cache: Path
) -> None:
    shard = checkpoint.shards[1]

    def download(revision: str | None = None) -> bytes:
        path = hf.hf_hub_download(
            REPO,
            shard,
            revision=revision,
            endpoint=threaded_hub.endpoint,
            cache_dir=hf_cache,
            token=TOKEN,
            force_download=True,
        )
        return Path(path).read_bytes()

    assert download() == checkpoint.path(shard).read_bytes()
    commit = (hf_cache / "models--org--model" / "refs" / "main").read_text()
    assert download(commit) == checkpoint.path(shard).read_bytes()
    resolved = [r.path for r in threaded_hub.log if r.method == "HEAD"]
    assert resolved == [f"/{REPO}/resolve/{rev}/{shard}" for rev in ("main", commit)]


def test_pr_revision(hf_cache: Path) -> None:
    fake = FakeHub()
    main = fake.add_repo(REPO, FILES)
    pr = fake.add_repo(REPO, {"notes.txt": b"from the PR"}, revision="refs/pr/1")
    assert main != pr
    with serve_in_thread(fake):
        snapshot = Path(
            hf.snapshot_download(
                REPO, revision="refs/pr/1", endpoint=fake.endpoint, cache_dir=hf_cache, token=False
            )
        )
        assert snapshot.name == pr
        assert [p.name for p in snapshot.iterdir()] == ["notes.txt"]
        assert (snapshot / "notes.txt").read_bytes() == b"from the PR"

        def download(revision: str) -> bytes:
            path = hf.hf_hub_download(
                REPO,
                "notes.txt",
                revision=revision,
                endpoint=fake.endpoint,
                cache_dir=hf_cache,
                token=False,
            )
            return Path(path).read_bytes()

        assert download("refs/pr/1") == b"from the PR"
        assert download("main") == NOTES
    assert (hf_cache / "models--org--model" / "refs" / "refs" / "pr" / "1").read_text() == pr


def test_cdn_base_redirects_lfs_files_to_a_server_of_ones_own(
    tmp_path: Path, hf_cache: Path
) -> None:
    """`FakeHub(cdn_base=URL)`: LFS files answer 302 to URL/<sha256> (the benchmarks point it at
    nginx) with the usual headers; small files still come from the hub, the built-in CDN idles."""
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    root = tmp_path / "files-server"
    (root / "by-sha256").mkdir(parents=True)
    (root / "by-sha256" / sha256).write_bytes(WEIGHTS)
    served: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            served.append(f"{self.command} {self.path}")

    files = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(root))
    )
    thread = threading.Thread(target=files.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{files.server_port}/by-sha256"
    fake = FakeHub(cdn_base=base + "/")
    fake.add_repo(REPO, FILES)
    try:
        with serve_in_thread(fake):
            hub = urlsplit(fake.endpoint)
            conn = http.client.HTTPConnection(hub.hostname or "", hub.port, timeout=10)
            conn.request("HEAD", f"/{REPO}/resolve/main/weights.safetensors")
            reply = conn.getresponse()
            conn.close()
            assert reply.status == 302
            assert reply.headers["Location"] == f"{base}/{sha256}"
            assert reply.headers["X-Linked-Etag"] == f'"{sha256}"'
            assert reply.headers["X-Linked-Size"] == str(len(WEIGHTS))
            assert reply.headers["ETag"] == f'"{sha256}"'
            for name, data in (("weights.safetensors", WEIGHTS), ("notes.txt", NOTES)):
                path = hf.hf_hub_download(
                    REPO, name, endpoint=fake.endpoint, cache_dir=hf_cache, token=False
                )
                assert Path(path).read_bytes() == data, name
            assert not [r for r in fake.log if r.server == "cdn"]
    finally:
        files.shutdown()
        files.server_close()
        thread.join()
    assert f"GET /by-sha256/{sha256}" in served
    assert all(sha256 in line for line in served)


async def test_raw_and_encoded_pr_revisions_in_urls(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    pr = hub.add_repo(REPO, {"notes.txt": b"pr"}, revision="refs/pr/1")
    for rev in ("refs/pr/1", "refs%2Fpr%2F1", pr):
        reply = await fetch(session, f"{hub.endpoint}/{REPO}/resolve/{rev}/notes.txt")
        assert (reply.status, reply.body, reply.headers["X-Repo-Commit"]) == (200, b"pr", pr)
        info = await fetch(session, f"{hub.endpoint}/api/models/{REPO}/revision/{rev}")
        assert json.loads(info.body)["sha"] == pr
    tree = await fetch(session, f"{hub.endpoint}/api/models/{REPO}/tree/refs%2Fpr%2F1")
    assert [e["path"] for e in json.loads(tree.body)] == ["notes.txt"]


async def test_model_info_with_blobs(hub: FakeHub) -> None:
    api = hf.HfApi(endpoint=hub.endpoint, token=False)
    info = await asyncio.to_thread(api.model_info, REPO, files_metadata=True)
    assert info.sha is not None and len(info.sha) == 40
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert siblings.keys() == FILES.keys()
    notes = siblings["notes.txt"]
    assert (notes.size, notes.blob_id, notes.lfs) == (len(NOTES), git_blob_id(NOTES), None)
    weights = siblings["weights.safetensors"]
    assert weights.lfs is not None
    assert weights.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert weights.lfs.size == weights.size == len(WEIGHTS)
    pointer = (
        f"version https://git-lfs.github.com/spec/v1\n"
        f"oid sha256:{weights.lfs.sha256}\nsize {len(WEIGHTS)}\n"
    ).encode()
    assert (weights.blob_id, weights.lfs.pointer_size) == (git_blob_id(pointer), len(pointer))


async def test_tree_listing_is_paginated(hub: FakeHub) -> None:
    hub.add_repo("org/many", {f"f{i:02d}.txt": b"%d" % i for i in range(7)})
    hub.tree_page_size = 3
    api = hf.HfApi(endpoint=hub.endpoint, token=False)
    listed = await asyncio.to_thread(lambda: list(api.list_repo_tree("org/many", recursive=True)))
    assert [f.path for f in listed] == [f"f{i:02d}.txt" for i in range(7)]
    pages = [r for r in hub.log if "/tree/" in r.path]
    assert len(pages) == 3
    assert "cursor" not in pages[0].query
    assert all("cursor" in r.query for r in pages[1:])


async def test_tree_listing_directories_and_subpaths(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    base = f"{hub.endpoint}/api/models/{REPO}/tree/main"
    top = json.loads((await fetch(session, base)).body)
    assert [(e["type"], e["path"]) for e in top] == [
        ("file", "notes.txt"),
        ("directory", "sub"),
        ("file", "weights.safetensors"),
    ]
    deep = json.loads((await fetch(session, f"{base}?recursive=true")).body)
    assert [e["path"] for e in deep] == [
        "notes.txt",
        "sub",
        "sub/dir",
        "sub/dir/extra.json",
        "weights.safetensors",
    ]
    lfs = next(e for e in deep if e["path"] == "weights.safetensors")["lfs"]
    assert lfs["oid"] == hashlib.sha256(WEIGHTS).hexdigest()
    assert lfs["size"] == len(WEIGHTS)
    sub = json.loads((await fetch(session, f"{base}/sub%2Fdir")).body)
    assert [e["path"] for e in sub] == ["sub/dir/extra.json"]
    page = await fetch(session, f"{base}?recursive=true&limit=2")
    assert [e["path"] for e in json.loads(page.body)] == ["notes.txt", "sub"]
    link = page.headers["Link"]
    assert link.startswith(f"<{base}?") and link.endswith('>; rel="next"')
    missing = await fetch(session, f"{base}/nowhere")
    assert (missing.status, missing.headers["X-Error-Code"]) == (404, "EntryNotFound")


@pytest.mark.parametrize(
    ("repo", "revision", "filename", "token", "error"),
    [
        ("org/missing", "main", "notes.txt", False, hf_errors.RepositoryNotFoundError),
        ("org/private", "main", "notes.txt", False, hf_errors.RepositoryNotFoundError),
        ("org/private", "main", "notes.txt", "wrong", hf_errors.RepositoryNotFoundError),
        ("org/gated", "main", "notes.txt", False, hf_errors.GatedRepoError),
        ("org/gated", "main", "notes.txt", "wrong", hf_errors.GatedRepoError),
        (REPO, "nope", "notes.txt", False, hf_errors.RevisionNotFoundError),
        (REPO, "main", "absent.txt", False, hf_errors.RemoteEntryNotFoundError),
    ],
)
async def test_errors_map_to_huggingface_hub_exceptions(
    hub: FakeHub,
    hf_cache: Path,
    repo: str,
    revision: str,
    filename: str,
    token: str | bool,
    error: type[Exception],
) -> None:
    hub.add_repo("org/private", FILES, token=TOKEN)
    hub.add_repo("org/gated", FILES, gated=True, token=TOKEN)
    with pytest.raises(error):
        await asyncio.to_thread(
            hf.hf_hub_download,
            repo,
            filename,
            revision=revision,
            endpoint=hub.endpoint,
            cache_dir=hf_cache,
            token=token,
        )
    if filename == "notes.txt":
        api = hf.HfApi(endpoint=hub.endpoint, token=token)
        with pytest.raises(error):
            await asyncio.to_thread(api.model_info, repo, revision=revision)


async def test_error_statuses(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    hub.add_repo("org/private", FILES, token=TOKEN)
    hub.add_repo("org/gated", FILES, gated=True, token=TOKEN)
    auth = {"Authorization": "Bearer wrong"}
    cases = [
        ("org/private", None, 401, "RepoNotFound"),
        ("org/private", auth, 404, "RepoNotFound"),
        ("org/gated", None, 401, "GatedRepo"),
        ("org/gated", auth, 403, "GatedRepo"),
    ]
    for repo, headers, status, code in cases:
        url = f"{hub.endpoint}/{repo}/resolve/main/notes.txt"
        reply = await fetch(session, url, headers=headers)
        assert (reply.status, reply.headers["X-Error-Code"]) == (status, code)
        assert json.loads(reply.body)["error"]
    ok = await fetch(
        session,
        f"{hub.endpoint}/org/gated/resolve/main/notes.txt",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert (ok.status, ok.body) == (200, NOTES)


# --- the protocol, with plain aiohttp ------------------------------------------------------------


async def test_resolve_headers(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    small = await fetch(session, f"{hub.endpoint}/{REPO}/resolve/main/notes.txt", method="HEAD")
    assert small.status == 200
    assert small.headers["ETag"] == f'"{git_blob_id(NOTES)}"'
    assert small.headers["Content-Length"] == str(len(NOTES))
    assert len(small.headers["X-Repo-Commit"]) == 40
    lfs = await fetch(session, f"{hub.endpoint}/{REPO}/resolve/main/weights.safetensors")
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    assert lfs.status == 302
    assert lfs.headers["X-Linked-Etag"] == f'"{sha256}"'
    assert lfs.headers["X-Linked-Size"] == str(len(WEIGHTS))
    assert lfs.headers["X-Repo-Commit"] == small.headers["X-Repo-Commit"]
    assert lfs.headers["Location"].startswith(f"{hub.cdn_endpoint}/")
    assert hub.cdn_endpoint.startswith("http://127.0.0.2:")
    body = await fetch(session, lfs.headers["Location"], headers={"Accept-Encoding": "gzip"})
    assert (body.status, body.body) == (200, WEIGHTS)
    assert body.headers["ETag"] == f'"{sha256}"'
    assert body.headers["Accept-Ranges"] == "bytes"
    assert "Content-Encoding" not in body.headers
    assert 'filename="weights.safetensors"' in body.headers["Content-Disposition"]


async def test_cdn_rejects_tampered_urls(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    tampered = url.replace("repo_path=weights", "repo_path=other")
    assert (await fetch(session, tampered)).status == 403
    assert (await fetch(session, url)).status == 200


@pytest.mark.parametrize("target", ["cdn", "direct"])
@pytest.mark.parametrize(
    ("header", "status", "span", "content_range"),
    [
        ("bytes=0-9", 206, (0, 10), "bytes 0-9/{n}"),
        ("bytes=5-", 206, (5, None), "bytes 5-{last}/{n}"),
        ("bytes=-4", 206, (-4, None), "bytes {tail}-{last}/{n}"),
        ("bytes=3-99999999", 206, (3, None), "bytes 3-{last}/{n}"),
        ("bytes=99999999-", 416, None, "bytes */{n}"),
        ("bytes=-0", 416, None, "bytes */{n}"),
        ("bytes=0-1,4-5", 200, (0, None), None),
        ("items=0-1", 200, (0, None), None),
        ("bytes=7-2", 200, (0, None), None),
    ],
)
async def test_range_requests(
    hub: FakeHub,
    session: aiohttp.ClientSession,
    target: str,
    header: str,
    status: int,
    span: tuple[int, int | None] | None,
    content_range: str | None,
) -> None:
    if target == "cdn":
        data, url = WEIGHTS, await cdn_url(hub, session, "weights.safetensors")
    else:
        data, url = NOTES, f"{hub.endpoint}/{REPO}/resolve/main/notes.txt"
    reply = await fetch(session, url, headers={"Range": header})
    assert reply.status == status
    n = len(data)
    expected_range = (
        None if content_range is None else content_range.format(n=n, last=n - 1, tail=n - 4)
    )
    assert reply.headers.get("Content-Range") == expected_range
    if span is not None:
        assert reply.body == data[span[0] : span[1]]
        assert reply.headers["Content-Length"] == str(len(reply.body))


async def test_if_range(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    etag = f'"{hashlib.sha256(WEIGHTS).hexdigest()}"'
    cases = [(etag, 206), ('"something-else"', 200), (f"W/{etag}", 200)]
    for if_range, status in cases:
        reply = await fetch(session, url, headers={"Range": "bytes=10-", "If-Range": if_range})
        assert reply.status == status, if_range
        assert reply.body == (WEIGHTS[10:] if status == 206 else WEIGHTS)


async def test_head_on_cdn_has_no_body(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    reply = await fetch(session, url, method="HEAD")
    assert (reply.status, reply.body) == (200, b"")
    assert reply.headers["Content-Length"] == str(len(WEIGHTS))
    assert hub.log[-1].bytes_sent == 0


async def test_log_and_bytes_served(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    await fetch(session, url, headers={"Range": "bytes=0-99", "Authorization": "Bearer leak"})
    await fetch(session, f"{hub.endpoint}/{REPO}/resolve/main/notes.txt")
    head, ranged, direct = hub.log
    assert (head.server, head.method, head.status, head.bytes_sent) == ("hub", "HEAD", 302, 0)
    assert head.file == "weights.safetensors"
    assert (ranged.server, ranged.status, ranged.range, ranged.bytes_sent) == (
        "cdn",
        206,
        "bytes=0-99",
        100,
    )
    assert ranged.headers["authorization"] == "Bearer leak"  # recorded, case-insensitively
    assert ranged.query["repo_path"] == "weights.safetensors"
    assert (direct.server, direct.file, direct.bytes_sent) == ("hub", "notes.txt", len(NOTES))
    assert hub.bytes_served() == 100 + len(NOTES)
    assert hub.bytes_served("*.safetensors") == 100
    hub.reset_log()
    assert hub.log == [] and hub.bytes_served() == 0


# --- faults --------------------------------------------------------------------------------------


async def test_cut_body_at_a_given_byte(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    rule = hub.faults.add(CutBody(at=1000, path="weights.*"))
    with pytest.raises(aiohttp.ClientPayloadError):
        await fetch(session, url)
    assert (rule.fired, rule.exhausted) == (1, True)
    assert hub.log[-1].bytes_sent == 1000
    assert (await fetch(session, url)).body == WEIGHTS


async def test_cut_body_at_random_is_seeded(session: aiohttp.ClientSession) -> None:
    cut_at = []
    for _ in range(2):
        async with FakeHub(seed=7) as hub:
            hub.add_repo(REPO, FILES)
            url = await cdn_url(hub, session, "weights.safetensors")
            hub.faults.add(CutBody())
            with pytest.raises(aiohttp.ClientPayloadError):
                await fetch(session, url, headers={"Range": "bytes=100-"})
            cut_at.append(hub.log[-1].bytes_sent)
    assert cut_at[0] == cut_at[1]
    assert 0 <= cut_at[0] < len(WEIGHTS) - 100


async def test_status_storm_then_success(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(Status(503, times=2))
    hub.faults.add(CutBody())  # waits: a Status response leaves body faults unused
    assert [(await fetch(session, url)).status for _ in range(2)] == [503, 503]
    with pytest.raises(aiohttp.ClientPayloadError):
        await fetch(session, url)
    assert (await fetch(session, url)).body == WEIGHTS


@pytest.mark.parametrize("retry_after", ["3", "Wed, 21 Oct 2015 07:28:00 GMT"])
async def test_status_429_retry_after(
    hub: FakeHub, session: aiohttp.ClientSession, retry_after: str
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(Status(429, retry_after=retry_after))
    reply = await fetch(session, url)
    assert (reply.status, reply.headers["Retry-After"]) == (429, retry_after)


async def test_faults_select_by_server_and_path(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    on_hub = hub.faults.add(Status(500, server="hub", path="notes.txt"))
    other = hub.faults.add(Status(500, path="model-*"))
    assert (await fetch(session, url)).status == 200
    notes = f"{hub.endpoint}/{REPO}/resolve/main/notes.txt"
    assert (await fetch(session, notes)).status == 500
    assert (await fetch(session, notes)).status == 200
    assert (on_hub.fired, other.fired) == (1, 0)
    api = hub.faults.add(Status(503, server="hub"))
    assert (await fetch(session, f"{hub.endpoint}/api/models/{REPO}")).status == 503
    assert api.exhausted


async def test_flip_byte(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(FlipByte(offset=10))
    reply = await fetch(session, url)
    assert reply.status == 200 and len(reply.body) == len(WEIGHTS)
    assert [i for i in range(len(WEIGHTS)) if reply.body[i] != WEIGHTS[i]] == [10]
    assert reply.body[10] == WEIGHTS[10] ^ 0xFF


async def test_ignore_range(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    rule = hub.faults.add(IgnoreRange())
    assert (await fetch(session, url)).status == 200
    assert rule.fired == 0  # a request without Range does not use it up
    reply = await fetch(session, url, headers={"Range": "bytes=100-"})
    assert (reply.status, reply.body) == (200, WEIGHTS)
    assert (await fetch(session, url, headers={"Range": "bytes=100-"})).status == 206


async def test_change_etag(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    old = (await fetch(session, url, method="HEAD")).headers["ETag"]
    hub.faults.add(ChangeEtag())
    new = (await fetch(session, url, method="HEAD")).headers["ETag"]
    assert new != old and not new.startswith("W/")
    stale = await fetch(session, url, headers={"Range": "bytes=100-", "If-Range": old})
    assert (stale.status, stale.body) == (200, WEIGHTS)
    fresh = await fetch(session, url, headers={"Range": "bytes=100-", "If-Range": new})
    assert (fresh.status, fresh.body) == (206, WEIGHTS[100:])


async def test_wrong_content_range(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(WrongContentRange())
    reply = await fetch(session, url, headers={"Range": "bytes=100-199"})
    assert (reply.status, reply.body) == (206, WEIGHTS[100:200])
    assert reply.headers["Content-Range"] == f"bytes 101-200/{len(WEIGHTS)}"


@pytest.mark.parametrize("shift", [-40, 40])
async def test_shifted_range_sends_the_bytes_of_another_range(
    hub: FakeHub, session: aiohttp.ClientSession, shift: int
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(ShiftedRange(shift))
    reply = await fetch(session, url, headers={"Range": "bytes=100-199"})
    first = 100 + shift
    assert reply.status == 206
    assert reply.body == WEIGHTS[first : first + 100] != WEIGHTS[100:200]
    assert reply.headers["Content-Range"] == f"bytes {first}-{first + 99}/{len(WEIGHTS)}"
    again = await fetch(session, url, headers={"Range": "bytes=100-199"})
    assert again.body == WEIGHTS[100:200]  # used up


async def test_a_fault_asked_again_skips_the_first_ask_of_each_range(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    """What shardsync's pump asks first and hands to aiohttp unread is left alone; the
    second ask of the same file and ``Range`` gets the fault."""
    url = await cdn_url(hub, session, "weights.safetensors")
    rule = hub.faults.add(ShiftedRange(40, asked_again=True))
    first = await fetch(session, url, headers={"Range": "bytes=100-199"})
    other = await fetch(session, url, headers={"Range": "bytes=200-299"})
    assert (first.body, other.body, rule.fired) == (WEIGHTS[100:200], WEIGHTS[200:300], 0)
    again = await fetch(session, url, headers={"Range": "bytes=100-199"})
    assert again.body == WEIGHTS[140:240] and rule.exhausted


async def test_shifted_range_stays_inside_the_file(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(ShiftedRange(-500))
    reply = await fetch(session, url, headers={"Range": "bytes=100-199"})
    assert (reply.status, reply.body) == (206, WEIGHTS[0:1])  # clipped, never empty
    assert reply.headers["Content-Range"] == f"bytes 0-0/{len(WEIGHTS)}"


async def test_replace_object_serves_new_content_under_a_new_etag(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    resolve = f"{hub.endpoint}/{REPO}/resolve/main/weights.safetensors"
    old = (await fetch(session, url, method="HEAD")).headers["ETag"]
    new_content = bytes(b ^ 0x55 for b in WEIGHTS[:1000])
    rule = hub.faults.add(ReplaceObject(new_content, path="weights.safetensors", after=1))
    assert (await fetch(session, url, method="HEAD")).headers["ETag"] == old  # waits for a body
    first = await fetch(session, url, headers={"Range": "bytes=0-99"})
    assert (first.body, first.headers["ETag"]) == (WEIGHTS[:100], old)
    # from now on the URL serves the new object: HEAD, Range, If-Range and the Hub's headers
    head = await fetch(session, url, method="HEAD")
    new = hashlib.sha256(new_content).hexdigest()
    assert head.headers["ETag"] == f'"{new}"' and head.headers["Content-Length"] == "1000"
    stale = await fetch(session, url, headers={"Range": "bytes=100-", "If-Range": old})
    assert (stale.status, stale.body) == (200, new_content)
    ranged = await fetch(session, url, headers={"Range": "bytes=100-199"})
    assert (ranged.status, ranged.body) == (206, new_content[100:200])
    assert ranged.headers["Content-Range"] == "bytes 100-199/1000"
    redirect = await fetch(session, resolve, method="HEAD")
    assert redirect.headers["X-Linked-Etag"] == f'"{new}"'
    assert redirect.headers["X-Linked-Size"] == "1000"
    assert rule.fired >= 4 and not rule.exhausted


async def test_replace_object_on_a_small_file_served_by_the_hub(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    notes = f"{hub.endpoint}/{REPO}/resolve/main/notes.txt"
    old = (await fetch(session, notes, method="HEAD")).headers["ETag"]
    hub.faults.add(ReplaceObject(b"replaced", path="notes.txt"))
    reply = await fetch(session, notes)
    assert reply.body == b"replaced" and reply.headers["ETag"] not in (old, None)


@pytest.mark.parametrize(("weak", "expected"), [(False, None), (True, "W/")])
async def test_no_etag_takes_the_validator_away(
    hub: FakeHub, session: aiohttp.ClientSession, weak: bool, expected: str | None
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    old = (await fetch(session, url, method="HEAD")).headers["ETag"]
    hub.faults.add(NoEtag(weak=weak))
    reply = await fetch(session, url, headers={"Range": "bytes=0-9"})
    etag = reply.headers.get("ETag")
    assert (etag[:2] if etag else None) == expected
    # an If-Range with the old strong ETag no longer matches anything: the full body
    stale = await fetch(session, url, headers={"Range": "bytes=0-9", "If-Range": old})
    assert stale.status == 200


async def test_no_etag_on_partial_answers_only_keeps_if_range_working(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    etag = (await fetch(session, url, method="HEAD")).headers["ETag"]
    hub.faults.add(NoEtag(partial_only=True))
    part = await fetch(session, url, headers={"Range": "bytes=0-9", "If-Range": etag})
    assert part.status == 206 and "ETag" not in part.headers
    assert part.body == WEIGHTS[:10]
    whole = await fetch(session, url)
    assert whole.status == 200 and whole.headers["ETag"] == etag
    stale = await fetch(session, url, headers={"Range": "bytes=0-9", "If-Range": '"old"'})
    assert stale.status == 200 and stale.body == WEIGHTS


async def test_ignore_if_range_answers_206_of_what_the_url_holds_now(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(ReplaceObject(b"n" * len(WEIGHTS), path="weights.safetensors"))
    hub.faults.add(IgnoreIfRange())
    reply = await fetch(session, url, headers={"Range": "bytes=0-9", "If-Range": '"stale"'})
    assert reply.status == 206 and reply.body == b"n" * 10


async def test_if_match_answers_412_once_the_object_changed(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    etag = (await fetch(session, url, method="HEAD")).headers["ETag"]
    same = await fetch(session, url, headers={"Range": "bytes=0-9", "If-Match": etag})
    assert same.status == 206 and same.body == WEIGHTS[:10]
    hub.faults.add(ReplaceObject(b"n" * len(WEIGHTS), path="weights.safetensors"))
    changed = await fetch(session, url, headers={"Range": "bytes=0-9", "If-Match": etag})
    assert changed.status == 412


def test_latency_for_bodies_only_spares_heads_and_redirects() -> None:
    plan = FaultPlan()
    rule = plan.add(Latency(5, bodies_only=True, times=1))
    assert plan.take(FaultRequest("cdn", "f", has_body=False, has_range=False)).latency == 0
    assert plan.take(FaultRequest("cdn", "f", has_body=True, has_range=True)).latency == 5
    assert rule.exhausted


async def test_chunked_body_has_no_length_and_the_same_bytes(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    rule = hub.faults.add(ChunkedBody(piece=1000))
    head = await fetch(session, url, method="HEAD")
    assert head.headers["Content-Length"] == str(len(WEIGHTS))
    part = await fetch(session, url, headers={"Range": "bytes=5-4004"})
    assert part.status == 206 and part.body == WEIGHTS[5:4005]
    assert part.headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in part.headers
    assert rule.fired == 1  # the HEAD has no body to chunk


async def test_flip_byte_in_a_small_file_served_by_the_hub(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    notes = f"{hub.endpoint}/{REPO}/resolve/main/notes.txt"
    hub.faults.add(FlipByte(offset=3, server="hub", path="notes.txt"))
    reply = await fetch(session, notes)
    assert reply.body != NOTES and reply.body[3] == NOTES[3] ^ 0xFF
    assert (await fetch(session, notes)).body == NOTES


async def test_stall_sends_headers_then_nothing(
    hub: FakeHub, session: aiohttp.ClientSession
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(Stall(60))
    timeout = aiohttp.ClientTimeout(sock_read=0.2)
    async with session.get(url, timeout=timeout) as response:
        assert response.status == 200
        with pytest.raises(asyncio.TimeoutError):
            await response.read()
    hub.faults.add(Stall(0))
    with pytest.raises(aiohttp.ClientPayloadError):
        await fetch(session, url)
    assert [r.bytes_sent for r in hub.log if r.server == "cdn"] == [0, 0]


async def test_latency_delays_the_first_byte(hub: FakeHub, session: aiohttp.ClientSession) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    rule = hub.faults.add(Latency(0.3, times=1))
    started = time.monotonic()
    assert (await fetch(session, url, method="HEAD")).status == 200
    assert time.monotonic() - started >= 0.25
    assert rule.exhausted


@pytest.mark.parametrize("fault", [Bandwidth(100_000), SlowDrip(100_000)])
async def test_pacing_faults_slow_the_body(
    hub: FakeHub, session: aiohttp.ClientSession, fault: Bandwidth | SlowDrip
) -> None:
    url = await cdn_url(hub, session, "weights.safetensors")
    hub.faults.add(fault)
    started = time.monotonic()
    reply = await fetch(session, url, headers={"Range": "bytes=0-29999"})
    elapsed = time.monotonic() - started
    assert reply.body == WEIGHTS[:30000]
    # 30 kB at 100 kB/s: the first chunk (5 or 10 kB) leaves at once, the rest cannot beat the
    # rate, so this lower bound holds however slow the machine is.
    assert elapsed >= 0.15


def test_pacer_arithmetic() -> None:
    now = [0.0]
    pacer = Pacer(1000, chunk=100, clock=lambda: now[0])
    assert [pacer.delay(100) for _ in range(3)] == [0.0, 0.1, 0.2]
    now[0] = 10.0  # idle time is not banked
    assert pacer.delay(100) == 0.0
    assert pacer.delay(100) == pytest.approx(0.1)


def test_fault_plan_chunking_and_scopes() -> None:
    plan = FaultPlan()
    body = FaultRequest("cdn", "a.bin", has_body=True, has_range=False)
    head = FaultRequest("cdn", "a.bin", has_body=False, has_range=False)
    plan.add(SlowDrip(1))
    assert plan.take(head).pacer() is None
    drip = plan.take(body).pacer()
    assert drip is not None and (drip.rate, drip.chunk) == (1, 1)
    plan.add(Bandwidth(10 << 20))
    capped = plan.take(body).pacer()
    assert capped is not None and capped.chunk == 256 * 1024
    with pytest.raises(ValueError):
        Status(200)
    with pytest.raises(ValueError):
        CutBody(times=0)


# --- the CLI -------------------------------------------------------------------------------------


def test_cli_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "built"
    assert cli_main(["build", "--out", str(out), "--total-bytes", "50000", "--shards", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == list(Checkpoint.scan(out).files)
    assert len(Checkpoint.scan(out).shards) == 2


def test_cli_rejects_bad_arguments(checkpoint: Checkpoint) -> None:
    directory = str(checkpoint.directory)
    assert cli_main(["serve", "--checkpoint", directory, "--repo", "no-slash"]) == 2
    assert cli_main(["serve", "--checkpoint", f"{directory}/nope", "--repo", REPO]) == 2


def test_cli_serve_until_sigterm(checkpoint: Checkpoint, tmp_path: Path, hf_cache: Path) -> None:
    ready_file = tmp_path / "ready.json"
    command = [sys.executable, "-m", "shardsync.testing", "serve"]
    command += ["--checkpoint", str(checkpoint.directory), "--repo", REPO]
    command += ["--ready-file", str(ready_file)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            ready = json.loads(server.stdout.readline())
            assert json.loads(ready_file.read_text()) == ready
            shard = checkpoint.shards[0]
            path = hf.hf_hub_download(
                REPO, shard, endpoint=ready["endpoint"], cache_dir=hf_cache, token=False
            )
            assert Path(path).read_bytes() == checkpoint.path(shard).read_bytes()
            assert Path(path).parent.name == ready["commit"]
        finally:
            server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
