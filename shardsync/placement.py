"""Putting tensors where they go: the device plan, the bytes on each device, a model's
parameters.

- ``find_devices``: the accelerators present and their budgets (``max_memory``, else each
  GPU's free memory less a reserve); ``plan_from_headers``: the device of every tensor,
  from the shards' safetensors headers, before any shard body lands.
- ``ShardPlacer``: one verified shard's tensors on their devices. CPU (and ``"disk"``)
  tensors are views of a private read-only mapping of the cache blob (no copy unless a dtype
  cast is asked, or an offset is misaligned for its dtype); CUDA ones go through a ring of
  pinned staging buffers on a side stream (``CudaPlacer``) and come with the event their copy
  records. A pickle shard is ``torch.load``ed weights-only and memory-mapped.
- ``fill_model``: ``load(model=...)``: each tensor assigned to the model's parameter of its
  name, a shard's tensors at a time, and the keys that did not match.

torch is imported inside the functions that use it, so importing this module costs none
(``tests/test_structure.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardsync.devicemap import (
    DevicePlan,
    DeviceSpec,
    MaxMemory,
    TensorSize,
    is_module_path,
    plan_device_map,
)
from shardsync.errors import HeaderError, LoadError
from shardsync.manifest import Manifest, ManifestEntry
from shardsync.safetensors_header import Header, TensorInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "CudaPlacer",
    "DeviceMap",
    "ShardPlacer",
    "fill_model",
    "find_devices",
    "plan_from_headers",
]

DeviceMap = DeviceSpec | Mapping[str, DeviceSpec]

_TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
"""safetensors dtypes as torch names them (looked up on torch: an older one may lack some).
The packed sub-byte ones (F4, F6_*) have no torch dtype of one element each."""
_CUDA_RESERVE = 1 << 30  # left free on each GPU for activations, CUDA context, allocator slack


def find_devices(
    max_memory: MaxMemory | None, *, automatic: bool
) -> tuple[tuple[str, ...], Mapping[str | int, int | str]]:
    """The accelerators and their budgets: ``max_memory``, else, for an ``automatic`` map
    (the only kind that plans by them), ``_default_budgets``. Asking a GPU for its free
    memory creates a CUDA context on it: a map that names its devices asks none."""
    import torch

    devices = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    budgets = max_memory
    if budgets is None:
        budgets = _default_budgets(devices) if automatic else {}
    return devices, budgets


def plan_from_headers(
    manifest: Manifest,
    headers: Mapping[str, Header],
    device_map: DeviceMap,
    *,
    devices: Sequence[str],
    budgets: Mapping[str | int, int | str],
    no_split: Sequence[str] | None,
    dtype: torch.dtype | None = None,
) -> DevicePlan | None:
    """The device plan from the headers; None for pickle checkpoints (placed shard by shard).
    A floating tensor counts at ``dtype``, what it is cast to before it is placed (as
    accelerate sizes modules): bf16 weights loaded as float32 take twice their bytes."""
    if not headers:
        return None
    sizes = []
    for entry in manifest.shards:
        for info in headers[entry.path].tensors:
            stored = _torch_dtype(info)  # refused now, before any shard is downloaded
            if not is_module_path(info.name):
                raise HeaderError(
                    f"{entry.path}: tensor {info.name!r} is not a dotted module path "
                    "(an empty part between dots): the device map places tensors by module"
                )
            cast = dtype is not None and stored.is_floating_point and stored != dtype
            nbytes = info.numel * dtype.itemsize if cast and dtype is not None else info.nbytes
            sizes.append(TensorSize(info.name, nbytes))
    return plan_device_map(
        sizes,
        device_map,
        devices=devices,
        max_memory=budgets or None,
        no_split=no_split,
    )


class ShardPlacer:
    """A verified shard's tensors on their devices, one at a time, in the shard's order.

    Each comes out as ``(name, tensor, event, nbytes)``: ``event`` is the CUDA event that the
    tensor's copy records (wait on it before handing the tensor out), None when the tensor is
    ready. A GPU's staging ring is made for its first tensor and kept for the later shards.
    """

    def __init__(self, dtype: torch.dtype | None, device_map: DeviceMap) -> None:
        self.dtype = dtype  # what floating tensors are cast to (None: as stored)
        self._device_map = device_map
        self._placers: dict[str, CudaPlacer] = {}

    def place_safetensors(
        self, file: Path, header: Header, plan: DevicePlan
    ) -> Iterator[tuple[str, torch.Tensor, Any, int]]:
        base = _map_file(file, header.file_size)
        pending: deque[tuple[str, torch.Tensor, Any, int]] = deque()
        for info in header.tensors:
            device = plan.device_of(info.name)
            tensor, event = _tensor_view(base, info), None
            if device.startswith("cuda"):
                placer = self._placers.get(device)
                if placer is None:
                    placer = self._placers[device] = CudaPlacer(device)
                tensor, event = placer.place(tensor, self.dtype)
            elif (
                self.dtype is not None and tensor.dtype != self.dtype and tensor.is_floating_point()
            ):
                tensor = tensor.to(self.dtype)
            pending.append((info.name, tensor, event, info.nbytes))
            # in the shard's order, finished copies out while later ones are in flight
            while pending and (len(pending) > 2 or _is_ready(pending[0][2])):
                yield pending.popleft()
        while pending:
            yield pending.popleft()

    def place_pickle(
        self, entry: ManifestEntry, file: Path, devices: Sequence[str]
    ) -> Iterator[tuple[str, torch.Tensor, Any, int]]:
        """``torch.load(weights_only=True, mmap=True)``: tensors are read lazily from the cache.
        A file saved before torch 1.6 is no zip, which ``mmap`` cannot read: it is read whole."""
        import pickle
        import zipfile

        import torch

        try:
            state = torch.load(
                file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file)
            )
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
            raise LoadError(f"{entry.path}: not a weights-only torch checkpoint: {exc}") from exc
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise LoadError(f"{entry.path}: expected a dict of tensors")
        for name in state:
            if not is_module_path(name):
                raise LoadError(f"{entry.path}: tensor name {name[:200]!r} is no module path")
        sizes = [TensorSize(name, t.nbytes) for name, t in state.items()]
        plan = plan_device_map(sizes, self._device_map, devices=devices)
        for name, tensor in state.items():
            device = plan.device_of(name)
            if device not in ("cpu", "disk"):
                tensor = tensor.to(device)
            if self.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            yield name, tensor, None, tensor.nbytes


def _is_ready(event: Any) -> bool:
    """Whether a placed tensor's copy is done (None: nothing to copy, a CPU or empty one)."""
    return event is None or bool(event.query())


def _default_budgets(devices: Sequence[str]) -> dict[str | int, int | str]:
    """Free memory of each GPU now, minus a reserve; the CPU is unbounded (tensors are mmapped)."""
    import torch

    budgets: dict[str | int, int | str] = {}
    for device in devices:
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        budgets[device] = max(int(free) - max(_CUDA_RESERVE, int(free) // 10), 0)
    return budgets


def _map_file(path: Path, size: int) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private read-only mapping (no bytes read yet)."""
    import torch

    storage: Any = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    # on the CPU whatever the caller's default device (``with torch.device("meta")``)
    return torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)


def _torch_dtype(info: TensorInfo) -> torch.dtype:
    import torch

    dtype = getattr(torch, _TORCH_DTYPES.get(info.dtype, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise HeaderError(
            f"{info.shard}: {info.name}: dtype {info.dtype} is not supported by this torch"
        )
    return dtype


def _tensor_view(base: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    dtype = _torch_dtype(info)
    raw = base[info.start : info.end]
    try:
        flat = raw.view(dtype)
    except RuntimeError:  # offset not aligned for the dtype: one copy of this tensor only
        flat = raw.clone().view(dtype)
    return flat.reshape(info.shape)


class CudaPlacer:
    """Pinned staging ring + side stream for one GPU: host->device copies overlap CPU memcpy."""

    def __init__(self, device: str, *, buffers: int = 4, size: int = 64 << 20) -> None:
        import torch

        self._cuda: Any = torch.cuda  # Stream/Event are untyped in torch's stubs
        self._device = torch.device(device)
        self._stream = self._cuda.Stream(device=self._device)
        self._ring = [
            torch.empty(size, dtype=torch.uint8, device="cpu").pin_memory() for _ in range(buffers)
        ]
        self._ready: list[Any] = [None] * buffers
        self._next = 0

    def place(self, view: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor, Any]:
        import torch

        out = torch.empty(view.shape, dtype=view.dtype, device=self._device)
        # ``out`` may be memory the consumer's stream freed with work still queued on it
        self._stream.wait_stream(self._cuda.current_stream(self._device))
        src = view.reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        size = self._ring[0].numel()
        event = None
        for start in range(0, src.numel(), size):
            n = min(size, src.numel() - start)
            slot = self._next
            self._next = (slot + 1) % len(self._ring)
            if self._ready[slot] is not None:
                self._ready[slot].synchronize()  # the DMA that used this buffer is done
            staging = self._ring[slot][:n]
            staging.copy_(src[start : start + n])
            with torch.cuda.stream(self._stream):
                dst[start : start + n].copy_(staging, non_blocking=True)
                event = self._cuda.Event()
                event.record(self._stream)
            self._ready[slot] = event
        out.record_stream(self._stream)  # the allocator must not reuse it under the copy
        if dtype is not None and out.dtype != dtype and out.is_floating_point():
            current = self._cuda.current_stream(self._device)
            if event is not None:
                current.wait_event(event)
            out = out.to(dtype)  # cast on the device, allocated on the consumer's stream
            event = self._cuda.Event()
            event.record(current)
        return out, event


def fill_model(
    model: torch.nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    shard_of: Mapping[str, str],
    *,
    known: set[str] | None,
    strict: bool,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Assign each tensor to ``model`` in place (``assign=True``), a shard's tensors at a time
    (``shard_of``: the index's weight map); the missing and unexpected keys. ``known``: every
    name of the checkpoint when the headers told them before the download; ``strict`` then
    raises ``LoadError`` on a mismatch before a single shard is downloaded."""
    expected = set(model.state_dict().keys())
    aliases = _aliases(model)

    def filled(names: set[str]) -> set[str]:
        """``names`` and the other names of their tied parameters (saved once)."""
        return names | {a for n in names & aliases.keys() for a in aliases[n]}

    if known is not None:
        _compare_keys(expected, filled(known), strict=strict)
    seen: set[str] = set()
    batch: dict[str, torch.Tensor] = {}
    current: str | None = None
    for name, tensor in tensors:
        seen.add(name)
        shard = shard_of.get(name, "")
        if batch and shard != current:
            _assign(model, batch, aliases)
            batch = {}
        current = shard
        if name in expected:
            batch[name] = tensor
    missing, unexpected = _compare_keys(expected, filled(seen), strict=strict)
    if batch:
        _assign(model, batch, aliases)
    return missing, unexpected


def _aliases(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of a parameter that several names share (tied weights: an embedding and
    the output head), mapped to all of them."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return {n: tuple(group) for group in names.values() if len(group) > 1 for n in group}


def _compare_keys(
    expected: set[str], names: set[str], *, strict: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    missing = tuple(sorted(expected - names))
    unexpected = tuple(sorted(names - expected))
    if strict and (missing or unexpected):
        raise LoadError(
            f"checkpoint does not match the model: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}"
        )
    return missing, unexpected


def _assign(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    aliases: Mapping[str, tuple[str, ...]],
) -> None:
    """Assign ``batch`` in place; a tied parameter's other names then get the very parameter
    assigned (``assign=True`` gives each name a parameter of its own: the tie would break)."""
    try:
        model.load_state_dict(batch, strict=False, assign=True)
    except RuntimeError as exc:
        raise LoadError(f"checkpoint does not fit the model: {exc}") from exc
    for name in batch.keys() & aliases.keys():
        parameter = model.get_parameter(name)
        for other in aliases[name]:
            owner, _, leaf = other.rpartition(".")
            setattr(model.get_submodule(owner), leaf, parameter)


def _few(names: Sequence[str], n: int = 5) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more
