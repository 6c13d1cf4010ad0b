"""The Chinchilla fit (lm.plan.scaling_fit): known laws recovered from synthetic points, the closed-form
compute optimum against a numeric one, bootstrap intervals that hold the truth, and bad input."""

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from lm.errors import UserError
from lm.plan.scaling_fit import Law, bootstrap, check_points, fit_law, interval

CHINCHILLA = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. (2022), approach 3
SMALL = Law(E=2.1, A=60.0, B=900.0, alpha=0.45, beta=0.52)  # another shape of law, at this repo's scale


def points(law: Law, n_range, d_range, noise: float, seed: int = 0, k: int = 6):
    """A k x k grid of (N, D) and the law's loss times log-normal noise."""
    n, d = (x.ravel() for x in np.meshgrid(np.geomspace(*n_range, k), np.geomspace(*d_range, k)))
    rng = np.random.default_rng(seed)
    return n, d, law.loss(n, d) * np.exp(rng.normal(0.0, noise, n.size))


@pytest.mark.parametrize(
    "law, n_range, d_range",
    [(CHINCHILLA, (1e7, 1e10), (1e9, 1e12)), (SMALL, (1e5, 1e7), (1e5, 1e8))],
    ids=["chinchilla", "small"],
)
def test_recovers_a_known_law(law, n_range, d_range):
    n, d, loss = points(law, n_range, d_range, noise=0.002)
    got = fit_law(n, d, loss)
    assert got.E == pytest.approx(law.E, rel=0.03)
    assert got.alpha == pytest.approx(law.alpha, abs=0.03)
    assert got.beta == pytest.approx(law.beta, abs=0.03)
    # A and B move with the exponents (log A errs by about d(alpha) x log N): compare the terms
    # A / N^alpha and B / D^beta at the middle of the points' range, which the points pin down
    mid = (math.sqrt(n_range[0] * n_range[1]), math.sqrt(d_range[0] * d_range[1]))
    assert got.A / mid[0] ** got.alpha == pytest.approx(law.A / mid[0] ** law.alpha, rel=0.05)
    assert got.B / mid[1] ** got.beta == pytest.approx(law.B / mid[1] ** law.beta, rel=0.05)
    assert math.log(got.A) == pytest.approx(math.log(law.A), abs=0.03 * math.log(mid[0]))
    assert math.log(got.B) == pytest.approx(math.log(law.B), abs=0.03 * math.log(mid[1]))
    # and the fitted law predicts inside the points' range to well under a percent
    assert float(got.loss(*mid)) == pytest.approx(float(law.loss(*mid)), rel=0.003)


def test_exact_points_are_fitted_exactly():
    n, d, loss = points(SMALL, (1e5, 1e7), (1e5, 1e8), noise=0.0, k=5)
    got = fit_law(n, d, loss)
    assert np.max(np.abs(np.log(got.loss(n, d) / loss))) < 1e-4


@pytest.mark.parametrize("law", [CHINCHILLA, SMALL], ids=["chinchilla", "small"])
@pytest.mark.parametrize("flops", [1e15, 1e19, 5.76e23])
def test_closed_form_optimum_is_the_numeric_minimum(law, flops):
    n_opt, d_opt = law.optimum(flops)
    assert 6 * n_opt * d_opt == pytest.approx(flops, rel=1e-12)
    # minimise L(N, C / 6N) over log N alone
    res = minimize_scalar(
        lambda log_n: float(law.loss(math.exp(log_n), flops / (6 * math.exp(log_n)))),
        bounds=(math.log(1.0), math.log(flops / 6)),
        method="bounded",
        options=dict(xatol=1e-10),
    )
    assert math.exp(res.x) == pytest.approx(n_opt, rel=1e-4)
    assert float(law.loss(n_opt, d_opt)) <= res.fun + 1e-12


def test_optimum_by_hand():
    """Chinchilla's law at its own budget, worked by hand: G = (0.34 x 406.4 / (0.28 x 410.7))^(1/0.62)
    = 1.3447, K = 5.76e23 / 6 = 9.6e22, N = G K^(0.28/0.62) = 3.22e10, D = K / N = 2.98e12."""
    n, d = CHINCHILLA.optimum(5.76e23)
    assert n == pytest.approx(3.22e10, rel=0.005)
    assert d == pytest.approx(2.98e12, rel=0.005)


def test_intervals_hold_the_truth_on_noisy_points():
    n, d, loss = points(SMALL, (1e5, 1e7), (1e5, 1e8), noise=0.01, seed=0)
    law, laws = bootstrap(n, d, loss, samples=40, seed=0)
    assert len(laws) == 40
    for key in ("E", "alpha", "beta"):
        lo, hi = interval([getattr(x, key) for x in laws])
        assert lo <= getattr(SMALL, key) <= hi, key
        assert lo <= getattr(law, key) <= hi, key
    flops = 6 * 3e6 * 3e7
    true_n, true_d = SMALL.optimum(flops)
    lo, hi = interval([float(x.loss(*x.optimum(flops))) for x in laws])
    assert lo <= float(SMALL.loss(true_n, true_d)) <= hi
    lo, hi = interval([x.optimum(flops)[0] for x in laws])
    assert lo <= true_n <= hi


def test_interval_is_the_central_95_percent():
    assert interval(np.arange(1001)) == pytest.approx((25.0, 975.0))


@pytest.mark.parametrize(
    "n, d, loss, message",
    [
        ([1e6] * 4, [1e7] * 4, [3.0] * 4, "4 point(s); the law has 5 parameters, expected at least 5 points"),
        ([1e6] * 5, [1e7] * 5, [3.0, 2.0, 0.0, 2.5, 2.4], "point 2 has loss 0.0; expected a positive finite number"),
        ([1e6] * 5, [1e7] * 5, [3.0, -2.0, 1.0, 2.5, 2.4], "point 1 has loss -2.0"),
        ([1e6] * 5, [1e7] * 5, [3.0, 2.0, float("nan"), 2.5, 2.4], "point 2 has loss nan"),
        ([1e6, 0, 1e6, 1e6, 1e6], [1e7] * 5, [3.0] * 5, "point 1 has params N 0.0"),
        ([1e6] * 5, [1e7] * 4, [3.0] * 5, "5 params, 4 token counts and 5 losses"),
    ],
)
def test_bad_points_are_one_clear_line(n, d, loss, message):
    with pytest.raises(UserError) as e:
        check_points(n, d, loss)
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError):
        fit_law(n, d, loss)


def test_plot_draws_an_interval_that_misses_its_point(tmp_path):
    """A percentile interval need not hold the fit (a parameter at its bound): the plot still draws."""
    from dataclasses import asdict

    from lm.plan.scaling_report import plot

    rows = [
        dict(width=w, depth=2, params=n, flops=6 * n * d, loss=float(SMALL.loss(n, d)))
        for w, n in ((32, 1e5), (64, 4e5))
        for d in (1e6, 4e6)
    ]
    n, d = SMALL.optimum(1e13)
    loss = float(SMALL.loss(n, d))
    optimum = dict(flops=1e13, n_opt=n, d_opt=d, loss=loss, loss_interval=[loss - 0.02, loss - 1e-6])
    plot(dict(law=asdict(SMALL), points=rows, optimum=optimum), tmp_path / "ladder.png")
    assert (tmp_path / "ladder.png").read_bytes()[:4] == b"\x89PNG"
