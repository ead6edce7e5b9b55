"""A colocated engine's decode-memory budget, as SGLang's scheduler keeps it.

Two mechanisms keep the running decode batch from outgrowing the device pool (SGLang 0.5.14,
``managers/schedule_policy.py``, ``scheduler.py``, ``schedule_batch.py``,
``scheduler_components/new_token_ratio_tracker.py``):

* **Admission reserves room for the running requests' remaining output.** ``PrefillAdder``
  admits a request only while ``rem_total_tokens`` (free + evictable device tokens, less a
  reservation) exceeds its ``extend_input_len + max_new + page``; the reservation counts, for
  each running request, ``min(max_new_tokens - len(output_ids), CLIP_MAX_NEW_TOKENS)`` times the
  *new-token ratio*, and for each request admitted in this batch its page-rounded new tokens,
  its whole ``max_new`` and a page.
* **A decode step that finds no room retracts requests.** ``update_running_batch`` ->
  ``check_decode_mem`` (the pages the step needs: one per request at a page boundary; the tree
  evicts for them) -> ``retract_decode``: requests leave the batch, fewest output tokens first
  (ties: the longest input first), their KV freed without entering the tree, until the rest
  fit; they re-queue and prefill again (prompt and the output so far).  The last request is
  never retracted: if even it does not fit it is aborted.  The ratio then restarts from what
  the remaining batch has decoded; each decode step without a retraction decays it toward its
  floor, and an idle scheduler resets it.

:class:`NewTokenRatio` is the ratio's schedule; :func:`retract_order` the order requests leave
in.  The engine (:mod:`sim.engine.engine`) applies both.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CLIP_MAX_NEW_TOKENS", "RETRACT_DECODE_STEPS", "NewTokenRatio", "retract_order"]

#: SGLang's defaults (``environ.py``): SGLANG_INIT_NEW_TOKEN_RATIO, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR,
#: SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS, SGLANG_RETRACT_DECODE_STEPS, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS = 4096


@dataclass
class NewTokenRatio:
    """The fraction of a running request's remaining output tokens admission reserves room
    for.  Starts at ``min(0.7 * conservativeness, 1)``; :meth:`decay_step` (a decode step
    with no retraction) lowers it by ``(init - floor) / 600`` down to ``floor = init * 0.14``;
    :meth:`after_retract` sets it from the batch that stays; :meth:`reset` (the scheduler
    idle) returns it to ``init``."""

    init: float
    floor: float
    decay: float
    current: float

    @classmethod
    def from_conservativeness(cls, conservativeness: float = 1.0) -> "NewTokenRatio":
        init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        floor = min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        return cls(init, floor, (init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS, init)

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.floor)

    def reset(self) -> None:
        self.current = self.init

    def after_retract(self, decoded: int, max_new: int, running: int) -> None:
        """The ratio after a retraction: ``(decoded + 20 * running) / (max_new + 1)``, at most
        1, over the requests that stay (their output tokens so far, their ``max_new_tokens``)."""
        self.current = min(1.0, (decoded + RETRACT_DECODE_STEPS * running) / (max_new + 1))


def retract_order(rids: list, decoded: dict, input_len: dict) -> list:
    """``rids`` (the running batch, in batch order) sorted as ``retract_decode`` sorts them:
    by (output tokens so far, -input length), descending, stable; requests leave from the
    END of the returned list."""
    return sorted(rids, key=lambda r: (decoded[r], -input_len[r]), reverse=True)
