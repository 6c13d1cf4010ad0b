"""The scaling law L(N, D) = E + A / N^alpha + B / D^beta fitted the Chinchilla way (Hoffmann et al.
2022, approach 3), its bootstrap intervals and the compute-optimal split of a FLOP budget.

The fit works in logs: parameters (e, a, b, alpha, beta) with E = exp(e), A = exp(a), B = exp(b);
the prediction log L = logsumexp(a - alpha log N, b - beta log D, e); the objective is the sum of
Huber(delta = 1e-3) of log L_pred - log L_obs over the points, minimised by L-BFGS-B. The objective
is evaluated on a grid of starting points, L-BFGS-B runs from the best of them, and the best end
point is kept. Compute is C = 6 N D. Numpy and scipy only: no jax.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
from scipy.optimize import minimize

from lm.errors import UserError

DELTA = 1e-3  # Huber's delta on log-loss residuals (Chinchilla's)
MIN_POINTS = 5  # as many as the law has parameters
# Chinchilla's grid of starting points: alpha, beta, e, a, b
GRID = dict(
    alpha=(0.0, 0.5, 1.0, 1.5, 2.0),
    beta=(0.0, 0.5, 1.0, 1.5, 2.0),
    e=(-1.0, -0.5, 0.0, 0.5, 1.0),
    a=(0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    b=(0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
)
# keep L-BFGS-B away from the flat ends of the law (an exponent of 0 makes A and E one constant)
BOUNDS = [(-20.0, 60.0), (-20.0, 60.0), (-10.0, 5.0), (1e-3, 4.0), (1e-3, 4.0)]  # a, b, e, alpha, beta


@dataclasses.dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    @classmethod
    def from_theta(cls, theta) -> "Law":
        a, b, e, alpha, beta = (float(x) for x in theta)
        return cls(math.exp(e), math.exp(a), math.exp(b), alpha, beta)

    def loss(self, n, d):
        n, d = np.asarray(n, float), np.asarray(d, float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def optimum(self, flops: float) -> tuple[float, float]:
        """(N_opt, D_opt) minimising L under 6 N D = flops: setting dL/dN = 0 with D = K / N, K = flops / 6,
        gives alpha A N^-alpha = beta B K^-beta N^beta, so N_opt = G K^(beta / (alpha + beta)) with
        G = (alpha A / (beta B))^(1 / (alpha + beta)), and D_opt = K / N_opt."""
        k = flops / 6.0
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        n = g * k ** (self.beta / (self.alpha + self.beta))
        return n, k / n

    def text(self) -> str:
        return f"L(N, D) = {self.E:.3f} + {self.A:.4g} / N^{self.alpha:.3f} + {self.B:.4g} / D^{self.beta:.3f}"


def check_points(n, d, loss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrays of N, D and loss, or one UserError line saying what is wrong."""
    n, d, loss = (np.asarray(x, float).ravel() for x in (n, d, loss))
    if not len(n) == len(d) == len(loss):
        raise UserError(
            f"scaling fit: {len(n)} params, {len(d)} token counts and {len(loss)} losses; expected one each a point"
        )
    if len(n) < MIN_POINTS:
        raise UserError(
            f"scaling fit: {len(n)} point(s); the law has 5 parameters, expected at least {MIN_POINTS} points"
        )
    for name, x in (("loss", loss), ("params N", n), ("tokens D", d)):
        bad = np.flatnonzero(~np.isfinite(x) | (x <= 0))
        if bad.size:
            raise UserError(f"scaling fit: point {bad[0]} has {name} {x[bad[0]]}; expected a positive finite number")
    return n, d, loss


def _objective(theta, log_n, log_d, log_l, weights):
    """Huber loss of the log residuals (weighted: a bootstrap resample counts repeats) and its gradient."""
    a, b, e, alpha, beta = theta
    t1, t2 = a - alpha * log_n, b - beta * log_d
    top = np.maximum(np.maximum(t1, t2), e)
    p1, p2, p3 = np.exp(t1 - top), np.exp(t2 - top), np.exp(e - top)
    total = p1 + p2 + p3
    r = top + np.log(total) - log_l
    value = weights @ np.where(np.abs(r) <= DELTA, 0.5 * r * r, DELTA * (np.abs(r) - 0.5 * DELTA))
    dr = weights * np.clip(r, -DELTA, DELTA) / total  # Huber's derivative times the softmax's denominator
    g1, g2 = dr * p1, dr * p2
    return value, np.array([g1.sum(), g2.sum(), dr @ p3, -(g1 @ log_n), -(g2 @ log_d)])


def _grid() -> np.ndarray:
    """Starting points as rows (a, b, e, alpha, beta)."""
    g = GRID
    return np.array(
        [(a, b, e, al, be) for al, be, e, a, b in itertools.product(g["alpha"], g["beta"], g["e"], g["a"], g["b"])]
    )


def _grid_values(starts, log_n, log_d, log_l, weights) -> np.ndarray:
    """The objective at every starting point at once."""
    a, b, e, alpha, beta = (starts[:, i : i + 1] for i in range(5))
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(starts), len(log_n)))])
    top = terms.max(axis=0)
    r = np.abs(top + np.log(np.exp(terms - top).sum(axis=0)) - log_l)
    return np.sum(weights * np.where(r <= DELTA, 0.5 * r**2, DELTA * (r - 0.5 * DELTA)), axis=1)


def _minimise(starts, log_n, log_d, log_l, weights, maxiter: int) -> tuple[np.ndarray, float]:
    best, best_value = None, np.inf
    for start in starts:
        res = minimize(
            _objective,
            start,
            args=(log_n, log_d, log_l, weights),
            jac=True,
            method="L-BFGS-B",
            bounds=BOUNDS,
            options=dict(maxiter=maxiter, ftol=1e-13, gtol=1e-10),
        )
        if np.isfinite(res.fun) and res.fun < best_value:
            best, best_value = res.x, float(res.fun)
    return best, best_value


def fit_theta(n, d, loss, starts: int = 16, weights=None, extra=(), maxiter: int = 2000) -> np.ndarray:
    """Best (a, b, e, alpha, beta): L-BFGS-B from the `starts` grid points with the lowest objective
    (plus the `extra` starting points). Points that pin the law down loosely leave a flat valley:
    the iterations go on until it is crossed (`maxiter`)."""
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    weights = np.ones_like(log_n) if weights is None else np.asarray(weights, float)
    grid = _grid()
    order = np.argsort(_grid_values(grid, log_n, log_d, log_l, weights))
    chosen = np.clip(grid[order[:starts]], [lo for lo, _ in BOUNDS], [hi for _, hi in BOUNDS])
    theta, _ = _minimise([*chosen, *extra], log_n, log_d, log_l, weights, maxiter)
    return theta


def fit_law(n, d, loss, starts: int = 16) -> Law:
    n, d, loss = check_points(n, d, loss)
    return Law.from_theta(fit_theta(n, d, loss, starts))


def bootstrap(n, d, loss, samples: int = 200, seed: int = 0, starts: int = 3) -> tuple[Law, list[Law]]:
    """The fit on all points and on `samples` resamples drawn with replacement (each refitted from
    the full fit and the best `starts` grid points of the resample, fewer iterations: the intervals
    need the spread of the refits, not each to the last digit)."""
    n, d, loss = check_points(n, d, loss)
    theta = fit_theta(n, d, loss)
    rng = np.random.default_rng(seed)
    laws = []
    for _ in range(samples):
        counts = np.bincount(rng.integers(0, len(n), len(n)), minlength=len(n))
        laws.append(Law.from_theta(fit_theta(n, d, loss, starts, weights=counts, extra=[theta], maxiter=400)))
    return Law.from_theta(theta), laws


def interval(values, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval (2.5th to 97.5th for 95%)."""
    tail = 50.0 * (1.0 - level)
    lo, hi = np.percentile(np.asarray(values, float), [tail, 100.0 - tail])
    return float(lo), float(hi)
