"""Device pools, host pools, their allocators and their byte layouts."""
from sim.pools.layouts import (  # noqa: F401
    Field, HostLayout, Layout, PagedLayout, PRESETS, HOST_LAYOUTS,
    bf16_index_k, c4_indexer, c4_paged, c128_paged, dsa_index_k, host_mirror, swa_paged, token_rows,
    layout_from_json, layout_to_json,
)
from sim.pools.allocator import (  # noqa: F401
    BaseTokenToKVPoolAllocator, MissingIndicesError, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator,
    get_num_new_pages,
)
from sim.pools.req_to_token import ReqPoolError, ReqToTokenPool  # noqa: F401
from sim.pools.device import (  # noqa: F401
    DeepSeekV4IndexerPool, DeepSeekV4SingleKVPool, DeepSeekV4TokenToKVPool, DSATokenToKVPool, KVCache,
    MLATokenToKVPool, POOL_ROLE_OF_KIND, buffer_decl, deepseek_v4_flash_ratios,
)
from sim.pools.host import (  # noqa: F401
    DeepSeekV4PagedHostPool, DSAIndexerPoolHost, HostKVCache, HostPoolGroup, LogicalHostPool,
    MLATokenToKVPoolHost, PARTIAL_PAGE_MODES, PoolEntry, PoolTransfer, UnsupportedTransfer,
    deepseek_v4_num_host_pages,
    resolve_layout_io_compatibility,
)
