"""Regenerate ``examples/bugs/``: real ordering bugs as schedules, each before and after its fix.

Every entry of :data:`BUGS` is one bug of ``docs/bugs.md`` that a schedule can show: the ops
and streams the bug's thread describes, cut down to one or two requests and a few pages.
``SLUG.json`` is the order with the bug, ``SLUG_fixed.json`` the same ops with the fix's
waits, records or syncs added (nothing else differs).  ``kvrace schedule run`` on the first
reports the races and the reads named in :data:`BUGS` (stale or torn); on the second, none.
``kvrace replay --mode controlled`` takes both to a GPU.  :data:`STALLS` are bugs that cost
time, not bytes: their fix moves ops, and they show under the profile written beside them
(``h200_submission.toml``, ``link.sharing = "submission"``).

NOTE: the PD and LMCache transfers (``rdma``, ``nixl`` streams) are copies between two device
buffers of device 0: the transfer engine's RDMA runs outside CUDA stream order, which a
stream of its own models (as the engine's PD transfer does), and one device lets the GPU
runner replay the file on one GPU.  Which orders hold does not depend on the buffers' device.

    python examples/make_bug_examples.py            # rewrites examples/bugs/
    python examples/make_bug_examples.py --check    # exit 1 if a file is out of date
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, NamedTuple

from sim.report_io import regenerate

OUT = Path(__file__).with_name("bugs")
PAGE_BYTES = 4096        # one page of one layer: a unit of every buffer here


class Bug(NamedTuple):
    """One bug as a schedule pair: ``build(fixed)`` makes either document.  With the bug,
    ``races`` (pairs of op ids) are its latent races, and the reads ``stale`` (op ids) are
    the ones that differ (stale or torn) on the default profile (``h200``); on another
    profile's timing some of ``at_risk`` differ (default: ``stale``).  With the fix no read
    differs and no race is left, on any profile."""
    slug: str
    reference: str
    build: Callable[[bool], dict]
    stale: tuple[str, ...]
    races: tuple[tuple[str, str], ...]
    at_risk: tuple[str, ...] = ()


def device(name: str, layers: int, pages: int, kind: str = "kv") -> dict:
    return {"name": name, "location": "device", "kind": kind,
            "layout": {"kind": "paged", "name": f"rows_{PAGE_BYTES}", "layers": layers, "pages": pages,
                       "page_bytes": PAGE_BYTES}}


def host(name: str, layers: int, units: int, owner: int | None = None, kind: str = "kv") -> dict:
    b = {"name": name, "location": "host", "kind": kind,
         "layout": {"kind": "host", "layout": "layer_first", "layers": layers, "units": units,
                    "unit_bytes": PAGE_BYTES}}
    if owner is not None:
        b["init"] = [{"layers": "all", "indices": {"start": 0, "count": units}, "owner": owner,
                      "version": 1, "first_unit": 0}]
    return b


def barrier(name: str, hosts: list[str]) -> list[dict]:
    """The barrier ``name``: one op per participating host (each host reaches it itself)."""
    return [{"id": f"{name}@{h}", "op": "barrier", "barrier": name, "hosts": hosts, "host": h} for h in hosts]


def span(start: int, count: int) -> dict:
    return {"start": start, "count": count}


def copy(id_: str, stream: str, src: str, dst: str, layer: int, src_units: dict, dst_units: dict,
         host_: str | None = None) -> dict:
    op = {"id": id_, "op": "copy", "stream": stream, "routine": "kernel_per_layer", "src": src, "dst": dst,
          "args": {"layer": layer, "src_indices": src_units, "dst_indices": dst_units}}
    if host_:
        op["host"] = host_
    return op


def doc(name: str, description: str, buffers: list, streams: list, events: list, ops: list,
        hosts: list | None = None) -> dict:
    d = {"kvrace_schedule": 2, "name": name, "description": description, "buffers": buffers,
         "streams": streams, "events": events, "ops": ops}
    if hosts:
        d["hosts"] = hosts
    return d


def title(slug: str, fixed: bool) -> str:
    return f"{slug}_fixed" if fixed else slug


# ---------------------------------------------------------------- the bugs

def pd_early_send(fixed: bool) -> dict:
    """SGLang #33970 (PD, Mooncake): every prefill chunk but the last is RDMA-read while the
    forward that writes its pages may still run; the final chunk is safe behind the sampling's
    ``copy_done.synchronize()``."""
    L, H = 2, "transfer"
    ops = []
    for c, (first, final) in enumerate(((0, False), (2, True)), start=1):
        ops += [{"id": f"chunk{c}_forward", "op": "compute", "stream": "forward", "duration_us": 30.0,
                 "jitter": False},
                {"id": f"chunk{c}_store_kv", "op": "write", "stream": "forward", "buffer": "prefill_kv",
                 "layers": list(range(L)), "units": [first, first + 1], "owner": 7, "version": 1}]
        if final or fixed:
            # NOTE: the fix records an event for the non-final chunk too; the final chunk had one
            ops.append({"id": f"chunk{c}_done", "op": "record", "stream": "forward", "event": f"chunk{c}_done"})
        if final:
            ops.append({"id": "copy_done_synchronize", "op": "host_sync", "event": f"chunk{c}_done"})
        ops += barrier(f"send_chunk{c}", ["host", H])
        if fixed and not final:
            ops.append({"id": f"chunk{c}_wait_event", "op": "host_sync", "event": f"chunk{c}_done", "host": H})
        ops += [copy(f"rdma_chunk{c}_L{l}", "rdma", "prefill_kv", "decode_kv", l, span(first, 2),
                     span(first, 2), H) for l in range(L)]
    ops += [{"id": "kv_sent", "op": "record", "stream": "rdma", "event": "kv_sent", "host": H},
            {"id": "poll_success", "op": "host_sync", "event": "kv_sent", "host": H},
            *barrier("decode_join", [H, "decode"])]
    ops += [{"id": f"decode_read_chunk{c}_L{l}", "op": "read", "stream": "decode", "buffer": "decode_kv",
             "layer": l, "units": [2 * c - 2, 2 * c - 1], "host": "decode"} for l in range(L) for c in (1, 2)]
    what = ("the fix: the non-final chunk records an event on the forward stream and the transfer thread "
            "synchronizes on it before the RDMA read" if fixed else
            "the bug: the non-final chunk records nothing and the Mooncake transfer thread reads its pages at once, "
            "while the forward that writes them still runs")
    return doc(title("pd_early_send", fixed),
               "SGLang #33970 (PD disaggregation with Mooncake): a prefill of two chunks (pages 0-1, then 2-3) "
               "is sent to the decode side chunk by chunk; the final chunk is sent after the sampling's "
               f"copy_done.synchronize(). Here {what}. With the bug the decode side reads the first chunk's "
               "pages stale and the final chunk's right: the corruption ends exactly at the chunk boundary.",
               [device("prefill_kv", L, 4), device("decode_kv", L, 4)],
               ["forward", "rdma", "decode"], ["chunk1_done", "chunk2_done", "kv_sent"], ops,
               hosts=["host", H, "decode"])


def pd_buffer_store_unsynced(fixed: bool) -> dict:
    """LMCache #5048 (fix #5049; the reference lists #2181 for this class): ``from_gpu`` copies
    the KV into the GPU ``pd_buffer`` on ``store_stream`` and skips ``store_stream.synchronize()``
    for a CUDA destination; the NIXL sender thread reads the buffer at once."""
    L, H = 4, "sender"
    ops = [{"id": "forward", "op": "compute", "stream": "forward", "duration_us": 30.0, "jitter": False},
           {"id": "store_kv_req9", "op": "write", "stream": "forward", "buffer": "paged_kv",
            "layers": list(range(L)), "units": [0, 1, 2, 3], "owner": 9, "version": 1},
           # NOTE: the store copies what the forward wrote, so its stream waits for the forward
           # (the thread's report is about the other side of the copy)
           {"id": "kv_written", "op": "record", "stream": "forward", "event": "kv_written"},
           {"id": "store_waits_forward", "op": "wait", "stream": "store", "event": "kv_written"}]
    ops += [copy(f"from_gpu_L{l}", "store", "paged_kv", "pd_buffer", l, span(0, 4), span(0, 4))
            for l in range(L)]
    if fixed:
        ops.append({"id": "store_stream_synchronize", "op": "host_sync", "stream": "store"})
    ops += barrier("send", ["host", H])
    ops += [copy(f"nixl_write_L{l}", "nixl", "pd_buffer", "decode_kv", l, span(0, 4), span(0, 4), H)
            for l in range(L)]
    ops += [{"id": "sent", "op": "record", "stream": "nixl", "event": "sent", "host": H},
            {"id": "transfer_done", "op": "host_sync", "event": "sent", "host": H}]
    ops += [{"id": f"decode_read_L{l}", "op": "read", "stream": "decode", "buffer": "decode_kv", "layer": l,
             "units": [0, 1, 2, 3], "host": H} for l in range(L)]
    what = ("the fix: store_stream.synchronize() for every destination, CUDA included" if fixed else
            "the bug: the pd_buffer is on the GPU, so the synchronize is skipped and the sender reads the buffer "
            "while the store stream still fills it")
    return doc(title("pd_buffer_store_unsynced", fixed),
               "LMCache #5048 / #5049 (PD through NIXL, pd_buffer_device = cuda): from_gpu copies request 9's KV "
               "(4 pages, 4 layers) into the GPU pd_buffer on store_stream (non_blocking); a sender thread then "
               f"RDMA-writes the buffer to the decode side, outside CUDA stream order. Here {what}. With the bug "
               "the decode side receives the buffer's bytes from before the store: here every layer, since the "
               "sender reads while the forward the store waits for still runs (the thread saw chunks partly stale "
               "and partly fresh: the store had filled some of them).",
               [device("paged_kv", L, 4), device("pd_buffer", L, 4), device("decode_kv", L, 4)],
               ["forward", "store", "nixl", "decode"], ["kv_written", "sent"], ops, hosts=["host", H])


def mamba_cow_before_load(fixed: bool) -> dict:
    """SGLang #36743: a deferred whole-slot state copy-on-write reads its source slot while the
    HiCache load-back still restores it layer by layer; the per-layer waits come later."""
    L = 4
    ops = [{"id": "start_event", "op": "record", "stream": "forward", "event": "start_loading"},
           {"id": "load_waits_start", "op": "wait", "stream": "load", "event": "start_loading"}]
    for l in range(L):
        ops += [copy(f"load_state_L{l}", "load", "host_state", "dev_state", l, span(0, 1), span(1, 1)),
                {"id": f"layer{l}_loaded", "op": "record", "stream": "load", "event": f"layer{l}_loaded"}]
    if fixed:
        ops.append({"id": "wait_for_hicache_load_complete", "op": "wait", "stream": "forward",
                    "event": f"layer{L - 1}_loaded"})
    ops.append({"id": "cow_whole_slot", "op": "copy", "stream": "forward", "routine": "kernel_all_layer",
                "src": "dev_state", "dst": "dev_state", "args": {"src_indices": span(1, 1), "dst_indices": span(2, 1)}})
    for l in range(L):
        ops += [{"id": f"wait_until_L{l}", "op": "wait", "stream": "forward", "event": f"layer{l}_loaded"},
                {"id": f"read_state_L{l}", "op": "read", "stream": "forward", "buffer": "dev_state", "layer": l,
                 "units": [2]}]
    what = ("the fix: the forward stream waits for the load's final layer event first "
            "(wait_for_hicache_load_complete)" if fixed else
            "the bug: the copy runs as soon as the load starts; the model's per-layer waits come after it "
            "and order nothing for the copied slot")
    return doc(title("mamba_cow_before_load", fixed),
               "SGLang #36743 (HiCache with a hybrid Mamba model): request 11's recurrent state is loaded back "
               "layer by layer from the host pool into device slot 1 (one event per layer); the deferred "
               "copy-on-write then copies the whole slot (every layer) to the request's own slot 2, which the "
               f"forward reads layer by layer behind wait_until. Here {what}. With the bug the copy (one kernel over "
               "every layer) takes the layers the load had not yet restored from the slot's previous owner (layers "
               "2 and 3 on the default profile; which ones depends on the copies' timing): a partly restored state.",
               [host("host_state", L, 1, owner=11, kind="state"), device("dev_state", L, 3, kind="state")],
               ["forward", "load"], ["start_loading"] + [f"layer{l}_loaded" for l in range(L)], ops)


def backup_source_race(fixed: bool) -> dict:
    """SGLang #20611 (not merged; 0.5.14's ``start_writing`` has the first wait): the
    write-through D2H backup runs on the write stream unordered with the forward that writes
    the KV it copies, and the next forward writes the pages while the copy reads them."""
    L = 2
    ops = [{"id": "fa3_forward", "op": "compute", "stream": "forward", "duration_us": 20.0, "jitter": False},
           {"id": "store_kv_req5", "op": "write", "stream": "forward", "buffer": "dev_kv",
            "layers": list(range(L)), "units": [0, 1], "owner": 5, "version": 1}]
    if fixed:
        ops += [{"id": "forward_done", "op": "record", "stream": "forward", "event": "forward_done"},
                {"id": "write_stream_wait_forward", "op": "wait", "stream": "write", "event": "forward_done"}]
    ops += [{"id": "backup_req5", "op": "copy", "stream": "write", "routine": "kernel_all_layer", "src": "dev_kv",
             "dst": "host_kv", "args": {"src_indices": span(0, 2), "dst_indices": span(0, 2)}},
            {"id": "last_write_finish", "op": "record", "stream": "write", "event": "last_write_finish"}]
    if fixed:
        ops.append({"id": "forward_wait_write", "op": "wait", "stream": "forward", "event": "last_write_finish"})
    ops += [{"id": "next_forward", "op": "compute", "stream": "forward", "duration_us": 5.0, "jitter": False},
            {"id": "store_kv_req6", "op": "write", "stream": "forward", "buffer": "dev_kv",
             "layers": list(range(L)), "units": [0, 1], "owner": 6, "version": 1},
            {"id": "ack_write", "op": "host_sync", "event": "last_write_finish"}]
    ops += [{"id": f"host_read_L{l}", "op": "read", "stream": "write", "buffer": "host_kv", "layer": l,
             "units": [0, 1]} for l in range(L)]
    what = ("the fix: the write stream waits for the forward (write_stream.wait_stream(forward_stream)) and the "
            "next forward for the backup's finish event" if fixed else
            "the bug: neither stream waits for the other")
    return doc(title("backup_source_race", fixed),
               "SGLang #20611 (HiCache write-through, FA3 on Hopper): the forward writes request 5's KV into "
               "device pages 0-1 while the write stream backs those pages up to the host (D2H); the next forward "
               f"writes request 6's KV into the same pages. Here {what}. With the bug the host copy holds the "
               "pages' bytes from before request 5's store (what a later load-back would restore). The thread's "
               "symptom, an illegal memory access in the FA3 kernel, is not modelled; the unordered accesses are.",
               [device("dev_kv", L, 2), host("host_kv", L, 2)],
               ["forward", "write"], ["forward_done", "last_write_finish"], ops)


def load_unfenced_overlap(fixed: bool) -> dict:
    """SGLang #36738 (with #36572): under the overlap scheduler a page freed by the CPU is still
    written by the round the GPU is running when the load-back's H2D restores another
    request's prefix into it."""
    L = 2
    ops = [{"id": "round_k_forward", "op": "compute", "stream": "forward", "duration_us": 40.0, "jitter": False},
           {"id": "round_k_store_req3", "op": "write", "stream": "forward", "buffer": "dev_kv",
            "layers": list(range(L)), "units": [2], "owner": 3, "version": 1},
           {"id": "start_event", "op": "record", "stream": "schedule", "event": "start_loading"},
           {"id": "load_waits_start", "op": "wait", "stream": "load", "event": "start_loading"}]
    if fixed:
        ops += [{"id": "forward_fence", "op": "record", "stream": "forward", "event": "forward_fence"},
                {"id": "load_fence_stream_wait", "op": "wait", "stream": "load", "event": "forward_fence"}]
    for l in range(L):
        ops += [copy(f"load_req8_L{l}", "load", "host_kv", "dev_kv", l, span(0, 1), span(2, 1)),
                {"id": f"layer{l}_loaded", "op": "record", "stream": "load", "event": f"layer{l}_loaded"}]
    for l in range(L):
        ops += [{"id": f"round_k1_wait_until_L{l}", "op": "wait", "stream": "forward", "event": f"layer{l}_loaded"},
                {"id": f"round_k1_read_L{l}", "op": "read", "stream": "forward", "buffer": "dev_kv", "layer": l,
                 "units": [2]}]
    what = ("the fix: start_loading makes the load stream wait for the forward stream (load_fence_stream)"
            if fixed else "the bug: the load waits only for the schedule stream's start_event")
    return doc(title("load_unfenced_overlap", fixed),
               "SGLang #36738 (HiCache under the overlap scheduler; the copies bound to the fenced stream by "
               "#36572): round k, still running on the forward stream, stores request 3's KV into device page 2, "
               "which the CPU, running ahead, has already freed and handed to request 8's load-back; round k+1 "
               f"reads the restored page behind wait_until. Here {what}. With the bug round k's late store lands "
               "on the restored prefix, and round k+1 reads request 3's KV as request 8's.",
               [host("host_kv", L, 1, owner=8), device("dev_kv", L, 3)],
               ["schedule", "forward", "load"], ["start_loading", "forward_fence"]
               + [f"layer{l}_loaded" for l in range(L)], ops)


BUGS: tuple[Bug, ...] = (
    Bug("pd_early_send", "sglang #33970", pd_early_send, ("decode_read_chunk1_L0", "decode_read_chunk1_L1"),
        (("chunk1_store_kv", "rdma_chunk1_L0"), ("chunk1_store_kv", "rdma_chunk1_L1"))),
    Bug("pd_buffer_store_unsynced", "lmcache #5048 / #5049", pd_buffer_store_unsynced,
        tuple(f"decode_read_L{l}" for l in range(4)),
        tuple((f"from_gpu_L{l}", f"nixl_write_L{l}") for l in range(4))),
    Bug("mamba_cow_before_load", "sglang #36743", mamba_cow_before_load,
        ("read_state_L2", "read_state_L3"),
        tuple((f"load_state_L{l}", "cow_whole_slot") for l in range(4)),
        tuple(f"read_state_L{l}" for l in range(4))),
    Bug("backup_source_race", "sglang #20611", backup_source_race, ("host_read_L0", "host_read_L1"),
        (("store_kv_req5", "backup_req5"), ("backup_req5", "store_kv_req6"))),
    Bug("load_unfenced_overlap", "sglang #36738", load_unfenced_overlap,
        ("round_k1_read_L0", "round_k1_read_L1"),
        (("round_k_store_req3", "load_req8_L0"), ("round_k_store_req3", "load_req8_L1"))),
)


# ---------------------------------------------------------------- a bug that costs time, not bytes

class Stall(NamedTuple):
    """A bug that delays ``delayed`` (an op id), with no race and no wrong byte: its copies
    queue behind others on the link. It shows under the profile ``SUBMISSION_PROFILE``
    (``link.sharing = "submission"``: the copy engine serves copies in issue order); the fix
    moves ops, so the pair is compared by ``delayed``'s start."""
    slug: str
    reference: str
    build: Callable[[bool], dict]
    delayed: str


#: the h200 profile with its link serving copies in issue order (written beside the files)
SUBMISSION_PROFILE = OUT / "h200_submission.toml"
PROFILES = Path(__file__).resolve().parent.parent / "sim" / "profiles"


def submission_profile() -> str:
    """``sim/profiles/h200.toml`` with ``link.sharing = "submission"`` and its own name."""
    text = (PROFILES / "h200.toml").read_text()
    head = ("# Written by examples/make_bug_examples.py: sim/profiles/h200.toml with its link serving copies in\n"
            "# issue order (link.sharing = \"submission\"), for examples/bugs/prefill_stall_behind_load*.json.\n")
    text = text.replace('name = "h200"\n', 'name = "h200-submission"\n', 1)
    return head + text.replace("[link]\n", '[link]\nsharing = "submission"\n', 1)


def prefill_stall_behind_load(fixed: bool) -> dict:
    """SGLang #38448 (fix #38449, both open): ``get_new_batch_prefill`` starts the load-back
    (``start_loading``) before ``prepare_for_extend``; the small H2D copies the forward needs
    (``seq_lens``, ``input_ids``) are issued after the burst and wait for all of it."""
    L = 8
    meta = [{"id": f"h2d_{name}", "op": "copy", "stream": "schedule", "routine": "kernel_per_layer",
             "src": "host_batch", "dst": "dev_batch", "args": {"layer": 0, "src_indices": span(i, 1),
                                                              "dst_indices": span(i, 1)}}
            for i, name in enumerate(("seq_lens", "input_ids"))]
    ops = list(meta) if fixed else []
    ops += [{"id": "start_event", "op": "record", "stream": "schedule", "event": "start_loading"},
            {"id": "load_waits_start", "op": "wait", "stream": "load", "event": "start_loading"}]
    for l in range(L):
        ops += [copy(f"load_L{l}", "load", "host_kv", "dev_kv", l, span(0, 64), span(0, 64)),
                {"id": f"layer{l}_loaded", "op": "record", "stream": "load", "event": f"layer{l}_loaded"}]
    if not fixed:
        ops += meta
    ops += [{"id": "batch_ready", "op": "record", "stream": "schedule", "event": "batch_ready"},
            {"id": "forward_waits_batch", "op": "wait", "stream": "forward", "event": "batch_ready"},
            {"id": "first_kernel", "op": "compute", "stream": "forward", "duration_us": 5.0, "jitter": False}]
    for l in range(L):
        ops += [{"id": f"wait_until_L{l}", "op": "wait", "stream": "forward", "event": f"layer{l}_loaded"},
                {"id": f"read_L{l}", "op": "read", "stream": "forward", "buffer": "dev_kv", "layer": l, "units": [0]}]
    what = ("the fix: the batch's copies go on the schedule stream before start_loading records its event, "
            "so they win by stream order" if fixed else
            "the bug: they are issued after the burst")
    return doc(title("prefill_stall_behind_load", fixed),
               "SGLang #38448 / #38449 (HiCache prefill; time, not bytes): start_loading records start_event on "
               "the schedule stream and the load stream submits a burst of 8 layer copies (256 KiB each); the "
               "forward waits for the batch's small H2D copies (seq_lens, input_ids) on the schedule stream. "
               f"Here {what}. Under a link that serves copies in issue order "
               "(examples/bugs/h200_submission.toml) the bug's forward starts only after the whole burst; no "
               "read is wrong and nothing races either way.",
               [host("host_kv", L, 64, owner=4), device("dev_kv", L, 64),
                host("host_batch", 1, 2, owner=4, kind="batch"), device("dev_batch", 1, 2, kind="batch")],
               ["schedule", "load", "forward"], ["start_loading", "batch_ready"]
               + [f"layer{l}_loaded" for l in range(L)], ops)


STALLS: tuple[Stall, ...] = (
    Stall("prefill_stall_behind_load", "sglang #38448", prefill_stall_behind_load, "first_kernel"),
)


def files() -> dict[Path, dict | str]:
    """Every file of ``examples/bugs/`` with what it must hold (a document, or a profile's text)."""
    out: dict[Path, dict | str] = {OUT / f"{title(b.slug, fixed)}.json": b.build(fixed)
                                   for b in BUGS + STALLS for fixed in (False, True)}
    out[SUBMISSION_PROFILE] = submission_profile()
    return out


def main(argv: list[str]) -> int:
    OUT.mkdir(exist_ok=True)
    check = "--check" in argv
    return max(regenerate(content, path, Path(__file__).name, check) for path, content in files().items())

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
