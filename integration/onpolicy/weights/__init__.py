"""Weight sync from Megatron (any TP/PP/EP/ETP) to N SGLang engines, checked after every sync.

`names` plans where each tensor lives and what HF calls it; `gather` streams full HF tensors to
global rank 0; `sync` sends them in buckets over a transport to the engines (each an
`onpolicy.rollout.engine.EngineHandle`) and checks what they hold.
"""

from onpolicy.weights.gather import Gatherer
from onpolicy.weights.names import Item, group_ranks, hf_names_by_rank, sync_items
from onpolicy.weights.sync import (
    TRANSPORTS,
    CheckReport,
    SyncConfig,
    SyncStats,
    WeightSync,
    WeightSyncError,
    covers,
)

__all__ = [
    "TRANSPORTS", "CheckReport", "Gatherer", "Item", "SyncConfig", "SyncStats", "WeightSync",
    "WeightSyncError", "covers", "group_ranks", "hf_names_by_rank", "sync_items",
]  # fmt: skip
