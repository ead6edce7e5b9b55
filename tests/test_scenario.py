"""Scenarios: presets, overrides with dotted keys, validation errors that name the key, round trips."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from sim.engine.scenario import (SECTIONS, Scenario, apply_overrides, load_scenario, scenario_from_dict,
                                 shipped_scenarios)
from sim.engine.workload import Workload
from sim.errors import InputError

ROOT = Path(__file__).parents[1]


def test_presets_are_shipped_and_match_the_incident():
    assert {"incident", "incident-short", "glm5-22811"} <= set(shipped_scenarios())
    s = load_scenario("incident")
    assert (s.model.family, s.model.index_k_dtype) == ("deepseek-v4-flash", "bf16")
    assert (s.deployment.mode, s.deployment.gpus, s.deployment.prefill_tp, s.deployment.decode_tp,
            s.deployment.profile) == ("pd", 8, 4, 4, "rtx-pro-6000")
    h = s.hicache
    assert (h.page_size, h.ratio, h.io_backend, h.layout) == (256, 2.0, "kernel", "page_first")
    assert s.workload.concurrency == 60 and s.workload.max_context_tokens >= 80_000
    assert 1_500 <= s.workload.first_turn_tokens <= 2_500
    g = load_scenario("glm5-22811")
    assert (g.model.family, g.hicache.page_size, g.variant.gate_map) == ("dsa-v3.2", 64, "upstream-0.5.10")
    assert g.configuration().gate_map.ungated()           # the 0.5.10 gap is there


def test_short_preset_inherits_the_incident_and_is_smaller():
    full, short = load_scenario("incident"), load_scenario("incident-short")
    assert short.name == "incident-short"
    assert (short.model, short.deployment, short.hicache, short.variant) == \
        (full.model, full.deployment, full.hicache, full.variant)
    assert short.workload.concurrency < full.workload.concurrency
    assert short.workload.max_context_tokens < full.workload.max_context_tokens
    assert short.run.duration_s < full.run.duration_s
    assert short.workload.sessions > 0
    # its contexts still overflow its device pool, so load-backs can happen
    assert short.workload.concurrency * short.workload.max_context_tokens > short.scheduler.max_total_tokens


def test_configuration_applies_the_fence_and_hypotheses():
    c = load_scenario("incident", ["hicache.load_fence=false"]).configuration()
    assert c.load_fence_stream == "schedule"
    c = load_scenario("incident", ["variant.hypotheses=ungated-index-k-bf16,index-k-c4-token-copy"]).configuration()
    assert not c.gate_map.is_gated("get_index_k_bf16_buffer")
    assert c.index_k_partial_pages == "dsv4_token"
    assert c.hypotheses == ("ungated-index-k-bf16", "index-k-c4-token-copy")
    assert c.options["index_k_dtype"] == "bf16"


@pytest.mark.parametrize("item,attr,value", [
    ("hicache.ratio=3", ("hicache", "ratio"), 3.0),
    ("workload.concurrency=1", ("workload", "concurrency"), 1),
    ("workload.concurrency=1_000", ("workload", "concurrency"), 1000),
    ("hicache.decode=no", ("hicache", "decode"), False),
    ("run.one_step=off", ("run", "one_step"), False),
    ("run.duration_s=1e-3", ("run", "duration_s"), 0.001),
    ("model.index_k_dtype=fp8", ("model", "index_k_dtype"), "fp8"),
    ("variant.hypotheses=", ("variant", "hypotheses"), ()),
    ("variant.hypotheses= load-unfenced , none", ("variant", "hypotheses"), ("load-unfenced", "none")),
    ("description=a b=c", ("description",), "a b=c"),
])
def test_overrides_are_parsed_by_type(item, attr, value):
    s = load_scenario("incident", [item])
    got = s
    for a in attr:
        got = getattr(got, a)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("item,where,match", [
    ("nosection.x=1", "nosection.x", "unknown section"),
    ("hicache.nokey=1", "hicache.nokey", "unknown key"),
    ("hicache", "--set", "key=value"),
    ("hicache.ratio=abc", "hicache.ratio", "number >= 1.0"),
    ("hicache.ratio=0.5", "hicache.ratio", ">= 1.0"),
    ("hicache.ratio=nan", "hicache.ratio", "finite"),
    ("hicache.ratio=inf", "hicache.ratio", "finite"),
    ("workload.concurrency=0", "workload.concurrency", ">= 1"),
    ("workload.concurrency=2.5", "workload.concurrency", "integer"),
    ("hicache.prefill=maybe", "hicache.prefill", "true or false"),
    ("hicache.layout=page_head", "hicache.layout", "one of"),
    ("hicache.io_backend=kernel_ascend", "hicache.io_backend", "one of"),
    ("hicache.page_size=64", "hicache.page_size", "256 for model deepseek-v4-flash"),
    ("model.family=llama", "model.family", "one of"),
    ("variant.gate_map=upstream-0.4", "variant.gate_map", "gate map"),
    ("variant.gate_map=upstream-0.5.10", "variant.gate_map", "does not list accessor"),
    ("variant.hypotheses=none,ghost", "variant.hypotheses", "ghost"),
    ("deployment.profile=tpu-v9", "deployment.profile", "profile"),
    ("deployment.prefill_tp=3", "deployment.prefill_tp", "divide"),
    ("deployment.gpus=12", "deployment.prefill_tp", "divide gpus"),
    ("deployment.mode=colocated", "hicache.decode", "colocated"),
    ("scheduler.max_total_tokens=1000", "scheduler.max_total_tokens", "multiple of page_size"),
    ("scheduler.chunked_prefill_size=0", "scheduler.chunked_prefill_size", "-1"),
    ("scheduler.chunked_prefill_size=-2", "scheduler.chunked_prefill_size", ">= -1"),
    ("run.duration_s=0", "run.duration_s", "> 0"),
    ("run.seed=-1", "run.seed", ">= 0"),
    ("workload.kind=trace", "workload.trace", "JSONL"),
    ("workload.first_turn_tokens=2", "workload.first_turn_tokens", "session tag"),
])
def test_bad_overrides_name_the_key(item, where, match):
    with pytest.raises(InputError, match=match) as e:
        load_scenario("incident", [item])
    assert e.value.where == where


def test_impossible_geometry_and_model_mismatches():
    with pytest.raises(InputError) as e:
        load_scenario("glm5-22811", ["model.index_k_dtype=bf16"])
    assert e.value.where == "model.index_k_dtype"
    with pytest.raises(InputError) as e:
        load_scenario("glm5-22811", ["deployment.decode_tp=4"])
    assert e.value.where == "deployment.decode_tp"
    with pytest.raises(InputError, match="set deployment.decode_tp = 2 with deployment.prefill_tp") as e:
        load_scenario("glm5-22811", ["deployment.prefill_tp=2"])      # colocated: says what to set
    with pytest.raises(InputError) as e:      # 128 heads: TP 16 is fine for heads, not for 8 GPUs
        load_scenario("glm5-22811", ["deployment.prefill_tp=16", "deployment.decode_tp=16"])
    assert e.value.where == "deployment.prefill_tp"
    with pytest.raises(InputError, match="heads") as e:
        load_scenario("incident", ["deployment.gpus=264", "deployment.prefill_tp=128"])
    assert e.value.where == "deployment.prefill_tp"
    # a geometry that works: 2 PD pairs of TP2 + TP2
    s = load_scenario("incident", ["deployment.prefill_tp=2", "deployment.decode_tp=2"])
    assert s.deployment.engines() == "PD prefill TP2 / decode TP2 x 2"


@pytest.mark.parametrize("doc,where", [
    ({"nosection": {}}, "scenario.nosection"),
    ({"hicache": {"bogus": 1}}, "hicache.bogus"),
    ({"hicache": {"ratio": "2"}}, "hicache.ratio"),
    ({"hicache": {"ratio": True}}, "hicache.ratio"),
    ({"hicache": 3}, "hicache"),
    ({"workload": {"concurrency": 1.0}}, "workload.concurrency"),
    ({"variant": {"hypotheses": "none"}}, "variant.hypotheses"),
    ({"name": 3}, "name"),
])
def test_bad_documents_name_the_key(doc, where):
    with pytest.raises(InputError) as e:
        scenario_from_dict(doc)
    assert e.value.where == where


def test_round_trip_and_digest():
    for name in shipped_scenarios():
        s = load_scenario(name)
        back = scenario_from_dict(tomllib.loads(s.to_toml()))
        assert back == s and back.digest() == s.digest()
        assert scenario_from_dict(json.loads(json.dumps(s.to_dict()))) == s
    a, b = load_scenario("incident"), load_scenario("incident", ["hicache.ratio=2.0"])
    assert a.digest() == b.digest()
    assert load_scenario("incident", ["hicache.ratio=3"]).digest() != a.digest()
    assert len({load_scenario(n).digest() for n in shipped_scenarios()}) == len(shipped_scenarios())


def test_round_trip_of_strings_toml_needs_escaped():
    """Quotes, backslashes, control characters, DEL and characters beyond the BMP (which ASCII
    JSON would write as a surrogate pair TOML refuses) survive to_toml -> TOML -> scenario."""
    text = 'say "hi" \\ tab\there\nnew \x01 del\x7f é 😀'
    s = load_scenario("glm5-22811-small", [f"description={text}"])
    back = scenario_from_dict(tomllib.loads(s.to_toml()))
    assert back.description == text and back == s
    with pytest.raises(InputError, match="surrogate"):
        load_scenario("glm5-22811-small", ["description=bad \ud800"]).to_toml()


def test_digest_is_stable_across_processes():
    code = "from sim.engine.scenario import load_scenario; print(load_scenario('incident').digest())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONHASHSEED": "7", "PATH": ""})
    assert out.stdout.strip() == load_scenario("incident").digest()


def test_scenario_file_with_a_base_and_a_relative_trace(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"session": 1, "turn": 0, "input_tokens": 1100,
                                                  "output_tokens": 20}) + "\n")
    (tmp_path / "mine.toml").write_text('base = "incident"\n[workload]\nkind = "trace"\ntrace = "t.jsonl"\n'
                                        'concurrency = 1\n')
    s = load_scenario(str(tmp_path / "mine.toml"))
    assert s.name == "mine" and s.workload.trace == str(tmp_path / "t.jsonl")
    assert s.hicache.page_size == 256                     # from the base
    d1 = s.digest()
    (tmp_path / "t.jsonl").write_text(json.dumps({"session": 1, "turn": 0, "input_tokens": 1101,
                                                  "output_tokens": 20}) + "\n")
    assert s.digest() != d1                               # the trace's bytes are part of it
    reqs = s.make_workload().simulate(lambda r: 10)
    assert [(r.input_len, r.output_len) for r in reqs] == [(1101, 20)]


def test_bad_files(tmp_path):
    with pytest.raises(InputError, match="no scenario file"):
        load_scenario("no-such-preset")
    p = tmp_path / "bad.toml"
    p.write_text("[hicache\n")
    with pytest.raises(InputError, match="TOML"):
        load_scenario(str(p))
    p.write_text('base = "nope"\n')
    with pytest.raises(InputError) as e:
        load_scenario(str(p))
    assert e.value.where == "base"
    p.write_text('[workload]\nkind = "trace"\ntrace = "missing.jsonl"\n')
    with pytest.raises(InputError, match="no trace file"):
        load_scenario(str(p))


def test_sections_document_every_field():
    import dataclasses
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc") is not None, (name, f.name)
        cls.from_dict({})                                 # defaults are valid on their own


def test_overrides_do_not_mutate_the_document():
    doc = {"hicache": {"ratio": 2.0}}
    out = apply_overrides(doc, ["hicache.ratio=4"])
    assert doc == {"hicache": {"ratio": 2.0}} and out["hicache"]["ratio"] == 4.0


def test_scenario_workload_is_the_incident_shape():
    s = load_scenario("incident-short")
    w = s.make_workload()
    assert isinstance(w, Workload) and w.seed == s.run.seed
    reqs = w.simulate(lambda r: 1000)
    assert len({r.session for r in reqs}) == s.workload.sessions
    assert isinstance(s, Scenario)


# ---------------------------------------------------------------- kvrace scenarios

def test_cli_lists_presets_one_line_each(capsys, tmp_path):
    from kvrace.cli import main

    assert main(["scenarios"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(shipped_scenarios())
    inc = next(line for line in lines if line.startswith("incident "))
    assert "deepseek-v4-flash, 8 x rtx-pro-6000, PD prefill TP4 / decode TP4" in inc
    out = tmp_path / "s.json"
    assert main(["scenarios", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [d["name"] for d in doc] == shipped_scenarios()
    assert all(scenario_from_dict(d["scenario"]).digest() == d["digest"] for d in doc)
    capsys.readouterr()
    assert main(["scenarios", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == doc
    assert main(["scenarios", "--json", str(tmp_path / "no" / "x.json")]) == 2


def test_docs_name_every_key_and_preset():
    import dataclasses
    text = (ROOT / "docs" / "scenarios.md").read_text()
    for name, cls in SECTIONS.items():
        assert f"### `[{name}]`" in text
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, (name, f.name)
    for preset in shipped_scenarios():
        assert f"`{preset}`" in text


def test_digest_covers_a_gate_map_file(tmp_path):
    gm = tmp_path / "gm.toml"
    gm.write_text('name = "mine"\nbase = "incident-fork"\n[gated]\nget_index_k_bf16_buffer = false\n')
    s = load_scenario("incident", [f"variant.gate_map={gm}"])
    assert not s.configuration().gate_map.is_gated("get_index_k_bf16_buffer")
    d1 = s.digest()
    gm.write_text('name = "mine"\nbase = "incident-fork"\n[gated]\nget_index_k_bf16_buffer = true\n')
    assert s.digest() != d1
    with pytest.raises(InputError) as e:
        load_scenario(42)
    assert e.value.where == "scenario"


@pytest.mark.parametrize("preset,override,key", [
    ("glm5-22811-small", "hicache.ratio=1e12", "hicache.ratio"),
    ("glm5-22811-small", "hicache.ratio=1e300", "hicache.ratio"),
    ("incident-repro", "hicache.ratio=1e12", "hicache.ratio"),          # DeepSeek V4's host pages
    ("glm5-22811-small", "hicache.size_gb=2147483648", "hicache.size_gb"),
    ("glm5-22811-small", "scheduler.max_total_tokens=2147483648", "scheduler.max_total_tokens"),
])
def test_pools_past_any_deployment_are_refused_naming_the_key(preset, override, key):
    """A pool of billions of tokens is refused at the key that sized it (MAX_DEVICE_POOL_TOKENS,
    MAX_HOST_POOL_TOKENS), before an array of that length is made: these gave a numpy
    allocation traceback, or an error naming an internal layout (a boundary sweep of every
    numeric key found them)."""
    from sim.engine.engine import PrefillEngine

    with pytest.raises(InputError, match=key.replace(".", r"\.")):
        PrefillEngine(load_scenario(preset, ["run.layers=3", override]), 0, keep="report")
