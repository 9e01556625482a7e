"""The bounded Zipf law of ranks: what the synthetic data draws its ids from, and what the
benches draw their traces and request ids from (``recsys.bench.store``, ``recsys.bench.scale``,
``recsys.bench.serve_load``).

A continuous power law on ``[0.5, card + 0.5)``, rounded to a rank in ``1..card`` (returned
0-based): rank r (1-based) has probability ``∫_{r-0.5}^{r+0.5} x**-s dx / Z``, about
``r**-s / Z`` (``zipf_norm`` is Z). One inverse-CDF draw per rank, no table: cardinalities
reach millions. numpy only, so the serve bench's load process can import it without the
synthetic data's pyarrow and metrics.
"""

from __future__ import annotations

import numpy as np


def zipf_norm(card: int, s: float) -> float:
    """Return the normalizer Z of the rank law of ``zipf_ranks``: P(rank r) ≈ r ** -s / Z (r 1-based)."""
    if s == 1.0:
        return float(np.log((card + 0.5) / 0.5))
    a = 1.0 - s
    return ((card + 0.5) ** a - 0.5**a) / a


def zipf_ranks(rng: np.random.Generator, n: int, card: int, s: float) -> np.ndarray:
    """Return ``n`` 0-based ranks in ``[0, card)`` with P(rank r) ≈ ∝ (r + 1) ** -s, drawn with
    one ``rng.random(n)``."""
    if s == 1.0:  # the limit of the power law: log-uniform
        x = 0.5 * ((card + 0.5) / 0.5) ** rng.random(n)
    else:
        a = 1.0 - s
        lo, hi = 0.5**a, (card + 0.5) ** a
        x = (lo + rng.random(n) * (hi - lo)) ** (1.0 / a)
    return np.clip(np.floor(x + 0.5).astype(np.int64), 1, card) - 1
