"""``recsys report RUN_DIR [--out DIR]``: a run's metrics.jsonl as PNG curves and a Markdown summary.

    OUT/loss.png          train loss over steps
    OUT/eval.png          AUC and log loss over steps, per split (periodic validation, final eval)
    OUT/throughput.png    samples/s over steps
    OUT/time.png          time per phase (% of a step) over steps
    OUT/store.png         store hit rate and evictions over steps
    OUT/report.md         job, data, final metrics, oracle gap, periodic evaluations and the
                          best checkpoint, early stop, checkpoints, the figures

A figure whose series the run never logged is left out (and the summary says so).
``OUT`` defaults to ``RUN_DIR/report``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from recsys.errors import UserError


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """Return (train records, eval records, checkpoint records) of ``run_dir/metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{run_dir}: not a run directory (no metrics.jsonl)")
    train, evals, ckpts = [], [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n}: not a JSON line") from None
        {"eval": evals, "checkpoint": ckpts}.get(rec.get("event"), train if "event" not in rec else []).append(rec)
    return train, evals, ckpts


def _by_split(evals: list[dict]) -> dict[str, list[dict]]:
    """Eval records by split: ``validation`` (the periodic evaluations) first, then ``eval``
    (the final evaluation on the eval split; records without a split are of the eval split)."""
    out: dict[str, list[dict]] = {}
    for r in sorted(evals, key=lambda r: r.get("split", "eval") != "validation"):
        out.setdefault(r.get("split", "eval"), []).append(r)
    return out


def _series(records: list[dict], key: str):
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> dict:
    """Write the figures and ``report.md`` of ``run_dir``; return {"markdown": path, "figures": [paths]}."""
    from recsys.eval.plots import _pyplot, _save

    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "report"
    train, evals, ckpts = read_metrics(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    figures, missing = [], []

    def figure(name: str, panels: list[tuple[str, list[tuple[list[dict], str, str]]]]) -> None:
        if not any(_series(recs, key)[0] for _, lines in panels for recs, key, _ in lines):
            missing.append(name)
            return
        fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3 * len(panels)), dpi=100, squeeze=False)
        for ax, (ylabel, lines) in zip(axes[:, 0], panels):
            for recs, key, label in lines:
                xs, ys = _series(recs, key)
                if xs:
                    ax.plot(xs, ys, "o-" if len(xs) < 20 else "-", markersize=3, label=label)
            ax.set(xlabel="step", ylabel=ylabel)
            ax.legend(loc="best")
        figures.append(_save(fig, out / f"{name}.png", plt))

    figure("loss", [("loss", [(train, "loss/train", "train loss")])])
    by_split = _by_split(evals)
    figure("eval", [("AUC", [(recs, "auc", f"{split} AUC") for split, recs in by_split.items()]),
                    ("log loss", [(recs, "log_loss", f"{split} log loss") for split, recs in by_split.items()])])
    figure("throughput", [("samples/s", [(train, "throughput/samples_per_s", "samples/s")])])
    phases = sorted({k for r in train for k in r if k.startswith("time/") and k.endswith("_pct")})
    figure("time", [("% of step time", [(train, k, k[len("time/"):-len("_pct")]) for k in phases])])
    figure("store", [("hit rate", [(train, "store/hit_rate", "store hit rate")]),
                     ("evictions", [(train, "store/evictions", "evictions")])])

    md = out / "report.md"
    md.write_text(_markdown(run_dir, out, train, evals, ckpts, figures, missing))
    return {"markdown": str(md), "figures": [str(f) for f in figures], "missing": missing}


def _markdown(run_dir, out, train, evals, ckpts, figures, missing) -> str:
    cfg = {}
    if (run_dir / "config.toml").exists():
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
    data = cfg.get("data", {})
    result = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
    by_split = _by_split(evals)
    finals = by_split.get("eval", [])
    final = finals[-1] if finals else {}
    validation = data.get("validation", {}).get("paths", [])
    lines = [f"# Run report: {run_dir.name}", "",
             f"- job: `{cfg.get('name', '?')}`",
             f"- train data: {', '.join(f'`{p}`' for p in data.get('train', {}).get('paths', [])) or '?'}"]
    if validation:
        lines.append(f"- validation data: {', '.join(f'`{p}`' for p in validation)}")
    lines += [f"- eval data: {', '.join(f'`{p}`' for p in data.get('eval', {}).get('paths', [])) or '?'}",
              f"- steps: {result.get('step', train[-1]['step'] if train else '?')}, "
              f"epochs: {result.get('epoch', '?')}"
              + (f" (stopped: {result['stopped']})" if result.get("stopped") else ""),
              f"- checkpoints: {len(ckpts)}" + (f", last `{Path(ckpts[-1]['path']).name}`" if ckpts else ""), ""]
    if final:
        lines += ["## Final evaluation", "", f"step {final['step']}, eval split", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(final[k])} |" for k in ("auc", "log_loss", "normalized_entropy", "calibration",
                                                          "base_ctr", "rows") if k in final]
        oracle = _oracle(data.get("eval", {}).get("paths", []))
        if oracle and "auc" in final:
            lines += ["", f"Oracle (true click probabilities): AUC {oracle['auc']:.5f}, log loss "
                      f"{oracle['log_loss']:.5f}; gap to the final AUC {oracle['auc'] - final['auc']:.5f}."]
    else:
        lines += ["No evaluation of the eval split was logged."]
    periodic = by_split.get("validation", [])
    if periodic:
        lines += ["", "## Periodic evaluations (validation split)", ""]
        if len(periodic) <= 20:
            lines += ["| step | rows | auc | log_loss |", "|---|---|---|---|"]
            lines += [f"| {r['step']} | {_fmt(r.get('rows', '-'))} | {_fmt(r.get('auc', '-'))} | "
                      f"{_fmt(r.get('log_loss', '-'))} |" for r in periodic]
        else:
            lines.append(f"{len(periodic)} evaluations (eval.png).")
        best = result.get("best")
        scored = [r for r in periodic if r.get("auc") is not None]
        if best:
            lines += ["", f"Best checkpoint by validation {best['metric']}: step {best['step']} "
                      f"({best['metric']} {best['value']:.5f}), kept as `checkpoints/best`; "
                      f"`recsys eval --checkpoint {run_dir}/checkpoints/best` scores it on the eval split."]
        elif scored:
            top = max(scored, key=lambda r: r["auc"])
            lines += ["", f"Best validation AUC: {top['auc']:.5f} at step {top['step']} (no train.eval.keep_best)."]
    lines += ["", "## Curves", ""]
    lines += [f"![{Path(f).stem}]({Path(f).relative_to(out)})" for f in figures]
    if missing:
        lines += ["", f"Not logged by this run: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, str):
        return v
    return f"{v:,}" if isinstance(v, int) else f"{v:.5g}"


def _oracle(eval_paths: list[str]) -> dict | None:
    """Return the ``eval`` part of the synthetic data's oracle.json next to an eval split, if any."""
    for p in eval_paths:
        cand = Path(p).parent / "oracle.json"
        if cand.exists():
            try:
                return json.loads(cand.read_text())["eval"]
            except (KeyError, json.JSONDecodeError):
                return None
    return None
