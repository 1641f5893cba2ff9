"""The error-shaping bench (bench/error_shaping.py) shapes, perturbs and counts what it says.

Its figures are measured by the bench on real runs, not asserted here: these
tests check its step multipliers, that its steps follow the class's unit, and
that a short run's rows hold what a coarser step must give, counted both as
entropy and as the codec's bytes.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
error_shaping = importlib.import_module("error_shaping")
fidelity = importlib.import_module("fidelity")


def test_shape_is_uniform_at_zero_and_finer_where_the_second_moment_is_larger() -> None:
    v_hat = torch.tensor([0.0, 1e-8, 1e-6, 1e-4, 1e-2])
    assert torch.equal(error_shaping._shape(v_hat, 1e-8, 0.0), torch.ones(5))
    s = error_shaping._shape(v_hat, 1e-8, 0.25)
    assert math.isclose(float(s.log().mean()), 0.0, abs_tol=1e-5)  # geometric mean 1
    assert torch.all(s[1:] < s[:-1])
    # the floor, 1/16 of the root mean square of sqrt(v), bounds the largest step
    floor = error_shaping.KAPPA * float(v_hat.mean().sqrt())
    assert float(s[0] / s[-1]) <= ((0.1 + floor) / floor) ** 0.5 * (1 + 1e-5)
    narrow = error_shaping._shape(v_hat, 1e-8, 0.25, kappa=1.0)  # a higher floor, a narrower range
    assert float(narrow[0] / narrow[-1]) < float(s[0] / s[-1])


def test_steps_follow_each_class_unit() -> None:
    run = fidelity.Run.fresh(fidelity.TASKS["mlp"], fidelity.OPTIMIZERS["adamw-0.95"])
    run.train(3)
    weights = error_shaping.class_steps(run, "weights", 0.0, 96.0)
    moments = error_shaping.class_steps(run, "first_moment", 0.0, 2.8)
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    assert all(t is p for (t, _), p in zip(weights, params, strict=True))
    assert all(t is run.optimizer.state[p]["exp_avg"] for (t, _), p in zip(moments, params, strict=True))
    for (_, w), (_, m) in zip(weights, moments, strict=True):
        assert torch.all(w == w.flatten()[0]) and w.flatten()[0] > 0  # one step a tensor
        assert torch.all(m > 0)
    shaped = error_shaping.class_steps(run, "weights", 0.25, 96.0)
    for (_, w), (_, s) in zip(weights, shaped, strict=True):
        assert math.isclose(float(s.log().mean()), math.log(float(w.flatten()[0])), rel_tol=1e-4)


def test_a_coarser_step_codes_fewer_bits() -> None:
    rows = error_shaping.measure("mlp", "adamw-0.95", at=40, interval=20, cls="weights",
                                 multiples=[32.0, 256.0], alphas=[0.0, 0.25], seeds=1)
    assert [(r["c"], r["alpha"]) for r in rows] == [(32.0, 0.0), (32.0, 0.25), (256.0, 0.0),
                                                    (256.0, 0.25)]
    for key in ("entropy", "bits"):  # order-0 entropy, and what the codec stores
        assert rows[2][key] < rows[0][key] and rows[3][key] < rows[1][key]
    # the codec's own packing and zstd store about the entropy of the same symbols
    assert all(0.5 * r["entropy"] < r["bits"] < 1.5 * r["entropy"] for r in rows)
    assert all(math.isfinite(r["steps_lost"]) for r in rows)


def test_grouped_shape_shares_each_groups_geometric_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    v_hat = torch.rand(6, 10, generator=gen) ** 4
    s = error_shaping._shape(v_hat, 1e-8, 0.25)
    by_row = error_shaping._shape(v_hat, 1e-8, 0.25, group="row")
    assert math.isclose(float(by_row.log().mean()), 0.0, abs_tol=1e-5)
    assert torch.allclose(by_row, s.log().mean(1, keepdim=True).exp().expand(6, 10), rtol=1e-5)
    by_four = error_shaping._shape(v_hat, 1e-8, 0.25, group="4").flatten()
    assert torch.allclose(by_four[:4], s.flatten()[:4].log().mean().exp().expand(4), rtol=1e-5)
    assert torch.allclose(by_four[-4:], s.flatten()[-4:].log().mean().exp().expand(4), rtol=1e-5)


def test_row_and_column_factors_keep_each_rows_and_columns_mean() -> None:
    gen = torch.Generator().manual_seed(1)
    v_hat = torch.rand(5, 3, 4, generator=gen) ** 4
    logs = error_shaping._shape(v_hat, 1e-8, 0.25).log().reshape(5, 12)
    fitted = error_shaping._shape(v_hat, 1e-8, 0.25, group="rowcol").log().reshape(5, 12)
    assert torch.allclose(fitted.mean(1), logs.mean(1), atol=1e-5)
    assert torch.allclose(fitted.mean(0), logs.mean(0), atol=1e-5)
    row_factor = fitted - fitted[:, :1]  # a row factor times a column factor: rank one
    assert torch.allclose(row_factor, row_factor[:1].expand(5, 12), atol=1e-5)
    bias = torch.rand(7, generator=gen)  # a vector keeps its elements' own steps
    assert torch.equal(error_shaping._shape(bias, 1e-8, 0.25, group="rowcol"),
                       error_shaping._shape(bias, 1e-8, 0.25))
