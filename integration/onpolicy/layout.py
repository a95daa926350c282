"""The trainer's parallel layout: every degree, derived once, and where each rank sits in it.

One `ParallelLayout` is read from a run config's [training] table; the contract's rules, the
plan, the Megatron builder and the HF -> Megatron loader all ask it rather than re-deriving
ranks (as torchtitan's ParallelDims does). Rank order is megatron-core's default
"tp-cp-ep-dp-pp", TP fastest: the dense grid is (tp, cp, dp, pp) and the expert grid over the
same ranks is (etp, ep, edp, pp).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """Megatron's parallel degrees. DP is what is left of the world after TP, PP and CP."""

    world: int
    """Total trainer ranks."""
    tp: int = 1
    """Tensor parallel size (attention, dense layers, the embedding and the LM head)."""
    pp: int = 1
    """Pipeline parallel stages (contiguous, equal layer ranges)."""
    ep: int = 1
    """Expert parallel size (contiguous, equal expert ranges)."""
    etp: int = 1
    """Expert tensor parallel size (each expert's FFN width split)."""
    sp: bool = False
    """Sequence parallel (activations outside attention and the MLP sharded over TP)."""
    cp: int = 1
    """Context parallel size; the contract pins it to 1."""
    dp: int = 0
    """Data parallel size; 0 derives it as world / (tp x pp x cp)."""

    def __post_init__(self) -> None:
        tpc = self.tp * self.pp * self.cp
        if self.dp == 0 and tpc > 0 and self.world % tpc == 0:
            object.__setattr__(self, "dp", self.world // tpc)

    @property
    def edp(self) -> int:
        """Expert data parallel size: a stage's TP x CP x DP ranks over ETP x EP."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    def degrees(self) -> dict[str, int | bool]:
        """tp, pp, ep, etp, sp, dp and edp, in that order (for plans and logs)."""
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp, "sp": self.sp,
                "dp": self.dp, "edp": self.edp}  # fmt: skip

    # --- where global rank g sits --------------------------------------------------------------
    def _check(self, g: int) -> None:
        if not 0 <= g < self.world:
            raise ValueError(f"rank {g} is outside the training world of {self.world} ranks")

    def tp_rank(self, g: int) -> int:
        self._check(g)
        return g % self.tp

    def dp_rank(self, g: int) -> int:
        self._check(g)
        return (g // (self.tp * self.cp)) % self.dp

    def pp_rank(self, g: int) -> int:
        self._check(g)
        return g // (self.tp * self.cp * self.dp)

    def etp_rank(self, g: int) -> int:
        self._check(g)
        return g % self.etp

    def ep_rank(self, g: int) -> int:
        self._check(g)
        return (g // self.etp) % self.ep

    def edp_rank(self, g: int) -> int:
        self._check(g)
        return (g // (self.etp * self.ep)) % self.edp

    def layers(self, g: int, num_layers: int) -> range:
        """Global decoder layers of rank g's pipeline stage."""
        if num_layers % self.pp:
            raise ValueError(f"{num_layers} layers do not split into PP = {self.pp} equal stages")
        per = num_layers // self.pp
        return range(self.pp_rank(g) * per, (self.pp_rank(g) + 1) * per)

    def experts(self, g: int, num_experts: int) -> range:
        """Global expert ids rank g holds."""
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts do not split over EP = {self.ep}")
        per = num_experts // self.ep
        return range(self.ep_rank(g) * per, (self.ep_rank(g) + 1) * per)

    def coords(self, g: int) -> dict[str, int]:
        """Every coordinate of rank g, by name."""
        names = ("tp", "dp", "pp", "etp", "ep", "edp")
        return {n: getattr(self, f"{n}_rank")(g) for n in names}

    # --- megatron-core ---------------------------------------------------------------------------
    @classmethod
    def from_parallel_state(cls, sp: bool) -> ParallelLayout:
        """The layout megatron-core's parallel_state was initialised with (SP lives elsewhere)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        return cls(
            world=dist.get_world_size(),
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            sp=sp,
        )

    def check_parallel_state(self) -> None:
        """Raise unless megatron-core placed this process where the layout says it sits."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        g = dist.get_rank()
        theirs = {
            "tp": ps.get_tensor_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank(),
        }  # fmt: skip
        ours = self.coords(g)
        if theirs != ours or ParallelLayout.from_parallel_state(self.sp) != self:
            raise RuntimeError(
                f"rank {g}: megatron-core's parallel_state {theirs} disagrees with the layout "
                f"{self.degrees()} ({ours}); initialise it from this layout "
                "(order tp-cp-ep-dp-pp)"
            )
