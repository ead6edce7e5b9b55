"""The request comparison's own parts on kvrace alone (no SGLang needed; default tier): the
sequences ``generate_requests`` draws, and kvrace's cache running them through
``cache_unfinished_req`` / ``cache_finished_req`` without losing a slot.  The slow test
``test_requests_agree_op_by_op`` runs them against SGLang's own cache, ``Req`` and
``ReqToTokenPool``."""
from __future__ import annotations

import pytest

from tests.differential.kvrace_side import KvraceSide
from tests.differential.ops import REQUEST_OPS, SideDriver, generate_requests
from tests.differential.sglang_side import DiffConfig, device_tokens_for


def test_generated_requests_are_seeded_and_all_finish():
    for seed in range(20):
        for hicache in (False, True):
            ops = generate_requests(seed, 200, page_size=16, device_tokens=128, hicache=hicache)
            assert ops == generate_requests(seed, 200, page_size=16, device_tokens=128, hicache=hicache)
            live = set()
            for op in ops:
                if op["op"] == "admit":
                    assert op["r"] not in live and len(live) < 3
                    assert op.get("chunk", 16) % 16 == 0          # chunks are whole pages
                    live.add(op["r"])
                elif op["op"] == "finish":
                    live.remove(op["r"])
                elif op["op"] in REQUEST_OPS:
                    assert op["r"] in live
                elif op["op"] == "flush":
                    assert not live                              # flush_cache runs on an idle cache
            assert not live
    kinds = {op["op"] for seed in range(10) for op in generate_requests(seed, 200, hicache=False)}
    assert set(REQUEST_OPS) <= kinds and "evict_host" not in kinds


@pytest.mark.parametrize("cfg", [
    DiffConfig(page_size=1, device_tokens=48, hicache=False),
    DiffConfig(page_size=16, device_tokens=device_tokens_for(16), hicache=False, is_eagle=True),
    DiffConfig(page_size=1, device_tokens=48),
    DiffConfig(page_size=16, device_tokens=device_tokens_for(16), write_policy="write_back", layout="page_first"),
], ids=lambda c: c.describe())
def test_no_slot_is_lost(cfg):
    """Through admissions (with load-backs), chunks, decode steps and finishes, no call raises,
    and at the end every device slot is either free or held by the tree, and every row free."""
    seen = set()
    for seed in range(6):
        side = KvraceSide(cfg)
        d = SideDriver(side)
        results = [d.apply(op) for op in generate_requests(seed, 250, page_size=cfg.page_size,
                                                           device_tokens=cfg.device_tokens, hicache=cfg.hicache)]
        assert not [r for r in results if r[0] == "raise"]
        seen |= {r[0] for r in results} | {"loaded" for r in results if r[0] == "admitted" and r[4] is not None}
        tree = side.tree
        assert not d.reqs and side.req_pool.available_size() == cfg.req_rows
        assert tree.protected_size() == 0
        assert side.allocator.available_size() + tree.total_size() == cfg.device_tokens
    # the sequences reach what they are for: chunked prefill, decode, and with HiCache load-backs
    assert {"admitted", "chunked", "decoded", "cached", "finished"} <= seen
    assert ("loaded" in seen) == cfg.hicache
