"""The one error type for bad input: it names the key and what was expected."""
from __future__ import annotations


class InputError(ValueError):
    """Bad user input (a scenario, schedule, layout or argument).

    ``where`` is the path to the offending key ("ops[3].args.src_indices"),
    ``message`` what was wrong and what was expected.  ``str()`` gives both.
    """

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)

    def __reduce__(self):          # picklable across process pools
        return (InputError, (self.where, self.message))


def require(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise InputError(where, message)
