"""Device pools, host pools, their allocators and their byte layouts."""
from sim.pools.layouts import (  # noqa: F401
    Field, HostLayout, Layout, PagedLayout, PRESETS, HOST_LAYOUTS,
    bf16_index_k, c4_indexer, c4_paged, c128_paged, dsa_index_k, host_mirror, token_rows,
    layout_from_json, layout_to_json,
)
from sim.pools.allocator import (  # noqa: F401
    BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator, get_num_new_pages,
)
from sim.pools.device import DSATokenToKVPool, KVCache, MLATokenToKVPool, buffer_decl  # noqa: F401
from sim.pools.host import (  # noqa: F401
    DSAIndexerPoolHost, HostKVCache, HostPoolGroup, MLATokenToKVPoolHost, PoolEntry, PoolTransfer,
    UnsupportedTransfer, resolve_layout_io_compatibility,
)
