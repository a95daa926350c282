"""The trainer's parallel layout: every degree, derived once, and where each rank sits in it.

One `ParallelLayout` is read from a run config's [training] table; the contract's rules, the
plan, the Megatron builder and the HF -> Megatron loader all ask it rather than re-deriving
ranks (as torchtitan's ParallelDims does). Rank order is megatron-core's default
"tp-cp-ep-dp-pp", TP fastest: the dense grid is (tp, cp, dp, pp) and the expert grid over the
same ranks is (etp, ep, edp, pp).

A layout names itself (`name`, e.g. `world8-tp2-pp2-ep2-sp`) and reads such a name back
(`parse`); on a command line it is `--world --tp --pp --ep --etp --cp --sp`
(`add_arguments`, `from_args`).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

_NAMED = ("tp", "pp", "ep", "etp", "cp")
"""The degrees a name spells, in order (after the world; sp last)."""
_TOKEN = re.compile(r"^(world|tp|pp|ep|etp|cp)(\d+)$|^(sp)$")


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

    # --- names ----------------------------------------------------------------------------------
    def name(self, *, full: bool = False) -> str:
        """`world8-tp2-pp2-ep2-sp`: the world, then tp, pp, ep, etp and cp where above 1, then
        `sp` when on. `full` spells tp, pp, ep and etp at 1 as well
        (`world8-tp2-pp2-ep2-etp1-sp`, `world1-tp1-pp1-ep1-etp1`: how the checkpoint messages
        show two layouts side by side); cp only ever shows above 1 (the contract pins it to 1).
        DP is derived, not named. `parse` reads either form back."""
        parts = [f"world{self.world}"]
        parts += [f"{k}{getattr(self, k)}" for k in _NAMED
                  if getattr(self, k) > 1 or (full and k != "cp")]  # fmt: skip
        return "-".join(parts + (["sp"] if self.sp else []))

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """The layout a `name` spells: `-`-joined tokens world<N>, tp<N>, pp<N>, ep<N>,
        etp<N>, cp<N> and sp, each at most once, in any order. An unnamed degree is 1 (sp off);
        an unnamed world is tp x pp x cp. A bad token raises ValueError naming it."""
        found: dict[str, int] = {}
        for tok in text.split("-"):
            m = _TOKEN.match(tok)
            key = (m.group(1) or m.group(3)) if m else None
            if key is None or key in found:
                raise ValueError(
                    f"layout {text!r}: token {tok!r} is {'repeated' if key else 'unknown'}; "
                    "a layout is world<N>, tp<N>, pp<N>, ep<N>, etp<N>, cp<N> and sp, each at "
                    "most once, joined by '-' (e.g. world8-tp2-pp2-ep2-sp)"
                )
            found[key] = int(m.group(2)) if m.group(2) else 1
        sp = bool(found.pop("sp", 0))
        world = found.pop("world", found.get("tp", 1) * found.get("pp", 1) * found.get("cp", 1))
        return cls(world=world, sp=sp, **found)

    # --- command lines ---------------------------------------------------------------------------
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """`--world --tp --pp --ep --etp --cp --sp` on `parser`; `from_args` reads them back."""
        g = parser.add_argument_group("trainer layout")
        g.add_argument("--world", type=int, default=None, help="trainer ranks (default: "
                       "torchrun's WORLD_SIZE, else tp x pp x cp)")  # fmt: skip
        for k, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert"),
                        ("etp", "expert tensor"), ("cp", "context")):  # fmt: skip
            g.add_argument(f"--{k}", type=int, default=1, help=f"{what} parallel size (default 1)")
        g.add_argument("--sp", action="store_true", help="sequence parallel")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelLayout:
        """The layout `add_arguments`' options name. Without --world: torchrun's WORLD_SIZE
        where it is set (a worker it started), else tp x pp x cp."""
        world = args.world
        if world is None:
            world = int(os.environ.get("WORLD_SIZE", "0")) or args.tp * args.pp * args.cp
        return cls(world=world, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=args.cp,
                   sp=args.sp)  # fmt: skip

    def cli_args(self) -> list[str]:
        """The options `add_arguments` reads, naming this layout (for a worker's command line)."""
        args = [f"--{k}={getattr(self, k)}" for k in ("world", "tp", "pp", "ep", "etp", "cp")]
        return args + (["--sp"] if self.sp else [])

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
