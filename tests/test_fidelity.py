"""The fidelity matrix (bench/fidelity.py) runs and reports what it claims to.

A slice of the quick subset runs end to end: the report's structure and
sanity, the near-lossless reference, the checker flagging a config known to
be bad, and ``balanced`` restoring every moment without systematic drift.
Its loss deviations and ratios are measured by the full matrix, not asserted
here: a resumed run's deviation is chaotic, and machines differ in the last
bits of their arithmetic.
"""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

from deltackpt import CheckpointManager, CompressionConfig, Quantizer


def _load_bench() -> ModuleType:
    path = Path(__file__).parent.parent / "bench" / "fidelity.py"
    spec = importlib.util.spec_from_file_location("fidelity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fidelity = _load_bench()
# Weights restored within thousands of learning rates of their value: visibly worse training.
BAD = replace(CompressionConfig.preset("balanced"), weights=Quantizer(step=5.0, move_step=1e4),
              name="bad")


@pytest.fixture(scope="module")
def report(one_torch_thread: None, fidelity_cache: Path) -> dict:
    """Adam on the GPT early in training, SGD momentum on the BatchNorm CNN, five restores of
    the MLP; under the near-lossless reference, balanced and the bad config. The cells run at
    once, each in a worker process forked from this one, into the session's cache, which the
    report then reads. The GPT's and the CNN's are the fidelity notebook's cells in the test
    suite's short run: they run under its presets too, and its run finds them in the cache
    (tests/test_notebooks.py)."""
    cells = [fidelity.cell("gpt-tiny", "adamw-0.95", 5, "early"),
             fidelity.cell("cnn-bn", "sgd", 5, "early"),
             fidelity.cell("mlp", "adamw-0.999", 20, "5x")]
    presets = {"near-lossless": fidelity.NEAR_LOSSLESS, "balanced": "balanced", "bad": BAD}
    notebook_cells = cells[:2]
    with ProcessPoolExecutor(len(cells), mp_context=multiprocessing.get_context("fork")) as workers:
        runs = [workers.submit(fidelity.cached_cell, c,
                               {**presets, **fidelity.PRESETS} if c in notebook_cells else presets,
                               fidelity_cache) for c in cells]
        for run in runs:
            run.result()
    return fidelity.run_matrix(cells, presets, log=None, cache=fidelity_cache)


def test_report_structure(report: dict) -> None:
    expected_keys = {"gpt-tiny": {"exp_avg", "exp_avg_sq", "weights"},
                     "cnn-bn": {"momentum_buffer", "running_mean", "running_var", "weights"},
                     "mlp": {"exp_avg", "exp_avg_sq", "weights"}}
    assert [len(c["restores"]) for c in report["cells"]] == [1, 1, 5]
    for c in report["cells"]:
        assert c["resume"] == 100 and len(c["exact"]["losses"]) >= 100
        for name, r in c["presets"].items():
            assert r["ratio"] > 1, (c["name"], name)
            assert r["deltas"] > 0 and set(r["restored_kinds"]) == {"delta"}, (c["name"], name)
            for key in ("loss_dev", "eval_dev", "logit_diff", "max_err"):
                assert math.isfinite(r[key]) and r[key] >= 0, (c["name"], name, key)
            assert set(r["moments"]) == expected_keys[c["task"]], (c["name"], name)
            for m in r["moments"].values():
                assert m["elements"] > 0 and m["q05"] <= m["median"] <= m["q95"]
                assert math.isfinite(m["slope"])
        floor = c["floor"]
        assert len(floor["seeds"]) == fidelity.FLOOR_SEEDS
        assert floor["loss_dev"] <= floor["loss_dev_max"] == max(abs(f["loss_rel"])
                                                                for f in floor["seeds"])
        for r in c["presets"].values():
            assert r["loss_dev"] == abs(r["loss_rel"])
            assert r["within_floor"] == (r["loss_dev"] <= floor["loss_dev_max"])
            assert r["excess_dev"] == pytest.approx(r["loss_dev"] - floor["loss_dev"])
            assert math.isnan(r["steps_lost"]) or r["excess_steps"] == pytest.approx(
                r["steps_lost"] - floor["steps_lost"])
    table = fidelity.table(report)
    assert len(table.splitlines()) == 1 + 3 * len(report["cells"])


def test_steps_lost_are_the_exact_runs_steps() -> None:
    """A resumed run whose loss is 0.05 above an exact run falling 0.01 a step lost 5 steps;
    one below gained them; where the exact loss does not fall, steps say nothing."""
    exact = [3.0 - 0.01 * t for t in range(100)]
    assert fidelity.steps_lost([x + 0.05 for x in exact], exact) == pytest.approx(5.0)
    assert fidelity.steps_lost([x - 0.05 for x in exact], exact) == pytest.approx(-5.0)
    assert math.isnan(fidelity.steps_lost(exact, [2.0] * 100))


@pytest.mark.parametrize("optimizer", ["adamw-0.95", "adamw-pure-bf16", "adamw-bf16"])
def test_the_noise_floor_perturbs_every_weight_by_its_scale(optimizer: str) -> None:
    """float32 weights (and float32 masters of bfloat16 ones) move by FLOOR_SCALE of their value;
    bfloat16 weights round stochastically: a few move by one ulp, the others stay."""
    run = fidelity.Run.fresh(fidelity.TASKS["mlp"], fidelity.OPTIMIZERS[optimizer])
    run.train(1)  # the optimizer state exists
    masters = [s["master_param"] for s in run.optimizer.state.values() if "master_param" in s]
    before = [t.clone() for t in (*run.model.parameters(), *masters)]
    run.perturb(0)
    after = list((*run.model.parameters(), *masters))
    assert len(masters) == (2 * 3 if optimizer == "adamw-bf16" else 0)
    moved = []  # of the bfloat16 weights, pooled: a small tensor may have none
    for old, new in zip(before, after, strict=True):
        old, new = old.detach(), new.detach()
        if new.dtype == torch.float32:
            nonzero = old != 0
            rel = (new[nonzero] / old[nonzero] - 1).double()
            assert float(rel.std()) == pytest.approx(fidelity.FLOOR_SCALE, rel=0.2)
        else:
            moved.append(new != old)
            assert ((new.float() - old.float()).abs() <= old.float().abs() * 2.0**-7).all()
    if moved:
        fraction = float(torch.cat([m.reshape(-1) for m in moved]).double().mean())
        assert 0.003 < fraction < 0.05, fraction


def test_near_lossless_reference_deviates_little(report: dict) -> None:
    reference = {"near-lossless": fidelity.Targets({5: 0.01}, drift=(0.99, 1.01))}
    assert fidelity.check(report, reference) == []


def test_checker_flags_bad_config(report: dict) -> None:
    misses = fidelity.check(report, {"bad": fidelity.Targets({5: 0.005}, (("adam", None, 1e6),))})
    assert any(m.startswith("gpt-tiny/adamw-0.95/i5/early bad: loss_dev") for m in misses), misses
    assert any("bad: ratio" in m for m in misses) and not any("balanced" in m for m in misses)
    assert all(isinstance(m, str) for m in fidelity.check(report))  # the issue's targets


def test_balanced_restores_moments_without_drift(report: dict) -> None:
    """Every moment and buffer's median restored/true within [0.9, 1.1], early in training (the
    ninth delta of a chain) and after five restores; first moments neither zeroed nor shrunk
    (least-squares slope near 1: zeroed, it is 0)."""
    drift_only = {"balanced": fidelity.Targets({5: math.inf}, drift=(0.9, 1.1))}
    assert fidelity.check(report, drift_only) == []
    for c in report["cells"]:  # each element's noise is several times its value: a loose band
        for key, m in c["presets"]["balanced"]["moments"].items():
            if key in ("exp_avg", "momentum_buffer"):
                assert 0.7 < m["slope"] < 1.5, (c["name"], key, m)


def test_checker_limits() -> None:
    """Loss limits by interval, ratio targets by family and interval, the drift band."""
    targets = fidelity.ISSUE_TARGETS["balanced"]
    assert [targets.loss_limit(i) for i in (5, 20, 50, 100, 500)] == [0.005] * 3 + [0.01] * 2
    moments = {"exp_avg_sq": {"median": 0.5}}
    cells = [{"name": f"{family}/{interval}", "family": family, "interval": interval,
              "presets": {"balanced": {"loss_dev": 0.0, "ratio": 30.0, "moments": moments}}}
             for family, interval in (("adam", 20), ("adam", 100), ("sgd-momentum", 5),
                                      ("other", 20))]
    misses = fidelity.check({"cells": cells})
    assert [m for m in misses if "ratio" in m] == ["adam/20 balanced: ratio 30.0x < 50x"]
    assert sum("exp_avg_sq median" in m for m in misses) == 4


def test_class_variants_coarsen_one_class_each() -> None:
    """``--by-class K``: balanced and aggressive, and per lossy class balanced with every error
    bound of that class (its step and the step's units) K times larger, the other classes as
    they are; and with every lossy class's K times larger."""
    balanced = CompressionConfig.preset("balanced")
    variants = fidelity.class_variants(4)
    assert set(variants) == {"balanced", "aggressive", "weights x4", "first_moment x4",
                             "second_moment x4", "all x4"}
    assert variants["aggressive"] == CompressionConfig.preset("aggressive")
    for name, config in variants.items():
        if name == "aggressive":
            continue
        for cls in ("weights", "first_moment", "second_moment", "buffers"):
            q, b = getattr(config, cls), getattr(balanced, cls)
            if name == f"{cls} x4" or (name == "all x4" and not b.exact):
                assert q.move_step == (None if b.move_step is None else 4 * b.move_step)
                assert (q.step, q.rel_step, q.update_step, q.rms_step, q.domain, q.pred) == (
                    4 * b.step, None if b.rel_step is None else 4 * b.rel_step,
                    None if b.update_step is None else 4 * b.update_step,
                    None if b.rms_step is None else 4 * b.rms_step, b.domain, b.pred)
            else:
                assert q == b, (name, cls)


def test_master_adamw_keeps_float32_state(tmp_path: Path) -> None:
    """The bf16 model's optimizer keeps float32 masters through torch's and deltackpt's loads."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    optimizer = fidelity.MasterAdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 8, dtype=torch.bfloat16)).square().sum().backward()
        optimizer.step()
    masters = [s["master_param"] for s in optimizer.state.values()]
    assert all(m.dtype == torch.float32 for m in masters)
    assert torch.equal(model.weight, optimizer.state[model.weight]["master_param"].bfloat16())
    fresh = torch.nn.Linear(8, 8).to(torch.bfloat16)
    again = fidelity.MasterAdamW(fresh.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path, compression="lossless") as mgr:
        mgr.save(3, model, optimizer)
        mgr.load(3, fresh, again)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            assert again.state[q][key].dtype == value.dtype and torch.equal(again.state[q][key], value)


def test_cost_fit_prices_each_class_by_its_squared_factor() -> None:
    """``--fit-cost``: a class's coefficient is the rise of the median steps lost (either way)
    from balanced to its variant over the cells holding the class, per unit of K**2 - 1 (a
    least-squares fit where several factors ran: weights x4 agrees with x2 here); the floor is
    balanced's median less their sum; a cell in two reports counts once; the check sets each
    config's prediction beside its median."""
    def result(steps: float, *classes: str) -> dict:
        return {"steps_lost": steps, "max_err_by_class": dict.fromkeys(classes, 0.1)}

    adam, sgd = ("exact", "weights", "first_moment", "second_moment"), ("weights", "first_moment")
    cells = [{"name": name, "presets": {
        "balanced": result(b, *classes), "weights x2": result(w, *classes),
        "first_moment x2": result(m, *classes), "second_moment x2": result(v, *classes),
        "weights x4": result(4.0, *classes), "all x2": result(a, *classes)}}
        for name, classes, b, w, m, v, a in [
            ("a", adam, -1.0, -1.6, 2.5, 1.0, 3.0), ("b", adam, 1.0, 1.6, -2.5, 1.0, -4.0),
            ("c", sgd, 1.0, 1.6, 2.5, 9.0, 3.0), ("d", adam, math.nan, 5.0, 5.0, 5.0, 5.0)]]
    cells.append({**cells[0], "presets": {"balanced": result(7.0, *adam)}})  # a's again
    model, check = fidelity.fit_cost(cells)
    assert model.per_class == {"weights": 0.2, "first_moment": 0.5, "second_moment": 0.0}
    assert model.floor == pytest.approx(0.3)
    assert "all x2: predicted 3.10, measured median 3.00 steps over 3 cells" in check
    assert "balanced: predicted 1.00, measured median 1.00 steps over 3 cells" in check


def _seed_run(name: str, seed: int, steps: float, loss_dev: float, floor_steps: float) -> dict:
    """A cell's result as run_cell reports it, cut to what over_seeds reads."""
    return {"name": name, "seed": seed,
            "floor": {"steps_lost": floor_steps, "loss_dev": 0.0001},
            "presets": {"balanced": {"steps_lost": steps, "loss_dev": loss_dev}}}


def test_over_seeds_gives_each_presets_spread_over_training_seeds() -> None:
    """Steps lost as mean +- sd and range over the seeds of a cell, beside the floor's mean;
    loss deviation where the loss no longer falls; a cell run with one seed has no row."""
    report = {"cells": [_seed_run("a", 0, 1.0, 0.001, 0.0), _seed_run("a", 1, 3.0, 0.002, 0.5),
                        _seed_run("a", 2, 8.0, 0.003, 0.1),
                        _seed_run("b", 0, math.nan, 0.001, math.nan),
                        _seed_run("b", 1, math.nan, 0.003, math.nan),
                        _seed_run("c", 0, 1.0, 0.001, 0.0)]}
    rows = fidelity.over_seeds(report).splitlines()
    assert len(rows) == 2
    assert rows[0].split()[:4] == ["a", "seeds", "0,1,2", "balanced"]
    assert "4.00 +-   3.61 steps [1.00, 8.00]; floor 0.20" in rows[0]
    assert rows[1].split()[:4] == ["b", "seeds", "0,1", "balanced"]
    assert "0.20 +-   0.14 % loss [0.10, 0.30]; floor 0.010" in rows[1]


def test_main_writes_its_report(report: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """The command line runs the cells it is given, lists the misses of both sets of targets
    and writes --json (it once died after the cells: the name check was bound in one branch)."""
    asked = {}

    def run_matrix(cells, presets, seeds):
        asked.update(cells=[c.name for c in cells], seeds=seeds)
        return {**report, "seconds": 1.0}

    monkeypatch.setattr(fidelity, "run_matrix", run_matrix)
    monkeypatch.setattr(fidelity.torch, "set_num_threads", lambda n: None)
    name = report["cells"][0]["name"]  # a matrix cell: the run is the fixture's report
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["fidelity.py", "--cells", name, "--json", str(out)])
    fidelity.main()
    assert asked == {"cells": [name], "seeds": 1}
    assert len(json.loads(out.read_text())["cells"]) == len(report["cells"])
    assert "misses of the noise floor's targets" in capsys.readouterr().out
