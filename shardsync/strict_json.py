"""The one JSON reader for bytes we did not write ourselves, or that a crash may have torn (pure).

Strict where ``json.loads`` is lenient: UTF-8 only, no duplicate keys at any depth (two
readers could pick different values), no ``NaN``/``Infinity``, no ``-0`` (an integer to
Python, a float to serde: safetensors refuses a header Python would read), bounded size and
nesting.
Callers turn ``StrictJSONError`` into their own error with context.
"""

from __future__ import annotations

import json

__all__ = ["StrictJSONError", "loads"]


class StrictJSONError(ValueError):
    """The bytes are not one strict JSON document."""


def _pairs(items: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in items:
        if key in result:
            raise StrictJSONError(f"duplicate JSON key {key!r}")
        result[key] = value
    return result


def _constant(name: str) -> object:
    raise StrictJSONError(f"{name} is not valid JSON")


def _integer(text: str) -> int:
    if text == "-0":
        raise StrictJSONError("-0 is an integer to some readers and a float to others")
    return int(text)


def loads(data: bytes | bytearray | memoryview | str, *, limit: int | None = None) -> object:
    """Parse ``data``; anything but a strict JSON document raises ``StrictJSONError``."""
    if limit is not None and len(data) > limit:
        raise StrictJSONError(f"{len(data)} bytes is over the {limit} byte limit")
    if isinstance(data, str):
        text = data
    else:
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise StrictJSONError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        return json.loads(
            text, object_pairs_hook=_pairs, parse_constant=_constant, parse_int=_integer
        )
    except StrictJSONError:
        raise
    except json.JSONDecodeError as exc:
        raise StrictJSONError(f"not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise StrictJSONError("JSON nested too deeply") from exc
    except ValueError as exc:  # e.g. an integer literal over Python's digit limit
        raise StrictJSONError(f"not usable JSON: {exc}") from exc
