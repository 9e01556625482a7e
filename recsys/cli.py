"""The ``recsys`` command. Parses arguments and calls into the library; no business logic.

Heavy modules (torch, torchrec) are imported inside the subcommand that needs them, so
``recsys --help`` and ``recsys gen-synthetic`` start fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from recsys.config import ConfigError
from recsys.errors import UserError, user_message

BENCH_TARGETS = ("reader", "hashing", "store", "train", "serve", "faults", "live", "convert", "quality", "scale",
                 "defaults", "step")


def _cmd_gen_synthetic(args: argparse.Namespace) -> int:
    from recsys.io import synth

    if args.format == "criteo":
        oracle = synth.write_criteo_tsv(args.out, args.preset, seed=args.seed,
                                        progress=lambda msg: print(msg, flush=True))
        print(json.dumps({k: oracle[k] for k in ("preset", "seed", "layout", "train", "eval")}, indent=2))
        return 0
    oracle = synth.generate(
        args.preset,
        args.out,
        seed=args.seed,
        row_group_size=args.row_group_size,
        progress=lambda msg: print(msg, flush=True),
    )
    print(json.dumps(oracle, indent=2))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from recsys.io.reader import describe

    schema = None
    paths = args.paths
    if args.config:
        from recsys.config import load_job

        job = load_job(args.config, args.set)
        schema = job.schema
        if not paths:
            paths = job.data.train.paths
    if not paths:
        raise ConfigError("inspect: give data paths, or --config with data.train.paths")
    print(describe(paths, schema))
    if args.stats:
        _print_dense_stats(args, job if args.config else None, paths)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from recsys.io.convert import ConvertOptions, convert

    schema, passthrough = None, []
    if args.schema:
        from recsys.config import load_job

        job = load_job(args.schema)
        schema = job.schema
        passthrough = list(dict.fromkeys([*job.data.train.passthrough, *job.data.eval.passthrough]))
    try:
        split = dict(_split_arg(text) for text in args.split)
        opts = ConvertOptions(fmt=args.fmt, preset=args.preset or "", header=not args.no_header,
                              rows_per_file=args.rows_per_file, row_group_rows=args.row_group_rows or 131_072,
                              bad_rows=args.bad_rows, split=split,
                              fit_row_groups=args.infer and args.row_group_rows is None)
    except ValueError as exc:
        raise UserError(f"convert: {exc}") from None
    r = convert(args.inputs, args.out, opts, schema=schema, passthrough=passthrough, infer=args.infer,
                progress=not args.no_progress, log=print)
    skipped = f", {r['bad_rows']:,} bad rows skipped (listed in {args.out}/_convert.json)" if r["bad_rows"] else ""
    print(f"converted {r['rows']:,} rows into {len(r['files'])} file(s) in {args.out}{skipped} in "
          f"{r['seconds']:.1f} s ({r['rows_per_s']:,.0f} rows/s)")
    if args.infer:
        print(f"proposed job: {r['proposed_job']} (edit it, then `recsys inspect --config {r['proposed_job']}`)")
    return 0


def _split_arg(text: str) -> tuple[str, str]:
    column, sep, value = text.partition("=")
    if not sep or not column or not value:
        raise UserError(f"convert: --split {text!r}: expected COLUMN=SEPARATOR, e.g. --split tags='|'")
    return column, value


def _print_dense_stats(args: argparse.Namespace, job, paths: list[str]) -> None:
    """``inspect --stats``: the dense statistics a training run of the job would compute."""
    import dataclasses

    from recsys.io import dense_stats

    if job is None:
        raise ConfigError("inspect --stats: give --config (the job's schema names the dense columns)")
    if not job.schema.dense:
        raise ConfigError(f"inspect --stats: {args.config} declares no dense columns (schema.dense)")
    cfg = job.data.train if not args.paths else dataclasses.replace(job.data.train, paths=list(paths),
                                                                    holdout_fraction=0.0)
    print()
    print(dense_stats.compute(cfg, job.schema).format())


def _cmd_train(args: argparse.Namespace) -> int:
    from recsys.train.launch import launch

    return launch(args)


def _cmd_tune(args: argparse.Namespace) -> int:
    from recsys.tune.run import DEFAULT_SPACE, TuneOptions, tune

    summary = tune(TuneOptions(config=str(args.config), out=str(args.out), space=str(args.space or DEFAULT_SPACE),
                               sets=args.set, trials=args.trials, timeout_s=args.timeout, jobs=_tune_jobs(args.jobs),
                               storage=args.storage or "", study=args.study or "", pruner=args.pruner, cv=args.cv,
                               prune_startup=args.prune_startup, prune_warmup=args.prune_warmup, seed=args.seed,
                               progress=not args.no_progress, given_first=not args.no_given_trial))
    return 130 if summary.get("interrupted") else 0


def _tune_jobs(value: str) -> int:
    from recsys.tune.run import auto_jobs

    if value == "auto":
        return auto_jobs()
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"tune: --jobs must be a number >= 1 or auto, found {value!r}")
    return int(value)


def _read_oracle(path: Path) -> dict:
    """Return the ``eval`` figures of a synthetic data set's oracle.json (UserError naming the file)."""
    try:
        oracle = json.loads(Path(path).read_text())["eval"]
        float(oracle["auc"]), float(oracle["log_loss"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: not an oracle.json of `recsys gen-synthetic` (expected JSON with "
                        f"eval.auc and eval.log_loss; {type(exc).__name__}: {exc})") from None
    return oracle


def _cmd_eval(args: argparse.Namespace) -> int:
    from recsys.eval.evaluate import EvalOptions, format_tables, run_eval

    opts = EvalOptions(data=args.data or None, slices=args.slice, top_k=args.top_k, predictions=args.predictions,
                       plots=args.plots, compare=args.compare, nproc=args.nproc,
                       max_exact_rows=args.max_exact_rows, device=args.device)
    oracle = _read_oracle(args.oracle) if args.oracle else None  # before the evaluation: fail fast
    result = run_eval(args.checkpoint, opts)
    if oracle is not None:
        result["oracle_auc"] = oracle["auc"]
        result["oracle_log_loss"] = oracle["log_loss"]
        result["auc_gap_to_oracle"] = oracle["auc"] - result.get("auc", float("nan"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    tables = format_tables(result)
    if tables:
        print(tables)
    if args.oracle:
        print(f"AUC {result['auc']:.4f}  (oracle {result['oracle_auc']:.4f}, gap {result['auc_gap_to_oracle']:.4f})  "
              f"log loss {result['log_loss']:.4f}  (oracle {result['oracle_log_loss']:.4f})")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from recsys.eval.report import write_report

    out = write_report(args.run_dir, args.out)
    print(f"wrote {out['markdown']} and {len(out['figures'])} figure(s)"
          + (f"; not logged by this run: {', '.join(out['missing'])}" if out["missing"] else ""))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """Every mode (export, --gc, --list) answers a bad argument or a Redis failure in one line (exit 2)."""
    import redis

    from embedding_server import export as publish
    from recsys.redisio.client import check_url, redact

    mode = "--gc" if args.gc else "--list" if args.list else ""
    at = f"export{' ' + mode if mode else ''}"
    try:
        check_url(args.redis, "--redis")
        if mode and args.keep < 1:
            raise ValueError(f"--keep must be >= 1 (the newest version is kept), found {args.keep}")
        for name, value in (("--grace-s", args.grace_s), ("--superseded-grace-s", args.superseded_grace_s)):
            if not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, found {value}")
    except ValueError as exc:
        raise UserError(f"{at}: {exc}") from None
    password_file = str(args.redis_password_file or "")
    if mode:
        try:
            if args.gc:
                result = publish.gc(args.redis, args.namespace, keep=args.keep, grace_s=args.grace_s,
                                    superseded_grace_s=args.superseded_grace_s, password_file=password_file)
                print(f"removed {len(result['removed'])} version(s) from {redact(args.redis)}: "
                      + (", ".join(f"{v} ({n} rows)" for v, n in result["removed"].items()) or "none"))
                for v, why in result["skipped"].items():
                    print(f"skipped the malformed registry entry {v!r} (its rows are left alone): {why}")
            print(json.dumps(publish.versions(args.redis, args.namespace, password_file=password_file), indent=2))
        except redis.RedisError as exc:
            raise UserError(f"{at}: Redis at {redact(args.redis)} failed: {type(exc).__name__}: {exc}") from None
        except (publish.ExportError, ValueError) as exc:
            raise UserError(f"{at}: {exc}") from None
        return 0
    if args.checkpoint is None:
        raise UserError("export: give --checkpoint (or --gc / --list)")
    try:
        settings = publish.ExportSettings(namespace=args.namespace, version=args.version or "", dtype=args.dtype,
                                          keep=args.keep, buckets=args.buckets,
                                          superseded_grace_s=args.superseded_grace_s,
                                          tables=[t for t in args.tables.split(",") if t] if args.tables else None)
    except ValueError as exc:
        raise UserError(f"export: {exc}") from None
    try:
        result = publish.export(args.checkpoint, args.redis, settings, progress=not args.no_progress,
                                password_file=password_file)
    except publish.AfterFlipError as exc:
        raise UserError(str(exc)) from None
    except (publish.ExportError, ValueError, OSError) as exc:
        raise UserError(f"{user_message(exc) or exc}; `current` is unchanged") from None
    except redis.RedisError as exc:
        raise UserError(f"Redis at {redact(args.redis)} failed: {type(exc).__name__}: {exc}; "
                        "`current` is unchanged (`recsys export --gc` removes the partial version)") from None
    print(f"exported {result['rows']:,} rows of {len(result['tables'])} table(s) in {result['seconds']:.1f} s "
          f"({result['rows_per_s']:,.0f} rows/s) as version {result['version']}; "
          f"{args.namespace}:current -> {result['version']} at {redact(args.redis)}")
    if result["removed_versions"]:
        print(f"removed old versions: {', '.join(result['removed_versions'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from embedding_server.app import serve
    from embedding_server.settings import ServeSettings

    if args.follow is not None and not args.redis:
        raise UserError("serve: --follow needs --redis (live rows are read from the Redis that holds the published "
                        "versions)")
    try:
        if args.follow is not None:  # an explicit empty name is an error, not "no --follow"
            from recsys.redisio.published import check_name

            check_name(args.follow, "--follow")
        settings = ServeSettings(checkpoint=str(args.checkpoint or ""), redis=args.redis or "",
                                 redis_password_file=str(args.redis_password_file or ""),
                                 namespace=args.namespace, host=args.host, port=args.port, workers=args.workers,
                                 token_file=str(args.token_file or ""), ssl_certfile=str(args.ssl_certfile or ""),
                                 ssl_keyfile=str(args.ssl_keyfile or ""), max_ids=args.max_ids,
                                 max_lookups=args.max_lookups,
                                 max_body_bytes=args.max_body_bytes, cache_bytes=int(args.cache_mb * (1 << 20)),
                                 refresh_s=args.refresh_s, follow=args.follow or "", live_ttl_s=args.live_ttl_s,
                                 fast_path=not args.no_fast_path)
        settings.token()  # a bad token file fails here, before the server starts
        if settings.redis:  # and a bad Redis password file
            from recsys.redisio.client import password_for

            password_for(settings.redis, settings.redis_password_file, "--redis-password-file")
    except (ValueError, OSError) as exc:
        raise UserError(f"serve: {exc}") from None
    serve(settings)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from recsys.bench import run

    target = args.target
    if args.device == "cuda":  # the GPU variant of a benchmark: its own module
        if target != "train":
            raise UserError(f"bench {target}: --device cuda is for `recsys bench train` only")
        target = "train_gpu"
    options = {}
    if args.tuned and target != "quality":
        raise UserError(f"bench {target}: --tuned is for `recsys bench quality` only")
    if args.splits is not None and target not in ("quality", "defaults"):
        raise UserError(f"bench {target}: --splits is for `recsys bench quality` and `recsys bench defaults` only")
    if target == "quality":
        options = {"tuned": args.tuned, "splits": args.splits}
    elif target == "defaults":
        options = {"splits": args.splits}
    step_only = {"config": args.config, "batch_size": args.batch_size, "steps": args.steps}
    if target == "step":
        options = step_only
    elif any(v is not None for v in step_only.values()):
        raise UserError(f"bench {target}: --config, --batch-size and --steps are for `recsys bench step` only")
    result = run(target, json_out=args.json, quick=args.quick, data=args.data, **options)
    return 0 if result.get("passed", True) else 1  # a scenario bench (faults) fails when one scenario does


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``recsys`` command."""
    parser = argparse.ArgumentParser(
        prog="recsys",
        description="Train recommendation models with huge sparse ID features.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "gen-synthetic",
        help="write a synthetic CTR data set with a known optimum",
        description="Write DIR/train/, DIR/eval/ (Parquet, zstd) and DIR/oracle.json "
        "(AUC and log loss of the true probabilities on the eval split).",
    )
    p.add_argument("--preset", choices=("tiny", "small", "large"), default="tiny")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="same seed, same data (default 0)")
    p.add_argument("--row-group-size", type=int, default=None, help="rows per Parquet row group")
    p.add_argument("--format", choices=("parquet", "criteo"), default="parquet",
                   help="criteo: DIR/train.txt.gz and DIR/eval.txt.gz in the Criteo click logs' layout "
                   "(TSV: label, 13 integers, 26 hex ids) instead of Parquet, for `recsys convert --preset criteo`")
    p.set_defaults(func=_cmd_gen_synthetic)

    p = sub.add_parser(
        "inspect",
        help="describe a Parquet data set and how a job's schema maps onto it",
        description="Print each file's schema, rows and row groups; with --config, which "
        "columns the job's feature schema maps to what, and what is missing or mistyped.",
    )
    p.add_argument("paths", nargs="*", help="files, directories or globs (default: the job's train paths)")
    p.add_argument("--config", type=Path, help="job file (TOML) whose schema to check")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a job setting")
    p.add_argument("--stats", action="store_true",
                   help="also the dense columns' statistics (count, nulls, mean, std, quantiles) as a training run "
                   "computes them (needs --config; schema.dense_stats_rows rows at most)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "convert",
        help="convert CSV, TSV (Criteo's layout too) or JSON lines into Parquet for the reader",
        description="Stream the inputs (local or filesystem URIs; .gz, .bz2, .zst read as such) into "
        "zstd Parquet files (DIR/part-NNNNN.parquet) with row groups sized for the reader, and a report "
        "(DIR/_convert.json). Nothing is moved into DIR unless every input converted.",
    )
    p.add_argument("--from", dest="fmt", required=True, choices=("csv", "tsv", "jsonl"), help="input format")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="input files, directories or globs")
    p.add_argument("--out", required=True, type=Path, help="output directory (no part-*.parquet in it yet)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--schema", type=Path, metavar="JOB.toml", help="write the columns this job reads, typed for it")
    how.add_argument("--infer", action="store_true", help="also propose a job (DIR/_job.toml) from the data")
    p.add_argument("--preset", choices=("criteo",), help="criteo: label, 13 integer and 26 hex categorical "
                   "fields, tab-separated, no header")
    p.add_argument("--no-header", action="store_true", help="CSV/TSV without a header line (fields named f0, f1, ...)")
    p.add_argument("--rows-per-file", type=int, default=4_194_304, help="rows per output file (default 4194304)")
    p.add_argument("--row-group-rows", type=int, help="rows per row group (default 131072; with --infer fewer "
                   "for a small input, so that a validation split of a tenth of the row groups is a tenth of the rows)")
    p.add_argument("--split", action="append", default=[], metavar="COLUMN=SEP",
                   help="CSV/TSV: split this string column at SEP into a list (a multi-hot feature); --infer finds them")
    p.add_argument("--bad-rows", choices=("error", "skip"), default="error",
                   help="a bad row stops the conversion (default) or is skipped, counted and listed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser(
        "train",
        help="train a job (torchrun with --nproc processes, elastic restarts)",
        description="Train the job in --config. With --nproc > 1 (or --max-restarts > 0) the "
        "processes are launched by torchrun; a restarted run resumes from its latest checkpoint.",
    )
    from recsys.train.job_args import add_job_arguments
    from recsys.train.launch import add_multinode_arguments

    add_job_arguments(p)
    p.add_argument("--nproc", type=int, default=1, help="training processes on this machine (default 1)")
    p.add_argument("--max-restarts", type=int, default=0, help="elastic restarts after a failure (default 0)")
    add_multinode_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging, torchrun's logs and tracebacks for user errors (as `recsys -v train`)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "tune",
        help="search a job's hyperparameters with Optuna (each trial a training run with early stopping)",
        description="Train the job once per trial with values drawn from the space (TPE), pruning trials whose "
        "validation evaluations fall behind (median pruner); the objective is the validation metric of "
        "train.eval.keep_best. Writes DIR/best.toml, DIR/trials.csv and plots; the study persists in --storage "
        "(default DIR/study.journal), so the same command continues it. Details: docs/tuning.md.",
    )
    p.add_argument("--config", required=True, type=Path, help="job file (TOML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a job setting")
    p.add_argument("--space", type=Path, help="search space (TOML; default jobs/spaces/ctr.toml)")
    p.add_argument("--out", required=True, type=Path, help="output directory: trials/<number>/, best.toml, ...")
    p.add_argument("--trials", type=int, default=20, help="trials this command runs (default 20)")
    p.add_argument("--timeout", type=float, default=0.0, help="start no trial after this many seconds (0: none)")
    p.add_argument("--jobs", default="1", metavar="K|auto",
                   help="trials at once on this machine (worker processes, each with cores / K torch threads; "
                   "default 1); auto: one per core, at most 8")
    p.add_argument("--storage", help="the study's storage shared by machines: redis://... (a journal; password "
                   "from the URL or $REDIS_PASSWORD, never written) or a database URL (sqlite:///..., "
                   "postgresql://...); default: DIR/study.journal")
    p.add_argument("--study", help="study name (default: the job's name)")
    p.add_argument("--pruner", choices=("median", "hyperband", "halving", "none"), default="median",
                   help="median (default), hyperband or halving (successive halving: a third goes on at "
                   "evaluations m, 3m, 9m...), none")
    p.add_argument("--cv", default="auto", metavar="auto|off|K",
                   help="score each trial by K-fold cross-validation over the training rows; auto (default): "
                   "5 folds when the validation split has under 20,000 rows")
    p.add_argument("--prune-startup", type=int, default=3, help="complete trials before any pruning (default 3)")
    p.add_argument("--prune-warmup", type=int, default=1,
                   help="a trial's first N validation evaluations are never pruned (default 1)")
    p.add_argument("--seed", type=int, help="seed of the sampler (one worker: the same trials every time)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the per-trial lines stay)")
    p.add_argument("--no-given-trial", action="store_true",
                   help="do not train the job as given as the study's first trial (the one to beat)")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser(
        "eval",
        help="score a checkpoint on a data split (AUC, log loss, NE, calibration)",
        description="Stream a Parquet split through the training code path (reader, hashing, "
        "store) and the checkpoint's model; print the metrics.",
    )
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="a checkpoint directory, a run directory, a checkpoints/ directory or its latest file")
    p.add_argument("--data", nargs="*", default=[], help="files, directories or globs (default: the job's eval split)")
    p.add_argument("--json", type=Path, help="also write the metrics here")
    p.add_argument("--oracle", type=Path, help="a synthetic data set's oracle.json: print the AUC next to it")
    p.add_argument("--slice", nargs="+", default=[], metavar="COLUMN",
                   help="also the metrics per value of these columns (the --top-k values by rows, then 'other')")
    p.add_argument("--top-k", type=int, default=10, help="slice values shown per --slice column (default 10)")
    p.add_argument("--predictions", type=Path, metavar="OUT.parquet",
                   help="write one row per example: the id columns (or row_id), label, score")
    p.add_argument("--plots", type=Path, metavar="DIR",
                   help="write PNGs: ROC, calibration, score histograms, AUC per slice")
    p.add_argument("--compare", type=Path, metavar="PATH2",
                   help="score the same rows with a second checkpoint: side-by-side table, deltas, "
                   "DeLong confidence interval of the AUC difference")
    p.add_argument("--nproc", type=int, default=1, help="processes reading the data (exactly-once shards; default 1)")
    p.add_argument("--max-exact-rows", type=int, default=None,
                   help="keep at most this many predictions in memory for an exact AUC (default 50M, "
                   "about 2 GB); beyond it one process reports a binned AUC with its error bound")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser(
        "report",
        help="render a run's metrics.jsonl as PNG curves and a Markdown summary",
        description="Write loss, eval AUC/log loss, samples/s, time per phase and store curves (PNG) and "
        "report.md (job, data, final metrics, best eval, oracle gap when the data has oracle.json).",
    )
    p.add_argument("run_dir", type=Path, help="a run directory (with metrics.jsonl)")
    p.add_argument("--out", type=Path, help="output directory (default RUN_DIR/report)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser(
        "export",
        help="publish a checkpoint's embeddings to Redis as a new version (then flip `current`)",
        description="Write every table's rows (spilled ones included) under a new version, verify them, "
        "flip the namespace's `current` alias atomically and keep the newest --keep versions. "
        "--gc removes failed or abandoned exports and old versions; --list shows the versions.",
    )
    p.add_argument("--checkpoint", type=Path,
                   help="a checkpoint directory, a run directory, a checkpoints/ directory or its latest file")
    p.add_argument("--redis", required=True, help="redis://[:password@]host:port/db, rediss:// for TLS; "
                   "any node of a Redis Cluster; a URL without a password takes --redis-password-file's, else "
                   "$REDIS_PASSWORD")
    p.add_argument("--redis-password-file", type=Path,
                   help="file holding the Redis password, for a --redis URL without one (else $REDIS_PASSWORD)")
    p.add_argument("--version", help="version name (default: s<step>-<UTC time>)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                   help="storage type in Redis (float16: half the memory, rows rounded)")
    p.add_argument("--keep", type=int, default=3, help="ready versions kept, the new one included (default 3)")
    p.add_argument("--tables", help="comma-separated tables to publish (default: all)")
    p.add_argument("--namespace", default="recsys", help="key prefix of this serving deployment (default recsys)")
    p.add_argument("--buckets", type=int, default=64, help="hash-tag buckets per table (Redis Cluster slots; default 64)")
    p.add_argument("--gc", action="store_true", help="only remove failed/abandoned exports and versions beyond --keep")
    p.add_argument("--grace-s", type=float, default=60.0,
                   help="--gc leaves an export alone while its heartbeat is younger than this (default 60)")
    p.add_argument("--superseded-grace-s", type=float, default=60.0,
                   help="a version `current` stopped naming is kept this long, beyond --keep too: servers may "
                   "read it until their next --refresh-s (default 60; removed by the next export or --gc after)")
    p.add_argument("--list", action="store_true", help="only print the versions and which one is current")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "serve",
        help="serve embeddings of raw ids over HTTP, from Redis or straight from a checkpoint",
        description="Run the embedding lookup service (FastAPI on uvicorn; OpenAPI docs at /docs). "
        "--checkpoint serves from memory with no Redis; --redis serves the version `recsys export` published.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="serve this checkpoint from memory (the embedded default)")
    src.add_argument("--redis", help="serve the published versions in this Redis (or Redis Cluster)")
    p.add_argument("--namespace", default="recsys", help="namespace the versions were published under")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--redis-password-file", type=Path,
                   help="file holding the Redis password, for a --redis URL without one (else $REDIS_PASSWORD)")
    p.add_argument("--token-file", type=Path, help="require `Authorization: Bearer <token in this file>` (off "
                   "loopback only with --ssl-certfile: the token never travels in clear)")
    p.add_argument("--ssl-certfile", type=Path, help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
    p.add_argument("--ssl-keyfile", type=Path, help="the certificate's private key (PEM)")
    p.add_argument("--max-ids", type=int, default=10_000, help="ids per request at most (default 10000)")
    p.add_argument("--max-lookups", type=int, default=1_000,
                   help="lookups per /v1/lookup/batch request at most (default 1000)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body size limit (default 4 MiB)")
    p.add_argument("--cache-mb", type=float, default=256, help="row cache per worker, MiB (default 256; 0: none)")
    p.add_argument("--refresh-s", type=float, default=1.0, help="how often the `current` alias is read (default 1)")
    p.add_argument("--follow", metavar="LIVE_NS",
                   help="overlay the live rows a training job pushes to this namespace (needs --redis)")
    p.add_argument("--live-ttl-s", type=float, default=1.0,
                   help="seconds a live row is cached per worker (default 1; 0: read every request)")
    p.add_argument("--no-fast-path", action="store_true",
                   help="answer every lookup through the full app, not the lookups' hot path (to compare)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "bench",
        help="side-by-side benchmarks (ours vs the limit and the peer)",
        description="Run a benchmark, print its comparison table, optionally write JSON.",
    )
    p.add_argument("target", choices=BENCH_TARGETS)
    p.add_argument("--json", type=Path, help="write results here")
    p.add_argument("--quick", action="store_true", help="small variant (at most about a minute)")
    p.add_argument("--data", type=Path, help="data directory to use instead of the default")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="train only: cuda runs the GPU training benchmark (recsys/bench/train_gpu.py; default cpu)")
    p.add_argument("--tuned", action="store_true",
                   help="quality only: add each real set's job found by `recsys tune` (30 trials / 30 min; reused)")
    p.add_argument("--splits", type=int, metavar="N",
                   help="quality and defaults: random splits for sets with under 10 k eval rows "
                        "(quality: default 10, --quick 0; defaults: default 5)")
    p.add_argument("--config", help="step only: the job whose schema and store it runs "
                                    "(default jobs/synthetic_small.toml)")
    p.add_argument("--batch-size", type=int, help="step only: rows per step (default 16384, --quick 1024)")
    p.add_argument("--steps", type=int, help="step only: steps counted, and as many timed (default 20, --quick 4)")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``recsys`` command; return its exit code."""
    args = build_parser().parse_args(argv)
    # third-party libraries (fbgemm) log chatter at INFO on the root logger: keep it quiet
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("recsys").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - input errors get one line (the traceback with -v); bugs keep theirs
        message = user_message(exc)
        if message is None:
            raise
        if args.verbose:
            import traceback

            traceback.print_exception(exc)
        print(f"recsys {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
