"""A seeded random Qwen3-MoE checkpoint in the HF hub layout, small enough for CPU tests.

Nothing can be downloaded from a hub here, so every test builds its model from this writer:
config.json (as the published Qwen3-MoE configs spell it), model.safetensors with per-expert
`mlp.experts.{e}.{gate,up,down}_proj` weights, and an offline byte-level BPE tokenizer that
transformers and SGLang both load. The same config and seed give byte-identical files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from onpolicy.models.hf_layout import hf_tensor_shapes
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig

DONE = ".tiny-checkpoint-complete"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(kw_only=True, slots=True, frozen=True)
class TinyConfig:
    """The shape of a tiny Qwen3-MoE; every field maps to one config.json entry."""

    vocab_size: int = 1000
    """Vocabulary size of the model and of the tokenizer."""
    hidden_size: int = 64
    """Residual stream width."""
    num_hidden_layers: int = 4
    """Decoder layers; every one is an MoE layer."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA groups)."""
    head_dim: int = 16
    """Width of one attention head."""
    num_experts: int = 8
    """Routed experts per layer."""
    num_experts_per_tok: int = 2
    """Top-k experts each token is sent to."""
    moe_intermediate_size: int = 32
    """Hidden width of one expert's SwiGLU."""
    intermediate_size: int = 128
    """Dense MLP width (unused by an all-MoE model, kept for config compatibility)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to one."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 4096
    """Longest sequence the config admits."""
    dtype: str = "bfloat16"
    """Stored weight dtype: bfloat16 (as published checkpoints) or float32."""
    init_std: float = 0.1
    """Std of the normal init of every matrix; large enough that greedy choices are not ties."""

    def hf_config(self) -> dict:
        """config.json contents, spelled as the published Qwen3-MoE checkpoints spell them."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "initializer_range": self.init_std,
            "use_cache": True,
            "bos_token_id": self.vocab_size - len(SPECIAL_TOKENS),
            "eos_token_id": self.vocab_size - 1,
            "torch_dtype": self.dtype,
        }

    def validate(self) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"TinyConfig.dtype must be bfloat16 or float32, got {self.dtype!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TinyConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"TinyConfig: num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"TinyConfig.vocab_size ({self.vocab_size}) must be at least "
                f"{256 + len(SPECIAL_TOKENS)}: the byte-level tokenizer needs 256 bytes + specials"
            )


def random_state_dict(cfg: TinyConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named weights drawn from one seeded generator, in the layout's fixed order."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            # Norm weights, not all ones, so a wrongly mapped norm shows up in the logits.
            return (1.0 + 0.1 * torch.randn(*shape, generator=g)).to(dtype)
        return (torch.randn(*shape, generator=g) * cfg.init_std).to(dtype)

    layout = hf_tensor_shapes(Qwen3MoeConfig.from_hf(cfg.hf_config()))
    return {name: draw(shape) for name, shape in layout.items()}


def _corpus(seed: int) -> list[str]:
    """Deterministic pseudo-English lines to train the BPE merges on."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "ri", "te", "mon", "sa", "vel", "dra", "qu", "is", "an", "or"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    return [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(2000)]


def write_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE (Qwen-style specials) of exactly `vocab_size` tokens, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    n_regular = vocab_size - len(SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=n_regular,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    # A small corpus can run out of merges; filler tokens keep the id space equal to the model's.
    filler = [f"<|reserved_{i}|>" for i in range(n_regular - tok.get_vocab_size())]
    tok.add_special_tokens([*filler, *SPECIAL_TOKENS])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"eos_token_id": vocab_size - 1, "pad_token_id": vocab_size - len(SPECIAL_TOKENS)}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def write_tiny_checkpoint(out_dir: str | os.PathLike, cfg: TinyConfig | None = None,
                          seed: int = 0) -> Path:  # fmt: skip
    """Write the checkpoint to `out_dir` atomically and return it.

    Files are built in a temporary sibling and renamed into place with the completion marker
    written last, so an interrupted write never leaves a folder that looks complete.
    """
    from safetensors.torch import save_file

    cfg = cfg or TinyConfig()
    cfg.validate()
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg.hf_config(), indent=2) + "\n")
        save_file(random_state_dict(cfg, seed), tmp / "model.safetensors", {"format": "pt"})
        write_tokenizer(tmp, cfg.vocab_size, seed)
        (tmp / "onpolicy-tiny.json").write_text(
            json.dumps({"seed": seed, **asdict(cfg)}, indent=2) + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        (out / DONE).write_text("ok\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
