"""The MT19937 twist: how a Mersenne Twister's 624-word state moves on.

torch's CPU generator, numpy's legacy ``RandomState`` and Python's ``random`` are all MT19937.
Each regenerates its whole state (the *twist*) every 624 32-bit draws, so between two saves of
a run its stored state has moved on a whole number of twists, and the state of one save is that
of an earlier one twisted k times. The ``patch`` codec stores that k instead of the 2.5 KB the
state would take again (docs/FORMAT.md, section 3.6).

The kernels take a 1-d ``uint32`` array of the 624 words, which may be a strided view: torch
keeps each word in the low half of a 64-bit slot. :func:`numpy_twist` is the executable spec
the tests compare them against.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from deltackpt.format.metadata import MT19937_WORDS as STATE_WORDS  # N: the words of the state

SHIFT = 397  # M: the word each new one takes its XOR from
_UPPER = np.uint32(0x80000000)
_LOWER = np.uint32(0x7FFFFFFF)
_MATRIX = np.uint32(0x9908B0DF)
_ONE = np.uint32(1)


@njit(cache=True, nogil=True)
def _twist_once(w: np.ndarray) -> None:
    for i in range(STATE_WORDS):
        y = (w[i] & _UPPER) | (w[(i + 1) % STATE_WORDS] & _LOWER)
        v = w[(i + SHIFT) % STATE_WORDS] ^ (y >> _ONE)
        if y & _ONE:
            v ^= _MATRIX
        w[i] = v


@njit(cache=True, nogil=True)
def twist(words: np.ndarray, times: int) -> None:
    """Twist the state ``words`` in place ``times`` times."""
    for _ in range(times):
        _twist_once(words)


@njit(cache=True, nogil=True)
def twists_between(bases: np.ndarray, words: np.ndarray, most: int) -> tuple[int, int]:
    """The first of the candidate states ``bases[c]`` (a ``(C, 624)`` array) that 1 to ``most``
    twists take to ``words[c]``, and the fewest twists that do: ``(c, k)``, or ``(-1, -1)``.
    The candidates are twisted in turn, so the search costs ``C`` times the twists found.
    ``bases`` is left twisted."""
    for k in range(1, most + 1):
        for c in range(bases.shape[0]):
            _twist_once(bases[c])
            same = True
            for i in range(STATE_WORDS):
                if bases[c, i] != words[c, i]:
                    same = False
                    break
            if same:
                return c, k
    return -1, -1


def numpy_twist(words: np.ndarray) -> np.ndarray:
    """Reference for one twist, returning the new state: the reference implementation's
    sequential loop (Matsumoto and Nishimura, 1998) in runs of words whose sources are all
    either replaced already or not yet."""
    w = words.astype(np.uint32)
    n, m = STATE_WORDS, SHIFT
    for lo, hi in ((0, n - m), (n - m, 2 * (n - m)), (2 * (n - m), n - 1), (n - 1, n)):
        i = np.arange(lo, hi)
        y = (w[i] & _UPPER) | (w[(i + 1) % n] & _LOWER)
        w[i] = w[(i + m) % n] ^ (y >> _ONE) ^ np.where(y & _ONE, _MATRIX, np.uint32(0))
    return w
