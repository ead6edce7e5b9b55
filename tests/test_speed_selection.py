"""Validation's unit-selection fast path (``_selection``: the common ``units`` case decided
without a key list, a memoisable list's range checked once, shared read-only lengths) and
``_normalise_args``'s shallow copy give exactly what the paths they replace give: the same
arrays, totals and InputError messages, on random selections (good and bad) and on random
schedules."""
import enum
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim.schedule as schedule
from sim.errors import InputError
from sim.schedule import PagedLayout, _int_list, _list_count, _get, _Totals, validate
from tests.strategies import base_buffers, rich_schedules, schedules

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _selection_before(d, where, buf, totals, *, allow_ranges):
    """``_selection`` as it was before the fast path (commit 9df6644), memo left out:
    the reference the fast path is checked against."""
    keys = [k for k in ("units", "tokens", "ranges") if k in d]
    allowed = "'units' or 'tokens'" + (" or 'ranges'" if allow_ranges else "")
    if not (len(keys) == 1):
        raise InputError(where, f"expected exactly one of {allowed}, got {keys or 'none'}")
    key = keys[0]
    if not (allow_ranges or key != "ranges"):
        raise InputError(f"{where}.ranges", f"not allowed here; use {allowed}")
    lay = buf.layout
    is_read = allow_ranges
    if key == "ranges":
        r = _get(d, "ranges", where, list)
        if not (0 < len(r) <= schedule.MAX_INDICES):
            raise InputError(f"{where}.ranges",
                             f"expected 1..{schedule.MAX_INDICES} (MAX_INDICES) [offset, nbytes] pairs, got {len(r)}")
        total = 0
        for k, x in enumerate(r):
            ok = (isinstance(x, list) and len(x) == 2
                  and all(isinstance(y, int) and not isinstance(y, bool) for y in x))
            if not ok:
                raise InputError(f"{where}.ranges[{k}]",
                                 f"expected an [offset, nbytes] pair of integers, got {schedule.show(x)}")
            o, n = x
            if not (0 <= o and 0 < n and o + n <= buf.nbytes):
                raise InputError(f"{where}.ranges[{k}]",
                                 f"expected offset >= 0, nbytes > 0 and offset + nbytes <= {buf.nbytes} "
                                 f"(the buffer's size), got {schedule.show(x)}")
            total += n
        totals.add_read(len(r), total, f"{where}.ranges")
        arr = np.asarray(r, dtype=np.int64).reshape(-1, 2)
        return None, None, (arr[:, 0].copy(), arr[:, 1].copy())
    layer = _get(d, "layer", where, int)
    if not (0 <= layer < lay.layers):
        raise InputError(f"{where}.layer", f"expected 0..{lay.layers - 1}, got {layer}")
    count = _list_count(d[key], f"{where}.{key}")
    totals.add_indices(count, f"{where}.{key}")
    if key == "units":
        if is_read:
            totals.add_read(count, count * lay.unit_bytes, f"{where}.units")
        idx = _int_list(d[key], f"{where}.units", 0, lay.units - 1)
        if not (idx.size > 0):
            raise InputError(f"{where}.{key}", "expected at least one index")
        offs = lay.unit_offsets(layer, idx)
        return layer, idx, (np.asarray(offs, dtype=np.int64), np.full(idx.size, lay.unit_bytes, np.int64))
    if not (isinstance(lay, PagedLayout)):
        raise InputError(f"{where}.tokens", "token selection needs a device (paged) layout")
    ntok = lay.pages * lay.entries_per_page
    if is_read:
        fields = lay.effective_fields
        totals.add_read(count * len(fields), count * sum(f.entry_bytes for f in fields), f"{where}.tokens")
    idx = _int_list(d[key], f"{where}.tokens", 0, ntok - 1)
    if not (idx.size > 0):
        raise InputError(f"{where}.{key}", "expected at least one index")
    offs, lens = lay.token_extents(layer, idx)
    return layer, idx, (np.asarray(offs, dtype=np.int64).ravel(), np.asarray(lens, dtype=np.int64).ravel())


def _normalise_args_before(args, where):
    return {k: (_int_list(v, f"{where}.{k}").tolist() if isinstance(v, dict) else v) for k, v in args.items()}


_BUFFERS = None


def _buffers():
    global _BUFFERS
    if _BUFFERS is None:
        doc = {"kvrace_schedule": 2, "name": "sel", "buffers": base_buffers(), "streams": ["s0"], "events": [],
               "ops": []}
        _BUFFERS = validate(doc).buffers
    return _BUFFERS


_index = st.one_of(st.integers(-3, 70), st.booleans(), st.just(2 ** 63), st.just(-(2 ** 63) - 1),
                   st.just(1.0), st.just("1"), st.none())
class _Eight(enum.IntEnum):
    """An int subclass that is not bool: the general test of a range pair accepts it."""
    EIGHT = 8


_index_list = st.one_of(st.lists(st.integers(0, 40), max_size=70), st.lists(_index, max_size=6),
                        st.fixed_dictionaries({"start": st.integers(-2, 10), "count": st.integers(-1, 8)}),
                        st.just("x"), st.none())
_ranges = st.one_of(st.lists(st.lists(st.integers(-2, 5000), min_size=2, max_size=2), max_size=4),
                    st.lists(st.one_of(st.just([0, True]), st.just([1]), st.just("r"), st.just((0, 8)),
                                       st.just([_Eight.EIGHT, 8]), st.just([0, 2 ** 70]), st.just([0.0, 8])),
                             max_size=3),
                    st.just(3))


@st.composite
def _selections(draw, buf):
    """A selection dict for ``buf``: mostly ``units`` (the fast path) with entries at the
    layout's edges, sometimes tokens, ranges, two keys or none, good and bad values."""
    n = buf.layout.units
    edges = st.lists(st.sampled_from([0, 1, n - 2, n - 1, n, n + 1, -1]), min_size=1, max_size=4)
    which = draw(st.sampled_from(["units"] * 6 + ["tokens", "ranges", "units+tokens", "units+ranges", "none"]))
    d = {}
    if "units" in which:
        d["units"] = draw(st.one_of(edges, edges, _index_list))
    if "tokens" in which:
        d["tokens"] = draw(_index_list)
    if "ranges" in which:
        d["ranges"] = draw(_ranges)
    if draw(st.integers(0, 6)):
        good = st.integers(0, buf.layout.layers - 1)
        d["layer"] = draw(st.one_of(good, good, good, st.integers(-1, 3), st.booleans(), st.just("0")))
    return d


def _outcome(f, d, buf, allow_ranges):
    totals = _Totals()
    try:
        layer, idx, ext = f(d, "ops[0]", buf, totals, allow_ranges=allow_ranges)
    except InputError as e:
        return ("error", str(e), vars(totals))
    return (layer, None if idx is None else (idx.dtype, idx.tolist()),
            [(a.dtype, a.tolist()) for a in ext], vars(totals))


@SETTINGS
@given(st.booleans(), st.data())
def test_selection_fast_path_equals_the_path_it_replaces(allow_ranges, data):
    bufs = _buffers()
    buf = bufs[data.draw(st.sampled_from(sorted(bufs)))]
    d = data.draw(_selections(buf))
    before = _outcome(_selection_before, d, buf, allow_ranges)
    # twice: the second call may come from the memo
    assert _outcome(schedule._selection, d, buf, allow_ranges) == before
    assert _outcome(schedule._selection, d, buf, allow_ranges) == before


def test_shared_lengths_are_read_only_and_equal_to_full():
    bufs = _buffers()
    name = next(n for n, b in bufs.items() if b.layout.units >= 3)
    buf = bufs[name]
    a = schedule._selection({"layer": 0, "units": [0, 2]}, "w", buf, _Totals(), allow_ranges=True)
    b = schedule._selection({"layer": 0, "units": [1, 2]}, "w", buf, _Totals(), allow_ranges=True)
    assert a[2][1] is b[2][1] and not a[2][1].flags.writeable
    assert a[2][1].tolist() == [buf.layout.unit_bytes] * 2
    with pytest.raises(ValueError):
        a[2][1][0] = 1


@SETTINGS
@given(st.dictionaries(st.sampled_from(["layer", "src_indices", "dst_indices", "layers", "x"]),
                       st.one_of(st.integers(-2, 5), st.lists(st.integers(0, 9), max_size=4), st.none(),
                                 st.fixed_dictionaries({"start": st.integers(0, 5), "count": st.integers(0, 4)}))))
def test_normalise_args_equals_the_path_it_replaces(args):
    got = schedule._normalise_args(args, "w")
    assert got == _normalise_args_before(args, "w") and got is not args
    assert list(got) == list(args)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(rich_schedules(max_ops=16), schedules(max_ops=16)))
def test_schedules_validate_as_with_the_replaced_paths(doc):
    fast = validate(doc)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(schedule, "_selection", _selection_before)
        mp.setattr(schedule, "_normalise_args", _normalise_args_before)
        slow = validate(doc)
    finally:
        mp.undo()
    assert fast.to_json() == slow.to_json()
    for a, b in zip(fast.ops, slow.ops):
        assert (a.layer, None if a.units is None else a.units.tolist()) == \
            (b.layer, None if b.units is None else b.units.tolist())
        assert (None if a.extents is None else [x.tolist() for x in a.extents]) == \
            (None if b.extents is None else [x.tolist() for x in b.extents])
        assert a.args == b.args


def test_selection_fast_path_at_every_edge():
    """Every buffer, layers at and past the edges, unit lists at and past the layout's
    range (ints, bools, floats, huge ints, empty, longer than the memo takes, arithmetic)
    and the other selection keys beside them: the same outcome as the replaced path."""
    lists = []
    for n in sorted({b.layout.units for b in _buffers().values()}):
        lists += [[0], [n - 1], [n], [n + 1], [-1], [0, n - 1], [0, n], [-1, 0], [n - 1, -1], [1, 1],
                  [True], [0, False], [1.0], [2 ** 63], [-(2 ** 63) - 1], [], list(range(min(n, 65))),
                  list(range(65)) + [n], {"start": 0, "count": 2}, {"start": n - 1, "count": 2}, None, "x"]
    cases = 0
    for buf in _buffers().values():
        for layer in (-1, 0, buf.layout.layers - 1, buf.layout.layers, True):
            for units in lists:
                for extra in ({}, {"tokens": [0]}, {"ranges": [[0, 1]]}):
                    for allow_ranges in (True, False):
                        d = {"layer": layer, "units": units, **extra}
                        before = _outcome(_selection_before, d, buf, allow_ranges)
                        assert _outcome(schedule._selection, d, buf, allow_ranges) == before, d
                        assert _outcome(schedule._selection, d, buf, allow_ranges) == before, d
                        cases += 1
    assert cases > 1000


def test_range_pairs_fast_path_at_every_edge():
    """A read's ranges: plain int pairs (the exact-type path) and every pair the general
    test decides (bools, an int subclass, tuples, floats, huge ints, wrong lengths): the
    same outcome as the replaced path."""
    pairs = [[0, 8], [0, True], [False, 8], [True, True], [_Eight.EIGHT, 8], [0, _Eight.EIGHT], (0, 8),
             [0.0, 8], [0, 8.0], [0, 2 ** 70], [2 ** 63, 1], [0], [0, 8, 1], [], "r", None, [-1, 8], [0, 0]]
    cases = 0
    for buf in _buffers().values():
        for p in pairs:
            for ranges in ([p], [[0, 8], p], [p, [0, 8]]):
                d = {"ranges": ranges}
                before = _outcome(_selection_before, d, buf, True)
                assert _outcome(schedule._selection, d, buf, True) == before, d
                cases += 1
    assert cases > 50


def test_long_range_lists_take_the_plain_path_with_the_same_outcome():
    """Range lists of at least ``PLAIN_RANGES_MIN`` pairs are checked by ``_plain_ranges``
    (C loops over the types), then by ``_array_ranges`` (int64 bounds): good lists at the buffer's edges take it, and a
    bad pair anywhere in a long list (every pair of the edge test, out of bounds by one,
    int64 overflow) gives the replaced loop's outcome, message included."""
    cases = 0
    for buf in _buffers().values():
        nb = buf.nbytes
        good = [[k % nb, 1] for k in range(40)] + [[nb - 1, 1], [0, nb]]
        assert len(good) >= schedule.PLAIN_RANGES_MIN
        assert schedule._plain_ranges(good) is not None
        bad = [[0, True], [False, 8], [_Eight.EIGHT, 8], (0, 8), [0.0, 8], [0, 2 ** 70], [2 ** 63, 1], [0],
               [0, 8, 1], [], "r", None, [-1, 8], [0, 0], [nb, 1], [nb - 1, 2], [0, nb + 1],
               [2 ** 62, 2 ** 62], [2 ** 63 - 1, 1]]
        for ranges in [good] + [good[:at] + [p] + good[at:] for p in bad for at in (0, 17, len(good))]:
            before = _outcome(_selection_before, {"ranges": ranges}, buf, True)
            assert _outcome(schedule._selection, {"ranges": ranges}, buf, True) == before, ranges
            cases += 1
    assert cases > 100
    # a total past int64 (each length <= the buffer): summed as Python ints
    r = [[0, 1 << 50]] * 8193
    assert schedule._array_ranges(schedule._plain_ranges(r), 1 << 50, "w")[2] == 8193 << 50


@SETTINGS
@given(st.data())
def test_range_arrays_equal_the_lists_they_stand_for(data):
    """A host program's ``ranges`` as an ``(n, 2)`` integer array (the engine's forward) gives
    what the list of its pairs gives: the same extents and totals, or the same error message,
    for good pairs, pairs out of bounds by one and every dtype of integers; other arrays (a
    wrong shape or dtype, empty) are refused with a message naming the key."""
    buf = _buffers()[data.draw(st.sampled_from(sorted(_buffers())))]
    nb = buf.nbytes
    value = st.sampled_from([0, 1, 8, nb - 1, nb, nb + 1, -1, 2 ** 40])
    pairs = data.draw(st.lists(st.lists(value, min_size=2, max_size=2), min_size=1, max_size=40))
    dtype = data.draw(st.sampled_from([np.int64, np.int32, np.uint64, np.uint32]))
    info = np.iinfo(dtype)
    if any(not info.min <= x <= info.max for p in pairs for x in p):
        return
    arr = np.array(pairs, dtype)
    # what the list of the array's values gives (a uint array holds no negative pair)
    want = _outcome(_selection_before, {"ranges": arr.tolist()}, buf, True)
    assert _outcome(schedule._selection, {"ranges": arr}, buf, True) == want


def test_range_arrays_of_another_shape_or_dtype_are_refused_by_name():
    buf = next(iter(_buffers().values()))
    for bad in (np.zeros((3,), np.int64), np.zeros((2, 3), np.int64), np.zeros((0, 2), np.int64),
                np.ones((2, 2), np.float64), np.ones((2, 2), bool)):
        with pytest.raises(InputError) as ei:
            schedule._selection({"ranges": bad}, "ops[0]", buf, _Totals(), allow_ranges=True)
        assert ei.value.where == "ops[0].ranges", bad
    huge = np.array([[0, 8], [2 ** 63, 1]], np.uint64)
    with pytest.raises(InputError) as ei:
        schedule._selection({"ranges": huge}, "ops[0]", buf, _Totals(), allow_ranges=True)
    assert ei.value.where == "ops[0].ranges[1]"


def test_a_read_issued_with_range_arrays_records_the_list():
    """The recorded schedule (and its digest) of a read issued with an array is the one its list
    gives; a keep='report' builder without a digest keeps the array (nothing records it)."""
    doc = {"kvrace_schedule": 2, "name": "sel", "buffers": base_buffers(), "streams": ["s0"], "events": [],
           "ops": []}
    name = validate(doc).buffers and sorted(validate(doc).buffers)[0]
    pairs = [[0, 8], [16, 4]]
    as_list, as_array = schedule.ScheduleBuilder(dict(doc)), schedule.ScheduleBuilder(dict(doc))
    streamed = schedule.ScheduleBuilder(dict(doc), max_ops=None, keep_ops=False)
    bare = schedule.ScheduleBuilder(dict(doc), max_ops=None, keep_ops=False, digest=False)
    as_list.add({"op": "read", "stream": "s0", "buffer": name, "ranges": pairs})
    for b in (as_array, streamed, bare):
        op = b.add({"op": "read", "stream": "s0", "buffer": name, "ranges": np.array(pairs)})
    assert as_array.ops[0].raw["ranges"] == pairs and type(as_array.ops[0].raw["ranges"]) is list
    assert as_array.digest() == streamed.digest() == as_list.digest()
    assert isinstance(op.raw["ranges"], np.ndarray)
