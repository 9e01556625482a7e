"""``recsys tune``: the study, its storage, the trials and the workers that run them.

Every trial is a real training run of the job with the trial's values set (``Trainer``, in
the worker's process, one process per trial as ``recsys train`` without ``--nproc``), in
``DIR/trials/<number>``, with validation-driven early stopping as the job asks. The
objective is the job's ``train.eval.keep_best`` metric on the validation split (the run's best
periodic evaluation), never the eval split. Each periodic evaluation is reported to the
study's pruner through the trainer's ``after_validation`` hook (Optuna's step: the
evaluation's number, 1, 2, ...); a pruned trial stops as early stopping does, its run
directory kept with ``"stopped": "pruned"`` in its ``result.json``.

The study lives in its storage: a journal file ``DIR/study.journal`` by default, Optuna's
journal on Redis (``redis://``), or a database (``sqlite:///``, ``postgresql://``...). The
same command again continues it; several machines with the same ``--storage`` share it.
``--jobs K`` runs K worker processes on this machine, each taking its share of ``--trials``.
Ctrl-C: the running trials end as failed, the study is kept, and the outputs are written.

With ``--cv K`` (``auto``: ``CV_FOLDS`` folds when the validation split is under
``CV_BELOW_ROWS`` rows) a trial trains the job once per fold (``DIR/trials/<number>/fold-<j>``:
fold j validates on the j-th slice of the training row groups, ``data.train.holdout_fold``,
and trains on the rest); its value is the folds' mean, the pruner sees the running mean after
each fold, and the trial's job (``best.toml``) trains on every training row for the folds'
mean best epoch count, with no validation split. A job whose validation split is files of its
own (``data.validation.paths``) is folded over its training and validation files pooled: the
folds then validate on every one of those rows once, and ``best.toml`` trains on all of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

from recsys.errors import UserError, user_message

DEFAULT_SPACE = Path(__file__).resolve().parents[2] / "jobs" / "spaces" / "ctr.toml"
WORKER_ENV = "RECSYS_TUNE_WORKER"
"""Set for the workers of ``--jobs K``: their index."""
MAX_FAILURES_IN_ROW = 3
"""A worker stops after this many trials in a row failed (a broken job, not an unlucky draw)."""
CV_FOLDS = 5
"""Folds of ``--cv auto``."""
CV_BELOW_ROWS = 20_000
"""``--cv auto`` cross-validates when the validation split has fewer rows than this."""
PRUNERS = ("median", "hyperband", "halving", "none")
REDUCTION_FACTOR = 3
"""Successive halving's and Hyperband's: a third of the trials at an evaluation go on."""
AUTO_JOBS_MAX = 8
"""``--jobs auto``: one trial per core, at most this many (the sampler learns less from
trials that run at once)."""


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_jobs() -> int:
    """``--jobs auto``: trials at once on this host, each with ``host_cores() // jobs`` threads."""
    return max(1, min(host_cores(), AUTO_JOBS_MAX))


@dataclass
class TuneOptions:
    """What ``recsys tune`` was asked (the CLI's arguments)."""

    config: str
    out: str
    space: str = str(DEFAULT_SPACE)
    sets: list[str] = dataclasses.field(default_factory=list)
    trials: int = 20
    """Trials this command runs (over all its workers); the study keeps earlier ones."""
    timeout_s: float = 0.0
    """No new trial starts after this many seconds (0: no limit)."""
    jobs: int = 1
    storage: str = ""
    """"" (a journal file in ``out``), ``redis://...`` or a database URL. Never written anywhere."""
    study: str = ""
    """Study name (default: the job's name)."""
    pruner: str = "median"
    """One of ``PRUNERS`` (``make_pruner``)."""
    cv: str = "auto"
    """"auto", "off" or a number of folds K >= 2 (``resolve_folds``)."""
    prune_startup: int = 3
    """Completed trials before the pruner prunes anything."""
    prune_warmup: int = 1
    """A trial's first this many evaluations are never pruned."""
    seed: int | None = None
    progress: bool = True
    enqueue: list[dict] = dataclasses.field(default_factory=list)
    """Parameter values to try first (Optuna's ``enqueue_trial``; the API and tests only)."""
    given_first: bool = True
    """The study's first trial trains the job as given (``enqueue_given``)."""


# --------------------------------------------------------------------------- set-up


@dataclass
class Context:
    """A worker's view of the tuning: options, space, storage, study."""

    opts: TuneOptions
    space: object
    metric: str
    storage: object
    study: object
    run_id: str
    chosen: dict = dataclasses.field(default_factory=dict)
    """What tune supplied because the job did not say (``early_stopping_defaults``)."""
    folds: int = 0
    """Cross-validation folds of each trial (0: the job's own validation split)."""
    validation_rows: int | None = None
    """Rows of the job's own validation split (carved from the training files, or its own files)."""
    pooled: tuple[str, ...] = ()
    """With folds over a job's own validation files: the training and validation paths the
    folds, and ``best.toml``, read as training files (empty: the training files alone)."""


def prepare(opts: TuneOptions, run_id: str | None = None) -> Context:
    """Load and check the job, the space and the storage; create or load the study."""
    import optuna

    from recsys.config import JobConfig, apply_overrides, from_dict, read_toml
    from recsys.train.config import early_stopping_defaults
    from recsys.tune.space import load_space

    if opts.trials < 0 or opts.jobs < 1 or opts.timeout_s < 0:
        raise UserError("tune: --trials must be >= 0, --jobs >= 1 and --timeout >= 0")
    if opts.pruner not in PRUNERS:
        raise UserError(f"tune: --pruner must be one of {', '.join(PRUNERS)}, found {opts.pruner!r}")
    base = apply_overrides(read_toml(opts.config), list(opts.sets), JobConfig)
    base, chosen = early_stopping_defaults(base)  # what the job and --set say win
    job = from_dict(JobConfig, base, str(opts.config))
    metric = check_job(job, opts.config)
    if os.environ.get(WORKER_ENV) is None:  # what `recsys train` checks first: the data, the output directory
        from recsys.train.launch import preflight

        preflight(job, None, Path(opts.out))
    space = load_space(opts.space, base)
    folds, rows, pooled = resolve_folds(opts.cv, job)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own lines say what happened
    storage = open_storage(opts.storage, Path(opts.out))
    direction = "maximize" if metric == "auc" else "minimize"
    name = opts.study or job.name
    sampler = optuna.samplers.TPESampler(seed=None if opts.seed is None else opts.seed
                                         + int(os.environ.get(WORKER_ENV, "0")))
    pruner = make_pruner(opts, job, folds)
    try:
        study = optuna.create_study(storage=storage, sampler=sampler, pruner=pruner, study_name=name,
                                    direction=direction, load_if_exists=True)
    except Exception as exc:  # noqa: BLE001 - the storage's own errors (Redis, SQL) become one line
        raise UserError(f"tune: cannot open study {name!r} in {_where(opts)}: {type(exc).__name__}: {exc}") from None
    known = study.user_attrs.get("metric")
    if study.direction.name.lower() != direction or known not in (None, metric):
        raise UserError(f"tune: study {name!r} in {_where(opts)} optimizes {known or study.direction.name.lower()}, "
                        f"this job's train.eval.keep_best is {metric!r}: give another --study")
    if known is None:
        study.set_user_attr("metric", metric)
    scored = study.user_attrs.get("cv_folds")
    if scored is None and not study.trials:
        study.set_user_attr("cv_folds", folds)
    elif (scored or 0) != folds:  # a study without the attribute predates --cv: one validation split
        raise UserError(f"tune: study {name!r} in {_where(opts)} scores trials "
                        f"{f'over {scored} folds' if scored else 'on one validation split'}, this command "
                        f"{f'over {folds} folds' if folds else 'on one validation split'} (--cv {opts.cv}): "
                        "give the same --cv or another --study")
    return Context(opts, space, metric, storage, study, run_id or uuid.uuid4().hex[:12], chosen, folds, rows, pooled)


def resolve_folds(cv: str, job) -> tuple[int, int | None, tuple[str, ...]]:
    """Return the folds ``--cv`` gives the job (0: none), the rows of the job's validation
    split (None when unknown) and, when the folds pool the job's own validation files with
    its training files, their paths (training first; empty otherwise). ``auto``: ``CV_FOLDS``
    when the validation split has fewer than ``CV_BELOW_ROWS`` rows and the files to fold
    have row groups enough. The validation split is carved (``train.eval.validation_fraction``)
    or files of its own (``data.validation.paths``); ``data.train.holdout_fraction`` is not
    folded."""
    from recsys.io.units import build_units, expand_paths, hold_out

    cv = str(cv).strip().lower()
    if cv == "off":
        return 0, None, ()
    if cv != "auto" and not (cv.isdigit() and int(cv) >= 2):
        raise UserError(f"tune: --cv must be auto, off or a number of folds >= 2, found {cv!r}")
    data = job.data
    own = bool(data.validation.paths) and not data.train.holdout_fraction
    carved = bool(job.train.eval.validation_fraction) and not data.validation.paths and not data.train.holdout_fraction
    if not (carved or own):
        if cv == "auto":
            return 0, None, ()
        raise UserError(f"tune: --cv {cv} folds the training rows: the job's validation split must be "
                        "train.eval.validation_fraction or data.validation.paths (not data.train.holdout_fraction)")
    pooled = tuple(data.train.paths) + tuple(data.validation.paths) if own else ()
    try:
        if own:
            rows = int(build_units(expand_paths(list(data.validation.paths)), job.schema, [],
                                   data.validation.on_bad_file).unit_rows.sum())
            table = build_units(expand_paths(list(pooled)), job.schema, [], data.train.on_bad_file)
        else:
            table = build_units(expand_paths(data.train.paths), job.schema, [], data.train.on_bad_file)
            held, _ = hold_out(table, job.train.eval.validation_fraction, data.train.holdout_seed, "only",
                               data.train.holdout_fold)
            rows = int(held.unit_rows.sum())
    except Exception as exc:  # noqa: BLE001 - the reader's own errors name the file
        raise UserError(f"tune: cannot read the training files' row groups: {user_message(exc) or exc}") from None
    k = CV_FOLDS if cv == "auto" else int(cv)
    if cv == "auto" and (rows >= CV_BELOW_ROWS or table.num_units < k):
        return 0, rows, ()
    if table.num_units < k:
        which = "training and validation" if own else "training"
        raise UserError(f"tune: --cv {k} needs at least {k} {which} row groups (whole row groups are held out), "
                        f"the {which} files have {table.num_units}")
    return k, rows, pooled


def fold_sets(j: int, k: int, pooled: tuple[str, ...] = ()) -> list[str]:
    """The ``--set``s of fold ``j`` of ``k``: validate on the j-th k-th of the training row
    groups (of ``pooled``'s files, when given)."""
    return [f"{key}={value!r}" for key, value in fold_values(j, k, pooled).items()]


def fold_values(j: int, k: int, pooled: tuple[str, ...] = ()) -> dict:
    return {"train.eval.validation_fraction": 1.0 / k, "data.train.holdout_fold": j, **_pooled_paths(pooled)}


def _pooled_paths(pooled: tuple[str, ...]) -> dict:
    """The keys that make ``pooled`` the training files, without validation files of their own."""
    return {"data.train.paths": list(pooled), "data.validation.paths": []} if pooled else {}


def make_pruner(opts: TuneOptions, job, folds: int):
    """The study's pruner. Its steps are a trial's validation evaluations (1, 2, ...), or with
    ``folds`` its folds (the running mean after each). ``median``: below the median of earlier
    trials at the same step, after ``--prune-startup`` complete trials; ``halving``
    (asynchronous successive halving) and ``hyperband`` (several halving brackets, each
    trial in one): at steps m, 3m, 9m... (m = ``--prune-warmup`` + 1) a trial goes on only
    if it is in the top third of the trials that reached that step."""
    import optuna

    if opts.pruner == "none":
        return optuna.pruners.NopPruner()
    if opts.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=opts.prune_startup, n_warmup_steps=opts.prune_warmup + 1)
    tc = job.train
    if folds:
        most = folds
    elif tc.eval.every_epochs and not tc.max_steps and tc.epochs >= tc.eval.every_epochs:
        most = tc.epochs // tc.eval.every_epochs
    else:
        most = None  # Optuna's "auto": the first complete trial's evaluations
    least = opts.prune_warmup + 1 if most is None else min(opts.prune_warmup + 1, most)
    if opts.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=least, reduction_factor=REDUCTION_FACTOR)
    return optuna.pruners.HyperbandPruner(min_resource=least, max_resource=most or "auto",
                                          reduction_factor=REDUCTION_FACTOR)


def check_job(job, where) -> str:
    """Return the objective's metric (``train.eval.keep_best``); ``UserError`` unless the job
    evaluates a validation split periodically."""
    tc = job.train
    if not tc.eval.keep_best:
        raise UserError(f"tune: {where}: the objective is the validation metric of train.eval.keep_best: set it "
                        "(e.g. --set train.eval.keep_best='\"auc\"') with train.eval.every or train.eval.every_epochs")
    if not (tc.eval.validation_fraction or job.data.validation.paths):
        raise UserError(f"tune: {where}: the job has no validation split (the objective is never the eval split): "
                        "set train.eval.validation_fraction or data.validation.paths")
    return tc.eval.keep_best


def open_storage(url: str, out: Path):
    """Return the Optuna storage of ``url``: a journal file in ``out`` when empty, a journal on
    Redis for ``redis://`` (the password from the URL or ``$REDIS_PASSWORD``), else a database."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalRedisBackend, JournalStorage

    from recsys.redisio.client import URL_SCHEMES, check_url, client_options, redact

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if not url:
            out.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(out / "study.journal")))
        if url.startswith(URL_SCHEMES):
            import redis

            try:
                check_url(url, "--storage")
            except ValueError as exc:
                raise UserError(str(exc)) from None
            backend = JournalRedisBackend(url, prefix="recsys-tune")
            options = client_options(url, where="--storage")
            if options:  # the password of $REDIS_PASSWORD: the backend's client takes only the URL's
                backend._redis = redis.Redis.from_url(url, **options)
            try:
                return JournalStorage(backend)
            except redis.RedisError as exc:
                raise UserError(f"tune: --storage {redact(url)}: {type(exc).__name__}: {exc}") from None
        if "://" not in url:
            raise UserError(f"tune: --storage {url!r}: expected redis://..., rediss://... or a database URL "
                            "(sqlite:///path, postgresql://...)")
        try:
            return optuna.storages.RDBStorage(url)
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy's errors
            raise UserError(f"tune: --storage {redact(url)}: {type(exc).__name__}: {exc}") from None


def _where(opts: TuneOptions) -> str:
    from recsys.redisio.client import redact

    return redact(opts.storage) if opts.storage else str(Path(opts.out) / "study.journal")


# --------------------------------------------------------------------------- one trial


def objective(ctx: Context, trial) -> float:
    """Train the job with ``trial``'s values; return its best validation metric."""
    import optuna
    import psutil

    from recsys.config import dumps
    from recsys.redisio.redaction import redact_text

    run_dir = Path(ctx.opts.out) / "trials" / str(trial.number)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} already holds a run (of another study in the same --out?)")
    me = psutil.Process()
    for key, value in (("host", socket.gethostname()), ("pid", me.pid), ("pid_started", me.create_time()),
                       ("tune_run", ctx.run_id), ("run_dir", str(run_dir))):
        trial.set_user_attr(key, value)
    try:
        if trial.user_attrs.get("given"):  # the job unchanged; its own values of the space recorded
            values = {}
            own = ctx.space.given()
            for param in ctx.space.params:
                if param.name in own:
                    param.suggest(trial)
        else:
            values = ctx.space.suggest(trial)
        trial.set_user_attr("values", values)
        # the job this trial trains, as `best.toml` gives it (without a password: ``dumps``):
        # a study continued with other --set's builds its later trials from another base
        trial.set_user_attr("job", dumps(ctx.space.job(values, f"trial {trial.number}")))
        if ctx.folds:
            return _cross_validate(ctx, trial, values, run_dir)
        result, evaluations = _train(ctx, trial, values, run_dir)
    except KeyboardInterrupt:
        trial.set_user_attr("error", "interrupted")
        raise
    except Exception as exc:
        # a Redis URL quoted in an error (a spill or publish URL) loses its password: the
        # message goes to the study's storage, the traceback to disk
        message = user_message(exc) or redact_text(f"{type(exc).__name__}: {exc}")
        trial.set_user_attr("error", message)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "error.txt").write_text(redact_text("".join(traceback.format_exception(exc))))
        raise
    best = result.get("best")
    trial.set_user_attr("steps", result["step"])
    trial.set_user_attr("evaluations", evaluations)
    if best is not None:
        trial.set_user_attr("best_step", best["step"])
    if result.get("stopped") == "pruned":
        raise optuna.TrialPruned(f"pruned at evaluation {evaluations} (step {result['step']})")
    if best is None:
        raise UserError(f"trial {trial.number}: the run made no validation evaluation of {ctx.metric} "
                        "(train.eval.every / every_epochs beyond its steps?)")
    return float(best["value"])


def _cross_validate(ctx: Context, trial, values: dict, run_dir: Path) -> float:
    """Train the trial's job once per fold; report the running mean of the folds' best
    validation metric after each (the pruner's step: the fold's number, 1..k); return the
    mean. The trial's ``job`` becomes the one ``best.toml`` gives: every training row, the
    folds' mean best epoch count (rounded, at least 1), no validation split."""
    import math
    import statistics

    import optuna

    from recsys.config import dumps

    k, scores, epochs = ctx.folds, [], []

    def record(done: int) -> None:
        std = statistics.stdev(scores) if len(scores) > 1 else None
        cv = {"folds": k, "done": done, "values": scores, "mean": statistics.fmean(scores), "std": std,
              "stderr": std / math.sqrt(len(scores)) if std is not None else None, "best_epochs": epochs}
        if epochs:
            cv["epochs"] = max(1, round(statistics.fmean(epochs)))
        trial.set_user_attr("cv", cv)

    for j in range(k):
        result, _ = _train(ctx, trial, values, run_dir / f"fold-{j}", fold=j)
        best = result.get("best")
        if best is None:
            raise UserError(f"trial {trial.number} fold {j}: the run made no validation evaluation of {ctx.metric} "
                            "(train.eval.every / every_epochs beyond its steps?)")
        scores.append(float(best["value"]))
        epochs.append(float(result.get("best_epochs") or max(1, result.get("epoch") or 1)))
        record(j + 1)
        trial.report(statistics.fmean(scores), j + 1)
        if j + 1 < k and trial.should_prune():
            raise optuna.TrialPruned(f"pruned after fold {j + 1} of {k}")
    cv = trial.user_attrs["cv"]
    retrain = {**values, **all_rows_values(cv["epochs"]), **_pooled_paths(ctx.pooled)}
    trial.set_user_attr("job", dumps(ctx.space.job(retrain, f"trial {trial.number}")))
    return cv["mean"]


def all_rows_values(epochs: int) -> dict:
    """The keys that make a trial's job train on every training row for ``epochs`` epochs:
    no validation split, so no periodic evaluation, best checkpoint or early stopping (they
    would read the eval split)."""
    return {"train.eval.validation_fraction": 0.0, "data.train.holdout_fold": 0, "train.epochs": epochs,
            "train.max_steps": 0, "train.eval.every": 0, "train.eval.every_epochs": 0,
            "train.eval.keep_best": "", "train.eval.early_stopping_patience": 0}


def epochs_at(run_dir: Path, step: int) -> float | None:
    """The epochs a run had trained at ``step`` (a fraction within an epoch), from its
    ``epoch_end`` events; None without them."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    ends = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "epoch_end":
            ends.append(int(rec["step"]))
    if not ends:
        return None
    done = sum(e <= step for e in ends)
    if done and ends[done - 1] == step:
        return float(done)
    start = ends[done - 1] if done else 0
    length = (ends[done] - start) if done < len(ends) else ends[0]
    return done + (step - start) / max(1, length)


def _train(ctx: Context, trial, values: dict, run_dir: Path, fold: int | None = None) -> tuple[dict, int]:
    """Run the trial's training in this process (as ``python -m recsys.train`` does). With
    ``fold``: that fold's training, its evaluations not reported (``_cross_validate`` reports
    the folds' running mean)."""
    from recsys.config import write_resolved
    from recsys.train.loop import Trainer, setup_env

    trial_only = {"train.progress": "none", "publish.redis": ""}  # no bar per trial; no live pushes
    if fold is not None:
        trial_only.update(fold_values(fold, ctx.folds, ctx.pooled))
    if ctx.opts.jobs > 1 and not ctx.space.job(values, "").train.runtime.threads:
        trial_only["train.runtime.threads"] = max(1, host_cores() // ctx.opts.jobs)
    job = ctx.space.job({**values, **trial_only}, f"trial {trial.number}")
    env = setup_env(job.train.device, job.train.runtime.collective_timeout_s)
    write_resolved(job, run_dir)
    trainer = Trainer(job, run_dir, env)
    evaluations = 0

    def report(step: int, result: dict) -> bool:
        nonlocal evaluations
        evaluations += 1
        if ctx.metric not in result or fold is not None:
            return False
        trial.report(float(result[ctx.metric]), evaluations)
        return trial.should_prune()

    trainer.after_validation = report
    try:
        result = trainer.train()
    finally:
        trainer.close()
    if result.get("best") is not None:
        result["best_epochs"] = epochs_at(run_dir, result["best"]["step"])
    (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    if result.get("stopped") == "SIGTERM":  # asked to stop: the trial is interrupted, not finished
        raise KeyboardInterrupt
    return result, evaluations


# --------------------------------------------------------------------------- workers


def enqueue_given(ctx: Context) -> int | None:
    """Make the job as given (with what tune supplied) the study's next trial, unless the
    study has one: tuning then never ends worse, on validation, than the job it was given.
    It trains the job unchanged; its parameters are the job's own values where the space
    has them (``Space.given``), so the sampler learns from it. Returns the trial's number, or None."""
    if any(t.user_attrs.get("given") for t in ctx.study.get_trials(deepcopy=False)):
        return None
    ctx.study.enqueue_trial(ctx.space.given(), user_attrs={"given": True}, skip_if_exists=True)
    queued = [t.number for t in ctx.study.get_trials(deepcopy=False) if t.user_attrs.get("given")]
    return queued[0] if queued else None


def fail_dead_trials(ctx: Context) -> list[int]:
    """Mark failed the running trials of this host whose process is gone (killed): a journal
    has no heartbeat. Returns their numbers."""
    import psutil
    from optuna.trial import TrialState

    host, dead = socket.gethostname(), []
    for t in ctx.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        attrs = t.user_attrs
        if attrs.get("host") != host or "pid" not in attrs:
            continue
        try:
            alive = psutil.Process(attrs["pid"]).create_time() == attrs.get("pid_started")
        except psutil.Error:
            alive = False
        if not alive:
            ctx.storage.set_trial_user_attr(t._trial_id, "error", "its process ended before it finished")
            ctx.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            dead.append(t.number)
    return dead


def run_trials(ctx: Context, n: int, timeout_s: float, on_trial=None) -> None:
    """Run ``n`` trials of the study in this process (fewer when ``timeout_s`` passes or
    ``MAX_FAILURES_IN_ROW`` fail in a row); ``on_trial(frozen_trial)`` after each."""
    from optuna.trial import TrialState

    failures = [0]

    def after(study, frozen) -> None:
        failures[0] = failures[0] + 1 if frozen.state == TrialState.FAIL else 0
        if on_trial is not None:
            on_trial(frozen)
        if failures[0] >= MAX_FAILURES_IN_ROW:
            study.stop()

    for params in ctx.opts.enqueue:
        ctx.study.enqueue_trial(params)
    if n:
        ctx.study.optimize(lambda trial: objective(ctx, trial), n_trials=n, timeout=timeout_s or None,
                           catch=(Exception,), callbacks=[after], gc_after_trial=True)
    if failures[0] >= MAX_FAILURES_IN_ROW:
        raise UserError(f"tune: {MAX_FAILURES_IN_ROW} trials in a row failed; the last one's error is in "
                        "its run directory's error.txt")


def _shares(n: int, k: int) -> list[int]:
    return [n // k + (i < n % k) for i in range(k)]


def worker_main() -> int:
    """``python -m recsys.tune.worker``: one of ``--jobs K``'s workers; its options (the
    storage URL included, which is never written anywhere) come as JSON on stdin."""
    # SIGINT is how ``tune`` stops its workers (its own Ctrl-C or SIGTERM, forwarded): taken
    # even when this process was born ignoring it, as a shell's background job or a nohup'ed
    # tune leaves its children, which would otherwise train on until killed
    signal.signal(signal.SIGINT, signal.default_int_handler)
    spec = json.loads(sys.stdin.read())
    opts = TuneOptions(**spec["opts"])
    ctx = prepare(opts, spec["run_id"])
    try:
        run_trials(ctx, spec["trials"], opts.timeout_s)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        print(f"recsys tune worker: error: {user_message(exc)}", file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------------- the command


def tune(opts: TuneOptions, log=print) -> dict:
    """Run ``recsys tune``; return the summary (also written as ``DIR/summary.json``)."""
    from recsys.train.config import describe_defaults
    from recsys.tune import report

    out = Path(opts.out)
    ctx = prepare(opts)
    out.mkdir(parents=True, exist_ok=True)
    _write_record(opts, ctx)
    log(describe_defaults(ctx.chosen, "tune"))
    for number in fail_dead_trials(ctx):
        log(f"trial {number}: its process ended before it finished (marked failed)")
    before = len(ctx.study.trials)
    given = enqueue_given(ctx) if opts.given_first and opts.trials else None
    log(f"study {ctx.study.study_name!r} in {_where(opts)}: {before} earlier trial(s); running {opts.trials} more "
        f"({opts.jobs} at a time); objective: validation {ctx.metric} ({ctx.study.direction.name.lower()})")
    log(describe_folds(ctx))
    if given is not None:
        log(f"trial {given} trains the job as given: the one to beat")
    bar = report.ProgressBar(ctx, opts.trials, enabled=opts.progress, log=log)
    interrupted, error = False, None
    # SIGTERM as Ctrl-C (a running trial's trainer takes it first: it checkpoints and stops)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if opts.jobs == 1:
            run_trials(ctx, opts.trials, opts.timeout_s, bar.finished)
        else:
            _run_workers(ctx, bar)
    except KeyboardInterrupt:
        interrupted = True
    except UserError as exc:  # trials failed: what the study has is written all the same
        error = exc
    finally:
        signal.signal(signal.SIGTERM, previous)
        bar.close()
    summary = report.write_outputs(ctx, log=log)
    if interrupted:
        log(f"interrupted: the study is kept in {_where(opts)}; the same command continues it")
        summary["interrupted"] = True
    if error is not None:
        raise error
    return summary


def describe_folds(ctx: Context) -> str:
    """One line: how trials are scored (``--cv``) and why."""
    rows = f"{ctx.validation_rows:,} rows" if ctx.validation_rows is not None else None
    if ctx.folds:
        why = (f"the validation split has {rows}, under {CV_BELOW_ROWS:,} (--cv auto)" if ctx.opts.cv == "auto"
               else f"--cv {ctx.opts.cv}")
        if ctx.pooled:
            return (f"cross-validation: each trial trains {ctx.folds} times over the training and validation files "
                    f"pooled, fold j validating on the j-th of {ctx.folds} slices of their row groups ({why}); its "
                    "value is the folds' mean, best.toml trains on all of those rows for the folds' mean best epochs "
                    "(--cv off: the job's own validation files)")
        return (f"cross-validation: each trial trains {ctx.folds} times, fold j validating on the j-th of "
                f"{ctx.folds} slices of the training row groups ({why}); its value is the folds' mean, best.toml trains "
                "on every training row for the folds' mean best epochs (--cv off: one validation split)")
    if ctx.opts.cv == "auto" and rows is not None and ctx.validation_rows < CV_BELOW_ROWS:
        return f"one validation split ({rows}): too few row groups for {CV_FOLDS} folds"
    why = f"{rows}, --cv auto cross-validates under {CV_BELOW_ROWS:,}" if rows is not None else None
    if ctx.opts.cv == "off":
        why = "--cv off"
    return "one validation split" + (f" ({why})" if why else " (the job's own validation files)")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _write_record(opts: TuneOptions, ctx: Context) -> None:
    """``DIR/tune.json``: what was tuned, against which study (the storage without its password)."""
    from recsys.redisio.client import redact_text

    record = {"config": str(Path(opts.config).resolve()), "space": str(Path(opts.space).resolve()),
              "set": list(opts.sets), "study": ctx.study.study_name, "storage": _where(opts), "metric": ctx.metric,
              "direction": ctx.study.direction.name.lower(), "chosen": ctx.chosen}
    # an override may quote a Redis URL too (the job's spill or publish URL)
    (Path(opts.out) / "tune.json").write_text(redact_text(json.dumps(record, indent=1)) + "\n")


def _run_workers(ctx: Context, bar) -> None:
    """Run ``--jobs K`` worker processes, each with its share of the trials; follow the study."""
    opts = ctx.opts
    logs = Path(opts.out) / "workers"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, n in enumerate(_shares(opts.trials, opts.jobs)):
        if not n:
            continue
        spec = {"opts": {**dataclasses.asdict(opts), "enqueue": opts.enqueue if i == 0 else []},
                "run_id": ctx.run_id, "trials": n}
        with open(logs / f"worker-{i}.log", "ab") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "recsys.tune.worker"], stdin=subprocess.PIPE,
                                    stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, WORKER_ENV: str(i)})
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        procs.append((i, proc))
    try:
        while any(p.poll() is None for _, p in procs):
            bar.follow()
            time.sleep(1.0)
    except KeyboardInterrupt:
        for _, p in procs:  # Ctrl-C in a terminal reached them already; a signal to this process alone did not
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for _, p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    finally:
        bar.follow()
    failed = [(i, p.returncode) for i, p in procs if p.returncode]
    if failed:
        tails = "; ".join(f"worker {i} exited {rc}: {_tail(logs / f'worker-{i}.log')}" for i, rc in failed)
        raise UserError(f"tune: {tails} (logs in {logs})")


def _tail(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
