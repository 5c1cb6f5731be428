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


def chi_square_homogeneity_pvalue(
    counts_a: dict[int, int], counts_b: dict[int, int], min_expected: float = 5.0
) -> float:
    """P-value of Pearson's test that two samples of categories come from one distribution.

    Categories whose expected count is below `min_expected` in either sample are pooled into one, as the test's
    chi-square approximation asks; a single remaining category gives 1.0.
    """
    n_a, n_b = sum(counts_a.values()), sum(counts_b.values())
    if n_a <= 0 or n_b <= 0:
        raise ValueError("both samples need counts.")
    keys = sorted(set(counts_a) | set(counts_b))
    rows = torch.tensor([[counts_a.get(k, 0), counts_b.get(k, 0)] for k in keys], dtype=torch.float64)
    share = min(n_a, n_b) / (n_a + n_b)
    small = rows.sum(dim=1) * share < min_expected
    if bool(small.any()):
        rows = torch.cat([rows[~small], rows[small].sum(dim=0, keepdim=True)])
        if float(rows[-1].sum()) == 0.0:
            rows = rows[:-1]
    if rows.shape[0] < 2:
        return 1.0
    totals = torch.tensor([n_a, n_b], dtype=torch.float64)
    expected = rows.sum(dim=1, keepdim=True) * totals / (n_a + n_b)
    statistic = float(((rows - expected) ** 2 / expected).sum())
    dof = rows.shape[0] - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(statistic / 2.0, dtype=torch.float64)
        )
    )
