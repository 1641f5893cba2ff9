"""Configuration mistakes: every bad value of every configuration argument (the manager's, a
CompressionConfig's, a Quantizer's, a RetentionPolicy's) raises ConfigError, worded one way per
kind of mistake, ``<name> must be <what>, got <value>``, whether the value has the wrong type or
is out of range; and a bad manager argument creates nothing."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from deltackpt import (
    EXACT,
    CheckpointManager,
    CompressionConfig,
    ConfigError,
    DeltackptError,
    Quantizer,
    RetentionPolicy,
)
from deltackpt.format.checks import check_int, check_number

POSITIVE_INT = "a positive integer"
NOT_INTS = [0, -1, 1.5, "3", True, None]  # what no positive-integer argument takes


def _manager(tmp: Path) -> Callable[..., object]:
    return lambda **kwargs: CheckpointManager(tmp / "ckpt", **kwargs)


# (what builds it, argument, bad values, the message up to ", got <value>")
CASES: list[tuple[str, str, list[Any], str]] = [
    ("manager", "full_every", NOT_INTS, f"full_every must be {POSITIVE_INT}"),
    ("manager", "max_in_flight", NOT_INTS, f"max_in_flight must be {POSITIVE_INT}"),
    ("manager", "workers", [0, -2, 1.5, "4", True], f"workers must be {POSITIVE_INT}"),
    ("manager", "chunk_bytes", [0, 1023, 4096.0, "8192", True, None],
     "chunk_bytes must be an integer of at least 1024"),
    ("manager", "cache_keep", [-1, 1.5, "1", True, None], "cache_keep must be a non-negative integer"),
    ("manager", "read_only", ["yes", 1, None], "read_only must be True or False"),
    ("manager", "blocking", ["no", 0, None], "blocking must be True or False"),
    ("manager", "reconstruction", ["gpu", "HOST", "", None],
     "reconstruction must be one of 'device', 'host'"),
    ("manager", "compression", [3, None, {"name": "balanced"}],
     "compression must be a preset name or a CompressionConfig"),
    ("manager", "compression", ["fast", ""],
     "compression preset must be one of 'aggressive', 'balanced', 'lossless'"),
    ("config", "target_ratio", ["8", 0.5, 1, 1.0, 0, -5.0, math.nan, math.inf, True],
     "target_ratio must be a number above 1"),
    ("config", "max_error", [0, -1.0, math.nan, math.inf, "1", True], "max_error must be a positive number"),
    ("config", "block", [10, 63, (1 << 20) + 1, 1024.0, "1024", True],
     "block must be an integer in [64, 1048576]"),
    ("config", "deltas", ["no", 0, None], "deltas must be True or False"),
    ("config", "name", [3, None], "name must be a string"),
    ("config", "weights", [1.0, "exact", None], "weights must be a Quantizer"),
    ("config", "second_moment", [2.0, "ordinal"], "second_moment must be a Quantizer"),
    ("config", "overrides", [["model/*"], "model/*", None],
     "overrides must be a mapping of name patterns to Quantizers"),
    ("quantizer", "step", [0, -1.0, math.nan, math.inf, "1", True],
     "Quantizer step must be a positive number"),
    ("quantizer", "move_step", [0.0, math.nan, "32", True], "Quantizer move_step must be a positive number"),
    ("quantizer", "rel_step", [-0.25, math.inf, "0.25"], "Quantizer rel_step must be a positive number"),
    ("quantizer", "domain", ["log", "", None], "Quantizer domain must be one of 'linear', 'ordinal'"),
    ("quantizer", "pred", ["mean", None], "Quantizer pred must be one of 'base', 'zero'"),
    ("quantizer", "dither", ["yes", 1, None], "Quantizer dither must be True or False"),
    ("quantizer", "exact", ["yes", 1], "Quantizer exact must be True or False"),
    ("policy", "last", NOT_INTS[:-1], f"retention policy: last must be {POSITIVE_INT}"),
    ("policy", "every", NOT_INTS[:-1], f"retention policy: every must be {POSITIVE_INT}"),
    ("policy", "full_within", NOT_INTS[:-1], f"retention policy: full_within must be {POSITIVE_INT}"),
]


def _builder(kind: str, tmp: Path) -> Callable[..., object]:
    return {"manager": _manager(tmp), "config": CompressionConfig, "quantizer": Quantizer,
            "policy": lambda **kw: RetentionPolicy(**{"last": 1, **kw})}[kind]


@pytest.mark.parametrize(("kind", "argument", "value", "wording"), [
    pytest.param(kind, argument, value, wording, id=f"{argument}={value!r}")
    for kind, argument, values, wording in CASES for value in values
])
def test_every_bad_value_is_a_config_error(tmp_path: Path, kind: str, argument: str, value: Any,
                                           wording: str) -> None:
    with pytest.raises(ConfigError) as info:
        _builder(kind, tmp_path)(**{argument: value})
    assert str(info.value) == f"{wording}, got {value!r}"
    assert isinstance(info.value, DeltackptError) and isinstance(info.value, ValueError)
    assert not (tmp_path / "ckpt").exists()  # a manager with a bad argument creates nothing


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"step": None, "density": value}, f"Quantizer density must be a number in (0, 1], got {value!r}")
    for value in (0.0, -0.1, 1.5, "0.5", True, math.nan)
] + [
    ({"step": 100.0, "domain": "ordinal"},
     "Quantizer step (dithered, ordinal domain) must be a number in (0, 64], got 100.0"),
    ({"step": "2", "domain": "ordinal"},
     "Quantizer step (dithered, ordinal domain) must be a number in (0, 64], got '2'"),
    ({"update_step": 0.0, "pred": "zero"}, "Quantizer update_step must be a positive number, got 0.0"),
    ({"rms_step": math.inf, "pred": "zero"}, "Quantizer rms_step must be a positive number, got inf"),
    ({"rms_step": 2.8}, "Quantizer rms_step= needs the linear domain and pred='zero'"),
    ({"overrides": {"model/*": 0.5}}, "overrides['model/*'] must be a Quantizer, got 0.5"),
    ({"overrides": {3: EXACT}}, "an overrides pattern must be a string, got 3"),
])
def test_dependent_bad_values(kwargs: dict[str, Any], message: str) -> None:
    """Values whose range depends on another argument, and the entries of ``overrides``."""
    build = CompressionConfig if "overrides" in kwargs else Quantizer
    with pytest.raises(ConfigError, match=re.escape(message) + "$"):
        build(**kwargs)


def test_target_ratio_is_worded_the_same_for_a_string_and_a_number() -> None:
    """A target_ratio of the wrong type and one out of range are the same mistake."""
    messages = []
    for value in ("8", 0.5):
        with pytest.raises(ConfigError) as info:
            CompressionConfig(target_ratio=value)  # type: ignore[arg-type]
        messages.append(str(info.value))
    assert messages == ["target_ratio must be a number above 1, got '8'",
                        "target_ratio must be a number above 1, got 0.5"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"deltas": False, "target_ratio": 50}, "target_ratio applies to delta steps, and this config "
     "has none (deltas=False, as the 'lossless' preset)"),
    ({"deltas": False, "max_error": 40}, "max_error applies to delta steps"),
    ({"max_error": 40}, "max_error (40) caps how far target_ratio scales the errors; without a "
     "target_ratio it does nothing"),
    ({"target_ratio": 50, "max_error": 40, "weights": EXACT}, "max_error (40) is in steps' worth "
     "of a weight's movement, the unit of weights.move_step, and these weights have none"),
    ({"target_ratio": 50, "max_error": 40, "weights": Quantizer(step=1.0)}, "these weights have none"),
])
def test_a_target_that_cannot_act_is_refused(kwargs: dict[str, Any], message: str) -> None:
    """``target_ratio`` and ``max_error`` that would be silently ignored: on a config without
    deltas (the lossless preset), ``max_error`` with nothing to cap or without its unit; also
    when a preset is adjusted, as the manual does it, before any manager sees the config."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        CompressionConfig(**kwargs)
    preset = CompressionConfig.preset("lossless" if kwargs.get("deltas") is False else "balanced")
    with pytest.raises(ConfigError, match=re.escape(message)):
        replace(preset, **{k: v for k, v in kwargs.items() if k != "deltas"})


def test_retention_policy_strings_and_types() -> None:
    """The string form and a value that is neither a policy nor a string: ConfigError too."""
    for spec in ("", "last", "keep=5", "last=2,last=3", "last=0"):
        with pytest.raises(ConfigError, match=re.escape(repr(spec))):
            RetentionPolicy.parse(spec)
    with pytest.raises(ConfigError, match=r"entry 'last=0': last must be a positive integer, got '0'$"):
        RetentionPolicy.parse("last=0")
    with pytest.raises(ConfigError, match="RetentionPolicy or a string such as 'last=5,every=100', got int"):
        RetentionPolicy.parse(5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="set at least one of last, every and full_within"):
        RetentionPolicy()


def test_good_values_pass(tmp_path: Path) -> None:
    """The edges of every range are accepted."""
    assert check_int(1, "x") == 1 and check_int(0, "x", least=0) == 0
    assert check_int(1 << 20, "x", least=64, most=1 << 20) == 1 << 20
    assert check_number(1.0, "x", above=0, most=1) == 1.0
    CompressionConfig(target_ratio=1.01, max_error=1e-9, block=64)
    CompressionConfig(block=1 << 20, deltas=False, overrides={"model/*": EXACT})
    Quantizer(step=64.0, domain="ordinal")
    Quantizer(step=100.0, domain="ordinal", dither=False)
    Quantizer(step=None, density=1.0)
    Quantizer(step="ignored", exact=True)  # type: ignore[arg-type]  # an exact class has no step
    RetentionPolicy(last=1, every=1, full_within=1)
    with CheckpointManager(tmp_path / "ckpt", full_every=1, chunk_bytes=1024, workers=1, cache_keep=0,
                           max_in_flight=1, blocking=False, reconstruction="host",
                           compression="lossless", keep="last=1") as mgr:
        assert mgr.full_every == 1 and mgr.keep == RetentionPolicy(last=1)
