"""Build real sharded safetensors checkpoints for tests and benchmarks.

The checkpoints look like a transformers decoder (Llama layout: tensor names, shapes and a
matching ``config.json``) filled with seeded random values, and are written by
huggingface_hub's own ``save_torch_state_dict`` so the shard names, the index and the file
format are exactly what the Hub serves. Values are random bits with the top exponent bit
cleared, so every float is finite and tensors compare equal to themselves.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "Checkpoint", "build_checkpoint"]

DTYPES = ("float16", "bfloat16", "float32")
"""Element types `build_checkpoint` can fill."""

INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint directory and the files that make it up."""

    directory: Path
    files: tuple[str, ...]
    """Relative posix paths, sorted."""
    index: str | None
    """The index file's relative path, or None for a single ``model.safetensors``."""

    @classmethod
    def scan(cls, directory: Path) -> Checkpoint:
        """Describe an existing checkpoint directory (every regular file under it)."""
        files = tuple(
            sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
        )
        return cls(directory, files, INDEX_NAME if INDEX_NAME in files else None)

    def path(self, rel: str) -> Path:
        """The local path of the file `rel`."""
        if rel not in self.files:
            raise KeyError(f"{rel} is not part of the checkpoint in {self.directory}")
        return self.directory / rel

    @property
    def shards(self) -> tuple[str, ...]:
        """The weight files, in name (= index) order."""
        return tuple(f for f in self.files if f.endswith(".safetensors"))

    @property
    def total_size(self) -> int:
        """Bytes of all files, i.e. what a full download moves."""
        return sum(self.path(rel).stat().st_size for rel in self.files)


@dataclass(frozen=True, slots=True)
class _Layout:
    hidden: int
    layers: int

    @property
    def intermediate(self) -> int:
        return 2 * self.hidden

    @property
    def vocab(self) -> int:
        return 4 * self.hidden

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes, in the order a transformers model saves them."""
        h, i, v = self.hidden, self.intermediate, self.vocab
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for n in range(self.layers):
            prefix = f"model.layers.{n}"
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[f"{prefix}.self_attn.{proj}.weight"] = (h, h)
            shapes[f"{prefix}.mlp.gate_proj.weight"] = (i, h)
            shapes[f"{prefix}.mlp.up_proj.weight"] = (i, h)
            shapes[f"{prefix}.mlp.down_proj.weight"] = (h, i)
            shapes[f"{prefix}.input_layernorm.weight"] = (h,)
            shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (v, h)
        return shapes

    @classmethod
    def fit(cls, total_bytes: int, n_shards: int, itemsize: int) -> _Layout:
        """A layout of about `total_bytes` with enough tensors to fill `n_shards` shards."""
        layers = max(2, 2 * n_shards)
        # Per layer 4h² (attention) + 6h² (mlp) + 2h, plus 8h² for embeddings and lm_head.
        hidden = math.isqrt(max(total_bytes // itemsize, 1) // (10 * layers + 8))
        if hidden >= 64:
            hidden -= hidden % 8
        else:
            hidden -= hidden % 2  # even, so every attention head has an even dimension
        return cls(max(hidden, 2), layers)

    def config(self, dtype: str) -> dict[str, object]:
        # Up to 32 heads of an even head_dim (RoPE rotates pairs of dimensions; transformers
        # refuses an odd one), and heads * head_dim == hidden_size (q_proj is hidden x hidden).
        heads = math.gcd(self.hidden // 2, 32)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": self.hidden // heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }


def _random_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: str, itemsize: int
) -> torch.Tensor:
    import torch

    count = math.prod(shape)
    words = rng.bit_generator.random_raw((count * itemsize + 7) // 8).view(np.uint8)
    raw = words[: count * itemsize]
    # Clear the top exponent bit of every element: no inf/NaN, so tensors equal themselves.
    top = raw[itemsize - 1 :: itemsize]
    np.bitwise_and(top, 0xBF, out=top)
    int_type = {2: np.int16, 4: np.int32}[itemsize]
    return torch.from_numpy(raw.view(int_type)).view(getattr(torch, dtype)).reshape(shape)


def _max_shard_size(state_dict: dict[str, torch.Tensor], n_shards: int) -> int:
    """The smallest ``max_shard_size`` for which huggingface_hub splits into `n_shards` files."""
    from huggingface_hub import split_torch_state_dict_into_shards

    def count(limit: int) -> int:
        split = split_torch_state_dict_into_shards(state_dict, max_shard_size=limit)
        return len(split.filename_to_tensors)

    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    low, high = 1, total
    while low < high:
        middle = (low + high) // 2
        if count(middle) <= n_shards:
            high = middle
        else:
            low = middle + 1
    if count(low) != n_shards:
        raise ValueError(f"cannot split {total} bytes into exactly {n_shards} shards")
    return low


def _extras(layout: _Layout, dtype: str) -> dict[str, str]:
    tokens = {f"<t{n}>": n for n in range(16)}
    tokenizer: dict[str, object] = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": tokens, "unk_token": "<t0>"},
    }
    return {
        "config.json": json.dumps(layout.config(dtype), indent=2) + "\n",
        "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n",
        "tokenizer.json": json.dumps(tokenizer, indent=2) + "\n",
        "tokenizer_config.json": json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<t0>"}, indent=2
        )
        + "\n",
        "README.md": "# Test checkpoint\n\nRandom weights written by shardsync.testing.\n",
    }


def build_checkpoint(
    directory: Path,
    *,
    total_bytes: int,
    n_shards: int,
    seed: int = 0,
    dtype: str = "float16",
    extras: bool = True,
) -> Checkpoint:
    """Write a sharded safetensors checkpoint of about `total_bytes` into `directory`.

    It has exactly `n_shards` shards (``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json``; a lone ``model.safetensors`` when `n_shards` is 1), the
    same bytes for the same arguments, and with `extras` the small files a model repo carries.
    All tensors are in memory at once (``save_torch_state_dict`` needs them), so keep it to a
    few GB.
    """
    from huggingface_hub import save_torch_state_dict

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, not {n_shards}")
    itemsize = 4 if dtype == "float32" else 2
    layout = _Layout.fit(total_bytes, n_shards, itemsize)
    rng = np.random.Generator(np.random.PCG64(seed))
    state_dict = {
        name: _random_tensor(rng, shape, dtype, itemsize) for name, shape in layout.shapes().items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(
        state_dict, directory, max_shard_size=_max_shard_size(state_dict, n_shards)
    )
    if extras:
        for name, text in _extras(layout, dtype).items():
            (directory / name).write_text(text)
    checkpoint = Checkpoint.scan(directory)
    if len(checkpoint.shards) != n_shards:
        raise RuntimeError(f"{directory} holds other safetensors files: {checkpoint.shards}")
    return checkpoint
