"""Report-level verdicts: intra-launch races and indeterminate bytes, the race cap and count.

The fact the intra-launch tests start from (measured on an H200): SGLang's
``transfer_cache_dsv4_mla`` launched over layers [0, 1] of a 256 B/token
bf16 index-K buffer writes 7,936 bytes twice and leaves different bytes from
launch to launch (at least 3 distinct outcomes in 11 launches).  By hand, from
the C4 constants (value 576 B at ``entry * 576`` of a 37,440 B page, scale
8 B at 36,864): with 31 tokens per layer the layer stride is 31 * 256 = 7,936
B and the buffer 15,872 B; layer 0's values cover [0, 31 * 576 = 17,856),
layer 1's [7,936, 25,792); both are clipped at 15,872 and every scale lands
past the end.  So [7,936, 15,872) -- all of layer 1 -- is written twice:
byte x by token x // 576 of layer 0 and token (x - 7,936) // 576 of layer 1.
"""
import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.executor import run_schedule
from sim.hb import double_written, intra_launch_races
from sim.schedule import validate
from sim.verdicts import analyse, summary_text
from tests.helpers import profile, schedule_doc

TOKENS = 31
STRIDE = TOKENS * 256            # 7,936 B per layer


def _dsv4_doc(extra_ops=(), extra_buffers=()):
    doc = json.load(open("examples/c4_routine_on_bf16_index_k.json"))
    for b in doc["buffers"]:
        if b["name"] == "host_index_k_bf16":
            b["layout"]["layers"] = 2
            b["init"][0]["indices"] = {"start": 0, "count": TOKENS}
        if b["name"] == "dev_index_k_bf16":
            b["layout"]["layers"] = 2
            b["layout"]["tokens"] = TOKENS
    doc["buffers"].extend(extra_buffers)
    doc["ops"][0]["args"] = {"src_indices": {"start": 0, "count": TOKENS},
                             "dst_indices": {"start": 0, "count": TOKENS}, "layers": [0, 1]}
    doc["ops"] = doc["ops"][:3]        # copy, record, wait
    doc["ops"].extend(extra_ops)
    return doc


def _read(op_id, layer, start=0, count=TOKENS, buffer="dev_index_k_bf16", stream="forward"):
    return {"id": op_id, "op": "read", "stream": stream, "buffer": buffer, "layer": layer,
            "tokens": {"start": start, "count": count}}


def test_dsv4_token_over_two_layers_double_writes_7936_bytes():
    s = validate(_dsv4_doc())
    races = intra_launch_races(s)
    assert len(races) == 1
    r = races[0]
    assert s.ops[r["op"]].id == "load_dsv4_token" and r["buffer"] == "dev_index_k_bf16"
    assert r["bytes"] == 7936
    assert r["starts"].tolist() == [STRIDE] and r["ends"].tolist() == [2 * STRIDE]
    # every double-written byte has exactly the two writers derived by hand
    dw = r["written"]
    for lo, hi, items in zip(dw.piece_starts.tolist(), dw.piece_ends.tolist(), dw.piece_items):
        for x in (lo, hi - 1):
            assert sorted(items.tolist()) == sorted({x // 576, (x - STRIDE) // 576})


def test_read_of_double_written_bytes_is_indeterminate_never_ok():
    doc = _dsv4_doc([_read("rd_l0", 0), _read("rd_l1", 1), _read("rd_l1_part", 1, start=2, count=4)])
    rep = analyse(run_schedule(validate(doc), profile()))
    reads = {r["op"]: r for r in rep["reads"]}
    assert reads["rd_l0"]["status"] == "ok" and reads["rd_l0"]["bytes_indeterminate"] == 0
    assert reads["rd_l1"]["status"] == "indeterminate"
    assert reads["rd_l1"]["bytes_indeterminate"] == 7936 and reads["rd_l1"]["bytes_differing"] == 0
    assert reads["rd_l1_part"]["bytes_indeterminate"] == 4 * 256
    assert reads["rd_l1_part"]["indeterminate_ranges"] == [[STRIDE + 512, STRIDE + 512 + 1024]]
    assert rep["indeterminate_reads"] == 2 and rep["corrupt_reads"] == 0
    (ir,) = rep["intra_launch_races"]
    assert ir["op"] == "load_dsv4_token" and ir["bytes"] == 7936 and ir["ranges"] == [[STRIDE, 2 * STRIDE]]
    # the first piece: bytes [7936, 8064) written by token 0 of layer 1 and token 13 of layer 0
    first = ir["candidates"][0]
    assert first["range"] == [7936, 13 * 576 + 576] and first["items"] == 2
    texts = {w["item"]: w["provenance"][0]["text"] for w in first["writers"]}
    assert set(texts) == {0, 13}
    assert "layer 1 request 40 unit 0 v1" in texts[0]           # host layer 1, token 0
    assert "layer 0 initial unit 31 v0" in texts[13]            # host layer 0 bytes 7488+448.. = unit 31
    text = summary_text(rep)
    assert "intra-launch races: 1" in text and "indeterminate: 2" in text
    assert "INTRA-LAUNCH RACE in load_dsv4_token" in text and "-> INDETERMINATE" in text


def test_a_later_ordered_write_makes_the_bytes_determinate_again():
    write = {"id": "rewrite", "op": "write", "stream": "forward", "buffer": "dev_index_k_bf16", "layer": 1,
             "units": list(range(4)), "owner": 77}
    doc = _dsv4_doc([write, _read("rd_l1", 1)])
    rep = analyse(run_schedule(validate(doc), profile()))
    r = rep["reads"][0]
    assert r["bytes_indeterminate"] == 7936 - 4 * 256 and r["status"] == "indeterminate"
    assert r["indeterminate_ranges"] == [[STRIDE + 1024, 2 * STRIDE]]


def test_a_copy_of_indeterminate_bytes_carries_them():
    other = {"name": "dev_copy", "location": "device", "kind": "index_k_bf16",
             "layout": {"preset": "bf16_index_k", "layers": 2, "tokens": TOKENS}}
    copy = {"id": "d2d", "op": "copy", "stream": "forward", "routine": "token_bytewise",
            "src": "dev_index_k_bf16", "dst": "dev_copy",
            "args": {"layer": 1, "src_indices": [0, 1, 2], "dst_indices": [5, 6, 7]}}
    doc = _dsv4_doc([copy, _read("rd", 1, start=4, count=5, buffer="dev_copy")], [other])
    rep = analyse(run_schedule(validate(doc), profile()))
    r = rep["reads"][0]
    assert r["status"] == "indeterminate" and r["bytes_indeterminate"] == 3 * 256
    assert r["indeterminate_ranges"] == [[STRIDE + 5 * 256, STRIDE + 8 * 256]]


def test_double_written_by_hand():
    # item 0: [0,10) and [2,8) (its own overlap is program order, no race);
    # item 1: [5,15) and [12,20); item 2: [18,30); item 3: [40,50)
    dst = np.array([0, 2, 5, 12, 18, 40])
    end = np.array([10, 8, 15, 20, 30, 50])
    item = np.array([0, 0, 1, 1, 2, 3])
    dw = double_written(dst, end, item)
    assert dw.starts.tolist() == [5, 18] and dw.ends.tolist() == [10, 20] and dw.nbytes == 7
    assert [i.tolist() for i in dw.items] == [[0, 1], [1, 2]]
    assert dw.piece_starts.tolist() == [5, 18] and [i.tolist() for i in dw.piece_items] == [[0, 1], [1, 2]]
    # three writers of one range, cut where the writer set changes
    dw = double_written(np.array([0, 4, 6]), np.array([10, 10, 8]), np.array([0, 1, 2]))
    assert dw.starts.tolist() == [4] and dw.ends.tolist() == [10]
    assert list(zip(dw.piece_starts.tolist(), dw.piece_ends.tolist())) == [(4, 6), (6, 8), (8, 10)]
    assert [i.tolist() for i in dw.piece_items] == [[0, 1], [0, 1, 2], [0, 1]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 8), st.integers(0, 3)), min_size=0, max_size=12))
def test_double_written_is_the_bytes_two_items_write(exts):
    """Against a per-byte count (disjoint extents included: the sweep's shortcut)."""
    dst = np.array([x[0] for x in exts], np.int64)
    end = dst + np.array([x[1] for x in exts], np.int64)
    item = np.array([x[2] for x in exts], np.int64)
    writers = {}
    for a, b, i in zip(dst.tolist(), end.tolist(), item.tolist()):
        for byte in range(a, b):
            writers.setdefault(byte, set()).add(i)
    want = sorted(b for b, w in writers.items() if len(w) >= 2)
    dw = double_written(dst, end, item)
    got = [b for a, e in zip(dw.starts.tolist(), dw.ends.tolist()) for b in range(a, e)]
    assert got == want
    for a, e, its in zip(dw.piece_starts.tolist(), dw.piece_ends.tolist(), dw.piece_items):
        assert all(writers[b] == set(its.tolist()) for b in range(a, e))


def test_kernel_copies_with_unique_destinations_have_no_intra_launch_race():
    ops = [{"id": "cp", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": [0, 0, 1, 1], "dst_indices": [0, 1, 2, 3]}}]
    assert intra_launch_races(validate(schedule_doc(ops))) == []


def test_race_cap_lists_some_and_counts_all():
    n = 30
    ops = [{"id": f"w{i}", "op": "write", "stream": f"s{i}", "buffer": "D", "layer": 0, "units": [1],
            "owner": 10 + i} for i in range(n)]
    s = validate(schedule_doc(ops, streams=[f"s{i}" for i in range(n)]))
    run = run_schedule(s, profile())
    rep = analyse(run, race_limit=10)
    assert len(rep["latent_races"]) == 10 and rep["latent_races_total"] == n * (n - 1) // 2
    assert rep["latent_races"][0]["ops"] == ["w0", "w1"] and rep["latent_races"][0]["bytes"] == 64
    assert "latent races: 435 (10 of 435 listed)" in summary_text(rep)
    full = analyse(run, race_limit=None)
    assert len(full["latent_races"]) == 435 and "listed" not in summary_text(full)
