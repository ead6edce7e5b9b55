"""Gate maps as data: the shipped engine versions and loading/overriding with named errors."""
from __future__ import annotations

import pytest

from sim.engine.gates import (ACCESSORS, GATE_MAPS, READERS, gate_map, gate_map_from_dict, load_gate_map,
                              ungated_readers)
from sim.engine.models import model
from sim.errors import InputError


def test_0510_leaves_exactly_the_three_named_readers_ungated():
    # reference/sglang_hicache.md 7.1: _get_topk_ragged (get_index_k_scale_buffer),
    # _get_topk_ragged_with_cp and forward_indexer (get_index_k_continuous / _scale_continuous)
    gm = gate_map("upstream-0.5.10")
    assert ungated_readers(gm) == ("_get_topk_ragged", "_get_topk_ragged_with_cp", "forward_indexer")
    assert gm.ungated() == ("get_index_k_continuous", "get_index_k_scale_buffer", "get_index_k_scale_continuous")
    assert gm.is_gated("get_index_k_with_scale_buffer") and gm.is_gated("get_key_buffer")


def test_0511_and_the_fork_gate_everything():
    for name in ("upstream-0.5.11", "incident-fork"):
        gm = gate_map(name)
        assert gm.ungated() == () and ungated_readers(gm) == ()
    assert "get_index_k_bf16_buffer" in gate_map("incident-fork").gated
    assert "get_index_k_bf16_buffer" not in gate_map("upstream-0.5.11").gated


def test_every_reader_a_model_uses_is_catalogued_and_known_to_its_maps():
    for fam, gm in ((model("dsa-v3.2"), "upstream-0.5.10"), (model("deepseek-v4-flash"), "upstream-0.5.11")):
        for steps in fam.steps.values():
            for s in steps:
                if s.reader == "forward_c4_indexer_bf16":
                    continue                    # the fork's reader: only the fork's map knows it
                for acc in READERS[s.reader]:
                    assert acc in ACCESSORS
                    gate_map(gm).is_gated(acc)


def test_unknown_accessor_is_an_error_naming_it():
    with pytest.raises(InputError, match="get_index_k_bf16_buffer"):
        gate_map("upstream-0.5.10").is_gated("get_index_k_bf16_buffer")
    with pytest.raises(InputError, match=r"gated\.get_nothing"):
        gate_map_from_dict({"name": "x", "gated": {"get_nothing": True}})


def test_from_dict_with_base_overrides_and_validates():
    gm = gate_map_from_dict({"name": "mine", "base": "upstream-0.5.11",
                             "gated": {"get_index_k_scale_buffer": False}})
    assert gm.ungated() == ("get_index_k_scale_buffer",) and gm.name == "mine"
    assert ungated_readers(gm) == ("_get_topk_ragged",)
    for bad, key in (({"name": "x", "base": "nope"}, "base"),
                     ({"name": "x", "gated": {"get_key_buffer": 1}}, "gated.get_key_buffer"),
                     ({"name": "x", "colour": 1}, "colour"),
                     ({"gated": {}}, "name"),
                     ({"name": "x", "gated": {}}, "gated")):
        with pytest.raises(InputError) as e:
            gate_map_from_dict(bad)
        assert key in str(e.value)


def test_override_returns_a_new_map_and_keeps_the_shipped_one():
    base = gate_map("upstream-0.5.11")
    new = base.override({"get_key_buffer": False})
    assert not new.is_gated("get_key_buffer") and base.is_gated("get_key_buffer")
    assert new != base and GATE_MAPS["upstream-0.5.11"] == base
    with pytest.raises(InputError, match="get_key_buffer"):
        base.override({"get_key_buffer": "no"})


def test_load_from_toml(tmp_path):
    p = tmp_path / "fork.toml"
    p.write_text('name = "fork-b"\nbase = "incident-fork"\n[gated]\nget_index_k_bf16_buffer = false\n')
    gm = load_gate_map(str(p))
    assert gm.ungated() == ("get_index_k_bf16_buffer",)
    assert load_gate_map("upstream-0.5.10") is GATE_MAPS["upstream-0.5.10"]
    (tmp_path / "bad.toml").write_text("name = [")
    with pytest.raises(InputError):
        load_gate_map(str(tmp_path / "bad.toml"))
    with pytest.raises(InputError, match="gate_map"):
        load_gate_map(str(tmp_path / "missing.toml"))
