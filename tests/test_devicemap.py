"""Table-driven tests for the pure device-map planner: no torch, no I/O, no event loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from shardsync.devicemap import (
    DevicePlan,
    DeviceUsage,
    TensorSize,
    detect_blocks,
    normalize_device,
    parse_memory,
    plan_device_map,
)
from shardsync.errors import ConfigError

GiB = 2**30

# A decoder: embed (100 B), 12 blocks of 4 tensors of 25 B (100 B each), norm (10 B), lm_head
# (100 B). Total 1410 B, 15 groups, largest group 100 B.
BLOCK_PARTS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
DECODER = [
    TensorSize("model.embed_tokens.weight", 100),
    *(TensorSize(f"model.layers.{i}.{part}.weight", 25) for i in range(12) for part in BLOCK_PARTS),
    TensorSize("model.norm.weight", 10),
    TensorSize("lm_head.weight", 100),
]
GROUPS = [
    "model.embed_tokens",
    *(f"model.layers.{i}" for i in range(12)),
    "model.norm",
    "lm_head",
]
TOTAL = 1410

GPU1 = ("cuda:0",)
GPU2 = ("cuda:0", "cuda:1")
GPU3 = ("cuda:0", "cuda:1", "cuda:2")
GPU4 = ("cuda:0", "cuda:1", "cuda:2", "cuda:3")


def runs(spec: str) -> list[str]:
    """``runs("cuda:0*3 cpu*2")`` -> one device per group, in group order."""
    out: list[str] = []
    for run in spec.split():
        device, count = run.split("*")
        out += [device] * int(count)
    return out


def group_devices(plan: DevicePlan) -> list[str]:
    """One device per group; fails if a group straddles devices."""
    keys = detect_blocks(plan.assignments)
    by_group: dict[str, set[str]] = {}
    for name, device in plan.assignments.items():
        by_group.setdefault(keys[name], set()).add(device)
    assert list(by_group) == GROUPS
    for key, devices in by_group.items():
        assert len(devices) == 1, f"{key} straddles {devices}"
    return [next(iter(by_group[key])) for key in GROUPS]


def bytes_by_device(plan: DevicePlan) -> dict[str, int]:
    return {u.device: u.bytes for u in plan.usage}


# --- automatic modes over capacity tables ------------------------------------------------

G2 = {0: 1000, 1: 1000}
G4 = dict.fromkeys(range(4), 1000)

AUTO = [
    # (id, device_map, devices, max_memory, expected device per group)
    ("cpu-only-unbounded", "auto", (), None, "cpu*15"),
    ("cpu-only-budget-to-disk", "auto", (), {"cpu": 1000}, "cpu*10 disk*5"),
    ("cpu-only-sequential", "sequential", (), {"cpu": "1000"}, "cpu*10 disk*5"),
    ("gpus-unlisted-means-cpu", "auto", GPU2, {"cpu": 10**6}, "cpu*15"),
    ("1gpu-sequential", "sequential", GPU1, {0: 600}, "cuda:0*6 cpu*9"),
    ("1gpu-auto-is-sequential", "auto", GPU1, {0: 600}, "cuda:0*6 cpu*9"),
    ("1gpu-low0-is-sequential", "balanced_low_0", GPU1, {"cuda:0": 600}, "cuda:0*6 cpu*9"),
    ("1gpu-cpu-then-disk", "sequential", GPU1, {0: 600, "cpu": 500}, "cuda:0*6 cpu*5 disk*4"),
    ("1gpu-no-cpu-to-disk", "auto", GPU1, {"cuda": "1KiB", "cpu": 0}, "cuda:0*10 disk*5"),
    ("1gpu-fits-exactly", "auto", GPU1, {"cuda": "1410", "cpu": 0}, "cuda:0*15"),
    ("2gpu-sequential", "sequential", GPU2, G2, "cuda:0*10 cuda:1*5"),
    # share = ceil(1410 / 2) + 100 = 805 on cuda:0; the last GPU keeps its full budget.
    ("2gpu-balanced", "balanced", GPU2, G2, "cuda:0*8 cuda:1*7"),
    ("2gpu-auto-is-balanced", "auto", GPU2, G2, "cuda:0*8 cuda:1*7"),
    ("2gpu-capped", "balanced", GPU2, {0: 300, 1: 1000, "cpu": 0}, "cuda:0*3 cuda:1*10 disk*2"),
    # low_0: cuda:1 keeps 1000, cuda:0 only gets the 410 B cuda:1 cannot hold.
    ("2gpu-low0", "balanced_low_0", GPU2, G2, "cuda:0*4 cuda:1*10 cpu*1"),
    ("2gpu-low0-roomy", "balanced_low_0", GPU2, {0: 2000, 1: 2000}, "cuda:1*15"),
    ("2gpu-only-listed-used", "sequential", GPU2, {1: 600}, "cuda:1*6 cpu*9"),
    ("2gpu-zero-budget-skipped", "balanced", GPU2, {0: 0, 1: 600}, "cuda:1*6 cpu*9"),
    # cuda:1 = min(600, ceil(1410 / 2) + 100), cuda:2 = 600, cuda:0 = 1410 - 1200 = 210.
    (
        "3gpu-low0",
        "balanced_low_0",
        GPU3,
        dict.fromkeys(range(3), 600),
        "cuda:0*2 cuda:1*6 cuda:2*6 cpu*1",
    ),
    # share = ceil(1410 / 4) + 100 = 453.
    ("4gpu-balanced", "balanced", GPU4, G4, "cuda:0*4 cuda:1*4 cuda:2*4 cuda:3*3"),
    ("4gpu-sequential", "sequential", GPU4, G4, "cuda:0*10 cuda:1*5"),
    (
        "4gpu-tight",
        "auto",
        GPU4,
        dict.fromkeys(range(4), 250) | {"cpu": 300},
        "cuda:0*2 cuda:1*2 cuda:2*2 cuda:3*2 cpu*3 disk*4",
    ),
    (
        "4gpu-exact-fit",
        "sequential",
        GPU4,
        {0: 400, 1: 400, 2: 400, 3: 210},
        "cuda:0*4 cuda:1*4 cuda:2*4 cuda:3*3",
    ),
    ("order-follows-devices", "sequential", ("cuda:1", "cuda:0"), G2, "cuda:1*10 cuda:0*5"),
    ("xpu", "auto", ("xpu:0", "xpu:1"), {"xpu": 1000, "xpu:1": 1000}, "xpu:0*8 xpu:1*7"),
]


@pytest.mark.parametrize(
    ("device_map", "devices", "max_memory", "spec"),
    [c[1:] for c in AUTO],
    ids=[c[0] for c in AUTO],
)
def test_auto_modes(
    device_map: str,
    devices: Sequence[str],
    max_memory: Mapping[str | int, int | str] | None,
    spec: str,
) -> None:
    plan = plan_device_map(DECODER, device_map, devices=devices, max_memory=max_memory)
    expected = runs(spec)
    assert group_devices(plan) == expected
    if "disk" not in expected:
        no_disk = plan_device_map(
            DECODER, device_map, devices=devices, max_memory=max_memory, allow_disk=False
        )
        assert no_disk == plan
    # Budgets are respected on every bounded device.
    budgets = {normalize_device(k): parse_memory(v) for k, v in (max_memory or {}).items()}
    for device, used in bytes_by_device(plan).items():
        assert used <= budgets.get(device, TOTAL)
    # Usage adds up and lists devices in order: accelerators, cpu, disk.
    assert sum(u.bytes for u in plan.usage) == TOTAL
    assert sum(u.tensors for u in plan.usage) == len(DECODER)
    assert sum(u.layers for u in plan.usage) == len(GROUPS)
    order = [*devices, "cpu", "disk"]
    assert [u.device for u in plan.usage] == [d for d in order if d in set(expected)]


@pytest.mark.parametrize("device_map", ["sequential", "balanced"])
def test_blocks_fill_devices_in_their_numbers_order_whatever_the_index_order(
    device_map: str,
) -> None:
    """transformers writes an index's keys sorted as text, so a checkpoint lists
    ``layers.10`` before ``layers.2``: a stack split in that order runs back and forth
    between devices at every step. Blocks go to devices in their numbers' order."""
    as_text = sorted(DECODER, key=lambda t: t.name)
    plan = plan_device_map(as_text, device_map, devices=GPU2, max_memory=G2)
    device_of = {i: plan.device_of(f"model.layers.{i}.mlp.up_proj.weight") for i in range(12)}
    order = [device_of[i] for i in range(12)]
    assert order == sorted(order) and len(set(order)) == 2  # one cut, between two blocks


def test_a_block_number_past_any_model_is_a_name_not_a_crash() -> None:
    """A header naming ``model.layers.<5000 digits>.weight`` ended the plan in Python's own
    ``ValueError`` (its int limit), a traceback: such a number is no block's."""
    huge = f"model.layers.{'7' * 5000}"
    tensors = [*DECODER, TensorSize(f"{huge}.weight", 25)]
    plan = plan_device_map(tensors, "sequential", devices=GPU2, max_memory=G2)
    assert plan.device_of(f"{huge}.weight") in GPU2


def test_balanced_spreads_roughly_evenly() -> None:
    for devices in (GPU2, GPU3, GPU4):
        plan = plan_device_map(
            DECODER,
            "balanced",
            devices=devices,
            max_memory=dict.fromkeys(range(len(devices)), 10 * GiB),
        )
        used = bytes_by_device(plan)
        assert set(used) == set(devices), used
        assert max(used.values()) - min(used.values()) <= 2 * 100  # two largest groups
        seq = plan_device_map(
            DECODER,
            "sequential",
            devices=devices,
            max_memory=dict.fromkeys(range(len(devices)), 10 * GiB),
        )
        assert bytes_by_device(seq) == {"cuda:0": TOTAL}


def test_balanced_low_0_puts_less_on_gpu0() -> None:
    budgets: dict[str | int, int | str] = {0: 1000, 1: 1000, 2: 1000}
    balanced = bytes_by_device(
        plan_device_map(DECODER, "balanced", devices=GPU3, max_memory=budgets)
    )
    low0 = bytes_by_device(
        plan_device_map(DECODER, "balanced_low_0", devices=GPU3, max_memory=budgets)
    )
    assert low0.get("cuda:0", 0) < balanced["cuda:0"]
    assert "cpu" not in low0 and "disk" not in low0
    # Tight budgets: cuda:0 takes exactly the overflow the others cannot hold.
    tight = bytes_by_device(
        plan_device_map(
            DECODER, "balanced_low_0", devices=GPU3, max_memory={0: 600, 1: 600, 2: 600}
        )
    )
    assert tight["cuda:0"] == 200 < tight["cuda:1"] == 600


def test_disk_refused_when_not_allowed() -> None:
    with pytest.raises(ConfigError, match="disk offload is disabled"):
        plan_device_map(
            DECODER, "sequential", devices=GPU1, max_memory={0: 600, "cpu": 500}, allow_disk=False
        )
    with pytest.raises(ConfigError, match="disk offload is disabled"):
        plan_device_map(DECODER, "auto", max_memory={"cpu": 0}, allow_disk=False)


def test_oversized_group_skips_a_device_without_closing_it() -> None:
    # The embedding is larger than either GPU: it goes to the cpu, the blocks still fill the GPUs.
    tensors = [TensorSize("model.embed_tokens.weight", 500), *DECODER[1:]]
    plan = plan_device_map(tensors, "sequential", devices=GPU2, max_memory={0: 400, 1: 400})
    assert plan.device_of("model.embed_tokens.weight") == "cpu"
    assert group_devices(plan) == runs("cpu*1 cuda:0*4 cuda:1*4 cpu*6")
    # Larger than every budget with the cpu bounded too: straight to disk, still not closing.
    plan = plan_device_map(tensors, "sequential", devices=GPU1, max_memory={0: 400, "cpu": 450})
    assert group_devices(plan)[:6] == runs("disk*1 cuda:0*4 cpu*1")
    with pytest.raises(ConfigError, match=r"'model\.embed_tokens' \(500 bytes\) fits on no"):
        plan_device_map(
            tensors, "sequential", devices=GPU1, max_memory={0: 400, "cpu": 450}, allow_disk=False
        )


def test_full_device_is_closed_for_later_small_groups() -> None:
    # After a block no longer fits on cuda:0, the 10-byte norm must not go back to it.
    plan = plan_device_map(DECODER, "sequential", devices=GPU2, max_memory={0: 1050, 1: 1000})
    assert group_devices(plan) == runs("cuda:0*10 cuda:1*5")


@pytest.mark.parametrize("device_map", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_auto_modes_need_budgets_for_accelerators(device_map: str) -> None:
    with pytest.raises(ConfigError, match="needs max_memory"):
        plan_device_map(DECODER, device_map, devices=GPU2)


def test_empty_checkpoint() -> None:
    plan = plan_device_map([], "auto", devices=GPU1, max_memory={0: 1})
    assert dict(plan.assignments) == {}
    assert plan.usage == ()
    assert plan.module_map() == {}


# --- no-split groups ---------------------------------------------------------------------


def test_no_split_empty_lets_blocks_straddle() -> None:
    plan = plan_device_map(DECODER, "sequential", devices=GPU1, max_memory={0: 650}, no_split=[])
    # embed + 5 blocks = 600 B; then the two attention tensors of block 5 still fit.
    assert plan.device_of("model.layers.5.self_attn.o_proj.weight") == "cuda:0"
    assert plan.device_of("model.layers.5.mlp.up_proj.weight") == "cpu"
    assert plan.usage[0] == DeviceUsage("cuda:0", 650, 1 + 5 * 4 + 2, 1 + 5 * 4 + 2)
    assert plan.module_map()["model.layers.5.self_attn"] == "cuda:0"
    assert plan.module_map()["model.layers.5.mlp"] == "cpu"


NO_SPLIT = [
    # (id, no_split, {tensor name: expected group})
    (
        "wildcard",
        ["model.layers.*"],
        {
            "model.layers.3.mlp.up_proj.weight": "model.layers.3",
            "model.embed_tokens.weight": "model.embed_tokens",
            "lm_head.weight": "lm_head",
        },
    ),
    (
        "trailing-dot",
        ["model.layers.3."],
        {
            "model.layers.3.mlp.up_proj.weight": "model.layers.3",
            "model.layers.30.mlp.up_proj.weight": "model.layers.30.mlp.up_proj",
        },
    ),
    (
        "whole-stack",
        ["model.layers"],
        {
            "model.layers.3.mlp.up_proj.weight": "model.layers",
            "model.norm.weight": "model.norm",
        },
    ),
    (
        "outermost-wins",
        ["model.layers.*.mlp", "model.layers.2"],
        {
            "model.layers.2.mlp.up_proj.weight": "model.layers.2",
            "model.layers.4.mlp.up_proj.weight": "model.layers.4.mlp",
            "model.layers.4.self_attn.q_proj.weight": "model.layers.4.self_attn.q_proj",
        },
    ),
    ("exact-tensor", ["lm_head.weight"], {"lm_head.weight": "lm_head.weight"}),
]


@pytest.mark.parametrize(
    ("no_split", "expected"), [c[1:] for c in NO_SPLIT], ids=[c[0] for c in NO_SPLIT]
)
def test_explicit_no_split_groups(no_split: list[str], expected: dict[str, str]) -> None:
    # Observe grouping through usage.layers with every tensor of a 1-byte checkpoint on cpu.
    names = list(expected)
    for name in names:
        others = [n for n in names if expected[n] != expected[name]]
        plan = plan_device_map(
            [TensorSize(n, 1) for n in names],
            {"": "cpu", **dict.fromkeys(others, "disk")},
            no_split=no_split,
        )
        assert plan.usage[0].layers == 1, (name, plan.usage)


def test_whole_stack_no_split_never_straddles() -> None:
    plan = plan_device_map(
        DECODER, "sequential", devices=GPU1, max_memory={0: 600}, no_split=["model.layers"]
    )
    devices = {plan.device_of(t.name) for t in DECODER if t.name.startswith("model.layers.")}
    assert devices == {"cpu"}  # 1200 B never fits in 600 B, and the GPU stays open
    assert plan.device_of("lm_head.weight") == "cuda:0"
    assert plan.usage == (DeviceUsage("cuda:0", 210, 3, 3), DeviceUsage("cpu", 1200, 48, 1))


@pytest.mark.parametrize("bad", [[""], ["a..b"], [".a"], "model.layers", [3]])
def test_bad_no_split(bad: object) -> None:
    with pytest.raises(ConfigError):
        plan_device_map(DECODER, "cpu", no_split=bad)  # type: ignore[arg-type]


DETECT = [
    ("llama", "model.layers.12.self_attn.q_proj.weight", "model.layers.12"),
    ("llama-embed", "model.embed_tokens.weight", "model.embed_tokens"),
    ("llama-norm", "model.norm.weight", "model.norm"),
    ("lm-head", "lm_head.weight", "lm_head"),
    ("gpt2", "transformer.h.0.attn.c_attn.weight", "transformer.h.0"),
    ("gpt2-wte", "transformer.wte.weight", "transformer.wte"),
    ("t5-encoder", "encoder.block.0.layer.1.DenseReluDense.wi.weight", "encoder.block.0"),
    ("t5-decoder", "decoder.block.3.layer.0.SelfAttention.q.weight", "decoder.block.3"),
    ("bart", "model.decoder.layers.2.fc1.weight", "model.decoder.layers.2"),
    ("bert", "bert.encoder.layer.11.attention.self.query.weight", "bert.encoder.layer.11"),
    ("vit", "blocks.3.attn.qkv.weight", "blocks.3"),
    ("bare-h", "h.0.weight", "h.0"),
    ("shortest-prefix", "model.layers.0.mlp.experts.layers.3.w", "model.layers.0"),
    ("shortest-repeated", "h.0.h.1.x", "h.0"),
    ("no-trailing-part", "model.layers.12", "model.layers"),
    ("not-a-boundary", "model.hlayers.0.x", "model.hlayers.0"),
    ("suffixed-container", "model.layers_0.x.weight", "model.layers_0.x"),
    ("non-ascii-digit", "model.layers.\u0661.weight", "model.layers.\u0661"),
    ("not-an-index", "model.layers.first.weight", "model.layers.first"),
    ("top-level", "logit_scale", "logit_scale"),
]


@pytest.mark.parametrize(("name", "expected"), [c[1:] for c in DETECT], ids=[c[0] for c in DETECT])
def test_detect_blocks(name: str, expected: str) -> None:
    assert detect_blocks([name]) == {name: expected}


def test_detect_blocks_decoder() -> None:
    keys = detect_blocks(t.name for t in DECODER)
    assert list(dict.fromkeys(keys.values())) == GROUPS


# --- single devices and explicit maps ----------------------------------------------------

SINGLE = [
    ("cpu", "cpu", "cpu"),
    ("disk", "disk", "disk"),
    ("cuda-1", "cuda:1", "cuda:1"),
    ("int", 1, "cuda:1"),
    ("bare-cuda", "cuda", "cuda:0"),
]


@pytest.mark.parametrize(
    ("device_map", "device"), [c[1:] for c in SINGLE], ids=[c[0] for c in SINGLE]
)
def test_single_device_takes_everything_without_capacity_check(
    device_map: str | int, device: str
) -> None:
    plan = plan_device_map(DECODER, device_map, devices=GPU2, max_memory={0: 1, 1: 1, "cpu": 1})
    assert set(plan.assignments.values()) == {device}
    assert plan.usage == (DeviceUsage(device, TOTAL, len(DECODER), len(GROUPS)),)
    assert plan.module_map() == {"": device}


def test_single_device_must_exist() -> None:
    with pytest.raises(ConfigError, match="not available"):
        plan_device_map(DECODER, "cuda:2", devices=GPU2)
    with pytest.raises(ConfigError, match="not available"):
        plan_device_map(DECODER, 0)
    with pytest.raises(ConfigError, match="allow_disk is False"):
        plan_device_map(DECODER, "disk", allow_disk=False)
    with pytest.raises(ConfigError, match="unknown device"):
        plan_device_map(DECODER, "fastest")


EXPLICIT = [
    # (id, device map, {tensor name: expected device})
    (
        "longest-prefix-and-boundary",
        {"model": "cuda:0", "model.layers.1": "cuda:1", "lm_head": "cpu"},
        {
            "model.layers.1.mlp.up_proj.weight": "cuda:1",
            "model.layers.10.mlp.up_proj.weight": "cuda:0",
            "model.layers.11.mlp.up_proj.weight": "cuda:0",
            "model.embed_tokens.weight": "cuda:0",
            "lm_head.weight": "cpu",
        },
    ),
    (
        "catch-all-and-ints",
        {"": "cpu", "model.layers.0": 0, "model.layers.1": "1"},
        {
            "model.layers.0.mlp.up_proj.weight": "cuda:0",
            "model.layers.1.mlp.up_proj.weight": "cuda:1",
            "model.layers.2.mlp.up_proj.weight": "cpu",
            "lm_head.weight": "cpu",
        },
    ),
    (
        "exact-tensor-key",
        {"": "disk", "lm_head.weight": "cuda", "model.layers.3.mlp": "cuda:1"},
        {
            "lm_head.weight": "cuda:0",
            "model.layers.3.mlp.down_proj.weight": "cuda:1",
            "model.layers.3.self_attn.q_proj.weight": "disk",
        },
    ),
    (
        "not-a-boundary-prefix",
        {"": "cpu", "model.lay": "cuda:0", "model.layers.1.mlp.up": 1},
        {
            "model.layers.1.mlp.up_proj.weight": "cpu",
        },
    ),
]


@pytest.mark.parametrize(
    ("device_map", "expected"), [c[1:] for c in EXPLICIT], ids=[c[0] for c in EXPLICIT]
)
def test_explicit_map(device_map: dict[str, str | int], expected: dict[str, str]) -> None:
    plan = plan_device_map(DECODER, device_map, devices=GPU2, max_memory={0: 1, 1: 1})
    for name, device in expected.items():
        assert plan.device_of(name) == device, name
    assert plan_device_map(DECODER, plan.module_map(), devices=GPU2) == plan


def test_explicit_map_unmatched_tensors_listed() -> None:
    with pytest.raises(ConfigError) as info:
        plan_device_map(DECODER, {"model.layers": "cpu"})
    message = str(info.value)
    assert "3 tensor(s)" in message
    assert "'model.embed_tokens.weight'" in message and "'lm_head.weight'" in message
    many = [TensorSize(f"x{i}.w", 1) for i in range(9)]
    with pytest.raises(ConfigError, match=r"9 tensor\(s\): 'x0\.w', .*'x4\.w' and 4 more"):
        plan_device_map(many, {"y": "cpu"})


@pytest.mark.parametrize(
    ("device_map", "devices", "allow_disk", "match"),
    [
        ({"": "gpu"}, (), True, "unknown device"),
        ({"": "cuda:1"}, GPU1, True, "not available"),
        ({"": "disk"}, (), False, "allow_disk is False"),
        ({"model.": "cpu"}, (), True, "dotted module path"),
        ({"a..b": "cpu"}, (), True, "dotted module path"),
        ({1: "cpu"}, (), True, "dotted module path"),
    ],
)
def test_explicit_map_errors(
    device_map: Mapping[str, str], devices: Sequence[str], allow_disk: bool, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_device_map(DECODER, device_map, devices=devices, allow_disk=allow_disk)


# --- module_map --------------------------------------------------------------------------


def test_module_map_collapses_uniform_modules() -> None:
    plan = plan_device_map(DECODER, "sequential", devices=GPU2, max_memory={0: 1000, 1: 1000})
    assert plan.module_map() == {
        "model.embed_tokens": "cuda:0",
        **{f"model.layers.{i}": "cuda:0" for i in range(9)},
        **{f"model.layers.{i}": "cuda:1" for i in range(9, 12)},
        "model.norm": "cuda:1",
        "lm_head": "cuda:1",
    }
    plan = plan_device_map(DECODER, "auto", devices=GPU1, max_memory={0: 1310})
    assert plan.module_map() == {"model": "cuda:0", "lm_head": "cpu"}


@pytest.mark.parametrize(
    ("device_map", "devices", "max_memory"),
    [c[1:4] for c in AUTO],
    ids=[c[0] for c in AUTO],
)
def test_module_map_round_trips(
    device_map: str,
    devices: Sequence[str],
    max_memory: Mapping[str | int, int | str] | None,
) -> None:
    plan = plan_device_map(DECODER, device_map, devices=devices, max_memory=max_memory)
    again = plan_device_map(DECODER, plan.module_map(), devices=devices)
    assert again.assignments == plan.assignments
    assert again.usage == plan.usage


def test_module_map_tensor_and_module_of_the_same_name() -> None:
    tensors = [TensorSize("a.b", 1), TensorSize("a.b.c", 1), TensorSize("a.b.d", 1)]
    plan = plan_device_map(tensors, {"": "cpu", "a.b.c": "disk"}, no_split=[])
    assert plan.module_map() == {"a.b": "cpu", "a.b.c": "disk", "a.b.d": "cpu"}
    assert plan_device_map(tensors, plan.module_map(), no_split=[]) == plan


def test_plan_is_read_only_and_device_of() -> None:
    plan = plan_device_map(DECODER, "cpu")
    with pytest.raises(TypeError):
        plan.assignments["lm_head.weight"] = "disk"  # type: ignore[index]
    built = DevicePlan(assignments={"w": "cpu"}, usage=())
    with pytest.raises(TypeError):
        built.assignments["w"] = "disk"  # type: ignore[index]
    with pytest.raises(KeyError, match="nope"):
        plan.device_of("nope")


def test_many_tensors_plan_and_collapse() -> None:
    # 80 blocks x 500 tensors: must plan (and round-trip) in well under the test timeout.
    tensors = [
        TensorSize(f"model.layers.{i}.experts.{j}.weight", 10)
        for i in range(80)
        for j in range(500)
    ]
    plan = plan_device_map(
        tensors, "balanced", devices=GPU4, max_memory=dict.fromkeys(range(4), GiB)
    )
    # Share = 80 blocks / 4 + one block of slack = 21 blocks; the last GPU takes the rest.
    assert [u.layers for u in plan.usage] == [21, 21, 21, 17]
    module_map = plan.module_map()
    assert len(module_map) == 80
    assert plan_device_map(tensors, module_map, devices=GPU4).assignments == plan.assignments


# --- input validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": ("cpu",)}, "accelerators only"),
        ({"devices": ("cuda:0", 0)}, "listed twice"),
        ({"devices": "cuda:0"}, "not a string"),
        ({"devices": GPU1, "max_memory": {0: 1, "cuda:0": 2}}, "twice"),
        ({"devices": GPU1, "max_memory": {1: 1}}, "not among the available"),
        ({"max_memory": {0: "1GiB"}}, "not among the available"),
        ({"max_memory": {"disk": "1GiB"}}, "cannot budget 'disk'"),
        ({"max_memory": {"cpu": "lots"}}, "not a memory size"),
        ({"max_memory": {"tpu": 1}}, "unknown device"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_device_map(DECODER, "auto", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "nbytes"), [("", 1), (".a", 1), ("a.", 1), ("a..b", 1), ("a", -1), ("a", True)]
)
def test_bad_tensor_sizes(name: str, nbytes: int) -> None:
    with pytest.raises(ValueError):
        TensorSize(name, nbytes)


def test_duplicate_tensor_names() -> None:
    with pytest.raises(ValueError, match="'a' is listed twice"):
        plan_device_map([TensorSize("a", 1), TensorSize("b", 1), TensorSize("a", 2)], "cpu")


MEMORY = [
    ("int", 1024, 1024),
    ("zero", 0, 0),
    ("digits", "1024", 1024),
    ("bytes-unit", "512B", 512),
    ("gib", "20GiB", 20 * 2**30),
    ("gb-is-decimal", "20GB", 20 * 10**9),
    ("mib", "500MiB", 500 * 2**20),
    ("mb", "500MB", 500 * 10**6),
    ("kib", "4KiB", 4096),
    ("kb", "4kB", 4000),
    ("tib", "1TiB", 2**40),
    ("tb", "2TB", 2 * 10**12),
    ("pib", "1PiB", 2**50),
    ("fraction", "1.5GiB", 3 * 2**29),
    ("fraction-floors", "0.3333KiB", 341),
    ("lowercase-gib", "20gib", 20 * 2**30),
    ("spaces", " 20 GiB ", 20 * 2**30),
]


@pytest.mark.parametrize(("value", "expected"), [c[1:] for c in MEMORY], ids=[c[0] for c in MEMORY])
def test_parse_memory(value: int | str, expected: int) -> None:
    assert parse_memory(value) == expected


BAD_MEMORY = [
    ("negative-int", -1),
    ("bool", True),
    ("float", 1.5e9),
    ("none", None),
    ("empty", ""),
    ("unit-only", "GiB"),
    ("negative", "-1GiB"),
    ("plus", "+1GiB"),
    ("exponent", "1e9"),
    ("nan", "nan"),
    ("inf", "inf"),
    ("unknown-unit", "20XB"),
    ("gigabits", "20Gb"),
    ("lower-gb", "20gb"),
    ("bits", "100b"),
    ("two-numbers", "1 2GiB"),
    ("leading-dot", ".5GiB"),
    ("trailing-dot", "5.GiB"),
    ("non-ascii-digit", "\u0662GiB"),
]


@pytest.mark.parametrize("value", [c[1] for c in BAD_MEMORY], ids=[c[0] for c in BAD_MEMORY])
def test_parse_memory_rejects(value: object) -> None:
    with pytest.raises(ConfigError):
        parse_memory(value)  # type: ignore[arg-type]


DEVICES = [
    ("cpu", "cpu", "cpu"),
    ("disk", "disk", "disk"),
    ("bare-cuda", "cuda", "cuda:0"),
    ("cuda-1", "cuda:1", "cuda:1"),
    ("leading-zero", "cuda:01", "cuda:1"),
    ("int-0", 0, "cuda:0"),
    ("int-3", 3, "cuda:3"),
    ("digit-string", "2", "cuda:2"),
    ("mps", "mps", "mps:0"),
    ("xpu", "xpu", "xpu:0"),
    ("xpu-2", "xpu:2", "xpu:2"),
    ("npu", "npu:1", "npu:1"),
]


@pytest.mark.parametrize(
    ("value", "expected"), [c[1:] for c in DEVICES], ids=[c[0] for c in DEVICES]
)
def test_normalize_device(value: str | int, expected: str) -> None:
    assert normalize_device(value) == expected


BAD_DEVICES = [
    ("gpu", "gpu"),
    ("empty", ""),
    ("upper", "CPU"),
    ("padded", " cpu"),
    ("meta", "meta"),
    ("colon-no-index", "cuda:"),
    ("negative-index", "cuda:-1"),
    ("letter-index", "cuda:x"),
    ("two-indices", "cuda:0:1"),
    ("non-ascii-index", "cuda:\u0661"),
    ("non-ascii-digits", "\u0661"),
    ("negative-int", -1),
    ("bool", True),
    ("float", 1.0),
    ("none", None),
    ("cpu-index", "cpu:0"),
]


@pytest.mark.parametrize("value", [c[1] for c in BAD_DEVICES], ids=[c[0] for c in BAD_DEVICES])
def test_normalize_device_rejects(value: object) -> None:
    with pytest.raises(ConfigError):
        normalize_device(value)  # type: ignore[arg-type]
