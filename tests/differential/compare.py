"""The canonical observation of one side after an op, and the op-by-op comparison.

:func:`observe` reads only names both trees share with SGLang 0.5.14 (``root_node``,
``children``, ``key.raw_token_ids()``, ``key.extra_key``, ``value``, ``host_value``, ``lock_ref``,
``host_ref_counter``, ``hit_count``, ``last_access_time``, ``write_through_pending_id``,
``evictable_leaves``, ``evictable_host_leaves``, ``ongoing_write_through``,
``ongoing_load_back``, ``evictable_size()``, ``protected_size()``, the controller's queues
and layer-done counter, the allocator's ``free_pages`` / ``release_pages`` and the host
pool's ``free_slots``).  Nodes are named by their path: the edges from the root to the
node's end, each its key's raw tokens after its ``extra_key`` when set (``"root"`` for the
root; :func:`edge`), so node ids need not agree.  The plain ``RadixCache`` (no
``cache_controller``) is observed without the host-tier fields (``evictable_host_leaves``,
``ongoing_*``, ``acks``, the queues, the producer and ``host_free``).

An observation is a dict of plain data:

* ``tree``: nested ``[the edge (extra key, tokens), state, lock_ref, host_ref_counter, hit_count,
  priority, device slots, host slots, write-through pending, children]``, children in key order;
  state ``D`` (device only), ``DH`` (device + host), ``H`` (host only);
* ``evictable_size``, ``protected_size``;
* ``evictable_leaves`` / ``evictable_host_leaves``: sorted paths;
* ``access_order``: every node's path, by last-access time (the LRU order eviction uses);
  ``creation_order``: by creation time (FIFO / FILO);
* ``ongoing_write_through``: sorted (lock node, backed-up length, covered nodes);
  ``ongoing_load_back``: sorted paths;
* ``acks``: per queue, each ack's (done, node paths of its node ids);
  ``load_queue`` / ``write_queue`` lengths, ``producer_index``, producer slots done;
* ``requests`` (while the request ops run any): per running request, by number, its row
  (``req_pool_idx``), ``fill_len``, ``kv_committed_len``, ``cache_protected_len``,
  ``prefix_indices``, ``last_node``'s path and its row's slots up to its longer length;
  ``req_free``: the request-to-token table's free rows in order;
* ``device_free``: ``free_pages`` and ``release_pages`` in order, ``available_size``;
  ``host_free``: ``free_slots`` in order, ``available_size``;
* ``result``: the op's result (``SideDriver.apply``); ``moves``: the slots the op moved
  (device/host alloc/free in call order); ``copies``: the write and load copies it issued
  (host and device indices), in issue order (the device indices of tied host indices sorted:
  :func:`_ties_sorted`).
"""
from __future__ import annotations

from typing import Any

__all__ = ["observe", "diff", "format_diff", "compress", "run_pair", "edge"]


def _lst(side, arr):
    return side.as_list(arr)


def edge(side, node) -> list:
    """A node's part of its path: its key's raw tokens, after its ``extra_key`` when it has
    one (namespaced sequences with the same tokens are different nodes)."""
    extra = node.key.extra_key
    return ([] if extra is None else [str(extra)]) + side.token_list(node.key)


def _kids(side, node) -> list:
    return sorted(node.children.values(), key=lambda ch: [str(x) for x in edge(side, ch)])


def _nodes(side):
    """(path, node) for every node, parents first, children in key order."""
    out = []
    root = side.root()

    def walk(node, path):
        out.append((path, node))
        for ch in _kids(side, node):
            walk(ch, path + tuple(edge(side, ch)))

    walk(root, ())
    return out


def _state(node) -> str:
    if node.value is None:
        return "H" if node.host_value is not None else "-"
    return "DH" if node.host_value is not None else "D"


def _name(path) -> Any:
    return "root" if path == () else list(path)


def observe(side, result=None, moves=None) -> dict:
    cache = side.cache_obj()
    nodes = _nodes(side)
    path_of = {id(n): p for p, n in nodes}
    by_id = {n.id: p for p, n in nodes}
    root = side.root()

    def tree(node):
        return [edge(side, node), _state(node), int(node.lock_ref), int(node.host_ref_counter),
                int(node.hit_count), int(node.priority), _lst(side, node.value), _lst(side, node.host_value),
                node.write_through_pending_id is not None, [tree(ch) for ch in _kids(side, node)]]

    def pname(node):
        p = path_of.get(id(node))
        return "<detached>" if p is None else _name(p)

    def idname(i):
        p = by_id.get(i)
        return "<gone>" if p is None else _name(p)

    alloc = side.allocator_obj()
    moves = list(moves or [])
    obs = {
        "result": result,
        # NOTE: slot moves and copies are kept apart: with the direct io backend kvrace issues
        # a backup's copy when the call settles (after SGLang's blocking index D2H), i.e.
        # after bookkeeping the same call does later in Python; within one call nothing else
        # touches those slots, so only each list's own order is compared (FINDINGS.md, F1)
        "moves": [m for m in moves if not m[0].endswith("_copy")],
        "copies": [_ties_sorted(m) for m in moves if m[0].endswith("_copy")],
        "tree": [tree(ch) for ch in _kids(side, root)],
        "evictable_size": int(cache.evictable_size()),
        "protected_size": int(cache.protected_size()),
        "evictable_leaves": sorted((pname(n) for n in cache.evictable_leaves), key=str),
        "access_order": [_name(p) for p, n in sorted(nodes, key=lambda pn: pn[1].last_access_time)],
        "creation_order": [_name(p) for p, n in sorted(nodes, key=lambda pn: pn[1].creation_time)],
        "device_free": {"free_pages": _lst(side, alloc.free_pages), "release_pages": _lst(side, alloc.release_pages),
                        "available_size": int(alloc.available_size())},
    }
    reqs = getattr(side, "reqs", None)
    if reqs:
        obs["requests"] = [
            [n, q.req_pool_idx, int(q.fill_len), int(q.kv_committed_len), int(q.cache_protected_len),
             _lst(side, q.prefix_indices), pname(q.last_node),
             _lst(side, side.req_pool.req_to_token[q.req_pool_idx, :max(q.fill_len, q.kv_committed_len)])]
            for n, q in sorted(reqs.items())]
    if getattr(side, "req_pool", None) is not None:
        obs["req_free"] = [int(i) for i in side.req_pool.free_slots]
    ctl = getattr(cache, "cache_controller", None)
    if ctl is None:              # the plain RadixCache: no host tier to observe
        return obs
    counter = ctl.layer_done_counter
    host = side.host_obj()
    acks = {}
    for q, queue in (("write", ctl.ack_write_queue), ("load", ctl.ack_load_queue)):
        acks[q] = [[bool(side.event_done(a[1])), [idname(i) for i in a[2]]] for a in queue]
    obs.update({
        "evictable_host_leaves": sorted((pname(n) for n in cache.evictable_host_leaves), key=str),
        "ongoing_write_through": sorted(
            ([idname(k), pname(v[0]), int(v[1]), [pname(x) for x in v[2]]]
             for k, v in cache.ongoing_write_through.items()), key=str),
        "ongoing_load_back": sorted((pname(v) for v in cache.ongoing_load_back.values()), key=str),
        "acks": acks,
        "load_queue": len(ctl.load_queue),
        "write_queue": len(ctl.write_queue),
        "producer_index": int(counter.producer_index),
        "slots_done": [bool(side.event_done(e.finish_event)) for e in counter.events],
        "host_free": {"free_slots": _lst(side, host.free_slots), "available_size": int(host.available_size())},
    })
    return obs


def _ties_sorted(copy):
    """A copy ``(kind, host indices, device indices)`` with the device indices of each run of
    equal consecutive host indices sorted.

    NOTE: host indices repeat only past F2 (host slots owned twice); the direct backend's
    ``layer_first`` path sorts the host indices with torch's ``sort``, which is not stable, so
    tied pairs come in an order of torch's own, kvrace's stable sort keeps them in list order.
    Each pair copies the same host slot to its device slot whichever comes first, so the
    copy is the same (FINDINGS.md F3)."""
    kind, host, dev = copy
    if host is None or dev is None or len(host) != len(dev) or len(set(host)) == len(host):
        return copy
    out, i = list(dev), 0
    while i < len(host):
        j = i + 1
        while j < len(host) and host[j] == host[i]:
            j += 1
        if j - i > 1:
            out[i:j] = sorted(out[i:j])
        i = j
    return (kind, host, out)


def _canon(x):
    if isinstance(x, tuple):
        return [_canon(v) for v in x]
    if isinstance(x, list):
        return [_canon(v) for v in x]
    if isinstance(x, dict):
        return {k: _canon(v) for k, v in x.items()}
    return x


def diff(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """The fields where two observations differ: (field, a's value, b's value)."""
    out = []
    for k in a:
        va, vb = _canon(a.get(k)), _canon(b.get(k))
        if va != vb:
            out.append((k, va, vb))
    for k in b:
        if k not in a:
            out.append((k, None, _canon(b[k])))
    return out


def compress(x):
    """Long runs of equal ints as ``"7x64"`` strings (page-64 keys stay readable)."""
    if isinstance(x, (list, tuple)):
        if len(x) > 8 and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
            out, i = [], 0
            while i < len(x):
                j = i
                while j < len(x) and x[j] == x[i]:
                    j += 1
                out.append(f"{x[i]}x{j - i}" if j - i > 1 else x[i])
                i = j
            return out
        return [compress(v) for v in x]
    if isinstance(x, dict):
        return {k: compress(v) for k, v in x.items()}
    return x


def format_diff(d: list, names=("sglang", "kvrace")) -> str:
    lines = []
    for field, va, vb in d:
        lines.append(f"  {field}:")
        lines.append(f"    {names[0]}: {compress(va)}")
        lines.append(f"    {names[1]}: {compress(vb)}")
    return "\n".join(lines)


def _mirror(sg, kv) -> None:
    sg.mirror(kv.ack_done("write"), kv.ack_done("load"), kv.slot_done())


def _kindless(result):
    return ("raise",) if isinstance(result, tuple) and result and result[0] == "raise" else result


def run_pair(cfg, ops: list[dict], *, stop_at_first: bool = True, error_kind: bool = True):
    """Run ``ops`` on SGLang's HiRadixCache and kvrace's (their plain ``RadixCache`` when
    ``cfg.hicache`` is False), observing both after each op.

    Transfers: a ``complete``/``complete_all`` op runs on the kvrace side (simulated time
    advances until the acks' copies have finished); after every op, whatever transfer
    completion kvrace reached is mirrored onto the SGLang side (ack by ack, by queue
    position, and per producer slot).  ``error_kind=False``: a failing op on both sides
    agrees whatever the exception kinds (to look past FINDINGS.md F2's).  Returns a list of
    divergences
    ``(index, op, diff, sglang observation, kvrace observation)`` (the first only, by
    default)."""
    from tests.differential.kvrace_side import KvraceSide
    from tests.differential.ops import SideDriver
    from tests.differential.sglang_side import SGLangSide

    sg, kv = SGLangSide(cfg), KvraceSide(cfg)
    dsg, dkv = SideDriver(sg), SideDriver(kv)
    out = []
    for i, op in enumerate(ops):
        if op["op"] in ("complete", "complete_all"):
            rk = dkv.apply(op)
            rs = ("ok",) if op["op"] == "complete" else dsg.apply(op)
        else:
            rs = dsg.apply(op)
            rk = dkv.apply(op)
        if cfg.hicache:
            _mirror(sg, kv)
        if not error_kind:
            rs, rk = _kindless(rs), _kindless(rk)
        a = observe(sg, rs, sg.take_moves())
        b = observe(kv, rk, kv.take_moves())
        d = diff(a, b)
        if d:
            out.append((i, op, d, a, b))
            if stop_at_first:
                break
    return out
