"""The waits between Register attempts while kubelet is not there."""

from __future__ import annotations

import itertools

from deviceplugin.resource import BACKOFF_MAX, BACKOFF_MIN, backoff


def test_backoff_doubles_up_to_the_cap() -> None:
    waits = list(itertools.islice(backoff(), 10))
    assert waits[0] == BACKOFF_MIN == 0.05
    assert waits[:8] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0]
    assert waits[7:] == [BACKOFF_MAX] * 3
