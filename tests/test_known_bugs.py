"""examples/bugs/: real ordering bugs (docs/bugs.md) before and after their fixes.

Each pair is what examples/make_bug_examples.py writes today. With the bug, exactly the named
op pairs race, and exactly the named reads are stale or torn on the default profile (on the
others, a non-empty part of the reads at risk); the fix only adds ops (the bug's ops are the
fixed file's, in order, with the additions taken out) and leaves no race, no differing read
and no unbound wait on any profile. Races do not depend on timing, so they are checked on one
profile; which reads go stale does, so those are checked on every shipped profile.
"""
import glob
from pathlib import Path

import pytest

from sim import analyse, load, load_profile, run_schedule
from tests.helpers import example_script

ROOT = Path(__file__).resolve().parent.parent
MOD = example_script("make_bug_examples")
PROFILES = sorted(Path(p).stem for p in glob.glob(str(ROOT / "sim" / "profiles" / "*.toml")))


def report(slug: str, profile: str = "h200") -> dict:
    s = load(str(ROOT / "examples" / "bugs" / f"{slug}.json"))
    return analyse(run_schedule(s, load_profile(profile)), race_limit=None)


def differing(rep: dict) -> set[str]:
    return {r["op"] for r in rep["reads"] if r["status"] != "ok"}


def race_pairs(rep: dict) -> set[tuple[str, str]]:
    return {tuple(r["ops"]) for r in rep["latent_races"]}


def test_committed_files_are_what_the_script_makes():
    assert MOD.main(["--check"]) == 0, "run: python examples/make_bug_examples.py"
    on_disk = {Path(p).name for p in glob.glob(str(ROOT / "examples" / "bugs" / "*"))}
    assert on_disk == {p.name for p in MOD.files()}, "a file in examples/bugs/ no bug makes"


@pytest.mark.parametrize("bug", MOD.BUGS, ids=lambda b: b.slug)
def test_the_bug_races_and_the_fix_orders_it(bug):
    rep = report(bug.slug)
    assert race_pairs(rep) == set(bug.races)
    assert differing(rep) == set(bug.stale)
    fixed = report(f"{bug.slug}_fixed")
    assert fixed["latent_races_total"] == 0 and not differing(fixed) and not fixed["unbound_waits"]
    assert fixed["reads_total"] == rep["reads_total"] > 0


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("bug", MOD.BUGS, ids=lambda b: b.slug)
def test_the_stale_reads_on_every_profile(bug, profile):
    got = differing(report(bug.slug, profile))
    assert got and got <= set(bug.at_risk or bug.stale)
    assert not differing(report(f"{bug.slug}_fixed", profile))


@pytest.mark.parametrize("bug", MOD.BUGS, ids=lambda b: b.slug)
def test_the_fix_only_adds_ops(bug):
    before, after = bug.build(False), bug.build(True)
    assert {k: v for k, v in before.items() if k not in ("name", "description", "ops")} == \
        {k: v for k, v in after.items() if k not in ("name", "description", "ops")}
    added = iter(after["ops"])
    for op in before["ops"]:           # an ordered subsequence, every op unchanged
        assert op in added, f"{bug.slug}: {op.get('id')} changed or moved by the fix"
    assert len(after["ops"]) > len(before["ops"])


@pytest.mark.parametrize("stall", MOD.STALLS, ids=lambda b: b.slug)
def test_the_stall_shows_when_the_link_serves_copies_in_issue_order(stall):
    """The burst's copies are ``load_L*``. With the link serving copies in issue order the
    bug's delayed op waits for the whole burst and the fix's for none of it past the first
    copy; with the default first-come link the bug costs at most the one copy in flight.
    Nothing races and no read differs, either way."""
    def run(slug, profile):
        rep = report(slug, profile)
        assert rep["latent_races_total"] == 0 and not differing(rep) and not rep["unbound_waits"]
        t = rep["timings_us"]
        burst = sorted(v for k, v in t.items() if k.startswith("load_L"))
        return t[stall.delayed][0], burst

    submission = str(MOD.SUBMISSION_PROFILE)
    start, burst = run(stall.slug, submission)
    assert start >= burst[-1][1]                       # behind the whole burst
    start, burst = run(f"{stall.slug}_fixed", submission)
    assert start < burst[1][1]
    start, burst = run(stall.slug, "h200")
    assert start < burst[1][1]                         # first come, first served: one copy at most


def test_each_bug_is_in_the_catalogue_and_named_in_its_files():
    text = (ROOT / "docs" / "bugs.md").read_text()
    for bug in MOD.BUGS + MOD.STALLS:
        assert f"examples/bugs/{bug.slug}.json" in text and bug.reference in text.lower()
        number = bug.reference.split()[1]
        assert all(number in bug.build(fixed)["description"] for fixed in (False, True))


@pytest.mark.parametrize("bug", MOD.BUGS, ids=lambda b: b.slug)
def test_kvrace_mutate_finds_every_op_of_the_fix_necessary(bug):
    """``kvrace mutate`` on a fixed file: removing any one op the fix added (a record, a wait,
    a sync) opens a latent race again, so the mutant is detected: no op of a fix is idle."""
    from sim.explore.mutate import mutate_schedule

    before_ids = {op["id"] for op in bug.build(False)["ops"]}
    added = {op["id"] for op in bug.build(True)["ops"]} - before_ids
    rep = mutate_schedule(load(str(ROOT / "examples" / "bugs" / f"{bug.slug}_fixed.json")), trials=0,
                          max_orders=2000)
    by_removed = {r: m for m in rep.mutants for r in m.removed}
    assert added and added <= set(by_removed)
    for op_id in added:
        m = by_removed[op_id]
        assert m.latent_race and m.status == "detected", (op_id, m.status)
