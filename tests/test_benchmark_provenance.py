"""What a benchmark's result file says a compared source tree is (benchmarks/provenance.py)."""
from benchmarks.provenance import ROOT, TREE_ORIGIN_FILE, git_commit, tree_origin


def test_a_tree_is_named_by_its_origin_file_else_the_checkout_commit(tmp_path):
    (tmp_path / TREE_ORIGIN_FILE).write_text("git archive 4d89f10\n")
    assert tree_origin(tmp_path) == "git archive 4d89f10"
    assert tree_origin(ROOT) == git_commit()
    assert tree_origin(tmp_path / "elsewhere") == "?"
