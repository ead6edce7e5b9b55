"""HiCache: SGLang's radix cache with a host tier, its cache controller, and a standalone session."""
from sim.cache.controller import (  # noqa: F401
    HiCacheAck, HiCacheController, LayerDoneCounter, LayerLoadingEvent, ProducerSlotBusy, SettleRequired,
)
from sim.cache.session import CacheSession, SessionConfig  # noqa: F401
from sim.cache.hiradix import HiRadixCache  # noqa: F401
from sim.cache.radix import RadixCache, RadixKey, TreeNode  # noqa: F401
from sim.cache.req import Req  # noqa: F401
from sim.cache.records import (  # noqa: F401
    CacheInitParams, EvictParams, EvictResult, InitLoadBackParams, InsertParams, InsertResult, MatchPrefixParams,
    MatchResult,
)
