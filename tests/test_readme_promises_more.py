"""Issue 15, item 8: the smaller sentences of the user documents that did not hold, as tests.

Each test reads the sentence it guards from the document under docs/ that holds it, or from
config.example.toml, where it can, and runs the real parts (the CLI, the fake Hub on loopback,
huggingface_hub itself), so it fails if the sentence became false again.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import fast_config, serving

from shardsync.testing import Checkpoint, FakeHub, NoEtag, build_checkpoint, serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
CLI = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
CACHE = (ROOT / "docs" / "cache.md").read_text(encoding="utf-8")
DAEMON = (ROOT / "docs" / "daemon.md").read_text(encoding="utf-8")
LOADING = (ROOT / "docs" / "loading.md").read_text(encoding="utf-8")
EXAMPLE = (ROOT / "config.example.toml").read_text(encoding="utf-8")
REPO = "acme/promises"


def _flat(text: str) -> str:
    """Whitespace (line breaks, the example's comment margins) folded to single spaces."""
    return " ".join(text.replace("#", " ").split())


def _fields(template: str) -> set[str]:
    """Every quoted field name of one of the documents' JSON templates, nested ones included."""
    return set(re.findall(r'"(\w+)"', template))


def _template(pattern: str) -> set[str]:
    """The field names of the docs/daemon.md template that `pattern`'s first group matches."""
    match = re.search(pattern, DAEMON, re.M | re.S)
    assert match, pattern
    return _fields(match.group(1))


def _keys(value: Any) -> set[str]:
    """Every key of a JSON value, at any depth."""
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt"), total_bytes=1 << 20, n_shards=3, seed=8
    )


# ----------------------------------------------------------------- the max_bandwidth floor


def test_the_documented_max_bandwidth_floor_is_the_one_enforced(tmp_path: Path) -> None:
    """docs/daemon.md (Priority) and config.example.toml: `max_bandwidth` must be at least
    `max_files x connections_per_file x min_throughput` (2 MiB/s with the defaults); a lower
    value is refused (exit 2), the floor itself is accepted."""
    from shardsync.cli import main
    from shardsync.config import load_config
    from shardsync.errors import ConfigError

    rule = "max_files x connections_per_file x min_throughput"
    assert rule in _flat(DAEMON) and rule in _flat(EXAMPLE)
    default = load_config(None, {})
    product = default.max_files * default.fetch.connections_per_file
    assert product * default.fetch.min_throughput == 2 << 20
    assert "(2 MiB/s with the defaults: 4 x 16 x 32 KiB/s)" in _flat(DAEMON)
    assert "(4 x 16 x 32KiB = 2MiB/s by default)" in _flat(EXAMPLE)
    assert (default.max_files, default.fetch.connections_per_file) == (4, 16)
    assert default.fetch.min_throughput == 32 << 10

    floor = 3 * 5 * (10 << 10)  # with other settings: exactly their product
    download = '[download]\nmax_files = 3\nconnections_per_file = 5\nmin_throughput = "10KiB"\n'
    path = tmp_path / "c.toml"
    for value, ok in ((floor, True), (floor - 1, False)):
        path.write_text(f"{download}[daemon]\nmax_bandwidth = {value}\n")
        if ok:
            assert load_config(path, {}).daemon.max_bandwidth == floor
        else:
            with pytest.raises(ConfigError, match=f"daemon.max_bandwidth.*{floor}"):
                load_config(path, {})
        path.write_text(download)
        env = {"SHARDSYNC_MAX_BANDWIDTH": str(value)}
        if ok:
            assert load_config(path, env).daemon.max_bandwidth == floor
        else:
            with pytest.raises(ConfigError, match=f"^SHARDSYNC_MAX_BANDWIDTH.*{floor}"):
                load_config(path, env)
    path.write_text(f"{download}[daemon]\nmax_bandwidth = {floor - 1}\n")
    assert main(["--config", str(path), "ls", "--cache-dir", str(tmp_path)]) == 2


# -------------------------------------------------------------------- the pickle refusal


def test_the_pickle_refusal_names_the_flag_and_the_argument(tmp_path: Path) -> None:
    """The refusal names `--allow-pickle` (prefetch's flag, which works) and `allow_pickle=True`
    (Python), and says that `shardsync load` has neither: it streams safetensors only."""
    import torch
    from test_readme_contract import _subcommands

    (tmp_path / "bin").mkdir()
    torch.save({"w": torch.zeros(4)}, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text("{}")
    fake = FakeHub()
    fake.add_repo(REPO, {p.name: p for p in (tmp_path / "bin").iterdir()})
    commands = _subcommands()
    assert "--allow-pickle" in commands["prefetch"]
    assert "--allow-pickle" not in commands["load"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "shardsync.cli",
                *args,
                "--endpoint",
                fake.endpoint,
                "--cache-dir",
                str(tmp_path / "cache"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    with serve_in_thread(fake):
        refused = cli("prefetch", REPO, "--no-daemon", "--quiet")
        loaded = cli("load", REPO, "--device-map", "cpu")
        allowed = cli("prefetch", REPO, "--no-daemon", "--quiet", "--allow-pickle")
    for out in (refused, loaded):
        assert out.returncode == 5, out.stderr
        assert "--allow-pickle" in out.stderr and "allow_pickle=True" in out.stderr
        assert "`shardsync load` streams safetensors only" in out.stderr
    assert "pass allow_pickle=True" not in refused.stderr
    assert allowed.returncode == 0, allowed.stderr
    assert (Path(allowed.stdout.strip()) / "pytorch_model.bin").is_file()


# ------------------------------------------------------- the loading examples, as written


class _StandIn:
    """What docs/loading.md leaves to the reader: `MyModel(config)`. A transformers Llama when
    transformers is installed (build_checkpoint's config.json is one), else a module with the
    checkpoint's parameter names and shapes."""

    @staticmethod
    def model_class(checkpoint: Checkpoint) -> tuple[Any, Any]:
        try:
            from transformers import AutoConfig, LlamaForCausalLM
        except ImportError:
            pass
        else:
            return LlamaForCausalLM, AutoConfig.from_pretrained(checkpoint.directory)
        import torch
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        for shard in checkpoint.shards:
            with safe_open(checkpoint.path(shard), "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[name] = tuple(f.get_slice(name).get_shape())

        class MyModel(torch.nn.Module):
            def __init__(self, config: dict[str, tuple[int, ...]]) -> None:
                super().__init__()
                for name, shape in config.items():
                    *path, leaf = name.split(".")
                    module: torch.nn.Module = self
                    for part in path:
                        if not hasattr(module, part):
                            module.add_module(part, torch.nn.Module())
                        module = getattr(module, part)
                    module.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape)))

        return MyModel, shapes


def test_the_loading_examples_run_as_written(
    checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/loading.md, "Loading while downloading": the ```python block runs as written, with
    the fake Hub as `HF_ENDPOINT`, its repo for "org/model", the reader's `MyModel(config)`,
    and "cpu" for "cuda:0" where there is no GPU. The model example asks `strict=False`, so
    the keys it prints are reported rather than raised."""
    import torch

    from shardsync.loader import LoadResult

    (code,) = re.findall(r"```python\n(.*?)```", LOADING, re.S)
    assert "strict=False" in code and "print(result.missing_keys" in code
    code = code.replace('"org/model"', repr(REPO))
    if not torch.cuda.is_available():
        code = code.replace('"cuda:0"', '"cpu"')
    model_class, config = _StandIn.model_class(checkpoint)
    namespace: dict[str, Any] = {"MyModel": model_class, "config": config}
    monkeypatch.setenv("SHARDSYNC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SHARDSYNC_SOCKET", str(tmp_path / "no-daemon" / "d.sock"))
    with serving({REPO: checkpoint}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        exec(compile(code, "docs/loading.md", "exec"), namespace)
    state, result = namespace["state"], namespace["result"]
    assert isinstance(result, LoadResult)
    model = namespace["model"]
    assert set(state) == set(model.state_dict())
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert (result.missing_keys, result.unexpected_keys) == ((), ())
    assert not any(p.is_meta for p in model.parameters())


def test_a_model_example_with_strict_would_have_raised_before_printing(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Why the example says `strict=False`: with the default `strict=True` a mismatch raises
    `LoadError` (before the download), so `missing_keys` is only ever worth printing without."""
    import torch

    import shardsync
    from shardsync.errors import LoadError

    class Partial(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Parameter(torch.empty(2))

    config = fast_config(tmp_path / "cache")
    with serving({REPO: checkpoint}) as hub:
        config = fast_config(tmp_path / "cache", hub.endpoint)
        with torch.device("meta"):
            model = Partial()
        with pytest.raises(LoadError):
            shardsync.load(REPO, model=model, device_map="cpu", config=config)
        result = shardsync.load(REPO, model=model, device_map="cpu", config=config, strict=False)
    assert result.missing_keys == ("extra",)
    assert len(result.unexpected_keys) > 0


# ------------------------------------------------------------------ status --json's shape


async def test_status_json_is_the_documented_object(
    fake_hub: FakeHub, checkpoint: Checkpoint
) -> None:
    """docs/daemon.md: `status --json` prints `{"daemon": <GET /v1/status>, "jobs": [<job>,
    ...], "cache": <GET /v1/cache>}`, each with the fields the API table names."""
    from daemons import daemon_in_loop, short_tmp

    import shardsync
    from shardsync.config import DaemonConfig

    assert '`{"daemon": <GET /v1/status>, "jobs": [<job>, ...] (GET /v1/jobs), "cache": ' in (
        _flat(DAEMON)
    )
    status_fields = _template(r"^\| `GET /v1/status` \| `(\{.*?\})`")
    cache_fields = _template(r"^\| `GET /v1/cache` \| `(\{.*?\})`")
    job_fields = _template(r"^A \*\*job\*\*: `(\{.*?\})`")
    assert {"version", "max_bandwidth"} <= status_fields and "disk_free" in cache_fields
    assert {"id", "merged_into", "snapshot_path"} <= job_fields

    fake_hub.add_checkpoint(REPO, checkpoint)
    with short_tmp() as work:
        socket_path = work / "shardsync" / "d.sock"
        config = fast_config(work / "dc", fake_hub.endpoint)
        async with daemon_in_loop(config, socket_path):
            client_config = replace(config, daemon=DaemonConfig(socket=socket_path))
            async with shardsync.Client(client_config, fallback="error") as client:
                await (await client.prefetch(REPO)).wait()
            env = {**os.environ, "SHARDSYNC_SOCKET": str(socket_path)}
            out = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "shardsync.cli", "status", "--json"],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
        gone = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "shardsync.cli", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert set(shown) == {"daemon", "jobs", "cache"}
    assert status_fields <= _keys(shown["daemon"])
    assert cache_fields <= _keys(shown["cache"])
    assert isinstance(shown["jobs"], list) and len(shown["jobs"]) == 1
    assert job_fields <= _keys(shown["jobs"][0])
    assert shown["jobs"][0]["repo"] == REPO and shown["jobs"][0]["state"] == "done"
    assert gone.returncode == 11, gone.stderr


# ------------------------------------------------------- ls: huggingface_hub's own downloads


def test_ls_shows_a_repo_huggingface_hub_downloaded_as_foreign(
    checkpoint: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cache.md, `ls`: a snapshot huggingface_hub itself downloaded into `<root>/hub` is
    flagged foreign (in `ls` and `ls --json`), shows as not complete and never used, and
    `prune` never touches it."""
    from huggingface_hub import snapshot_download

    from shardsync.cli import main
    from shardsync.prefetch import prefetch

    assert "pinned, leased, foreign." in _flat(CACHE) and '"foreign": false' in CACHE
    cache = tmp_path / "cache"
    with serving({REPO: checkpoint, "acme/theirs": checkpoint}) as hub:
        asyncio.run(prefetch(REPO, fast_config(cache, hub.endpoint)))
        snapshot_download("acme/theirs", cache_dir=cache / "hub", endpoint=hub.endpoint)

    def run(*args: str, code: int = 0) -> str:
        capsys.readouterr()
        assert main([*args, "--cache-dir", str(cache)]) == code
        return capsys.readouterr().out

    listing = json.loads(run("ls", "--json"))
    by_repo = {r["repo"]: r for r in listing["repos"]}
    (theirs,) = by_repo["acme/theirs"]["snapshots"]
    (mine,) = by_repo[REPO]["snapshots"]
    assert theirs["foreign"] is True and mine["foreign"] is False
    assert theirs["complete"] is False and theirs["last_used"] is None
    assert listing["foreign_bytes"] > 0
    rows = {line.split()[0]: line.split() for line in run("ls").splitlines()[1:-1]}
    assert rows["acme/theirs"][-3:] == ["no", "never", "foreign"]
    assert rows[REPO][-1] == "-"

    report = json.loads(run("prune", "--max-size", "0", "--json", code=8))  # theirs is left
    assert {p["repo"]: p["reason"] for p in report["protected"]}["acme/theirs"] == "foreign"
    assert all(e["repo"] != "acme/theirs" for e in report["evicted"])


# ------------------------------------------------- a refused connection over plain http


def test_a_refused_http_connection_says_what_failed_without_aiohttp_internals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An `http://` endpoint on a closed loopback port: exit 6, a message naming the host,
    the port and the reason, and nothing of aiohttp's connection key (`ssl:default`)."""
    from shardsync.cli import main

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again when the block ends: nobody listens
    config = tmp_path / "c.toml"
    config.write_text(
        "[retry]\nmax_attempts = 2\nbase_delay = 0.01\nmax_delay = 0.01\n"
        f'[daemon]\nsocket = "{tmp_path / "none" / "d.sock"}"\n'
    )
    cache = ("--cache-dir", str(tmp_path / "cache"), "--no-daemon", "--quiet")
    endpoint = f"http://127.0.0.1:{port}"
    for source, extra in ((REPO, ("--endpoint", endpoint)), (f"{endpoint}/m/", ())):
        assert main(["--config", str(config), "prefetch", source, *extra, *cache]) == 6
        err = capsys.readouterr().err
        assert f"cannot connect to 127.0.0.1:{port}: Connection refused" in err, err
        assert "ssl" not in err.lower()


# ---------------------------------------------------------- build_checkpoint's config.json


@pytest.mark.parametrize(
    ("total_bytes", "n_shards", "dtype"),
    [
        (1, 1, "float16"),
        (4096, 1, "float16"),
        (128 << 10, 2, "float16"),
        (384 << 10, 3, "bfloat16"),
        (1 << 20, 4, "float32"),
        (16 << 20, 4, "float16"),
    ],
)
def test_build_checkpoints_config_is_a_consistent_llama(
    tmp_path: Path, total_bytes: int, n_shards: int, dtype: str
) -> None:
    """`build_checkpoint` writes a `config.json` that matches its tensors: heads x head_dim ==
    hidden_size, an even head_dim (RoPE rotates pairs), and every shape it implies; and
    transformers, where installed, loads it and builds a model with exactly these tensors."""
    from safetensors import safe_open

    ckpt = build_checkpoint(tmp_path, total_bytes=total_bytes, n_shards=n_shards, dtype=dtype)
    config = json.loads(ckpt.path("config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config["head_dim"]
    assert heads * head_dim == hidden and head_dim % 2 == 0
    assert heads % config["num_key_value_heads"] == 0
    shapes = {}
    for shard in ckpt.shards:
        with safe_open(ckpt.path(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    assert shapes["model.embed_tokens.weight"] == (config["vocab_size"], hidden)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (heads * head_dim, hidden)
    kv = config["num_key_value_heads"] * head_dim
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv, hidden)
    assert shapes["model.layers.0.mlp.up_proj.weight"] == (config["intermediate_size"], hidden)
    layers = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.")}
    assert layers == set(range(config["num_hidden_layers"]))
    assert math.prod(shapes["lm_head.weight"]) == config["vocab_size"] * hidden

    transformers = pytest.importorskip("transformers")
    import torch

    loaded = transformers.AutoConfig.from_pretrained(ckpt.directory)
    assert loaded.head_dim == head_dim
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(loaded)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes


# ------------------------------------------------------------ a plain URL without an ETag


@pytest.mark.parametrize("etag", ["strong", "none", "weak"])
def test_a_plain_url_without_a_strong_etag_is_downloaded_again_every_run(
    checkpoint: Checkpoint, tmp_path: Path, etag: str
) -> None:
    """docs/cli.md, prefetch: a second run from a plain URL downloads nothing while the server
    sends a strong ETag, and every file again when it sends none (or only a weak one); the
    same bytes are still stored once."""
    from shardsync.prefetch import prefetch

    flat = _flat(CLI)
    assert "sends no `ETag` (or only a weak `W/` one)" in flat
    assert "**every run downloads every file again** (the same bytes are still stored once)" in (
        flat
    )
    cache = tmp_path / "cache"
    with serving({REPO: checkpoint}) as hub:
        if etag != "strong":
            hub.faults.add(NoEtag(weak=etag == "weak"))
        source = f"{hub.endpoint}/{REPO}/resolve/main/"
        config = fast_config(cache)
        first = asyncio.run(prefetch(source, config))
        blobs = sorted((cache / "store").rglob("*"))
        served = hub.bytes_served()
        hub.reset_log()
        second = asyncio.run(prefetch(source, config))
        again = hub.bytes_served()
        methods = {r.method for r in hub.log if r.file is not None}
    assert served == first.bytes_downloaded == first.total_size > 0
    assert set(checkpoint.shards) <= {f.path for f in second.files}
    if etag == "strong":
        assert again == second.bytes_downloaded == 0
        assert methods == {"HEAD"}
    else:
        assert again == second.bytes_downloaded == second.total_size == first.total_size
        assert all(f.source == "network" for f in second.files)
    assert sorted((cache / "store").rglob("*")) == blobs
