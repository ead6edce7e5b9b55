"""HiCache: SGLang's radix cache with a host tier, its cache controller, and a standalone session."""
from sim.cache.controller import (  # noqa: F401
    HiCacheAck, HiCacheController, LayerDoneCounter, LayerLoadingEvent, ProducerSlotBusy, SettleRequired,
)
from sim.cache.session import CacheSession, SessionConfig  # noqa: F401
