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


def test_profile_engine_warm_profiles_only_the_stretch_after_it(capsys, monkeypatch):
    """benchmarks/profile_engine.py --warm (BENCHMARKS.md's twenty-fourth session cites it): the
    stats cover the batches after the warm-up, not the warm-up's."""
    import pstats

    from benchmarks import profile_engine
    seen = {}
    real = pstats.Stats

    def keep(prof, *args):
        seen["stats"] = real(prof, *args)
        return seen["stats"]

    monkeypatch.setattr(profile_engine.pstats, "Stats", keep)
    assert profile_engine.main(["glm5-22811-small", "--set", "run.layers=2", "--duration", "0.09",
                                "--warm", "0.05", "--top", "1"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    warm_batches = int(head.split("unprofiled (")[1].split(" CPU s, ")[1].split(" batches")[0])
    total = int(head.split(" batches, ")[0].rsplit(" ", 1)[1])
    calls = {f[2]: v[1] for f, v in seen["stats"].stats.items() if f[0].endswith("engine.py")}
    assert 0 < warm_batches < total and calls["_run_batch"] == total - warm_batches
