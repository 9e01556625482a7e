"""``recsys eval --plots DIR``: PNGs of one evaluation (matplotlib, Agg backend, no display).

    roc.png                ROC curve (and the compared checkpoint's, when there is one)
    calibration.png        predicted vs observed CTR per score bin, bin sizes below
    score_hist.png         score histogram per label (density)

With sample weights (``schema.weight``) the ROC curve, the histograms and the calibration
diagram are weighted like the metrics.
    slice_auc_<col>.png    AUC (and rows) per slice value of each --slice column, the whole set's AUC dashed
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roc_curve(labels: np.ndarray, scores: np.ndarray,
              weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return (false positive rate, true positive rate) at every distinct score threshold
    (rates of weight when ``weights`` are given)."""
    y = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    w = np.ones(s.size) if weights is None else np.asarray(weights, dtype=np.float64)
    order = np.argsort(-s, kind="stable")
    s, y, w = s[order], y[order], w[order]
    last = np.r_[np.flatnonzero(s[1:] != s[:-1]), s.size - 1]  # last row of each tie group
    tp = np.cumsum(np.where(y, w, 0.0))[last]
    fp = np.cumsum(np.where(y, 0.0, w))[last]
    return np.r_[0.0, fp / (fp[-1] or 1.0)], np.r_[0.0, tp / (tp[-1] or 1.0)]


def write_plots(out: Path, scored, result: dict, other=None) -> list[Path]:
    """Write the PNGs of ``result`` (scores in ``scored``; ``other``: the compared checkpoint's) to ``out``."""
    plt = _pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    y, p, w = scored.labels, scored.scores, scored.weights

    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    fpr, tpr = roc_curve(y, p, w)
    name = "A: " if other is not None else ""
    ax.plot(fpr, tpr, label=f"{name}step {result['step']} (AUC {result.get('auc', float('nan')):.4f})")
    if other is not None:
        fpr_b, tpr_b = roc_curve(other.labels, other.scores, w)  # B's rows weigh as A's
        auc_b = result.get("compare", {}).get("metrics", {}).get("auc", float("nan"))
        ax.plot(fpr_b, tpr_b, label=f"B: step {other.step} (AUC {auc_b:.4f})")
    ax.plot([0, 1], [0, 1], "--", color="grey", linewidth=0.8, label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC", xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="lower right")
    written.append(_save(fig, out / "roc.png", plt))

    table = result.get("calibration_table", [])
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(5, 6), dpi=100, sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], "--", color="grey", linewidth=0.8, label="perfectly calibrated")
    ax.plot([b["predicted_ctr"] for b in table], [b["observed_ctr"] for b in table], "o-",
            label=f"model (ECE {result.get('ece', float('nan')):.4f})")
    ax.set(ylabel="observed CTR", title="calibration", xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="upper left")
    ax2.bar([(b["lo"] + b["hi"]) / 2 for b in table], [b["rows"] for b in table],
            width=[(b["hi"] - b["lo"]) * 0.9 for b in table], color="tab:grey")
    ax2.set(xlabel="predicted CTR (score bin)", ylabel="rows")
    written.append(_save(fig, out / "calibration.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    edges = np.linspace(0, 1, 51)
    for label, name in ((0, "label 0"), (1, "label 1")):
        sel = p[y == label]
        if sel.size:
            ax.hist(sel, bins=edges, density=True, alpha=0.5, label=f"{name} ({sel.size:,} rows)",
                    weights=None if w is None else w[y == label])
    ax.set(xlabel="score", ylabel="density", title="scores by label")
    ax.legend()
    written.append(_save(fig, out / "score_hist.png", plt))

    for col, groups in result.get("slices", {}).items():
        written.append(_slice_plot(plt, out / f"slice_auc_{_safe(col)}.png", col, groups, result.get("auc")))
    return written


def _slice_plot(plt, path: Path, col: str, groups: list[dict], overall: float | None) -> Path:
    """AUC per slice value as bars, each labelled with its AUC and rows; the y axis spans the
    AUCs shown (it says where it starts), so differences of a few thousandths are visible."""
    names = [str(g["value"]) for g in groups]
    aucs = np.array([np.nan if g.get("auc") is None else g["auc"] for g in groups], dtype=np.float64)
    shown = aucs[np.isfinite(aucs)].tolist() + ([overall] if overall is not None else [])
    lo = max(0.0, min(shown, default=0.0) - 0.02)
    hi = min(1.0, max(shown, default=1.0) + 0.03)
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(groups) + 1.5), 4), dpi=100)
    bars = ax.bar(range(len(groups)), np.where(np.isfinite(aucs), aucs - lo, 0.0), bottom=lo, color="tab:blue")
    for bar, g, a in zip(bars, groups, aucs):
        text = f"{a:.4f}" if np.isfinite(a) else "n/a"
        ax.annotate(f"{text}\n{g['rows']:,} rows", (bar.get_x() + bar.get_width() / 2, lo),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=7,
                    color="white" if np.isfinite(a) and a - lo > 0.3 * (hi - lo) else "black")
    if overall is not None:
        ax.axhline(overall, color="tab:red", linestyle="--", label=f"all rows ({overall:.4f})")
        ax.legend(loc="upper right")
    ax.set_xticks(range(len(groups)), names, rotation=45, ha="right")
    ax.set(ylabel=f"AUC (axis from {lo:.2f})", title=f"AUC by {col} (top values by rows)", ylim=(lo, hi))
    return _save(fig, path, plt)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
