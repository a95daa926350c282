"""`onpolicy convert` and onpolicy.checkpoint.torch_dist refuse bad input before any launch.

Each case is checked without torchrun: the refusal must name its rule and the values, and the
CLI must exit 2 with it on stderr. The checkpoints here are folders laid out as `save` writes
them (manifest, megatron-core's marker, torch's index and shard of one small tensor, not the
model's); tests/engines/test_checkpoint_dist.py runs the real saves and loads.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from onpolicy.checkpoint import torch_dist
from onpolicy.checkpoint.convert import main
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import CheckpointError
from onpolicy.models.tiny import TINY, tiny_hf_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny-cpu.toml")
SAVED = ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)
MARKER = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
"""megatron-core's metadata.json of a torch_dist checkpoint."""


def make_checkpoint(root: Path, *, iteration: int = 1, layout: ParallelLayout = SAVED,
                    optimizer: dict | None = None, dtype: str = "bfloat16",
                    files: tuple[str, ...] = ("metadata.json", ".metadata")) -> Path:  # fmt: skip
    """A root with iteration `iteration` as `torch_dist.save` lays it out: the manifest,
    megatron-core's marker and torch's index (of one small tensor, not the model's)."""
    import torch.distributed.checkpoint as dcp

    it_dir = torch_dist.iteration_dir(root, iteration)
    it_dir.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: torch saves as a single process
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(it_dir))
    (it_dir / "metadata.json").write_text(json.dumps(MARKER))
    for name in {"metadata.json", ".metadata"} - set(files):
        (it_dir / name).unlink()
    config = tiny_hf_config(TINY)
    manifest = {
        "format_version": torch_dist.FORMAT_VERSION, "iteration": iteration,
        "model_config": config, "config_sha256": torch_dist.config_sha256(config),
        "dtype": dtype, "layout": torch_dist.layout_dict(layout),
        "has_optimizer": optimizer is not None, "optimizer": optimizer, "source_hf": None,
        "files": torch_dist.file_hashes(it_dir),
    }  # fmt: skip
    (it_dir / torch_dist.MANIFEST).write_text(json.dumps(manifest))
    (root / torch_dist.TRACKER).write_text(f"{iteration}\n")
    return root


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def world1_sets() -> list[str]:
    return ["--set", "training.world=1", "--set", "training.tp=1", "--set", "training.pp=1",
            "--set", "training.ep=1", "--set", "training.sp=false"]  # fmt: skip


def test_help_documents_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("hf-to-dist", "dist-to-hf", "reshard"))
    options = {"hf-to-dist": ("--hf", "--config", "--set", "--out", "--iteration"),
               "dist-to-hf": ("--ckpt", "--out"),
               "reshard": ("--ckpt", "--config", "--set", "--out", "--model-only")}  # fmt: skip
    for cmd, opts in options.items():
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert all(o in out for o in opts), (cmd, out)


def test_not_a_checkpoint(tmp_path, capsys):
    code, err = run(capsys, "dist-to-hf", "--ckpt", str(tmp_path / "nowhere"), "--out",
                    str(tmp_path / "hf"))  # fmt: skip
    assert code == 2 and "not_a_checkpoint" in err and "does not exist" in err, err
    (tmp_path / "empty").mkdir()
    code, err = run(capsys, "dist-to-hf", "--ckpt", str(tmp_path / "empty"), "--out",
                    str(tmp_path / "hf"))  # fmt: skip
    assert code == 2 and "not_a_checkpoint" in err and "latest" in err, err
    assert not (tmp_path / "hf").exists()


def test_a_tmp_folder_is_refused(tmp_path, capsys):
    tmp = tmp_path / "root" / ".iter_0000002.tmp"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"x")
    code, err = run(capsys, "dist-to-hf", "--ckpt", str(tmp), "--out", str(tmp_path / "hf"))
    assert code == 2 and "not_a_checkpoint" in err and "unfinished save" in err, err


def test_missing_metadata_json_is_refused(tmp_path, capsys):
    root = make_checkpoint(tmp_path / "root", files=(".metadata",))
    code, err = run(capsys, "dist-to-hf", "--ckpt", str(root), "--out", str(tmp_path / "hf"))
    assert code == 2 and "not_a_checkpoint" in err and "metadata.json" in err, err


def test_tracker_naming_a_missing_iteration_is_refused(tmp_path):
    root = make_checkpoint(tmp_path / "root")
    (root / torch_dist.TRACKER).write_text("7\n")
    with pytest.raises(CheckpointError, match="names iteration 7") as e:
        torch_dist.read_manifest(root)
    assert e.value.rule == "not_a_checkpoint"


def test_edited_manifest_config_is_refused(tmp_path):
    root = make_checkpoint(tmp_path / "root")
    it_dir = torch_dist.iteration_dir(root, 1)
    manifest = json.loads((it_dir / torch_dist.MANIFEST).read_text())
    manifest["model_config"]["num_experts"] = 16
    (it_dir / torch_dist.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="config_sha256") as e:
        torch_dist.read_manifest(root)
    assert e.value.rule == "manifest"


def test_model_config_differing_from_the_run_names_the_field(tmp_path, capsys):
    root = make_checkpoint(tmp_path / "root")
    code, err = run(capsys, "reshard", "--ckpt", str(root), "--config", CONFIG, "--set",
                    "model.tiny.num_experts=16", "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "model_config" in err, err
    assert "num_experts = 8" in err and "num_experts = 16" in err, err
    assert not (tmp_path / "out").exists()


def test_dtype_mismatch_is_refused(tmp_path, capsys):
    root = make_checkpoint(tmp_path / "root")
    code, err = run(capsys, "reshard", "--ckpt", str(root), "--config", CONFIG, "--set",
                    "model.dtype=float32", "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "[rule dtype]" in err and "bfloat16" in err and "float32" in err, err


def test_layout_that_does_not_divide_the_model_is_refused(tmp_path, capsys):
    root = make_checkpoint(tmp_path / "root")
    sets = ["--set", "training.world=3", "--set", "training.pp=3", "--set", "training.tp=1",
            "--set", "training.ep=1", "--set", "training.sp=false"]  # fmt: skip
    code, err = run(capsys, "reshard", "--ckpt", str(root), "--config", CONFIG, *sets, "--out",
                    str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "layout_divides_model" in err, err
    assert "num_hidden_layers = 4" in err and "pp = 3" in err, err
    with pytest.raises(CheckpointError, match="num_experts = 8 does not divide over ep = 3"):
        torch_dist.check_layout(TINY, ParallelLayout(world=3, ep=3))


def test_optimizer_across_ep1_and_ep2_is_refused(tmp_path, capsys):
    opt = {"sharding_type": torch_dist.SHARDING, "sub_optimizers": 2, "distributed": True}
    root = make_checkpoint(tmp_path / "root", optimizer=opt)
    code, err = run(capsys, "reshard", "--ckpt", str(root), "--config", CONFIG, *world1_sets(),
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "optimizer_layout" in err, err
    assert "world8-tp2-pp2-ep2-etp1-sp" in err and "world1-tp1-pp1-ep1-etp1" in err, err
    assert "--model-only" in err and "load the model only" in err, err


def test_optimizer_requested_but_not_saved_and_not_reshardable(tmp_path):
    it_dir, manifest = torch_dist.read_manifest(make_checkpoint(tmp_path / "a"))
    run_opt = {"sub_optimizers": 2, "distributed": True}
    with pytest.raises(CheckpointError, match="holds the model only") as e:
        torch_dist.check_compatible(it_dir, manifest, TINY, SAVED, torch.bfloat16,
                                    optimizer=run_opt)  # fmt: skip
    assert e.value.rule == "optimizer_saved"
    opt = {"sharding_type": "dp_reshardable", "sub_optimizers": 2, "distributed": True}
    it_dir, manifest = torch_dist.read_manifest(make_checkpoint(tmp_path / "b", optimizer=opt))
    torch_dist.check_compatible(it_dir, manifest, TINY, SAVED, torch.bfloat16, optimizer=run_opt)
    other = ParallelLayout(world=8, pp=2, ep=4)
    with pytest.raises(CheckpointError, match="dp_reshardable") as e:
        torch_dist.check_compatible(it_dir, manifest, TINY, other, torch.bfloat16,
                                    optimizer=run_opt)  # fmt: skip
    assert e.value.rule == "optimizer_reshardable"


def test_existing_iteration_is_refused(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(tiny_hf_config(TINY)))
    root = make_checkpoint(tmp_path / "root", iteration=0)
    before = sorted(p.name for p in torch_dist.iteration_dir(root, 0).iterdir())
    code, err = run(capsys, "hf-to-dist", "--hf", str(hf), "--config", CONFIG, "--out",
                    str(root))  # fmt: skip
    assert code == 2 and "iteration_exists" in err and "iter_0000000" in err, err
    assert sorted(p.name for p in torch_dist.iteration_dir(root, 0).iterdir()) == before


def test_hf_model_differing_from_the_run_is_refused(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(tiny_hf_config(TINY)))
    code, err = run(capsys, "hf-to-dist", "--hf", str(hf), "--config", CONFIG, "--set",
                    "model.tiny.hidden_size=128", "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "model_config" in err and "hidden_size = 64" in err, err
    code, err = run(capsys, "hf-to-dist", "--hf", str(tmp_path / "none"), "--config", CONFIG,
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "hf_not_checkpoint" in err, err
    code, err = run(capsys, "hf-to-dist", "--hf", str(hf), "--config", str(tmp_path / "x.toml"),
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "config_file" in err, err
    assert not (tmp_path / "out").exists()


class _Payload:
    """Unpickling this creates `marker`: what a planted `.metadata` would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rehash(it_dir: Path) -> None:
    """Record the folder's current files in its manifest, as a forger would."""
    manifest = json.loads((it_dir / torch_dist.MANIFEST).read_text())
    manifest["files"] = torch_dist.file_hashes(it_dir)
    (it_dir / torch_dist.MANIFEST).write_text(json.dumps(manifest))


def test_a_planted_metadata_pickle_is_refused_and_runs_nothing(tmp_path, capsys):
    import pickle

    root = make_checkpoint(tmp_path / "root")
    it_dir = torch_dist.iteration_dir(root, 1)
    marker = tmp_path / "ran"
    (it_dir / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    _rehash(it_dir)  # the manifest forged too: the hashes alone cannot stop it
    with pytest.raises(CheckpointError, match="io.open is not a class of torch's") as e:
        torch_dist.verify(*torch_dist.read_manifest(root))
    assert e.value.rule == "checkpoint_index" and not marker.exists()
    with pytest.raises(CheckpointError):
        torch_dist.global_tensors(root)
    code, err = run(capsys, "dist-to-hf", "--ckpt", str(root), "--out", str(tmp_path / "hf"))
    assert code == 2 and "checkpoint_index" in err and not marker.exists(), err


def test_a_forged_marker_is_refused_with_the_rule(tmp_path):
    root = make_checkpoint(tmp_path / "root")
    it_dir = torch_dist.iteration_dir(root, 1)
    (it_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    _rehash(it_dir)
    with pytest.raises(CheckpointError, match="names backend 'zarr', not torch_dist") as e:
        torch_dist.verify(*torch_dist.read_manifest(root))
    assert e.value.rule == "checkpoint_index"


def test_a_changed_or_added_file_is_refused_by_its_hash(tmp_path):
    root = make_checkpoint(tmp_path / "root")
    it_dir = torch_dist.iteration_dir(root, 1)
    shard = next(it_dir.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name) as e:
        torch_dist.verify(*torch_dist.read_manifest(root))
    assert e.value.rule == "files"
    shard.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))  # restored
    torch_dist.verify(*torch_dist.read_manifest(root))
    (it_dir / "extra.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="extra.distcp"):
        torch_dist.verify(*torch_dist.read_manifest(root))


def test_a_sound_folder_reads(tmp_path):
    root = make_checkpoint(tmp_path / "root")
    assert torch.equal(torch_dist.global_tensors(root)["w"], torch.arange(4.0))


def test_iterations_newer_than_latest_are_set_aside(tmp_path):
    root = make_checkpoint(tmp_path / "root", iteration=1)
    make_checkpoint(tmp_path / "other", iteration=2)
    # iteration 2 published, then the writer died before `latest` moved
    torch_dist.iteration_dir(tmp_path / "other", 2).rename(torch_dist.iteration_dir(root, 2))
    moved = torch_dist.set_aside_newer(root)
    assert [(a.name, b.name.split(".aside-")[0]) for a, b in moved] == [
        ("iter_0000002", ".iter_0000002")
    ]
    assert not torch_dist.iteration_dir(root, 2).exists() and moved[0][1].is_dir()
    assert torch_dist.read_tracker(root) == 1 and torch_dist.iteration_dir(root, 1).is_dir()
    assert torch_dist.set_aside_newer(root) == []
