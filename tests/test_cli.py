"""The README's promises, run as a user would: the CLI on the shipped examples."""
import json
import subprocess
import sys

import pytest

from sim.cli import main


def kvrace(*args):
    p = subprocess.run([sys.executable, "-m", "sim.cli", *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def test_minimal_race_names_stale_bytes_and_their_owner():
    rc, out, err = kvrace("schedule", "run", "examples/index_k_ungated_race.json")
    assert rc == 0, err
    assert "corrupt: 1 (stale 1, torn 0)" in out
    assert "saw:      bytes 33792-33792: index_k layer 0 initial unit 4 v0" in out
    assert "expected: bytes 33792-33792: index_k layer 0 request 12 unit 0 v1" in out
    assert "LATENT RACE on dev_index_k layer 0" in out


def test_gated_twin_is_clean():
    rc, out, _ = kvrace("schedule", "run", "examples/index_k_gated.json", "--json", "-")
    rep = json.loads(out)
    assert rc == 0
    assert rep["reads_total"] == 1 and rep["corrupt_reads"] == 0 and rep["latent_races"] == []


def test_c4_example_reports_out_of_bounds_bytes():
    rc, out, _ = kvrace("schedule", "run", "examples/c4_routine_on_bf16_index_k.json", "--json", "-")
    rep = json.loads(out)
    assert rc == 0
    # Derived from the C4 constants: token t goes to page t//64 (37,440 B stride), value 576 B at
    # entry*576, scale 8 B at 36,864 + entry*8; the device buffer holds 300 x 256 = 76,800 B.
    expected = 0
    for t in range(300):
        base = (t // 64) * 37440
        for off, n in ((base + (t % 64) * 576, 576), (base + 36864 + (t % 64) * 8, 8)):
            expected += max(0, off + n - max(off, 76800))
    assert sum(o["bytes_outside"] for o in rep["oob_writes"]) == expected
    assert {o["would_hit"] for o in rep["oob_writes"]} == {"dev_neighbour"}
    assert rep["placement"][0]["items"] == 300
    assert rep["placement"][0]["items_placed_correctly"] < 300


def test_json_report_keys(tmp_path):
    path = tmp_path / "r.json"
    assert main(["schedule", "run", "examples/index_k_ungated_race.json", "--json", str(path)]) == 0
    rep = json.loads(path.read_text())
    for key in ("reads", "stale_reads", "torn_reads", "latent_races", "oob_writes"):
        assert key in rep
    assert rep["reads"][0]["provenance"][0]["origin"]["kind"] == "index_k"


def test_validate_and_bad_input_exit_2_with_named_key(tmp_path):
    rc, out, _ = kvrace("schedule", "validate", "examples/index_k_gated.json")
    assert rc == 0 and "valid kvrace schedule" in out
    doc = json.load(open("examples/index_k_gated.json"))
    doc["ops"][2]["dst"] = "dev_nowhere"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    rc, out, err = kvrace("schedule", "run", str(bad))
    assert rc == 2
    assert "ops[2] (load_index_k_L0).dst: unknown buffer 'dev_nowhere'" in err
    assert "Traceback" not in err


def test_profiles_listed():
    rc, out, _ = kvrace("profiles")
    assert rc == 0 and "h200" in out and "rtx-pro-6000: uncalibrated" in out


def test_readme_opens_with_exactly_two_commands_and_ci_runs_the_second():
    lines = open("README.md").read().splitlines()
    assert lines[0] == "```bash" and lines[3] == "```"
    assert "kvrace schedule run" in lines[1] and "pytest" in lines[2]
    ci = open(".ci/run").read()
    assert "sed -n '3p' README.md" in ci


@pytest.mark.parametrize("profile", ["h200", "rtx-pro-6000"])
def test_both_profiles_run(profile):
    assert main(["schedule", "run", "examples/index_k_ungated_race.json", "--profile", profile,
                 "--json", "-"]) == 0


def test_torn_example_shows_half_written_pages():
    rc, out, _ = kvrace("schedule", "run", "examples/index_k_torn_read.json", "--json", "-")
    rep = json.loads(out)
    assert rc == 0
    r = rep["reads"][0]
    assert r["status"] == "torn" and rep["torn_reads"] == 1
    prov = r["provenance"]
    assert len(prov) == 8                      # 4 pages, each new bytes then old bytes
    split = prov[0]["nbytes"]
    assert split % 256 == 0 and 0 < split < 8448   # whole 256 B warp steps landed
    for page in range(4):
        new, old = prov[2 * page], prov[2 * page + 1]
        assert new["origin"]["owner"] == 12 and new["first_unit"] == page and new["nbytes"] == split
        assert old["origin"]["owner"] == -1 and old["nbytes"] == 8448 - split
    assert r["bytes_differing"] == 4 * (8448 - split)
