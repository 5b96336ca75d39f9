"""A helper for the ranks of multi-process tests: what each call raised, as picklable strings."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def raised(calls: Iterable[Callable[[], object]], error: type[Exception] = ValueError) -> list[str | None]:
    """For each call, the message of the ``error`` it raised, or None when it returned (other errors propagate)."""
    messages = []
    for call in calls:
        try:
            call()
            messages.append(None)
        except error as exc:
            messages.append(str(exc))
    return messages
