"""The engine: one prefill rank (or ``deployment.simulated_ranks`` TP ranks in lockstep) with
byte-level verdicts, its decode side in simulated time.

:func:`run_prefill_engine` runs a scenario's workload through one prefill engine built on a
:class:`~sim.cache.session.CacheSession` (the HiCache model: tree, controller, device and host
pools, the online executor) and the forward model (:func:`~sim.engine.forward.issue_forward`),
then analyses the finished run (:func:`sim.verdicts.analyse`) and attributes every corrupted
read to the requests whose entries hold the differing bytes.

One scheduler iteration (SGLang's ``event_loop_normal`` around a prefill batch, reduced):

1. ``check_hicache_events()``: poll the backup and load acks, unlock, free (HiCache on);
   PD: bring the decode engine up to now; the chunked request's computed pages enter the
   tree (``stash_chunked_request``);
2. batch formation: the chunked request in progress first, then waiting requests whose arrival
   time has come, in the queue's order, while the batch's new tokens fit
   ``scheduler.chunked_prefill_size`` (one request at a time may be chunked: a page-aligned
   chunk now, the rest in later batches) and the device pool (``evict`` when short); per
   request: ``match_prefix``, on a host hit ``init_load_back``, ``inc_lock_ref`` of its last
   node (as SGLang's ``PrefillAdder`` locks it), the new tokens' slots (whole pages: the paged
   allocator's unit);
3. ``ready_to_load_host_cache()`` once per batch: the producer slot is the batch's consumer
   index (-1 when nothing was loaded);
4. the batch's new tokens' KV written on the forward stream (one ``store_kv`` write per pool
   covering its layers, for the whole batch, as ``set_kv_buffer``; no wait: the fallback
   index-K store and ``set_kv_buffer`` never wait on a layer event and write slots no load
   touches), then the forward pass (``issue_forward``) with the scenario's gate map, options
   and cost model; the scheduler waits for the forward stream (``copy_done.synchronize()``);
5. per request: ``insert`` (page-aligned key; duplicates freed), then its decode
   (:mod:`sim.engine.decode`): PD, the prefill side frees the unaligned tail, unlocks its node
   and the decode engine (its own GPUs, simulated time only) receives the KV and decodes it;
   colocated (``cache_unfinished_req``), the request keeps its tail page and its page-aligned
   prompt locked, the engine runs decode steps on the forward stream whenever no prefill batch
   can be formed, each writing every running request's newest KV into its own slots, and the
   request's release inserts its prompt and output (``cache_finished_req``).  The turn
   completes in the :class:`WorkloadDriver` at its last output token.

With ``scheduler.event_loop = "overlap"`` the loop is SGLang's ``event_loop_overlap`` instead
(docs/engine.md, "The overlap loop"): batch N+1 formed and launched (its load started) before
batch N's result is processed on an event recorded after N's forward; colocated, decode steps
are launched the same way (their KV written per layer).

When nothing is admissible (and, colocated, nothing decodes) the scheduler idles a short host
delay (or until the next arrival or decode event) and polls again.  The run ends when the driver
has nothing in flight.  The run's reads are then judged twice: by the race verdict
(:func:`sim.verdicts.analyse`) and by the KV oracle (:mod:`sim.engine.oracle`).
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from sim.arrays import unique_sorted
from sim.cache.radix import RadixCache, RadixKey
from sim.cache.records import CacheInitParams, EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.cache.ranks import rank_name
from sim.cache.session import BATCH_EVENT, MODEL_ROLES, SEND_DONE_EVENT, SEND_EVENT, SEND_STREAM, CacheSession
from sim.engine.budget import CLIP_MAX_NEW_TOKENS, RETRACT_DECODE_STEPS, NewTokenRatio, retract_order
from sim.engine.cost import CostModel
from sim.engine.decode import DecodeEngine, DecodeStepModel, TransferSize, transfer_size
from sim.engine.hypotheses import CONTROLLER_KEYS
from sim.engine.forward import (
    BatchRequest, ForwardBatch, ForwardIssue, ReadInfo, can_advance_in_one_step, coalesce, entry_bytes, issue_forward,
    topk_verdict,
)
from sim.engine.models import ModelFamily, model as model_family
from sim.engine.layer_reads import LayerReads
from sim.engine.oracle import KVOracle
from sim.engine.scenario import Scenario, load_scenario
from sim.engine.workload import Request, Workload, WorkloadDriver, output_tokens, tokens
from sim.errors import InputError, KvraceError, show
from sim.executor import run_reference
from sim.profile import load_profile
from sim.verdicts import analyse, differing_runs

__all__ = ["EngineError", "EngineResult", "OwnershipError", "PrefillEngine", "SESSION_MODELS",
           "dfs_weight_order", "reduced_model", "run_prefill_engine"]

#: model family -> the CacheSession model whose device and host pools it has
SESSION_MODELS = MappingProxyType({"dsa-v3.2": "dsa", "deepseek-v4-flash": "deepseek-v4"})
#: host delay (us) of an idle scheduler iteration (nothing admissible: acks pending)
IDLE_US = 50.0
#: ``lpm``: SGLang sorts the waiting queue only while at most this many wait (``fcfs`` above)
LPM_MAX_QUEUE = 128
#: ``lpm``: SGLang's ``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`` and ``..._DEPRIORITIZE_THRESHOLD``
IN_BATCH_PREFIX_TOKENS = 32


def dfs_weight_order(root, last_nodes: list) -> list:
    """SGLang's ``_sort_by_dfs_weight`` (``schedule_policy="dfs-weight"``): ``last_nodes`` is the
    queue as ``[(rid, node)]``, ``node`` the tree node the request's prefix match ended at.  A
    node's weight is the number of requests ending at it plus its children's weights
    (``_calc_weight``); the order is depth first from ``root``, a node's children in descending
    weight (a stable sort: ties keep the children's order), the requests ending at a node after
    its subtree's, in queue order (``_get_dfs_priority``).  Returns the rids in that order."""
    at: dict[int, list] = {}
    for rid, node in last_nodes:
        at.setdefault(id(node), []).append(rid)
    weight: dict[int, int] = {}
    # NOTE: iterative post-order (a deep tree would overflow SGLang's recursion here)
    post, stack = [], [root]
    while stack:
        node = stack.pop()
        post.append(node)
        stack.extend(node.children.values())
    for node in reversed(post):
        weight[id(node)] = len(at.get(id(node), ())) + sum(weight[id(c)] for c in node.children.values())
    out, stack = [], [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(at.get(id(node), ()))
            continue
        stack.append((node, True))
        children = sorted(node.children.values(), key=lambda c: -weight[id(c)])
        stack.extend((c, False) for c in reversed(children))
    return out


def _left_out(roles: set, chosen) -> list[str] | None:
    """A configuration's pool set (``backup_pools``, ``transfer_pools``) as the session and the
    decode side take it: None when it names every pool role in ``roles``, else its roles there,
    sorted."""
    return None if roles <= set(chosen) else sorted(roles & set(chosen))


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens ``a`` and ``b`` share from the start (what a page-1 radix tree holding ``b`` matches of ``a``)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


#: CacheSession input keys -> the scenario keys they come from (errors name the user's key)
_SESSION_KEYS = {"config.layers": "run.layers", "hicache_size": "hicache.size_gb", "hicache_ratio": "hicache.ratio",
                 "config.seed": "run.seed", "config.device_tokens": "scheduler.max_total_tokens"}


class EngineError(KvraceError, RuntimeError):
    """The engine cannot go on (a request that can never fit the device pool, a stuck run)."""


class OwnershipError(EngineError):
    """A forward was about to read a slot its request does not own (engine bookkeeping bug)."""


@dataclass
class EngineResult:
    """The metrics of one run (docs/engine.md, "The prefill engine (first slice)").

    ``requests_corrupted``: requests a read made for them observed bytes other than the
    happens-before order gives (attributed per request: the differing bytes lie in that
    request's entries).  ``stale_reads`` / ``torn_reads``: corrupted reads (``analyse``);
    ``latent_races``: racing (buffer, op pair)s in all; ``latent_races_by_buffer``: per buffer.
    ``load_backs``: non-empty ``init_load_back`` results (``load_back_tokens`` their tokens);
    ``backups``: backup operations issued (``start_writing``); ``branches``: per device pool
    role, per copy routine, the copy ops the controller issued.  ``corrupted_reads`` lists
    each corrupted read (op id, layer, reader, role, status, waited, consumer index,
    requests).  ``sim_time_s``: simulated time at the end; ``wall_time_s``: wall time of the
    run and its analysis.  ``forwards_one_step``: forwards advanced in one step (nothing in
    flight: ``run.one_step``); ``hicache``: whether HiCache was on (``hicache.prefill``);
    ``chunked_batches``: batches after which a chunked request still had chunks to go.
    ``requests_corrupted`` is the union of ``requests_raced`` (a read saw bytes other than
    happens-before order gives, in that request's entries) and ``requests_wrong_kv`` (the KV
    oracle, :mod:`sim.engine.oracle`: a read saw KV that is not the request's own tokens',
    in any order: what a wrong copy geometry or a pool never backed up does);
    ``wrong_kv_reads``: reads the oracle flagged; ``oracle_entries``: entries it checked.
    ``index_k_topk_changed``: raced index-K reads whose indexer top-k, computed from the
    bytes read, differs from the one computed from the happens-before-order bytes for some
    request and pool layer (``topk_changed`` per corrupted read: True, False, or None where
    not an index-K race).

    TP ranks in lockstep (``deployment.simulated_ranks`` = n > 1; docs/engine.md "TP ranks in
    lockstep"): every read of every rank is judged against that rank's bytes, a request is
    corrupted when a read for it on ANY rank is; ``reads_total``, ``stale_reads``,
    ``torn_reads``, ``wrong_kv_reads``, ``oracle_entries``, ``forwards_one_step`` and
    ``latent_races`` count over all ranks; ``corrupted_reads`` entries carry their ``rank``;
    ``corrupted_reads_by_rank[r]``: rank r's corrupted reads; ``branches``, ``backups`` and
    ``load_backs`` count one rank's (every rank issues the same copies).

    ``requests_aborted``: requests the scheduler refused at admission, as SGLang's
    ``validate_input_length`` does (an input of ``max_req_input_len`` tokens or more: the
    device pool less 6), and requests the byte-level decode side aborted (a failed restore:
    ``decode.restores_failed``); ``aborted_requests`` lists each (``rid``, ``input_tokens``,
    ``reason``), and colocated requests aborted because even alone they found no page to
    decode into (``retract_decode``'s last request).  Every released request ends completed or
    aborted: ``requests_completed + requests_aborted == requests_total``.
    ``requests_retracted``: colocated retractions (a decode step's pages did not fit; the
    request prefilled again later: :mod:`sim.engine.budget`), counted once per retraction.
    ``graph_replays``: batches that loaded and replayed a captured prefill graph, so that none
    of their accessors waited (``graph-replay-no-waits``: configuration key
    ``graph_replay_max_tokens``).  ``early_sends``: PD early send (``deployment.pd_send``):
    non-final chunks whose KV the sender read right after their forward's launch."""

    scenario: str
    seed: int
    layers: int
    requests_total: int
    requests_completed: int
    requests_corrupted: int
    corrupted_fraction: float
    reads_total: int
    stale_reads: int
    torn_reads: int
    latent_races: int
    latent_races_by_buffer: dict
    oob_writes: int
    load_backs: int
    load_back_tokens: int
    backups: int
    batches: int
    branches: dict
    sim_time_s: float
    wall_time_s: float
    corrupted_reads: list = field(default_factory=list)
    ownership_checks: int = 0
    forwards_one_step: int = 0
    hicache: bool = True
    chunked_batches: int = 0
    requests_raced: int = 0
    requests_wrong_kv: int = 0
    wrong_kv_reads: int = 0
    oracle_entries: int = 0
    index_k_topk_changed: int = 0
    simulated_ranks: int = 1
    corrupted_reads_by_rank: list = field(default_factory=list)
    decode: dict | None = None
    requests_aborted: int = 0
    aborted_requests: list = field(default_factory=list)
    requests_retracted: int = 0
    graph_replays: int = 0
    early_sends: int = 0

    def to_dict(self) -> dict:
        """The fields as a dict; ``simulated_ranks`` and ``corrupted_reads_by_rank`` only when
        more than one rank was simulated, ``decode`` only with a byte-level decode side,
        ``requests_aborted`` and ``aborted_requests`` only when a request was aborted,
        ``requests_retracted`` only when one was, ``graph_replays`` only when a batch replayed a
        graph, ``early_sends`` only when a chunk was sent early (so a one-rank result without
        them is what it was before any existed)."""
        d = dataclasses.asdict(self)
        if self.simulated_ranks == 1:
            d.pop("simulated_ranks")
            d.pop("corrupted_reads_by_rank")
        if d["decode"] is None:
            del d["decode"]
        if not self.requests_aborted:
            del d["requests_aborted"], d["aborted_requests"]
        for late in LATE_FIELDS:
            if not d[late]:
                del d[late]
        return d

    def signature(self) -> dict:
        """Everything but the wall time (what the same seed must reproduce)."""
        d = self.to_dict()
        d.pop("wall_time_s")
        return d


def reduced_model(fam: ModelFamily, layers: int | None) -> ModelFamily:
    """``fam`` with only its first ``layers`` layers (for small runs and tests): layer kinds
    and every pool's layer list cut there; ``None``: ``fam`` itself."""
    if layers is None or layers == fam.n_layers:
        return fam
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= fam.n_layers:
        raise InputError("layers", f"expected an integer in 1..{fam.n_layers} ({fam.name}), got {show(layers)}")
    pools = {r: dataclasses.replace(p, layers=tuple(x for x in p.layers if x < layers)) for r, p in fam.pools.items()}
    bf16 = fam.bf16_index_k
    if bf16 is not None:
        bf16 = dataclasses.replace(bf16, layers=tuple(x for x in bf16.layers if x < layers))
    return dataclasses.replace(fam, layer_kinds=fam.layer_kinds[:layers], pools=MappingProxyType(pools),
                               bf16_index_k=bf16)


@dataclass
class _Tally:
    """What the judged reads add up to (``PrefillEngine._judge``)."""

    reads: int = 0
    stale: int = 0
    torn: int = 0
    raced: set = field(default_factory=set)
    wrong: set = field(default_factory=set)
    corrupted: list = field(default_factory=list)
    wrong_reads: int = 0
    topk_changed: int = 0
    by_rank: list = field(default_factory=list)   # corrupted reads per simulated rank


@dataclass
class _Admitted:
    req: Request
    key: RadixKey
    prefix: np.ndarray          # device slots of the matched prefix (resident + loaded)
    loaded: int                 # tokens loaded back for it
    node: object                # the locked last node
    new: np.ndarray             # the new tokens' slots so far (whole pages, for done + chunk tokens)
    n_new: int
    done: int = 0               # new tokens computed by earlier chunks
    chunk: int = 0              # new tokens this batch computes
    sent: int = 0               # PD early send: sequence positions sent so far (SGLang's start_send_idx)


@dataclass
class _Decoding:
    """A colocated request from the end of its prefill to its release: what SGLang's
    ``cache_unfinished_req`` leaves it (the tree's slots of its page-aligned prompt, ``prefix``,
    under its lock on ``node``; its own slots from there on, ``own``: the prompt's unaligned tail
    page, then a page at a time as decode needs them) and how far its KV goes: ``ctx`` positions
    written (prompt, then one per decode step)."""

    req: Request
    node: object
    prefix: np.ndarray
    own: np.ndarray
    ctx: int


class _Launched(NamedTuple):
    """A batch the overlap loop launched: the requests whose prefill it completes, the event
    recorded on the forward stream after its forward (SGLang's ``copy_done``), and for a
    colocated decode step the requests whose last output token it produced (``decoded``) and
    those it produced a token for (``ran``: until its result is processed the scheduler does
    not have that token)."""

    finished: list
    event: str
    decoded: tuple = ()
    ran: tuple = ()


#: ``PrefillEngine._admit``'s answer when the decode-memory reservation leaves no room
#: (PrefillAdder's ``AddReqResult.NO_TOKEN``: the batch takes no more requests)
_NO_TOKEN = object()


#: the overlap loop's batch events: two suffice, a batch's result is processed before the batch
#: after the next one records its event (the names are reused in turn)
_OVERLAP_EVENTS = tuple(BATCH_EVENT.format(k) for k in range(2))
#: EngineResult fields added after the first results, left out of ``to_dict`` while zero (a
#: result without them digests as before they existed: benchmarks/engine_cases.py)
LATE_FIELDS = ("requests_retracted", "graph_replays", "early_sends")
#: the reader named by the PD sender's early chunk reads (``pd_send``)
SEND_READER = "pd_send"


class _Expected(NamedTuple):
    """A read's views in happens-before order (what ``ReadCapture.views`` is for the run)."""

    views: list


#: the engine's keep modes (``PrefillEngine(keep=...)``)
ENGINE_KEEP = ("report", "all")


class PrefillEngine:
    """One prefill engine on one rank, or on ``deployment.simulated_ranks`` TP ranks in lockstep
    (one scheduler decision per iteration issued on every rank: docs/engine.md, "TP ranks in
    lockstep"); see the module doc.  ``layers``: run only the model's
    first layers (small runs); ``device_tokens``: device pool size (default the scenario's
    ``scheduler.max_total_tokens``); ``materialise``: real bytes besides provenance.

    ``keep``: ``"all"`` (default): the session keeps the whole run (every op, read and
    timing: what ``--export-races``, ``--trace``, ``sim.window.cut_window`` and a test that
    inspects the recorded schedule or :attr:`issues` need) and :meth:`finish` judges the reads
    after the run (``sim.verdicts.analyse`` against ``run_reference``); ``"report"``
    (streaming, what ``kvrace run`` and :func:`run_prefill_engine` use): the verdicts are
    computed while the run runs (the session's ``keep="report"``), each read judged (race
    verdict, the requests it hit, top-k, the KV oracle) when the run captures it (the oracle
    judges a per-layer forward's ``ok`` reads together, before any other read is judged and
    before a write into their layers: :mod:`sim.engine.layer_reads`) and then forgotten, so memory
    follows the live state and what the result lists.  A byte-level decode side's session
    keeps the same (its run and, with ``"all"``, its report: ``DecodeCacheEngine.run`` and
    ``report``).  Both give the same :class:`EngineResult` (``tests/test_engine_stream.py``,
    ``tests/test_decode_export.py``)."""

    def __init__(self, scenario: Scenario, seed: int | None = None, *, layers: int | None = None,
                 device_tokens: int | None = None, materialise: bool = False, keep: str = "all"):
        if not isinstance(scenario, Scenario):
            raise InputError("scenario", f"expected a Scenario, got {type(scenario).__name__}")
        if keep not in ENGINE_KEEP:
            raise InputError("keep", f"expected one of {list(ENGINE_KEEP)}, got {show(keep)}")
        self.keep = keep
        sc = scenario
        fam = model_family(sc.model.family)
        if fam.name not in SESSION_MODELS:
            raise InputError("model.family", f"expected a family whose pools CacheSession has: {sorted(SESSION_MODELS)}, "
                             f"got {show(fam.name)}")
        self.scenario = sc
        self.seed = sc.run.seed if seed is None else int(seed)
        self.config = cfg = sc.configuration()
        if layers is None and sc.run.layers:
            if sc.run.layers > fam.n_layers:
                raise InputError("run.layers", f"expected an integer in 0..{fam.n_layers} ({fam.name}), got {sc.run.layers}")
            layers = sc.run.layers
        self.model = reduced_model(fam, layers)
        self.options = dict(self.config.options)
        tokens_ = sc.scheduler.max_total_tokens if device_tokens is None else device_tokens
        smodel = SESSION_MODELS[fam.name]
        # the hypotheses' controller switches (sim.engine.hypotheses.CONTROLLER_KEYS) go to the
        # session as they are; a pool set naming every pool of the model is None (all)
        roles = set(MODEL_ROLES[smodel])
        switches = dict(backup_pools=_left_out(roles, cfg.backup_pools), host_lock_during_load=cfg.host_lock_during_load)
        if cfg.index_k_host_bytes_per_entry != CONTROLLER_KEYS["index_k_host_bytes_per_entry"][1]:
            switches["index_k_host_bytes_per_entry"] = cfg.index_k_host_bytes_per_entry
        if smodel == "deepseek-v4":
            switches.update(index_k_dtype=sc.model.index_k_dtype, index_k_partial_pages=cfg.index_k_partial_pages)
        elif sc.model.index_k_dtype != "fp8" or cfg.index_k_partial_pages != "page_aligned":
            raise InputError("model.index_k_dtype" if sc.model.index_k_dtype != "fp8" else "variant.hypotheses",
                             f"expected an fp8, page-aligned index-K for {fam.name} (the bf16 index-K and the C4 "
                             f"token copy are DeepSeek V4's), got {sc.model.index_k_dtype}, {cfg.index_k_partial_pages}")
        try:
            self.session = self._session(sc, smodel, tokens_, materialise, switches)
        except InputError as e:
            # the user's keys: run.layers (or the layers argument), hicache.size_gb / ratio (a host
            # pool not larger than the device pool, found by benchmarks/fuzz_engine.py)
            if e.where in _SESSION_KEYS:
                raise InputError(_SESSION_KEYS[e.where], e.message) from None
            raise
        s = self.session
        self.page = s.config.page_size
        profile = load_profile(sc.deployment.profile)
        self.cost = CostModel.from_profile(profile, self.seed)
        self.pd = sc.deployment.mode == "pd"
        self.prefill_tp = sc.deployment.prefill_tp
        steps = DecodeStepModel(self.model, self.cost, self.options, sc.deployment.decode_tp)
        # PD: the KV crosses to the decode engine's GPUs first; colocated: it is already there
        self.decode = DecodeEngine(steps, max_running=sc.scheduler.max_running_requests,
                                   transfer_gbps=self._pd_transfer_gbps(profile) if self.pd else 1.0,
                                   transfer=(transfer_size(self.model, self.options, self.page) if self.pd
                                             else TransferSize(0.0)),
                                   transfer_latency_us=self._pd_transfer_latency_us(profile) if self.pd else 0.0)
        # the pools the PD transfer sends (None: all); one left out is seen only by decode reads
        transfer = _left_out(roles, cfg.transfer_pools)
        if self.pd and (sc.hicache.decode or sc.deployment.decode_bytes or transfer is not None):
            self.decode = self._decode_cache_engine(steps, profile, smodel, tokens_, switches, materialise, transfer)
        self._decoding: dict[int, _Decoding] = {}     # colocated: from prefill's end to release
        self._send_pending: list[tuple] = []          # PD early send: (slots, node or None) released once sent
        self._tree_vals: dict[int, tuple] = {}  # _tree_slots: id -> (a node's value, as int64), counted
        self._tree_count = np.zeros(0, np.int32)
        self._ids: dict[int, np.ndarray] = {}  # rid -> its input ids (_tokens)
        # pool role -> (device buffer, layout): what the forward model reads
        self.buffers = {s.device_pool.role_of(name): (name, lay) for name, lay in s.device_pool.layouts.items()}
        specs = self.model.pools_for(self.options)
        self.ratios = {role: specs[role].tokens_per_entry for role in self.buffers}
        self.oracle = KVOracle(self.buffers, {n: s.device_pool.kind_of(n) for n, _ in self.buffers.values()},
                               self.ratios)
        self._init_ranks()
        self.gate_map = self.config.gate_map
        # graph-replay-no-waits: the gate map of a batch that replays a captured prefill graph
        # (no accessor waits: the graph was captured with no load in flight)
        gm = self.gate_map
        self._replay_gate_map = gm.override({a: False for a in gm.gated}, name=f"{gm.name}+graph-replay")
        # HiCache off: SGLang's plain RadixCache over the same allocator (no host pool traffic,
        # an evicted prefix is recomputed); on: the session's HiRadixCache
        self.hicache = bool(sc.hicache.prefill)
        self.cache = s.cache if self.hicache else RadixCache(
            CacheInitParams(page_size=self.page, token_to_kv_pool_allocator=s.allocator))
        self.one_step = bool(sc.run.one_step)
        self.forwards_one_step = 0
        self.driver = WorkloadDriver(Workload(sc.workload, seed=self.seed), until_us=int(sc.run.duration_s * 1e6))
        self.waiting: list[Request] = []
        self._order: list[int] = []                # rids in SGLang's waiting_queue order (_queue_order)
        # NOTE: schedule_policy="random" shuffles with Python's global random in SGLang; a
        # generator of its own, seeded by the run's seed, keeps a run reproducible
        self._policy_rng = random.Random(f"schedule_policy:{self.seed}")
        self.issues: list[ForwardIssue] = []       # keep="all" only: every batch's forward
        self.read_rids: dict[str, tuple] = {}      # read op id -> (ReadInfo, consumer, {rid: (req, n_ctx)}), until judged
        self.report: dict | None = None            # keep="all": the run's verdicts (analyse), after finish()
        self._tally = _Tally(by_rank=[0] * self.ranks)
        self._layer_reads: LayerReads | None = None     # keep="report" with the incremental oracle
        if self.keep == "report":
            self.session.set_read_sink(self._on_read, digests=False)
            if self.oracle.incremental:
                # NOTE: the oracle remembers verdicts of pages not written since (its module
                # doc); every mutation of the run's memory makes it forget the pages touched,
                # after the reads kept for it that cover those layers are judged
                self._layer_reads = LayerReads(self.oracles, {name: lay.layer_bytes for bufs in self.rank_buffers
                                                              for name, lay in bufs.values()}, self._tally_read)
                for oracle, bufs in zip(self.oracles, self.rank_buffers):
                    self.session.watch_writes(self._watcher(oracle), [name for name, _ in bufs.values()])
        self.counts = dict(load_backs=0, load_back_tokens=0, batches=0, ownership_checks=0, chunks=0)
        self._stores = 0                 # batch stores issued (their number is their writes' version)
        self.chunked: _Admitted | None = None
        # the overlap loop (scheduler.event_loop = "overlap"): the batch launched last, whose result
        # is processed in the next iteration (SGLang's result_queue of one)
        self.overlap_loop = sc.scheduler.event_loop == "overlap"
        self._pending: _Launched | None = None
        self.counts["retractions"] = 0
        # colocated: SGLang's decode-memory budget (sim.engine.budget): the new-token ratio
        # admission reserves by, the requests retracted (rid -> output tokens they had, until
        # their prefill is done again) and when each re-entered the queue
        self.ratio = NewTokenRatio.from_conservativeness(sc.scheduler.schedule_conservativeness)
        self._retracted: dict[int, int] = {}
        self._queued: dict[int, float] = {}
        self.counts["stash_frees"] = 0
        self.counts["graph_replays"] = 0
        self.counts["early_sends"] = 0
        self._t0: float | None = None               # perf_counter at start()
        self.completed: list[int] = []
        self.aborted: list[dict] = []
        # NOTE: SGLang's TpModelWorker: max_req_len = min(context_len - 1, pool size - 1) and the
        # scheduler aborts (set_finish_with_abort) a request whose input is max_req_len - 5
        # tokens or more; the model's context length (V4 and DSA: far above any pool here) is
        # not modelled, so the pool decides
        self.max_req_input_len = int(sc.scheduler.max_total_tokens) - 1 - 5

    # ---------------------------------------------------------------- one request
    def _session(self, sc, smodel: str, device_tokens: int, materialise: bool, switches: dict) -> CacheSession:
        cfg = self.config
        # NOTE: digest=False: an EngineResult carries no schedule digest, so the ops' canonical
        # JSON is not hashed as they are issued
        return CacheSession(
            model=smodel, layers=self.model.n_layers, page_size=sc.hicache.page_size,
            device_tokens=device_tokens, hicache_ratio=sc.hicache.ratio, hicache_size=float(sc.hicache.size_gb),
            layout=sc.hicache.layout, io_backend=sc.hicache.io_backend, write_policy=sc.hicache.write_policy,
            load_back_threshold=sc.hicache.load_back_threshold, overlap=sc.scheduler.overlap,
            load_fence=sc.hicache.load_fence and cfg.load_fence_stream == "forward", profile=sc.deployment.profile,
            seed=self.seed, materialise=materialise, keep=self.keep, digest=False,
            batch_events=len(_OVERLAP_EVENTS) if sc.scheduler.event_loop == "overlap" else 0,
            # PD with an early send (pd_send): the sender's chunk reads are ops of the run
            send_stream=sc.deployment.mode == "pd" and cfg.pd_send != "after_forward",
            ranks=sc.deployment.simulated_ranks, **switches)

    def _init_ranks(self) -> None:
        """TP ranks in lockstep (``deployment.simulated_ranks``): per rank, the forward's buffers
        (rank ``r``'s names, :func:`sim.cache.ranks.rank_name`) and a KV oracle over them that
        shares the content keys of rank 0's (:meth:`KVOracle.for_buffers`)."""
        s = self.session
        self.ranks = s.ranks
        self.rank_buffers = [self.buffers] + [
            {role: (rank_name(name, r), lay) for role, (name, lay) in self.buffers.items()}
            for r in range(1, self.ranks)]
        self.oracles = [self.oracle] + [
            self.oracle.for_buffers(bufs, {n: s.device_pool.kind_of(n0) for (n, _), (n0, _) in
                                           zip(bufs.values(), self.buffers.values())})
            for bufs in self.rank_buffers[1:]]

    def _tokens(self, req: Request) -> np.ndarray:
        """``tokens(req)``, read-only, kept until the request's prefill is done.

        NOTE: a waiting request is matched again at every batch it does not fit (its ids are
        a hash of every position: an 80k-token context cost about 2 % of a long run)."""
        got = self._ids.get(req.rid)
        if got is None:
            if len(self._ids) >= 4 * self.scenario.scheduler.max_running_requests:
                self._ids.clear()            # NOTE: a bound only; requests done are dropped below
            got = tokens(req)
            if req.rid in self._retracted:
                # NOTE: a retracted request prefills again its prompt and the output it had
                # (SGLang's fill_ids: origin_input_ids + output_ids)
                got = np.concatenate([got, output_tokens(req)[:self._retracted[req.rid]]])
            self._ids[req.rid] = got
            got.setflags(write=False)
        return got

    def _admit(self, req: Request, budget_tokens: float, can_chunk: bool, reserved: float = 0.0,
               input_room: float = np.inf):
        """PrefillAdder's ``add_one_req``: match -> lock -> check -> load back; None, holding
        nothing, when it does not fit the chunk budget (and may not be chunked) or
        ``input_room``.  A request whose page-rounded new tokens exceed the budget is admitted
        as the chunked request when ``can_chunk`` and at least a page of budget is left: this
        batch computes a page-aligned first chunk of it (``chunk``), later batches the rest.
        ``reserved``: PrefillAdder's ``rem_total_token_offset`` so far (:meth:`_reserve`, then
        :meth:`_offset` of each request added); ``_NO_TOKEN``, holding nothing, when the
        request's new tokens, ``max_new`` and a page do not fit in the free and evictable
        tokens less that (the ``rem_total_tokens`` check, made with the matched prefix
        locked).  ``input_room``: ``rem_input_tokens`` when chunked prefill is off and the
        batch has a request (else infinite); None when the request's page-rounded new tokens
        (after its host hit) reach it.  No slot is allocated here: the batch's are, when it
        is formed (:meth:`_allocate`)."""
        cache = self.cache
        ids = self._tokens(req)
        key = RadixKey(ids)
        n_total = len(key)
        # NOTE: as SGLang's Req.init_next_round_input, the match runs on all but the last token
        # (at least one token is computed, for its logits); the tree matches whole pages
        m = cache.match_prefix(MatchPrefixParams(RadixKey(ids[:n_total - 1])))
        prefix, node = m.device_indices, m.last_device_node
        chunk_room = int(budget_tokens // self.page * self.page) if np.isfinite(budget_tokens) else 0
        real_input = self._paged(n_total - len(prefix) - m.host_hit_length)
        if real_input > budget_tokens and not (can_chunk and chunk_room >= self.page):
            return None
        if real_input >= input_room:
            return None
        # NOTE: PrefillAdder holds a lock on the matched device node (``_lock_node``) around
        # the check, the load-back and its own ``inc_lock_ref``, so the eviction the load-back
        # may cause never takes the prefix just matched
        held = node
        cache.inc_lock_ref(held)
        if (n_total - len(prefix) + self._max_new(req) + self.page
                >= self.session.allocator.available_size() + cache.evictable_size() - reserved):
            cache.dec_lock_ref(held)
            return _NO_TOKEN
        loaded = 0
        if self.hicache and m.host_hit_length > 0:
            # NOTE: load_back evicts for its own slots when they are short (HiRadixCache.load_back)
            values, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
            if len(values):
                prefix = np.concatenate([prefix, values])
                loaded = len(values)
                self.counts["load_backs"] += 1
                self.counts["load_back_tokens"] += loaded
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(held)
        n_new = n_total - len(prefix)
        chunk = n_new if self._paged(n_new) <= budget_tokens else chunk_room
        return _Admitted(req, key, np.asarray(prefix, np.int64), loaded, node, np.zeros(0, np.int64), n_new, 0, chunk)

    def _allocate(self, batch: list[_Admitted]) -> None:
        """SGLang's ``alloc_for_extend`` for a batch just formed: when fewer slots are free than
        its new tokens plus a page per request, the tree is asked to evict that whole amount
        (``alloc_paged_token_slots_extend`` -> ``evict_from_tree_cache``); then each request
        gets the pages its chunk needs beyond those it has (a chunked request's slots grow
        chunk by chunk).  Admission's check makes room certain; a shortfall is SGLang's
        out-of-memory error."""
        self._evict_for(sum(a.chunk for a in batch) + len(batch) * self.page)
        alloc = self.session.allocator
        for a in batch:
            need = self._paged(a.done + a.chunk) - len(a.new)
            if need <= 0:
                continue
            got = alloc.alloc(need)
            if got is None:
                raise EngineError(f"request {a.req.rid}: prefill out of memory: {need} device tokens for its chunk, "
                                  f"{alloc.available_size()} free after eviction (admission's check should have "
                                  "prevented this)")
            a.new = np.concatenate([a.new, np.asarray(got, np.int64)])

    def _evict_for(self, need: int) -> None:
        """SGLang's ``evict_from_tree_cache``: when fewer than ``need`` device tokens are free,
        ask the tree to evict ``need`` (not the shortfall)."""
        if self.session.allocator.available_size() < need:
            self.cache.evict(EvictParams(need))

    def _max_new_tokens(self, req: Request) -> int:
        """The request's ``max_new_tokens`` as SGLang's ``init_req_max_new_tokens`` bounds it:
        its output length, at most ``max_req_len - input - 1`` and ``pool - page-rounded input -
        page - 1`` (so a request alone always fits admission's reservation).  A colocated
        request stops there (:meth:`_out_len`)."""
        pool = int(self.scenario.scheduler.max_total_tokens)
        return max(0, min(req.output_len, pool - 1 - req.input_len - 1,
                          pool - self._paged(req.input_len) - self.page - 1))

    def _out_len(self, req: Request) -> int:
        """The output tokens the request produces: colocated, its ``max_new_tokens`` (at least
        one: the prefill's own token), so in a pool too small for its whole turn it finishes
        by length as in SGLang; PD, the turn's output (the decode side is not bounded here)."""
        return req.output_len if self.pd else max(1, self._max_new_tokens(req))

    def _max_new(self, req: Request) -> int:
        """PrefillAdder's ``max_new``: the request's ``max_new_tokens`` less the output it has
        (a retracted request's), at most ``CLIP_MAX_NEW_TOKENS``.  PD prefill: 1 (SGLang's
        prefill server sets ``max_new_tokens = 1`` so that admission counts no decode)."""
        if self.pd:
            return 1
        return min(max(self._max_new_tokens(req) - self._retracted.get(req.rid, 0), 0), CLIP_MAX_NEW_TOKENS)

    def _reserve(self) -> float:
        """PrefillAdder's ``rem_total_token_offset`` at the start of a batch: the new-token
        ratio times each decoding request's remaining output tokens (``max_new_tokens`` less
        its output so far, at most ``CLIP_MAX_NEW_TOKENS``); 0 for a PD prefill engine, which
        decodes nothing."""
        left = sum(min(max(self._max_new_tokens(d.req) - (d.ctx - d.req.input_len), 0), CLIP_MAX_NEW_TOKENS)
                   for d in self._decoding.values())
        return left * self.ratio.current

    # ---------------------------------------------------------------- ownership
    def _tree_slots(self) -> np.ndarray:
        """Per device slot, how many tree nodes' values hold it (int32, as long as the largest
        slot any value held), from a walk of the tree.

        NOTE: kept across batches, with the value arrays counted: a walk adds the arrays that
        appeared since the last one and takes out those gone, O(changes) array work instead of
        concatenating the whole tree's slots (a split, an eviction, a load-back or an insert
        gives a node a new array or none; an array is never written in place).  The arrays
        counted are held here, so an id is never that of a freed array."""
        vals = {}
        stack = [self.cache.root_node]
        while stack:
            n = stack.pop()
            v = n.value
            if v is not None and n.parent is not None:
                vals[id(v)] = v
            stack.extend(n.children.values())
        held, cnt = self._tree_vals, self._tree_count
        for k in held.keys() - vals.keys():
            cnt[held.pop(k)[1]] -= 1
        for k in vals.keys() - held.keys():
            arr = np.asarray(vals[k], np.int64)
            if arr.size and int(arr.max()) >= cnt.size:
                cnt = np.concatenate([cnt, np.zeros(max(int(arr.max()) + 1, 2 * cnt.size) - cnt.size, np.int32)])
            cnt[arr] += 1
            held[k] = (vals[k], arr)
        self._tree_count = cnt
        return cnt

    def _check_ownership(self, batch: list[_Admitted]) -> None:
        """Every slot a request's kernels read is its own: its prefix slots are the values of
        the locked path from the root to its last node (plus what it loaded back), its new
        slots are allocated (not free), hold no tree node's KV, and no other request of the
        batch has them."""
        # NOTE: membership by masks over slot and page ids: the tree can hold the whole device
        # pool (a million slots in the incident), which sets of Python ints rebuilt per batch
        # made the largest part of a long run's engine time
        free = self.session.allocator.free_page_ids()
        in_tree = self._tree_slots()
        mine_all = [a.new[:a.n_new] for a in batch]
        top = 1 + max([in_tree.size - 1]
                      + [int(x.max()) for a in batch for x in (a.prefix, a.new[:a.n_new]) if len(x)])
        if top > in_tree.size:
            in_tree = np.concatenate([in_tree, np.zeros(top - in_tree.size, in_tree.dtype)])
        seen_new = np.zeros(top, bool)
        is_free = np.zeros(max(top // self.page + 1, int(free.max()) + 1 if free.size else 0), bool)
        is_free[free] = True
        for a, used in zip(batch, mine_all):
            self.counts["ownership_checks"] += 1
            path, n = [], a.node
            while n is not None and n.parent is not None:
                if n.lock_ref <= 0:
                    raise OwnershipError(f"request {a.req.rid}: node {n.id} on its path is not locked")
                if n.value is None:
                    raise OwnershipError(f"request {a.req.rid}: node {n.id} on its path is not on the device")
                path.append(np.asarray(n.value, np.int64))
                n = n.parent
            owned = np.concatenate(path[::-1]) if path else np.zeros(0, np.int64)
            if not np.array_equal(owned[:len(a.prefix)], a.prefix):
                raise OwnershipError(f"request {a.req.rid}: prefix slots are not its locked path's values")
            pages = unique_sorted(np.concatenate([a.prefix, used]) // self.page)
            bad = pages[is_free[pages]]
            if bad.size:
                raise OwnershipError(f"request {a.req.rid}: reads pages {bad[:4].tolist()} "
                                     "that are free in the allocator")
            mine = unique_sorted(used)
            bad = mine[in_tree[mine] > 0]
            if bad.size:
                raise OwnershipError(f"request {a.req.rid}: new slots {bad[:4].tolist()} hold a tree "
                                     "node's KV")
            if seen_new[mine].any():
                raise OwnershipError(f"request {a.req.rid}: new slots shared with another request of the batch")
            seen_new[mine] = True

    # ---------------------------------------------------------------- one iteration
    def _form_batch(self) -> list[_Admitted]:
        now = self.session.now
        cps = self.scenario.scheduler.chunked_prefill_size
        budget = np.inf if cps == -1 else cps
        batch: list[_Admitted] = []
        used = 0
        # NOTE: as SGLang's PrefillAdder, the chunked request in progress goes first with its
        # next chunk; at most one request is chunked at a time
        # NOTE: admission reserves room for the decoding requests' remaining output (colocated)
        # and for what each admitted request will need (sim.engine.budget); the first request
        # that cannot be added ends the batch (get_new_batch_prefill breaks on any result but
        # CONTINUE: requests behind it wait, as in SGLang's FCFS queue)
        reserved = self._reserve()
        if self.chunked is not None:
            a, self.chunked = self.chunked, None
            # NOTE: add_chunked_req: the next chunk is at most the chunk budget and what memory
            # is left (int(rem_total_tokens), not page-aligned: the chunk may end mid-page, the
            # stash inserts the whole pages, the request keeps the partial one); the whole
            # budget when nothing is left
            left = int(self.session.allocator.available_size() + self.cache.evictable_size() - reserved)
            a.chunk = int(min(a.n_new - a.done, budget, left if left > 0 else budget))
            batch.append(a)
            used += self._paged(a.chunk)
            reserved += self._offset(a)
        # NOTE: a chunked request whose last chunk this is leaves the rest of the budget to
        # others, one of which may be chunked in turn (SGLang's rem_chunk_tokens)
        chunking = bool(batch) and batch[0].done + batch[0].chunk < batch[0].n_new
        # NOTE: PrefillAdder's rem_input_tokens is --max-prefill-tokens less the page-rounded
        # chunks added, which ``used`` counts too; with chunked prefill off a request that would
        # reach it ends the batch unless it is the first, and either way the batch ends once it
        # is spent (budget_state); with chunking on, chunked_prefill_size (the smaller default)
        # binds first
        max_input = self.scenario.scheduler.max_prefill_tokens
        self._abort_too_long(now)
        full = False
        rest = [r for r in self.waiting if r.arrival_us > now]
        for req in self._queue_order(now):
            if (full or len(batch) >= self.scenario.scheduler.max_running_requests
                    or used >= budget or used >= max_input):
                rest.append(req)
                continue
            room = max_input - used if batch and not np.isfinite(budget) else np.inf
            a = self._admit(req, budget - used, can_chunk=not chunking, reserved=reserved, input_room=room)
            if a is None or a is _NO_TOKEN:
                full = True
                rest.append(req)
                continue
            batch.append(a)
            used += self._paged(a.chunk)
            chunking = chunking or a.chunk < a.n_new
            reserved += self._offset(a)
        self.waiting = rest
        if batch:
            self._allocate(batch)
        return batch

    def _queue_order(self, now: float) -> list[Request]:
        """The requests arrived by ``now`` in SGLang's ``waiting_queue`` order after
        ``SchedulePolicy.calc_priority``.  The queue is a list kept across iterations: a
        request joins its end when it arrives (a retracted request when it is retracted).
        ``fcfs`` leaves it in that order; ``lpm``, while at most 128 wait (SGLang turns to
        ``fcfs`` above), sorts it in place, stably, longest cached prefix first
        (:meth:`_lpm_sort`); ``dfs-weight`` matches every request (stamping its path's access
        time) and rebuilds it depth first over the tree (:func:`dfs_weight_order`); ``lof``
        sorts it stably by descending ``max_new_tokens`` (all 1 on a PD prefill server);
        ``random`` shuffles it."""
        ready = {r.rid: r for r in self.waiting if r.arrival_us <= now}
        order = [rid for rid in self._order if rid in ready]
        known = set(order)
        order += [r.rid for r in sorted((r for rid, r in ready.items() if rid not in known),
                                        key=lambda r: (self._queued.get(r.rid, r.arrival_us), r.rid))]
        policy = self.scenario.scheduler.schedule_policy
        if policy == "lpm" and len(order) <= LPM_MAX_QUEUE:
            order = self._lpm_sort([ready[rid] for rid in order])
        elif policy == "dfs-weight":
            # NOTE: _compute_prefix_matches first (each match stamps its path's access time)
            order = dfs_weight_order(self.cache.root_node, [
                (rid, self.cache.match_prefix(MatchPrefixParams(RadixKey(self._tokens(ready[rid])))).last_device_node)
                for rid in order])
        elif policy == "lof":
            # NOTE: sampling_params.max_new_tokens: 1 for every request of a PD prefill server
            order = sorted(order, key=lambda rid: 0 if self.pd else -self._max_new_tokens(ready[rid]))
        elif policy == "random":
            self._policy_rng.shuffle(order)
        self._order = order
        return [ready[rid] for rid in order]

    def _lpm_sort(self, queue: list[Request]) -> list[int]:
        """``calc_priority`` under ``lpm``: each request matched against the tree on all its
        tokens (``_compute_prefix_matches``; the match stamps the path's access time, as
        SGLang's does, so a waiting request's prefix stays recent in the LRU), its key the
        matched device and host tokens (at most all but the last); a request whose device
        match is at most ``IN_BATCH_PREFIX_TOKENS`` and that shares at least that many tokens
        with an earlier such request goes last (in-batch prefix caching: one of them computes
        the shared prefix first).  Stable, so ties keep the queue's order."""
        matched, deprioritized, shared = {}, set(), []
        for req in queue:
            ids = self._tokens(req)
            m = self.cache.match_prefix(MatchPrefixParams(RadixKey(ids)))
            matched[req.rid] = min(len(m.device_indices) + m.host_hit_length, max(len(ids) - 1, 0))
            if len(m.device_indices) <= IN_BATCH_PREFIX_TOKENS:
                if max((_common_prefix(ids, o) for o in shared), default=0) >= IN_BATCH_PREFIX_TOKENS:
                    deprioritized.add(req.rid)
                else:
                    shared.append(ids)
        return [r.rid for r in sorted(queue, key=lambda r: np.inf if r.rid in deprioritized else -matched[r.rid])]

    def _paged(self, n: int) -> int:
        return -(-n // self.page) * self.page

    def _offset(self, a: _Admitted) -> int:
        """What adding ``a`` (its chunk ``a.chunk`` from ``a.done`` on) to the batch adds to
        PrefillAdder's ``rem_total_token_offset``: its page-rounded chunk, its ``max_new`` if
        this chunk is its last, and a page (the chunk's slots are allocated after the batch is
        formed, so the free count does not have them yet)."""
        last = a.done + a.chunk >= a.n_new
        return self._paged(a.chunk) + (self._max_new(a.req) if last else 0) + self.page

    def _prepare(self, batch: list[_Admitted]) -> tuple[int, int, list, ForwardBatch]:
        """What launching ``batch`` starts with, in either loop: its number ``k``, the load
        queue started (the batch's consumer index, -1 without HiCache), the ownership check,
        the number of its KV store with each request's new slots recorded for it (``parts``),
        and its ``ForwardBatch``."""
        s = self.session
        k = self.counts["batches"]
        self.counts["batches"] += 1
        consumer = self.cache.ready_to_load_host_cache() if self.hicache else -1
        self._check_ownership(batch)
        store = self._next_store()
        parts, reqs = [], []
        for a in batch:
            new = a.new[a.done:a.done + a.chunk]
            self._record_store(a, new, store)
            parts.append(new)
            slots = np.concatenate([a.prefix, a.new[:a.done + a.chunk]])
            entries = {role: s.entries_of(name, slots) for role, (name, _) in self.buffers.items()}
            reqs.append(BatchRequest(a.req.rid, entries, a.chunk, len(slots)))
        return k, store, parts, ForwardBatch("extend", tuple(reqs), consumer)

    def _issue_forward(self, batch: list[_Admitted], k: int, fb: ForwardBatch, one_step: bool,
                       before_layer=None) -> None:
        """Issue ``batch``'s forward (``fwd{k}``; rank ``r >= 1``: ``fwd{k}@r`` on its own
        stream, buffers and layer events) on every simulated rank with the gate map and keep,
        for each read, what judging it needs (the requests it was made for and how far each
        had come, the rank).  ``one_step``: a rank's forward may advance in one step when
        nothing is in flight into that rank's buffers.  ``before_layer(layer, rank)``: called
        before each layer of each rank's forward.  The cost model's jitter is keyed by the
        rank too (``(k,)`` on rank 0, ``(k, r)`` on rank r), so the ranks drift apart."""
        s = self.session
        consumer = fb.consumer_index
        events = s.controller.layer_event_names(consumer) if consumer >= 0 else None
        bound = self.config.graph_replay_max_tokens
        # a batch that loads and fits the captured prefill graph replays it (graph-replay-no-waits)
        replay = bound > 0 and consumer >= 0 and sum(r.new_tokens for r in fb.requests) <= bound
        self.counts["graph_replays"] += replay
        gate_map = self._replay_gate_map if replay else self.gate_map
        made_for = {a.req.rid: (a.req, len(a.prefix) + a.done + a.chunk) for a in batch}
        for rank, bufs in enumerate(self.rank_buffers):
            # NOTE: each rank decides one step on its own buffers (a slower rank may still have a
            # copy in flight); the outcome is the per-layer mode's either way
            one = one_step and can_advance_in_one_step(s.host, fb, bufs)
            self.forwards_one_step += one
            before = None if before_layer is None else (lambda layer, r=rank: before_layer(layer, r))
            issue = issue_forward(
                s.host.base, rank_name("forward", rank), fb, model=self.model, gate_map=gate_map, buffers=bufs,
                cost=self.cost, layer_events=None if events is None else [rank_name(e, rank) for e in events],
                options=self.options, tp=self.prefill_tp, one_step=one, tag=rank_name(f"fwd{k}", rank),
                key=(k,) if rank == 0 else (k, rank), before_layer=before)
            if self.keep == "all":
                self.issues.append(issue)
            for r in issue.reads:
                self.read_rids[r.op_id] = (r, consumer, made_for, rank)

    def _send_chunks(self, batch: list[_Admitted], k: int) -> None:
        """PD early send (``pd_send``; hypotheses module doc): right after batch ``k``'s forward
        is launched, each request whose chunk is not its last has the KV of its sequence
        positions ``[sent, end)`` read by the sender (``end``: the positions computed once this
        chunk is, page-aligned, as ``send_kv_chunk`` cuts a non-final chunk) on every rank:
        one ``read`` per pool the sender moves with every chunk, on :data:`SEND_STREAM`, covering
        every pool layer.  ``"early"`` puts a wait on :data:`SEND_EVENT`, recorded on the forward
        stream after the forward, before the reads; ``"early_unfenced"`` does not (#33970).
        Each read is judged as a read made for its request (reader ``pd_send``)."""
        mode = self.config.pd_send
        if not self.pd or mode == "after_forward":
            return
        s = self.session
        sends = []
        for a in batch:
            end = (len(a.prefix) + a.done + a.chunk) // self.page * self.page
            if a.done + a.chunk >= a.n_new or end <= a.sent:
                continue                  # the last chunk is sent after its forward (not an op)
            slots = np.concatenate([a.prefix, a.new[:a.done + a.chunk]])
            sends.append((a, a.sent, end, slots))
            a.sent = end
        if not sends:
            return
        # each read's entries and byte extents, the same on every rank (one layout per role)
        reads = []
        for a, start, end, slots in sends:
            made_for = {a.req.rid: (a.req, end)}
            for role in self.model.chunk_sent_roles:
                if role not in self.buffers or role not in self.config.transfer_pools:
                    continue
                name0, lay = self.buffers[role]
                before = len(s.entries_of(name0, slots[:start]))
                ent = s.entries_of(name0, slots[:end])[before:]
                if len(ent):
                    ext = [lay.token_extents(pl, ent) for pl in range(lay.layers)]
                    starts, lens = coalesce(np.concatenate([o for o, _ in ext]), np.concatenate([n for _, n in ext]))
                    reads.append((a.req.rid, role, lay.layers, before, ent, starts, lens, made_for))
        for rank, bufs in enumerate(self.rank_buffers):
            stream = rank_name(SEND_STREAM, rank)
            if mode == "early":
                event = rank_name(SEND_EVENT, rank)
                s.host.base.issue({"op": "record", "stream": rank_name("forward", rank), "event": event,
                                   "id": rank_name(f"send{k}.record", rank)})
                s.host.base.issue({"op": "wait", "stream": stream, "event": event,
                                   "id": rank_name(f"send{k}.wait", rank)})
            for rid, role, layers, before, ent, starts, lens, made_for in reads:
                op_id = rank_name(f"send{k}.r{rid}.{role}", rank)
                buffer = bufs[role][0]
                s.host.base.issue({"op": "read", "stream": stream, "buffer": buffer, "id": op_id,
                                   "ranges": np.stack([starts, lens], axis=1)})
                info = ReadInfo(op_id, -1, SEND_READER, role, buffer, tuple(range(layers)), mode == "early",
                                starts, lens, {rid: ent}, {rid: before} if before else {})
                self.read_rids[op_id] = (info, -1, made_for, rank)
            s.host.base.issue({"op": "record", "stream": stream, "event": rank_name(SEND_DONE_EVENT, rank),
                               "id": rank_name(f"send{k}.done", rank)})
        self.counts["early_sends"] += len(sends)

    def _run_batch(self, batch: list[_Admitted]) -> None:
        s = self.session
        k, store, parts, fb = self._prepare(batch)
        self._store_batch(parts, batch[0].req.rid, store)
        # NOTE: one step only where nothing can interleave: no load into these buffers in flight
        # and none issued before the forward's last read (the scheduler synchronizes the forward
        # stream below before its next cache call); the results are the per-layer mode's.
        # Decided per rank in _issue_forward.
        self._issue_forward(batch, k, fb, self.one_step)
        self._send_chunks(batch, k)
        s.synchronize(stream="forward")
        for a in batch:
            a.done += a.chunk
            if a.done < a.n_new:
                # NOTE: the chunked request keeps its lock and slots; its computed pages enter
                # the tree at the top of the next iteration (_stash)
                self.chunked = a
                self.counts["chunks"] += 1
                continue
            self._prefill_done(a)

    def _prefill_done(self, a: _Admitted) -> None:
        """Request ``a``'s last chunk has been computed (its batch's result is processed):
        ``insert`` its KV (duplicates of what the tree has freed), then hand it to decode (PD:
        its unaligned tail freed; colocated: kept, :class:`_Decoding`)."""
        s = self.session
        self._ids.pop(a.req.rid, None)
        res = self.cache.insert(InsertParams(a.key, np.concatenate([a.prefix, a.new[:a.n_new]])))
        aligned = len(a.key) // self.page * self.page
        dup = a.new[:max(0, res.prefix_len - len(a.prefix))]
        tail = a.new[max(0, aligned - len(a.prefix)):]
        if len(dup):
            self._free_maybe_sent(a, dup)
        # NOTE: colocated, SGLang's process_batch_result_prefill -> cache_unfinished_req: the
        # request keeps its unaligned tail page (its decode continues in it) and its lock moves
        # to the node its page-aligned prompt now ends at, so the prompt stays protected until
        # its release (cache_finished_req, _release); PD, the prefill engine frees the tail and
        # releases the request once the KV is handed over (its transfer is not modelled on the
        # prefill side's streams)
        if self.pd:
            if a.sent:
                # NOTE: SGLang keeps a request whose KV is being sent in its inflight queue and
                # releases it once the sender reports KVPoll.Success: its slots are not freed (nor
                # its prefix made evictable) while an early read of them may still run
                self._send_pending.append((tail, a.node))
            else:
                self._release_sent(tail, a.node)
        else:
            prefix = self._move_lock(a, a.key[:aligned]).device_indices if aligned else a.prefix
            self._decoding[a.req.rid] = _Decoding(a.req, a.node, np.asarray(prefix, np.int64), tail, len(a.key))
        # a retracted request's output so far was prefilled again: its decode goes on from there
        had = self._retracted.pop(a.req.rid, 0)
        self._queued.pop(a.req.rid, None)
        self.decode.admit(a.req.rid, s.now, len(a.key), self._out_len(a.req) - had)

    def _release_sent(self, slots: np.ndarray, node) -> None:
        """PD: the prefill side's release of a request handed over (its unaligned tail freed,
        its node unlocked), or (``node`` None) of duplicate slots an early send covered."""
        if len(slots):
            self.session.allocator.free(slots)
        if node is not None:
            self.cache.dec_lock_ref(node)

    def _free_maybe_sent(self, a: _Admitted, slots: np.ndarray) -> None:
        """Free ``a``'s duplicate ``slots`` (their tokens are the tree's now), after its early
        sends have completed when it had any (an early read may cover them)."""
        if a.sent:
            self._send_pending.append((slots, None))
        else:
            self.session.allocator.free(slots)

    def _poll_sends(self) -> None:
        """PD early send: release the requests whose early reads have completed (the sender's
        poll: the last batch's sends, recorded on :data:`SEND_STREAM` as :data:`SEND_DONE_EVENT`,
        queried on every rank; the stream is FIFO, so every earlier send has completed too)."""
        if self._send_pending and self.session.host.query(SEND_DONE_EVENT):
            pending, self._send_pending = self._send_pending, []
            for slots, node in pending:
                self._release_sent(slots, node)

    def _stash(self, a: _Admitted) -> None:
        """SGLang's ``stash_chunked_request`` -> ``cache_unfinished_req(chunked=True)`` at the top
        of batch formation: the chunked request's computed tokens, page-aligned, enter the tree;
        the slots of the part the tree already had (another request inserted those tokens since
        this one matched) are freed, and the request continues on the tree's slots for them
        (``match_prefix`` again), its lock moved to the new last node.

        NOTE: both loops stash at the top of the iteration after the chunk's launch.  In the
        overlap loop the batch that computed the chunk may still be running on the GPU: the
        freed slots are still being written by that forward (its per-layer KV stores), and the
        batch formed next may hand them to a load-back, whose H2D only PR #36738's fence orders
        after those writes."""
        computed = len(a.prefix) + a.done
        aligned = computed // self.page * self.page
        if aligned <= len(a.prefix):
            return
        ids = self._tokens(a.req)
        slots = np.concatenate([a.prefix, a.new])
        key = RadixKey(ids[:aligned])
        res = self.cache.insert(InsertParams(key, slots[:aligned].copy(), chunked=True))
        dup = slots[len(a.prefix):res.prefix_len]
        if len(dup):
            self._free_maybe_sent(a, dup)
            self.counts["stash_frees"] += len(dup)
        a.prefix = np.asarray(self._move_lock(a, key).device_indices, np.int64)
        a.new = slots[aligned:]
        a.n_new -= aligned - computed + a.done
        a.done = computed - aligned

    def _move_lock(self, a: _Admitted, key: RadixKey):
        """The end of ``cache_unfinished_req`` for request ``a`` whose page-aligned ``key`` was
        just inserted: match it again (the tree's slots for it, which differ from the
        request's where another request inserted those tokens first) and move the request's
        lock from ``a.node`` to the node the match ends at; returns the match."""
        m = self.cache.match_prefix(MatchPrefixParams(key))
        if len(m.device_indices) != len(key):
            raise EngineError(f"request {a.req.rid}: {len(m.device_indices)} device slots matched right after "
                              f"inserting {len(key)} tokens (cache_unfinished_req)")
        self.cache.dec_lock_ref(a.node)
        self.cache.inc_lock_ref(m.last_device_node)
        a.node = m.last_device_node
        return m

    # ---------------------------------------------------------------- the overlap loop
    def _launch(self, batch: list[_Admitted]) -> _Launched:
        """Launch ``batch`` without waiting for it (SGLang's ``run_batch`` in the overlap loop):
        the load queue started, the ownership check, the forward issued per layer with each
        layer's new-token KV stores at its start (as the real forward writes them: a late
        layer's store lands late), then ``copy_done`` recorded on the forward stream."""
        k, store, parts, fb = self._prepare(batch)

        def store_layer(layer: int, rank: int) -> None:
            self._store_batch(parts, batch[0].req.rid, store, layer, ranks=[rank])

        # NOTE: never one step here: the next batch's load is issued while this forward runs
        self._issue_forward(batch, k, fb, False, before_layer=store_layer)
        self._send_chunks(batch, k)
        event = self._record_copy_done(f"fwd{k}")
        finished = []
        for a in batch:
            # NOTE: the request's progress advances at launch (SGLang's fill_ids / prefix_indices),
            # so the next iteration's stash sees this chunk as computed
            a.done += a.chunk
            if a.done < a.n_new:
                self.chunked = a
                self.counts["chunks"] += 1
            else:
                finished.append(a)
        return _Launched(finished, event)

    def _record_copy_done(self, tag: str) -> str:
        """Record the next of the overlap loop's batch events on the forward stream (after
        everything the launch issued); returns its name."""
        n = self.counts["launches"] = self.counts.get("launches", 0) + 1
        event = _OVERLAP_EVENTS[(n - 1) % len(_OVERLAP_EVENTS)]
        self.session.host.issue({"op": "record", "stream": "forward", "event": event, "id": f"{tag}.copy_done"})
        return event

    def _process(self, launched: _Launched) -> None:
        """``process_batch_result`` of a launched batch: wait for its ``copy_done`` (the event,
        not the stream: the batch launched after it is not waited for), then each request whose
        prefill it completed enters the tree and goes to decode (:meth:`_prefill_done`); the
        chunked request's chunk has nothing to process."""
        s = self.session
        s.synchronize(event=launched.event)
        for a in launched.finished:
            self._prefill_done(a)
        for rid in launched.decoded:
            if rid not in self._decoding:
                # NOTE: retracted (or aborted) when the next step was launched, before this
                # result came (SGLang's process_batch_result_decode skips it: the token is dropped)
                continue
            # NOTE: release_kv_cache -> cache_finished_req (_release): the request's last
            # (partial) page is freed here, while the decode step launched after this one may
            # still write the KV of its last token into it (that step ran it once more: it did
            # not know it had finished)
            self._finish(rid, s.now)

    def _launch_decode(self) -> _Launched | None:
        """Colocated, no prefill batch: launch one decode step of the running batch on the
        forward stream (SGLang runs the running batch when no prefill batch is formed) without
        waiting for it.  Each request in it writes its newest token's KV into its own decode
        slots, layer by layer inside the step; that includes the requests that finished in the
        step launched before, whose result is not processed yet (the overlap loop's extra step).
        None when nothing decodes."""
        s = self.session
        self.decode.join(s.now)
        last = self._pending
        extra = list(last.decoded) if last is not None else []
        if not self.decode.running and not extra:
            return None
        # NOTE: update_running_batch runs before the last step's result is processed: the
        # requests that finished in it are still in the batch (extra), and none of the batch
        # has that step's token yet
        running = list(self.decode.running)
        kept = set(self._update_running_batch(running + extra, unprocessed=set(last.ran) if last is not None else ()))
        running = [r for r in running if r in kept]
        extra = [r for r in extra if r in kept]
        if not running and not extra:
            return None
        if running:
            d, done = self.decode.step()
        else:
            # NOTE: only requests that finished already: the step still runs (SGLang filters them
            # out of the running batch when it processes the earlier step's result, after this launch)
            d, done = self.decode.steps.step_us([self._decoding[r].ctx for r in extra], self.decode.step_count), []
        k = self.counts["decode_steps"] = self.counts.get("decode_steps", 0) + 1
        # NOTE: a finished request's extra step writes its token into the page freed when the
        # earlier step's result is processed (SGLang #36738)
        parts, store = self._decode_kv(running, extra)
        layers = self.model.n_layers
        for layer in range(layers):
            if parts:
                self._store_batch(parts, (running + extra)[0], store, layer)
            s.host.issue({"op": "compute", "stream": "forward", "duration_us": d / layers, "jitter": False,
                          "id": f"decode{k - 1}.L{layer}"})
        event = self._record_copy_done(f"decode{k - 1}")
        return _Launched([], event, tuple(done), tuple(running))

    def _step_overlap(self) -> bool:
        """One iteration of SGLang's ``event_loop_overlap``: poll; stash the chunked request
        (top of ``get_next_batch_to_run``); form and launch the next batch; then process the
        previous batch's result.  With neither, the normal loop's idle handling."""
        self._poll()
        if self.pd:
            self._decode_pd()
        if self.chunked is not None:
            self._stash(self.chunked)
        batch = self._form_batch()
        launched = self._launch(batch) if batch else None
        if launched is None and not self.pd:
            launched = self._launch_decode()
        last, self._pending = self._pending, launched
        if last is not None:
            self._process(last)
        if launched is not None or last is not None:
            return True
        return self._idle()

    def _next_store(self) -> int:
        """The number of the next batch store (1, 2, ...: unique in the run); its write ops
        carry it as their ``version``, and the KV oracle files its units under it."""
        self._stores += 1
        return self._stores

    def _store_batch(self, parts: list, owner: int, store: int, layer: int | None = None, ranks=None) -> None:
        """Store a batch's new KV: the slots of every request (``parts``, in batch order) in
        ONE write per device buffer covering its layers (``layer``: that one only; default all), as
        SGLang's ``set_kv_buffer`` (and the DSA / V4 pools' ``set_*``) writes a whole batch's
        ``out_cache_loc`` with one kernel per layer and pool.

        NOTE: a write op carries one ``owner``: here the batch's first request, by convention
        (``version`` = ``store``).  What each unit holds is the oracle's per-request record
        (:meth:`_record_store`), never this owner; the race verdict compares provenance of
        the same schedule in two orders, so the owner only names the bytes.  ``ranks``: the
        simulated ranks written (default all, each on its own forward stream)."""
        slots = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.session.store_kv(slots, owner=owner, layers=None if layer is None else [layer], version=store,
                              stream="forward", sync=False, ranks=ranks)

    def _record_store(self, a: _Admitted, slots: np.ndarray, store: int) -> None:
        """Tell the KV oracle which token prefix each unit store ``store`` wrote for ``a``
        holds."""
        self._record_kv(a.req, slots, len(a.prefix) + a.done + np.arange(len(slots), dtype=np.int64), store)

    def _record_kv(self, req: Request, slots: np.ndarray, pos: np.ndarray, store: int, roles=None) -> None:
        """Tell the KV oracle that store ``store`` wrote, for ``req``, the KV of positions ``pos``
        of its sequence into ``slots`` (of the pool roles ``roles``; default every one)."""
        entries, positions = {}, {}
        for role, (name, _) in self.buffers.items():
            if roles is not None and role not in roles:
                continue
            r = self.ratios[role]
            ent = self.session.entries_of(name, slots)
            done = (slots + 1) % r == 0
            if len(ent) != int(done.sum()):
                raise EngineError(f"pool {role}: {len(ent)} entries for {int(done.sum())} slots completing a group "
                                  f"of {r} tokens (the session's entry mapping and the model's ratio disagree)")
            entries[role], positions[role] = ent, pos[done]
        self.oracle.record_store(req, store, entries, positions)

    def _decode_kv(self, running: list, extra=()) -> tuple[list, int]:
        """A colocated decode step's KV: each request of ``running`` writes its newest token's
        KV at its position ``ctx``, in its own slots (the prompt's tail page, then a page at a
        time: ``alloc_for_decode``, after :meth:`_update_running_batch` made room); so does
        each of ``extra`` (finished, in the overlap loop's extra step: SGLang #36738).
        Returns the slots to store, in request order, and the store's number (its keys
        recorded for the KV oracle).

        NOTE: one token per request, as the GPU writes it; where a buffer's unit is a page the
        session's write covers the whole page (``CacheSession.store_kv``), so the page's last
        store is the origin of all of it and files the key of the prefix up to its last entry,
        which is the key the next turn expects of a full page (the KV oracle's module doc)."""
        writes = []
        rids = [*running, *extra]
        # NOTE: alloc_for_decode over-estimates, a page per request, for its eviction
        self._evict_for(len(rids) * self.page)
        for rid in rids:
            d = self._decoding[rid]
            p = d.ctx
            d.ctx += 1
            i = p - len(d.prefix)
            if i >= len(d.own):
                more = self.session.allocator.alloc(self.page)
                if more is None:
                    raise EngineError(f"request {rid}: no free page for decode position {p} after "
                                      "check_decode_mem found room")
                d.own = np.concatenate([d.own, np.asarray(more, np.int64)])
            writes.append((d.req, d.own[i:i + 1], np.array([p], np.int64)))
        if not writes:
            return [], 0
        store = self._next_store()
        for req, slots, pos in writes:
            self._record_kv(req, slots, pos, store)
        return [slots for _, slots, _ in writes], store

    def _release(self, d: _Decoding) -> None:
        """SGLang's ``release_kv_cache`` -> ``cache_finished_req`` for a colocated request: its
        committed KV (``kv_committed_len``: prompt and output but the last output token, whose
        KV no step computed), page-aligned, is inserted into the tree with the slots that hold
        it; the slots of what the tree already had past the protected prompt and the unaligned
        tail are freed; its lock goes."""
        req, n = d.req, len(d.prefix)
        committed = min(d.ctx, req.input_len + self._out_len(req) - 1)
        end = committed // self.page * self.page
        rest = d.own
        if end > n:
            ids = np.concatenate([tokens(req), output_tokens(req)])[:end]
            res = self.cache.insert(InsertParams(RadixKey(ids), np.concatenate([d.prefix, d.own[:end - n]])))
            dup = d.own[:max(0, min(res.prefix_len, end) - n)]
            if len(dup):
                self.session.allocator.free(dup)
            rest = d.own[end - n:]
        if len(rest):
            self.session.allocator.free(rest)
        self.cache.dec_lock_ref(d.node)

    # ---------------------------------------------------------------- decode memory
    def _update_running_batch(self, rids: list, unprocessed=()) -> list:
        """SGLang's ``update_running_batch`` for the colocated decode batch ``rids`` (batch
        order): if the step's new pages do not fit (``check_decode_mem``, evicting for them),
        ``retract_decode`` (:mod:`sim.engine.budget`): requests leave, fewest output tokens
        first, until the rest fit, the last one never (it is aborted if even it does not fit);
        the new-token ratio restarts from the batch that stays.  Otherwise the ratio decays a
        step.  Returns the requests that stay, in batch order.  ``unprocessed``: requests that
        ran in the launched step whose result is not processed yet (overlap loop): their
        scheduler has one output token fewer, the one a retraction drops."""
        if self._check_decode_mem(rids):
            self.ratio.decay_step()
            return rids
        decoded = {r: self._decoding[r].ctx - self._decoding[r].req.input_len - (r in unprocessed) for r in rids}
        order = retract_order(rids, decoded, {r: self._decoding[r].req.input_len for r in rids})
        first = True
        while first or not self._check_decode_mem(order):
            if len(order) == 1:
                break                    # NOTE: retract_decode always keeps one request
            first = False
            self._retract(order.pop(), decoded, len(order))
        if len(order) <= 1 and not self._check_decode_mem(order):
            rid = order.pop()
            self._free_decoding(rid, 0)
            self.aborted.append(dict(rid=rid, input_tokens=self.driver._in_flight[rid].input_len,
                                     reason="out of memory even after retracting all other requests in the decode "
                                            "batch (SGLang's retract_decode aborts the last request)"))
            # the client gets the error: its session ends (as an input too long for the pool)
            self.waiting.extend(self.driver.abort(rid, int(self.session.now)))
        self.ratio.after_retract(sum(decoded[r] for r in order),
                                 sum(self._max_new_tokens(self._decoding[r].req) for r in order), len(order))
        kept = set(order)
        return [r for r in rids if r in kept]

    def _check_decode_mem(self, rids) -> bool:
        """``check_decode_mem``: the pages the next step needs (a page for each request whose
        next position starts one), evicting for them; whether they are free."""
        need = self.page * sum(1 for r in rids if self._decoding[r].ctx - len(self._decoding[r].prefix)
                               >= len(self._decoding[r].own))
        self._evict_for(need)
        return self.session.allocator.available_size() >= need

    def _free_decoding(self, rid: int, remaining: int) -> _Decoding:
        """``release_req``: the request's KV leaves without entering the tree
        (``cache_finished_req(is_insert=False)``: every slot of its own freed, its lock gone),
        it leaves the decode batch, and the tree evicts for the ``remaining`` requests' next
        ``SGLANG_RETRACT_DECODE_STEPS`` tokens."""
        d = self._decoding.pop(rid)
        if len(d.own):
            self.session.allocator.free(d.own)
        self.cache.dec_lock_ref(d.node)
        self._evict_for(remaining * RETRACT_DECODE_STEPS)
        self.decode.retract(rid)
        return d

    def _retract(self, rid: int, decoded: dict, remaining: int) -> None:
        """Retract ``rid`` (:meth:`_free_decoding`): it re-enters the queue now, with the
        ``decoded[rid]`` output tokens it had, to prefill again."""
        d = self._free_decoding(rid, remaining)
        self._retracted[rid] = decoded[rid]
        self._queued[rid] = self.session.now
        self._ids.pop(rid, None)
        self.waiting.append(d.req)
        self.counts["retractions"] += 1

    def _finish(self, rid: int, t_us: float, completed: bool = True) -> None:
        """Request ``rid``'s last output token came at ``t_us``: the turn is complete
        (``completed=False``: it ended aborted, already listed in ``aborted``)."""
        d = self._decoding.pop(rid, None)
        if d is not None:
            self._release(d)
        if completed:
            self.completed.append(rid)
        self.waiting.extend(self.driver.complete(rid, int(t_us)))

    def _abort_too_long(self, now: float) -> None:
        """Abort every arrived waiting request whose input is ``max_req_input_len`` tokens or
        more, as SGLang's scheduler does when the request comes in (``validate_input_length``:
        it finishes with an abort and an error message and never reaches a batch); the
        sessions they end open the next ones, whose first requests are checked in turn.
        Colocated, also a request admission could never take (:meth:`_refusal`)."""
        while True:
            bad = {r.rid: reason for r in self.waiting if r.arrival_us <= now
                   for reason in [self._refusal(r)] if reason is not None}
            if not bad:
                return
            gone = [r for r in self.waiting if r.rid in bad]
            self.waiting = [r for r in self.waiting if r.rid not in bad]
            for req in sorted(gone, key=lambda r: (r.arrival_us, r.rid)):
                self.aborted.append(dict(rid=req.rid, input_tokens=req.input_len, reason=bad[req.rid]))
                self.waiting.extend(self.driver.abort(req.rid, int(now)))

    def _refusal(self, req: Request) -> str | None:
        """Why ``req`` is aborted on arrival, or None.

        NOTE: a request whose input, admission's ``max_new`` (colocated its ``max_new_tokens``,
        at most ``CLIP_MAX_NEW_TOKENS``; PD prefill 1) and a page reach the pool fails
        admission's check even in an idle pool (its matched prefix is locked, all else free or
        evictable), at every try: SGLang 0.5.14 keeps it queued forever, and the queue behind
        it (colocated, ``init_req_max_new_tokens`` bounds ``max_new_tokens`` for this, but the
        page-rounded input can still leave no room: an input within a page of the pool).  A
        hung queue measures nothing, so it is aborted here, with that reason."""
        if req.input_len >= self.max_req_input_len:
            return (f"input length ({req.input_len} tokens) exceeds the maximum allowed length "
                    f"({self.max_req_input_len} tokens: scheduler.max_total_tokens - 6)")
        pool = int(self.scenario.scheduler.max_total_tokens)
        if req.input_len + self._max_new(req) + self.page >= pool:
            what = "max_new_tokens as the PD prefill server sets it" if self.pd else "max_new_tokens"
            return (f"input ({req.input_len} tokens), {what} ({self._max_new(req)}) and a page "
                    f"({self.page}) reach the pool ({pool} tokens: scheduler.max_total_tokens): admission could "
                    "never take it (SGLang would keep it queued, and the queue behind it, forever)")
        return None

    def _decode_pd(self) -> None:
        """PD: the decode engine runs on its own GPUs; bring it up to now.  A request the
        byte-level decode side aborted (a failed restore, ``DecodeCacheEngine._abort``) ends its
        turn as before, but is counted aborted, with its reason, not completed."""
        failed = getattr(self.decode, "aborted", ())
        for rid, t in self.decode.advance(self.session.now):
            if rid in failed:
                self.aborted.append(dict(rid=rid, input_tokens=self.driver._in_flight[rid].input_len,
                                         reason="decode-side HiCache restore failed (the decode server aborts the "
                                                "request: its load-back could not cover decode_prefix_len)"))
                self._finish(rid, t, completed=False)
            else:
                self._finish(rid, t)

    def _decode_step_colocated(self) -> bool:
        """Colocated: one decode step of the running batch on the forward stream (SGLang runs
        a decode batch when no prefill batch could be formed): its KV (:meth:`_decode_kv`, one
        write per buffer covering every layer), its compute, then the requests it finished
        released; False when nothing decodes."""
        s = self.session
        self.decode.join(s.now)
        if not self.decode.running:
            return False
        running = self._update_running_batch(list(self.decode.running))
        if not running:
            return True
        parts, store = self._decode_kv(running)
        d, done = self.decode.step()
        if parts:
            self._store_batch(parts, running[0], store)
        # jitter: false: the step model applied its keyed jitter already
        s.host.issue({"op": "compute", "stream": "forward", "duration_us": d, "jitter": False,
                      "id": f"decode{self.decode.step_count - 1}"})
        s.synchronize(stream="forward")
        for rid in done:
            self._finish(rid, s.now)
        return True

    def run(self, max_iterations: int = 1_000_000, *, progress=None) -> EngineResult:
        """Run the workload to its end and analyse the run: :meth:`start`, :meth:`step` until it
        returns False, :meth:`finish`.  ``progress``: called with the simulated time (us) before
        each scheduler iteration (e.g. to drive a progress bar)."""
        self.start()
        for _ in range(max_iterations):
            if progress is not None:
                progress(self.session.now)
            if not self.step():
                break
        else:
            raise EngineError(f"the run did not finish in {max_iterations} scheduler iterations")
        return self.finish()

    def start(self) -> None:
        """Release the workload's first requests (call once, before :meth:`step`)."""
        if self._t0 is not None:
            raise EngineError("the engine has started already (start() is called once)")
        self._t0 = time.perf_counter()
        self.waiting.extend(self.driver.start(0))

    def step(self) -> bool:
        """One scheduler iteration: poll the acks, bring the decode side up to now, run a
        prefill batch if one can be formed (else, colocated, a decode step; else wait for the
        next arrival or decode event, or poll again after ``IDLE_US``).  False, doing
        nothing, once every request has completed."""
        if self._t0 is None:
            raise EngineError("call start() before step()")
        if self.driver.done:
            return False
        if self.overlap_loop:
            return self._step_overlap()
        self._poll()
        if self.pd:
            self._decode_pd()
        if self.chunked is not None:
            self._stash(self.chunked)
        batch = self._form_batch()
        if batch:
            self._run_batch(batch)
            return True
        return self._idle()

    def _idle(self) -> bool:
        """No prefill batch: colocated, a decode step; else wait for the next arrival or decode
        event, or poll again after ``IDLE_US``."""
        s = self.session
        if not self.pd and self._decode_step_colocated():
            return True
        # NOTE: nothing to run: the scheduler's on_idle resets the new-token ratio
        self.ratio.reset()
        future = [r.arrival_us for r in self.waiting if r.arrival_us > s.now]
        nxt = self.decode.next_event_us()
        if nxt is not None and nxt > s.now:
            future.append(nxt)
        ready = [r for r in self.waiting if r.arrival_us <= s.now]
        if future and not ready:
            s.advance(max(1.0, min(future) - s.now))
        elif ready and not s.controller.ack_write_queue and not s.controller.ack_load_queue and not self._send_pending:
            r = ready[0]
            raise EngineError(f"request {r.rid} ({r.input_len} tokens) cannot fit the device pool "
                              f"({s.allocator.size_full} tokens) "
                              "even with nothing pending; raise scheduler.max_total_tokens")
        else:
            s.advance(IDLE_US)
        return True

    def finish(self) -> EngineResult:
        """Wait for the device to go idle, poll once more and analyse the run (the verdicts,
        the KV oracle, the metrics); the session is finished after it."""
        if self._t0 is None:
            raise EngineError("call start() and step() before finish()")
        if not self.driver.done:
            raise EngineError(f"{len(self.driver.in_flight())} requests are still in flight; step() until it "
                              "returns False")
        if self._pending is not None:
            # the overlap loop's last launch (a decode step that only ran requests already
            # finished): its result, which holds nothing more to do, is processed as SGLang's
            # next iteration would
            last, self._pending = self._pending, None
            self._process(last)
        self.session.wait_idle()
        self._poll()
        return self._result(time.perf_counter() - self._t0)

    def _poll(self) -> None:
        """``check_hicache_events()``: poll the backup and load acks (HiCache on only); PD with
        an early send, the sender's completions too (:meth:`_poll_sends`)."""
        if self.hicache:
            self.cache.check_hicache_events()
        self._poll_sends()

    # ---------------------------------------------------------------- verdicts
    def _on_read(self, capture, expected_views, entry: dict) -> None:
        """The session's read sink (``keep="report"``): judge the read now."""
        t = self._tally
        t.reads += 1
        st = entry["status"]
        t.stale += st == "stale"
        t.torn += st == "torn"
        # NOTE: a read with no copy item mid-flight in its bytes saw the buffer as it is now (the
        # items landed so far are applied before it; the sink runs at the read's instant), which
        # the oracle looks up once instead of view by view, and judges incrementally
        contents = None if capture.torn else self.session.buffer_contents(capture.buffer)
        lr = self._layer_reads
        if lr is not None:
            # NOTE: an ok per-layer read waits to be judged with the forward's others of its rank
            # and role, in one oracle call (sim.engine.layer_reads says why the verdicts agree)
            rec = self.read_rids.get(capture.op_id)
            if st == "ok" and contents is not None and rec is not None and lr.keep(capture.op_id, rec, contents):
                del self.read_rids[capture.op_id]
                return
            lr.flush()
        self._judge(capture.op_id, st, capture, _Expected(expected_views), contents)

    def _watcher(self, oracle: KVOracle):
        """The run memory's write watcher for ``oracle``: the reads kept that a write touches
        are judged first (``LayerReads.written``), then the oracle forgets its pages."""
        lr = self._layer_reads

        def written(buffer, offsets, lengths):
            lr.written(buffer, offsets, lengths)
            oracle.written(buffer, offsets, lengths)
        return written

    def _judge(self, op_id: str, status: str, obs, ref, contents=None) -> None:
        """One read of a forward (``obs``: what it saw; ``ref``: its happens-before-order
        views; ``status``: the race verdict): which requests it hit, the indexer's top-k on
        a raced index-K read, and the KV oracle's check of each request it was made for."""
        rec = self.read_rids.pop(op_id, None)
        if rec is None:
            return
        info, consumer, made_for, rank = rec
        t = self._tally
        rids: set[int] = set()
        topk = None
        if status in ("stale", "torn"):
            rids = self._requests_hit(info, obs, ref)
            t.raced |= rids
            if info.role == "index_k" and rids and info.reader != SEND_READER:
                topk = self._topk_changed(info, obs, ref, rids)
                t.topk_changed += bool(topk)
        # the oracle: did each request see its own tokens' KV (in any order)?
        kv_wrong = {rid for rid, bad in self.oracles[rank].check_reads(info, obs, made_for, contents).items()
                    if bad.any()}
        self._tally_read(op_id, status, info, consumer, rank, rids, kv_wrong, topk)

    def _judge_run(self, run) -> dict:
        """``keep="all"``: the finished ``run``'s verdicts (``sim.verdicts.analyse`` against its
        happens-before-order reference, every race listed), each of its reads judged
        (``_judge``) and the tally's read counts set; returns the report."""
        ref = run_reference(run.schedule, materialise=run.memory.material is not None, table=run.memory.table)
        rep = analyse(run, reference=ref, race_limit=None)
        ref_reads = {r.op_id: r for r in ref.reads}
        obs_reads = {r.op_id: r for r in run.reads}
        for entry in rep["reads"]:
            self._judge(entry["op"], entry["status"], obs_reads[entry["op"]], ref_reads[entry["op"]])
        t = self._tally
        t.reads, t.stale, t.torn = rep["reads_total"], rep["stale_reads"], rep["torn_reads"]
        return rep

    def _tally_read(self, op_id: str, status: str, info, consumer: int, rank: int, rids: set, kv_wrong: set,
                    topk) -> None:
        """Add one judged read to the tally: ``rids`` the requests its race hit, ``kv_wrong``
        those the oracle found reading KV not theirs, ``topk`` the indexer's verdict (or None)."""
        t = self._tally
        t.wrong |= kv_wrong
        t.wrong_reads += bool(kv_wrong)
        if rids or kv_wrong:
            t.by_rank[rank] += 1
            t.corrupted.append({"op": op_id, "layer": info.layer, "reader": info.reader, "role": info.role,
                                "buffer": info.buffer, "status": status if rids else "wrong-kv", "waited": info.waited,
                                "consumer_index": consumer, "requests": sorted(rids | kv_wrong),
                                "wrong_kv_requests": sorted(kv_wrong), "topk_changed": topk,
                                **({"rank": rank} if self.ranks > 1 else {})})

    def _result(self, wall0: float) -> EngineResult:
        t0 = time.perf_counter()
        s = self.session
        run = s.finish()
        if self._layer_reads is not None:
            self._layer_reads.flush()
        t = self._tally
        if self.keep == "all":
            rep = self.report = self._judge_run(run)   # e.g. for a trace or an exported window
            races, races_total = rep["latent_races"], rep["latent_races_total"]
            oob = len(rep["oob_writes"])
        else:
            # NOTE: straight from the online verdicts (every race listed: the session's
            # race_limit is None); analyse's report would also digest every buffer, which the
            # result does not need
            races, races_total = run.online.races.listed(None), run.online.races.total
            oob = sum(o["side"] == "dst" for o in run.oob)
        corrupted_rids = t.raced | t.wrong
        decode = self._decode_side_result()
        if decode is not None:
            corrupted_rids = corrupted_rids | set(decode["corrupted_rids"])
        by_buf: dict[str, int] = {}
        for race in races:
            by_buf[race["buffer"]] = by_buf.get(race["buffer"], 0) + 1
        total = self.driver.requests_released
        return EngineResult(
            scenario=self.scenario.name, seed=self.seed, layers=self.model.n_layers, requests_total=total,
            requests_completed=len(self.completed), requests_corrupted=len(corrupted_rids),
            corrupted_fraction=len(corrupted_rids) / total if total else 0.0, reads_total=t.reads,
            stale_reads=t.stale, torn_reads=t.torn, latent_races=races_total,
            latent_races_by_buffer=dict(sorted(by_buf.items())), oob_writes=oob,
            load_backs=self.counts["load_backs"], load_back_tokens=self.counts["load_back_tokens"],
            backups=s.controller.writes_started, batches=self.counts["batches"], branches=s.branches,
            sim_time_s=run.end_us / 1e6, wall_time_s=wall0 + time.perf_counter() - t0, corrupted_reads=t.corrupted,
            ownership_checks=self.counts["ownership_checks"], forwards_one_step=self.forwards_one_step,
            hicache=self.hicache, chunked_batches=self.counts["chunks"], requests_raced=len(t.raced),
            requests_wrong_kv=len(t.wrong), wrong_kv_reads=t.wrong_reads,
            oracle_entries=sum(o.entries_checked for o in self.oracles), index_k_topk_changed=t.topk_changed,
            simulated_ranks=self.ranks, corrupted_reads_by_rank=list(t.by_rank), decode=decode,
            requests_aborted=len(self.aborted), aborted_requests=list(self.aborted),
            requests_retracted=self.counts["retractions"], graph_replays=self.counts["graph_replays"],
            early_sends=self.counts["early_sends"])

    def _decode_cache_engine(self, steps, profile, smodel: str, device_tokens: int, switches: dict,
                             materialise: bool, transfer_pools):
        """PD with ``hicache.decode``, ``deployment.decode_bytes`` or a transfer that leaves a
        pool out (``transfer_pools``, None: every pool): the decode engine at byte level on its
        own ``CacheSession`` (``sim.engine.decode_hicache``), same pool geometry and HiCache
        settings as the prefill's (its tree used only with ``hicache.decode``) and the engine's
        ``keep`` (``"all"``: the decode run is kept whole, so its raced reads can be cut into
        windows; ``"report"``: its verdicts streamed)."""
        from sim.engine.decode_hicache import DecodeCacheEngine

        sc, cfg = self.scenario, self.config
        overlap = sc.scheduler.decode_event_loop == "overlap"
        session = CacheSession(
            model=smodel, layers=self.model.n_layers, page_size=sc.hicache.page_size, device_tokens=device_tokens,
            hicache_ratio=sc.hicache.ratio, hicache_size=float(sc.hicache.size_gb), layout=sc.hicache.layout,
            io_backend=sc.hicache.io_backend, write_policy=sc.hicache.write_policy,
            load_back_threshold=sc.hicache.load_back_threshold, overlap=sc.scheduler.overlap,
            load_fence=sc.hicache.load_fence and cfg.load_fence_stream == "forward", profile=sc.deployment.profile,
            seed=self.seed, materialise=materialise, keep=self.keep, digest=False,
            batch_events=len(_OVERLAP_EVENTS) if overlap else 0, **switches)
        # NOTE: the driver holds each request in flight until its turn completes, which is after
        # the decode side has finished with it
        return DecodeCacheEngine(steps, max_running=sc.scheduler.max_running_requests,
                                 transfer_gbps=self._pd_transfer_gbps(profile),
                                 transfer=transfer_size(self.model, self.options, session.config.page_size),
                                 transfer_latency_us=self._pd_transfer_latency_us(profile), session=session,
                                 hicache=sc.hicache.decode, transfer_pools=transfer_pools,
                                 lookup=lambda rid: self.driver._in_flight[rid], overlap=overlap)

    def _pd_transfer_gbps(self, profile) -> float:
        """The PD KV transfer's rate: ``deployment.pd_transfer_gbps``, or the profile's H2D rate."""
        return self.scenario.deployment.pd_transfer_gbps or profile.h2d_gbps

    def _pd_transfer_latency_us(self, profile) -> float:
        """The PD KV transfer's fixed time: ``deployment.pd_transfer_latency_us``, or (-1) the
        profile's memcpy latency."""
        t = self.scenario.deployment.pd_transfer_latency_us
        return profile.memcpy_latency_us if t == -1 else t

    def _decode_side_result(self) -> dict | None:
        """The byte-level decode side's metrics (``DecodeCacheEngine.finish``), or None."""
        finish = getattr(self.decode, "finish", None)
        return finish() if finish is not None else None

    @staticmethod
    def _read_bytes(read, info) -> np.ndarray:
        """The bytes a read saw, in its extents' order (materialised from provenance)."""
        views = sorted(read.views, key=lambda v: v.offset)
        offs = np.array([v.offset for v in views], np.int64)
        parts = []
        for st, ln in zip(info.starts.tolist(), info.lengths.tolist()):
            v = views[int(np.searchsorted(offs, st, side="right")) - 1]
            parts.append(v.compact.materialise(st - v.offset, ln))
        return np.concatenate(parts) if parts else np.zeros(0, np.uint8)

    def _topk_changed(self, info, obs, ref, rids) -> bool:
        """Does the indexer's top-k (``sim.engine.forward.topk_verdict``, the model's
        ``index_topk``) from the bytes read differ from the one from the happens-before-order
        bytes, for any request in ``rids`` and pool layer of the read?"""
        lay = self.buffers["index_k"][1]
        seen_b, right_b = self._read_bytes(obs, info), self._read_bytes(ref, info)
        field = "key" if "key" in [f.name for f in lay.effective_fields] else None
        for rid in sorted(rids):
            ent = info.entries.get(rid)
            if ent is None or not len(ent):
                continue
            for pl in info.pool_layers:
                seen = entry_bytes(seen_b, info, lay, ent, pl, field)
                right = entry_bytes(right_b, info, lay, ent, pl, field)
                if topk_verdict(seen, right, self.model.dims.index_topk, query_seed=rid).changed:
                    return True
        return False

    def _requests_hit(self, info, obs, ref) -> set[int]:
        """Requests of the read whose entries' bytes hold a differing byte (by provenance).

        NOTE: decided on the runs where the two views' provenance differs (``differing_runs``,
        O(segments)) against each request's entry extents, not byte by byte: a raced read of a
        long context (a decode step reads them all) is megabytes, and materialising each byte's
        provenance was most of a byte-level decode run's time
        (``tests/test_speed_requests_hit.py`` compares it with the per-byte check)."""
        lo, hi = [], []
        for vo, vr in zip(obs.views, ref.views):
            for s, n, wrong, _ in differing_runs(vo, vr):
                if wrong:
                    lo.append(vo.offset + s)
                    hi.append(vo.offset + s + n)
        if not lo:
            return set()
        lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        lay = self.buffers[info.role][1]
        out = set()
        for rid, ent in info.entries.items():
            for pl in info.pool_layers:
                offs, lens = lay.token_extents(pl, ent)
                starts, ends = offs.ravel(), (offs + lens).ravel()
                if not starts.size:
                    continue
                order = np.argsort(starts, kind="stable")
                starts, reach = starts[order], np.maximum.accumulate(ends[order])
                # the extents starting before each differing run's end: one reaching past its start meets it
                k = np.searchsorted(starts, hi, side="left") - 1
                if bool(((k >= 0) & (lo < reach[np.maximum(k, 0)])).any()):
                    out.add(rid)
                    break
        return out


def run_prefill_engine(scenario, seed: int | None = None, *, overrides=(), layers: int | None = None,
                       device_tokens: int | None = None, materialise: bool = False,
                       keep: str = "report") -> EngineResult:
    """Run ``scenario`` (a :class:`Scenario`, a shipped name or a TOML path, with ``--set``
    style ``overrides``) through one :class:`PrefillEngine`; ``seed`` overrides ``run.seed``;
    ``keep`` (default ``"report"``: streaming verdicts, memory flat in the run's length) as
    :class:`PrefillEngine`'s."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario, overrides)
    if isinstance(scenario, Scenario) and overrides:
        raise InputError("overrides", "expected no overrides with a Scenario object (apply them when loading)")
    return PrefillEngine(sc, seed, layers=layers, device_tokens=device_tokens, materialise=materialise,
                         keep=keep).run()
