"""Pearson's chi-square goodness-of-fit test, for checking that sampled tokens follow a distribution.

Uses torch's regularized incomplete gamma (the chi-square survival function), so tests need no scipy.
"""

from __future__ import annotations

from typing import Sequence

import torch


def chi_square_pvalue(observed: Sequence[int] | torch.Tensor, expected_probs: Sequence[float] | torch.Tensor) -> float:
    """P(X >= statistic) for X ~ chi-square with (categories - 1) degrees of freedom.

    Categories with zero expected probability must have zero counts (else the fit fails outright: p = 0).
    """
    obs = torch.as_tensor(observed, dtype=torch.float64).reshape(-1)
    probs = torch.as_tensor(expected_probs, dtype=torch.float64).reshape(-1)
    if obs.shape != probs.shape:
        raise ValueError(f"observed and expected_probs must have the same length, got {obs.shape} and {probs.shape}.")
    if (probs < 0).any() or abs(float(probs.sum()) - 1.0) > 1e-6:
        raise ValueError(f"expected_probs must be a distribution, got {probs.tolist()!r}.")
    total = float(obs.sum())
    if total <= 0:
        raise ValueError("observed has no counts.")
    support = probs > 0
    if bool((obs[~support] > 0).any()):
        return 0.0
    expected = probs[support] * total
    statistic = float(((obs[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    if dof < 1:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(statistic / 2.0, dtype=torch.float64)
        )
    )
