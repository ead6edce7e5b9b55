"""Argument types shared by the `kvrace` commands (one home: every command's errors read alike)."""
from __future__ import annotations

import argparse

__all__ = ["int_at_least"]


def int_at_least(minimum: int):
    """An argparse ``type`` for a whole number >= ``minimum``; anything else is a usage error
    (exit 2) that says what was expected."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {v}")
        return v
    return parse
