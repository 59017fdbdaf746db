"""Plan which device each tensor of a checkpoint goes to, from sizes alone.

Pure: no I/O, no torch. The loader plans from the safetensors headers before
any shard lands, so each tensor can go straight to its device as its shard is
verified. The inputs mean what they mean to Hugging Face accelerate
(``device_map="auto"|"balanced"|"balanced_low_0"|"sequential"|{prefix: device}``,
``max_memory``, no-split modules), so users can pass the maps they already have.

Where accelerate walks an ``nn.Module`` tree, we only have tensor names: a
*group* (accelerate's no-split module) is found from the names, either a
transformer block such as ``model.layers.12`` or, outside blocks, the parent
module of a tensor (``model.embed_tokens``). A group never straddles two devices
in the automatic modes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Final, Protocol

from shardsync.errors import ConfigError

__all__ = [
    "MODES",
    "Device",
    "DevicePlan",
    "DeviceSpec",
    "DeviceUsage",
    "MaxMemory",
    "TensorSize",
    "TorchDevice",
    "detect_blocks",
    "is_module_path",
    "normalize_device",
    "parse_memory",
    "plan_device_map",
]

Device = str
"""A normalised device: ``"cpu"``, ``"disk"`` or ``"<accelerator>:<index>"``."""

MaxMemory = Mapping[Any, int | str]
"""``max_memory``: a budget (bytes, or ``"20GiB"``) per device name (``"cuda:0"``, ``"cpu"``) or
GPU index, as accelerate takes it. Keys are checked when a plan is made, so a ``dict[str, str]``
or ``dict[int, str]`` of the caller's types as well (``Mapping`` fixes its key type)."""

MODES: Final = frozenset({"auto", "balanced", "balanced_low_0", "sequential"})
"""The automatic planning modes accelerate and transformers accept as ``device_map``."""

_ACCELERATOR_TYPES: Final = frozenset({"cuda", "xpu", "mps", "npu", "mlu", "musa", "hpu"})
_DEVICE_RE: Final = re.compile(r"([a-z]+)(?::([0-9]+))?")
_BLOCK_CONTAINERS: Final = frozenset({"layers", "layer", "blocks", "block", "h"})
_MEMORY_RE: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_UNITS: Final = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_SHOWN_UNMATCHED: Final = 5


class TorchDevice(Protocol):
    """A ``torch.device``, as accelerate's maps may hold (this module imports no torch)."""

    @property
    def type(self) -> str: ...

    @property
    def index(self) -> int | None: ...


DeviceSpec = str | int | TorchDevice
"""A device as callers name it: ``"cuda:1"``, ``1``, ``"cpu"``, ``torch.device("cuda", 1)``."""


def normalize_device(value: DeviceSpec) -> Device:
    """Canonical device name, so ``0``, ``"0"``, ``"cuda"``, ``"cuda:0"`` and
    ``torch.device("cuda", 0)`` compare equal.

    Plain integers (and digit strings, as JSON keys and CLI values arrive) mean
    CUDA devices, as in accelerate; an accelerator without an index is index 0.
    """
    if type(value).__module__ == "torch" and type(value).__name__ == "device":
        value = str(value)  # "cpu", "cuda", "cuda:1": this module imports no torch
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"not a device: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"device index must be >= 0, got {value}")
        return f"cuda:{value}"
    if value in ("cpu", "disk"):
        return value
    if value.isascii() and value.isdigit():
        return f"cuda:{int(value)}"
    match = _DEVICE_RE.fullmatch(value)
    if match is None or match.group(1) not in _ACCELERATOR_TYPES:
        raise ConfigError(
            f"unknown device {value!r}: use 'cpu', 'disk', an index, or one of "
            f"{', '.join(sorted(_ACCELERATOR_TYPES))} with an optional ':<index>'"
        )
    return f"{match.group(1)}:{int(match.group(2) or 0)}"


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string like ``"20GiB"``/``"20GB"``/``"1.5 GiB"``.

    ``GB`` is 10**9 and ``GiB`` 2**30, as in accelerate. Accelerate reads a
    lowercase ``b`` (``"20Gb"``) as bits; that is almost always a typo for bytes,
    so it is refused rather than silently divided by eight.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"memory size must be an int or a string like '20GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"memory size must be >= 0, got {value}")
        return value
    match = _MEMORY_RE.fullmatch(value)
    if match is None:
        raise ConfigError(f"not a memory size: {value!r} (use bytes or e.g. '20GiB', '500MB')")
    number, unit = match.groups()
    if unit.endswith("b") and not unit.lower().endswith("ib"):
        raise ConfigError(
            f"ambiguous memory size {value!r}: a lowercase 'b' means bits to accelerate; "
            f"write {unit[:-1]}B or {unit[:-1]}iB"
        )
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"unknown memory unit {unit!r} in {value!r}")
    return math.floor(Fraction(number) * factor)


def is_module_path(path: str) -> bool:
    """A dotted path without an empty part: what a module's parameter is named (a device
    map's keys are prefixes of it)."""
    return not (path == "" or path.startswith(".") or path.endswith(".") or ".." in path)


@dataclass(frozen=True, slots=True)
class TensorSize:
    """One tensor of the checkpoint as the planner sees it: a dotted name and its bytes."""

    name: str
    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not is_module_path(self.name):
            raise ValueError(f"tensor name must be a dotted path, got {self.name!r}")
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"nbytes of {self.name!r} must be an int >= 0, got {self.nbytes!r}")


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """What one device received. ``layers`` counts the groups (blocks and other modules)."""

    device: Device
    bytes: int
    tensors: int
    layers: int


class _Node:
    """A module-path trie node; ``device`` is the one device of its subtree, None if mixed."""

    __slots__ = ("children", "device", "own")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.own: Device | None = None
        self.device: Device | None = None


def _summarise(node: _Node) -> Device | None:
    devices = set() if node.own is None else {node.own}
    mixed = False
    for child in node.children.values():
        device = _summarise(child)
        if device is None:
            mixed = True
        else:
            devices.add(device)
    node.device = devices.pop() if not mixed and len(devices) == 1 else None
    return node.device


def _emit(node: _Node, path: str, out: dict[str, Device]) -> None:
    if node.device is not None:
        out[path] = node.device
        return
    if node.own is not None:
        out[path] = node.own
    for part, child in node.children.items():
        _emit(child, f"{path}.{part}" if path else part, out)


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """The planner's answer: a device per tensor, and what each device received."""

    assignments: Mapping[str, Device]
    """Tensor name -> device, in checkpoint order; read-only."""
    usage: tuple[DeviceUsage, ...]
    """Accelerators in order, then cpu, then disk; only devices that received something."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "assignments", MappingProxyType(dict(self.assignments)))

    def device_of(self, name: str) -> Device:
        try:
            return self.assignments[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this plan") from None

    def module_map(self) -> dict[str, Device]:
        """Compact accelerate-style ``{prefix: device}``; feeding it back gives the same plan.

        Every module path whose tensors all share one device collapses to one
        key (``{"": "cpu"}`` when everything is on the cpu), as accelerate's
        cleaned device maps do.
        """
        root = _Node()
        for name, device in self.assignments.items():
            node = root
            for part in name.split("."):
                child = node.children.get(part)
                if child is None:
                    child = node.children[part] = _Node()
                node = child
            node.own = device
        out: dict[str, Device] = {}
        if root.children:
            _summarise(root)
            _emit(root, "", out)
        return out


def _parent(name: str) -> str:
    head, dot, _ = name.rpartition(".")
    return head if dot else name


def _block_key(name: str) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 2):
        index = parts[i + 1]
        if parts[i] in _BLOCK_CONTAINERS and index.isascii() and index.isdigit():
            return ".".join(parts[: i + 2])
    return _parent(name)


def detect_blocks(names: Iterable[str]) -> dict[str, str]:
    """Map each tensor name to its no-split group, guessed from the name alone.

    A block is the shortest prefix ``…<layers|layer|blocks|block|h>.<N>`` that
    has more below it (``model.layers.12``, ``transformer.h.0``,
    ``encoder.block.3``); other tensors group by their parent module
    (``model.embed_tokens``), and a top-level tensor is its own group.
    """
    return {name: _block_key(name) for name in names}


def _matches(pattern: tuple[str, ...], parts: list[str]) -> bool:
    return all(p in ("*", q) for p, q in zip(pattern, parts, strict=False))


class _NoSplit:
    """Explicit no-split prefixes; a ``*`` component matches any one component."""

    __slots__ = ("_exact", "_patterns")

    def __init__(self, prefixes: Sequence[str]) -> None:
        if isinstance(prefixes, str):
            raise ConfigError("no_split must be a list of module prefixes, not a string")
        exact: set[str] = set()
        patterns: list[tuple[str, ...]] = []
        for prefix in prefixes:
            path = prefix[:-1] if isinstance(prefix, str) and prefix.endswith(".") else prefix
            if not isinstance(path, str) or not is_module_path(path):
                raise ConfigError(f"no-split prefix must be a dotted module path, got {prefix!r}")
            if "*" in path.split("."):
                patterns.append(tuple(path.split(".")))
            else:
                exact.add(path)
        self._exact = frozenset(exact)
        self._patterns = tuple(patterns)

    def key(self, name: str) -> str:
        parts = name.split(".")
        depth = 0
        prefix = ""
        for i, part in enumerate(parts, 1):
            prefix = f"{prefix}.{part}" if prefix else part
            if prefix in self._exact:
                depth = i
                break
        for pattern in self._patterns:
            shorter = depth == 0 or len(pattern) < depth
            if shorter and len(pattern) <= len(parts) and _matches(pattern, parts):
                depth = len(pattern)
        return ".".join(parts[:depth]) if depth else _parent(name)


def _group_keys(names: Sequence[str], no_split: Sequence[str] | None) -> list[str]:
    if no_split is None:
        return [_block_key(name) for name in names]
    if len(no_split) == 0 and not isinstance(no_split, str):
        return list(names)
    rule = _NoSplit(no_split)
    return [rule.key(name) for name in names]


def _normalize_accelerators(devices: Sequence[str]) -> tuple[Device, ...]:
    if isinstance(devices, str):
        raise ConfigError("devices must be a sequence of device names, not a string")
    seen: list[Device] = []
    for value in devices:
        device = normalize_device(value)
        if device in ("cpu", "disk"):
            raise ConfigError(f"devices lists accelerators only; {device!r} is always available")
        if device in seen:
            raise ConfigError(f"device {device!r} is listed twice in devices")
        seen.append(device)
    return tuple(seen)


def _normalize_budgets(
    max_memory: MaxMemory | None, accelerators: tuple[Device, ...]
) -> dict[Device, int] | None:
    if max_memory is None:
        return None
    budgets: dict[Device, int] = {}
    for key, value in max_memory.items():
        device = normalize_device(key)
        if device == "disk":
            raise ConfigError("max_memory cannot budget 'disk'; use allow_disk to control offload")
        if device != "cpu" and device not in accelerators:
            raise ConfigError(
                f"max_memory names {device!r}, which is not among the available "
                f"accelerators {list(accelerators)}"
            )
        if device in budgets:
            raise ConfigError(f"max_memory gives {device!r} twice ({key!r})")
        budgets[device] = parse_memory(value)
    return budgets


def _check_target(device: Device, accelerators: tuple[Device, ...], allow_disk: bool) -> None:
    if device == "disk" and not allow_disk:
        raise ConfigError("the device map sends tensors to 'disk' but allow_disk is False")
    if device not in ("cpu", "disk") and device not in accelerators:
        raise ConfigError(
            f"device {device!r} is not available; accelerators here: {list(accelerators) or 'none'}"
        )


def _explicit(
    names: Sequence[str],
    device_map: Mapping[str, DeviceSpec],
    accelerators: tuple[Device, ...],
    allow_disk: bool,
) -> list[Device]:
    entries: dict[str, Device] = {}
    for key, value in device_map.items():
        if not isinstance(key, str) or (key != "" and not is_module_path(key)):
            raise ConfigError(f"device map key must be a dotted module path or '', got {key!r}")
        device = normalize_device(value)
        _check_target(device, accelerators, allow_disk)
        entries[key] = device
    out: list[Device] = []
    unmatched: list[str] = []
    for name in names:
        end = len(name)
        found = entries.get(name)
        while found is None and end > 0:
            end = name.rfind(".", 0, end)
            found = entries.get(name[:end]) if end > 0 else entries.get("")
        if found is None:
            unmatched.append(name)
        else:
            out.append(found)
    if unmatched:
        shown = ", ".join(repr(n) for n in unmatched[:_SHOWN_UNMATCHED])
        more = len(unmatched) - _SHOWN_UNMATCHED
        raise ConfigError(
            f"the device map places no device for {len(unmatched)} tensor(s): {shown}"
            + (f" and {more} more" if more > 0 else "")
            + "; add their modules or a '' catch-all key"
        )
    return out


def _budget_chain(
    mode: str,
    group_sizes: Sequence[int],
    accelerators: tuple[Device, ...],
    budgets: dict[Device, int] | None,
    allow_disk: bool,
) -> list[tuple[Device, int | None]]:
    """Devices in fill order with their budgets (None = unbounded), balanced like accelerate.

    Balanced modes cap every accelerator but the last at an even share plus
    the largest group as slack; the last keeps its whole budget so the
    remainder stays on an accelerator rather than spilling to the cpu.
    ``balanced_low_0`` shares among accelerators 1.. and gives accelerator 0
    only what they cannot hold, keeping it free for ``generate()``.
    """
    if budgets is None:
        if accelerators:
            raise ConfigError(
                f"device_map={mode!r} needs max_memory budgets for the accelerators "
                f"{list(accelerators)} (e.g. {{0: '20GiB', 'cpu': '64GiB'}})"
            )
        budgets = {}
    gpus = [device for device in accelerators if budgets.get(device, 0) > 0]
    caps = [budgets[device] for device in gpus]
    if mode != "sequential" and len(gpus) > 1:
        low_zero = mode == "balanced_low_0"
        total = sum(group_sizes)
        share = len(gpus) - 1 if low_zero else len(gpus)
        per_device = -(-total // share) + max(group_sizes, default=0)
        for i in range(1 if low_zero else 0, len(gpus) - 1):
            caps[i] = min(caps[i], per_device)
        if low_zero:
            caps[0] = min(caps[0], max(0, total - sum(caps[1:])))
    chain: list[tuple[Device, int | None]] = [(d, c) for d, c in zip(gpus, caps, strict=True) if c]
    cpu = budgets.get("cpu")
    if cpu != 0:
        chain.append(("cpu", cpu))
    if allow_disk:
        chain.append(("disk", None))
    return chain


def _in_block_order(groups: list[str]) -> list[str]:
    """Groups in checkpoint order, but the numbered blocks of one stack in their numbers'
    order, in the places the stack's blocks took: transformers writes an index's keys sorted
    as text (``layers.10`` before ``layers.2``), and a stack fills devices in the order it
    runs, or its steps go back and forth between them."""

    def numbered(group: str) -> tuple[str, int] | None:
        head, _, tail = group.rpartition(".")
        if not (head and tail.isascii() and tail.isdigit() and len(tail) <= 18):
            return None  # a name, not a block number (past 18 digits: no model has that many)
        return head, int(tail)

    stacks: dict[str, list[tuple[int, str]]] = {}
    for group in groups:
        found = numbered(group)
        if found is not None:
            stacks.setdefault(found[0], []).append((found[1], group))
    turns = {head: iter([g for _, g in sorted(blocks)]) for head, blocks in stacks.items()}
    return [g if (found := numbered(g)) is None else next(turns[found[0]]) for g in groups]


def _fill(
    group_names: Sequence[str], group_sizes: Sequence[int], chain: list[tuple[Device, int | None]]
) -> list[Device]:
    """Sequential filling; a group never straddles two devices.

    A device is closed once a group that would fit in its whole budget no longer
    fits in what is left, and later groups go further down the chain. A group
    larger than a device's whole budget skips that device without closing it,
    so one oversized embedding does not push the rest of the model off the
    accelerators.
    """
    remaining = [budget for _, budget in chain]
    cursor = 0
    out: list[Device] = []
    for key, size in zip(group_names, group_sizes, strict=True):
        index = cursor
        last_full = -1
        while index < len(chain):
            left = remaining[index]
            if left is None or left >= size:
                break
            budget = chain[index][1]
            if budget is not None and budget >= size:
                last_full = index
            index += 1
        if index == len(chain):
            budgets = ", ".join(f"{d}={b}" for d, b in chain)
            raise ConfigError(
                f"{key!r} ({size} bytes) fits on no device (budgets: {budgets or 'none'}) "
                "and disk offload is disabled; raise max_memory or allow disk"
            )
        left = remaining[index]
        if left is not None:
            remaining[index] = left - size
        out.append(chain[index][0])
        if last_full >= 0:
            cursor = last_full + 1
    return out


def _usage(
    sizes: Sequence[int],
    keys: Sequence[str],
    placed: Sequence[Device],
    accelerators: tuple[Device, ...],
) -> tuple[DeviceUsage, ...]:
    totals: dict[Device, list[int]] = {}
    groups: dict[Device, set[str]] = {}
    for size, key, device in zip(sizes, keys, placed, strict=True):
        entry = totals.setdefault(device, [0, 0])
        entry[0] += size
        entry[1] += 1
        groups.setdefault(device, set()).add(key)
    order = (*accelerators, "cpu", "disk")
    return tuple(
        DeviceUsage(device, totals[device][0], totals[device][1], len(groups[device]))
        for device in order
        if device in totals
    )


def plan_device_map(
    tensors: Sequence[TensorSize],
    device_map: DeviceSpec | Mapping[str, DeviceSpec],
    *,
    devices: Sequence[str] = (),
    max_memory: MaxMemory | None = None,
    no_split: Sequence[str] | None = None,
    allow_disk: bool = True,
) -> DevicePlan:
    """Plan a device for every tensor, with accelerate's ``device_map`` semantics.

    ``tensors`` come in checkpoint order; groups are filled in order of first
    appearance, a stack's numbered blocks in their numbers' order. ``devices`` are the
    accelerators present, in order (empty on a CPU-only host). Automatic modes need a
    ``max_memory`` budget per accelerator to use, and use only the accelerators it lists;
    the cpu is unbounded unless budgeted; overflow goes to ``"disk"`` (memory-mapped from the cache)
    when ``allow_disk``. A single device or an explicit ``{prefix: device}``
    map is followed as given, without capacity checks. ``no_split`` replaces
    block detection with explicit prefixes (``*`` matches one component);
    ``[]`` makes every tensor its own group.
    """
    accelerators = _normalize_accelerators(devices)
    budgets = _normalize_budgets(max_memory, accelerators)
    names = [t.name for t in tensors]
    sizes = [t.nbytes for t in tensors]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"tensor {name!r} is listed twice")
            seen.add(name)
    keys = _group_keys(names, no_split)

    placed: list[Device]
    if isinstance(device_map, Mapping):
        placed = _explicit(names, device_map, accelerators, allow_disk)
    elif isinstance(device_map, str) and device_map in MODES:
        group_sizes: dict[str, int] = {}
        for key, size in zip(keys, sizes, strict=True):
            group_sizes[key] = group_sizes.get(key, 0) + size
        groups = _in_block_order(list(group_sizes))
        in_order = [group_sizes[g] for g in groups]
        chain = _budget_chain(device_map, in_order, accelerators, budgets, allow_disk)
        group_device = dict(zip(groups, _fill(groups, in_order, chain), strict=True))
        placed = [group_device[key] for key in keys]
    else:
        device = normalize_device(device_map)
        _check_target(device, accelerators, allow_disk)
        placed = [device] * len(names)

    return DevicePlan(
        assignments=dict(zip(names, placed, strict=True)),
        usage=_usage(sizes, keys, placed, accelerators),
    )
