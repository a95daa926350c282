"""Strict, atomic HF checkpoint I/O: every refusal names file, tensor and rule; writes are atomic.

Each refusal test first reads the same, unmodified copy successfully, so the refusal is caused by
the one change the test makes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from onpolicy.bits import assert_bitwise, bitwise_equal
from onpolicy.checkpoint.hf import COMPLETE, is_complete, write_hf_checkpoint
from onpolicy.models.hf_layout import (
    INDEX,
    CheckpointError,
    hf_tensor_shapes,
    read_hf_checkpoint,
)
from onpolicy.models.tiny import tiny, write_tiny_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

SMALL = tiny(num_hidden_layers=2, num_experts=4, vocab_size=300)
EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"
O_PROJ = "model.layers.1.self_attn.o_proj.weight"
REPO = Path(__file__).resolve().parents[2]


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path (hidden files included)."""
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "small", SMALL, seed=3)


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    """A private copy of the small checkpoint, shown to read fine before the test changes it."""
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    ck = read_hf_checkpoint(path)
    assert list(ck.tensors) == list(hf_tensor_shapes(SMALL)) and ck.config == SMALL
    return path


@pytest.fixture
def sharded(pristine, tmp_path) -> Path:
    """The small checkpoint rewritten as 4+ shards with an index, shown to read fine."""
    ck = read_hf_checkpoint(pristine)
    out = write_hf_checkpoint(
        tmp_path / "sharded", ck.config_json, ck.tensors, source=pristine, max_shard_bytes=60_000
    )
    assert len(list(out.glob("model-*.safetensors"))) >= 4
    read_hf_checkpoint(out)
    return out


def refused(path: Path, rule: str, *names: str, dtype: torch.dtype | None = None):
    """Reading `path` raises CheckpointError for `rule`, naming each of `names`."""
    with pytest.raises(CheckpointError) as info:
        read_hf_checkpoint(path, dtype=dtype)
    err, msg = info.value, str(info.value)
    assert err.rule == rule and f"[rule {rule}]" in msg, msg
    for name in names:
        assert name in msg, f"{name!r} not in {msg!r}"
    return err


def rewrite(file: Path, change) -> None:
    """Rewrite one safetensors file with `change(tensors)` applied."""
    sd = load_file(file)
    change(sd)
    save_file(sd, file, {"format": "pt"})


def edit_config(path: Path, **fields: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))


# ---- not a checkpoint, bad config.json -------------------------------------------------------


def test_not_a_checkpoint_says_what_is_missing(ckpt, tmp_path):
    refused(tmp_path / "nowhere", "hf_not_checkpoint", "nowhere", "does not exist")
    refused(ckpt / "config.json", "hf_not_checkpoint", "config.json", "not a directory")
    (ckpt / "config.json").rename(tmp_path / "config.json")
    refused(ckpt, "hf_not_checkpoint", str(ckpt), "no config.json")
    (tmp_path / "config.json").rename(ckpt / "config.json")
    read_hf_checkpoint(ckpt)
    (ckpt / "model.safetensors").rename(tmp_path / "model.safetensors")
    refused(ckpt, "hf_not_checkpoint", str(ckpt), "no *.safetensors")


def test_pickle_weights_are_never_loaded(ckpt, tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint read called a pickle loader")

    torch.save({"x": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr("pickle.load", forbidden)
    monkeypatch.setattr("pickle.loads", forbidden)
    assert len(read_hf_checkpoint(ckpt).tensors) == len(hf_tensor_shapes(SMALL))
    (ckpt / "model.safetensors").unlink()
    refused(ckpt, "hf_not_checkpoint", "no *.safetensors")


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (None, "model_type = 'llama'"),
        ("drop:num_experts", "num_experts"),
    ],
)
def test_bad_config_json_is_refused_naming_the_file(ckpt, text, says):
    file = ckpt / "config.json"
    if text is None:
        edit_config(ckpt, model_type="llama")
    elif text.startswith("drop:"):
        cfg = json.loads(file.read_text())
        del cfg[text[5:]]
        file.write_text(json.dumps(cfg))
    else:
        file.write_text(text)
    refused(ckpt, "hf_config", str(file), says)


def test_a_writers_temporary_folder_is_refused_as_incomplete(ckpt):
    tmp = ckpt.parent / f".ckpt.tmp-{os.getpid()}-abc123"
    shutil.copytree(ckpt, tmp)
    refused(tmp, "hf_incomplete", tmp.name, "unfinished")


# ---- corrupt safetensors ---------------------------------------------------------------------


def header_len(file: Path) -> int:
    return int.from_bytes(file.read_bytes()[:8], "little")


@pytest.mark.parametrize("where", ["length", "header", "data_start", "data_middle", "last_byte"])
def test_truncated_safetensors_is_refused_naming_the_file(ckpt, where):
    file = ckpt / "model.safetensors"
    raw, n = file.read_bytes(), header_len(file)
    cut = {"length": 5, "header": 8 + n // 2, "data_start": 8 + n + 3,
           "data_middle": (8 + n + len(raw)) // 2, "last_byte": len(raw) - 1}[where]  # fmt: skip
    file.write_bytes(raw[:cut])
    says = "past the end" if where != "length" else "shorter than the 8-byte"
    refused(ckpt, "hf_safetensors_corrupt", str(file), says)


@pytest.mark.parametrize(
    "length, says",
    [(2**40, "past the end"), (-1, "after the header"), (-20, "not valid JSON"),
     (+8, "not valid JSON"), (0, "not valid")],
)  # fmt: skip
def test_a_flipped_header_length_is_refused(ckpt, length, says):
    file = ckpt / "model.safetensors"
    raw, n = file.read_bytes(), header_len(file)
    new = length if length in (2**40, 0) else n + length
    # n - 1 drops a padding space: valid JSON, but then the data is one byte longer than listed.
    file.write_bytes(new.to_bytes(8, "little") + raw[8:])
    refused(ckpt, "hf_safetensors_corrupt", str(file), says)


def put_header(file: Path, change) -> None:
    """Rewrite the JSON header of `file` with `change(header)`; the data bytes stay."""
    raw, n = file.read_bytes(), header_len(file)
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def test_header_offsets_past_the_data_or_overlapping_are_refused(ckpt):
    file = ckpt / "model.safetensors"
    good = file.read_bytes()

    def past_eof(h):
        begin, end = h[O_PROJ]["data_offsets"]
        h[O_PROJ]["data_offsets"] = [begin + 10**9, end + 10**9]

    put_header(file, past_eof)
    refused(ckpt, "hf_safetensors_corrupt", str(file), O_PROJ, "past the end")
    file.write_bytes(good)
    read_hf_checkpoint(ckpt)

    def overlap(h):
        h[O_PROJ]["data_offsets"] = list(h[EXPERT]["data_offsets"])
        h[O_PROJ]["shape"] = list(h[EXPERT]["shape"])

    put_header(file, overlap)
    refused(ckpt, "hf_safetensors_corrupt", str(file), "gap or an overlap")
    file.write_bytes(good)

    def bad_dtype(h):
        h[O_PROJ]["dtype"] = "Q4"

    put_header(file, bad_dtype)
    refused(ckpt, "hf_safetensors_corrupt", str(file), O_PROJ, "'Q4'")


def test_the_lenient_read_checks_the_header_too(ckpt):
    assert set(read_hf_checkpoint(ckpt, strict=False).tensors) == set(hf_tensor_shapes(SMALL))
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"past the end.*\[rule hf_safetensors_corrupt\]"):
        read_hf_checkpoint(ckpt, strict=False)


# ---- sharded checkpoints: the index ----------------------------------------------------------


def index_of(path: Path) -> dict:
    return json.loads((path / INDEX).read_text())


def test_index_naming_a_missing_file_is_refused(sharded):
    wm = index_of(sharded)["weight_map"]
    shard = wm[EXPERT]
    (sharded / shard).unlink()
    refused(sharded, "hf_index", INDEX, shard, "missing file")


def test_index_naming_the_wrong_file_is_refused(sharded):
    index = index_of(sharded)
    files = sorted(set(index["weight_map"].values()))
    other = next(f for f in files if f != index["weight_map"][EXPERT])
    index["weight_map"][EXPERT] = other
    (sharded / INDEX).write_text(json.dumps(index))
    refused(sharded, "hf_index", INDEX, EXPERT, other, "lacks it")


def test_a_tensor_in_two_files_is_refused(sharded):
    wm = index_of(sharded)["weight_map"]
    home = wm[EXPERT]
    other = next(f for f in sorted(set(wm.values())) if f != home)
    copy = load_file(sharded / home)[EXPERT]
    rewrite(sharded / other, lambda sd: sd.__setitem__(EXPERT, copy))
    refused(sharded, "hf_index", EXPERT, "also stored in", home, other)


def test_a_shard_the_index_does_not_name_or_no_index_is_refused(sharded):
    shutil.copy(sharded / index_of(sharded)["weight_map"][EXPERT], sharded / "stray.safetensors")
    refused(sharded, "hf_index", "stray.safetensors", "does not name")
    (sharded / "stray.safetensors").unlink()
    read_hf_checkpoint(sharded)
    (sharded / INDEX).write_text("{broken")
    refused(sharded, "hf_index", INDEX, "weight_map")
    (sharded / INDEX).unlink()
    refused(sharded, "hf_index", "no model.safetensors.index.json")


# ---- tensors vs config.json ------------------------------------------------------------------


def test_missing_tensor_is_refused_by_name_and_shape(ckpt):
    rewrite(ckpt / "model.safetensors", lambda sd: sd.pop(EXPERT))
    refused(ckpt, "hf_tensor_missing", EXPERT, "(32, 64)")


def test_unexpected_tensor_is_refused_by_name(ckpt):
    name = "model.layers.0.mlp.shared_expert.gate_proj.weight"
    rewrite(ckpt / "model.safetensors", lambda sd: sd.__setitem__(name, torch.zeros(2, 2)))
    refused(ckpt, "hf_tensor_extra", name, "model.safetensors")


@pytest.mark.parametrize("name", [O_PROJ, "model.layers.1.self_attn.q_norm.weight"])
def test_wrong_shape_is_refused_with_both_shapes(ckpt, name):
    def change(sd):
        t = sd[name]
        sd[name] = torch.zeros(*t.shape[:-1], t.shape[-1] + 2, dtype=t.dtype)

    want = tuple(hf_tensor_shapes(SMALL)[name])
    got = (*want[:-1], want[-1] + 2)
    rewrite(ckpt / "model.safetensors", change)
    # One malformed q_norm is that tensor's fault, not a head_dim mismatch with config.json.
    refused(ckpt, "hf_tensor_shape", name, str(got), str(want))


def test_wrong_dtype_is_refused_with_both_dtypes(ckpt):
    rewrite(ckpt / "model.safetensors", lambda sd: sd.__setitem__(O_PROJ, sd[O_PROJ].float()))
    refused(ckpt, "hf_tensor_dtype", O_PROJ, "torch.float32", "torch_dtype=bfloat16")


def test_the_callers_dtype_is_enforced(ckpt):
    assert read_hf_checkpoint(ckpt, dtype=torch.bfloat16).tensors[O_PROJ].dtype == torch.bfloat16
    refused(ckpt, "hf_tensor_dtype", "torch.bfloat16", "caller wants torch.float32",
            dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("num_experts", 8, "config.json num_experts=8 but the tensors hold 4 experts"),
        ("num_hidden_layers", 3, "config.json num_hidden_layers=3 but the tensors hold 2 layers"),
        ("hidden_size", 128, "config.json hidden_size=128 but the tensors hold 64"),
        ("moe_intermediate_size", 48, "moe_intermediate_size=48 but the tensors hold 32"),
        ("vocab_size", 512, "config.json vocab_size=512 but the tensors hold 300"),
        ("num_key_value_heads", 4, "config.json num_key_value_heads=4 but the tensors hold 2"),
    ],
)  # fmt: skip
def test_config_json_that_disagrees_with_the_tensors_names_the_field(ckpt, field, value, says):
    edit_config(ckpt, **{field: value})
    refused(ckpt, "hf_config_disagrees", str(ckpt / "config.json"), says)


# ---- writing ---------------------------------------------------------------------------------


def test_round_trip_through_shards_is_bit_identical(pristine, tmp_path):
    ck = read_hf_checkpoint(pristine)
    out = write_hf_checkpoint(tmp_path / "out", ck.config_json, ck.tensors, source=pristine,
                              max_shard_bytes=100_000)  # fmt: skip
    back = read_hf_checkpoint(out)
    assert list(back.tensors) == list(ck.tensors) and back.config_json == ck.config_json
    for name, t in ck.tensors.items():
        assert_bitwise(back.tensors[name], t, name)
    shards = sorted(out.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and [f.name for f in shards] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = index_of(out)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ck.tensors.values())
    assert set(index["weight_map"]) == set(ck.tensors)
    for f in shards:
        with safe_open(f, framework="pt") as s:
            assert set(s.keys()) == {k for k, v in index["weight_map"].items() if v == f.name}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (pristine / name).read_bytes(), name
    assert is_complete(out) and not is_complete(pristine)
    assert not (out / "onpolicy-tiny.json").exists()  # describes the seeded draw, not these
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left
    # Control: the comparison sees a single flipped bit.
    flipped = ck.tensors[O_PROJ].clone()
    flipped.view(torch.int16)[0, 0] ^= 1
    assert not bitwise_equal(back.tensors[O_PROJ], flipped)


def test_one_shard_has_no_index(pristine, tmp_path):
    ck = read_hf_checkpoint(pristine)
    out = write_hf_checkpoint(tmp_path / "one", ck.config_json, ck.tensors)
    assert sorted(p.name for p in out.iterdir()) == [COMPLETE, "config.json", "model.safetensors"]
    assert all(bitwise_equal(read_hf_checkpoint(out).tensors[k], t) for k, t in ck.tensors.items())


def test_views_of_one_storage_are_written(pristine, tmp_path):
    """Tensors sliced from one buffer (as a gather produces them) write and read back."""
    ck = read_hf_checkpoint(pristine)
    flat = torch.cat([t.reshape(-1) for t in ck.tensors.values()])
    views, at = {}, 0
    for k, t in ck.tensors.items():
        views[k] = flat[at : at + t.numel()].view(t.shape)
        at += t.numel()
    out = write_hf_checkpoint(tmp_path / "v", ck.config_json, views, max_shard_bytes=100_000)
    back = read_hf_checkpoint(out).tensors
    assert all(bitwise_equal(back[k], t) for k, t in ck.tensors.items())


def test_bad_tensors_never_produce_an_output_folder(pristine, tmp_path):
    ck = read_hf_checkpoint(pristine)
    out = tmp_path / "out"
    cases = {
        "hf_tensor_missing": {k: t for k, t in ck.tensors.items() if k != EXPERT},
        "hf_tensor_shape": {**ck.tensors, O_PROJ: ck.tensors[O_PROJ][:, :-2]},
        "hf_tensor_dtype": {**ck.tensors, O_PROJ: ck.tensors[O_PROJ].float()},
        "hf_tensor_extra": {**ck.tensors, "lm_head.bias": torch.zeros(300)},
    }
    for rule, tensors in cases.items():
        with pytest.raises(CheckpointError) as info:
            write_hf_checkpoint(out, ck.config_json, tensors)
        assert info.value.rule == rule and str(out) in str(info.value), str(info.value)
        assert not tmp_path.joinpath("out").exists() and list(tmp_path.iterdir()) == []
    bad_cfg = {**ck.config_json, "num_experts": 8}
    with pytest.raises(CheckpointError, match="config.json num_experts=8 but the tensors hold 4"):
        write_hf_checkpoint(out, bad_cfg, ck.tensors)
    with pytest.raises(CheckpointError, match="hf_config"):
        write_hf_checkpoint(out, {**ck.config_json, "model_type": "llama"}, ck.tensors)
    assert list(tmp_path.iterdir()) == []
    write_hf_checkpoint(out, ck.config_json, ck.tensors)  # control: the good input writes
    assert is_complete(out)


def test_an_existing_target_is_refused_and_left_byte_identical(pristine, tmp_path):
    ck = read_hf_checkpoint(pristine)
    done = write_hf_checkpoint(tmp_path / "done", ck.config_json, ck.tensors)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine\n")
    afile = tmp_path / "afile"
    afile.write_text("x")
    for target, says in [(done, "complete checkpoint"), (user, "not empty"),
                         (afile, "not a directory")]:  # fmt: skip
        before = digests(target) if target.is_dir() else target.read_bytes()
        with pytest.raises(CheckpointError, match=f"{says}.*rule hf_out_exists"):
            write_hf_checkpoint(target, ck.config_json, ck.tensors, source=pristine)
        assert before == (digests(target) if target.is_dir() else target.read_bytes())
    empty = tmp_path / "empty"
    empty.mkdir()
    assert is_complete(write_hf_checkpoint(empty, ck.config_json, ck.tensors))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "done", "empty", "user"]


KILLED_WRITER = """
import sys, torch
from onpolicy.checkpoint.hf import write_hf_checkpoint
from onpolicy.models.hf_layout import hf_tensor_shapes
from onpolicy.models.tiny import tiny, tiny_hf_config
cfg = tiny(hidden_size=256, num_experts=16, moe_intermediate_size=256, num_hidden_layers=8,
           head_dim=64)
tensors = {k: torch.full(s, 0.5, dtype=torch.bfloat16) for k, s in hf_tensor_shapes(cfg).items()}
write_hf_checkpoint(sys.argv[1], tiny_hf_config(cfg), tensors, max_shard_bytes=2**18)
"""


def test_a_killed_writer_leaves_nothing_complete_and_the_next_write_cleans_up(pristine, tmp_path):
    ck = read_hf_checkpoint(pristine)
    neighbour = write_hf_checkpoint(tmp_path / "neighbour", ck.config_json, ck.tensors)
    before = digests(neighbour)
    # A live writer's temporary (this process) and another target's are not ours to remove.
    live = tmp_path / f".out.tmp-{os.getpid()}-live"
    live.mkdir()
    other = tmp_path / ".neighbour.tmp-999999999-x"
    other.mkdir()
    out = tmp_path / "out"
    path = os.pathsep.join([str(REPO / "integration"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out)], env=env)
    deadline = time.monotonic() + 60
    temp = None
    while time.monotonic() < deadline and proc.poll() is None:
        temps = [p for p in tmp_path.glob(f".out.tmp-{proc.pid}-*")]
        if temps and len(list(temps[0].glob("*.safetensors"))) >= 2:
            temp = temps[0]
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the writer finished before it was killed"
    assert temp is not None and temp.is_dir() and not is_complete(temp)
    assert not out.exists()
    refused(temp, "hf_incomplete", temp.name)
    assert digests(neighbour) == before and is_complete(neighbour)
    # The next writer of `out` removes the dead writer's temporary, and only that.
    fresh = write_hf_checkpoint(out, ck.config_json, ck.tensors, max_shard_bytes=100_000)
    assert is_complete(fresh) and not temp.exists() and live.is_dir() and other.is_dir()
    back = read_hf_checkpoint(fresh).tensors
    assert all(bitwise_equal(back[k], t) for k, t in ck.tensors.items())
    assert digests(neighbour) == before


def test_a_missing_source_is_refused_before_anything_is_written(pristine, tmp_path):
    ck = read_hf_checkpoint(pristine)
    with pytest.raises(CheckpointError, match=r"nowhere.*rule hf_source"):
        write_hf_checkpoint(
            tmp_path / "out", ck.config_json, ck.tensors, source=tmp_path / "nowhere"
        )
    assert list(tmp_path.iterdir()) == []
    link = tmp_path / "link"
    link.symlink_to(pristine, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"a symlink.*rule hf_out_exists"):
        write_hf_checkpoint(link, ck.config_json, ck.tensors)
    write_hf_checkpoint(tmp_path / "out", ck.config_json, ck.tensors, source=link)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        pristine / "tokenizer.json"
    ).read_bytes()


def test_a_source_file_linked_outside_the_source_is_refused(pristine, tmp_path):
    """The source's small files are copied into the output: a link out of the source folder
    (a planted `tokenizer.model -> ~/.ssh/id_rsa`) is refused, not followed. A snapshot of the
    HF hub cache, whose files link to ../../blobs, is copied."""
    ck = read_hf_checkpoint(pristine)
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    src = tmp_path / "src"
    shutil.copytree(pristine, src)
    (src / "tokenizer.model").symlink_to(secret)
    with pytest.raises(CheckpointError, match=r"rule hf_source_link") as e:
        write_hf_checkpoint(tmp_path / "out", ck.config_json, ck.tensors, source=src)
    assert str(src / "tokenizer.model") in str(e.value) and str(secret) in str(e.value)
    assert not (tmp_path / "out").exists()
    # The hub cache's layout: models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/SHA256.
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in pristine.iterdir():
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / sha)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / sha)
    out = write_hf_checkpoint(tmp_path / "out", ck.config_json, ck.tensors, source=snap)
    assert (out / "tokenizer.json").read_bytes() == (pristine / "tokenizer.json").read_bytes()
    assert not (out / "tokenizer.json").is_symlink()


def test_the_error_keeps_its_fields_across_processes(ckpt):
    (ckpt / "config.json").write_text("{")
    err = refused(ckpt, "hf_config", "config.json")
    back = pickle.loads(pickle.dumps(err))
    assert (back.rule, back.file, back.tensor, str(back)) == (err.rule, err.file, None, str(err))
