"""Hierarchical references: the schedule's tree, and a writer that follows it.

The schedule must keep every save within its depth, code each one against the latest save a
level up, and have the least sum of log2(distance to the reference) such a tree can have (checked
against every tree of small groups). A manager must write the steps its schedule names, hold at
most one reconstruction a level, restore every step through at most ``depth`` deltas, and keep
doing so across a failed save, a load and a gc.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

import deltackpt.save.driver as driver
from deltackpt import CheckpointManager
from deltackpt.errors import ConfigError
from deltackpt.save.schedule import EXACT_SAVES, schedule


def _cost(depths: tuple[int, ...]) -> float:
    """Sum of log2(distance to the reference) of a group's depths (the reference of a save is
    the latest save one level up)."""
    total = 0.0
    for p in range(1, len(depths)):
        parent = max(q for q in range(p) if depths[q] == depths[p] - 1)
        total += math.log2(p - parent)
    return total


def _trees(n: int, depth: int):
    """Every depth sequence of ``n`` positions (0: the root) a writer could follow."""
    for rest in itertools.product(range(1, depth + 1), repeat=n - 1):
        depths = (0, *rest)
        if all(any(depths[q] == depths[p] - 1 for q in range(p)) for p in range(1, n)):
            yield depths


@pytest.mark.parametrize(("n", "depth"), [(2, 1), (5, 1), (6, 2), (8, 2), (8, 3), (9, 4), (7, 6)])
def test_the_schedule_is_the_least_cost_tree(n: int, depth: int) -> None:
    plan = schedule(n, depth)
    assert max(plan.depths) <= depth and plan.depths[0] == 0
    assert _cost(plan.depths) == pytest.approx(min(_cost(t) for t in _trees(n, depth)))


@pytest.mark.parametrize(("n", "depth"), [(10, 8), (128, 8), (100, 3), (EXACT_SAVES + 70, 5),
                                          (2 * EXACT_SAVES + 1, 1), (1, 4)])
def test_every_save_is_within_depth_and_on_the_latest_a_level_up(n: int, depth: int) -> None:
    plan = schedule(n, depth)
    assert len(plan.depths) == n and max(plan.depths) <= depth
    for p in range(1, n):
        reference = plan.reference(p)
        assert plan.depths[reference] == plan.depths[p] - 1
        assert not any(plan.depths[q] == plan.depths[reference] for q in range(reference + 1, p))
        assert plan.is_base[reference]
    assert [p for p in range(n) if plan.is_base[p]] == sorted(
        {plan.reference(p) for p in range(1, n)})


def test_short_groups_are_chains_and_long_ones_branch() -> None:
    assert schedule(9, 8).depths == tuple(range(9))
    plan = schedule(128, 8)
    assert plan.depths[:9] == tuple(range(9)) and max(plan.depths) == 8
    assert _cost(plan.depths) < _cost(schedule(128, 4).depths)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None])
def test_a_bad_depth_is_refused_naming_it(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="depth"):
        CheckpointManager(tmp_path, depth=bad)
    assert not any(tmp_path.iterdir())


class _Run:
    """A small model trained with Adam on a fixed regression task: real optimizer state."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                         torch.nn.Linear(64, 8))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(256, 32, generator=gen), torch.randn(256, 8, generator=gen)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.slack: dict[int, float] = {}

    def train(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def save(self, mgr: CheckpointManager, step: int):
        self.states[step] = {k: v.clone() for k, v in self.model.state_dict().items()}
        return mgr.save(step, self.model, self.optimizer, rng=False)

    @property
    def lossy_bytes(self) -> int:
        """fp32 bytes of the parameters and both moments: one reconstruction."""
        return 3 * sum(p.numel() * 4 for p in self.model.parameters())

    def check(self, mgr: CheckpointManager, step: int) -> None:
        """``step`` restores to its weights within the error its writer recorded (a re-coded
        step: plus the error of the version it replaced, ``slack``)."""
        other = _Run()
        mgr.load(step, other.model, other.optimizer, rng=False)
        classes = mgr.metadata(step).stats.classes or {}
        bound = classes.get("weights", {}).get("max_abs_error", 0.0) * (1 + 1e-6)
        for name, value in other.model.state_dict().items():
            error = (value - self.states[step][name]).abs().max().item()
            assert error <= bound + self.slack.get(step, 0.0), (step, name, error, bound)


def _trained(run: _Run, mgr: CheckpointManager, steps) -> None:
    for step in steps:
        run.train()
        run.save(mgr, step)


def _depth(mgr: CheckpointManager, step: int) -> int:
    meta = mgr.metadata(step)
    return 0 if meta.kind == "full" else 1 + _depth(mgr, meta.base_step)


@pytest.mark.parametrize(("full_every", "depth"), [(20, 3), (12, 2)])
def test_a_manager_writes_its_schedule(tmp_path: Path, full_every: int, depth: int) -> None:
    plan, run = schedule(full_every, depth), _Run()
    with CheckpointManager(tmp_path, full_every=full_every, depth=depth) as mgr:
        for step in range(full_every + 3):
            run.train()
            info = run.save(mgr, step)
            position = step % full_every
            assert info.kind == ("full" if position == 0 else "delta")
            if position:
                assert info.base_step == step - position + plan.reference(position)
            held = len(mgr._reference.levels)
            assert held <= depth and (held or position == full_every - 1)
            assert sum(mgr.reconstruction_bytes.values()) <= held * run.lossy_bytes
        for step in range(full_every + 3):
            assert _depth(mgr, step) == plan.depths[step % full_every]
            run.check(mgr, step)


def test_a_failed_save_leaves_the_held_levels_intact(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """After a delta failed, the next saves are the steps they would have been without it,
    whether the failed one coded its base in place or a copy (a later save needs the base)."""
    plan = schedule(20, 2)
    assert plan.depths[1:4] == (1, 2, 1)  # position 1's base is needed by 3, 2's is not
    run = _Run()
    with CheckpointManager(tmp_path / "ref", full_every=20, depth=2) as ref:
        _trained(run, ref, range(5))
    for fails in (1, 2):
        other = _Run()
        with CheckpointManager(tmp_path / f"ckpt{fails}", full_every=20, depth=2) as mgr:
            for step in range(5):
                other.train()
                if step == fails:
                    with monkeypatch.context() as patch:
                        patch.setattr(driver, "write_data", _disk_gone)
                        with pytest.raises(OSError, match="disk gone"):
                            other.save(mgr, step)
                    assert mgr.steps() == list(range(step))
                info = other.save(mgr, step)
                assert info.base_step == ref.metadata(step).base_step
            for step in range(5):
                assert mgr.restore(step).tensors.keys() == ref.restore(step).tensors.keys()
                for name, value in ref.restore(step).tensors.items():
                    assert torch.equal(mgr.restore(step).tensors[name], value), (fails, step)


def _disk_gone(*args: object, **kwargs: object) -> None:
    raise OSError("disk gone")


def test_saves_after_a_load_stay_within_depth(tmp_path: Path) -> None:
    run = _Run()
    with CheckpointManager(tmp_path, full_every=40, depth=3) as mgr:
        _trained(run, mgr, range(20))
    for resume in (5, 12, 19):
        with CheckpointManager(tmp_path, full_every=40, depth=3) as mgr:
            mgr.load(resume, run.model, run.optimizer, rng=False)
            _trained(run, mgr, range(100 * resume, 100 * resume + 8))
            for step in mgr.steps():
                assert _depth(mgr, step) <= 3
            for step in range(100 * resume, 100 * resume + 8):
                run.check(mgr, step)


def test_gc_on_the_hierarchy_recodes_only_what_loses_its_reference(tmp_path: Path) -> None:
    run = _Run()
    with CheckpointManager(tmp_path, full_every=64, depth=3) as mgr:
        _trained(run, mgr, range(40))
        metas = {s: mgr.metadata(s) for s in mgr.steps()}
        run.slack = {s: m.stats.classes["weights"]["max_abs_error"] for s, m in metas.items()
                     if m.kind == "delta"}
        dry = mgr.gc("every=8", dry_run=True)
        report = mgr.gc("every=8")
        assert (dry.removed, dry.recoded, dry.rewritten) == \
            (report.removed, report.recoded, report.rewritten)
        assert abs(dry.bytes_after - report.bytes_after) <= 0.1 * report.bytes_after
        assert not report.held
        kept = set(range(0, 40, 8)) | {39}
        assert set(report.kept) == kept and set(report.removed) == set(range(40)) - kept
        lost = {s for s in kept if any(c not in kept for c in _chain(metas, s))}
        assert set(report.recoded) | set(report.rewritten) == lost
        assert report.bytes_after <= report.bytes_before
        for step in report.kept:
            assert _depth(mgr, step) <= 3
            run.check(mgr, step)
        run.train()
        run.save(mgr, 40)
        assert _depth(mgr, 40) <= 3
        run.check(mgr, 40)


def _chain(metas: dict, step: int) -> list[int]:
    """The steps ``step`` is restored through, below it."""
    out = []
    while metas[step].kind == "delta":
        step = metas[step].base_step
        out.append(step)
    return out
