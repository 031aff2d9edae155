"""The type checks the library's arguments share: counts are ints and rates
are numbers, but ``bool`` is an ``int`` subclass and ``True`` is neither
(``CPUBackend(True, True)`` was one block of one token); and how a message
quotes a bad value or describes an exception."""

from __future__ import annotations

import math
from typing import TypeGuard

from kvoffload.errors import ConfigError

__all__ = ["abridged", "check_int", "described", "is_finite_number", "is_int", "is_number"]


def is_int(value: object) -> TypeGuard[int]:
    """An ``int``, not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int) -> int:
    """``value``, an int (not a bool) of at least ``minimum``; else
    :class:`~kvoffload.errors.ConfigError` ``NAME must be an int >= MINIMUM``."""
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def is_number(value: object) -> TypeGuard[int | float]:
    """An ``int`` or a ``float``, not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """A number (:func:`is_number`) that is finite as a float: not ``nan``,
    not ``inf``, not an integer past any float."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def abridged(text: str, keep: int = 40) -> str:
    """``text`` quoted, its middle cut out when longer than ``keep`` characters
    (a 5000-digit argument is not repeated in full)."""
    if len(text) <= keep:
        return repr(text)
    return f"{text[: keep // 2]!r}...{text[-keep // 2 :]!r} ({len(text)} characters)"


def described(exc: BaseException) -> str:
    """``Type: message``, or ``Type`` alone for an exception with no message."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
