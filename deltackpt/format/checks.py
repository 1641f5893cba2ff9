"""Checks of configuration values (the manager's arguments, compression configs, retention
policies), so that each kind of mistake is worded one way wherever it is made:

    <name> must be <what it must be>, got <the value's repr>

raised as :class:`~deltackpt.errors.ConfigError`. A wrong type and a value out of range are the
same mistake: ``full_every`` of ``0``, ``-1``, ``1.5``, ``"3"`` or ``True`` all give
``full_every must be a positive integer, got ...``. Booleans are never numbers here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from deltackpt.errors import ConfigError


def config_error(name: str, expected: str, value: object) -> ConfigError:
    """The error for ``name``'s ``value`` that is not ``expected`` (``"a Quantizer"``)."""
    return ConfigError(f"{name} must be {expected}, got {value!r}")


def _integer_text(least: int, most: int | None) -> str:
    if most is not None:
        return f"an integer in [{least}, {most}]"
    if least == 1:
        return "a positive integer"
    if least == 0:
        return "a non-negative integer"
    return f"an integer of at least {least}"


def _number_text(above: float, most: float | None) -> str:
    if most is not None:
        return f"a number in ({above:g}, {most:g}]"
    return "a positive number" if above == 0 else f"a number above {above:g}"


def check_int(value: object, name: str, *, least: int = 1, most: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) from ``least`` to ``most``; otherwise
    :class:`ConfigError`: ``<name> must be a positive integer, got <value>`` (``least`` 1, the
    default), ``... a non-negative integer ...`` (0), ``... an integer of at least <least>
    ...`` or ``... an integer in [<least>, <most>] ...``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least \
            or (most is not None and value > most):
        raise config_error(name, _integer_text(least, most), value)
    return value


def check_number(value: object, name: str, *, above: float = 0, least: float | None = None,
                 most: float | None = None) -> float:
    """``value`` if it is a finite ``int`` or ``float`` (not a ``bool``) above ``above`` (or at
    least ``least``, when given) and at most ``most``; otherwise :class:`ConfigError`: ``<name>
    must be a positive number, got <value>`` (``above`` 0, the default), ``... a number above
    <above> ...``, ``... a non-negative number ...`` (``least`` 0) or ``... a number in
    (<above>, <most>] ...``."""
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)
    if least is None:
        text, in_range = _number_text(above, most), finite and value > above
    else:
        text = "a non-negative number" if least == 0 else f"a number of at least {least:g}"
        in_range = finite and value >= least
    if not in_range or (most is not None and value > most):
        raise config_error(name, text, value)
    return value


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is a ``bool``; otherwise :class:`ConfigError`: ``<name> must be True or
    False, got <value>``."""
    if not isinstance(value, bool):
        raise config_error(name, "True or False", value)
    return value


def check_choice(value: object, name: str, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``; otherwise :class:`ConfigError`: ``<name> must be one
    of 'a', 'b', got <value>``."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise config_error(name, f"one of {', '.join(map(repr, choices))}", value)
    return value
