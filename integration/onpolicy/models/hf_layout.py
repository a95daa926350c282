"""The HF hub layout of a Qwen3-MoE checkpoint: tensor names and shapes, reading, checking.

One description serves every side that touches HF weights: the tiny-checkpoint writer draws
exactly these tensors, and the reference model, the Megatron loader and the checkpoint writer
(`onpolicy.checkpoint.hf`) read and check them.

`read_hf_checkpoint` is the one reader. Strict (the default), it checks everything before
returning anything: config.json parses as a Qwen3-MoE config, every *.safetensors header is
well formed with its data inside the file, a sharded checkpoint's index agrees with its files,
and the tensors are exactly the ones config.json describes (names, shapes, one dtype). Lenient
(`strict=False`), it returns the tensors of every *.safetensors file, each header checked and a
tensor stored twice refused, and checks nothing else. Only safetensors are read, never a pickle.

Every refusal is a `CheckpointError` naming the file, the tensor (if any) and the rule.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig

INDEX = "model.safetensors.index.json"
"""The weight map of a sharded checkpoint (HF's name)."""
MAX_HEADER = 100 * 2**20
"""The largest safetensors JSON header the format allows."""

_ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint refused: the message names the file, the tensor (if any) and the rule."""

    def __init__(self, rule: str, file: str | os.PathLike, detail: str, tensor: str | None = None):
        self.rule, self.file, self.tensor, self.detail = rule, Path(file), tensor, detail
        what = f"tensor {tensor}: " if tensor else ""
        super().__init__(f"{file}: {what}{detail} [rule {rule}]")

    def __reduce__(self):  # picklable across processes with its fields, not just the message
        return (CheckpointError, (self.rule, str(self.file), self.detail, self.tensor))


@dataclass(frozen=True)
class HFCheckpoint:
    """A read HF checkpoint: fully checked, or (strict=False) its tensors only."""

    path: Path
    """The checkpoint folder."""
    config: Qwen3MoeConfig | None
    """The model shape parsed from config.json (None when read with strict=False)."""
    config_json: dict | None
    """config.json as stored, every key kept (None when read with strict=False)."""
    tensors: dict[str, torch.Tensor]
    """Every tensor: strict, in `hf_tensor_shapes` order, all of the checked dtype; else in
    file order, unchecked against any config."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as a safetensors header describes it."""

    dtype: torch.dtype
    """Stored dtype."""
    shape: tuple[int, ...]
    """Stored shape."""
    file: Path
    """The file holding it."""


def _is_temp_name(name: str) -> bool:
    """A writer's temporary folder (`onpolicy.checkpoint.hf`: `.NAME.tmp-PID-RANDOM`)."""
    return re.fullmatch(r"\..+\.tmp-\d+-[A-Za-z0-9_]+", name) is not None


# ---- names and shapes ------------------------------------------------------------------------


def hf_tensor_shapes(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape, in a fixed order (the writer's draw order).

    The LM head is absent when the config ties it to the embedding.
    """
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    i, v = cfg.moe_intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate.weight": (e, h),
        }
        for x in range(e):
            shapes |= {
                f"{p}.mlp.experts.{x}.gate_proj.weight": (i, h),
                f"{p}.mlp.experts.{x}.up_proj.weight": (i, h),
                f"{p}.mlp.experts.{x}.down_proj.weight": (h, i),
            }
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def check_hf_weights(cfg: Qwen3MoeConfig, sd: dict[str, torch.Tensor]) -> None:
    """Refuse weights that do not match the config, naming the tensors, before any use."""
    want = hf_tensor_shapes(cfg)
    missing = [k for k in want if k not in sd]
    wrong = [f"{k} {tuple(sd[k].shape)} (config wants {s})"
             for k, s in want.items() if k in sd and tuple(sd[k].shape) != s]  # fmt: skip
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing, e.g. {', '.join(missing[:3])}")
        if wrong:
            parts.append(f"{len(wrong)} with the wrong shape, e.g. {'; '.join(wrong[:3])}")
        raise ValueError(
            "HF checkpoint does not match its config.json (a Qwen3-MoE with "
            f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts, hidden "
            f"{cfg.hidden_size}): tensors {' and '.join(parts)}"
        )


# ---- reading ---------------------------------------------------------------------------------


def _read_header(file: Path) -> dict[str, TensorSpec]:
    """Parse and check one safetensors header: length, JSON, dtypes, shapes, data offsets."""

    def bad(detail: str, tensor: str | None = None) -> CheckpointError:
        return CheckpointError("hf_safetensors_corrupt", file, detail, tensor)

    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"file of {size} bytes is shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > MAX_HEADER:
            raise bad(f"header length {n} runs past the end of the file ({size} bytes)")
        raw = f.read(n)

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise bad(f"header names a key twice: {sorted(k for k in keys if keys.count(k) > 1)}")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ must map strings to strings")
    data_len = size - 8 - n
    specs: dict[str, TensorSpec] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"entry {entry!r} is not {{dtype, shape, data_offsets}}", name)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _ST_DTYPES:
            raise bad(f"unknown dtype {dtype!r}", name)
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise bad(f"shape {shape!r} is not a list of non-negative integers", name)
        ints = isinstance(offsets, list) and all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets
        )
        if not ints or len(offsets) != 2:
            raise bad(f"data_offsets {offsets!r} is not [begin, end]", name)
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        want = numel * _ST_DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != want:
            raise bad(f"data_offsets {offsets} do not hold {want} bytes of {dtype} {shape}", name)
        if end > data_len:
            raise bad(
                f"data_offsets {offsets} run past the end of the file (data holds {data_len} "
                f"bytes; the file is {size} bytes, truncated?)",
                name,
            )
        specs[name] = TensorSpec(_ST_DTYPES[dtype], tuple(shape), file)
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise bad(f"data_offsets start at {begin}, expected {at} (a gap or an overlap)", name)
        at = end
    if at != data_len:
        raise bad(f"tensors hold {at} bytes of data but the file holds {data_len} after the header")
    return specs


def _shard_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read and, for a sharded checkpoint, the index's weight map."""
    files = sorted(path.glob("*.safetensors"))
    index = path / INDEX
    if not index.is_file():
        if not files:
            raise CheckpointError(
                "hf_not_checkpoint", path, "not an HF checkpoint: no *.safetensors file"
            )
        if len(files) > 1:
            raise CheckpointError(
                "hf_index", path, f"{len(files)} *.safetensors files but no {INDEX} to map them"
            )
        return files, None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            "hf_index", index, f"not a JSON object with a weight_map: {e!r}"
        ) from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError("hf_index", index, "weight_map must map tensor names to file names")
    named = sorted(set(weight_map.values()))
    for name in named:
        if Path(name).name != name or not (path / name).is_file():
            tensor = next(k for k, v in weight_map.items() if v == name)
            raise CheckpointError("hf_index", index, f"names a missing file {name!r}", tensor)
    unnamed = [f.name for f in files if f.name not in named]
    if unnamed:
        raise CheckpointError(
            "hf_index", index, f"does not name the safetensors file(s) {unnamed} beside it"
        )
    return [path / name for name in named], weight_map


def _gather_specs(path: Path, files: list[Path], weight_map: dict[str, str] | None):
    specs: dict[str, TensorSpec] = {}
    for file in files:
        for name, spec in _read_header(file).items():
            if name in specs:
                raise CheckpointError(
                    "hf_index", file, f"is also stored in {specs[name].file.name}", name
                )
            specs[name] = spec
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in specs or specs[name].file.name != file:
                raise CheckpointError(
                    "hf_index", path / INDEX, f"names file {file} but that file lacks it", name
                )
        for name, spec in specs.items():
            if name not in weight_map:
                raise CheckpointError("hf_index", spec.file, f"is not named by {INDEX}", name)
    return specs


def hf_config_of(config_json: object, file: Path) -> tuple[Qwen3MoeConfig, torch.dtype]:
    if not isinstance(config_json, dict):
        raise CheckpointError("hf_config", file, "config.json must hold a JSON object")
    try:
        cfg = Qwen3MoeConfig.from_hf(config_json)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError("hf_config", file, f"not a supported qwen3_moe config: {e}") from None
    dtype = getattr(torch, cfg.torch_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError("hf_config", file, f"torch_dtype {cfg.torch_dtype!r} is not a dtype")
    return cfg, dtype


def read_hf_checkpoint(
    path: str | os.PathLike, *, strict: bool = True, dtype: torch.dtype | None = None
) -> HFCheckpoint:
    """Read an HF checkpoint folder; strict (the default), check all of it and refuse it whole.

    strict: config.json, the headers, the index and the tensors against config.json are checked
    before any data is read, and any fault raises a `CheckpointError`. `dtype` is the dtype every
    tensor must have; by default config.json's torch_dtype. Folders without the completion
    marker (hub downloads) are read; a writer's temporary is not.

    strict=False: the tensors of every *.safetensors file in the folder, in file order. Each
    file's header is checked before its data is read and a tensor stored in two files is refused
    (`CheckpointError`), nothing else: `config` and `config_json` are None. A folder without
    *.safetensors raises FileNotFoundError. `dtype` is not checked, so it may not be given.
    """
    if not strict:
        if dtype is not None:
            raise TypeError("read_hf_checkpoint: dtype is checked only with strict=True")
        return HFCheckpoint(Path(path), None, None, _read_lenient(path))
    path = Path(path)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise CheckpointError("hf_not_checkpoint", path, f"not an HF checkpoint: the path {what}")
    if _is_temp_name(path.name):
        raise CheckpointError(
            "hf_incomplete", path, "is the temporary folder of an unfinished or killed writer"
        )
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError("hf_not_checkpoint", path, "not an HF checkpoint: no config.json")
    try:
        config_json = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError("hf_config", file, f"config.json is not valid JSON: {e}") from None
    cfg, cfg_dtype = hf_config_of(config_json, file)
    files, weight_map = _shard_files(path)
    specs = _gather_specs(path, files, weight_map)
    check_specs(cfg, specs, dtype or cfg_dtype, dtype is None, path)
    tensors = _load(specs)
    order = hf_tensor_shapes(cfg)
    return HFCheckpoint(path, cfg, config_json, {k: tensors[k] for k in order})


def _read_lenient(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every *.safetensors file's tensors, each header checked first; a tensor twice refused."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd: dict[str, torch.Tensor] = {}
    seen: dict[str, Path] = {}
    for f in files:
        for name, t in read_safetensors(f).items():
            if name in seen:
                raise CheckpointError("hf_index", f, f"is also stored in {seen[name].name}", name)
            seen[name] = f
            sd[name] = t
    return sd


def read_safetensors(file: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, its header and data offsets checked first."""
    file = Path(file)
    return _load(_read_header(file))


def _load(specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, spec in specs.items():
        by_file.setdefault(spec.file, []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                for name in names:
                    out[name] = f.get_tensor(name)
        except Exception as e:  # the library's own errors, as a refusal naming the file
            raise CheckpointError("hf_safetensors_corrupt", file, f"unreadable: {e}") from None
        for name in names:
            t, s = out[name], specs[name]
            if t.dtype != s.dtype or tuple(t.shape) != s.shape:
                raise CheckpointError(
                    "hf_safetensors_corrupt", file,
                    f"read as {t.dtype} {tuple(t.shape)}, header says {s.dtype} {s.shape}", name,
                )  # fmt: skip
    return out


# ---- checking against config.json ------------------------------------------------------------


def _disagreements(cfg: Qwen3MoeConfig, specs: dict[str, TensorSpec]) -> list[tuple[str, str]]:
    """config.json fields the tensors contradict, as (evidence tensor, message).

    A field is blamed only when every tensor that shows it agrees on one other value, so a
    single malformed tensor is reported as itself, not as a config mismatch.
    """
    found: list[tuple[str, str]] = []

    def held(pattern: str, dim: int) -> tuple[int | None, str]:
        """The one size of `dim` over the tensors matching `pattern`, and one such tensor."""
        names = [k for k in specs if re.fullmatch(pattern, k)]
        sizes = {specs[k].shape[dim] if len(specs[k].shape) > dim else -1 for k in names}
        return (sizes.pop() if len(sizes) == 1 else None), (names[0] if names else pattern)

    def differ(field: str, value: int | None, what: str, tensor: str) -> None:
        want = getattr(cfg, field)
        if value is not None and value > 0 and value != want:
            found.append(
                (tensor, f"config.json {field}={want} but the tensors hold {value} {what}")
            )

    layer = r"model\.layers\.(\d+)\..*"
    layers = {int(m[1]) for k in specs if (m := re.fullmatch(layer, k))}
    if layers and layers == set(range(max(layers) + 1)):
        differ("num_hidden_layers", len(layers), "layers", "model.layers.{N}.*")
    per_layer: dict[int, set[int]] = {}
    for k in specs:
        if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\..*", k):
            per_layer.setdefault(int(m[1]), set()).add(int(m[2]))
    counts = {len(e) if e == set(range(max(e) + 1)) else -1 for e in per_layer.values()}
    if len(counts) == 1:
        differ("num_experts", counts.pop(), "experts", "model.layers.{N}.mlp.experts.{E}.*")
    vocab, vocab_t = held(r"model\.embed_tokens\.weight|lm_head\.weight", 0)
    differ("vocab_size", vocab, "vocabulary rows", vocab_t)
    norms = r"model\.norm\.weight|model\.layers\.\d+\.(input|post_attention)_layernorm\.weight"
    hidden, hidden_t = held(norms, 0)
    differ("hidden_size", hidden, "elements in every norm (hidden size)", hidden_t)
    width, width_t = held(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up)_proj\.weight", 0)
    differ("moe_intermediate_size", width, "rows in every expert gate/up", width_t)
    head_dim, qk = held(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", 0)
    differ("head_dim", head_dim, "elements in every q/k norm (head dim)", qk)
    if head_dim:
        q_rows, q = held(r"model\.layers\.\d+\.self_attn\.q_proj\.weight", 0)
        k_rows, k = held(r"model\.layers\.\d+\.self_attn\.[kv]_proj\.weight", 0)
        if q_rows and q_rows % head_dim == 0:
            differ("num_attention_heads", q_rows // head_dim, "query heads", q)
        if k_rows and k_rows % head_dim == 0:
            differ("num_key_value_heads", k_rows // head_dim, "key/value heads", k)
    if cfg.tie_word_embeddings and "lm_head.weight" in specs:
        found.append(("lm_head.weight", "config.json tie_word_embeddings=True but the tensors "
                      "hold a separate lm_head.weight"))  # fmt: skip
    return found


def check_specs(
    cfg: Qwen3MoeConfig,
    specs: dict[str, TensorSpec],
    dtype: torch.dtype,
    from_config: bool,
    path: Path,
) -> None:
    """Refuse tensors that are not exactly the ones config.json describes, at `dtype`."""
    want = hf_tensor_shapes(cfg)
    missing = [k for k in want if k not in specs]
    extra = sorted(k for k in specs if k not in want)
    wrong = [k for k, s in want.items() if k in specs and specs[k].shape != s]
    if missing or extra or wrong:
        found = _disagreements(cfg, specs)
        if found:
            tensor, _ = found[0]
            detail = "; ".join(msg for _, msg in found)
            raise CheckpointError(
                "hf_config_disagrees", path / "config.json",
                f"config.json disagrees with the tensors: {detail}", tensor,
            )  # fmt: skip
    more = lambda names: f" (and {len(names) - 1} more)" if len(names) > 1 else ""  # noqa: E731
    if missing:
        raise CheckpointError(
            "hf_tensor_missing", path,
            f"missing; config.json wants it with shape {want[missing[0]]}{more(missing)}",
            missing[0],
        )  # fmt: skip
    if extra:
        raise CheckpointError(
            "hf_tensor_extra", specs[extra[0]].file,
            f"unexpected: a Qwen3-MoE of this config.json has no such tensor{more(extra)}",
            extra[0],
        )  # fmt: skip
    if wrong:
        k = wrong[0]
        raise CheckpointError(
            "hf_tensor_shape", specs[k].file,
            f"has shape {specs[k].shape} but config.json wants {want[k]}{more(wrong)}", k,
        )  # fmt: skip
    bad = [k for k in want if specs[k].dtype != dtype]
    if bad:
        k = bad[0]
        whose = f"config.json torch_dtype={cfg.torch_dtype}" if from_config else "the caller"
        raise CheckpointError(
            "hf_tensor_dtype", specs[k].file,
            f"has dtype {specs[k].dtype} but {whose} wants {dtype}{more(bad)}", k,
        )  # fmt: skip
