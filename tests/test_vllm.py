"""vLLM loads through shardsync (``load_format="shardsync"``), with a real vLLM.

vLLM pins its own torch and transformers, so it lives in a venv of its own (docs/serving.md:
The vLLM venv): ``.venv-vllm`` beside this checkout, or ``$SHARDSYNC_VLLM_PYTHON``. Every
vLLM run is a child process of that venv (``tests/vllm_child.py``); the fake Hub, the daemon
and the checks run here. Without the venv these tests skip.

The reference is vLLM's own default loader reading the same checkpoint from a directory:
greedy tokens must be equal, token for token.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from daemons import cli, short_tmp
from helpers import assert_store_verified, serving

from shardsync.testing import Checkpoint, FakeHub, serve_in_thread
from shardsync.testing.daemons import DaemonProcess, write_config
from shardsync.testing.ports import free_port
from shardsync.testing.seaweedfs import S3Server

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "vllm_child.py"
VLLM_PYTHON = Path(
    os.environ.get("SHARDSYNC_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python"
)
REPO = "acme/tiny-llama"
RESULT = "vllm-child-result: "

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM venv at {VLLM_PYTHON} (docs/serving.md: The vLLM venv, to create it)",
)


def child(
    *args: str, env: Mapping[str, str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VLLM_PYTHON), str(CHILD), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env),
        cwd=ROOT,
    )


def vllm_env(work: Path, hub: FakeHub | None = None, **extra: str) -> dict[str, str]:
    """One process's world: its own caches, no daemon unless given, vLLM in one process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDSYNC_", "HF_"))}
    env.pop("VIRTUAL_ENV", None)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_CACHE=str(work / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
        SHARDSYNC_CACHE_DIR=str(work / "cache"),
        SHARDSYNC_SOCKET=str(work / "no-daemon" / "d.sock"),
    )
    if hub is not None:
        env["HF_ENDPOINT"] = hub.endpoint
    env.update(extra)
    return env


def generate(model: str, load_format: str, env: Mapping[str, str], extra: str = "") -> object:
    args = ["generate", model, load_format, *([extra] if extra else [])]
    done = child(*args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    marked = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    assert len(marked) == 1, done.stdout[-2000:]
    return json.loads(marked[0].removeprefix(RESULT))["tokens"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Checkpoint, object]:
    """A tiny Llama (head size 32, which CPU attention needs) in 10 shards, and a tokenizer;
    and the reference: vLLM's own loader reading its directory (one vLLM process for both)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    work = tmp_path_factory.mktemp("reference")
    done = child("build", str(directory), env=vllm_env(work))
    assert done.returncode == 0, done.stderr[-3000:]
    marked = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    assert len(marked) == 1, done.stdout[-2000:]
    return Checkpoint.scan(directory), json.loads(marked[0].removeprefix(RESULT))["tokens"]


@pytest.fixture(scope="module")
def tiny(built: tuple[Checkpoint, object]) -> Checkpoint:
    return built[0]


@pytest.fixture(scope="module")
def hub(tiny: Checkpoint) -> Iterator[FakeHub]:
    with serving({REPO: tiny}) as running:
        yield running


@pytest.fixture(scope="module")
def reference(built: tuple[Checkpoint, object]) -> object:
    """Greedy tokens of vLLM's own loader, reading the checkpoint's directory."""
    return built[1]


def test_load_format_shardsync_gives_the_default_loaders_tokens_from_the_hub(
    tiny: Checkpoint, hub: FakeHub, reference: object, tmp_path: Path
) -> None:
    """In vLLM's default layout: the engine core in a process of its own, which loads the
    weights, so the plugin must register there too."""
    hub.reset_log()
    env = vllm_env(tmp_path, hub, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    tokens = generate(REPO, "shardsync", env)
    assert tokens == reference
    fetched = {r.file for r in hub.log if r.bytes_sent > 0}
    assert set(tiny.shards) <= fetched  # the shards came from the Hub, through shardsync
    assert_store_verified(tmp_path / "cache", tiny)
    assert not (tmp_path / "hf").exists() or not list((tmp_path / "hf").rglob("*.safetensors"))


def test_the_download_goes_on_while_vllm_builds_the_model_with_the_options_given(
    hub: FakeHub, reference: object, tmp_path: Path
) -> None:
    """vLLM builds the model (allocation, initialization) before it asks for weights; the
    stream opens as its ``load_model`` starts, so a shard is verified while vLLM is still
    building (the child holds the building until one is, at most 15 s). The loader's
    options come from ``model_loader_extra_config``: the cache it names is filled."""
    extra = json.dumps({"shardsync": {"cache_dir": str(tmp_path / "named"), "priority": 3}})
    done = child("early", REPO, extra, env=vllm_env(tmp_path, hub))
    assert done.returncode == 0, done.stderr[-3000:]
    marked = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    assert len(marked) == 1, done.stdout[-2000:]
    answer = json.loads(marked[0].removeprefix(RESULT))
    assert answer["shard_before_model"] is True
    assert answer["tokens"] == reference
    assert list((tmp_path / "named").glob("store/sha256/*/*"))
    assert not (tmp_path / "cache").exists()  # not the environment's cache


def test_download_model_prefetches_and_registering_twice_is_harmless(
    tiny: Checkpoint, hub: FakeHub, tmp_path: Path
) -> None:
    """``download_model`` (what vLLM's download paths call) makes the snapshot complete; the
    entry point runs twice in one process without a second registration."""
    done = child("download", REPO, env=vllm_env(tmp_path, hub))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "already registered" not in done.stderr
    assert_store_verified(tmp_path / "cache", tiny)
    refs = list((tmp_path / "cache").glob("hub/models--acme--tiny-llama/refs/main"))
    assert refs, "no complete snapshot"


def test_vllm_through_the_daemon_downloads_once_per_host(
    tiny: Checkpoint, hub: FakeHub, reference: object
) -> None:
    with short_tmp() as work:
        socket_path = work / "d" / "d.sock"
        conf = write_config(
            work / "d.toml", cache=work / "cache", endpoint=hub.endpoint, socket_path=socket_path
        )
        daemon = DaemonProcess(conf, work)
        try:
            daemon.start()
            env = vllm_env(work, hub, SHARDSYNC_SOCKET=str(socket_path))
            hub.reset_log()
            urgent = json.dumps({"shardsync": {"priority": 5}})  # the daemon's job's
            assert generate(REPO, "shardsync", env, urgent) == reference
            first = hub.bytes_served("*.safetensors")
            assert generate(REPO, "shardsync", env) == reference  # a second instance
            again = hub.bytes_served("*.safetensors")
            status = cli("status", "--json", env={"SHARDSYNC_SOCKET": str(socket_path)})
            # a cache named in the options is filled by vLLM's process, not the daemon's
            named = json.dumps({"shardsync": {"cache_dir": str(work / "named")}})
            assert generate(REPO, "shardsync", env, named) == reference
            third = hub.bytes_served("*.safetensors")
            assert_store_verified(work / "named", tiny)
            assert list((work / "named").glob("store/sha256/*/*"))
        finally:
            daemon.close()
    shards = sum(tiny.path(s).stat().st_size for s in tiny.shards)
    assert first >= shards
    assert again == first  # the second instance read the daemon's cache: no byte again
    assert status.returncode == 0
    assert sorted(job["priority"] for job in json.loads(status.stdout)["jobs"]) == [0, 5]
    assert third - again >= shards


def test_weights_from_s3_with_the_config_from_a_directory(
    tiny: Checkpoint,
    reference: object,
    s3server: S3Server,
    s3bucket: str,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """vLLM takes an ``s3://`` model only for its own loaders, so ``--model`` is a directory
    of the config and tokenizer alone and the ``source`` option names the weights."""
    from test_s3_origin import upload

    upload(s3server, s3bucket, tiny, checksums=True, prefix="models/tiny-llama")
    configs = tmp_path / "configs"
    configs.mkdir()
    for rel in tiny.files:
        if not rel.endswith((".safetensors", ".index.json")):
            shutil.copy(tiny.path(rel), configs / rel)
    conf = tmp_path / "s3.toml"
    conf.write_text(
        f'[s3]\nendpoint = "{s3server.endpoint}"\nregion = "{s3server.region}"\n'
        'addressing = "path"\n'
    )
    source = f"s3://{s3bucket}/models/tiny-llama/"
    extra = json.dumps({"shardsync": {"source": source, "config": str(conf)}})
    assert generate(str(configs), "shardsync", vllm_env(tmp_path), extra) == reference
    assert_store_verified(tmp_path / "cache", tiny)
    assert not list(configs.glob("*.safetensors"))  # vLLM read no weights of its own


def test_missing_weights_are_shardsyncs_clear_error(tiny: Checkpoint, tmp_path: Path) -> None:
    """A repo whose index names a shard the Hub does not have: vLLM builds its config, then
    the load fails with shardsync's error naming the file, not a traceback from vLLM."""
    missing = tiny.shards[3]
    broken = FakeHub()
    broken.add_repo(REPO, {rel: tiny.path(rel) for rel in tiny.files if rel != missing})
    with serve_in_thread(broken) as running:
        done = child("generate", REPO, "shardsync", env=vllm_env(tmp_path, running))
    assert done.returncode != 0
    assert "shardsync.errors" in done.stderr and missing in done.stderr


def test_the_openai_server_answers_with_weights_from_shardsync(
    hub: FakeHub, tmp_path: Path
) -> None:
    port = free_port()
    env = vllm_env(tmp_path, hub)
    with (
        (tmp_path / "server.log").open("w") as log,
        subprocess.Popen(
            [str(VLLM_PYTHON), str(CHILD), "server", REPO, "shardsync", str(port)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        ) as server,
    ):
        try:
            answer = _complete(port, server, deadline=time.monotonic() + 180)
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    assert answer["choices"] and answer["usage"]["completion_tokens"] == 8


def _complete(port: int, server: subprocess.Popen[bytes], *, deadline: float) -> dict[str, object]:
    body = json.dumps({"model": REPO, "prompt": "hello world", "max_tokens": 8, "temperature": 0})
    while True:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}")
        try:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                return dict(json.loads(resp.read()))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
