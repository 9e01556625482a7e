"""The search space of ``recsys tune``: a TOML file naming job keys and their ranges or choices.

The format (docs/tuning.md)::

    [params]
    "store.lr" = { low = 0.005, high = 0.3, log = true }   # a range: the key's type says float or int
    "data.train.batch_size" = { choices = [256, 512, 1024] }
    "model.top_mlp" = { choices = [[128, 64, 1], [256, 128, 1]] }

    [groups.embedding]                                      # several keys chosen together
    choices = [{ "schema.tables.*.dim" = 16, "model.bottom_mlp" = [64, 32, 16] },
               { "schema.tables.*.dim" = 32, "model.bottom_mlp" = [128, 64, 32] }]

A key is a job key as ``recsys train --set`` takes it, checked the same way (an unknown key
names the valid ones); ``*`` stands for every entry of a table the job has (every
``schema.tables``). Every value is checked against the job when the file loads: a wrong one
fails naming the file, the key and what was expected. No torch here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsys.config import ConfigError, JobConfig, apply_overrides, from_dict, read_toml, to_dict
from recsys.model.config import WIDE_SETTINGS

RANGE_KEYS = ("low", "high", "log", "step")
NOT_TUNABLE = ("train.eval.keep_best",)
"""Keys a space may not set: the objective's metric is the job's own."""


@dataclass
class Param:
    """One dimension of the space: a range of a number, or a choice among values."""

    name: str
    """The Optuna parameter name: the job key, or the group's name."""
    kind: str
    """"float", "int" or "choice"."""
    keys: list[str] = dataclasses.field(default_factory=list)
    """Concrete job keys a range sets (a wildcard expanded)."""
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None
    choices: dict[Any, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Choice label (what Optuna sees) -> the concrete job keys and values it sets."""

    def suggest(self, trial) -> dict[str, Any]:
        """Return the job keys and values ``trial`` draws for this parameter."""
        if self.kind == "choice":
            return self.choices[trial.suggest_categorical(self.name, list(self.choices))]
        if self.kind == "float":
            value = trial.suggest_float(self.name, self.low, self.high, log=self.log, step=self.step)
        else:
            value = trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return {key: value for key in self.keys}

    def contains(self, value: Any) -> bool:
        """Whether a range draws ``value`` (a number inside it, on its step)."""
        kinds = (int,) if self.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not self.low <= value <= self.high:
            return False
        if self.step is None:
            return True
        ratio = (value - self.low) / self.step
        return abs(ratio - round(ratio)) < 1e-9


@dataclass
class Space:
    """A validated search space over a base job."""

    path: Path
    base: dict
    """The job as plain data: the job file with ``--set`` overrides applied."""
    params: list[Param]

    def suggest(self, trial) -> dict[str, Any]:
        """Return the job keys and values of ``trial`` (every parameter drawn)."""
        out: dict[str, Any] = {}
        for param in self.params:
            out.update(param.suggest(trial))
        return out

    def given(self) -> dict[str, Any]:
        """Return the Optuna parameters of the base job itself: each parameter whose keys have,
        in the job (its own value or the library's default), one of the space's values (a
        range's value inside it, a choice's every key as the job has it). A parameter the job
        sits outside of (a weight decay of 0 under a log range) is left out: the job's trial
        trains the job unchanged all the same (``recsys.tune.run``)."""
        job = to_dict(from_dict(JobConfig, self.base, "job"))
        out: dict[str, Any] = {}
        for param in self.params:
            if param.kind == "choice":
                for label, keys in param.choices.items():
                    if all(_get(job, k.split(".")) == v for k, v in keys.items()):
                        out[param.name] = label
                        break
                continue
            values = {_get(job, k.split(".")) for k in param.keys}
            value = values.pop() if len(values) == 1 else None
            if param.contains(value):
                out[param.name] = value
        return out

    def job_data(self, values: dict[str, Any]) -> dict:
        """Return the base job's data with ``values`` (concrete job keys) set."""
        return _with_values(self.base, values)

    def job(self, values: dict[str, Any], where: str) -> JobConfig:
        """Return the base job with ``values`` set (``ConfigError`` naming ``where`` if it does not fit)."""
        return from_dict(JobConfig, self.job_data(values), where)


def load_space(path: str | Path, base: dict) -> Space:
    """Return the space in the TOML file at ``path`` over the job ``base`` (plain data), checked."""
    path = Path(path)
    raw = read_toml(path)
    where = str(path)
    unknown = sorted(set(raw) - {"params", "groups"})
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; a space has [params] and [groups]")
    params: list[Param] = []
    for name, spec in _table(raw.get("params", {}), f"{where}: [params]").items():
        params.append(_param(name, spec, base, f"{where}: params.{_quote(name)}"))
    for name, spec in _table(raw.get("groups", {}), f"{where}: [groups]").items():
        params.append(_group(name, spec, base, f"{where}: groups.{_quote(name)}"))
    if not params:
        raise ConfigError(f"{where}: the space is empty; give [params] or [groups] (docs/tuning.md)")
    seen: dict[str, str] = {}
    for param in params:
        keys = param.keys if param.kind != "choice" else {k for c in param.choices.values() for k in c}
        for key in keys:
            if key in seen:
                raise ConfigError(f"{where}: {param.name!r} and {seen[key]!r} both set {key}")
            seen[key] = param.name
    if len({p.name for p in params}) != len(params):
        raise ConfigError(f"{where}: a group has the name of a parameter")
    return Space(path, base, params)


# --------------------------------------------------------------------------- one parameter


def _param(name: str, spec: Any, base: dict, where: str) -> Param:
    spec = _table(spec, where, "a table: { low = ..., high = ... } or { choices = [...] }")
    keys = _expand(name, base, where)
    if "choices" in spec:
        extra = sorted(set(spec) - {"choices"})
        if extra:
            raise ConfigError(f"{where}: {extra} do not go with choices (a range has low, high, log, step)")
        values = _choices(spec["choices"], where)
        choices = {_label(v): {k: v for k in keys} for v in values}
        if len(choices) != len(values):
            raise ConfigError(f"{where}: choices repeat a value: {values}")
        for choice in choices.values():
            _check(base, choice, where)
        return Param(name, "choice", keys=keys, choices=choices)
    unknown = sorted(set(spec) - set(RANGE_KEYS))
    if unknown or "low" not in spec or "high" not in spec:
        raise ConfigError(f"{where}: expected {{ low = ..., high = ... }} (optional log = true, step = ...) or "
                          f"{{ choices = [...] }}, found keys {sorted(spec)}")
    kind = _number_kind(keys[0])
    if kind is None:
        raise ConfigError(f"{where}: a range needs a number setting; {name} is "
                          f"{_type_name(keys[0])}: give {{ choices = [...] }}")
    low, high, log, step = spec["low"], spec["high"], spec.get("log", False), spec.get("step")
    number = int if kind == "int" else (int, float)
    for key, value in (("low", low), ("high", high), ("step", step)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, number)
                                  or not math.isfinite(value)):
            raise ConfigError(f"{where}: {key} must be {'an int' if kind == 'int' else 'a number'} ({name} is "
                              f"{kind}), found {value!r}")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: log must be true or false, found {log!r}")
    if not low < high:
        raise ConfigError(f"{where}: low must be below high, found low = {low!r}, high = {high!r}")
    if log and low <= 0:
        raise ConfigError(f"{where}: log = true needs low > 0, found {low!r}")
    if step is not None and (step <= 0 or log):
        raise ConfigError(f"{where}: step must be > 0 and goes without log = true, found step = {step!r}")
    for value in (low, high):
        _check(base, {k: (float(value) if kind == "float" else value) for k in keys}, where)
    return Param(name, kind, keys=keys, low=low, high=high, log=log, step=step)


def _group(name: str, spec: Any, base: dict, where: str) -> Param:
    spec = _table(spec, where, "a table with choices = [{ key = value, ... }, ...]")
    extra = sorted(set(spec) - {"choices"})
    if extra or "choices" not in spec:
        raise ConfigError(f"{where}: expected choices = [{{ key = value, ... }}, ...], found keys {sorted(spec)}")
    if "." in name:
        raise ConfigError(f"{where}: a group's name has no dot (a dotted name is a job key: put it in [params])")
    choices: dict[Any, dict[str, Any]] = {}
    for i, choice in enumerate(_choices(spec["choices"], where)):
        here = f"{where}: choices[{i}]"
        if not isinstance(choice, dict) or not choice:
            raise ConfigError(f"{here}: expected a table of job keys and values, found {choice!r}")
        concrete = {k: v for key, v in choice.items() for k in _expand(key, base, f"{here}: {key}")}
        _check(base, concrete, here)
        label = " ".join(f"{key.rsplit('.', 1)[-1]}={_label(v)}" for key, v in choice.items())
        if label in choices:
            raise ConfigError(f"{here}: repeats an earlier choice")
        choices[label] = concrete
    return Param(name, "choice", choices=choices)


# --------------------------------------------------------------------------- helpers


def _table(value: Any, where: str, expected: str = "a table") -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected {expected}, found {value!r}")
    return value


def _choices(value: Any, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: choices must be a non-empty list, found {value!r}")
    return value


def _quote(name: str) -> str:
    return f'"{name}"' if "." in name else name


def _label(value: Any) -> Any:
    """Return the Optuna choice for ``value``: itself when Optuna takes it (bool, int, float,
    str), else its JSON text (a list of layer sizes reads as in TOML)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value)


def _expand(key: str, base: dict, where: str) -> list[str]:
    """Return the concrete job keys of ``key`` (``*``: every entry of that table in the job),
    each checked as ``--set`` checks it."""
    if key in NOT_TUNABLE:
        raise ConfigError(f"{where}: {key} is the objective's metric, not a parameter (set it in the job)")
    parts = key.split(".")
    keys = [[]]
    for i, part in enumerate(parts):
        if part != "*":
            keys = [k + [part] for k in keys]
            continue
        grown = []
        for k in keys:
            node = _get(base, k)
            if not isinstance(node, dict) or not node:
                raise ConfigError(f"{where}: {'.'.join(k)} has no entries in the job for '*' to stand for")
            grown += [k + [name] for name in node]
        keys = grown
    out = [".".join(k) for k in keys]
    for concrete in out:
        try:
            apply_overrides(base, [f"{concrete}=0"], JobConfig)  # the key's path, as --set checks it
        except ConfigError as exc:
            raise ConfigError(f"{where}: {str(exc).split(': ', 1)[-1]}") from None
    return out


def _with_values(base: dict, values: dict[str, Any]) -> dict:
    """Return a copy of ``base`` with ``values`` (concrete job keys) set. A trial that turns
    ``model.wide`` off drops the arm's own settings (``WIDE_SETTINGS``), so a job tuned for its
    wide arm stays searchable with and without it."""
    data = copy.deepcopy(base)
    for key, value in values.items():
        _set(data, key.split("."), value)
    model = data.get("model")
    if isinstance(model, dict) and model.get("wide") is False:
        for key in WIDE_SETTINGS:
            model.pop(key, None)
    return data


def _check(base: dict, values: dict[str, Any], where: str) -> None:
    """Raise ``ConfigError`` naming ``where`` unless the job with ``values`` set loads."""
    try:
        from_dict(JobConfig, _with_values(base, values), "job")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {values} does not fit the job: {exc}") from None


def _declared(key: str) -> Any:
    """Return the declared type of a (checked) job key, ``Optional`` unwrapped."""
    tp: Any = JobConfig
    for part in key.split("."):
        if dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp)[part]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if type(None) in typing.get_args(tp) and len(args) == 1:
            tp = args[0]
    return tp


def _number_kind(key: str) -> str | None:
    tp = _declared(key)
    return "float" if tp is float else "int" if tp is int else None


def _type_name(key: str) -> str:
    tp = _declared(key)
    return getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "")


def _get(data: dict, keys: list[str]) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _set(data: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        data = data.setdefault(key, {})
    data[keys[-1]] = copy.deepcopy(value)
