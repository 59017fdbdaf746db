"""vLLM's ``--load-format shardsync``: the engine's weights come from shardsync.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process it
starts (the API server, the engine core, each worker), so it is idempotent and cheap: it
imports nothing of shardsync's beyond this module until a load starts.

- ``download_model``: a prefetch of the model vLLM was given (a Hub id and its revision or a
  directory), or of the ``source`` option (an ``s3://`` prefix or an http base URL), through
  the daemon when one answers, so every instance and worker on the host shares one download
  (and the fleet's tier, when one is configured).
- ``load_model``/``load_weights``: shardsync's stream opens as vLLM's ``load_model`` starts, so
  the download goes on while vLLM builds the model, and ``model.load_weights`` is fed by it
  in index order as each shard is verified, so loading overlaps downloading; the tensors are
  views of the cache's mapped files and nothing is read twice. vLLM merges q/k/v and
  gate/up itself.

Options come from ``--model-loader-extra-config '{"shardsync": {...}}'``: ``source`` (where
the weights come from, when not from ``--model``), ``config`` (a shardsync TOML file for the
work done in vLLM's own processes, e.g. its ``[s3]`` endpoint), ``priority`` (the daemon's job
priority), ``cache_dir``, ``endpoint``, ``include`` (extra small files) and ``allow_pickle``.
Errors are shardsync's own (``ShardsyncError``).

Why ``source``: vLLM reads the model's config from ``--model`` before any loader runs, and
refuses every load format but its own object-storage ones for an ``s3://`` model. So
``--model`` names the config (a directory, or a Hub id) and ``source`` the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardsync.errors import ConfigError, LoadError

__all__ = ["LOAD_FORMAT", "register"]

LOAD_FORMAT = "shardsync"
_OPTIONS = frozenset(
    {"source", "config", "priority", "cache_dir", "endpoint", "include", "allow_pickle"}
)
_registered = False


@dataclass(frozen=True, slots=True)
class _Options:
    source: str | None = None
    config: str | None = None
    priority: int = 0
    cache_dir: str | None = None
    endpoint: str | None = None
    include: tuple[str, ...] | None = None
    allow_pickle: bool = False


def register() -> None:
    """Register the ``shardsync`` load format with vLLM (once per process)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader(LOAD_FORMAT)
    class ShardsyncModelLoader(BaseModelLoader):  # type: ignore[misc]
        """Downloads through shardsync and feeds ``model.load_weights`` from its stream."""

        _early: Any = None  # the stream ``load_model`` opened for ``load_weights``

        def download_model(self, model_config: Any) -> None:
            _download(model_config, _options(self.load_config))

        def load_model(self, vllm_config: Any, model_config: Any, *args: Any, **kw: Any) -> Any:
            """Open the stream (listing, headers, the download) before vLLM builds the
            model, so the download goes on while vLLM allocates and initializes it, and
            shardsync's own imports and listing are behind it when the weights are asked
            for (0.2 s and 0.24 s for the 2 GB, 2-layer model of ``bench/vllm.py``; more
            for a model of many layers)."""
            self._early = _open_stream(model_config, _options(self.load_config))
            try:
                return super().load_model(vllm_config, model_config, *args, **kw)
            finally:
                early, self._early = self._early, None
                if early is not None:  # vLLM failed before its load_weights took it
                    early.close()

        def load_weights(self, model: Any, model_config: Any) -> None:
            early, self._early = self._early, None
            _load_weights(model, model_config, _options(self.load_config), early)

    _registered = True


def _options(load_config: Any) -> _Options:
    extra = getattr(load_config, "model_loader_extra_config", None) or {}
    beside = sorted(set(extra) - {LOAD_FORMAT}) if isinstance(extra, Mapping) else []
    if beside:  # else a source given beside the key loads --model's weights without a word
        raise ConfigError(
            f'model_loader_extra_config has {beside}: shardsync\'s options go under "shardsync"'
        )
    raw = extra.get(LOAD_FORMAT, {}) if isinstance(extra, Mapping) else {}
    if not isinstance(raw, Mapping):
        raise ConfigError('model_loader_extra_config["shardsync"] must be a JSON object')
    unknown = set(raw) - _OPTIONS
    if unknown:
        raise ConfigError(
            f"unknown shardsync loader options {sorted(unknown)}; known: {sorted(_OPTIONS)}"
        )
    priority = raw.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"shardsync option priority must be an integer, not {priority!r}")
    include = raw.get("include")
    if include is not None and (
        isinstance(include, str)
        or not isinstance(include, Sequence)
        or not all(isinstance(g, str) for g in include)
    ):
        raise ConfigError("shardsync option include must be a list of glob patterns")
    for key in ("source", "config", "cache_dir", "endpoint"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ConfigError(f"shardsync option {key} must be a string")
    allow_pickle = raw.get("allow_pickle", False)
    if not isinstance(allow_pickle, bool):
        raise ConfigError("shardsync option allow_pickle must be true or false")
    return _Options(
        source=raw.get("source"),
        config=raw.get("config"),
        priority=priority,
        cache_dir=raw.get("cache_dir"),
        endpoint=raw.get("endpoint"),
        include=None if include is None else tuple(include),
        allow_pickle=allow_pickle,
    )


def _config(options: _Options) -> Any:
    from pathlib import Path

    from shardsync.config import check_endpoint, load_config

    cache = Path(options.cache_dir).expanduser() if options.cache_dir else None
    path = Path(options.config).expanduser() if options.config else None
    config = load_config(path, cache_dir=cache)
    if options.endpoint:
        from dataclasses import replace

        config = replace(config, endpoint=check_endpoint("endpoint", options.endpoint))
    return config


def _weights_source(model_config: Any, options: _Options) -> tuple[str, str | None]:
    """What the weights come from, and its revision: the ``source`` option's (no revision:
    an object store or a URL has none), else vLLM's model."""
    if options.source is not None:
        return options.source, None
    return str(model_config.model), model_config.revision


def _download(model_config: Any, options: _Options) -> None:
    from shardsync.client import SyncClient

    # a cache or Hub named in the options is this process's to fill, as for the loader
    named = options.cache_dir is not None or options.endpoint is not None
    with SyncClient(_config(options), use_daemon=not named) as client:
        source, revision = _weights_source(model_config, options)
        job = client.prefetch(
            source,
            revision=revision,
            include=options.include,
            priority=options.priority,
            allow_pickle=options.allow_pickle,
        )
        job.wait()


def _open_stream(model_config: Any, options: _Options) -> Any:
    """shardsync's stream of the weights (a ``TensorStream``), started now."""
    from shardsync.loader import stream

    source, revision = _weights_source(model_config, options)
    return stream(
        source,
        revision=revision,
        device_map="cpu",  # views of the cache's mapped files: vLLM copies them in itself
        endpoint=options.endpoint,
        cache_dir=options.cache_dir,  # named: a daemon serving another cache is not used
        allow_pickle=options.allow_pickle,
        priority=options.priority,  # the daemon's job for the stream
        config=_config(options) if options.config else None,
    )


def _load_weights(model: Any, model_config: Any, options: _Options, tensors: Any) -> None:
    """``model.load_weights`` fed by ``tensors`` (a stream ``load_model`` opened), or by a
    stream opened now (vLLM reloading weights calls ``load_weights`` alone)."""
    wanted = {name for name, _ in model.named_parameters()}
    source, _revision = _weights_source(model_config, options)
    with tensors if tensors is not None else _open_stream(model_config, options) as stream:
        loaded = model.load_weights(stream)
    if loaded is not None and getattr(model_config, "quantization", None) is None:
        missing = sorted(wanted - set(loaded))
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise LoadError(
                f"{source}: the checkpoint has no weights for {len(missing)} "
                f"parameters of the model vLLM built ({shown})"
            )
