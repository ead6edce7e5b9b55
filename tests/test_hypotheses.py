"""Hypotheses: named switches that change the configuration (never the measurement)."""
from __future__ import annotations

import dataclasses

import pytest

import sim.engine.hypotheses as H
from sim.engine.gates import gate_map
from sim.engine.hypotheses import (CONTROLLER_KEYS, Configuration, Hypothesis, apply_hypotheses, configuration,
                                   configuration_from_dict, hypothesis, hypothesis_names, register)
from sim.errors import InputError
from tests.test_forward import issue_only, position

SHIPPED = ["host-freed-during-load", "index-k-c4-token-copy", "index-k-not-backed-up", "index-k-stride-mismatch",
           "load-unfenced", "none", "ungated-index-k", "ungated-index-k-bf16"]


def test_shipped_names():
    assert set(SHIPPED) <= set(hypothesis_names())


def test_defaults_are_the_no_bug_baseline():
    c = configuration()
    assert c.model == "deepseek-v4-flash" and c.gate_map == gate_map("incident-fork")
    assert c.gate_map.ungated() == ()
    assert (c.index_k_partial_pages, c.index_k_host_bytes_per_entry, c.load_fence_stream,
            c.host_lock_during_load) == ("page_aligned", 0, "forward", True)
    assert c.backup_pools == frozenset({"swa", "c4", "index_k", "c128"})
    assert hypothesis("none").apply(c) == dataclasses.replace(c, hypotheses=("none",))


@pytest.mark.parametrize("name,field,value", [
    ("index-k-c4-token-copy", "index_k_partial_pages", "dsv4_token"),
    ("index-k-stride-mismatch", "index_k_host_bytes_per_entry", 132),
    ("load-unfenced", "load_fence_stream", "schedule"),
    ("host-freed-during-load", "host_lock_during_load", False),
    ("index-k-not-backed-up", "backup_pools", ["c128", "c4", "swa"]),
])
def test_controller_switches_set_exactly_their_key(name, field, value):
    c = configuration(options={"index_k_dtype": "bf16"})
    out = hypothesis(name).apply(c)
    before, after = c.to_dict(), out.to_dict()
    assert after[field] == value
    assert [k for k in before if before[k] != after[k]] == [field, "hypotheses"]
    assert out.hypotheses == (name,)


def test_ungated_index_k_ungates_every_index_k_accessor_and_nothing_else():
    c = configuration("dsa-v3.2", "upstream-0.5.11")
    out = hypothesis("ungated-index-k").apply(c)
    assert out.gate_map.ungated() == ("get_index_k_continuous", "get_index_k_scale_buffer",
                                      "get_index_k_scale_continuous", "get_index_k_with_scale_buffer")
    assert out.gate_map.name == "upstream-0.5.11+ungated-index-k"
    # and the forward model honours it: the top-k read now precedes the layer's wait
    issue, _ = issue_only("dsa-v3.2", "", "extend", 0, gate=out.gate_map, options={"index_k_store": "fused"})
    assert all(position(issue, "read", L, "index_k") < position(issue, "wait", L) for L in range(61))


def test_ungated_index_k_bf16_only_touches_the_bf16_path():
    c = configuration()
    out = hypothesis("ungated-index-k-bf16").apply(c)
    assert out.gate_map.ungated() == ("get_index_k_bf16_buffer",)
    # with an fp8 index-K the fork reads through the upstream getter: the forward is unchanged
    a, _ = issue_only("deepseek-v4-flash", "", "extend", 0, gate=c.gate_map)
    b, _ = issue_only("deepseek-v4-flash", "", "extend", 0, gate=out.gate_map)
    assert a.ops == b.ops
    # on an upstream map (no bf16 path) the switch changes nothing
    up = configuration(gate_map_name="upstream-0.5.11")
    assert hypothesis("ungated-index-k-bf16").apply(up).gate_map.ungated() == ()


def test_switches_compose_in_order():
    c = apply_hypotheses(configuration(), ["ungated-index-k-bf16", "load-unfenced"])
    assert c.hypotheses == ("ungated-index-k-bf16", "load-unfenced")
    assert c.load_fence_stream == "schedule" and c.gate_map.ungated() == ("get_index_k_bf16_buffer",)


def test_a_switch_may_not_change_undeclared_keys():
    sneaky = Hypothesis("sneaky", "changes the fence but declares nothing",
                        lambda c: c.replace(load_fence_stream="schedule"))
    with pytest.raises(InputError, match="load_fence_stream"):
        sneaky.apply(configuration())
    with pytest.raises(InputError, match="Configuration"):
        Hypothesis("broken", "returns junk", lambda c: 3).apply(configuration())


def test_users_register_their_own(monkeypatch):
    monkeypatch.setattr(H, "_REGISTRY", dict(H._REGISTRY))
    mine = register(Hypothesis("fp8-store-fallback", "the DSA fallback store",
                               lambda c: c.replace(options={**c.options, "index_k_store": "fallback"}),
                               ("options",)))
    assert hypothesis("fp8-store-fallback") is mine
    with pytest.raises(InputError, match="already registered"):
        register(mine)
    with pytest.raises(InputError, match="unknown configuration keys"):
        register(Hypothesis("bad-keys", "x", lambda c: c, ("measurement",)))
    out = apply_hypotheses(configuration("dsa-v3.2", "upstream-0.5.10", {"index_k_store": "fused"}),
                           ["fp8-store-fallback"])
    assert out.options["index_k_store"] == "fallback"


def test_entry_points_are_loaded_on_lookup(monkeypatch):
    monkeypatch.setattr(H, "_REGISTRY", dict(H._REGISTRY))
    monkeypatch.setattr(H, "_entry_points_loaded", False)

    class EP:
        def load(self):
            return lambda: [Hypothesis("from-plugin", "a plugin's switch", lambda c: c)]
    monkeypatch.setattr(H.metadata, "entry_points", lambda group: [EP()] if group == H.ENTRY_POINT_GROUP else [])
    assert hypothesis("from-plugin").summary == "a plugin's switch"
    assert "from-plugin" in hypothesis_names()


def test_configuration_validation_names_the_key():
    for d, key in (({"model": "gpt-9"}, "model"),
                   ({"model": "dsa-v3.2", "gate_map": "0.4"}, "gate_map"),
                   ({"model": "dsa-v3.2", "options": {"index_k_dtype": "fp16"}}, "options.index_k_dtype"),
                   ({"model": "dsa-v3.2", "load_fence_stream": "side"}, "load_fence_stream"),
                   ({"model": "dsa-v3.2", "host_lock_during_load": "yes"}, "host_lock_during_load"),
                   ({"model": "dsa-v3.2", "backup_pools": ["c4"]}, "backup_pools"),
                   ({"model": "dsa-v3.2", "index_k_host_bytes_per_entry": -1}, "index_k_host_bytes_per_entry"),
                   ({"model": "dsa-v3.2", "measurement": 1}, "measurement")):
        with pytest.raises(InputError) as e:
            configuration_from_dict(d)
        assert key in str(e.value), (d, str(e.value))
    with pytest.raises(InputError, match="hypothesis"):
        hypothesis("no-such-switch")
    assert set(CONTROLLER_KEYS) < set(Configuration.__dataclass_fields__)


def test_on_v4_the_index_k_switches_expose_no_read_without_the_compressor_state_gate():
    """A finding of the model, from 0.5.14's order: the indexer compressor fetches its state
    through the gated get_indexer_compress_states before the index-K read, so on DeepSeek V4
    ungating the index-K getters alone leaves every index-K read behind its layer's wait;
    with that getter ungated too (a user switch), every C4 layer's index-K read is exposed."""
    opts = {"index_k_dtype": "bf16"}
    for name in ("ungated-index-k", "ungated-index-k-bf16"):
        c = hypothesis(name).apply(configuration(options=opts))
        issue, _ = issue_only("deepseek-v4-flash", "", "extend", 0, options=opts, gate=c.gate_map)
        assert issue.exposed_reads == []
    both = Hypothesis("ungated-index-k-and-state", "index-K and the indexer compressor state skip the gate",
                      lambda c: c.replace(gate_map=c.gate_map.override(
                          {"get_index_k_bf16_buffer": False, "get_indexer_compress_states": False})),
                      ("gate_map",))
    c = both.apply(configuration(options=opts))
    issue, _ = issue_only("deepseek-v4-flash", "", "extend", 0, options=opts, gate=c.gate_map)
    exposed = issue.exposed_reads
    assert len(exposed) == 21 and {r.role for r in exposed} == {"index_k"}
