"""The one error type for bad input: it names the key and what was expected."""
from __future__ import annotations

SHOW_LIMIT = 80     # characters of an echoed value in an error message


def show(value, limit: int = SHOW_LIMIT) -> str:
    """``repr(value)`` cut to at most ``limit`` characters (a cut text ends with
    '... (N chars)', N being the length of the whole repr).  Every error message
    that echoes user input uses this, so a huge value never makes a huge message."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):          # deeply nested or an int too long to print
        text = f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


class InputError(ValueError):
    """Bad user input (a scenario, schedule, layout or argument).

    ``where`` is the path to the offending key ("ops[3].args.src_indices"),
    ``message`` what was wrong and what was expected.  ``str()`` gives both.
    ``args`` is ``(where, message)``, so code that re-creates an exception from
    its args (SimPy re-raising a process's exception, pickling) gets an equal one;
    ``InputError(text)`` alone is a message with an empty ``where``.
    """

    def __init__(self, where: str, message: str | None = None):
        if message is None:
            where, message = "", where
        self.where = where
        self.message = message
        super().__init__(where, message)

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message

    def __reduce__(self):          # picklable across process pools
        return (InputError, (self.where, self.message))


def require(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise InputError(where, message)
