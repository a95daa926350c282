"""One run per output folder: `onpolicy e2e` refuses a used --out without --resume, a folder
another process has locked, and a garbage resume point, with exit 2 and nothing written.

Each refusal comes before Ray or any engine starts (`Driver.setup`), so these run the CLI's
`main` in-process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from onpolicy.fsutil import FolderLocked, lock_folder
from onpolicy.grpo.e2e import main
from onpolicy.grpo.procs import RUN_ID_ENV

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.toml"


@pytest.fixture(autouse=True)
def _run_id(monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, uuid.uuid4().hex)  # the driver sets it: restored after


def _main(out: Path, *args: str) -> int:
    return main(["--config", str(CONFIG), "--out", str(out), "--set", "run.wandb_mode=disabled",
                 "--set", "run.progress=false", *args])  # fmt: skip


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_used_out_without_resume_is_refused_and_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "config.json").write_text("{}\n")
    before = _snapshot(out)
    assert _main(out) == 2
    err = capsys.readouterr().err
    assert "[run_out]" in err and str(out) in err and "config.json, metrics.jsonl" in err, err
    assert "--resume" in err
    assert _snapshot(out) == before


def test_a_locked_out_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("1\n")
    held = lock_folder(out)
    try:
        before = _snapshot(out)
        assert _main(out, "--resume") == 2
        err = capsys.readouterr().err
        assert "[run_lock]" in err and f"locked by process {os.getpid()}" in err, err
        assert _snapshot(out) == before
    finally:
        held.close()


def test_a_garbage_resume_point_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("not-a-step\n")
    assert _main(out, "--resume") == 2
    err = capsys.readouterr().err
    assert "--resume:" in err and "[rule tracker]" in err and "not-a-step" in err, err
    assert "Traceback" not in err
    assert not (out / "config.json").exists() and not list(out.glob("tiny-seed*")), _snapshot(out)


def test_a_resume_with_another_model_is_refused_before_anything_is_written(tmp_path, capsys):
    """--resume with a [model] that is not the run's (another seed) would seed a second model
    into the run folder: refused naming the rule and what the folder holds, nothing written."""
    from onpolicy.contract import load_config, model_checkpoint_path

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("1\n")
    runs = model_checkpoint_path(load_config(CONFIG), out)  # the run's seeded model (seed 0)
    runs.mkdir()
    before = _snapshot(out)
    assert _main(out, "--resume", "--set", "model.seed=1") == 2
    err = capsys.readouterr().err
    assert "[resume_model]" in err and "seed 1" in err and runs.name in err, err
    assert {k: v for k, v in _snapshot(out).items() if k != ".lock"} == before
    assert sorted(p.name for p in out.iterdir() if p.name != ".lock") == ["checkpoints", runs.name]


def test_the_lock_is_exclusive_across_processes_and_released_on_close(tmp_path):
    folder = tmp_path / "f"
    other = textwrap.dedent(f"""
        import sys
        from onpolicy.fsutil import FolderLocked, lock_folder
        try:
            lock_folder({str(folder)!r})
        except FolderLocked as err:
            print("refused:", err)
            sys.exit(0)
        print("taken")
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "integration"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    held = lock_folder(folder)
    p = subprocess.run([sys.executable, "-c", other], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.stdout.startswith(f"refused: {folder} is locked by process {os.getpid()}"), p
    with pytest.raises(FolderLocked):  # this process's second open file is refused too
        lock_folder(folder)
    held.close()
    p = subprocess.run([sys.executable, "-c", other], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.stdout.strip() == "taken", p
