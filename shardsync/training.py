"""Training checkpoints: which one to resume from, and which of its files one rank reads.

Pure: no I/O. ``choose`` takes an origin's listing (path, size) and the bytes of the few
small files it asks for (``Need``: a DCP ``.metadata``, DeepSpeed's ``latest``, Megatron's
tracker), and answers with a ``Choice``; ``select_rank`` then narrows a choice to one
rank's files. The caller loops::

    contents: dict[str, bytes | None] = {}
    while isinstance(step := choose(listing, "latest", contents), Need):
        contents[step.path] = read_at_most(step.path, step.limit + 1)  # None: no such file

Formats, as the frameworks write them:

* **dcp** (``torch.distributed.checkpoint``): a directory of ``__<rank>_<n>.distcp`` files
  and a pickled ``Metadata`` in ``.metadata``, written last by the coordinator. Complete:
  ``.metadata`` present, and every file its ``storage_data`` names present and at least as
  large as the last byte range it names there. DCP folders side by side (accelerate's
  ``save_state``: the model's and the optimizer's) are one checkpoint, their parent.
* **deepspeed**: ``latest`` names a tag; ``<tag>/mp_rank_XX_model_states.pt`` and
  ``<tag>/[bf16_]zero_pp_rank_<dp>_mp_rank_XX_{optim,model}_states.pt``. Complete: model
  states for every model-parallel rank 0..M-1 and, if ZeRO files exist, ZeRO files for the
  same data-parallel ranks 0..D-1 under every model-parallel rank.
* **trainer** (Hugging Face): ``checkpoint-<step>/`` with ``trainer_state.json`` (written
  last). Complete: ``trainer_state.json`` present (and a DeepSpeed or DCP folder inside is
  checked as such).
* **megatron**: ``latest_checkpointed_iteration.txt`` holds an iteration or ``release``;
  ``iter_<7 digits>/mp_rank_XX[_YYY[_ZZZ]]/model_optim_rng.pt`` or a DCP (``torch_dist``)
  folder. Complete: ``model_optim_rng.pt`` for a full tensor x pipeline (x expert) grid,
  or a complete DCP folder.

``latest`` is the framework's own pointer where it has one (naming an incomplete checkpoint
it is an error: the framework reads it), else the highest step among complete checkpoints;
every candidate passed over is reported in ``Choice.skipped`` with the reason.
"""

from __future__ import annotations

import itertools
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from shardsync.dcp_metadata import (
    DCP_METADATA,
    MAX_METADATA_BYTES,
    DCPMetadata,
    parse_dcp_metadata,
)
from shardsync.errors import ManifestError, UnsafeNameError
from shardsync.manifest import validate_name

__all__ = [
    "DEEPSPEED_LATEST",
    "MEGATRON_TRACKER",
    "Choice",
    "Format",
    "Need",
    "RankSelection",
    "Skipped",
    "choose",
    "select_rank",
]

Format = Literal["dcp", "deepspeed", "trainer", "megatron"]

DEEPSPEED_LATEST = "latest"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"

MAX_POINTER_BYTES = 4096

_DISTCP = re.compile(r"__(\d+)_(\d+)\.distcp")
_DS_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_DS_ZERO = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(?:optim|model)_states\.pt")
_DS_LAYER = re.compile(r"layer_\d+-model_\d+-model_states\.pt")
_TRAINER_DIR = re.compile(r"checkpoint-(\d+)")
_TRAINER_RNG = re.compile(r"rng_state_(\d+)\.pth")
_MEGATRON_DIR = re.compile(r"iter_(\d{7,})|release")
_MEGATRON_RANK_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?")
_MEGATRON_FILE = "model_optim_rng.pt"
_STEP = re.compile(r"(\d+)$")
_FSDP_MODEL = re.compile(r"pytorch_model_fsdp_\d+")
_RANK_METADATA = re.compile(r"__\d+\.metadata")


# ------------------------------------------------------------------------------ values


@dataclass(frozen=True, slots=True)
class Need:
    """Bytes the caller must supply before ``choose`` can go on: ``contents[path]`` is
    the file's first ``limit + 1`` bytes at most, or None when there is no such file."""

    path: str
    limit: int


@dataclass(frozen=True, slots=True)
class Skipped:
    """A checkpoint that was not chosen, and why."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Choice:
    """The checkpoint to resume from.

    ``name`` is its folder under the source; ``root`` the folder a framework is pointed at
    (the checkpoint folder itself, or for DeepSpeed and Megatron the run folder holding the
    pointer file); ``files`` every file of it, pointer included when it names this one.
    """

    format: Format
    name: str
    step: int | None
    root: str
    files: tuple[tuple[str, int | None], ...]
    skipped: tuple[Skipped, ...] = ()
    dcp: DCPMetadata | None = None
    dcp_dir: str | None = None  # the folder of the DCP files (a Megatron torch_dist one too)

    @property
    def total_size(self) -> int:
        return sum(size or 0 for _, size in self.files)


@dataclass(frozen=True, slots=True)
class RankSelection:
    """The files one rank reads, and what was decided on the way."""

    files: tuple[tuple[str, int | None], ...]
    notes: tuple[str, ...] = ()

    @property
    def total_size(self) -> int:
        return sum(size or 0 for _, size in self.files)


# ------------------------------------------------------------------------------ helpers


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _step(name: str, depth: int = -1) -> int | None:
    """The number that ends ``name``'s component ``depth`` (its last by default)."""
    parts = name.split("/")
    m = _STEP.search(parts[depth] if -len(parts) <= depth < len(parts) else "")
    return int(m.group(1)) if m else None


def _step_depth(candidates: Sequence[str]) -> int:
    """The path component that tells candidates apart, the first that differs (``step-200/
    model``, ``checkpoints/checkpoint_9/pytorch_model_fsdp_0``), else the last."""
    split = [c.split("/") for c in candidates]
    if len(split) > 1 and len({len(p) for p in split}) == 1:
        for depth in range(len(split[0])):
            if len({p[depth] for p in split}) > 1:
                return depth
    return -1


class _Tree:
    """The listing, by folder."""

    def __init__(self, listing: Iterable[tuple[str, int | None]]) -> None:
        self.sizes: dict[str, int | None] = {}
        for path, size in listing:
            self.sizes[validate_name(path)] = size

    def under(self, folder: str) -> list[tuple[str, int | None]]:
        prefix = folder + "/" if folder else ""
        return sorted((p, s) for p, s in self.sizes.items() if p.startswith(prefix))

    def top_dirs(self) -> set[str]:
        return {p.split("/", 1)[0] for p in self.sizes if "/" in p}

    def dcp_dirs(self) -> list[str]:
        return sorted(
            {posixpath.dirname(p) for p in self.sizes if _DISTCP.fullmatch(posixpath.basename(p))}
        )


class _Incomplete(Exception):
    """A candidate that is not (yet) a complete checkpoint."""


class _Resolver:
    def __init__(self, tree: _Tree, contents: Mapping[str, bytes | None]) -> None:
        self.tree = tree
        self.contents = contents

    def read(self, path: str, limit: int) -> bytes | None:
        """The bytes of a small file, or raise ``_NeedBytes``."""
        if path not in self.contents:
            raise _NeedBytes(Need(path, limit))
        data = self.contents[path]
        if data is not None and len(data) > limit:
            raise ManifestError(f"{path}: larger than {limit} bytes")
        return data

    # -- completeness, per format; each returns the checkpoint's files or raises _Incomplete

    def dcp(self, folder: str) -> tuple[list[tuple[str, int | None]], DCPMetadata]:
        meta_path = _join(folder, DCP_METADATA)
        data = self.read(meta_path, MAX_METADATA_BYTES)
        if data is None and any(
            _RANK_METADATA.fullmatch(posixpath.basename(p)) for p, _ in self.tree.under(folder)
        ):  # dcp.save(..., use_collectives=False): not torn, so not passed over
            raise ManifestError(
                f"{folder or 'the checkpoint'} was saved without collectives (one "
                f"__R.metadata per rank), which shardsync cannot read yet"
            )
        if data is None:
            raise _Incomplete(f"no {DCP_METADATA} (torn: the coordinator writes it last)")
        meta = replace(parse_dcp_metadata(data, path=meta_path), folder=folder)
        for rel, end in sorted(meta.needed.items()):
            size = self.tree.sizes.get(_join(folder, rel))
            if size is None:
                raise _Incomplete(f"{rel} named by {DCP_METADATA} is missing")
            if size < end:
                raise _Incomplete(f"{rel} has {size} bytes, {DCP_METADATA} needs {end}")
        files = [(p, s) for p, s in self.tree.under(folder) if p != meta_path]
        files.append((meta_path, len(data)))
        return sorted(files), meta

    def deepspeed(self, tag: str) -> list[tuple[str, int | None]]:
        files = self.tree.under(tag)
        names = [posixpath.basename(p) for p, _ in files if posixpath.dirname(p) == tag]
        models = {int(m.group(1)) for n in names if (m := _DS_MODEL.fullmatch(n))}
        optim: set[tuple[int, int]] = set()
        zero_models: set[tuple[int, int]] = set()  # ZeRO-3: model states per (dp, mp) too
        for n in names:
            if m := _DS_ZERO.fullmatch(n):
                cell = (int(m.group(1)), int(m.group(2)))
                (optim if n.endswith("_optim_states.pt") else zero_models).add(cell)
        if zero_models:
            if optim and optim != zero_models:
                raise _Incomplete("ZeRO-3 model and optimizer states differ in ranks")
            _full_grid(zero_models, "ZeRO-3 model states")
        elif not models:
            raise _Incomplete("no mp_rank_XX_model_states.pt (model states)")
        else:
            if models != set(range(len(models))):
                raise _Incomplete(f"model states of model-parallel ranks {sorted(models)}")
            if optim:
                if {mp for _, mp in optim} != models:
                    raise _Incomplete("ZeRO files and model states differ in model-parallel ranks")
                _full_grid(optim, "ZeRO optimizer states")
        return files

    def megatron(self, folder: str) -> tuple[list[tuple[str, int | None]], DCPMetadata | None]:
        files = self.tree.under(folder)
        if any(_DISTCP.fullmatch(posixpath.basename(p)) for p, _ in files):
            return self.dcp(folder)
        grid: set[tuple[int, ...]] = set()
        for p, _ in files:
            parts = p[len(folder) + 1 :].split("/")
            if len(parts) == 2 and parts[1] == _MEGATRON_FILE:
                m = _MEGATRON_RANK_DIR.fullmatch(parts[0])
                if m:
                    grid.add(tuple(int(g) for g in m.groups() if g is not None))
        if not grid:
            raise _Incomplete(f"no mp_rank_*/{_MEGATRON_FILE}")
        # mp_rank_TT, _TT_PPP, or _TT_PPP_EEE with expert parallelism: every rank of each
        sizes = [len({cell[i] for cell in grid}) for i in range(max(map(len, grid)))]
        if grid != set(itertools.product(*map(range, sizes))):
            raise _Incomplete("the tensor x pipeline (x expert) rank folders are not a full grid")
        return files, None

    def trainer(self, folder: str) -> tuple[list[tuple[str, int | None]], DCPMetadata | None]:
        if _join(folder, TRAINER_STATE) not in self.tree.sizes:
            raise _Incomplete(f"no {TRAINER_STATE} (the Trainer writes it last)")
        return self.with_parts(folder)

    def with_parts(self, folder: str) -> tuple[list[tuple[str, int | None]], DCPMetadata | None]:
        """A folder whose subfolders are DCP or DeepSpeed checkpoints, each checked as such
        (a Trainer's; accelerate's ``save_state``); every file of it is the checkpoint's."""
        files = self.tree.under(folder)
        metas: list[DCPMetadata] = []
        for sub in sorted({posixpath.dirname(p) for p, _ in files} - {folder}):
            if posixpath.dirname(sub) != folder:
                continue
            inner = self.tree.under(sub)
            if any(_DISTCP.fullmatch(posixpath.basename(p)) for p, _ in inner):
                dcp_files, meta = self.dcp(sub)  # an FSDP folder (pytorch_model_fsdp_0, ...)
                files = sorted({*files, *dcp_files})
                metas.append(meta)
            elif any(_is_deepspeed(posixpath.basename(p)) for p, _ in inner):
                self.deepspeed(sub)
        # accelerate writes the model's (``pytorch_model_fsdp_<i>``) beside the optimizer's
        # (``optimizer_<i>``): a reader of the model reads that one, and of several models
        # none (it is pointed at the folder it wants instead)
        models = [m for m in metas if _FSDP_MODEL.fullmatch(posixpath.basename(m.folder))]
        one = metas if len(metas) == 1 else models if len(models) == 1 else []
        return files, one[0] if one else None


def _is_deepspeed(name: str) -> bool:
    """A DeepSpeed tag's file: model states, or ZeRO ones (ZeRO-3 writes no others)."""
    return bool(_DS_MODEL.fullmatch(name) or _DS_ZERO.fullmatch(name))


def _full_grid(cells: set[tuple[int, int]], what: str) -> None:
    """(data-parallel, model-parallel) ranks must be 0..D-1 x 0..M-1."""
    dps = {d for d, _ in cells}
    mps = {m for _, m in cells}
    if cells != {(d, m) for d in range(len(dps)) for m in range(len(mps))}:
        raise _Incomplete(f"{what}: (data, model)-parallel ranks {sorted(cells)} are not a grid")


class _NeedBytes(Exception):
    def __init__(self, need: Need) -> None:
        super().__init__(need.path)
        self.need = need


# ------------------------------------------------------------------------------ choose


def choose(
    listing: Iterable[tuple[str, int | None]],
    checkpoint: str = "latest",
    contents: Mapping[str, bytes | None] | None = None,
) -> Choice | Need:
    """The checkpoint ``checkpoint`` names (``latest``, or a folder under the source), or
    the small file whose bytes are needed first. Raises ``ManifestError`` when there is no
    training checkpoint or the named one is incomplete, ``UnsafeNameError`` for hostile
    names (in the listing, the argument, a pointer file or a ``.metadata``)."""
    tree = _Tree(listing)
    if checkpoint != "latest":
        validate_name(checkpoint)
    resolver = _Resolver(tree, contents or {})
    try:
        return _choose(tree, resolver, checkpoint)
    except _NeedBytes as need:
        return need.need


def _choose(tree: _Tree, r: _Resolver, wanted: str) -> Choice:
    if MEGATRON_TRACKER in tree.sizes:
        return _with_pointer(tree, r, wanted, "megatron")
    if DEEPSPEED_LATEST in tree.sizes:
        return _with_pointer(tree, r, wanted, "deepspeed")
    trainer = sorted(d for d in tree.top_dirs() if _TRAINER_DIR.fullmatch(d))
    dcp = tree.dcp_dirs()
    # checkpoint-N/ is the Trainer's where one holds what it writes first or last, or no
    # DCP folder is there (a torn run still says why); else a DCP run's name for its steps
    marks = (TRAINER_STATE, "training_args.bin")
    if trainer and (not dcp or any(_join(d, m) in tree.sizes for d in trainer for m in marks)):
        return _highest(r, wanted, "trainer", trainer, r.trainer)
    if dcp:
        # DCP folders side by side of one step (accelerate's pytorch_model_fsdp_0/ and
        # optimizer_0/) are parts of one checkpoint, their parent, with its rng and scheduler
        parents = [posixpath.dirname(d) for d in dcp]
        kids = {p: [d for d in dcp if posixpath.dirname(d) == p] for p in parents}
        groups = {p for p in parents if _parts_of_one_step(kids[p])} - set(dcp)
        # the parts a step beside those holds: one lone part there is that step, torn
        parts: dict[str, set[str]] = {}
        for g in groups:
            parts.setdefault(posixpath.dirname(g), set()).update(map(posixpath.basename, kids[g]))
        groups |= {
            p
            for d, p in zip(dcp, parents, strict=True)
            if p not in dcp and posixpath.basename(d) in parts.get(posixpath.dirname(p), ())
        }

        def check(d: str) -> tuple[list[tuple[str, int | None]], DCPMetadata | None]:
            if d not in groups:
                return r.dcp(d)
            lacks = parts[posixpath.dirname(d)] - {posixpath.basename(k) for k in kids[d]}
            if lacks:
                raise _Incomplete(f"no {', '.join(sorted(lacks))} beside its other parts")
            return r.with_parts(d)

        named = sorted({p if p in groups else d for d, p in zip(dcp, parents, strict=True)})
        return _highest(r, wanted, "dcp", named, check)
    ds = sorted(
        d
        for d in tree.top_dirs()
        if any(_is_deepspeed(posixpath.basename(p)) for p, _ in tree.under(d))
    )
    if ds:
        return _highest(r, wanted, "deepspeed", ds, lambda d: (r.deepspeed(d), None))
    raise ManifestError(
        "no training checkpoint found: expected a DCP folder (.metadata + __R_N.distcp), "
        f"DeepSpeed's {DEEPSPEED_LATEST}, Trainer checkpoint-N/ folders or Megatron's "
        f"{MEGATRON_TRACKER}"
    )


def _parts_of_one_step(folders: list[str]) -> bool:
    """DCP folders side by side are parts of one checkpoint, not steps of a run (``step_100/``,
    ``step_200/``), when one number ends them all, or several names end in the same numbers:
    accelerate's ``pytorch_model_fsdp_<i>/`` and ``optimizer_<i>/``, ``i`` a model's index."""
    if len(folders) < 2:
        return False
    numbers: dict[str, set[int | None]] = {}
    for base in map(posixpath.basename, folders):
        numbers.setdefault(_STEP.sub("", base), set()).add(_step(base))
    return len(set().union(*numbers.values())) == 1 or (
        len(numbers) > 1 and len({frozenset(n) for n in numbers.values()}) == 1
    )


def _highest(
    r: _Resolver,
    wanted: str,
    fmt: Format,
    candidates: Sequence[str],
    check: Any,
) -> Choice:
    """The named candidate if complete; for ``latest`` the highest complete step."""
    depth = _step_depth(candidates)
    if wanted != "latest":
        if wanted not in candidates:
            raise ManifestError(
                f"no {fmt} checkpoint {wanted!r}; there are: {', '.join(candidates)}"
            )
        order = [wanted]
    else:
        order = sorted(
            candidates, key=lambda d: (_step(d, depth) is not None, _step(d, depth) or 0, d)
        )[::-1]
    skipped: list[Skipped] = []
    for name in order:
        try:
            files, meta = check(name)
        except _Incomplete as exc:
            if wanted != "latest":
                raise ManifestError(f"checkpoint {name!r} is incomplete: {exc}") from None
            skipped.append(Skipped(name, str(exc)))
            continue
        root = name
        return Choice(
            format=fmt,
            name=name,
            step=_step(name, depth),
            root=root,
            files=tuple(files),
            skipped=tuple(skipped),
            dcp=meta,
            dcp_dir=None if meta is None else meta.folder,
        )
    detail = "; ".join(f"{s.name}: {s.reason}" for s in skipped)
    raise ManifestError(f"no complete {fmt} checkpoint ({detail})")


def _read_pointer(r: _Resolver, fmt: Format) -> str | None:
    """The folder the framework's pointer file names (None: it names nothing usable)."""
    path = MEGATRON_TRACKER if fmt == "megatron" else DEEPSPEED_LATEST
    data = r.read(path, MAX_POINTER_BYTES)
    if data is None:
        return None
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ManifestError(f"{path} is not UTF-8 text") from None
    if not text:  # truncated before the framework writes it again
        raise ManifestError(f"{path} is empty: the run is writing it; run again")
    if fmt == "megatron":
        if text == "release":
            return "release"
        if not (text.isascii() and text.isdigit()):  # "\u00b2".isdigit(), yet int() refuses it
            raise ManifestError(f"{path} holds {text!r}, not an iteration number or 'release'")
        return f"iter_{int(text):07d}"
    try:
        validate_name(text)
    except UnsafeNameError as exc:
        raise UnsafeNameError(f"{path} points outside the checkpoint folder: {exc}") from None
    if "/" in text:
        raise UnsafeNameError(f"{path} names {text!r}, not a folder next to it")
    return text


def _with_pointer(tree: _Tree, r: _Resolver, wanted: str, fmt: Format) -> Choice:
    pointer_file = MEGATRON_TRACKER if fmt == "megatron" else DEEPSPEED_LATEST
    try:
        target = _read_pointer(r, fmt)
    except ManifestError:
        if wanted == "latest":
            raise
        target = None  # one asked by name is fetched without a pointer that names nothing
    if fmt == "megatron":
        candidates = sorted(d for d in tree.top_dirs() if _MEGATRON_DIR.fullmatch(d))

        def check(d: str) -> tuple[list[tuple[str, int | None]], DCPMetadata | None]:
            return r.megatron(d)
    else:
        candidates = sorted(
            d
            for d in tree.top_dirs()
            if any(_is_deepspeed(p.rsplit("/", 1)[-1]) for p, _ in tree.under(d))
        )

        def check(d: str) -> tuple[list[tuple[str, int | None]], DCPMetadata | None]:
            return r.deepspeed(d), None

    if wanted == "latest":
        if target is None or target not in tree.top_dirs():
            problem = f"{pointer_file} names {target or 'nothing'}, which is not in the listing"
        else:
            try:
                files, meta = check(target)
            except _Incomplete as exc:
                problem = f"{pointer_file} names {target}, which is incomplete: {exc}"
            else:
                return _pointer_choice(fmt, target, files, meta, pointer_file, tree)
        # Not the next best: the framework, pointed at the run folder, reads the pointer, and
        # without it starts from scratch (Megatron) or loads nothing (DeepSpeed).
        try:
            older = _highest(r, wanted, fmt, [c for c in candidates if c != target], check).name
        except ManifestError:
            raise ManifestError(f"no complete {fmt} checkpoint: {problem}") from None
        raise ManifestError(
            f"{problem}; the newest complete one is {older}: fetch it with --checkpoint "
            f"{older} and resume from it by name ({_by_name(fmt, older)})"
        )
    choice = _highest(r, wanted, fmt, candidates, check)
    return _pointer_choice(
        fmt,
        choice.name,
        list(choice.files),
        choice.dcp,
        pointer_file if target == choice.name else None,
        tree,
    )


def _by_name(fmt: Format, name: str) -> str:
    """How a framework pointed at the run folder is told which checkpoint to load."""
    if fmt == "deepspeed":
        return f"load_checkpoint(path, tag={name!r})"
    step = _step(name)
    return f"Megatron's --ckpt-step {step}" if step is not None else f"a tracker naming {name}"


def _pointer_choice(
    fmt: Format,
    name: str,
    files: list[tuple[str, int | None]],
    meta: DCPMetadata | None,
    pointer_file: str | None,
    tree: _Tree,
) -> Choice:
    """DeepSpeed and Megatron are pointed at the run folder: the pointer file goes with
    the checkpoint when it names this one (else the caller passes the tag/iteration, and
    ``select_rank`` says so)."""
    if pointer_file is not None:
        files = sorted({*files, (pointer_file, tree.sizes[pointer_file])})
    step = _step(name)
    return Choice(
        format=fmt,
        name=name,
        step=step,
        root="",
        files=tuple(files),
        dcp=meta,
        dcp_dir=None if meta is None else meta.folder,
    )


# ------------------------------------------------------------------------------ ranks


def select_rank(choice: Choice, rank: int | None, world_size: int | None) -> RankSelection:
    """The files rank ``rank`` of ``world_size`` reads; every file without a rank.

    A file that belongs to a rank (``__R_N.distcp``, ``zero_pp_rank_R_...``,
    ``rng_state_R.pth``, Megatron's ``mp_rank_XX[_YYY]/``) is kept only for this rank; every
    other file is shared. When the checkpoint was saved by another number of ranks than
    ``world_size``, the mapping is unknown and the whole checkpoint is selected.
    """
    notes: list[str] = []
    pointer = {"megatron": MEGATRON_TRACKER, "deepspeed": DEEPSPEED_LATEST}.get(choice.format)
    if pointer is not None and all(p != pointer for p, _ in choice.files):
        notes.append(
            f"the run's {pointer} names another checkpoint and is not in this folder: "
            f"resume from {choice.name} by name ({_by_name(choice.format, choice.name)})"
        )
    if rank is None and world_size is None:
        return RankSelection(files=choice.files, notes=tuple(notes))
    if rank is None or world_size is None:
        raise ManifestError("give both rank and world size, or neither")
    for what, value in (("rank", rank), ("world size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ManifestError(f"{what} must be a non-negative integer (got {value!r})")
    if world_size < 1 or rank >= world_size:
        raise ManifestError(f"rank {rank} is not within a world size of {world_size}")

    names = [(p, s, posixpath.basename(p)) for p, s in choice.files]
    distcp = {int(m.group(1)) for _, _, n in names if (m := _DISTCP.fullmatch(n))}
    zero = {(int(m.group(1)), int(m.group(2))) for _, _, n in names if (m := _DS_ZERO.fullmatch(n))}
    rng = {int(m.group(1)) for _, _, n in names if (m := _TRAINER_RNG.fullmatch(n))}
    grid = _megatron_grid(choice)

    keep_distcp: set[int] | None = None
    if distcp:
        if len(distcp) == world_size:
            keep_distcp = {rank}
        else:
            notes.append(
                f"DCP files were written by {len(distcp)} ranks, not {world_size}: "
                "every data file is selected"
            )
    keep_zero: set[tuple[int, int]] | None = None
    keep_model_mp: int | None = None
    if zero:
        mp, dp = len({m for _, m in zero}), len({d for d, _ in zero})
        if any(_DS_LAYER.fullmatch(n) for _, _, n in names):  # a pipeline: stage-major ranks
            notes.append("a DeepSpeed pipeline's ranks are unknown: every ZeRO file is selected")
        elif mp * dp == world_size:
            keep_zero, keep_model_mp = {(rank // mp, rank % mp)}, rank % mp
        else:
            notes.append(
                f"DeepSpeed saved {dp} data x {mp} model-parallel ranks, not {world_size}: "
                "every ZeRO file is selected"
            )
    keep_rng: int | None = None
    if rng:
        if len(rng) == world_size:
            keep_rng = rank
        else:
            notes.append(f"rng states of {len(rng)} ranks, not {world_size}: all selected")
    keep_grid: tuple[int, int] | None = None
    if grid:
        tp = len({t for t, _ in grid})
        pp = len({q for _, q in grid})
        if world_size % (tp * pp) == 0:
            per_stage = world_size // pp  # Megatron's order: tp fastest, pp slowest
            keep_grid = (rank % tp, rank // per_stage)
        else:
            notes.append(
                f"Megatron saved {tp} tensor x {pp} pipeline ranks, which do not divide "
                f"{world_size}: every rank folder is selected"
            )

    def keep(path: str, name: str) -> bool:
        if m := _DISTCP.fullmatch(name):
            return keep_distcp is None or int(m.group(1)) in keep_distcp
        if m := _DS_ZERO.fullmatch(name):
            return keep_zero is None or (int(m.group(1)), int(m.group(2))) in keep_zero
        if m := _DS_MODEL.fullmatch(name):
            return keep_model_mp is None or int(m.group(1)) == keep_model_mp
        if m := _TRAINER_RNG.fullmatch(name):
            return keep_rng is None or int(m.group(1)) == keep_rng
        cell = _megatron_cell(choice, path)
        return keep_grid is None or cell is None or cell == keep_grid

    files = [(path, size) for path, size, name in names if keep(path, name)]
    return RankSelection(files=tuple(files), notes=tuple(notes))


def _megatron_cell(choice: Choice, path: str) -> tuple[int, int] | None:
    if choice.format != "megatron":
        return None
    parts = path.split("/")
    if len(parts) != 3 or parts[0] != choice.name:
        return None
    m = _MEGATRON_RANK_DIR.fullmatch(parts[1])
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def _megatron_grid(choice: Choice) -> set[tuple[int, int]]:
    return {c for p, _ in choice.files if (c := _megatron_cell(choice, p)) is not None}
