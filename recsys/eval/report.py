"""``recsys report RUN_DIR [--out DIR]``: a run's metrics.jsonl as PNG curves and a Markdown summary.

    OUT/loss.png          train loss over steps
    OUT/eval.png          eval AUC and log loss over steps (when the run evaluated)
    OUT/throughput.png    samples/s over steps
    OUT/time.png          time per phase (% of a step) over steps
    OUT/store.png         store hit rate and evictions over steps
    OUT/report.md         job, data, final metrics, checkpoints, oracle gap, the figures

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
    figure("eval", [("AUC", [(evals, "auc", "eval AUC")]), ("log loss", [(evals, "log_loss", "eval log loss")])])
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
    final = evals[-1] if evals else {}
    lines = [f"# Run report: {run_dir.name}", "",
             f"- job: `{cfg.get('name', '?')}`",
             f"- train data: {', '.join(f'`{p}`' for p in data.get('train', {}).get('paths', [])) or '?'}",
             f"- eval data: {', '.join(f'`{p}`' for p in data.get('eval', {}).get('paths', [])) or '?'}",
             f"- steps: {result.get('step', train[-1]['step'] if train else '?')}, "
             f"epochs: {result.get('epoch', '?')}",
             f"- checkpoints: {len(ckpts)}" + (f", last `{Path(ckpts[-1]['path']).name}`" if ckpts else ""), ""]
    if final:
        lines += ["## Final evaluation", "", f"step {final['step']}", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {final[k]:.5g} |" for k in ("auc", "log_loss", "normalized_entropy", "calibration",
                                                       "base_ctr", "rows") if k in final]
        best = max(evals, key=lambda r: r.get("auc", float("-inf")))
        lines += ["", f"Best eval AUC: {best.get('auc', float('nan')):.5f} at step {best['step']} "
                  f"(of {len(evals)} evaluation(s))."]
        oracle = _oracle(data.get("eval", {}).get("paths", []))
        if oracle and "auc" in final:
            lines += [f"Oracle (true click probabilities): AUC {oracle['auc']:.5f}, log loss {oracle['log_loss']:.5f}; "
                      f"gap to the final AUC {oracle['auc'] - final['auc']:.5f}."]
    else:
        lines += ["No evaluation was logged."]
    lines += ["", "## Curves", ""]
    lines += [f"![{Path(f).stem}]({Path(f).relative_to(out)})" for f in figures]
    if missing:
        lines += ["", f"Not logged by this run: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


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
