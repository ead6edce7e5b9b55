"""What a benchmark's result file says about where it came from: the commit, and whether the
tree had uncommitted changes (a result from a tree that is not a commit cannot be reproduced)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """``git rev-parse --short HEAD``, with ``+uncommitted`` when tracked files other than results
    differ from it; ``?`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        # NOTE: result files being written (benchmarks/results/, results/) are not the code
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!benchmarks/results", ":!results"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+uncommitted" if dirty else "")


def command() -> str:
    """The command line that is running, as typed from the repository root."""
    return "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(ROOT))
                                 if Path(sys.argv[0]).resolve().is_relative_to(ROOT) else sys.argv[0],
                                 *sys.argv[1:]])


#: a file a compared tree holds, naming where it came from (see tree_origin)
TREE_ORIGIN_FILE = "TREE_ORIGIN"


def tree_origin(tree) -> str:
    """What a source tree a benchmark compares is: its ``TREE_ORIGIN`` file's text, written when
    the tree is made (``git archive C | tar -x -C T && echo "git archive C" > T/TREE_ORIGIN``),
    else the commit of a git checkout (:func:`git_commit`'s form), else ``?``."""
    path = Path(tree)
    named = path / TREE_ORIGIN_FILE
    if named.is_file():
        return named.read_text().strip()
    if path.resolve() == ROOT:
        return git_commit()
    return "?"
