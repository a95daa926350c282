"""Megatron torch-dist checkpoints (onpolicy.checkpoint.torch_dist, `onpolicy convert`) on the
patched megatron-core, gloo/CPU, tiny Qwen3-MoE in bf16.

- HF -> torch-dist at TP2 PP2 EP2 SP (world 8, `onpolicy convert hf-to-dist`) -> HF at world 1
  (`onpolicy convert dist-to-hf`): every tensor has the source's bits, config.json and the
  tokenizer files are the source's.
- Resharding keeps the model: the checkpoint scored at world 1 and at TP1 PP2 EP4 (world 8) by
  the exact spec gives the same log-prob bits as at the saving layout. Control: the stock local
  spec, loaded from the same checkpoint and scored on the same sequences through the same
  schedule, gives other bits at two of those layouts.
- Training checkpoints: a DistributedOptimizer step at TP2 PP2 EP2, saved with its optimizer
  (fully_reshardable). Loaded by fresh objects at the same layout, the next step gives the
  bits of the uninterrupted run. Loaded at TP1 PP2 EP4 (2 chained optimizers on both sides),
  the re-save holds every saved tensor's bits (model and optimizer); the next step there is
  compared with the uninterrupted run and reported. At world 1 (EP1, one optimizer) the
  optimizer load is refused by rule, the model-only load gives the trained weights.
- A writer SIGKILLed after its shards are on disk leaves the previous iteration loadable with
  its bits and `latest` unchanged; the next save of that iteration succeeds.
- `onpolicy convert reshard` of the training checkpoint to world 2 EP2 keeps every tensor's
  bits, the optimizer's included; `dist-to-hf` of it gives the trained weights (read from its
  shards: the source HF folder its manifest records holds the untrained ones).

Launches: four CLI jobs (world 8, world 1, world 2, world 1), three worker jobs (world 8, world 8,
world 1) and the killed one (world 1); each launch checks several things.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from onpolicy.bits import assert_bitwise, bitwise_equal, n_differ
from onpolicy.checkpoint import torch_dist
from onpolicy.contract.config import load_config
from onpolicy.contract.rules import validate
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.hf_megatron import hf_to_megatron

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "checkpoint_dist.py"
CONFIG = REPO / "configs" / "tiny-cpu.toml"
SAVE = ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)
OTHER = ParallelLayout(world=8, tp=1, pp=2, ep=4)
WORLD1 = ParallelLayout(world=1)
EP2 = ParallelLayout(world=2, ep=2)
"""`onpolicy convert reshard` target: TP2 -> 1 and PP2 -> 1, EP > 1 on both sides."""
LENGTHS = [23, 5, 40, 2, 17, 12]
"""Mixed lengths; packed into several THD micro-batches of 64 tokens."""


def overrides(layout: ParallelLayout) -> dict[str, object]:
    """tiny-cpu.toml at this training layout, with a colocated rollout of the same TP."""
    return {
        "training.world": layout.world, "training.tp": layout.tp, "training.pp": layout.pp,
        "training.ep": layout.ep, "training.etp": layout.etp, "training.sp": layout.sp,
        "rollout.tp": layout.tp, "rollout.ep": layout.tp,
        "rollout.engines": layout.world // layout.tp, "rollout.colocate": True,
    }  # fmt: skip


def sets(layout: ParallelLayout) -> list[str]:
    out = []
    for k, v in overrides(layout).items():
        out += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return out


def layout_args(layout: ParallelLayout) -> list[str]:
    args = ["--tp", str(layout.tp), "--pp", str(layout.pp), "--ep", str(layout.ep)]
    return args + (["--sp"] if layout.sp else [])


def convert(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "integration"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "onpolicy.cli", "convert", *args], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.parametrize("layout", [SAVE, OTHER, WORLD1], ids=["save", "other", "world1"])
def test_layouts_are_exact_by_the_contract(layout):
    validate(load_config(CONFIG, overrides(layout)))


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_checkpoint, torchrun) -> dict:
    """Every launch, in order; their records by name and wall time by launch."""
    root = tmp_path_factory.mktemp("dist")
    g = torch.Generator().manual_seed(5)
    vocab = Qwen3MoeConfig.from_hf(tiny_checkpoint).vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    (root / "sequences.json").write_text(json.dumps(seqs))
    wall: dict[str, float] = {}

    def timed(name, fn, *a):
        t = time.perf_counter()
        out = fn(*a)
        wall[name] = time.perf_counter() - t
        return out

    model = root / "model"
    p = timed("hf-to-dist", convert, "hf-to-dist", "--hf", str(tiny_checkpoint), "--config",
              str(CONFIG), *sets(SAVE), "--out", str(model))  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    p = timed("dist-to-hf", convert, "dist-to-hf", "--ckpt", str(model), "--out",
              str(root / "hf"))  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    common = ["--hf", str(tiny_checkpoint), "--model", str(model), "--work", str(root),
              "--sequences", str(root / "sequences.json")]  # fmt: skip
    for mode, layout in (("save-layout", SAVE), ("other-layout", OTHER)):
        timed(mode, torchrun, WORKER, layout.world, "--mode", mode, *common,
              *layout_args(layout))  # fmt: skip
    p = timed("reshard", convert, "reshard", "--ckpt", str(root / "train"), "--config",
              str(CONFIG), *sets(EP2), "--out", str(root / "reshard"))  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    p = timed("dist-to-hf of train", convert, "dist-to-hf", "--ckpt", str(root / "train"),
              "--out", str(root / "hf-train"))  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    killed = timed("kill", kill_midway, common, root)
    timed("world1", torchrun, WORKER, 1, "--mode", "world1", *common)
    print("wall s per launch:", {k: round(v, 1) for k, v in wall.items()})
    return {"root": root, "seqs": seqs, "killed": killed, "wall": wall}


def process_tree(pid: int) -> list[int]:
    """pid and every descendant (Linux /proc): every process of the job, wherever its
    session or process group."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            children = task / "children"
            if children.is_file():
                todo += [int(c) for c in children.read_text().split()]
    return out


def kill_midway(common: list[str], root: Path) -> dict:
    """Launch the kill job; SIGKILL torchrun and every process under it once iteration 2's
    temporary folder holds a .distcp file."""
    from onpolicy.rendezvous import loopback_env, torchrun

    cmd = torchrun(1, str(WORKER), "--mode", "kill", *common)
    path = [str(REPO / "integration"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **loopback_env()}
    tmp = root / "kill" / ".iter_0000002.tmp"
    with open(root / "kill.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 300
        while not (tmp.is_dir() and any(tmp.glob("*.distcp"))):
            assert proc.poll() is None, (root / "kill.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the kill job never wrote iteration 2's shards"
            time.sleep(0.05)
        tree = process_tree(proc.pid)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
    for pid in tree[1:]:  # reaped by init once their parent died
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
            assert time.monotonic() < deadline, f"process {pid} survived SIGKILL"
            time.sleep(0.05)
    return {"returncode": proc.returncode, "files": sorted(p.name for p in tmp.iterdir())}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def records(root: Path, mode: str, world: int) -> tuple[dict, list[dict]]:
    rec = torch.load(root / f"{mode}.pt", weights_only=False)
    ranks = [torch.load(root / f"{mode}-rank{r}.pt") for r in range(world)] if world else []
    return rec, ranks


@pytest.mark.slow
def test_hf_to_dist_to_hf_is_bit_identical(work, tiny_checkpoint):
    root = work["root"]
    src = read_hf_checkpoint(tiny_checkpoint, strict=False).tensors
    out = read_hf_checkpoint(root / "hf", strict=False).tensors
    assert list(out) == list(src)
    for k in src:
        assert_bitwise(out[k], src[k], k)
    print(f"hf -> torch-dist at {torch_dist.layout_name(torch_dist.layout_dict(SAVE))} -> hf: "
          f"{len(src)}/{len(src)} tensors bitwise equal")  # fmt: skip
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (root / "hf" / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name
    _, manifest = torch_dist.read_manifest(root / "model")
    assert manifest["layout"] == torch_dist.layout_dict(SAVE)
    assert (manifest["dtype"], manifest["iteration"], manifest["has_optimizer"]) == (
        "bfloat16", 0, False)  # fmt: skip
    assert manifest["source_hf"] == str(tiny_checkpoint.resolve())
    assert sorted(p.name for p in (root / "model").iterdir()) == ["iter_0000000", "latest"]
    # The control: the comparison sees a changed tensor.
    changed = out["model.norm.weight"].clone()
    changed[0] = -changed[0]
    assert not bitwise_equal(changed, src["model.norm.weight"])


@pytest.mark.slow
def test_logprobs_after_resharding_are_bitwise_equal(work):
    root = work["root"]
    saved = records(root, "save-layout", 0)[0]
    others = {"other": records(root, "other-layout", 0)[0], "world1": records(root, "world1", 0)[0]}
    ref = torch.cat(saved["exact"])
    assert [len(v) for v in saved["exact"]] == [n - 1 for n in LENGTHS]
    stock = {"save": torch.cat(saved["stock"])}
    for name, rec in others.items():
        assert_bitwise(
            torch.cat(rec["exact"]), ref, f"exact spec loaded at {name} vs saving layout"
        )
        stock[name] = torch.cat(rec["stock"])
        n = ref.numel()
        print(f"{name}: exact {n}/{n} log-probs equal to the saving layout's; stock spec "
              f"differs on {n_differ(stock[name], stock['save'])}/{n}")  # fmt: skip
    # The control: the stock spec's log-probs from the same checkpoints are layout-dependent.
    assert (
        n_differ(stock["world1"], stock["save"]) > 0 or n_differ(stock["other"], stock["save"]) > 0
    )


@pytest.mark.slow
def test_training_checkpoint_across_layouts(work, tiny_checkpoint):
    root = work["root"]
    saved, save_ranks = records(root, "save-layout", SAVE.world)
    # Same layout, fresh objects, state from disk: the second step has the uninterrupted bits.
    assert saved["step2_resumed"] == saved["step2"], (saved["step2_resumed"], saved["step2"])
    for r, rec in enumerate(save_ranks):
        assert rec["p2"].keys() == rec["p2_resumed"].keys()
        for k, p in rec["p2"].items():
            assert_bitwise(rec["p2_resumed"][k], p, f"rank {r} {k}: resumed step")
        # Control: the second step moved the weights, so a lost optimizer state would show.
        assert sum(n_differ(rec["p1"][k], p) for k, p in rec["p2"].items()) > 0
    # TP1 PP2 EP4: the re-save after the optimizer load holds every tensor's bits.
    train = torch_dist.global_tensors(root / "train")
    resave = torch_dist.global_tensors(root / "resave")
    assert train.keys() == resave.keys()
    assert any(k.startswith("optimizer.state.exp_avg.") for k in train)
    for k, t in train.items():
        assert_bitwise(resave[k], t, f"re-save at TP1 PP2 EP4: {k}")
    # `onpolicy convert reshard` to world 2 EP2 carries the optimizer with the same bits.
    _, manifest = torch_dist.read_manifest(root / "reshard")
    assert manifest["layout"] == torch_dist.layout_dict(EP2) and manifest["has_optimizer"]
    assert manifest["iteration"] == 1
    resharded = torch_dist.global_tensors(root / "reshard")
    assert resharded.keys() == train.keys()
    for k, t in train.items():
        assert_bitwise(resharded[k], t, f"onpolicy convert reshard to world 2 EP2: {k}")
    cont = torch_dist.global_tensors(root / "cont")
    resh = torch_dist.global_tensors(root / "resh")
    differ = {k: n_differ(resh[k], t) for k, t in cont.items()}
    other = records(root, "other-layout", 0)[0]
    print(f"re-save at TP1 PP2 EP4: {len(train)}/{len(train)} tensors bitwise equal; the next "
          f"step there vs at TP2 PP2 EP2: {sum(v > 0 for v in differ.values())}/{len(cont)} "
          f"tensors differ (grad norm {other['step2']['grad_norm']!r} vs "
          f"{saved['step2']['grad_norm']!r})")  # fmt: skip
    # Control: the comparison of the re-save sees a step (iteration 1 vs 2 weights differ).
    assert any(n_differ(cont[k], train[k]) for k in cont)
    # World 1: EP2 -> EP1 changes the chained optimizer count: refused by rule.
    w1 = records(root, "world1", 0)[0]
    refusal = w1["optimizer_refusal"]
    assert refusal and refusal["rule"] == "optimizer_layout", refusal
    assert "world8-tp2-pp2-ep2-etp1-sp" in refusal["message"] and "model only" in refusal["message"]
    # Model-only at world 1: the trained weights after step 1, on every saving rank's shard.
    cfg = Qwen3MoeConfig.from_hf(tiny_checkpoint)
    assert w1["model_only"]["iteration"] == 1
    for r, rec in enumerate(save_ranks):
        expected = hf_to_megatron(cfg, w1["model_only"]["hf"], SAVE, r, torch.bfloat16)
        for k, p in rec["p1"].items():
            assert_bitwise(expected[k], p, f"world-1 model-only load, rank {r} {k}")
    # dist-to-hf reads the shards, not the source HF folder the manifest records: the trained
    # checkpoint converts to the trained weights, which differ from the source's.
    _, manifest = torch_dist.read_manifest(root / "train")
    assert manifest["source_hf"] == str(tiny_checkpoint.resolve())
    converted = read_hf_checkpoint(root / "hf-train", strict=False).tensors
    trained = w1["model_only"]["hf"]
    assert sorted(converted) == sorted(trained)
    for k, t in trained.items():
        assert_bitwise(converted[k], t, f"dist-to-hf of the trained checkpoint: {k}")
    src = read_hf_checkpoint(tiny_checkpoint, strict=False).tensors
    assert sum(n_differ(converted[k], src[k]) > 0 for k in src) > 0


@pytest.mark.slow
def test_killed_writer_leaves_the_previous_iteration(work):
    root, killed = work["root"], work["killed"]
    assert killed["returncode"] == -signal.SIGKILL, killed
    assert any(f.endswith(".distcp") for f in killed["files"]), killed
    w1 = records(root, "world1", 0)[0]
    assert w1["kill_latest_before"] == "1"
    assert w1["kill_stale_tmp"] == [".iter_0000002.tmp", "iter_0000001", "latest"]
    assert w1["kill_loaded"] == 1
    before = torch.load(root / "kill.pt")["params"]
    for k, p in before.items():
        assert_bitwise(w1["kill_params"][k], p, f"iteration 1 after the kill: {k}")
    # Control: iteration 2's weights (doubled) differ from iteration 1's.
    assert any(n_differ(p * 2, p) for p in before.values())
    assert w1["kill_after"] == ["iter_0000001", "iter_0000002", "latest"]
    assert w1["kill_latest_after"] == "2"
    assert w1["exists_refusal"]["rule"] == "iteration_exists", w1["exists_refusal"]
