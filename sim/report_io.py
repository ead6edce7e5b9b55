"""Writing reports: the output-path check and the JSON/text emitter that the ``kvrace`` command
line (``kvrace/cli.py``) and the GPU backend's commands (``gpu_backend.replay.cli_replay``,
``gpu_backend.calibrate.cli_calibrate``) share.  Errors are ``InputError`` (exit 2)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from sim.errors import InputError


def check_output_path(path: str | None, option: str, made: tuple = ()) -> None:
    """Refuse an output path that cannot be written, before any work is done ('-' is stdout).
    ``made``: folders the same command makes before it writes ``path`` (each checked by
    ``check_output_dir``; None entries are ignored): a path directly inside one is accepted."""
    if path is None or path == "-":
        return
    if os.path.isdir(path):
        raise InputError(option, f"{path!r} is a directory; give a file path (or '-' for stdout)")
    parent = os.path.dirname(path) or "."
    if not os.path.exists(parent) and os.path.abspath(parent) in {os.path.abspath(m) for m in made if m}:
        return
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise InputError(option, f"cannot write {path!r}: {parent!r} is a file; expected a folder path")
    if not os.path.isdir(parent):
        raise InputError(option, f"cannot write {path!r}: directory {parent!r} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise InputError(option, f"cannot write {path!r}: permission denied")


def check_output_dir(path: str | None, option: str) -> None:
    """Refuse a folder path that cannot be made (with its parents) or written, before any work
    is done.  The folder itself is made by whoever writes into it."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(option, f"{path!r} is a file; expected a folder (made if missing)")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(option, f"cannot make {path!r}: {existing!r} is a file; expected a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(option, f"cannot write into {path!r}: permission denied on {existing!r}")


def write_json(doc, path: str, default=None) -> None:
    """JSON to ``path``, or to stdout when ``path`` is '-'."""
    text = json.dumps(doc, indent=1, default=default)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def emit(rep: dict, json_path: str | None, text, default=None) -> None:
    """Write a report: JSON to ``json_path`` ('-' = stdout only) and the human text
    to stdout unless the JSON went there."""
    if json_path:
        write_json(rep, json_path, default)
    if json_path != "-":
        print(text(rep))


def regenerate(doc: dict | str, path: Path, script: str, check: bool) -> int:
    """Write a generated schedule ``doc`` to ``path`` (sorted keys, one-space indent; a str, such
    as a profile written beside the schedules, as it is), or with ``check`` only say whether the
    committed file is what ``script`` makes today (0 yes, 1 no): how the generated files under
    ``examples/`` stay current."""
    text = doc if isinstance(doc, str) else json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date: run python {script}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}" + ("" if isinstance(doc, str) else f" ({len(doc['ops'])} ops)"))
    return 0
