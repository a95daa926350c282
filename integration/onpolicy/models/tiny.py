"""A seeded random Qwen3-MoE checkpoint in the HF hub layout, small enough for CPU tests.

Nothing can be downloaded from a hub here, so every test builds its model from this writer:
config.json (as the published Qwen3-MoE configs spell it), model.safetensors with per-expert
`mlp.experts.{e}.{gate,up,down}_proj` weights, and an offline byte-level BPE tokenizer that
transformers and SGLang both load, with a Qwen3-style chat template. The same config and seed
give byte-identical files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

import torch

from onpolicy.models.hf_layout import hf_tensor_shapes
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig

DONE = ".tiny-checkpoint-complete"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


TINY_DIMS: dict[str, object] = {
    "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": True, "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}  # fmt: skip
"""The default tiny shape, in `Qwen3MoeConfig`'s (HF config.json's) field names."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
"""The tiny tokenizer's chat template: Qwen3's ChatML turns and generation prompt, including its
`enable_thinking=False` switch (an empty think block after the generation prompt); no tools."""

INIT_STD = 0.1
"""Std of the normal init of every matrix; large enough that greedy choices are not ties."""


def tiny(**dims: object) -> Qwen3MoeConfig:
    """The tiny Qwen3-MoE shape: `TINY_DIMS` with `dims` changed (HF field names).

    Unknown names are refused; the end-of-sequence token is the tokenizer's last id.
    """
    unknown = sorted(set(dims) - {f.name for f in fields(Qwen3MoeConfig)} - {"eos_token_id"})
    if unknown:
        raise ValueError(
            f"tiny model: unknown dims {unknown}; use Qwen3MoeConfig's (HF config.json's) names: "
            f"{', '.join(TINY_DIMS)}"
        )
    merged = {**TINY_DIMS, **dims}
    merged.setdefault("eos_token_id", int(merged["vocab_size"]) - 1)
    return Qwen3MoeConfig(**merged)


TINY = tiny()
"""The default tiny Qwen3-MoE shape."""


def check_tiny(cfg: Qwen3MoeConfig) -> None:
    """What the tiny writer needs beyond a valid shape: a stored dtype, room for the tokenizer."""
    if cfg.torch_dtype not in ("bfloat16", "float32"):
        raise ValueError(
            f"tiny model: torch_dtype must be bfloat16 or float32, got {cfg.torch_dtype!r}"
        )
    if cfg.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"tiny model: vocab_size ({cfg.vocab_size}) must be at least "
            f"{256 + len(SPECIAL_TOKENS)}: the byte-level tokenizer needs 256 bytes + specials"
        )
    if cfg.eos_token_id != cfg.vocab_size - 1 or cfg.tie_word_embeddings:
        raise ValueError(
            f"tiny model: eos_token_id must be the last id {cfg.vocab_size - 1} (got "
            f"{cfg.eos_token_id}) and the LM head untied (got tie={cfg.tie_word_embeddings})"
        )


def tiny_hf_config(cfg: Qwen3MoeConfig, init_std: float = INIT_STD) -> dict:
    """config.json of a tiny checkpoint: the shape's fields plus the keys HF configs also carry."""
    return {
        **cfg.to_hf(),
        "intermediate_size": 4 * cfg.hidden_size,  # the dense MLP width; unused, every layer is MoE
        "max_window_layers": cfg.num_hidden_layers,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "initializer_range": init_std,
        "use_cache": True,
        "bos_token_id": cfg.vocab_size - len(SPECIAL_TOKENS),
    }


def random_state_dict(
    cfg: Qwen3MoeConfig, seed: int, init_std: float = INIT_STD
) -> dict[str, torch.Tensor]:
    """HF-named weights drawn from one seeded generator, in the layout's fixed order."""
    g = torch.Generator().manual_seed(seed)
    dtype = cfg.dtype

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            # Norm weights, not all ones, so a wrongly mapped norm shows up in the logits.
            return (1.0 + 0.1 * torch.randn(*shape, generator=g)).to(dtype)
        return (torch.randn(*shape, generator=g) * init_std).to(dtype)

    return {name: draw(shape) for name, shape in hf_tensor_shapes(cfg).items()}


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
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"eos_token_id": vocab_size - 1, "pad_token_id": vocab_size - len(SPECIAL_TOKENS)}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def write_tiny_checkpoint(out_dir: str | os.PathLike, cfg: Qwen3MoeConfig | None = None,
                          seed: int = 0, init_std: float = INIT_STD) -> Path:  # fmt: skip
    """Write the checkpoint to `out_dir` atomically and return it.

    Files are built in a temporary sibling and renamed into place with the completion marker
    written last, so an interrupted write never leaves a folder that looks complete.
    """
    from safetensors.torch import save_file

    cfg = cfg or TINY
    check_tiny(cfg)
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        config = tiny_hf_config(cfg, init_std)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        weights = random_state_dict(cfg, seed, init_std)
        save_file(weights, tmp / "model.safetensors", {"format": "pt"})
        write_tokenizer(tmp, cfg.vocab_size, seed)
        (tmp / "onpolicy-tiny.json").write_text(
            json.dumps({"seed": seed, "init_std": init_std, **asdict(cfg)}, indent=2) + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        (out / DONE).write_text("ok\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
