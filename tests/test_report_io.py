"""Output paths are refused before any work, with the option named and what to give instead."""
from __future__ import annotations

import pytest

from sim.errors import InputError
from sim.report_io import check_output_dir, check_output_path


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return f


def test_output_file_paths(tmp_path, a_file):
    check_output_path(None, "--json")
    check_output_path("-", "--json")
    check_output_path(str(tmp_path / "new.json"), "--json")
    check_output_path(str(a_file), "--json")                     # overwritten
    for path, why in ((tmp_path, "is a directory; give a file path"),
                      (a_file / "x.json", "'" + str(a_file) + "' is a file; expected a folder path"),
                      (tmp_path / "missing" / "x.json", "does not exist; create it first")):
        with pytest.raises(InputError, match="--json") as e:
            check_output_path(str(path), "--json")
        assert why in str(e.value)


def test_output_folders(tmp_path, a_file):
    check_output_dir(None, "--out")
    check_output_dir(str(tmp_path), "--out")
    check_output_dir(str(tmp_path / "new" / "deeper"), "--out")  # made with its parents later
    for path, why in ((a_file, "is a file; expected a folder"),
                      (a_file / "below", "cannot make"),
                      (a_file / "below" / "deeper", "cannot make")):
        with pytest.raises(InputError, match="--out") as e:
            check_output_dir(str(path), "--out")
        assert why in str(e.value)


def test_output_file_in_a_folder_the_command_makes(tmp_path):
    """A file path inside a folder the same command makes first (``made``: ``--json D/run.json``
    beside ``--export-races D``) is accepted; a path one folder further down is not."""
    d = tmp_path / "races"
    check_output_path(str(d / "run.json"), "--json", made=(str(d),))
    check_output_path(str(d) + "/./run.json", "--json", made=(str(d) + "/",))
    with pytest.raises(InputError, match="--json") as e:
        check_output_path(str(d / "sub" / "run.json"), "--json", made=(str(d),))
    assert "does not exist; create it first" in str(e.value)
    with pytest.raises(InputError, match="--json"):
        check_output_path(str(d / "run.json"), "--json", made=(None,))
