"""The forward model: one batch's forward pass as stream ops, in the model's real order.

:func:`issue_forward` issues, on one stream of a :class:`sim.executor.Host`, what
SGLang's model runner launches for a batch (``reference/sglang_hicache.md``
sections 1.2 steps 6-7 and 6): for each layer, for each step of the layer
(:mod:`sim.engine.models`), in order:

1. the step's accessors; if any is gated in the gate map and the batch carries a
   consumer index (``>= 0``), a ``wait`` on that layer's load event of the
   consumer's producer slot, on the forward stream (``wait_until(layer)`` is
   ``current_stream().wait_event(load_events[layer])``).  With consumer ``-1``
   (decode batches, and extends that loaded nothing, as in SGLang) no wait is
   issued: ``wait_until`` returns at once;
2. one ``read`` per pool role the step reads: exactly the bytes of that layer
   the kernel reads for the batch's slots (every field extent of every entry,
   coalesced into ``ranges`` so an 80k-token read is a handful of extents; a
   sliding-window pool only the window before the query tokens:
   ``PoolSpec.read_entries``);
3. the step's ``compute`` op, and after the layer's steps the layer's ``ffn``,
   with durations from the cost model (:mod:`sim.engine.cost`).

NOTE: a second gated accessor of the same layer in one forward would issue a
second wait on the same event on the same stream; it adds no ordering, so it
is issued once per layer (the first gated call places it, which is what
decides a race).

**One-step mode** (``one_step=True``): when nothing can interleave (no copy in
flight into the batch's buffers: :func:`copies_in_flight`), the forward is
issued as one ``read`` per pool role (the same extents over every layer, in
layer order) and one ``compute`` whose duration is the sum of the per-layer
durations (keyed jitter makes them the same numbers).  The bytes every read
sees, the buffers' final bytes and the verdicts are those of the per-layer
mode; only compute op ids and the times of reads inside the forward differ.
It is refused for a batch with a consumer index (its per-layer waits are what
the race verdict is about).  The caller also guarantees that no copy into
these buffers is issued before the forward's last read.

Top-k (:func:`indexer_topk`, :func:`topk_verdict`): the indexer's selection
computed from the bytes a read saw and from the right bytes, so a stale
index-K read that changes the selection is told apart from one that does not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from sim.arrays import unique_sorted
from sim.engine.cost import CostModel, mix64_array, step_cost
from sim.engine.gates import READERS, GateMap
from sim.engine.models import ModelFamily, resolve_options
from sim.errors import InputError, require, show
from sim.pools.layouts import PagedLayout

__all__ = ["BatchRequest", "ForwardBatch", "ForwardIssue", "ReadInfo", "TopkVerdict", "can_advance_in_one_step",
           "coalesce", "copies_in_flight", "entry_bytes", "indexer_topk", "issue_forward", "read_ranges",
           "stand_in_scores", "topk_verdict"]

MODES = ("extend", "decode")


@dataclass(frozen=True)
class BatchRequest:
    """One request of a batch: ``slots[role]`` are the entry indices (token slots, or
    compressed entries for C4/C128 pools) of that pool's device layout its kernels read;
    ``new_tokens`` query tokens computed now, ``context_tokens`` attended."""

    rid: int
    slots: Mapping[str, np.ndarray]
    new_tokens: int
    context_tokens: int


@dataclass(frozen=True)
class ForwardBatch:
    """``mode``: ``extend`` or ``decode``; ``consumer_index``: the producer slot whose
    layer events the gated accessors wait on, ``-1`` when the batch loaded nothing."""

    mode: str
    requests: tuple[BatchRequest, ...]
    consumer_index: int = -1


@dataclass
class ReadInfo:
    """One issued read: its op id, model layer (-1: every layer, one-step mode), the step's
    reader, pool role and buffer, pool layers covered, whether a wait on this layer's event
    preceded it in this forward, and the entries read per request (for top-k and the KV
    oracle), in sequence order; ``first[rid]``: the sequence index of request ``rid``'s first
    entry read (0 when absent: a read from the first entry on; a windowed pool's read starts
    later, ``PoolSpec.read_entries``)."""

    op_id: str
    layer: int
    reader: str
    role: str
    buffer: str
    pool_layers: tuple[int, ...]
    waited: bool
    starts: np.ndarray
    lengths: np.ndarray
    entries: dict[int, np.ndarray]
    first: dict[int, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


@dataclass
class ForwardIssue:
    """What :func:`issue_forward` issued: op ids in issue order as (kind, id, layer);
    ``compute_us``: the cost model's durations issued (one-step mode also adds the launch
    cost of the reads it merged to its compute op, not counted here)."""

    ops: list[tuple[str, str, int]] = field(default_factory=list)
    reads: list[ReadInfo] = field(default_factory=list)
    compute_us: float = 0.0
    one_step: bool = False
    consumer_index: int = -1

    @property
    def last_op(self) -> str:
        return self.ops[-1][1]

    @property
    def exposed_reads(self) -> list[ReadInfo]:
        """Reads of a load-carrying batch issued before any wait on their layer's event in
        this forward (the #22811 class: each races that layer's load copy unless something
        else orders them); empty for a batch that loaded nothing."""
        if self.consumer_index < 0:
            return []
        return [r for r in self.reads if not r.waited]


# ---------------------------------------------------------------- extents

def coalesce(offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, merged byte extents: duplicates dropped, touching or overlapping extents joined."""
    o = np.asarray(offsets, np.int64).ravel()
    n = np.asarray(lengths, np.int64).ravel()
    if o.size == 0:
        return o, n
    if o.size > 1 and not (o[1:] >= o[:-1]).all():
        order = np.argsort(o, kind="stable")
        o, n = o[order], n[order]
    e = o + n
    run_end = np.maximum.accumulate(e)
    new = np.ones(o.size, bool)
    new[1:] = o[1:] > run_end[:-1]
    first = np.flatnonzero(new)
    # a run's end is the running maximum at its last extent (the one before the next run's first)
    last = np.append(first[1:] - 1, o.size - 1)
    return o[first], run_end[last] - o[first]


def read_ranges(layout: PagedLayout, pool_layer: int, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The coalesced byte extents of every field of ``entries`` in ``pool_layer``."""
    offs, lens = layout.token_extents(pool_layer, np.asarray(entries, np.int64))
    return coalesce(offs, lens)


# ---------------------------------------------------------------- in-flight copies

def copies_in_flight(host, buffers: Sequence[str]) -> list[str]:
    """Ids of copies issued so far (on any host and stream) that write one of ``buffers``
    and have not completed: each stream's running op and its queue (a stream is FIFO, so
    these are exactly its unfinished ops)."""
    # NOTE: the cost is the number of unfinished stream ops, so the engine may call it before
    # every forward.
    names = set(buffers)
    return [op.id for op in host.unfinished() if op.op == "copy" and op.dst in names]


def can_advance_in_one_step(host, batch: ForwardBatch, buffers: Mapping[str, tuple[str, PagedLayout]]) -> bool:
    """The one-step condition at issue time: the batch waits on nothing (consumer -1) and no
    copy into its buffers is in flight.  (The caller must also issue no such copy before the
    forward's last read.)"""
    return batch.consumer_index < 0 and not copies_in_flight(host, [name for name, _ in buffers.values()])


# ---------------------------------------------------------------- the forward

def _check_batch(batch: ForwardBatch, model: ModelFamily, layer_events) -> None:
    require(batch.mode in MODES, "batch.mode", f"expected one of {list(MODES)}, got {show(batch.mode)}")
    require(isinstance(batch.consumer_index, int) and batch.consumer_index >= -1, "batch.consumer_index",
            f"expected an integer >= -1, got {show(batch.consumer_index)}")
    require(len(batch.requests) > 0, "batch.requests", "expected at least one request")
    for k, r in enumerate(batch.requests):
        require(r.new_tokens >= 1 and r.context_tokens >= r.new_tokens, f"batch.requests[{k}]",
                f"expected 1 <= new_tokens <= context_tokens, got {r.new_tokens}, {r.context_tokens}")
    if batch.consumer_index >= 0:
        require(layer_events is not None and len(layer_events) == model.n_layers, "layer_events",
                f"a batch with consumer index {batch.consumer_index} waits on its producer slot's layer "
                f"events: expected {model.n_layers} event names (one per layer), got "
                f"{None if layer_events is None else len(layer_events)}")


def _entries(batch: ForwardBatch, pool, window: int) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """The entries of ``pool`` the batch's kernels read per request, and the sequence index
    of each request's first one where it is not 0 (``PoolSpec.read_entries``)."""
    out, first = {}, {}
    for r in batch.requests:
        s = r.slots.get(pool.role)
        if s is not None and len(s):
            ent, f = pool.read_entries(np.asarray(s, np.int64), r.new_tokens, window)
            out[r.rid] = ent
            if f:
                first[r.rid] = f
    return out, first


def _plan(model, gate_map, options, batch, pools, buffers, cost, tp, key):
    """Per layer: [(step, gated, [(role, pool_layer, starts, lengths, entries, first)], compute_us)], ffn_us.

    The durations are ``cost.duration_us(step_cost(...), (*key, layer, step))`` of each layer's
    steps (the ffn's step ``1 << 20``), the same floats: a step's cost depends on its layer
    only through the layer's kind (its steps, their KV bytes and ratio), so each (compute,
    layer kind, KV bytes, ratio) is costed once per batch, and the keyed jitter of every op is
    drawn together (``CostModel.durations_us``).  ``tests/test_speed_forward_plan.py``
    compares them with the per-layer calls on random batches."""
    plan = []
    entries, firsts = {}, {}
    for role in buffers:
        entries[role], firsts[role] = _entries(batch, pools[role], model.dims.window)
    # NOTE: a device layout is layer-major, so the extents of one set of entries in pool layer k
    # are those of pool layer 0 shifted by k * layer_bytes: computed once per role
    base: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    kv_bytes: dict[str, int] = {}
    for role, ent in entries.items():
        if ent:
            allent = unique_sorted(np.concatenate(list(ent.values())))
            base[role] = read_ranges(buffers[role][1], 0, allent)
            kv_bytes[role] = int(base[role][1].sum())
    steps_of: dict[str, tuple] = {}       # layer kind -> its steps (layer_steps)
    gated_of: dict[str, bool] = {}        # step reader -> whether any of its accessors is gated
    nominal: dict[tuple, float] = {}      # (compute, layer kind, KV bytes, ratio) -> nominal_us
    noms, rows = [], []                   # every compute op's nominal_us and (layer, step) key
    for layer in range(model.n_layers):
        lk = model.layer_kinds[layer]
        layer_steps = steps_of.get(lk)
        if layer_steps is None:
            layer_steps = steps_of[lk] = model.layer_steps(layer, batch.mode, options)
        steps = []
        for si, step in enumerate(layer_steps):
            gated = gated_of.get(step.reader)
            if gated is None:
                gated = False
                for acc in READERS[step.reader]:
                    gated = gate_map.is_gated(acc) or gated       # every accessor must be known to the map
                gated_of[step.reader] = gated
            reads = []
            kv = 0
            for role in step.roles:
                if role not in buffers or not entries[role]:
                    continue
                pl = pools[role].pool_layer(layer)
                starts0, lens = base[role]
                starts = starts0 + np.int64(pl) * np.int64(buffers[role][1].layer_bytes)
                reads.append((role, pl, starts, lens, entries[role], firsts[role]))
                kv += kv_bytes[role]
            if step.compute:
                ratio = max((pools[r].tokens_per_entry for r in step.roles if r in pools), default=1)
                if step.compute == "indexer":
                    ratio = pools["index_k"].tokens_per_entry
                ck = (step.compute, lk, kv, ratio)
                nom = nominal.get(ck)
                if nom is None:
                    nom = nominal[ck] = cost.nominal_us(step_cost(step.compute, model.dims, lk, batch.requests, kv,
                                                                  tp, ratio))
                noms.append(nom)
                rows.append((layer, si))
            steps.append((step, gated, reads, step.compute))
        ck = ("ffn", lk, 0, 1)
        nom = nominal.get(ck)
        if nom is None:
            nom = nominal[ck] = cost.nominal_us(step_cost("ffn", model.dims, lk, batch.requests, 0, tp))
        noms.append(nom)
        rows.append((layer, 1 << 20))
        plan.append(steps)
    durations = iter(cost.durations_us(noms, key, rows))
    out = []
    for steps in plan:
        steps = [(step, gated, reads, next(durations) if compute else 0.0) for step, gated, reads, compute in steps]
        out.append((steps, next(durations)))
    return out


def issue_forward(host, stream: str, batch: ForwardBatch, *, model: ModelFamily, gate_map: GateMap,
                  buffers: Mapping[str, tuple[str, PagedLayout]], cost: CostModel,
                  layer_events: Sequence[str] | None = None, options: Mapping[str, str] | None = None,
                  tp: int = 1, one_step: bool = False, tag: str = "fwd",
                  key: Sequence[int] = (0,), before_layer=None) -> ForwardIssue:
    """Issue ``batch``'s forward on ``stream`` through ``host`` (see the module doc).

    ``buffers``: pool role -> (buffer name, device layout); roles the model reads but
    ``buffers`` lacks are not read (their steps still gate).  ``layer_events[layer]``: the
    load event of model layer ``layer`` in the consumer's producer slot (needed when
    ``batch.consumer_index >= 0``).  ``tag`` prefixes op ids (unique per forward);
    ``key`` keys the cost model's jitter (unique per forward).  ``before_layer``: called with
    each model layer's index before that layer's first op is issued (per-layer mode only; the
    engine's overlap loop issues the layer's new-token KV stores there, as the real forward
    writes each layer's KV inside that layer); refused with ``one_step``."""
    options = resolve_options(options)
    _check_batch(batch, model, layer_events)
    pools = model.pools_for(options)
    for role, v in buffers.items():
        require(isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], PagedLayout), f"buffers.{role}",
                f"expected (buffer name, PagedLayout), got {show(v)}")
        require(role in pools, f"buffers.{role}", f"expected a pool role of {model.name}, one of {sorted(pools)}")
        lay = v[1]
        require(lay.layers == len(pools[role].layers), f"buffers.{role}",
                f"layout {lay.name} has {lay.layers} layers; pool {role} of {model.name} has "
                f"{len(pools[role].layers)}")
        for k, r in enumerate(batch.requests):
            s = r.slots.get(role)
            if s is not None and len(s):
                s = np.asarray(s)
                # NOTE: a layout is layer-major, so an entry past the layer's end would silently
                # address the next layer's bytes: refused here
                require(int(s.min()) >= 0 and int(s.max()) < lay.tokens, f"batch.requests[{k}].slots.{role}",
                        f"expected entries in 0..{lay.tokens - 1} (layout {lay.name}), got "
                        f"{int(s.min())}..{int(s.max())}")
    if one_step and batch.consumer_index >= 0:
        raise InputError("one_step", f"batch has consumer index {batch.consumer_index}: its per-layer waits "
                         "decide the race verdict, so it is issued per layer")
    if one_step and before_layer is not None:
        raise InputError("before_layer", "expected None with one_step (a one-step forward has no layers to "
                         "issue ops before)")
    plan = _plan(model, gate_map, options, batch, pools, buffers, cost, tp, tuple(key))
    out = ForwardIssue(one_step=one_step, consumer_index=batch.consumer_index)
    consumer = batch.consumer_index

    def read(op_id, layer, reader, role, pls, waited, starts, lens, ent, first):
        # NOTE: ranges as an (n, 2) array (a host program may; a recorded schedule lists it): a
        # context's read is thousands of pairs, and the list form cost 3-4 % of a long run
        host.issue({"op": "read", "stream": stream, "buffer": buffers[role][0], "id": op_id,
                    "ranges": np.stack([starts, lens], axis=1)})
        out.ops.append(("read", op_id, layer))
        out.reads.append(ReadInfo(op_id, layer, reader, role, buffers[role][0], pls, waited, starts, lens, ent,
                                  first))

    def compute(op_id, layer, us, extra_us=0.0):
        # jitter: false: ``cost`` already applied its keyed jitter (the executor would draw again)
        host.issue({"op": "compute", "stream": stream, "duration_us": us + extra_us, "id": op_id, "jitter": False})
        out.ops.append(("compute", op_id, layer))
        out.compute_us += us

    if one_step:
        per_role: dict[str, list] = {}
        total = 0.0
        for layer, (steps, ffn) in enumerate(plan):
            for step, _g, reads, us in steps:
                for role, pl, starts, lens, ent, first in reads:
                    per_role.setdefault(role, []).append((pl, starts, lens, ent, first))
                total += us
            total += ffn
        for role, parts in per_role.items():
            starts, lens = coalesce(np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]))
            read(f"{tag}.all.{role}", -1, "*", role, tuple(p[0] for p in parts), False, starts, lens, parts[0][3],
                 parts[0][4])
        # NOTE: every read kernel costs the profile's kernel_launch_us before it touches bytes; the
        # launches of the per-layer reads merged away are added to the compute, so the forward ends
        # at the same time in both modes (launch skew, when the profile has one, is not replayed)
        merged = sum(len(p) for p in per_role.values()) - len(per_role)
        compute(f"{tag}.compute", -1, total, merged * host.profile.kernel_launch_us)
        return out

    for layer, (steps, ffn) in enumerate(plan):
        if before_layer is not None:
            before_layer(layer)
        waited = False
        for si, (step, gated, reads, us) in enumerate(steps):
            if gated and consumer >= 0 and not waited:
                wid = f"{tag}.L{layer}.wait"
                host.issue({"op": "wait", "stream": stream, "event": layer_events[layer], "id": wid})
                out.ops.append(("wait", wid, layer))
                waited = True
            for role, pl, starts, lens, ent, first in reads:
                read(f"{tag}.L{layer}.{step.reader}.{role}", layer, step.reader, role, (pl,), waited,
                     starts, lens, ent, first)
            if step.compute:
                compute(f"{tag}.L{layer}.{step.reader}.{step.compute}", layer, us)
        compute(f"{tag}.L{layer}.ffn", layer, ffn)
    return out


# ---------------------------------------------------------------- top-k

def entry_bytes(read_bytes: np.ndarray, info: ReadInfo, layout: PagedLayout, entries: np.ndarray,
                pool_layer: int | None = None, field_name: str | None = None) -> np.ndarray:
    """The bytes ``entries`` had in a read (``read_bytes``: what the read saw, in its
    extents' order), as a ``(len(entries), bytes)`` uint8 array: every field of an entry
    in field order, or only ``field_name``."""
    pl = info.pool_layers[0] if pool_layer is None else pool_layer
    require(pl in info.pool_layers, "pool_layer", f"the read covers pool layers {list(info.pool_layers)}, not {pl}")
    offs, lens = layout.token_extents(pl, np.asarray(entries, np.int64))
    if field_name is not None:
        names = [f.name for f in layout.effective_fields]
        require(field_name in names, "field_name", f"expected one of {names}, got {show(field_name)}")
        j = names.index(field_name)
        offs, lens = offs[:, j:j + 1], lens[:, j:j + 1]
    cum = np.concatenate([[0], np.cumsum(info.lengths)])
    rb = np.asarray(read_bytes, np.uint8)
    parts = []
    for j in range(offs.shape[1]):
        o, width = offs[:, j], int(lens[0, j]) if lens.size else 0
        k = np.searchsorted(info.starts, o, side="right") - 1
        kk = np.maximum(k, 0)
        inside = (k >= 0) & (o + width <= info.starts[kk] + info.lengths[kk])
        require(bool(inside.all()), "entries", "some entry bytes are outside this read")
        pos = cum[kk] + (o - info.starts[kk])
        parts.append(rb[pos[:, None] + np.arange(width)[None, :]])
    return np.concatenate(parts, axis=1) if parts else np.zeros((len(entries), 0), np.uint8)


def stand_in_scores(keys: np.ndarray, query_seed: int = 0) -> np.ndarray:
    """A stand-in for the indexer's score of each entry (row of ``keys``, uint8).

    The real score is a ReLU-weighted sum over 64 heads of q.k with fp8 keys; the model's
    bytes are pattern words, not trained keys, so the stand-in keeps only what the verdict
    needs: a score that is a deterministic function of the entry's bytes and the query
    (``query_seed``), where different bytes give a different score (almost surely).  Each
    8-byte little-endian word (zero-padded) is XORed with a query word and mixed by
    splitmix64; the score is the mean of the mixed words as numbers in [0, 1)."""
    k = np.asarray(keys, np.uint8)
    n, b = k.shape
    pad = (-b) % 8
    if pad:
        k = np.concatenate([k, np.zeros((n, pad), np.uint8)], axis=1)
    words = np.ascontiguousarray(k).view("<u8")
    with np.errstate(over="ignore"):
        q = mix64_array(np.arange(words.shape[1], dtype=np.uint64) + np.uint64(int(query_seed) & ((1 << 64) - 1)))
        mixed = mix64_array(words ^ q[None, :])
    return ((mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)).mean(axis=1) if words.shape[1] \
        else np.zeros(n)


def indexer_topk(keys: np.ndarray, k: int, query_seed: int = 0) -> np.ndarray:
    """Positions (rows of ``keys``) of the ``k`` highest stand-in scores, ties to the lower
    position, returned sorted (the selection, as a set)."""
    s = stand_in_scores(keys, query_seed)
    order = np.lexsort((np.arange(s.size), -s))
    return np.sort(order[:min(int(k), s.size)])


@dataclass(frozen=True)
class TopkVerdict:
    """``seen``/``right``: selections from the bytes read and from the right bytes;
    ``differing``: rows whose bytes differ; ``changed``: the selections differ."""

    seen: np.ndarray
    right: np.ndarray
    differing: int
    changed: bool
    selected_differing: int      # differing rows inside the seen selection


def topk_verdict(seen_keys: np.ndarray, right_keys: np.ndarray, k: int, query_seed: int = 0) -> TopkVerdict:
    """Top-k from the bytes a read saw vs from the right bytes (both ``(entries, bytes)``)."""
    a, b = np.asarray(seen_keys, np.uint8), np.asarray(right_keys, np.uint8)
    require(a.shape == b.shape, "keys", f"seen {a.shape} and right {b.shape} differ in shape")
    diff = (a != b).any(axis=1)
    s, r = indexer_topk(a, k, query_seed), indexer_topk(b, k, query_seed)
    return TopkVerdict(s, r, int(diff.sum()), not np.array_equal(s, r), int(diff[s].sum()))
