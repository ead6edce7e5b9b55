"""Device pools, host pools and their byte layouts."""
from sim.pools.layouts import (  # noqa: F401
    Field, HostLayout, Layout, PagedLayout, PRESETS, HOST_LAYOUTS,
    bf16_index_k, c4_indexer, c4_paged, c128_paged, dsa_index_k, host_mirror, token_rows,
    layout_from_json, layout_to_json,
)
