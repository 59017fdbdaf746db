"""Run inside the vLLM venv by ``tests/test_vllm.py`` (vLLM cannot live in the project's
venv: it pins its own torch and transformers).

    python tests/vllm_child.py build DIR
        a tiny sharded Llama (hidden 128, 4 heads, 2 layers, vocab 512) and a byte-level
        BPE tokenizer, saved as ``transformers`` saves them; then ``generate DIR auto``,
        vLLM's own loader reading it (the reference), in the same process
    python tests/vllm_child.py generate MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON]
        greedy tokens from ``vllm.LLM``: one line, ``RESULT`` + ``{"tokens": [[...], ...]}``
    python tests/vllm_child.py server MODEL LOAD_FORMAT PORT
        vLLM's OpenAI server (``vllm serve`` is broken in this repackaging)
    python tests/vllm_child.py download MODEL
        vLLM's plugins loaded twice, then the ``shardsync`` loader's ``download_model``
    python tests/vllm_child.py early MODEL [EXTRA_CONFIG_JSON]
        ``generate`` with ``shardsync``, vLLM's model building held until a shard is in
        the cache (15 s at most): ``RESULT`` + ``{"tokens": ..., "shard_before_model": ...}``

The environment (``HF_ENDPOINT``, ``SHARDSYNC_*``, ``VLLM_*``) comes from the parent.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = ["hello world", "the quick brown fox"]
RESULT = "vllm-child-result: "  # marks our line among what vLLM's processes print


def build(directory: Path) -> None:
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
    text = ["hello world " * 40, "the quick brown fox jumps over the lazy dog " * 40]
    tokenizer.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="200KB", safe_serialization=True)


def generate(
    model: str, load_format: str, extra: str | None, also: dict[str, object] | None = None
) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=json.loads(extra) if extra else {},
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    print(RESULT + json.dumps({"tokens": tokens, **(also or {})}), flush=True)


def early(model: str, extra: str | None) -> None:
    """Whether the download runs while vLLM builds the model: its building waits for a
    verified shard in the snapshot, which only a stream opened before it can bring (in the
    cache the options name, else ``$SHARDSYNC_CACHE_DIR``)."""
    import os
    import time

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    named = (json.loads(extra) if extra else {}).get("shardsync", {}).get("cache_dir")
    snapshots = Path(named or os.environ["SHARDSYNC_CACHE_DIR"]) / "hub"
    build = BaseModelLoader.create_model
    seen: dict[str, object] = {}

    def create_model(self: object, *args: object, **kwargs: object) -> object:
        deadline = time.monotonic() + 15
        while not any(snapshots.glob("*/snapshots/*/*.safetensors")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        seen["shard_before_model"] = any(snapshots.glob("*/snapshots/*/*.safetensors"))
        return build(self, *args, **kwargs)  # type: ignore[arg-type]

    BaseModelLoader.create_model = create_model  # type: ignore[method-assign]
    generate(model, "shardsync", extra, seen)


def download(model: str) -> None:
    from types import SimpleNamespace

    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_plugins_by_group

    for _ in range(2):  # vLLM loads plugins in every process: twice is fine
        for plugin in load_plugins_by_group("vllm.general_plugins").values():
            plugin()
    loader = get_model_loader(LoadConfig(load_format="shardsync"))
    loader.download_model(SimpleNamespace(model=model, revision=None))
    print(RESULT + json.dumps({"loader": type(loader).__name__}), flush=True)


def server(model: str, load_format: str, port: str) -> None:
    import runpy

    sys.argv = [
        "vllm",
        *("--model", model, "--load-format", load_format, "--dtype", "float32"),
        *("--max-model-len", "128", "--enforce-eager", "--host", "127.0.0.1", "--port", port),
    ]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")


if __name__ == "__main__":  # vLLM spawns: nothing may run on import
    command, *args = sys.argv[1:]
    if command == "build":
        build(Path(args[0]))
        generate(args[0], "auto", None)
    elif command == "generate":
        generate(args[0], args[1], args[2] if len(args) > 2 else None)
    elif command == "server":
        server(*args)
    elif command == "download":
        download(args[0])
    elif command == "early":
        early(args[0], args[1] if len(args) > 1 else None)
    else:
        raise SystemExit(f"unknown command {command!r}")
