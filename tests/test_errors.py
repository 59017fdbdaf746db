"""The one exception tree's helpers: what a task group's failure surfaces as."""

from __future__ import annotations

import pytest

from shardsync.errors import CacheError, raise_first


def test_the_first_error_of_a_group_is_raised_with_its_own_cause() -> None:
    """A task group's ``CacheError`` raised from an ``OSError`` reaches the caller with that
    ``OSError`` as its cause (what a user debugging a full disk reads), ours before others."""
    disk = OSError(28, "No space left on device")
    try:
        raise CacheError("cannot write the partial file") from disk
    except CacheError as exc:
        ours = exc
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ValueError("other"), ours])
    with pytest.raises(CacheError) as caught:
        raise_first(group)
    assert caught.value is ours
    assert caught.value.__cause__ is disk
