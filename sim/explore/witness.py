"""Witnesses: an explored order as a schedule that a GPU (or the simulator) runs in that order.

The format is controlled replay's (``sim.replay.controlled_schedule``): the schedule's
copies split at item boundaries into copies of the same routine over the sliced indices
(ids ``COPY#a-b``), and record -> wait pairs (``rec_forceN`` / ``wait_forceN``) that force
every racing pair into the witness's order.  Such a schedule has no latent race left, so
``kvrace schedule run`` predicts the outcome's bytes under any timing and
``kvrace replay --mode controlled`` runs it on a GPU and compares byte for byte.  (Its
reads are ``ok`` against its own happens-before order, which is now the witness's order;
the outcome's bytes are in ``--snapshot`` and in each read's ``provenance_sha256``, equal
to the explorer's.)

How it is built: the schedule becomes one host's program (every op issued by host
``host`` in list order; ``host_delay`` and ``barrier`` ops dropped: the first only times
the issue, the second orders nothing one host's program order does not), so every stream
runs its ops in list order and every forced wait is issued after its record (with several
hosts, a host that issues earlier in time would issue a wait before the record it should
bind to: a no-op in CUDA).  This adds happens-before (a host op now precedes every later
op), never removes any; an order it contradicts is refused.  Then the copies that race are split (into consecutive copies on their stream,
which orders nothing new) at the block boundaries the order needs (a boundary is needed
when a node of an op racing that copy lands between the two blocks), then
``controlled_schedule`` is run on that schedule with a run whose clock is the order's
position: each node lands at its position, so the order is the run's order.  The witness is
checked by simulating it (no race with a read or write left; its happens-before order
gives the order's reads and final buffers, by provenance).

Not every order can be forced: a boundary inside an item (a torn read: controlled replay
forces item boundaries, never bytes inside an item), or an order that streams and events
cannot express without moving an op across a host op (``ReplayError``).  Those come back
as ``None`` with the reason.
"""
from __future__ import annotations

import numpy as np

from sim.executor import RunResult, run_reference
from sim.explore.evaluate import Evaluation, Evaluator, outcome_key
from sim.hb import latent_races
from sim.verdicts import read_digest
from sim.explore.model import RaceModel
from sim.replay import ReplayError, controlled_schedule
from sim.schedule import DEFAULT_HOST, validate
from sim.transfers.routines import slice_items

__all__ = ["witness_schedule"]


def _needed_cuts(model: RaceModel, order: list[int]) -> dict[int, list[int]]:
    """Per racing copy (op index): the block indices ``k`` whose start must be a cut."""
    pos = {u: i for i, u in enumerate(order)}
    partners: dict[int, set] = {}
    for u, v in model.pairs:
        partners.setdefault(model.nodes[u].op, set()).add(v)
        partners.setdefault(model.nodes[v].op, set()).add(u)
    cuts: dict[int, list[int]] = {}
    for op, ids in model.op_nodes.items():
        if len(ids) < 2:
            continue
        others = sorted(pos[w] for w in partners.get(op, ()))
        need = []
        for k in range(1, len(ids)):
            lo, hi = pos[ids[k - 1]], pos[ids[k]]
            j = int(np.searchsorted(others, lo, side="right"))
            if j < len(others) and others[j] < hi:
                need.append(k)
        if need:
            cuts[op] = need
    return cuts


def witness_schedule(model: RaceModel, order: list[int], evaluation: Evaluation | None = None,
                     evaluator: Evaluator | None = None) -> tuple[dict | None, str | None]:
    """``(document, None)``: a controlled schedule forcing ``order``; ``(None, reason)`` when
    it cannot be forced (see the module doc)."""
    s = model.schedule
    cuts = _needed_cuts(model, order)
    for op, ks in cuts.items():
        for k in ks:
            node = model.nodes[model.op_nodes[op][k]]
            if node.first[1] != 0:
                return None, (f"copy {s.ops[op].id} is cut inside item {node.first[0]} (at byte {node.first[1]}): "
                              "a torn read; controlled replay forces item boundaries only")
    # the schedule with the racing copies split at the needed cuts
    doc = s.to_json()              # fresh dicts per op (their nested values are not modified)
    doc["hosts"] = [DEFAULT_HOST]
    seg_of: dict[int, str] = {}            # node id -> id of the (split) op it belongs to
    new_ops = []
    for op in s.ops:
        d = doc["ops"][op.index]
        if op.op in ("host_delay", "barrier"):
            continue
        d["host"] = DEFAULT_HOST
        ids = model.op_nodes.get(op.index)
        ks = cuts.get(op.index)
        if not ks:
            new_ops.append(d)
            for nid in ids or ():
                seg_of[nid] = op.id
            continue
        n_items = int(op.plan.extents.n_items)
        bounds = [0] + [model.nodes[ids[k]].first[0] for k in ks] + [n_items]
        starts = [0] + list(ks) + [len(ids)]
        for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg = {**d, "id": f"{op.id}#{a}-{b}", "args": slice_items(op.routine, op.args, a, b)}
            new_ops.append(seg)
            for nid in ids[starts[j]:starts[j + 1]]:
                seg_of[nid] = seg["id"]
    doc["ops"] = new_ops
    doc["name"] = f"{s.name}.split"
    split = validate(doc)
    # the order's clock: every op lands at the position of its first node
    at: dict[str, float] = {}
    for p, nid in enumerate(order):
        at.setdefault(seg_of[nid], float(p))
    timings, item_end, access_us, access_seq = {}, {}, {}, {}
    for op in split.ops:
        if op.id not in at:
            continue
        t = at[op.id]
        if op.op == "copy":
            timings[op.id] = (t, t + 0.5)
            item_end[op.id] = np.full(int(op.plan.extents.n_items), t + 0.5)
        else:
            timings[op.id] = (t, t)
            access_us[op.id] = t
            access_seq[op.id] = int(t)
    ev = evaluation if evaluation is not None else (evaluator or Evaluator(model)).run(order)
    by_id = {r.op_id: r for r in ev.reads}
    reads = [by_id[op.id] for op in split.ops if op.op == "read"]
    run = RunResult(split, None, ev.memory, reads, timings, [], [], float(len(order)), item_end, access_us,
                    access_seq, torn=False)
    try:
        out = controlled_schedule(split, run, verify=False)
        reason = _verify(split, out, ev)
    except ReplayError as e:
        return None, str(e)
    if reason:
        return None, reason
    out["name"] = s.name + ".witness"
    return out, None


def _verify(split, doc: dict, ev: Evaluation) -> str | None:
    """What ``controlled_schedule(verify=True)`` checks, by provenance instead of bytes (equal
    provenance, equal bytes; no bytes are materialised): no read or write races any more, and
    the witness's happens-before order gives the outcome's reads and final buffers."""
    cs = validate(doc)
    left = [r for r in latent_races(cs) if {cs.ops[r["a"].op].op, cs.ops[r["b"].op].op} & {"read", "write"}]
    if left:
        r = left[0]
        return f"the forced schedule still races: {cs.ops[r['a'].op].id} vs {cs.ops[r['b'].op].id}"
    ref = run_reference(cs, materialise=False)
    want = {r.op_id: read_digest(r) for r in ev.reads}
    got = {r.op_id: read_digest(r) for r in ref.reads}
    if got != want:
        return "the forced schedule does not reproduce the order's reads"
    if outcome_key(ref.reads, ref.memory)[1] != ev.key[1]:
        return "the forced schedule does not reproduce the order's final buffers"
    return None
