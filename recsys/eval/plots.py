"""``recsys eval --plots DIR``: PNGs of one evaluation (matplotlib, Agg backend, no display).

    roc.png                ROC curve (and the compared checkpoint's, when there is one)
    calibration.png        predicted vs observed CTR per score bin, bin sizes below
    score_hist.png         score histogram per label (density)
    slice_auc_<col>.png    AUC per slice value of each --slice column
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roc_curve(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (false positive rate, true positive rate) at every distinct score threshold."""
    y = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    last = np.r_[np.flatnonzero(s[1:] != s[:-1]), s.size - 1]  # last row of each tie group
    tp = np.cumsum(y)[last]
    fp = (last + 1) - tp
    return np.r_[0.0, fp / max(fp[-1], 1)], np.r_[0.0, tp / max(tp[-1], 1)]


def write_plots(out: Path, scored, result: dict) -> list[Path]:
    """Write the PNGs of ``result`` (scores in ``scored``) to ``out``; return their paths."""
    plt = _pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    y, p = scored.labels, scored.scores

    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    fpr, tpr = roc_curve(y, p)
    ax.plot(fpr, tpr, label=f"step {result['step']} (AUC {result.get('auc', float('nan')):.4f})")
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
            ax.hist(sel, bins=edges, density=True, alpha=0.5, label=f"{name} ({sel.size:,} rows)")
    ax.set(xlabel="score", ylabel="density", title="scores by label")
    ax.legend()
    written.append(_save(fig, out / "score_hist.png", plt))

    for col, groups in result.get("slices", {}).items():
        names = [str(g["value"]) for g in groups]
        aucs = [g.get("auc", np.nan) for g in groups]
        fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(groups) + 2), 4), dpi=100)
        ax.bar(range(len(groups)), np.nan_to_num(aucs, nan=0.0), color="tab:blue")
        if "auc" in result:
            ax.axhline(result["auc"], color="tab:red", linestyle="--", label=f"all rows ({result['auc']:.4f})")
            ax.legend(loc="lower right")
        ax.set_xticks(range(len(groups)), names, rotation=45, ha="right")
        ax.set(ylabel="AUC", title=f"AUC by {col} (top values by rows)", ylim=(0, 1))
        written.append(_save(fig, out / f"slice_auc_{_safe(col)}.png", plt))
    return written


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
