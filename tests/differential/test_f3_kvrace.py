"""FINDINGS.md F3 on kvrace alone (no SGLang needed; default tier): past F2, kvrace's cache
fails where SGLang's does, and the harness compares a load whose host indices repeat by the
pairs it copies.  The slow differential test (``test_f3_past_f2_the_caches_still_agree``)
checks both against SGLang op by op."""
from __future__ import annotations

from sim.errors import KvraceError
from sim.pools.allocator import MissingIndicesError
from tests.differential.compare import _ties_sorted
from tests.differential.kvrace_side import KvraceSide
from tests.differential.ops import SideDriver, error_family, generate
from tests.differential.sglang_side import DiffConfig

#: the shrunk case: seed 1800154005 reaches F2's detached node under FILO eviction, and a
#: later evict frees its device value a second time (None); SGLang 0.5.14 fails there with an
#: AttributeError inside its allocator's ``free``
CFG = DiffConfig(page_size=64, device_tokens=512, write_policy="write_back", hicache_ratio=1.1,
                 layout="layer_first", io_backend="kernel", eviction_policy="filo")


def test_a_detached_node_evicted_again_fails_as_in_sglang():
    side = KvraceSide(CFG)
    driver = SideDriver(side)
    failed = None
    for i, op in enumerate(generate(1800154005, 250, page_size=64, device_tokens=512)):
        try:
            driver._apply(op)
        except KvraceError as e:
            failed = (i, op["op"], e)
            break
    assert failed is not None, "the sequence no longer reaches the second eviction"
    i, kind, e = failed
    assert kind == "evict" and isinstance(e, MissingIndicesError) and "free_index" in str(e)
    assert error_family(e) == "AttributeError"            # SGLang's kind there
    # the recorder saw the None free (the call failed in the allocator, not in the harness)
    assert ("device_free", None) in side.take_moves()


def test_tied_host_indices_compare_by_their_pairs():
    # torch's unstable sort (SGLang) and a stable sort (kvrace) of the same pairs
    sglang = ("load_copy", [1, 2, 2, 2, 5], [10, 31, 20, 30, 50])
    kvrace = ("load_copy", [1, 2, 2, 2, 5], [10, 20, 30, 31, 50])
    assert _ties_sorted(sglang) == _ties_sorted(kvrace) == ("load_copy", [1, 2, 2, 2, 5], [10, 20, 30, 31, 50])
    # the same pairs in another order of distinct host indices stay different
    assert _ties_sorted(("load_copy", [2, 1], [20, 10])) != _ties_sorted(("load_copy", [1, 2], [10, 20]))
    # a tie moved to a different host slot is a different copy
    assert _ties_sorted(("load_copy", [2, 2, 3], [30, 20, 40])) != _ties_sorted(("load_copy", [2, 3, 3], [20, 30, 40]))
    plain = ("write_copy", [0, 1, 2], [7, 5, 6])
    assert _ties_sorted(plain) is plain
