"""Training checkpoints: which one `--checkpoint latest` picks, and what one rank fetches.

The DCP run is written by torch itself (2 ranks, gloo on loopback: a tensor of each rank's
own, replicated ones, a DTensor sharded over both); DeepSpeed, Megatron and Trainer runs are
laid out with ``torch.save`` under exactly the names their code writes (DeepSpeed
``engine._get_ckpt_name``/``_get_rank_zero_ckpt_name``, Megatron ``get_checkpoint_name`` and
``get_checkpoint_tracker_filename``, transformers ``Trainer._save_checkpoint``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import shutil
import socket
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fast_config

from shardsync.checkpoint import latest, prefetch_checkpoint
from shardsync.cli import main
from shardsync.dcp_metadata import parse_dcp_metadata
from shardsync.errors import ManifestError, UnsafeNameError
from shardsync.training import Choice, Need, choose, select_rank

# ------------------------------------------------------------------------------ builders

DCP_STEPS = (100, 200)
DCP_TORN = 300
WORLD = 2


def dcp_state(step: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` holds at ``step`` (plain tensors: the sharded one is added by the
    worker as a DTensor)."""
    own = torch.Generator().manual_seed(step * 100 + rank)
    shared = torch.Generator().manual_seed(step)
    return {
        f"rank{rank}.w": torch.randn(128, 256, generator=own),  # 128 KiB, this rank's only
        "shared.emb": torch.randn(64, 256, generator=shared),  # replicated: saved once
        "shared.bias": torch.randn(256, generator=shared).to(torch.bfloat16),
        "step": step,
    }


def dcp_sharded(step: int) -> torch.Tensor:
    return torch.randn(256, 128, generator=torch.Generator().manual_seed(step + 7))


def dcp_expected(step: int) -> dict[str, Any]:
    """Everything saved at ``step``, as one process loads it back."""
    out: dict[str, Any] = {}
    for rank in range(WORLD):
        out.update(dcp_state(step, rank))
    out["sharded.w"] = dcp_sharded(step)
    return out


def _dcp_worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        for step in (*DCP_STEPS, DCP_TORN):
            state = dcp_state(step, rank)
            state["sharded.w"] = distribute_tensor(dcp_sharded(step), mesh, [Shard(0)])
            dcp.save(state, checkpoint_id=f"{root}/step-{step}")
        dist.barrier()
        if rank == 0:  # a step whose coordinator died before writing .metadata
            os.unlink(f"{root}/step-{DCP_TORN}/.metadata")
    finally:
        dist.destroy_process_group()


def build_dcp_run(root: Path) -> Path:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root.mkdir(parents=True)
    mp.start_processes(_dcp_worker, args=(port, str(root)), nprocs=WORLD, start_method="spawn")
    return root


def _save(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def _tensors(seed: int, n: int = 2, size: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(size, generator=g) for i in range(n)}


def build_deepspeed_run(root: Path, variant: str = "zero2") -> Path:
    """``save_dir/latest`` = ``global_step20``; ``global_step30`` half uploaded (no model
    states, no ZeRO files of rank 1), ``latest`` not yet moved to it."""
    for step in (10, 20, 30):
        tag = root / f"global_step{step}"
        if variant == "zero3":
            for dp in range(WORLD):
                _save(tag / f"zero_pp_rank_{dp}_mp_rank_00_model_states.pt", _tensors(step + dp))
        elif step != 30:  # its model states never made it
            _save(tag / "mp_rank_00_model_states.pt", _tensors(step))
        prefix = "" if variant == "zero2" else "bf16_"
        for dp in range(WORLD if step != 30 else 1):
            _save(
                tag / f"{prefix}zero_pp_rank_{dp}_mp_rank_00_optim_states.pt", _tensors(-step - dp)
            )
    (root / "latest").write_text("global_step20")
    (root / "zero_to_fp32.py").write_text("# DeepSpeed copies its recovery script here\n")
    return root


def build_megatron_run(root: Path) -> Path:
    """TP=2 x PP=2; the tracker says 200; iteration 300 lacks one rank folder."""
    for it in (100, 200, 300):
        for tp in range(2):
            for pp in range(2):
                if it == 300 and (tp, pp) == (1, 1):
                    continue
                _save(
                    root / f"iter_{it:07d}" / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt",
                    {"iteration": it, "model": _tensors(it + 10 * tp + pp)},
                )
    (root / "latest_checkpointed_iteration.txt").write_text("200")
    return root


def build_trainer_run(root: Path) -> Path:
    """``checkpoint-500`` and ``-1000`` complete; ``-1500`` lacks ``trainer_state.json``."""
    from safetensors.torch import save_file

    for step in (500, 1000, 1500):
        ck = root / f"checkpoint-{step}"
        ck.mkdir(parents=True)
        (ck / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
        save_file(_tensors(step), str(ck / "model.safetensors"))
        _save(ck / "optimizer.pt", {"state": _tensors(-step)})
        _save(ck / "scheduler.pt", {"last_epoch": step})
        for rank in range(WORLD):
            _save(ck / f"rng_state_{rank}.pth", {"cpu": torch.manual_seed(rank).get_state()})
        _save(ck / "training_args.bin", {"output_dir": "out"})
        if step != 1500:
            (ck / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return root


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    return {
        "dcp": build_dcp_run(base / "dcp"),
        "deepspeed": build_deepspeed_run(base / "deepspeed"),
        "megatron": build_megatron_run(base / "megatron"),
        "trainer": build_trainer_run(base / "trainer"),
    }


# ------------------------------------------------------------------------------ helpers


def listing_of(root: Path) -> list[tuple[str, int | None]]:
    """What an origin lists: every file but hidden ones (a DCP `.metadata` included)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                full = Path(dirpath, name)
                out.append((full.relative_to(root).as_posix(), full.stat().st_size))
    return out


def choose_from(
    root: Path, checkpoint: str = "latest", read: Callable[[str], bytes | None] | None = None
) -> Choice:
    def from_disk(path: str) -> bytes | None:
        full = root / path
        return full.read_bytes() if full.is_file() else None

    read = read or from_disk
    listing = listing_of(root)
    contents: dict[str, bytes | None] = {}
    asked: list[str] = []
    while isinstance(step := choose(listing, checkpoint, contents), Need):
        assert step.path not in asked
        asked.append(step.path)
        contents[step.path] = read(step.path)
    return step


def names(files: tuple[tuple[str, int | None], ...]) -> set[str]:
    return {p for p, _ in files}


def load_equal(a: Any, b: Any) -> None:
    """Tensor by tensor, bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            load_equal(a[k], b[k])
    else:
        assert a == b


def dcp_load(path: Path, template: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    state = {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in template.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, no_dist=True, **kwargs)
    return state


# ------------------------------------------------------------------------------ choose (pure)


def test_dcp_latest_is_the_highest_step_with_metadata_and_a_torn_step_is_skipped(
    runs: dict[str, Path],
) -> None:
    choice = choose_from(runs["dcp"])
    assert (choice.format, choice.name, choice.step, choice.root) == (
        "dcp",
        "step-200",
        200,
        "step-200",
    )
    assert [(s.name, "no .metadata" in s.reason) for s in choice.skipped] == [("step-300", True)]
    files = names(choice.files)
    assert "step-200/.metadata" in files
    assert {p for p in files if p.endswith(".distcp")} == {
        f"step-200/{n}" for n in os.listdir(runs["dcp"] / "step-200") if n.endswith(".distcp")
    }
    assert choice.dcp is not None and set(choice.dcp.needed) <= {
        n for n in os.listdir(runs["dcp"] / "step-200")
    }
    older = choose_from(runs["dcp"], "step-100")
    assert older.name == "step-100" and not older.skipped
    with pytest.raises(ManifestError, match=r"step-300.*incomplete.*no \.metadata"):
        choose_from(runs["dcp"], "step-300")
    with pytest.raises(ManifestError, match="no dcp checkpoint 'step-7'"):
        choose_from(runs["dcp"], "step-7")
    with pytest.raises(UnsafeNameError):
        choose_from(runs["dcp"], "../step-200")


def test_dcp_rank_selection_is_metadata_plus_that_ranks_files(runs: dict[str, Path]) -> None:
    choice = choose_from(runs["dcp"])
    for rank in range(WORLD):
        sel = select_rank(choice, rank, WORLD)
        assert names(sel.files) == {"step-200/.metadata"} | {
            p for p, _ in choice.files if os.path.basename(p).startswith(f"__{rank}_")
        }
        assert not sel.notes
    assert select_rank(choice, None, None).files == choice.files
    resharded = select_rank(choice, 1, 4)  # saved by 2, loaded by 4: nobody knows who reads what
    assert resharded.files == choice.files and "2 ranks, not 4" in resharded.notes[0]
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ManifestError):
            select_rank(choice, *bad)


def test_a_dcp_data_file_shorter_than_metadata_says_is_not_complete(
    runs: dict[str, Path],
) -> None:
    root = runs["dcp"]
    listing = listing_of(root)
    victim = next(p for p, _ in listing if p.startswith("step-200/") and p.endswith(".distcp"))
    cut = [(p, (s or 0) - 1 if p == victim else s) for p, s in listing]
    contents: dict[str, bytes | None] = {}
    while isinstance(step := choose(cut, "latest", contents), Need):
        full = root / step.path
        contents[step.path] = full.read_bytes() if full.is_file() else None
    assert step.name == "step-100"
    assert [s.name for s in step.skipped] == ["step-300", "step-200"]
    assert "bytes" in step.skipped[1].reason
    missing = [(p, s) for p, s in listing if p != victim]
    contents = {}
    while isinstance(step := choose(missing, "latest", contents), Need):
        full = root / step.path
        contents[step.path] = full.read_bytes() if full.is_file() else None
    assert "missing" in step.skipped[1].reason


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_hostile_dcp_metadata_is_refused_without_running_it(runs: dict[str, Path]) -> None:
    real = (runs["dcp"] / "step-200" / ".metadata").read_bytes()
    assert parse_dcp_metadata(real).needed
    for bad in (b"not a pickle", pickle.dumps(_Boom()), pickle.dumps({"a": 1}), b""):
        with pytest.raises(ManifestError):
            parse_dcp_metadata(bad)
        with pytest.raises(ManifestError):
            choose_from(runs["dcp"], "step-200", lambda p, bad=bad: bad)  # type: ignore[misc]
    meta = parse_dcp_metadata(real).metadata
    info = next(iter(meta.storage_data.values()))
    # the allowed classes, built without their fields (pickle sets what the file gives)
    for shell, field in ((meta, "state_dict_metadata"), (info, "relative_path")):
        kept = getattr(shell, field)
        delattr(shell, field)
        with pytest.raises(ManifestError):
            parse_dcp_metadata(pickle.dumps(meta))
        setattr(shell, field, kept)
    for evil in ("../../etc/passwd", "/etc/passwd", "a/../../b"):
        info.relative_path = evil
        with pytest.raises(UnsafeNameError, match="outside its folder"):
            parse_dcp_metadata(pickle.dumps(meta))


@pytest.mark.parametrize(
    ("fmt", "pointer", "named"),
    [
        ("deepspeed", "latest", "global_step10"),
        ("megatron", "latest_checkpointed_iteration.txt", "iter_0000100"),
    ],
)
def test_a_pointer_being_rewritten_leaves_a_checkpoint_named_to_be_fetched(
    runs: dict[str, Path], tmp_path: Path, fmt: str, pointer: str, named: str
) -> None:
    """DeepSpeed and Megatron truncate their pointer, then write it: read in between it is
    empty. A checkpoint named explicitly (the docs' way past a bad pointer) is fetched
    without it; ``latest`` is told the pointer is being written, not that it is hostile."""
    run = tmp_path / fmt
    shutil.copytree(runs[fmt], run)
    (run / pointer).write_bytes(b"")
    chosen = choose_from(run, named)
    assert chosen.name == named
    assert pointer not in {path for path, _ in chosen.files}
    with pytest.raises(ManifestError) as refused:
        choose_from(run, "latest")
    assert not isinstance(refused.value, UnsafeNameError)


def test_names_with_dotdot_in_a_listing_are_refused() -> None:
    with pytest.raises(UnsafeNameError):
        choose([("step-1/../../x/__0_0.distcp", 10)])
    with pytest.raises(ManifestError, match="no training checkpoint"):
        choose([("model.safetensors", 10), ("config.json", 2)])


def test_deepspeed_latest_follows_the_pointer_and_selects_a_ranks_zero_shard(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    choice = choose_from(runs["deepspeed"])
    assert (choice.format, choice.name, choice.step, choice.root) == (
        "deepspeed", "global_step20", 20, ""
    )  # fmt: skip
    assert "latest" in names(choice.files)
    sel = select_rank(choice, 1, WORLD)
    assert names(sel.files) == {
        "latest",
        "global_step20/mp_rank_00_model_states.pt",
        "global_step20/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    }  # zero_to_fp32.py lives beside the tags, not in this one
    with pytest.raises(ManifestError, match=r"global_step30.*model states"):
        choose_from(runs["deepspeed"], "global_step30")
    older = choose_from(runs["deepspeed"], "global_step10")
    assert "latest" not in names(older.files)  # it names another tag: pass tag= instead
    for variant in ("bf16", "zero3"):
        root = build_deepspeed_run(tmp_path / variant, variant)
        choice = choose_from(root)
        assert choice.name == "global_step20"
        sel = names(select_rank(choice, 0, WORLD).files)
        prefix = "bf16_"
        assert f"global_step20/{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt" in sel
        assert not any("zero_pp_rank_1" in p for p in sel)
        if variant == "zero3":
            assert "global_step20/zero_pp_rank_0_mp_rank_00_model_states.pt" in sel


def test_a_deepspeed_pointer_outside_the_prefix_or_at_a_torn_tag(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    root = runs["deepspeed"]
    for evil in ("../../etc", "/etc", "a/../../b", "global_step20/../.."):
        with pytest.raises(UnsafeNameError):
            choose_from(root, read=lambda p, e=evil: e.encode() if p == "latest" else None)  # type: ignore[misc]
    # the pointer names a torn tag: an older one without ``latest`` beside it would make
    # ``engine.load_checkpoint(path)`` load nothing, so ``latest`` is an error ...
    with pytest.raises(ManifestError):
        choose_from(root, read=lambda p: b"global_step30\n" if p == "latest" else None)
    # ... and a tag named explicitly comes with a note to resume from it by name
    older = choose_from(root, "global_step10")
    assert "latest" not in names(older.files)
    for rank, world in ((None, None), (0, WORLD)):
        assert select_rank(older, rank, world).notes
    assert not select_rank(choose_from(root), None, None).notes


def test_megatron_tracker_and_tensor_pipeline_rank_folders(runs: dict[str, Path]) -> None:
    choice = choose_from(runs["megatron"])
    assert (choice.format, choice.name, choice.step) == ("megatron", "iter_0000200", 200)
    assert "latest_checkpointed_iteration.txt" in names(choice.files)
    # world 4 = TP 2 x PP 2: rank 3 is tp 1, pp 1 (Megatron orders tp fastest, pp slowest)
    for rank, cell in ((0, "mp_rank_00_000"), (1, "mp_rank_01_000"), (3, "mp_rank_01_001")):
        sel = names(select_rank(choice, rank, 4).files)
        assert sel == {
            "latest_checkpointed_iteration.txt",
            f"iter_0000200/{cell}/model_optim_rng.pt",
        }
    with pytest.raises(ManifestError, match="full grid"):
        choose_from(runs["megatron"], "iter_0000300")
    for hostile in (b"../200", "\u00b2".encode()):  # a digit to str.isdigit, not to int
        with pytest.raises(ManifestError, match="not an iteration"):
            choose_from(runs["megatron"], read=lambda p, text=hostile: text)


def _choose_listing(
    listing: list[tuple[str, int | None]], wanted: str = "latest", **files: bytes
) -> Choice:
    contents: dict[str, bytes | None] = {}
    while isinstance(step := choose(listing, wanted, contents), Need):
        contents[step.path] = files.get(step.path.replace(".", "_"))
    return step


def _megatron_listing(missing: tuple[int, int, int] | None) -> list[tuple[str, int | None]]:
    """TP 2 x PP 2 x EP 3 (``mp_rank_TT_PPP_EEE``) at iterations 50 and 100; the tracker
    says 100; ``missing`` is a rank folder of iteration 100 that never landed."""
    listing: list[tuple[str, int | None]] = [("latest_checkpointed_iteration.txt", 3)]
    for it in (50, 100):
        for cell in itertools.product(range(2), range(2), range(3)):
            if it == 100 and cell == missing:
                continue
            tp, pp, ep = cell
            folder = f"iter_{it:07d}/mp_rank_{tp:02d}_{pp:03d}_{ep:03d}"
            listing.append((f"{folder}/model_optim_rng.pt", 1000))
    return listing


def test_megatron_expert_rank_folders_make_a_full_grid_or_no_checkpoint() -> None:
    tracker = {"latest_checkpointed_iteration_txt": b"100"}
    choice = _choose_listing(_megatron_listing(None), **tracker)
    assert choice.name == "iter_0000100"
    # rank 3 of 8 (TP 2 x PP 2 x DP 2): tp 1, pp 0, and every expert folder of that cell
    sel = {p.split("/")[1] for p, _ in select_rank(choice, 3, 8).files if "/" in p}
    assert sel == {f"mp_rank_01_000_{ep:03d}" for ep in range(3)}
    torn = _megatron_listing((1, 1, 2))
    with pytest.raises(ManifestError):  # not iteration 50 without its tracker
        _choose_listing(torn, **tracker)
    with pytest.raises(ManifestError):
        _choose_listing(torn, "iter_0000100", **tracker)
    assert _choose_listing(torn, "iter_0000050", **tracker).name == "iter_0000050"


def test_zero3_tags_are_checked_inside_a_trainer_checkpoint_and_alone() -> None:
    """ZeRO-3 writes no ``mp_rank_XX_model_states.pt``, only per-rank ZeRO files."""

    def tag(folder: str, ranks: range | tuple[int, ...]) -> list[tuple[str, int | None]]:
        return [
            (f"{folder}/{kind}zero_pp_rank_{dp}_mp_rank_00_{what}_states.pt", 1000)
            for dp in ranks
            for kind, what in (("", "model"), ("bf16_", "optim"))
        ]

    trainer: list[tuple[str, int | None]] = []
    for step, ranks in ((10, range(2)), (20, (1,))):  # checkpoint-20: dp rank 0 missing
        trainer += [(f"checkpoint-{step}/trainer_state.json", 100)]
        trainer += tag(f"checkpoint-{step}/global_step{step}", ranks)
    choice = _choose_listing(trainer)
    assert (choice.name, [s.name for s in choice.skipped]) == ("checkpoint-10", ["checkpoint-20"])
    alone = tag("global_step10", range(2)) + tag("global_step20", (1,))
    assert _choose_listing(alone).name == "global_step10"


def test_a_deepspeed_pipeline_rank_gets_every_zero_file() -> None:
    """Its ranks are stage-major (data fastest): ``R // MP`` would give rank 1 stage 1's
    files, where DeepSpeed opens stage 0's of data rank 1."""
    listing: list[tuple[str, int | None]] = [("latest", 12)]
    for mp in range(2):
        listing.append((f"global_step5/mp_rank_{mp:02d}_model_states.pt", 100))
        listing.append((f"global_step5/layer_{mp:02d}-model_00-model_states.pt", 100))
        for dp in range(2):
            listing.append((f"global_step5/zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt", 9))
    choice = _choose_listing(listing, latest=b"global_step5")
    selection = select_rank(choice, 1, 4)
    assert names(selection.files) == names(choice.files) and selection.notes


@pytest.mark.parametrize("models", [1, 2])
def test_accelerates_save_state_folders_are_one_checkpoint_each(
    tmp_path: Path, models: int
) -> None:
    """``accelerator.save_state`` with FSDP writes ``checkpoints/checkpoint_<i>/`` holding two
    DCP checkpoints per model (``pytorch_model_fsdp_<m>/``, ``optimizer_<m>/``) and its rng
    and scheduler states: one checkpoint to resume from, whole, chosen by ``i``, its model's
    folder for a reader (with several models, none: the model indices are no steps)."""
    import torch.distributed.checkpoint as dcp

    for step in (8, 9):
        folder = tmp_path / "checkpoints" / f"checkpoint_{step}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for m in range(models):
                for part in (f"pytorch_model_fsdp_{m}", f"optimizer_{m}"):
                    dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(folder / part), no_dist=True)
        _save(folder / "random_states_0.pkl", {"step": step})
    torn = tmp_path / "checkpoints" / "checkpoint_9" / f"optimizer_{models - 1}" / ".metadata"
    torn.unlink()
    choice = choose_from(tmp_path)
    assert (choice.format, choice.name, choice.step) == ("dcp", "checkpoints/checkpoint_8", 8)
    model = "checkpoints/checkpoint_8/pytorch_model_fsdp_0"
    assert choice.dcp_dir == (model if models == 1 else None)
    assert names(choice.files) == {
        p.relative_to(tmp_path).as_posix()
        for p in (tmp_path / "checkpoints" / "checkpoint_8").rglob("*")
        if p.is_file()
    }
    assert [s.name for s in choice.skipped] == ["checkpoints/checkpoint_9"]


def test_a_save_state_checkpoint_still_missing_a_part_is_torn(tmp_path: Path) -> None:
    """accelerate writes ``pytorch_model_fsdp_0/`` before ``optimizer_0/``: a
    ``checkpoint_1/`` holding the model's folder alone is checkpoint_1, torn, never a
    checkpoint of its own (its ``_0`` is a model's index, no step), which ``load_state``
    could not resume from."""
    import torch.distributed.checkpoint as dcp

    for step, parts in (
        (0, ("pytorch_model_fsdp_0", "optimizer_0")),
        (1, ("pytorch_model_fsdp_0",)),
    ):
        folder = tmp_path / "checkpoints" / f"checkpoint_{step}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for part in parts:
                dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(folder / part), no_dist=True)
    _save(tmp_path / "checkpoints" / "checkpoint_0" / "random_states_0.pkl", {"step": 0})
    choice = choose_from(tmp_path)
    assert (choice.format, choice.name, choice.step) == ("dcp", "checkpoints/checkpoint_0", 0)
    assert [s.name for s in choice.skipped] == ["checkpoints/checkpoint_1"]
    with pytest.raises(ManifestError):
        choose_from(tmp_path, "checkpoints/checkpoint_1/pytorch_model_fsdp_0")


def test_a_dcp_run_saved_in_checkpoint_n_folders_is_a_dcp_run(tmp_path: Path) -> None:
    """``dcp.save`` into ``checkpoint-<step>/`` (no Trainer file in them) is a DCP run, not a
    Trainer run refused for want of ``trainer_state.json``."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (100, 200):
            folder = str(tmp_path / f"checkpoint-{step}")
            dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=folder, no_dist=True)
    (tmp_path / "checkpoint-200" / ".metadata").unlink()  # torn
    choice = choose_from(tmp_path)
    assert (choice.format, choice.name, choice.step) == ("dcp", "checkpoint-100", 100)
    assert [s.name for s in choice.skipped] == ["checkpoint-200"]


def test_a_pointer_saved_again_during_the_fetch_is_no_checkpoint_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's ``latest`` moves on (the run saved again) after the choice read it and
    before its copy: fetched as it is now, it would name a tag that was not fetched and
    DeepSpeed would load nothing. The copy is refused and nothing is kept."""
    from shardsync.checkpoint_selection import CheckpointSelection
    from shardsync.errors import OriginError

    run = tmp_path / "run"
    for step in (10, 20):
        _save(run / f"global_step{step}" / "mp_rank_00_model_states.pt", {"w": torch.ones(4)})
    (run / "latest").write_text("global_step10")
    chosen = CheckpointSelection.select

    async def select_then_save_again(self: CheckpointSelection, listing: Any) -> Any:
        manifest = await chosen(self, listing)
        (run / "latest").write_text("global_step20")
        return manifest

    monkeypatch.setattr(CheckpointSelection, "select", select_then_save_again)
    config = fast_config(tmp_path / "cache")
    with pytest.raises(OriginError):
        _run(prefetch_checkpoint(str(run), config))
    assert not list(config.cache_dir.glob("hub/*/snapshots/*/latest"))
    result = _run(prefetch_checkpoint(str(run), config))  # run again: the new pointer
    assert result.checkpoint == "global_step20"
    assert (result.path / "latest").read_text() == "global_step20"


def test_the_step_is_read_where_the_checkpoints_differ_and_an_unreadable_one_is_no_torn_one(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(1)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = (tmp_path / ".metadata").read_bytes()
    data = (tmp_path / "__0_0.distcp").stat().st_size
    listing: list[tuple[str, int | None]] = []
    for step in (200, 1000):  # a fixed name under each step folder: ``model`` says nothing
        listing += [(f"step-{step}/model/.metadata", len(metadata))]
        listing += [(f"step-{step}/model/__0_0.distcp", data)]
    found = {f"step-{n}/model/_metadata": metadata for n in (200, 1000)}
    choice = _choose_listing(listing, **found)
    assert (choice.name, choice.step) == ("step-1000/model", 1000)
    # dcp.save(..., use_collectives=False) writes one __R.metadata per rank, no .metadata
    older = [("step-100/.metadata", len(metadata)), ("step-100/__0_0.distcp", data)]
    newer = [("step-200/__0.metadata", 10), ("step-200/__0_0.distcp", data)]
    assert _choose_listing(older, **{"step-100/_metadata": metadata}).name == "step-100"
    with pytest.raises(ManifestError):  # not passed over for step-100 as if torn
        _choose_listing(older + newer, **{"step-100/_metadata": metadata})


def test_trainer_latest_needs_trainer_state_and_a_rank_gets_its_rng_state(
    runs: dict[str, Path],
) -> None:
    choice = choose_from(runs["trainer"])
    assert (choice.format, choice.name, choice.root) == (
        "trainer",
        "checkpoint-1000",
        "checkpoint-1000",
    )
    assert [s.name for s in choice.skipped] == ["checkpoint-1500"]
    assert "trainer_state.json" in choice.skipped[0].reason
    sel = names(select_rank(choice, 1, WORLD).files)
    assert "checkpoint-1000/rng_state_1.pth" in sel
    assert "checkpoint-1000/rng_state_0.pth" not in sel
    assert {"checkpoint-1000/optimizer.pt", "checkpoint-1000/trainer_state.json"} <= sel


# ------------------------------------------------------------------------------ prefetch


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_cli_prefetch_checkpoint_of_a_local_dcp_run_for_one_rank(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    argv = ["prefetch", str(runs["dcp"]), "--checkpoint", "latest", "--rank", "1",
            "--world-size", "2", "--cache-dir", str(cache), "--json", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["checkpoint"], report["format"]) == ("step-200", "dcp")
    local = Path(report["snapshot_path"])
    assert local.name == "step-200"
    origin = runs["dcp"] / "step-200"
    assert sorted(os.listdir(local)) == sorted(
        [".metadata", *(n for n in os.listdir(origin) if n.startswith("__1_"))]
    )
    for name in os.listdir(local):
        assert (local / name).read_bytes() == (origin / name).read_bytes()
    assert report["skipped"] == [{"name": "step-300", "reason": report["skipped"][0]["reason"]}]
    assert {f["verified"] for f in report["files"]} == {"tofu"}
    assert main([*argv[:-1], "--quiet"]) == 0  # again: nothing moves
    again = json.loads(capsys.readouterr().out)
    assert again["bytes_downloaded"] == 0 and again["snapshot_path"] == report["snapshot_path"]


def test_cli_checkpoint_needs_both_rank_and_world_size(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["prefetch", str(runs["dcp"]), "--checkpoint", "latest", "--rank", "1",
            "--cache-dir", str(tmp_path / "c"), "--quiet"]  # fmt: skip
    assert main(argv) == 2
    assert "--world-size" in capsys.readouterr().err
    argv = ["prefetch", str(runs["dcp"]), "--rank", "0", "--world-size", "1",
            "--cache-dir", str(tmp_path / "c"), "--quiet"]  # fmt: skip
    assert main(argv) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_a_whole_local_dcp_checkpoint_loads_with_dcp_unchanged(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    config = fast_config(tmp_path / "cache")
    result = _run(prefetch_checkpoint(str(runs["dcp"]), config))
    assert result.checkpoint == "step-200" and result.path.name == "step-200"
    expected = dcp_expected(200)
    load_equal(dcp_load(result.path, expected), expected)
    assert latest(str(runs["dcp"]), config=config).name == "step-200"


def test_local_deepspeed_megatron_trainer_land_laid_out_like_the_run(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    config = fast_config(tmp_path / "cache")
    for fmt, rank, world, expect in (
        ("deepspeed", 1, 2, "global_step20/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("megatron", 3, 4, "iter_0000200/mp_rank_01_001/model_optim_rng.pt"),
        ("trainer", 0, 2, "checkpoint-1000/rng_state_0.pth"),
    ):
        result = _run(prefetch_checkpoint(str(runs[fmt]), config, rank=rank, world_size=world))
        assert result.format == fmt
        snapshot = result.prefetch.snapshot_path
        assert (snapshot / expect).is_file()
        for f in result.prefetch.files:
            local, origin = snapshot / f.path, runs[fmt] / f.path
            assert local.read_bytes() == origin.read_bytes()
            if f.path.endswith((".pt", ".pth")):
                load_equal(
                    torch.load(local, weights_only=True), torch.load(origin, weights_only=True)
                )
        if fmt == "trainer":
            assert result.path == snapshot / "checkpoint-1000"
        else:  # deepspeed.load_checkpoint(path) / Megatron --load read the pointer there
            assert result.path == snapshot and (snapshot / result.prefetch.files[0].path).exists()


# ------------------------------------------------------------------------------ S3


def _upload_tree(server: Any, bucket: str, root: Path, prefix: str) -> int:
    from test_s3_origin import put

    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            full = Path(dirpath, name)
            data = full.read_bytes()
            put(server, bucket, f"{prefix}/{full.relative_to(root).as_posix()}", data, True)
            total += len(data)
    return total


@pytest.fixture
def s3_runs(
    s3server: Any, s3bucket: str, aws_env: None, runs: dict[str, Path]
) -> Iterator[dict[str, str]]:
    for fmt, root in runs.items():
        _upload_tree(s3server, s3bucket, root, f"runs/{fmt}")
    yield {fmt: f"s3://{s3bucket}/runs/{fmt}/" for fmt in runs}


def test_every_format_from_s3_latest_and_one_rank(
    s3server: Any, s3_runs: dict[str, str], runs: dict[str, Path], tmp_path: Path
) -> None:
    from test_s3_origin import s3_config

    config = s3_config(tmp_path / "cache", s3server)
    picks = {"dcp": "step-200", "deepspeed": "global_step20", "megatron": "iter_0000200",
             "trainer": "checkpoint-1000"}  # fmt: skip
    for fmt, url in s3_runs.items():
        world = 4 if fmt == "megatron" else WORLD
        assert latest(url, config=config).name == picks[fmt]
        result = _run(prefetch_checkpoint(url, config, rank=1, world_size=world))
        assert (result.format, result.checkpoint) == (fmt, picks[fmt])
        files = {f.path: f for f in result.prefetch.files}
        whole = _run(prefetch_checkpoint(url, config))
        assert set(files) < {f.path for f in whole.prefetch.files}
        for path, f in files.items():
            assert (result.prefetch.snapshot_path / path).read_bytes() == (
                runs[fmt] / path
            ).read_bytes()
            assert f.verified == "sha256"  # .metadata too: listed with its checksum
        if fmt == "dcp":
            assert set(files) == {"step-200/.metadata"} | {
                p for p in files if "/__1_" in p
            } and any("/__1_" in p for p in files)
            expected = dcp_expected(200)
            load_equal(dcp_load(whole.path, expected), expected)
        again = _run(prefetch_checkpoint(url, config, rank=1, world_size=world))
        assert again.prefetch.bytes_downloaded == 0


def test_s3_json_from_the_cli(
    s3server: Any, s3_runs: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conf = tmp_path / "shardsync.toml"
    conf.write_text(
        f'[s3]\naddressing = "path"\nregion = "us-east-1"\nendpoint = "{s3server.endpoint}"\n'
    )
    argv = ["--config", str(conf), "prefetch", s3_runs["deepspeed"], "--checkpoint", "latest",
            "--rank", "0", "--world-size", "2", "--cache-dir", str(tmp_path / "c"),
            "--no-daemon", "--json", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["checkpoint"], report["format"]) == ("global_step20", "deepspeed")
    local = Path(report["snapshot_path"])
    assert (local / "latest").read_text() == "global_step20"
    assert sorted(os.listdir(local / "global_step20")) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]


def test_the_sync_client_fetches_one_ranks_checkpoint(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """``SyncClient.prefetch`` takes the checkpoint arguments ``Client.prefetch`` takes, and
    its handle waits for the checkpoint's outcome, for code without an event loop (a
    training script before its process group exists)."""
    from shardsync.client import SyncClient

    with SyncClient(fast_config(tmp_path / "cache"), use_daemon=False) as client:
        job = client.prefetch(str(runs["dcp"]), checkpoint="latest", rank=1, world_size=2)
        result = job.wait_checkpoint()
    assert (result.format, result.checkpoint) == ("dcp", "step-200")
    mine = [n for n in os.listdir(runs["dcp"] / "step-200") if n.startswith("__1_")]
    assert mine and sorted(os.listdir(result.path)) == sorted([".metadata", *mine])


# ------------------------------------------------------------------------------ daemon


async def test_daemon_jobs_per_rank_join_and_share_the_hosts_blobs(
    s3server: Any, s3_runs: dict[str, str], runs: dict[str, Path]
) -> None:
    from daemons import daemon_in_loop, short_tmp
    from test_s3_origin import s3_config

    from shardsync.client import Client

    url = s3_runs["dcp"]
    with short_tmp() as work:
        config = s3_config(work / "cache", s3server)
        async with daemon_in_loop(config, work / "d" / "d.sock") as running:
            client_config = replace(config, daemon=running.config.daemon)
            async with Client(client_config, fallback="error") as client:
                first = await client.prefetch(url, checkpoint="latest", rank=0, world_size=2)
                same = await client.prefetch(url, checkpoint="latest", rank=0, world_size=2)
                other = await client.prefetch(url, checkpoint="latest", rank=1, world_size=2)
                assert first.created and not same.created and same.id == first.id
                assert other.id != first.id
                assert first.info["checkpoint"] == "latest" and first.info["rank"] == 0
                results = [await j.wait_checkpoint() for j in (first, same, other)]
            assert {(r.format, r.checkpoint) for r in results} == {("dcp", "step-200")}
            for result, rank in ((results[0], 0), (results[2], 1)):
                local = result.path
                assert sorted(os.listdir(local)) == sorted(
                    [
                        ".metadata",
                        *(
                            n
                            for n in os.listdir(runs["dcp"] / "step-200")
                            if n.startswith(f"__{rank}_")
                        ),
                    ]
                )
            # the shared .metadata is one blob on the host
            assert (results[0].path / ".metadata").resolve() == (
                results[2].path / ".metadata"
            ).resolve()


# ------------------------------------------------------------------------------ transformers


def _tiny_trainer(output: Path, steps: int, save: bool) -> Any:
    """A one-layer Llama of a few thousand parameters, trained by the real ``Trainer`` on
    the CPU (seconds), on 16 fixed sequences."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # what the Trainer needs for torch

    class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    transformers.set_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(output), max_steps=steps, per_device_train_batch_size=2,
        save_strategy="steps" if save else "no", save_steps=1, report_to=[], use_cpu=True,
        disable_tqdm=True, logging_strategy="no", seed=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    return transformers.Trainer(model=model, args=args, train_dataset=Sequences())


def test_a_real_trainer_run_resumes_from_the_latest_checkpoint_fetched_from_a_directory_and_s3(
    s3server: Any, s3bucket: str, aws_env: None, tmp_path: Path
) -> None:
    """``transformers.Trainer`` saves checkpoint-1..3; the upload of checkpoint-3 is torn
    (no ``trainer_state.json``, which the Trainer writes last). ``--checkpoint latest``
    picks checkpoint-2, and a Trainer resumed from the fetched folder reaches exactly the
    weights the uninterrupted run had at step 3 (model, optimizer, scheduler and RNG all
    restored from the cache)."""
    from safetensors.torch import load_file
    from test_s3_origin import s3_config

    run = tmp_path / "run"
    _tiny_trainer(run, steps=3, save=True).train()
    assert sorted(os.listdir(run)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    uninterrupted = load_file(run / "checkpoint-3" / "model.safetensors")
    (run / "checkpoint-3" / "trainer_state.json").unlink()
    _upload_tree(s3server, s3bucket, run, "trainer")

    for n, source in enumerate((str(run), f"s3://{s3bucket}/trainer/")):
        config = s3_config(tmp_path / f"cache{n}", s3server)
        choice = latest(source, config=config)
        assert (choice.format, choice.name) == ("trainer", "checkpoint-2")
        assert [s.name for s in choice.skipped] == ["checkpoint-3"]
        result = _run(prefetch_checkpoint(source, config))
        assert result.checkpoint == "checkpoint-2" and result.path.name == "checkpoint-2"
        assert {f.path for f in result.prefetch.files} == {
            f"checkpoint-2/{name}" for name in os.listdir(run / "checkpoint-2")
        }
        trainer = _tiny_trainer(tmp_path / f"resumed{n}", steps=3, save=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Trainer's notes on the resumed arguments
            trainer.train(resume_from_checkpoint=str(result.path))
        assert trainer.state.global_step == 3
        resumed = {k: v.detach() for k, v in trainer.model.state_dict().items()}
        load_equal({k: resumed[k] for k in uninterrupted}, uninterrupted)
