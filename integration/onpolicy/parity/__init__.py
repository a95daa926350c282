"""`onpolicy parity`: SGLang samples, Megatron scores the same tokens, the log-probs must be equal.

`run` plans the layout pairs and runs both sides; `rollout_worker` is the engine's process
(`python -m onpolicy.parity.rollout_worker`), `trainer_worker` the torchrun job
(`-m onpolicy.parity.trainer_worker`). The comparison itself is `onpolicy.compare`.
"""

from onpolicy.parity.run import (
    Pair,
    ParityRun,
    RolloutLayout,
    WorkerError,
    config_pair,
    make_prompts,
    pair_config,
    pair_overrides,
    parse_pair,
    run_pairs,
)

__all__ = [
    "Pair", "ParityRun", "RolloutLayout", "WorkerError", "config_pair", "make_prompts",
    "pair_config", "pair_overrides", "parse_pair", "run_pairs",
]  # fmt: skip
