"""Typed job configs: dataclasses loaded from TOML and overridden by ``--set a.b=c``.

Each component owns its settings as a ``@dataclass(kw_only=True, slots=True)`` with checks
in ``__post_init__``; this module only knows how to build such dataclasses from plain
data, type-check them, and write them back. Rules:

- Unknown keys fail, naming the path and the valid keys.
- Values must have the declared type (an int is accepted where a float is declared);
  a wrong type fails naming the path, the expected and the found type.
- ``--set section.key=value`` parses ``value`` as a TOML value when it can (``3``,
  ``true``, ``[1, 2]``, ``"x"``) and as a bare string otherwise.
- A key that moved to a section of its own (``MOVED``) fails in a job file or ``--set``
  with one line naming its new place; a saved job (a checkpoint's config) is read with
  its moved keys put in their new places (``saved_job``).

No torch here: the module is imported by the CLI before any heavy import.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

import tomli_w

from recsys.errors import UserError

T = TypeVar("T")


class ConfigError(UserError):
    """A job file or override does not fit the config's declared shape."""


# --------------------------------------------------------------------------- building


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Return an instance of dataclass ``cls`` built from ``data`` (nested dicts/lists); a
    whole job (``JobConfig``) holding a key of ``MOVED`` fails naming its new place."""
    where = where or cls.__name__
    if cls is JobConfig and isinstance(data, dict):
        check_moved(data, where)
    return _convert(cls, data, where)


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, found {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table for {tp.__name__}, found {_tname(value)}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {unknown}; valid keys are {sorted(fields)}"
            )
        kwargs = {k: _convert(hints[k], v, f"{where}.{k}") for k, v in value.items()}
        missing = [
            n
            for n, f in fields.items()
            if n not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"{where}: missing required key(s) {missing}")
        try:
            return tp(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, found {_tname(value)}")
        (item_tp,) = args
        return [_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, found {_tname(value)}")
        key_tp, val_tp = args
        return {str(k): _convert(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a float, found {_tname(value)} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an int, found {_tname(value)} {value!r}")
        return value
    if tp is bool or tp is str:
        if type(value) is not tp:
            raise ConfigError(f"{where}: expected a {tp.__name__}, found {_tname(value)} {value!r}")
        return value
    raise TypeError(f"{where}: unsupported config type {tp!r}")  # a programming error


def _tname(value: Any) -> str:
    return {dict: "table", list: "list", str: "string"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """Return (dotted path, value) for ``a.b.c=value``; value parsed as TOML when possible."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"--set {text!r}: empty key in {path!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return keys, value


def apply_overrides(data: dict, overrides: list[str], cls: type | None = None) -> dict:
    """Return a copy of ``data`` with each ``a.b=c`` override set (checked against ``cls``)."""
    out = _deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node, tp = out, cls
        for i, key in enumerate(keys):
            if tp is not None and dataclasses.is_dataclass(tp):
                valid = sorted(f.name for f in dataclasses.fields(tp) if f.init)
                if key not in valid:
                    old = ".".join(keys[: i + 1])
                    if cls is JobConfig and old in MOVED:
                        raise ConfigError(f"--set {text!r}: {moved_message(old)}")
                    where = ".".join(keys[:i]) or "top level"
                    raise ConfigError(
                        f"--set {text!r}: unknown key {key!r} in {where}; valid keys are {valid}"
                    )
                tp = _unwrap_optional(typing.get_type_hints(tp)[key])
            elif tp is not None and typing.get_origin(tp) is dict:
                tp = _unwrap_optional(typing.get_args(tp)[1])
            else:
                tp = None
            if i == len(keys) - 1:
                node[key] = value
            else:
                child = node.setdefault(key, {})
                if not isinstance(child, dict):
                    raise ConfigError(f"--set {text!r}: {'.'.join(keys[: i + 1])} is not a table")
                node = child
    return out


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


# --------------------------------------------------------------------------- files


def read_toml(path: str | os.PathLike) -> dict:
    """Return the parsed TOML file; a syntax error names the file and line."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: job file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a job file (TOML)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the job file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); a job file is TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def load(cls: type[T], path: str | os.PathLike | None = None, overrides: list[str] = ()) -> T:
    """Return ``cls`` built from the TOML file at ``path`` with ``--set`` overrides applied."""
    data = read_toml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides), cls)
    where = str(path) if path is not None else cls.__name__
    return from_dict(cls, data, where)


def to_dict(cfg: Any) -> Any:
    """Return plain data (dicts/lists/scalars, no ``None``) that ``from_dict`` maps back to ``cfg``."""
    if dataclasses.is_dataclass(cfg):
        out = {}
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if value is not None:
                out[f.name] = to_dict(value)
        return out
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items() if v is not None}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def dumps(cfg: Any) -> str:
    """Return ``cfg`` as TOML text (loadable again as a job file), with no secret in it.

    The text is saved (a run's ``config.toml``, every checkpoint's ``meta.json``), and run
    directories and checkpoints are copied to serving hosts and shared: every Redis URL in
    it is written without its password (``recsys.redisio.client.strip_password``). A run that
    loads it again takes the password from the ``*_password_file`` keys or
    ``$REDIS_PASSWORD``."""
    return tomli_w.dumps(_without_secrets(to_dict(cfg)))


def _without_secrets(data: Any) -> Any:
    from recsys.redisio.client import URL_SCHEMES, redact, strip_password

    if isinstance(data, dict):
        return {k: _without_secrets(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_without_secrets(v) for v in data]
    if isinstance(data, str) and data.startswith(URL_SCHEMES):
        try:
            return strip_password(data)
        except ValueError:  # not parsable: nothing of it is kept but what redact shows
            return redact(data)
    return data


def saved_job(text: str, where: str) -> "JobConfig":
    """Return the job of a saved config (a checkpoint's ``meta.json`` ``config``), with the
    settings its recsys had implied where a default changed since
    (``saved_model_settings``, ``saved_schema_settings``) and its keys of ``MOVED`` in their
    new places (``move_keys``): a checkpoint written before a key moved still evaluates,
    serves and exports."""
    from recsys.model.config import saved_model_settings
    from recsys.features.schema import saved_schema_settings

    data = saved_schema_settings(saved_model_settings(move_keys(tomllib.loads(text))))
    return from_dict(JobConfig, data, where)


def write_resolved(cfg: Any, run_dir: str | os.PathLike, name: str = "config.toml") -> Path:
    """Write the resolved config into ``run_dir`` and return its path."""
    path = Path(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dumps(cfg))
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- the job


from recsys.io.config import ReaderConfig  # noqa: E402  (component configs, torch-free)
from recsys.model.config import ModelConfig  # noqa: E402
from recsys.features.schema import Schema  # noqa: E402
from recsys.store.config import StoreConfig  # noqa: E402
from recsys.train.config import PublishConfig, TrainConfig  # noqa: E402


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The data a job reads: the train and eval splits share the schema."""

    train: ReaderConfig = dataclasses.field(default_factory=ReaderConfig)
    """Training split and how it is read."""
    eval: ReaderConfig = dataclasses.field(
        default_factory=lambda: ReaderConfig(shuffle=False)
    )
    """Evaluation split (read in order, once: ``shuffle = false`` unless set)."""
    validation: ReaderConfig = dataclasses.field(
        default_factory=lambda: ReaderConfig(shuffle=False)
    )
    """Validation split for the periodic evaluations during training (``shuffle = false``
    unless set; no paths: the eval split, or ``train.eval.validation_fraction``'s held-out
    row groups)."""


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """A whole job file: one section per component."""

    name: str = "job"
    """Job name (used in run directory names)."""
    schema: Schema = dataclasses.field(default_factory=Schema)
    """Feature schema."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Data splits."""
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    """Embedding store: sparse optimizer, initialization, admission, staleness; its spill tier,
    device tiers and use of the host."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Dense model."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Training loop: the dense optimizer and its schedule, evaluations, checkpoints, logging,
    and how the processes run."""
    publish: PublishConfig = dataclasses.field(default_factory=PublishConfig)
    """Live pushes of fresh rows to the serving tier while training (``recsys serve --follow``)."""


def load_job(path: str | os.PathLike, overrides: list[str] = ()) -> JobConfig:
    """Return the job at ``path`` with overrides applied; relative data paths resolve from the CWD."""
    return load(JobConfig, path, overrides)


# --------------------------------------------------------------------------- moved keys


MOVED: dict[str, str] = {
    "store.spill_url": "store.spill.url",
    "store.spill_password_file": "store.spill.password_file",
    "store.spill_namespace": "store.spill.namespace",
    "store.spill_takeover": "store.spill.takeover",
    "store.spill_outage": "store.spill.outage",
    "store.spill_hold_timeout_s": "store.spill.hold_timeout_s",
    "store.spill_hold_max_rows": "store.spill.hold_max_rows",
    "store.spill_delete_restored": "store.spill.delete_restored",
    "store.spill_batch_rows": "store.spill.batch_rows",
    "store.spill_queue_rows": "store.spill.queue_rows",
    "store.spill_retries": "store.spill.retries",
    "store.spill_backoff_s": "store.spill.backoff_s",
    "store.spill_timeout_s": "store.spill.timeout_s",
    "store.device_cache_rows": "store.device.cache_rows",
    "store.device_memory_gb": "store.device.memory_gb",
    "store.prefault": "store.host.prefault",
    "store.huge_pages": "store.host.huge_pages",
    "store.threads": "store.host.threads",
    "store.waiter_helps": "store.host.waiter_helps",
    "store.keep_freed_memory": "store.host.keep_freed_memory",
    "train.optimizer": "train.optim.name",
    "train.fused_optimizer": "train.optim.fused",
    "train.lr": "train.optim.lr",
    "train.weight_decay": "train.optim.weight_decay",
    "train.clip_grad_norm": "train.optim.clip_grad_norm",
    "train.warmup_steps": "train.schedule.warmup_steps",
    "train.decay": "train.schedule.decay",
    "train.min_lr_ratio": "train.schedule.min_lr_ratio",
    "train.eval_every": "train.eval.every",
    "train.eval_every_epochs": "train.eval.every_epochs",
    "train.eval_max_rows": "train.eval.max_rows",
    "train.keep_best": "train.eval.keep_best",
    "train.early_stopping_patience": "train.eval.early_stopping_patience",
    "train.validation_fraction": "train.eval.validation_fraction",
    "train.checkpoint_every_steps": "train.checkpoint.every_steps",
    "train.checkpoint_every_minutes": "train.checkpoint.every_minutes",
    "train.keep_last": "train.checkpoint.keep_last",
    "train.threads": "train.runtime.threads",
    "train.optimizer_threads": "train.runtime.optimizer_threads",
    "train.idle_background": "train.runtime.idle_background",
    "train.pin_cores": "train.runtime.pin_cores",
    "train.local_exchange": "train.runtime.local_exchange",
    "train.collective_timeout_s": "train.runtime.collective_timeout_s",
}
"""Job keys that moved into a section of their component, old path -> new path. A job file
or ``--set`` naming an old path fails with ``moved_message``; a saved job is moved
(``move_keys``)."""


def moved_message(old: str) -> str:
    """Return the one-line error of the moved key ``old``: ``store.spill_url: moved to store.spill.url``."""
    return f"{old}: moved to {MOVED[old]}"


def _lookup(data: dict, path: str) -> tuple[dict, str] | None:
    """Return (the table holding ``path``'s last key, that key) when ``data`` has ``path``."""
    *parents, last = path.split(".")
    node: Any = data
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    return (node, last) if isinstance(node, dict) and last in node else None


def check_moved(data: dict, where: str) -> None:
    """Raise ``ConfigError`` (one line, naming every moved key's new place) when the job
    ``data`` sets a key of ``MOVED``."""
    found = [old for old in MOVED if _lookup(data, old) is not None]
    if found:
        raise ConfigError(f"{where}: " + "; ".join(moved_message(old) for old in found))


def move_keys(data: dict) -> dict:
    """Return the job ``data`` (plain data, changed in place) with every key of ``MOVED`` it
    sets put at its new path."""
    for old, new in MOVED.items():
        hit = _lookup(data, old)
        if hit is None:
            continue
        table, key = hit
        value = table.pop(key)
        *parents, last = new.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return data
