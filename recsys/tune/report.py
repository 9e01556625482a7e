"""What ``recsys tune`` shows and writes: a line per trial under a progress bar, then
``DIR/best.toml`` (the best trial's job, trainable as is), ``DIR/trials.csv``, the plots
(``history.png``, ``evaluations.png``, ``importances.png``) and ``DIR/summary.json``."""

from __future__ import annotations

import csv
import json
import os
import warnings
from pathlib import Path


class ProgressBar:
    """A bar over this command's trials, and one line per finished trial."""

    def __init__(self, ctx, total: int, enabled: bool, log) -> None:
        from tqdm import tqdm

        self.ctx, self.log, self.seen = ctx, log, set()
        # disable=None: a bar on a terminal only; the lines are printed either way
        self.bar = tqdm(total=total, unit="trial", desc="tune", disable=None if enabled else True, leave=False)

    def finished(self, frozen) -> None:
        """Show a trial this process ran (or ``follow`` found) as finished."""
        if frozen.number in self.seen:
            return
        self.seen.add(frozen.number)
        best = best_trial(self.ctx.study)
        with self.bar.external_write_mode():
            self.log(describe(frozen, self.ctx.metric) + (f" | best: trial {best.number}, {best.value:.5f}"
                                                          if best is not None else ""))
        self.bar.update(1)
        if best is not None:
            self.bar.set_postfix_str(f"best {self.ctx.metric} {best.value:.5f} (trial {best.number})")

    def follow(self) -> None:
        """Show the trials this command's workers finished since the last call (``--jobs K``)."""
        for t in self.ctx.study.get_trials(deepcopy=False):
            if t.user_attrs.get("tune_run") == self.ctx.run_id and t.state.is_finished():
                self.finished(t)

    def close(self) -> None:
        self.bar.close()


def best_trial(study):
    """Return the best complete trial, or None."""
    try:
        return study.best_trial
    except ValueError:
        return None


def describe(t, metric: str) -> str:
    """One line: how a trial ended."""
    attrs = t.user_attrs
    seconds = f" in {t.duration.total_seconds():.1f} s" if t.duration is not None else ""
    state = t.state.name.lower()
    given = " (the job as given)" if attrs.get("given") else ""
    cv = attrs.get("cv")
    if cv and state == "complete":
        return (f"trial {t.number}{given} complete: validation {metric} {t.value:.5f} ± {_num(cv.get('std'))} "
                f"(mean ± std over {cv['folds']} folds, stderr {_num(cv.get('stderr'))}; best epochs "
                f"{_epochs(cv['best_epochs'])}: best.toml trains {cv.get('epochs')}){seconds}")
    if cv and state == "pruned":
        return (f"trial {t.number}{given} pruned after fold {cv['done']} of {cv['folds']}: validation {metric} "
                f"{cv['mean']:.5f} (running mean){seconds}")
    if state == "complete":
        return (f"trial {t.number}{given} complete: validation {metric} {t.value:.5f} (best at step {attrs.get('best_step')}"
                f" of {attrs.get('steps')}, {attrs.get('evaluations')} evaluations){seconds}")
    if state == "pruned":
        last = t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else float("nan")
        return (f"trial {t.number}{given} pruned at evaluation {attrs.get('evaluations')} (step {attrs.get('steps')}): "
                f"validation {metric} {last:.5f}{seconds}")
    return f"trial {t.number}{given} {state}: {attrs.get('error', 'interrupted')}{seconds}"


def _num(value) -> str:
    return "-" if value is None else f"{value:.5f}"


def _epochs(values) -> str:
    return "[" + ", ".join(f"{v:g}" if float(v).is_integer() else f"{v:.2f}" for v in values) + "]"


def cv_summary(t) -> dict | None:
    """A trial's cross-validation (``recsys.tune.run._cross_validate``): its folds' values, mean,
    std (over folds, n - 1), stderr (std / sqrt(folds)), best epochs and the epochs chosen."""
    return t.user_attrs.get("cv")


def write_outputs(ctx, log=print) -> dict:
    """Write the table, the best job and the plots of the whole study; print the table; return
    the summary (also ``DIR/summary.json``)."""
    out = Path(ctx.opts.out)
    out.mkdir(parents=True, exist_ok=True)
    trials = ctx.study.get_trials(deepcopy=False)
    names = [p.name for p in ctx.space.params]
    names += sorted({n for t in trials for n in t.params} - set(names))  # a space changed between runs
    rows = [_row(t, names) for t in trials]
    header = ["number", "state", "value", "std", "stderr", "folds", "epochs", "best_step", "steps", "evaluations",
              "seconds", *names, "run_dir", "error"]
    _atomic(out / "trials.csv", lambda fh: _csv(fh, header, rows))
    files = [out / "trials.csv"]
    counts = {s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "fail", "running")}
    log(f"study {ctx.study.study_name!r}: {len(rows)} trial(s): " + ", ".join(f"{n} {s}" for s, n in counts.items()
                                                                              if n))
    if rows:
        shown = ["std", "epochs"] if getattr(ctx, "folds", 0) else ["steps"]
        log(format_table(rows, ["number", "state", "value", *shown, "seconds", *names]))
    best = best_trial(ctx.study)
    summary = {"study": ctx.study.study_name, "metric": ctx.metric, "cv_folds": getattr(ctx, "folds", 0),
               "trials": len(rows), **counts, "best": None}
    if best is not None:
        path = write_best(ctx, best, out / "best.toml")
        files.append(path)
        summary["best"] = {"number": best.number, "value": best.value, "params": best.params,
                           "run_dir": best.user_attrs.get("run_dir"), "given": bool(best.user_attrs.get("given")),
                           "cv": cv_summary(best)}
        log(f"best: trial {best.number}, validation {ctx.metric} {best.value:.5f}; "
            f"train it: recsys train --config {path}")
    files += write_plots(ctx.study, out, log, f"validation {ctx.metric}")
    summary["files"] = [str(f) for f in files]
    _atomic(out / "summary.json", lambda fh: fh.write(json.dumps(summary, indent=1, default=str) + "\n"))
    log("wrote " + ", ".join(str(f) for f in files))
    return summary


def write_best(ctx, best, path: Path) -> Path:
    """Write the best trial's job as a TOML ``recsys train --config`` takes: the job the trial
    trained, as it saved it in the study (``job``; no password in it: ``recsys.config.dumps``).
    A trial saved before trials kept their job gets this command's job with its values,
    and the file says so."""
    from recsys.config import dumps

    text = best.user_attrs.get("job")
    note = ""
    if not isinstance(text, str):
        text = dumps(ctx.space.job(best.user_attrs.get("values", {}), f"trial {best.number}"))
        note = ("# the trial did not save its job: this is this command's job (--config, --set) with its "
                "values, which it may not have trained\n")
    shown = ", ".join(f"{k} = {v}" for k, v in best.params.items())
    if best.user_attrs.get("given"):  # nothing beat it: the job as given
        shown = "nothing: the job as given (no trial did better on validation)"
    cv = cv_summary(best)
    where = (f"mean over {cv['folds']} folds, std {_num(cv.get('std'))}; it trains on every training row for "
             f"{cv.get('epochs')} epochs, the folds' mean best epochs {_epochs(cv['best_epochs'])} rounded, with no "
             "validation split" if cv else f"its best checkpoint: step {best.user_attrs.get('best_step')}")
    head = (f"# recsys tune: the best trial of study {ctx.study.study_name!r}: trial {best.number}, validation "
            f"{ctx.metric} {best.value:.6f} ({where})\n"
            f"# its run: {best.user_attrs.get('run_dir')}; tuned: {shown}\n"
            f"{note}# train it: recsys train --config {path}\n")
    _atomic(path, lambda fh: fh.write(head + text))
    return path


def write_plots(study, out: Path, log, label: str) -> list[Path]:
    """Write history.png, evaluations.png (each trial's validation curve, the pruned ones cut
    short) and importances.png (PED-ANOVA, from 2 complete trials); return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as oplt

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    plots = {"history.png": lambda: oplt.plot_optimization_history(study),
             "evaluations.png": lambda: oplt.plot_intermediate_values(study)}
    if len(complete) >= 2:
        plots["importances.png"] = lambda: oplt.plot_param_importances(
            study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
    written = []
    for name, plot in plots.items():
        with warnings.catch_warnings():  # Optuna's plots are "experimental"; too few trials warn
            warnings.simplefilter("ignore")
            try:
                ax = plot()
            except (ValueError, RuntimeError) as exc:
                log(f"{name}: not drawn ({exc})")
                continue
        if name != "importances.png":
            ax.set_ylabel(label)
            ax.set_xlabel("trial" if name == "history.png" else "evaluation")
        fig = ax.figure
        fig.set_size_inches(7, 4)
        fig.savefig(out / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(out / name)
    if "importances.png" not in plots:
        log("importances.png: not drawn (needs 2 complete trials)")
    return written


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Return ``rows`` as a text table."""
    heads = list(columns)
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _row(t, names: list[str]) -> dict:
    attrs = t.user_attrs
    value = t.value
    if t.state.name == "PRUNED" and t.intermediate_values:  # its last evaluation
        value = t.intermediate_values[max(t.intermediate_values)]
    cv = attrs.get("cv") or {}
    return {"number": t.number, "state": t.state.name.lower(), "value": value, "std": cv.get("std"),
            "stderr": cv.get("stderr"), "folds": cv.get("done"), "epochs": cv.get("epochs"),
            "best_step": attrs.get("best_step"),
            "steps": attrs.get("steps"), "evaluations": attrs.get("evaluations"),
            "seconds": round(t.duration.total_seconds(), 1) if t.duration is not None else None,
            **{n: t.params.get(n) for n in names}, "run_dir": attrs.get("run_dir"), "error": attrs.get("error")}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.5g}"
    return str(value)


def _csv(fh, header: list[str], rows: list[dict]) -> None:
    writer = csv.DictWriter(fh, fieldnames=header)
    writer.writeheader()
    writer.writerows(rows)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as fh:
        write(fh)
    os.replace(tmp, path)
