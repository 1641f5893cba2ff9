"""The expected cost of a delta's errors in steps of progress (deltackpt/encode/cost.py): what
the model gives each config, and what saves record of it (SaveInfo, the step's metadata)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_delta import mlp, train

from deltackpt import CheckpointManager, CompressionConfig, Quantizer
from deltackpt.app.cli import main
from deltackpt.encode.cost import MATRIX, expected_steps
from deltackpt.encode.policy import EXACT
from deltackpt.save.info import SaveInfo

BALANCED = CompressionConfig.preset("balanced")
W, M, V = (MATRIX.per_class[c] for c in ("weights", "first_moment", "second_moment"))


def test_presets_cost_their_errors_squared() -> None:
    """balanced prices every class at its own errors; aggressive's weights move three times as
    far (move_step 96 against 32, its largest bound's ratio), its first moment 2 / 1.4 times
    and its second moment twice: each class's coefficient times the square of that ratio."""
    assert expected_steps(BALANCED) == round(MATRIX.floor + W + M + V, 2)
    aggressive = CompressionConfig.preset("aggressive")
    assert expected_steps(aggressive) == round(
        MATRIX.floor + 9 * W + (2 / 1.4) ** 2 * M + 4 * V, 2)
    assert expected_steps(BALANCED) < expected_steps(aggressive)


def test_scale_and_classes_coded() -> None:
    """target_ratio's scale multiplies every class's errors; a class stored exactly, or absent
    from the state (SGD has no second moment), costs nothing."""
    assert MATRIX.steps(BALANCED, 2.0) == pytest.approx(MATRIX.floor + 4 * (W + M + V))
    assert MATRIX.steps(BALANCED, classes=["weights", "first_moment"]) == pytest.approx(
        MATRIX.floor + W + M)
    assert MATRIX.steps(replace(BALANCED, weights=EXACT)) == pytest.approx(MATRIX.floor + M + V)
    assert MATRIX.steps(replace(BALANCED, weights=EXACT, first_moment=EXACT,
                                second_moment=EXACT)) == MATRIX.floor
    finer = replace(BALANCED, first_moment=Quantizer(step=0.7, update_step=0.7, pred="zero"))
    assert MATRIX.steps(finer) == pytest.approx(MATRIX.floor + W + M / 4 + V)


@pytest.mark.parametrize("change", [
    {"weights": Quantizer(step=None, density=0.1)},  # a density instead of a step
    {"weights": Quantizer(step=1.0)},  # no unit of movement: another error than the matrix's
    {"second_moment": Quantizer(step=1.0)},  # linear where balanced's is ordinal
    {"first_moment": Quantizer(step=1.4, update_step=1.4, pred="zero", dither=False)},
    {"buffers": Quantizer(step=1.0)},  # lossy buffers: the matrix never coded them
    {"overrides": {"model/0.*": Quantizer(step=2.0, move_step=64.0, rel_step=0.5)}},
])
def test_errors_the_matrix_did_not_price_have_no_estimate(change: dict) -> None:
    assert expected_steps(replace(BALANCED, **change)) is None


def test_an_exact_override_keeps_the_estimate() -> None:
    """An override that stores some tensors exactly only lowers the errors: the class's
    estimate stays an upper one."""
    assert expected_steps(replace(BALANCED, overrides={"model/0.*": EXACT})) == \
        expected_steps(BALANCED)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_saves_record_the_expected_cost(tmp_path: Path, optimizer: str) -> None:
    """A full step costs nothing; a delta records the model's cost of its config at its scale
    over the classes it coded (SGD's momentum but no second moment), in the metadata and in
    ``SaveInfo``, as ``save`` returns it and as ``info`` reads it back."""
    model = mlp()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw" else
           torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    classes = ["weights", "first_moment"] + (["second_moment"] if optimizer == "adamw" else [])
    with CheckpointManager(tmp_path / "ckpt", full_every=10) as mgr:
        infos = []
        for step in range(3):
            train(model, opt, 2)
            infos.append(mgr.save(step, model=model, optimizer=opt))
        assert infos[0].kind == "full" and infos[0].expected_steps == 0.0
        for info in infos[1:]:
            compression = mgr.metadata(info.step).stats.compression
            assert info.kind == "delta" and compression["scale"] == 1.0
            assert compression["expected_steps"] == info.expected_steps == round(
                MATRIX.steps(BALANCED, classes=classes), 2)
            assert mgr.info(info.step) == info == SaveInfo.of(mgr.metadata(info.step))


def test_target_ratio_records_the_cost_of_its_scale(tmp_path: Path) -> None:
    """A target scales the errors, and the recorded cost follows the scale chosen per save."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = replace(BALANCED, target_ratio=1e6)  # held at the default cap, sqrt(2)
    with CheckpointManager(tmp_path / "ckpt", full_every=10, compression=config) as mgr:
        for step in range(3):
            train(model, opt, 2)
            info = mgr.save(step, model=model, optimizer=opt)
        compression = mgr.metadata(info.step).stats.compression
        assert compression["scale"] > 1
        assert info.expected_steps == expected_steps(config, compression["scale"]) > \
            expected_steps(BALANCED)


def test_an_unpriced_delta_says_its_cost_is_unknown(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Weights coded by density: no estimate in the metadata or SaveInfo, and ``info`` says the
    cost is unknown."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = replace(BALANCED, weights=Quantizer(step=None, density=0.1))
    with CheckpointManager(tmp_path / "ckpt", full_every=10, compression=config) as mgr:
        for step in range(2):
            train(model, opt, 2)
            info = mgr.save(step, model=model, optimizer=opt)
        assert info.kind == "delta" and info.expected_steps is None
        assert "expected_steps" not in mgr.metadata(1).stats.compression
    assert main(["info", str(tmp_path / "ckpt"), "--step", "1"]) == 0
    assert re.search(r"^compression     balanced, scale 1, target ratio -, expected cost unknown$",
                     capsys.readouterr().out, re.M)
