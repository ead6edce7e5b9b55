"""What a benchmark's result file says a compared source tree is (benchmarks/provenance.py)."""
from benchmarks.provenance import ROOT, TREE_ORIGIN_FILE, git_commit, tree_origin


def test_a_tree_is_named_by_its_origin_file_else_the_checkout_commit(tmp_path):
    (tmp_path / TREE_ORIGIN_FILE).write_text("git archive 4d89f10\n")
    assert tree_origin(tmp_path) == "git archive 4d89f10"
    assert tree_origin(ROOT) == git_commit()
    assert tree_origin(tmp_path / "elsewhere") == "?"


def test_admission_timeline_prints_a_row_per_interval(capsys, monkeypatch):
    """benchmarks/admission_timeline.py (docs/engine.md "Head of line" cites it): a row per
    interval whose counts add up to the run's, and the engine's methods put back as they were
    only within its process (it patches the class: run it as a script)."""
    from benchmarks import admission_timeline
    from sim.engine import engine as E
    monkeypatch.setattr(E.PrefillEngine, "_admit", E.PrefillEngine._admit)
    monkeypatch.setattr(E.PrefillEngine, "_run_batch", E.PrefillEngine._run_batch)
    admission_timeline.main(["glm5-22811-small", "--set", "run.layers=2", "--duration", "1", "--every", "0.02"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) >= 3
    done = [int(r[2]) for r in rows]
    assert done == sorted(done) and done[-1] > 0
    assert all(int(r[9]) >= 0 and int(r[10]) >= 0 for r in rows)


def test_profile_late_profiles_only_the_late_stretch(tmp_path, monkeypatch, capsys):
    """benchmarks/profile_late.py (BENCHMARKS.md's twenty-fourth session cites it): the stats
    cover the profiled stretch's batches, not the warm-up's."""
    import pstats
    import sys

    from benchmarks import profile_late
    out = tmp_path / "late.prof"
    monkeypatch.setattr(sys, "argv", ["profile_late.py", "1", "1", "--out", str(out)])
    profile_late.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("warm cpu") and lines[1].startswith("profiled cpu")
    batches = int(lines[1].split("batches ")[1])
    calls = {f[2]: v[1] for f, v in pstats.Stats(str(out)).stats.items() if f[0].endswith("engine.py")}
    assert batches > 0 and calls["_run_batch"] == batches
