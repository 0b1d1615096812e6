"""Chi-square goodness of fit for the statistical sampling tests. Written here because scipy is not a dependency:
the survival function comes from the regularized incomplete gamma function (scipy's is used when importable)."""

from __future__ import annotations

import math

ALPHA = 1e-3  # the tests' significance level: with fixed seeds a test cannot flake, it passes or fails


def _upper_gamma_regularized(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): power series for P below a + 1, continued fraction (Lentz) above."""
    if x <= 0.0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        denom = a
        for _ in range(100_000):
            denom += 1.0
            term *= x / denom
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi2_sf(x: float, df: int) -> float:
    return _upper_gamma_regularized(df / 2.0, x / 2.0)


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """x with P(chi2_df > x) = alpha."""
    try:
        from scipy.stats import chi2  # type: ignore[import-not-found]

        return float(chi2.ppf(1.0 - alpha, df))
    except ImportError:
        pass
    lo, hi = 0.0, max(1.0, 2.0 * df)
    while chi2_sf(hi, df) > alpha:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def chi_square_gof(counts: dict, probs: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of observed `counts` (outcome -> count) against `probs` (outcome -> probability).
    Cells with expected count < min_expected are pooled. An observed outcome of probability 0 fails at once.
    Returns (statistic, degrees of freedom)."""
    n = sum(counts.values())
    assert abs(sum(probs.values()) - 1.0) < 1e-5, sum(probs.values())
    impossible = {c: k for c, k in counts.items() if probs.get(c, 0.0) <= 0.0}
    assert not impossible, f"outcomes the target can never produce were sampled: {impossible}"
    cells = sorted(((n * p, counts.get(c, 0)) for c, p in probs.items() if p > 0.0), reverse=True)
    kept = [[e, o] for e, o in cells if e >= min_expected]
    pool_e = sum(e for e, _ in cells if e < min_expected)
    pool_o = sum(o for e, o in cells if e < min_expected)
    if pool_e > 0.0:
        if pool_e >= min_expected or not kept:
            kept.append([pool_e, pool_o])
        else:  # too small on its own: merge it into the smallest kept cell
            kept[-1][0] += pool_e
            kept[-1][1] += pool_o
    assert len(kept) >= 2, "not enough cells for a goodness-of-fit test"
    stat = sum((o - e) ** 2 / e for e, o in kept)
    return stat, len(kept) - 1


def rejected(counts: dict, probs: dict) -> bool:
    """The goodness-of-fit test rejects: an impossible outcome was observed, or chi2 is above the critical value."""
    if any(probs.get(c, 0.0) <= 0.0 for c in counts):
        return True
    stat, df = chi_square_gof(counts, probs)
    return stat >= chi2_critical(df)


def assert_fits(counts: dict, probs: dict, what: str) -> None:
    stat, df = chi_square_gof(counts, probs)
    crit = chi2_critical(df)
    assert stat < crit, f"{what}: chi2={stat:.1f} >= critical {crit:.1f} (df={df}, alpha={ALPHA})"
