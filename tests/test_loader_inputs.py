"""What the loader takes and what it refuses, judged by the bytes safetensors itself reads.

Every dtype this torch has loads bit-exact (complex and every float8 included), under any
default device of the caller's. A dtype torch lacks, or a tensor name no module has, is a
``HeaderError`` before a shard is downloaded. A shard replaced at its origin between the
header read the plan came from and its download is refused before a tensor is cut from it
at the old offsets, in this process as through a daemon; and a shard a plain URL serves
must end where its header says.
"""

from __future__ import annotations

import functools
import json
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fast_config, s3
from safetensors.torch import load_file, save_file

import shardsync
from shardsync.config import S3Config
from shardsync.errors import HeaderError, LoadError, ShardsyncError
from shardsync.testing.seaweedfs import S3Server

SHARD = "model.safetensors"


def _blobs(cache: Path) -> list[Path]:
    return [p for p in (cache / "store").rglob("*") if p.is_file()]


def _bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert got[name].device.type == "cpu", name
        assert got[name].contiguous().view(-1).view(torch.uint8).tolist() == (
            tensor.contiguous().view(-1).view(torch.uint8).tolist()
        ), name


def _raw_shard(path: Path, header: dict[str, Any], body: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


# ------------------------------------------------------------------------------ dtypes, names


def _of(dtype: str, values: list[float]) -> Callable[[], torch.Tensor]:
    return lambda: torch.tensor(values).to(getattr(torch, dtype))


DTYPES = {
    "complex64": lambda: torch.randn(5, dtype=torch.complex64),
    "float8_e4m3fn": _of("float8_e4m3fn", [0.5, -2.0, 3.0]),
    "float8_e5m2": _of("float8_e5m2", [0.5, -2.0, 3.0]),
    "float8_e4m3fnuz": _of("float8_e4m3fnuz", [0.5, -2.0, 3.0]),
    "float8_e5m2fnuz": _of("float8_e5m2fnuz", [0.5, -2.0, 3.0]),
    "float8_e8m0fnu": _of("float8_e8m0fnu", [0.5, 2.0, 4.0, 8.0]),
    "bfloat16": lambda: torch.randn(3, 7).to(torch.bfloat16),
    "bool": lambda: torch.tensor([True, False, True]),
    "uint16": lambda: torch.tensor([1, 65535, 7], dtype=torch.uint16),
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.zeros(0, 4),
}


@pytest.mark.parametrize("kind", sorted(DTYPES))
def test_every_dtype_this_torch_has_loads_bit_exact(kind: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # two tensors, so one sits at an offset: a misaligned view must still read right
    save_file({"x.w": DTYPES[kind](), "y.w": torch.arange(3, dtype=torch.int8)}, run / SHARD)
    got = shardsync.load(str(run), device_map="cpu", config=fast_config(tmp_path / "cache"))
    assert isinstance(got, dict)
    _bit_exact(got, load_file(run / SHARD))


def test_tensors_load_to_the_cpu_whatever_the_callers_default_device(tmp_path: Path) -> None:
    """A model is often built under ``with torch.device("meta")``; a load there (or after
    ``torch.set_default_device``) still gives the cache's bytes on the CPU."""
    run = tmp_path / "run"
    run.mkdir()
    save_file({"x.w": torch.randn(4, 4), "y.w": torch.randn(3).to(torch.bfloat16)}, run / SHARD)
    with torch.device("meta"):
        got = shardsync.load(str(run), device_map="cpu", config=fast_config(tmp_path / "cache"))
    assert isinstance(got, dict)
    _bit_exact(got, load_file(run / SHARD))


@pytest.mark.parametrize("device_map", ["cpu", {"": "cpu"}])
def test_a_map_that_names_its_devices_asks_no_gpu_for_its_free_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device_map: Any
) -> None:
    """Free memory is what automatic maps (``auto``, ``balanced``, ...) plan with. Asking
    each GPU for it creates a CUDA context there (hundreds of MiB and a second or so per
    GPU): a CPU load on an 8-GPU host must not take a slice of every GPU. The GPUs here are
    a stand-in that fails when asked."""

    def asked(*_: object) -> tuple[int, int]:
        raise AssertionError("a GPU was asked for its free memory")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", asked)
    run = tmp_path / "run"
    run.mkdir()
    save_file({"x.w": torch.randn(4, 4)}, run / SHARD)
    got = shardsync.load(str(run), device_map=device_map, config=fast_config(tmp_path / "cache"))
    assert isinstance(got, dict)
    _bit_exact(got, load_file(run / SHARD))


def test_max_memory_holds_the_tensors_at_the_dtype_they_are_cast_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 weights loaded with ``dtype=torch.float32`` take twice their bytes on the GPU:
    planned at the checkpoint's dtype, a 2.5 MiB budget got two 1 MiB tensors that hold
    4 MiB once cast (accelerate sizes modules at the dtype they load as). One GPU stands in
    for a real one: only the plan is read."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run = tmp_path / "run"
    run.mkdir()
    weight_map = {}
    for i in range(4):  # 1 MiB each as bf16, 2 MiB as float32
        shard = f"model-0000{i + 1}-of-00004.safetensors"
        save_file({f"model.layers.{i}.w": torch.zeros(1 << 19, dtype=torch.bfloat16)}, run / shard)
        weight_map[f"model.layers.{i}.w"] = shard
    index = {"metadata": {}, "weight_map": weight_map}
    (run / "model.safetensors.index.json").write_text(json.dumps(index))
    budget = 5 << 19  # 2.5 MiB
    with shardsync.stream(
        str(run),
        device_map="auto",
        max_memory={"cuda:0": budget},
        dtype=torch.float32,
        config=fast_config(tmp_path / "cache"),
    ) as tensors:
        plan = tensors.plan
        assert plan is not None
        on_gpu = [name for name, device in plan.assignments.items() if device == "cuda:0"]
    assert on_gpu  # one fits
    assert len(on_gpu) * (1 << 19) * torch.float32.itemsize <= budget


@pytest.mark.parametrize(
    "device_map",
    [torch.device("cpu"), {"": torch.device("cpu")}, {"x": torch.device("cpu"), "y": "cpu"}],
    ids=["device", "map-of-device", "mixed-map"],
)
def test_a_torch_device_is_a_device_as_in_accelerate(tmp_path: Path, device_map: Any) -> None:
    """accelerate and transformers take ``torch.device`` values in a device map; a map the
    caller already has works here too."""
    run = tmp_path / "run"
    run.mkdir()
    save_file({"x.w": torch.randn(4, 4), "y.w": torch.randn(3)}, run / SHARD)
    got = shardsync.load(str(run), device_map=device_map, config=fast_config(tmp_path / "cache"))
    assert isinstance(got, dict)
    _bit_exact(got, load_file(run / SHARD))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_shard_split_between_a_gpu_and_the_cpu_keeps_its_order_and_empty_tensors(
    tmp_path: Path,
) -> None:
    """An empty tensor has no copy to wait for, and a CPU tensor after a GPU one waits for
    it: the shard's own order, every tensor bit-exact."""
    run = tmp_path / "run"
    run.mkdir()
    tensors = {
        "a.w": torch.randn(256, 256),
        "b.w": torch.zeros(0, 4),
        "c.w": torch.tensor(2.5),
        "d.w": torch.randn(8),
    }
    save_file(tensors, run / SHARD)
    device_map = {"a": "cuda:0", "b": "cuda:0", "c": "cpu", "d": "cuda:0"}
    config = fast_config(tmp_path / "cache")
    with shardsync.stream(str(run), device_map=device_map, config=config) as stream:
        pairs = list(stream)
    assert [name for name, _ in pairs] == [t.name for t in stream.headers[SHARD].tensors]
    assert {name: t.device.type for name, t in pairs} == {
        "a.w": "cuda", "b.w": "cuda", "c.w": "cpu", "d.w": "cuda"
    }  # fmt: skip
    _bit_exact({name: t.cpu() for name, t in pairs}, load_file(run / SHARD))


@pytest.mark.parametrize(
    ("name", "dtype", "shape", "size"),
    [
        ("w", "F4", [2], 1),  # safetensors reads it; torch has no one-element F4 dtype
        ("w", "F6_E2M3", [4], 3),
        ("a..b", "F32", [1], 4),  # safetensors names it; no module's parameter is named so
        (".w", "F32", [1], 4),
    ],
    ids=["F4", "F6_E2M3", "empty-part", "leading-dot"],
)
def test_what_torch_or_a_module_cannot_hold_is_refused_before_the_download(
    tmp_path: Path, name: str, dtype: str, shape: list[int], size: int
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    header = {name: {"dtype": dtype, "shape": shape, "data_offsets": [0, size]}}
    _raw_shard(run / SHARD, header, bytes(size))
    cache = tmp_path / "cache"
    with pytest.raises(HeaderError):
        shardsync.load(str(run), device_map="cpu", config=fast_config(cache))
    assert _blobs(cache) == []  # refused from the header: the shard was never copied


# ------------------------------------------------------------------------------ a shard replaced


class Replacing(torch.nn.Module):
    """A model whose key check (``state_dict``, before the download starts) replaces the
    shard at its origin: same tensors, same file size, other offsets."""

    def __init__(self, replace_shard: Callable[[], None]) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4))
        self.b = torch.nn.Parameter(torch.zeros(4))
        self._replace: Callable[[], None] | None = replace_shard

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self._replace is not None:
            replace_shard, self._replace = self._replace, None
            replace_shard()
        return super().state_dict(*args, **kwargs)


def _old_and_new(tmp_path: Path) -> tuple[bytes, bytes]:
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    save_file({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}, old)
    save_file({"a": torch.full((2,), 3.0), "b": torch.full((6,), 4.0)}, new)
    return old.read_bytes(), new.read_bytes()


def _assert_never_a_mix(model: Replacing, load: Callable[[], Any]) -> None:
    with pytest.raises(LoadError):
        load()
    for p in (model.a, model.b):  # never the old layout's cut of the new bytes
        assert p.tolist() == [0.0] * 4, (model.a.tolist(), model.b.tolist())


def test_a_local_shard_replaced_between_its_plan_and_its_copy_is_refused(
    tmp_path: Path,
) -> None:
    old, new = _old_and_new(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / SHARD).write_bytes(old)
    model = Replacing(lambda: (run / SHARD).write_bytes(new))
    config = fast_config(tmp_path / "cache")
    _assert_never_a_mix(
        model, lambda: shardsync.load(str(run), model=model, device_map="cpu", config=config)
    )


def test_an_s3_shard_replaced_between_its_plan_and_its_download_is_refused(
    s3server: S3Server, s3bucket: str, aws_env: None, tmp_path: Path
) -> None:
    """In this process (through a daemon: ``test_s3_origin.py``)."""
    old, new = _old_and_new(tmp_path)
    client = s3(s3server)
    key = f"replaced/{SHARD}"
    client.put_object(Bucket=s3bucket, Key=key, Body=old)
    model = Replacing(lambda: client.put_object(Bucket=s3bucket, Key=key, Body=new))
    config = replace(
        fast_config(tmp_path / "cache"), s3=S3Config(s3server.endpoint, s3server.region, "path")
    )
    source = f"s3://{s3bucket}/replaced/"
    _assert_never_a_mix(
        model, lambda: shardsync.load(source, model=model, device_map="cpu", config=config)
    )


# ------------------------------------------------------------------------------ a plain URL


@pytest.fixture
def plain_url(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A plain HTTP server of ``root`` (no sizes known from a listing, as any web server)."""
    root = tmp_path / "www"
    root.mkdir()

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=root))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", root
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("cut", ["trailing-bytes", "short"])
def test_a_plain_url_shard_must_end_where_its_header_says(
    plain_url: tuple[str, Path], tmp_path: Path, cut: str
) -> None:
    url, root = plain_url
    shard = "model-00001-of-00001.safetensors"
    save_file({"w": torch.arange(4, dtype=torch.float32)}, root / shard)
    data = (root / shard).read_bytes()
    (root / shard).write_bytes(data + b"junk" * 8 if cut == "trailing-bytes" else data[:-4])
    index = {"metadata": {}, "weight_map": {"w": shard}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ShardsyncError) as refused:
        shardsync.load(url, device_map="cpu", config=fast_config(tmp_path / "cache"))
    assert isinstance(refused.value, HeaderError), refused.value


@pytest.mark.parametrize(
    "options",
    [
        {"prority": 3},
        {"priority": "high"},
        {"priority": True},
        {"include": "*.safetensors"},
        {"cache_dir": 7},
        {"allow_pickle": "yes"},
        [1, 2],
    ],
)
def test_the_vllm_plugins_options_are_checked_before_anything_runs(options: object) -> None:
    """``model_loader_extra_config["shardsync"]`` comes from a command line as JSON: a typo
    or a wrong type is shardsync's ``ConfigError`` naming it, before any download
    (``tests/test_vllm.py`` shows such an error reaching vLLM's caller)."""
    from types import SimpleNamespace

    from shardsync.errors import ConfigError
    from shardsync.vllm_plugin import _options

    load_config = SimpleNamespace(model_loader_extra_config={"shardsync": options})
    with pytest.raises(ConfigError):
        _options(load_config)
    good = {"priority": 3, "include": ["*.safetensors"], "cache_dir": "/c", "allow_pickle": True}
    parsed = _options(SimpleNamespace(model_loader_extra_config={"shardsync": good}))
    assert (parsed.priority, parsed.include, parsed.cache_dir, parsed.allow_pickle) == (
        3,
        ("*.safetensors",),
        "/c",
        True,
    )


@pytest.mark.parametrize(
    "extra",
    [
        {"source": "s3://models/finetuned/"},
        {"shardsync": {}, "source": "s3://models/finetuned/"},
        {"shardsync_": {"source": "s3://models/finetuned/"}},
    ],
    ids=["unwrapped", "beside", "misspelled"],
)
def test_the_vllm_plugins_options_outside_its_key_are_refused(extra: dict[str, Any]) -> None:
    """Options given beside the ``"shardsync"`` key, or under a misspelled one, were
    dropped without a word: the weights came from ``--model`` (the base model), not the
    ``source`` the command line named (a fine-tune)."""
    from types import SimpleNamespace

    from shardsync.errors import ConfigError
    from shardsync.vllm_plugin import _options

    with pytest.raises(ConfigError):
        _options(SimpleNamespace(model_loader_extra_config=extra))
