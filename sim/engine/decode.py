"""The decode side in simulated time: continuous batching, one token per request per step.

A decode step's duration comes from the same roofline terms as the forward model
(:func:`~sim.engine.cost.step_cost` per layer and step of a ``decode`` batch: one query token
per request, every entry of its context read, the layer's FFN), times one keyed jitter
factor per step.  Decode batches carry no HiCache load (consumer index -1, as in SGLang), so
in the engine no decode read can race a load-back: what decode changes is *when* a turn ends
(and so when the session's next turn arrives) and, colocated, how long the GPU is busy
between prefill batches.

:class:`DecodeEngine` (``deployment.mode = "pd"``): the decode engine of a PD pair.  A
request admitted at ``t`` (its prefill's end) first waits for its KV transfer (the prefill
engine's KV of its context, every pool and layer, a sliding-window pool's window only
(:class:`TransferSize`), over the link at ``link.h2d_gbps``: the profile's PCIe figure stands
in for the NIXL path between the two engines' GPUs), then joins
the running batch at the next step boundary (at most ``max_running`` requests; the rest
queue in arrival order).  Steps run back to back while any request runs; a request
finishes at the end of the step that produces its last output token.  No byte-level
model of the decode engine's pools here: with ``hicache.decode = false`` (the incident)
nothing loads into them; with ``hicache.decode = true`` the engine uses
:class:`sim.engine.decode_hicache.DecodeCacheEngine`, this class with its pools at byte level.

Colocated mode uses :func:`decode_step_us` directly: the engine issues each decode step as
a compute op on the forward stream between prefill batches.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from sim.engine.cost import CostModel, keyed_normal, seq_sum, step_cost_of
from sim.engine.models import ModelFamily, window_start
from sim.errors import InputError, show

__all__ = ["DecodeEngine", "DecodeStepModel", "TransferSize", "transfer_size"]

#: the key tag of a decode step's jitter (the prefill forwards key theirs by batch number)
_DECODE_KEY = 1 << 40


@dataclass(frozen=True)
class TransferSize:
    """What a PD transfer moves: ``per_token`` device KV bytes per raw token of every pool
    but the sliding-window one (over every layer, page padding included), and
    ``window_per_token`` of the sliding-window pool (0: the model has none), which is sent
    only from :func:`~sim.engine.models.window_start` (``window``, ``page``) on, as SGLang's
    ``_swa_payload`` sends it."""

    per_token: float
    window_per_token: float = 0.0
    window: int = 0
    page: int = 1

    def nbytes(self, start: int, stop: int) -> float:
        """Bytes of the transfer of positions ``[start, stop)`` of a ``stop``-token sequence."""
        b = (stop - start) * self.per_token
        if self.window_per_token:
            b += max(0, stop - max(start, window_start(stop, self.window, self.page))) * self.window_per_token
        return b


def transfer_size(model: ModelFamily, options: Mapping[str, str], page: int) -> TransferSize:
    """The :class:`TransferSize` of ``model``'s pools under ``options`` with pages of ``page``
    tokens."""
    pools = model.pools_for(options).values()
    win = [p for p in pools if p.windowed and model.dims.window > 0]
    return TransferSize(sum(p.bytes_per_token * len(p.layers) for p in pools if p not in win),
                        sum(p.bytes_per_token * len(p.layers) for p in win),
                        model.dims.window if win else 0, page)


class DecodeStepModel:
    """Duration of one decode step of a batch, on one GPU of a TP group of ``tp``.

    Layers of one kind cost the same, so each kind is costed once and multiplied by its
    layer count.  KV bytes read per request and pool: its entries
    (``ceil(context / tokens_per_entry)``, the sliding-window pool only the window) times the
    entry's bytes.  Contexts are rounded up to ``QUANTUM`` tokens before costing (a step adds
    one token per request, so without it no two steps would share a cost; a page of context
    changes a step's duration by well under 1 %)."""

    #: context tokens are costed in multiples of this (a HiCache page of V4)
    QUANTUM = 256

    def __init__(self, model: ModelFamily, cost: CostModel, options: Mapping[str, str], tp: int):
        if not isinstance(tp, int) or tp < 1:
            raise InputError("tp", f"expected an integer >= 1, got {show(tp)}")
        self.model, self.cost, self.options, self.tp = model, cost, dict(options), tp
        self.pools = model.pools_for(self.options)
        self._cache: dict[tuple, float] = {}
        self.kinds: dict[str, int] = {}
        self.first_layer: dict[str, int] = {}
        for i, k in enumerate(model.layer_kinds):
            self.kinds[k] = self.kinds.get(k, 0) + 1
            self.first_layer.setdefault(k, i)

    def _kv_bytes(self, role: str, contexts: np.ndarray) -> int:
        p = self.pools[role]
        per_entry = p.page_bytes / p.entries_per_page
        win = self.model.dims.window
        c = np.minimum(contexts, win) if role == "swa" and win else contexts
        return int(seq_sum(np.ceil(c / p.tokens_per_entry) * per_entry))

    def nominal_us(self, contexts: Sequence[int]) -> float:
        """The step's roofline duration without jitter (contexts rounded up to ``QUANTUM``)."""
        q = self.QUANTUM
        key = tuple(sorted(-(-c // q) * q for c in contexts))
        d = self._cache.get(key)
        if d is None:
            if len(self._cache) > 65536:
                self._cache.clear()
            d = self._cache[key] = self._nominal(key)
        return d

    def _nominal(self, contexts: Sequence[int]) -> float:
        contexts = np.asarray(contexts)
        ones = np.ones(contexts.size, np.int64)
        dims = self.model.dims
        total = 0.0
        for kind, n in self.kinds.items():
            layer = self.first_layer[kind]
            us = 0.0
            for step in self.model.layer_steps(layer, "decode", self.options):
                if not step.compute:
                    continue
                roles = [r for r in step.roles if r in self.pools]
                kv = sum(self._kv_bytes(r, contexts) for r in roles)
                ratio = max((self.pools[r].tokens_per_entry for r in roles), default=1)
                if step.compute == "indexer":
                    ratio = self.pools["index_k"].tokens_per_entry
                us += self.cost.nominal_us(step_cost_of(step.compute, dims, kind, ones, contexts, kv, self.tp, ratio))
            us += self.cost.nominal_us(step_cost_of("ffn", dims, kind, ones, contexts, 0, self.tp))
            total += n * us
        return total

    def step_us(self, contexts: Sequence[int], step: int) -> float:
        """``nominal_us`` times step ``step``'s keyed jitter factor."""
        d = self.nominal_us(contexts)
        j = self.cost.params.jitter_frac
        if j > 0:
            d *= max(0.0, 1.0 + j * keyed_normal(self.cost.seed, (_DECODE_KEY, step)))
        return d


class DecodeEngine:
    """A PD decode engine in simulated time (module doc).  ``transfer_gbps``: the KV transfer
    rate; ``transfer``: the bytes a transfer moves (:class:`TransferSize`)."""

    def __init__(self, steps: DecodeStepModel, *, max_running: int, transfer_gbps: float, transfer: TransferSize,
                 transfer_latency_us: float = 0.0):
        if max_running < 1 or transfer_gbps <= 0:
            raise InputError("decode", f"expected max_running >= 1 and transfer_gbps > 0, got {max_running}, "
                             f"{transfer_gbps}")
        self.steps = steps
        self.max_running = max_running
        self.transfer_gbps = transfer_gbps
        self.transfer_size = transfer
        self.transfer_latency_us = transfer_latency_us
        self.now = 0.0              # end of the last step (or the idle clock)
        self.arriving: list = []    # heap of (ready_us, order, rid, context, remaining)
        self.running: dict[int, list] = {}   # rid -> [context, remaining]
        self._order = 0
        self.step_count = 0
        self.transfer_bytes = 0.0
        self.busy_us = 0.0

    def transfer_us(self, context_tokens: int, start: int = 0) -> float:
        """The duration of the transfer of positions ``[start, context_tokens)``."""
        b = self.transfer_size.nbytes(start, context_tokens)
        return self.transfer_latency_us + b / (self.transfer_gbps * 1e3)   # GB/s = 1e3 B/us

    def admit(self, rid: int, t_us: float, context_tokens: int, output_tokens: int) -> None:
        """Request ``rid``'s prefill ended at ``t_us``: its KV transfer starts then."""
        if output_tokens < 1:
            raise InputError("output_tokens", f"expected >= 1, got {output_tokens}")
        self.transfer_bytes += self.transfer_size.nbytes(0, context_tokens)
        heapq.heappush(self.arriving, (t_us + self.transfer_us(context_tokens), self._order, rid, context_tokens,
                                       output_tokens))
        self._order += 1

    @property
    def idle(self) -> bool:
        return not self.running and not self.arriving

    def next_event_us(self) -> float | None:
        """When the decode side next changes: the running step's end, or the next arrival."""
        if self.running:
            return self.now
        return self.arriving[0][0] if self.arriving else None

    def join(self, now_us: float) -> None:
        """Requests whose transfer has landed by ``now_us`` join the running batch (arrival
        order, up to ``max_running``)."""
        while self.arriving and self.arriving[0][0] <= now_us and len(self.running) < self.max_running:
            _, _, rid, ctx, out = heapq.heappop(self.arriving)
            self.running[rid] = [ctx, out]

    def retract(self, rid: int) -> None:
        """Request ``rid`` leaves the running batch unfinished (colocated retraction, or an
        abort); nothing if it is not running (it finished in a step whose result the engine has
        not processed yet)."""
        self.running.pop(rid, None)

    def step(self) -> tuple[float, list[int]]:
        """One step of the running batch: its duration, and the requests it finishes (each
        gains a token; a request whose last output token this is finishes)."""
        if not self.running:
            raise InputError("decode", "no running request to step (call join first)")
        d = self.steps.step_us([c for c, _ in self.running.values()], self.step_count)
        self.step_count += 1
        self.busy_us += d
        done = []
        for rid in list(self.running):
            st = self.running[rid]
            st[0] += 1
            st[1] -= 1
            if st[1] == 0:
                del self.running[rid]
                done.append(rid)
        return d, done

    def advance(self, until_us: float) -> list[tuple[int, float]]:
        """On the engine's own clock (PD): run every step that starts at or before
        ``until_us``; the requests finished, with their finish times (a step that starts by
        ``until_us`` may end after it), in finish order."""
        out: list[tuple[int, float]] = []
        while True:
            if not self.running:
                if not self.arriving or self.arriving[0][0] > until_us:
                    return out
                self.now = max(self.now, self.arriving[0][0])
            self.join(self.now)
            if self.now > until_us:
                return out
            d, done = self.step()
            self.now += d
            out.extend((rid, self.now) for rid in done)
