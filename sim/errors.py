"""kvrace's errors: ``KvraceError``, the one root every kvrace exception derives from, and
``InputError``, bad input that names the key and what was expected; plus the helpers that
build their messages (``show``, ``require``, ``check_keys``)."""
from __future__ import annotations

from typing import Iterable, Mapping

SHOW_LIMIT = 80     # characters of an echoed value in an error message
MAX_NAME_CHARS = 256  # a buffer, kind, stream, event, op, layout or field name


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


class KvraceError(Exception):
    """The root of every exception kvrace raises on purpose: bad input (``InputError``), a
    schedule that cannot be replayed (``sim.replay.ReplayError``), a GPU provider or the SGLang
    shim that cannot run (``gpu_backend``'s ``ProviderError``, ``ShimError``, ...).  Catch this
    one type to handle them all; each subclass also keeps its builtin base (``ValueError``,
    ``RuntimeError``, ``ImportError``), so existing ``except`` clauses still match."""


class InputError(KvraceError, ValueError):
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


def check_keys(d: Mapping, allowed: Iterable[str], where: str, required: Iterable[str] = (), *,
               context: str = "", missing: str = "key") -> None:
    """Refuse a mapping with a key outside ``allowed`` or without one of ``required``.

    The first unknown key (in ``d``'s order) is an InputError at ``where.KEY`` (the key echoed
    through ``show``, so a huge key never makes a huge message), then the first missing required
    key one at ``where.KEY``.  ``context`` is appended to the expectation (" for dsv4_token"),
    ``missing`` names what a required key is ("key", "argument")."""
    names = sorted(allowed) if isinstance(allowed, (set, frozenset)) else list(allowed)
    for k in d:
        if k not in names:
            key = show(k)
            if isinstance(k, str) and key[:1] in "'\"":     # the key without its quotes (a cut one ends in 'chars)')
                key = key[1:-1] if key[-1:] == key[:1] else key[1:]
            raise InputError(f"{where}.{key}", f"expected one of {names}{context}, got unknown key {show(k)}")
    for k in required:
        if k not in d:
            raise InputError(f"{where}.{k}", f"expected this {missing}{context}, got nothing (missing)")
