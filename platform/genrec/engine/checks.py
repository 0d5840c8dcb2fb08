"""Checks of engine settings: a bad value is refused by name, never read as "use the default"."""

from __future__ import annotations

from genrec.errors import InvalidRequestError


def check_int(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidRequestError(name, f"must be an integer >= {least}, got {value!r}")
    return value


def check_seconds(name: str, value) -> float:
    """A positive duration (infinity: no limit). Zero is refused: nothing could ever finish in it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidRequestError(name, f"must be a positive number of seconds, got {value!r}")
    return value
