"""The streaming loader against the fake hub: bit-exact tensors, a real module, overlap."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fast_config, serving, until
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

import shardsync
from shardsync.daemon import DaemonStatistics
from shardsync.errors import ConfigError, HeaderError, LoadError
from shardsync.loader import LoadResult
from shardsync.testing import Bandwidth, Checkpoint, FakeHub, build_checkpoint, serve_in_thread

REPO = "acme/loader"


class TinyTransformer(torch.nn.Module):
    """A two-block decoder, enough to prove the weights land where the model expects them."""

    def __init__(self, vocab: int = 64, dim: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, batch_first=True)
            for _ in range(blocks)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), total_bytes=6 << 20, n_shards=3)


@pytest.fixture
def hub(checkpoint: Checkpoint) -> Iterator[FakeHub]:
    with serving({REPO: checkpoint}) as running:
        yield running


def _originals(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in checkpoint.shards:
        tensors.update(load_file(checkpoint.path(shard)))
    return tensors


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_stream_is_bit_exact_and_in_shard_order(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    config = fast_config(tmp_path, hub.endpoint)
    with shardsync.stream(REPO, device_map="cpu", config=config) as tensors:
        pairs = list(tensors)
        stats = tensors.statistics()
        order = [tensors.manifest.weight_map[name] for name, _ in pairs]
    _assert_bit_exact(dict(pairs), _originals(checkpoint))
    assert order == sorted(order)  # every tensor of shard 1, then shard 2, ...
    assert stats.tensors == len(pairs) and stats.finished is not None
    assert len(stats.shards_verified) == len(checkpoint.shards)
    # headers were read with small Range requests before any shard body was sent
    first_body = next(i for i, r in enumerate(hub.log) if r.bytes_sent > 64 * 1024)
    header_reads = [r for r in hub.log[:first_body] if r.range == "bytes=0-65535"]
    assert len(header_reads) == len(checkpoint.shards)


def test_weights_gives_every_tensor_in_shard_order_as_cpu_views(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """``shardsync.weights``, what an engine's ``load_weights`` takes: every tensor once,
    bit-exact, shard by shard, on the CPU, and the iterator closes its stream when done."""
    config = fast_config(tmp_path, hub.endpoint)
    pairs = list(shardsync.weights(REPO, config=config))
    originals = _originals(checkpoint)
    assert [name for name, _ in pairs].count(pairs[0][0]) == 1
    _assert_bit_exact(dict(pairs), originals)
    assert all(tensor.device.type == "cpu" for _, tensor in pairs)
    index = json.loads(checkpoint.path(checkpoint.index).read_text())["weight_map"]
    order = [index[name] for name, _ in pairs]
    assert order == sorted(order) and len(pairs) == len(originals)


def test_load_single_file_and_from_cache(tmp_path: Path) -> None:
    single = build_checkpoint(tmp_path / "single", total_bytes=1 << 20, n_shards=1, seed=4)
    fake = FakeHub()
    fake.add_checkpoint("acme/single", single)
    with serve_in_thread(fake) as hub:
        config = fast_config(tmp_path / "cache", hub.endpoint)
        first = shardsync.load("acme/single", device_map="cpu", config=config)
        hub.reset_log()
        again = shardsync.load("acme/single", device_map="cpu", config=config)
        assert hub.bytes_served() == 0  # headers and bodies came from the cache
    assert isinstance(first, dict) and isinstance(again, dict)
    want = load_file(single.path("model.safetensors"))
    _assert_bit_exact(first, want)
    _assert_bit_exact(again, want)


def test_dtype_cast(hub: FakeHub, tmp_path: Path) -> None:
    got = shardsync.load(
        REPO, device_map="cpu", dtype=torch.float32, config=fast_config(tmp_path, hub.endpoint)
    )
    assert isinstance(got, dict)
    assert {t.dtype for t in got.values()} == {torch.float32}


def test_fill_a_meta_model_and_match_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    original = TinyTransformer().eval()
    (tmp_path / "tiny").mkdir()
    save_torch_state_dict(original.state_dict(), tmp_path / "tiny", max_shard_size=20_000)
    shards = list((tmp_path / "tiny").glob("*.safetensors"))
    assert len(shards) >= 3
    files = {p.name: p for p in (tmp_path / "tiny").iterdir()}
    fake = FakeHub()
    fake.add_repo("acme/tiny-model", files)
    with torch.device("meta"):
        model = TinyTransformer()
    with serve_in_thread(fake) as hub:
        result = shardsync.load(
            "acme/tiny-model",
            model=model,
            device_map="cpu",
            config=fast_config(tmp_path / "cache", hub.endpoint),
        )
    assert isinstance(result, LoadResult)
    assert result.missing_keys == () and result.unexpected_keys == ()
    model.eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids), original(ids))


class _Tied(torch.nn.Module):
    """An embedding and an output head sharing one weight (``tie_word_embeddings=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@pytest.mark.parametrize("strict", [True, False])
def test_tied_weights_saved_once_fill_both_names_and_stay_tied(
    tmp_path: Path, strict: bool
) -> None:
    """safetensors (and transformers) save a tied weight once: both names are filled from it,
    as ``safetensors.torch.load_model`` does, and stay one parameter. The other name was
    "missing" (``strict`` refused the load) and stayed on the meta device."""
    from safetensors.torch import save_model

    torch.manual_seed(0)
    original = _Tied().eval()
    (tmp_path / "tied").mkdir()
    save_model(original, str(tmp_path / "tied" / "model.safetensors"))
    with torch.device("meta"):
        model = _Tied()
    result = shardsync.load(
        str(tmp_path / "tied"),
        model=model,
        device_map="cpu",
        strict=strict,
        config=fast_config(tmp_path / "cache"),
    )
    assert isinstance(result, LoadResult)
    assert result.missing_keys == () and result.unexpected_keys == ()
    assert model.head.weight is model.embed.weight
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), original(ids))


def test_strict_mismatch_fails_before_downloading(hub: FakeHub, tmp_path: Path) -> None:
    with torch.device("meta"):
        model = TinyTransformer()
    with pytest.raises(LoadError, match=r"missing .*embed\.weight"):
        shardsync.load(REPO, model=model, config=fast_config(tmp_path, hub.endpoint))
    assert hub.bytes_served("*.safetensors") <= 3 * 64 * 1024  # only the header probes


def test_loading_starts_before_the_last_shard_arrives(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    hub.faults.add(Bandwidth(2_000_000))
    seen_at: list[float] = []
    # one file at a time: shards are verified in index order, well apart
    config = replace(fast_config(tmp_path, hub.endpoint), max_files=1)
    with shardsync.stream(REPO, device_map="cpu", config=config) as tensors:
        for _name, _tensor in tensors:
            seen_at.append(tensors.statistics().shards_verified[-1])
        stats = tensors.statistics()
    assert stats.first_tensor is not None
    assert stats.first_tensor < stats.shards_verified[-1]


def _malicious_shard(header: dict[str, object], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@pytest.mark.parametrize(
    ("header", "body", "message"),
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8), "needs 16 bytes"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(16), "trailing"),
        ({"b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "index"),
    ],
    ids=["overlap", "shape-mismatch", "trailing-bytes", "not-in-index"],
)
def test_malicious_headers_are_refused_before_download(
    tmp_path: Path, header: dict[str, object], body: bytes, message: str
) -> None:
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors"}}
    files = {
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00001.safetensors": _malicious_shard(header, body),
    }
    fake = FakeHub()
    fake.add_repo("acme/bad", files)
    with serve_in_thread(fake) as hub:
        with pytest.raises(HeaderError, match=message):
            shardsync.load("acme/bad", device_map="cpu", config=fast_config(tmp_path, hub.endpoint))
        body_reads = [r for r in hub.log if r.method == "GET" and r.server == "cdn"]
        assert all(r.range == "bytes=0-65535" for r in body_reads)  # the header probe only


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_placement_is_bit_exact(hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path) -> None:
    config = fast_config(tmp_path, hub.endpoint)
    got = shardsync.load(REPO, device_map="cuda:0", config=config)
    assert isinstance(got, dict)
    assert {t.device.type for t in got.values()} == {"cuda"}
    _assert_bit_exact({k: v.cpu() for k, v in got.items()}, _originals(checkpoint))


@pytest.mark.cuda
@cuda
def test_cuda_auto_map_with_dtype(hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path) -> None:
    config = fast_config(tmp_path, hub.endpoint)
    got = shardsync.load(REPO, device_map="auto", dtype=torch.float32, config=config)
    assert isinstance(got, dict)
    want = _originals(checkpoint)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor.cpu(), want[name].to(torch.float32)), name


@pytest.mark.cuda
@cuda
def test_cuda_staging_ring_reuse_never_corrupts_a_copy() -> None:
    """Many chunks through two tiny pinned buffers, no sync between tensors: a staging buffer
    refilled before its DMA finished would show up as wrong bytes on the device."""
    from shardsync.placement import CudaPlacer

    placer = CudaPlacer("cuda:0", buffers=2, size=4096)
    generator = torch.Generator().manual_seed(0)
    sources = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
        for n in (1, 4095, 4096, 4097, 1 << 20, 3 * 4096 + 17)
    ]
    placed = [placer.place(source, None) for source in sources]
    for source, (out, event) in zip(sources, placed, strict=True):
        event.synchronize()
        assert out.device.type == "cuda"
        assert torch.equal(out.cpu(), source)


@pytest.mark.cuda
@cuda
def test_cuda_split_between_gpu_and_cpu_by_max_memory(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    config = fast_config(tmp_path, hub.endpoint)
    budget = {0: 2 << 20, "cpu": 1 << 30}  # the 6 MiB checkpoint cannot fit on the GPU
    with shardsync.stream(REPO, device_map="auto", max_memory=budget, config=config) as tensors:
        got = {name: tensor for name, tensor in tensors}
    on_gpu = [t for t in got.values() if t.device.type == "cuda"]
    assert on_gpu and {t.device.type for t in got.values()} == {"cuda", "cpu"}
    assert sum(t.nbytes for t in on_gpu) <= 2 << 20
    _assert_bit_exact({k: v.cpu() for k, v in got.items()}, _originals(checkpoint))


@pytest.mark.cuda
@cuda
def test_cuda_fill_a_meta_model_and_match_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    original = TinyTransformer().eval()
    (tmp_path / "tiny").mkdir()
    save_torch_state_dict(original.state_dict(), tmp_path / "tiny", max_shard_size=20_000)
    fake = FakeHub()
    fake.add_repo("acme/tiny-model", {p.name: p for p in (tmp_path / "tiny").iterdir()})
    with torch.device("meta"):
        model = TinyTransformer()
    with serve_in_thread(fake) as hub:
        shardsync.load(
            "acme/tiny-model",
            model=model,
            device_map="cuda:0",
            config=fast_config(tmp_path / "cache", hub.endpoint),
        )
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    model.eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.cuda()).cpu(), original(ids))


def test_cli_load_reports_plan_and_timings(hub: FakeHub, tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsync.cli",
            "load",
            REPO,
            "--endpoint",
            hub.endpoint,
            "--cache-dir",
            str(tmp_path),
            "--device-map",
            "cpu",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [u["device"] for u in report["plan"]] == ["cpu"]
    assert report["tensors"] == report["plan"][0]["tensors"] > 0
    assert report["bytes_downloaded"] >= report["bytes"] > 0
    assert 0 < report["first_tensor_s"] <= report["total_s"]
    assert report["peak_rss_bytes"] > 0


def test_pickle_checkpoints_need_allow_pickle(tmp_path: Path) -> None:
    from shardsync.errors import ManifestError

    torch.manual_seed(1)
    state = {f"layers.{i}.weight": torch.randn(64, 64) for i in range(6)}
    (tmp_path / "bin").mkdir()
    save_torch_state_dict(state, tmp_path / "bin", max_shard_size=40_000, safe_serialization=False)
    files = {p.name: p for p in (tmp_path / "bin").iterdir()}
    assert "pytorch_model.bin.index.json" in files
    fake = FakeHub()
    fake.add_repo("acme/pickled", files)
    with serve_in_thread(fake) as hub:
        config = fast_config(tmp_path / "cache", hub.endpoint)
        with pytest.raises(ManifestError, match="pickle"):
            shardsync.load("acme/pickled", device_map="cpu", config=config)
        assert hub.bytes_served("*.bin") == 0
        with pytest.raises(ConfigError, match="pickle"):
            shardsync.load("acme/pickled", device_map="auto", allow_pickle=True, config=config)
        got = shardsync.load("acme/pickled", device_map="cpu", allow_pickle=True, config=config)
    assert isinstance(got, dict)
    _assert_bit_exact(got, state)


def test_pickle_checkpoints_in_the_pre_zip_format_load_and_bad_names_are_refused(
    tmp_path: Path,
) -> None:
    """``pytorch_model.bin`` files saved before torch 1.6 (BERT-era repos) are no zip, which
    ``mmap=True`` cannot read; ``torch.load`` reads them whole. A state dict whose keys are
    no module paths is a ``LoadError`` naming the file, as the same name in a header is."""
    from shardsync.errors import LoadError

    old = {
        "bert.embeddings.weight": torch.arange(6.0).reshape(2, 3),
        "bert.pooler.bias": torch.ones(4),
    }
    (tmp_path / "old").mkdir()
    torch.save(old, tmp_path / "old" / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    config = fast_config(tmp_path / "cache")
    got = shardsync.load(str(tmp_path / "old"), device_map="cpu", allow_pickle=True, config=config)
    assert isinstance(got, dict)
    _assert_bit_exact(got, old)
    for bad in ("model..weight", "", "lm_head.weight."):
        (tmp_path / "bad").mkdir(exist_ok=True)
        torch.save({bad: torch.ones(2)}, tmp_path / "bad" / "pytorch_model.bin")
        with pytest.raises(LoadError, match=r"pytorch_model\.bin"):
            shardsync.load(
                str(tmp_path / "bad"), device_map="cpu", allow_pickle=True, config=config
            )


def test_a_stream_gets_the_first_shard_before_the_last_one_downloads(tmp_path: Path) -> None:
    """Loading overlaps downloading only if the shards land in the order they are read:
    side by side at equal rates, all four were verified at the end (``bench/overlap.py``)."""
    model = build_checkpoint(tmp_path / "ckpt", total_bytes=8 << 20, n_shards=4, seed=9)
    shard_of = json.loads(model.path(model.index).read_text())["weight_map"]
    first, last = model.shards[0], model.shards[-1]
    fake = FakeHub()
    fake.add_checkpoint("acme/turns", model)
    fake.faults.add(Bandwidth(1_000_000, path="*.safetensors"))  # per connection
    served_then: dict[str, int] = {}
    with serve_in_thread(fake) as hub:
        config = fast_config(tmp_path / "cache", hub.endpoint)
        with shardsync.stream("acme/turns", device_map="cpu", config=config) as tensors:
            for name, _tensor in tensors:
                served_then.setdefault(shard_of[name], hub.bytes_served(last))
    # at most the last shard's header, read before any download to plan the placement
    assert served_then[first] < model.path(last).stat().st_size // 10, served_then


async def _load_through_a_daemon(
    hub: FakeHub, tmp_path: Path, *, own_endpoint: str | None = None, **load: Any
) -> tuple[Any, DaemonStatistics, list[tuple[bool, int]]]:
    """``shardsync.load(REPO)`` by a caller whose config names a daemon in this loop that
    serves ``hub``, at priority 7; the caller's own endpoint is ``own_endpoint`` (else the
    hub). What the load gave, the daemon's statistics, and each of its jobs' ``in_order`` and
    priority."""
    from daemons import daemon_in_loop, short_tmp

    from shardsync.config import DaemonConfig
    from shardsync.jobs import daemon_for

    with short_tmp() as work:
        socket_path = work / "shardsync" / "d.sock"
        async with daemon_in_loop(
            fast_config(work / "daemon-cache", hub.endpoint), socket_path
        ) as daemon:
            mine = replace(
                fast_config(tmp_path / "mine", own_endpoint or hub.endpoint),
                daemon=DaemonConfig(socket=socket_path),
            )
            got = await asyncio.to_thread(
                shardsync.load, REPO, device_map="cpu", priority=7, config=mine, **load
            )
            statistics = daemon.statistics()
            client = await daemon_for(mine, cache_dir=None, endpoint=None)
            assert client is not None
            try:
                in_order = [(job["in_order"], job["priority"]) for job in await client.jobs()]
            finally:
                await client.close()
    return got, statistics, in_order


def _own_blobs(tmp_path: Path) -> list[str]:
    """The blobs in the caller's own cache (``tmp_path / "mine"``)."""
    return [p.name for p in (tmp_path / "mine" / "store").glob("sha256/*/*")]


async def test_a_token_given_to_a_load_is_used_though_a_daemon_answers(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A daemon fetches with its own credentials (none here); a ``token=`` is the caller's
    for this load, which then runs in this process with it, as one naming its own cache or
    Hub does, where the daemon's job failed as ``RepoNotFoundError``."""
    fake_hub.add_checkpoint(REPO, checkpoint, token="hf_secret-for-this-load")
    got, jobs, _ = await _load_through_a_daemon(fake_hub, tmp_path, token="hf_secret-for-this-load")
    assert isinstance(got, dict)
    _assert_bit_exact(got, _originals(checkpoint))
    assert jobs.jobs_submitted == 0 and _own_blobs(tmp_path)


async def test_load_goes_through_a_running_daemon(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """With a daemon serving, the stream's process asks the origin nothing: the daemon lists,
    reads the headers (``POST /v1/prepare``) and downloads. Here the caller's own endpoint
    refuses every connection, so one request of its own would fail the load."""
    import socket

    fake_hub.add_checkpoint(REPO, checkpoint)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: every connection is refused
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
        got, jobs, asked = await _load_through_a_daemon(fake_hub, tmp_path, own_endpoint=nowhere)
    assert isinstance(got, dict)
    _assert_bit_exact(got, _originals(checkpoint))
    assert jobs.jobs_submitted == 1
    # the shards in their turn (the stream reads them in order), at the caller's priority
    assert asked == [(True, 7)]
    assert not _own_blobs(tmp_path)  # the daemon downloaded everything into its cache
    shard_bytes = sum(checkpoint.path(s).stat().st_size for s in checkpoint.shards)
    header_probes = len(checkpoint.shards) * 65536
    assert fake_hub.bytes_served("*.safetensors") <= shard_bytes + header_probes


async def test_a_stream_through_a_daemon_is_leased_in_the_daemons_cache(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream a daemon serves reads the daemon's cache, which need not be the caller's own
    (the system daemon's). The daemon leases the snapshot there while the stream is open, so
    a prune of that cache after the job ended leaves the shards still to be placed; once
    the stream is closed, the lease ends (at the daemon's next heartbeat)."""
    from daemons import daemon_in_loop, short_tmp

    from shardsync import daemon as daemon_module
    from shardsync.cache import CacheStore
    from shardsync.config import DaemonConfig
    from shardsync.prune import prune_cache
    from shardsync.prune_plan import Limits

    monkeypatch.setattr(daemon_module, "_HEARTBEAT_S", 0.2)
    fake_hub.add_checkpoint(REPO, checkpoint)

    def prune(cache: Path) -> list[str]:
        return [e.repo for e in prune_cache(CacheStore(cache), Limits(max_size=0)).evicted]

    with short_tmp() as work:
        socket_path, theirs = work / "shardsync" / "d.sock", work / "daemon-cache"
        async with daemon_in_loop(fast_config(theirs, fake_hub.endpoint), socket_path) as running:
            mine = replace(
                fast_config(tmp_path / "mine", fake_hub.endpoint),
                daemon=DaemonConfig(socket=socket_path),
            )
            stream = await asyncio.to_thread(shardsync.stream, REPO, device_map="cpu", config=mine)
            try:
                first = await asyncio.to_thread(next, stream)
                await until(lambda: running.statistics().jobs.get("done") == 1)
                assert await asyncio.to_thread(prune, theirs) == []  # its own lease ended
                rest = await asyncio.to_thread(list, stream)
            finally:
                await asyncio.to_thread(stream.close)
            _assert_bit_exact(dict([first, *rest]), _originals(checkpoint))
            async with asyncio.timeout(10):
                while await asyncio.to_thread(prune, theirs) != [REPO]:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)  # a prune has no event to await


async def test_a_prepare_slower_than_a_plain_request_still_serves_the_load(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's prepare waits on the origin (here the index, held 1.5 s) and on its own
    retries: the client gives it longer than a request to the daemon alone (cut to 0.5 s
    here, 60 s in use)."""
    from shardsync import daemon_transport
    from shardsync.testing import Latency

    monkeypatch.setattr(daemon_transport, "_REQUEST_TIMEOUT_S", 0.5)
    fake_hub.add_checkpoint(REPO, checkpoint)
    fake_hub.faults.add(Latency(1.5, path="*.index.json", server="hub", times=None))
    got, jobs, _ = await _load_through_a_daemon(fake_hub, tmp_path)
    assert isinstance(got, dict)
    _assert_bit_exact(got, _originals(checkpoint))
    assert jobs.jobs_submitted == 1
    assert not _own_blobs(tmp_path)  # the daemon's work


async def test_a_daemon_older_than_prepare_still_serves_the_load(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon from before ``POST /v1/prepare`` (an upgraded client, the host's daemon not
    yet restarted) answers 404: the loader reads the headers itself, the daemon downloads."""
    from aiohttp import web

    from shardsync.daemon import Daemon

    async def no_route(self: Daemon, request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    monkeypatch.setattr(Daemon, "_prepare", no_route)
    fake_hub.add_checkpoint(REPO, checkpoint)
    got, jobs, _ = await _load_through_a_daemon(fake_hub, tmp_path)
    assert isinstance(got, dict)
    _assert_bit_exact(got, _originals(checkpoint))
    assert jobs.jobs_submitted == 1  # the shards came through the daemon
    index = hashlib.sha256(checkpoint.path(checkpoint.index).read_bytes()).hexdigest()
    assert _own_blobs(tmp_path) == [index]
