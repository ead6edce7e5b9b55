"""Layer-shifted copy plans (issue 9's speed): a ``kernel_per_layer`` copy planned at one layer
is the plan of the same copy at another layer with its offsets moved by the layouts' layer
strides (``routines.LAYER_SHIFTED``), and what the executor derives from it (item times, byte
accesses) is its base's, shifted; all equal to planning and deriving afresh."""
import numpy as np
import pytest

import sim.transfers.routines as routines
from sim.errors import InputError
from sim.pools.layouts import HostLayout, PagedLayout
from sim.transfers.routines import plan


def _layouts():
    dev = PagedLayout(name="dev", layers=5, pages=64, page_bytes=96, entries_per_page=1)
    hosts = [HostLayout(name=f"host_{k}", layout=k, layers=5, units=80, unit_bytes=96,
                        page_size=4 if k == "page_first_direct" else 1)
             for k in ("layer_first", "page_first", "page_first_direct")]
    return dev, hosts


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_layer_stride_is_the_offset_of_a_layer(layout):
    dev, hosts = _layouts()
    for lay in (dev, *(h for h in hosts if h.layout == layout)):
        units = np.arange(lay.pages if lay is dev else lay.units)
        for L in range(lay.layers):
            assert np.array_equal(lay.unit_offsets(L, units), lay.unit_offsets(0, units) + L * lay.layer_stride)


def _fresh(routine, src, dst, args):
    return routines._plan(routine, src, dst, args, "copy")


@pytest.mark.parametrize("seed", range(30))
def test_shifted_plans_equal_fresh_plans(seed, monkeypatch):
    monkeypatch.setattr(routines, "_layer_families", {})
    rng = np.random.default_rng(seed)
    dev, hosts = _layouts()
    host = hosts[seed % 3]
    n = int(rng.integers(1, 400))
    s = rng.integers(-1, host.units, n).tolist()                          # -1: an item the kernel skips
    d = rng.integers(0, dev.pages, n).tolist()
    pairs = [(host, dev, s, d), (dev, host, d, s)]                        # a load and a backup direction
    for src, dst, si, di in pairs:
        layers = rng.permutation(5).tolist()
        for L in layers:
            args = {"layer": L, "src_indices": list(si), "dst_indices": list(di)}
            got, want = plan("kernel_per_layer", src, dst, args), _fresh("kernel_per_layer", src, dst, args)
            for a, b in zip((got.extents.src, got.extents.dst, got.extents.length, got.extents.item),
                            (want.extents.src, want.extents.dst, want.extents.length, want.extents.item)):
                assert np.array_equal(a, b) and a.dtype == b.dtype
            assert got.extents.n_items == want.extents.n_items and got.launch == want.launch
            assert (got.base is None) == (L == layers[0])
            assert not got.extents.src.flags.writeable


def test_a_bad_layer_is_refused_on_the_shifted_path_as_on_the_fresh_one(monkeypatch):
    monkeypatch.setattr(routines, "_layer_families", {})
    dev, hosts = _layouts()
    idx = list(range(40))
    plan("kernel_per_layer", hosts[1], dev, {"layer": 0, "src_indices": idx, "dst_indices": [0] * len(idx)})
    for bad in (5, -1, True, "1"):
        args = {"layer": bad, "src_indices": idx, "dst_indices": [0] * len(idx)}
        with pytest.raises(InputError) as shifted:
            plan("kernel_per_layer", hosts[1], dev, args, "copy")
        with pytest.raises(InputError) as fresh:
            _fresh("kernel_per_layer", hosts[1], dev, args)
        assert str(shifted.value) == str(fresh.value)


def test_other_arguments_are_part_of_the_family(monkeypatch):
    """Another index list or item size is another copy: planned afresh, not shifted."""
    monkeypatch.setattr(routines, "_layer_families", {})
    dev, hosts = _layouts()
    idx = list(range(40))
    a = plan("kernel_per_layer", hosts[1], dev, {"layer": 0, "src_indices": idx, "dst_indices": idx})
    b = plan("kernel_per_layer", hosts[1], dev, {"layer": 1, "src_indices": idx[::-1], "dst_indices": idx})
    c = plan("kernel_per_layer", hosts[1], dev, {"layer": 1, "src_indices": idx, "dst_indices": idx,
                                                 "item_bytes": 48})
    assert a.base is None and b.base is None and c.base is None
    assert int(c.extents.length[0]) == 48


def test_an_engine_run_with_derived_memo_values_equals_one_without(monkeypatch):
    """``incident-repro``'s load-backs (one copy per layer and pool with the same page lists)
    run with clipping, item times and accesses derived from the base plans (``Executor._shifted``), each
    checked against the value made afresh, and with them made afresh: the same
    ``EngineResult``; and the derivation was used."""
    import sim.executor as ex
    from sim.engine.engine import PrefillEngine
    from sim.engine.scenario import load_scenario

    from sim.memory import clip_and_leaves
    from sim.verdicts import _merge

    def run():
        e = PrefillEngine(load_scenario("incident-repro", ["run.duration_s=3"]), keep="report")
        return e.run().signature()

    used = []
    real = ex.Executor._shifted

    def counting(self, plan, what):
        got = real(self, plan, what)
        used.append(got is not None)
        if got is None:
            return None
        if what[0] == "times":
            want = self._copy_shape(plan, what[1], plan.extents.item)
        elif what[0] == "clip":
            (c, leaves), (w, want_leaves) = got, clip_and_leaves(plan, *what[1:])
            assert leaves == want_leaves and c.src_nbytes == w.src_nbytes
            assert all(np.array_equal(getattr(c, f), getattr(w, f)) for f in _CLIP_FIELDS)
            return got
        else:
            c = clip_and_leaves(plan, *what[1:])[0]
            want = (*_merge(c.src, np.minimum(c.length, c.fill_start)), *_merge(c.dst, c.fill_end))
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
        return got
    monkeypatch.setattr(ex.Executor, "_shifted", counting)
    with_shift = run()
    assert sum(used) > 40
    monkeypatch.setattr(ex.Executor, "_shifted", lambda self, plan, what: None)
    assert run() == with_shift
    monkeypatch.setattr(routines, "LAYER_SHIFTED", frozenset())           # every plan fresh
    monkeypatch.setattr(routines, "_layer_families", {})
    assert run() == with_shift


_CLIP_FIELDS = ("src", "dst", "length", "item", "copy_len", "fill_start", "fill_end")


def _bare_executor():
    """An Executor holding only its plan memo (what ``_memo`` and ``_shifted`` use)."""
    import sim.executor as ex
    e = object.__new__(ex.Executor)
    e._plan_memo = {}
    return e


@pytest.mark.parametrize("seed", range(20))
def test_shifted_clips_equal_fresh_clips(seed, monkeypatch):
    """A layer-shifted plan's clipping to its buffers (the memo's ``"clip"``) is its base's with
    the offsets moved when neither plan has an extent leaving a buffer, and made afresh
    otherwise: equal to ``clip_and_leaves`` either way, for buffer sizes that cut some layers."""
    from sim.memory import clip_and_leaves
    monkeypatch.setattr(routines, "_layer_families", {})
    rng = np.random.default_rng(1000 + seed)
    dev, hosts = _layouts()
    host = hosts[seed % 3]
    n = int(rng.integers(1, 300))
    s = rng.integers(-1, host.units, n).tolist()
    d = rng.integers(0, dev.pages, n).tolist()
    e = _bare_executor()
    derived = 0
    for src, dst, si, di in ((host, dev, s, d), (dev, host, d, s)):
        full_s, full_d = src.nbytes, dst.nbytes
        # whole buffers, and ones cut short on either side (the extents of some layers leave)
        for sn, dn in ((full_s, full_d), (full_s - int(rng.integers(1, full_s // 3)), full_d),
                       (full_s, full_d - int(rng.integers(1, full_d // 3)))):
            for L in rng.permutation(5).tolist():
                p = plan("kernel_per_layer", src, dst, {"layer": L, "src_indices": list(si), "dst_indices": list(di)})
                was = e._shifted(p, ("clip", sn, dn)) is not None
                derived += was
                got, leaves = e._memo(p, ("clip", sn, dn), lambda: clip_and_leaves(p, sn, dn))
                want, want_leaves = clip_and_leaves(p, sn, dn)
                assert leaves == want_leaves and not (was and leaves)
                for f in _CLIP_FIELDS:
                    assert np.array_equal(getattr(got, f), getattr(want, f)), f
                assert got.src_nbytes == want.src_nbytes
    assert derived >= 8


def test_the_memo_keeps_the_base_plans_values_only(monkeypatch):
    """What ``_memo`` derives for a layer-shifted plan is returned, not kept: a static schedule
    clips every copy at issue, so keeping one entry per copy filled the memo to its clear (the
    bases with it) before the verdicts asked again.  A shifted plan whose extents leave a
    buffer is made afresh and kept."""
    from sim.memory import clip_and_leaves
    monkeypatch.setattr(routines, "_layer_families", {})
    dev, hosts = _layouts()
    e = _bare_executor()
    args = {"src_indices": [3, 7, 9], "dst_indices": [1, 2, 5]}
    plans = [plan("kernel_per_layer", hosts[1], dev, {"layer": L, **args}) for L in range(5)]
    for p in plans:
        e._memo(p, ("clip", hosts[1].nbytes, dev.nbytes), lambda p=p: clip_and_leaves(p, hosts[1].nbytes, dev.nbytes))
    assert [v[0] for v in e._plan_memo.values()] == [plans[0]]
    short = dev.nbytes - dev.layer_stride          # the last layer's extents leave the device buffer
    for p in plans:
        e._memo(p, ("clip", hosts[1].nbytes, short), lambda p=p: clip_and_leaves(p, hosts[1].nbytes, short))
    assert [v[0] for k, v in e._plan_memo.items() if k[3] == short] == [plans[0], plans[4]]
