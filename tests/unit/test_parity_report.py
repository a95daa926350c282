"""`onpolicy parity` without engines: the comparison, the first-mismatch report, pair specs and
the refusals (contract rules, bad specs) before anything starts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from onpolicy.cli import main
from onpolicy.compare import PairResult, compare, format_table
from onpolicy.contract import ContractError
from onpolicy.parity import WorkerError, pair_config, parse_pair
from onpolicy.parity.run import _run

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def rollout_and_scores() -> tuple[list[dict], dict[int, torch.Tensor]]:
    """Two samples; the trainer's scores cover tokens 1..len-1, prompt positions included."""
    g = torch.Generator().manual_seed(0)
    samples, scores = [], {}
    for i, (n_prompt, n_out) in enumerate(((3, 4), (5, 6))):
        prompt = list(range(10 * i, 10 * i + n_prompt))
        out = list(range(100 + 10 * i, 100 + 10 * i + n_out))
        lps = -torch.rand(n_prompt + n_out - 1, generator=g) * 8
        samples.append({"prompt": prompt, "output_ids": out,
                        "logprobs": [float(x) for x in lps[n_prompt - 1 :]]})  # fmt: skip
        scores[i] = lps.clone()
    return samples, scores


def test_equal_scores_are_all_equal_and_prompt_positions_are_not_compared():
    samples, scores = rollout_and_scores()
    for i, s in enumerate(samples):  # the prompt's own log-probs are not the rollout's
        scores[i][: len(s["prompt"]) - 1] = 0.0
    r = compare(samples, scores, "tp1:world1")
    assert (r.equal, r.compared, r.first, r.ok) == (10, 10, None, True)
    # An off-by-one slice of the trainer's scores is caught.
    shifted = {i: torch.cat([t[1:], t[:1]]) for i, t in scores.items()}
    assert not compare(samples, shifted).ok


def test_one_ulp_is_reported_with_sample_position_token_and_hex():
    samples, scores = rollout_and_scores()
    samples[1]["logprobs"][2] = -1.0
    scores[1][len(samples[1]["prompt"]) - 1 + 2] = torch.nextafter(
        torch.tensor(-1.0), torch.tensor(-2.0)
    )
    r = compare(samples, scores, "tp2-ep2:world8-tp2-pp2-ep2-sp")
    assert (r.equal, r.compared, r.ok) == (9, 10, False)
    m = r.first
    assert (m.sample, m.position, m.completion_index, m.token) == (1, 5 + 2, 2, 112)
    text = m.describe()
    assert "sample 1, position 7 (generated token 2), token id 112" in text, text
    assert "rollout -1.0 (0xbf800000) vs trainer -1.0000001192092896 (0xbf800001)" in text, text
    table = format_table([r, PairResult(pair="tp1:world2-tp2-sp", compared=10, equal=10)])
    lines = table.splitlines()
    assert lines[1].split() == ["tp2-ep2:world8-tp2-pp2-ep2-sp", "9", "/", "10", "DIFFER"]
    assert lines[2].split() == ["tp1:world2-tp2-sp", "10", "/", "10", "bitwise", "equal"]
    assert lines[3] == f"tp2-ep2:world8-tp2-pp2-ep2-sp: {text}"


def test_first_mismatch_is_the_earliest_sample_then_position():
    samples, scores = rollout_and_scores()
    for i, j in ((1, 0), (0, 3), (0, 1)):
        samples[i]["logprobs"][j] += 1.0
    m = compare(samples, scores).first
    assert (m.sample, m.completion_index, m.position) == (0, 1, 3 + 1), m


def test_signed_zero_differs():
    samples, scores = rollout_and_scores()
    samples[0]["logprobs"][0] = 0.0
    scores[0][len(samples[0]["prompt"]) - 1] = -0.0
    r = compare(samples, scores)
    assert r.equal == r.compared - 1 and "(0x00000000) vs trainer -0.0 (0x80000000)" in (
        r.first.describe()
    )


def test_missing_or_misshapen_scores_are_refused():
    samples, scores = rollout_and_scores()
    with pytest.raises(ValueError, match="no scores for sample 1"):
        compare(samples, {0: scores[0]}, "p")
    with pytest.raises(ValueError, match="bfloat16"):
        compare(samples, {i: t.bfloat16() for i, t in scores.items()}, "p")


def test_pair_specs():
    p = parse_pair("tp2-ep2:world8-tp2-pp2-ep2-sp")
    assert (p.rollout.tp, p.rollout.ep) == (2, 2)
    t = p.training
    assert (t.world, t.tp, t.pp, t.ep, t.etp, t.sp, t.dp) == (8, 2, 2, 2, 1, True, 2)
    assert p.name == "tp2-ep2:world8-tp2-pp2-ep2-sp" and t.name() == p.name.split(":")[1]
    assert parse_pair("tp1:tp2-sp").training.world == 2
    stock = parse_pair("tp1-stock:world1").rollout
    assert stock.stock and stock.name == "tp1-stock" and not parse_pair("tp1:world1").rollout.stock
    control = parse_pair("tp2-ep2:world1-stock")
    assert control.training_stock and control.name == "tp2-ep2:world1-stock"
    assert not control.rollout.stock and not parse_pair("tp1:world1").training_stock
    bad_specs = (
        "tp2",
        "tp2:",
        "tp2-pp2:world1",
        "tp2:tp2-tp2-sp",
        "tp2:world8-xp2",
        "tpx:tp1",
        "tp1:world1-stock-stock",
        "tp1-sp:world1",
    )
    for bad in bad_specs:
        with pytest.raises(ContractError, match="parity_pairs"):
            parse_pair(bad)


def test_pairs_are_checked_against_the_contract():
    cfg = pair_config(CONFIG, {}, parse_pair("tp2:world1"))
    assert (cfg.rollout.engines, cfg.rollout.colocate, cfg.training.world) == (1, False, 1)
    cfg = pair_config(CONFIG, {}, parse_pair("tp1:world4-tp2-ep2-sp"))
    assert (cfg.rollout.engines, cfg.rollout.colocate, cfg.training.dp) == (4, True, 2)
    with pytest.raises(ContractError, match="sp_required") as e:
        pair_config(CONFIG, {}, parse_pair("tp1:tp2"))
    assert "layout pair tp1:world2-tp2" in str(e.value)
    with pytest.raises(ContractError, match="ep_divides_dp"):
        pair_config(CONFIG, {}, parse_pair("tp1:tp2-ep2-sp"))


def test_cli_refuses_bad_input_with_exit_2(tmp_path, capsys):
    work = ["--workdir", str(tmp_path)]
    assert main(["parity", "--config", str(tmp_path / "none.toml"), *work]) == 2
    assert "config_file" in capsys.readouterr().err
    assert main(["parity", "--config", str(CONFIG), "--pairs", "tp3:world1", *work]) == 2
    assert "power_of_2_groups" in capsys.readouterr().err
    assert main(["parity", "--config", str(CONFIG), "--new-tokens", "0", *work]) == 2
    assert "parity_sampling" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "a refused run must not start anything"


def test_a_dead_worker_is_named_with_its_exit_code_and_log(tmp_path):
    log = tmp_path / "rollout.log"
    cmd = [sys.executable, "-c", "import sys; print('loading weights'); sys.exit(7)"]
    with pytest.raises(WorkerError) as e:
        _run("rollout engine tp1", cmd, dict(os.environ), log, timeout=60)
    msg = str(e.value)
    assert msg.startswith(f"rollout engine tp1 exited 7; log: {log}") and "loading weights" in msg
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(WorkerError, match="trainer world1 ran past 1 s and was killed"):
        _run("trainer world1", hang, dict(os.environ), log, timeout=1)


# --- whole log-prob rows, by digest ------------------------------------------------------------
def test_row_digests_see_every_entry_and_not_the_order_of_the_sum():
    from onpolicy.bits import row_digests

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 151936, generator=g) - 12.0
    d = row_digests(rows)
    assert d.dtype == torch.int64 and d.shape == (4,)
    assert torch.equal(row_digests(rows.clone()), d)
    assert torch.equal(row_digests(rows[[2, 0]]), d[[2, 0]])  # a row's digest is its own
    for j in (0, 77_777, 151_935):  # one ulp anywhere in a row changes that row's digest only
        bumped = rows.clone()
        bumped[1, j] = torch.nextafter(bumped[1, j], torch.tensor(0.0))
        changed = row_digests(bumped) != d
        assert changed.tolist() == [False, True, False, False], j
    zeros = torch.zeros(1, 8)
    assert row_digests(zeros) != row_digests(-zeros)  # -0.0 and +0.0 are different bits
    with pytest.raises(ValueError, match="float32"):
        row_digests(rows.to(torch.bfloat16))


def test_compare_rows_counts_positions_and_names_the_first_in_hex():
    from onpolicy.compare import compare_rows

    samples, scores = rollout_and_scores()
    digests = {i: torch.arange(len(s["prompt"]) + len(s["output_ids"]) - 1) * 1000 + i
               for i, s in enumerate(samples)}  # fmt: skip
    for i, s in enumerate(samples):
        s["row_digests"] = digests[i][len(s["prompt"]) - 1 :].tolist()
    r = compare_rows(compare(samples, scores, "tp1:world1"), samples, digests)
    assert (r.rows_equal, r.rows_compared, r.first_row, r.ok) == (10, 10, None, True)
    samples[0]["row_digests"][1] = -1
    r = compare_rows(compare(samples, scores, "tp1:world1"), samples, digests)
    assert (r.rows_equal, r.rows_compared, r.ok) == (9, 10, False)
    assert r.first_row == (
        "first row mismatch: sample 0, position 4 (generated token 1): rollout "
        "row digest 0xffffffffffffffff vs trainer 0x0000000000000bb8"
    ), r.first_row
    table = format_table([r])
    assert "rows equal / compared" in table and " 9 / 10 " in table, table
    with pytest.raises(ValueError, match="trainer row digests"):
        compare_rows(r, samples, {i: d[:-1] for i, d in digests.items()})


@pytest.mark.parametrize("kernel", [False, True], ids=["no-sgl-kernel", "sgl-kernel"])
@pytest.mark.parametrize("rollout", ["tp1-stock", "tp1"])
def test_the_cuda_stock_control_without_sgl_kernel_runs_torch_ops_eagerly(
    monkeypatch, tmp_path, kernel, rollout
):
    """Where sglang-kernel is absent (the H200 host) the CUDA stock control runs SGLang's torch
    ops and decodes eagerly (their MoE reads expert counts back to the host, which a graph
    capture refuses); with it installed, or on the exact path, neither switch is set."""
    from onpolicy.parity import ParityRun
    from onpolicy.parity import run as parity_run
    from onpolicy.rollout import engine as rollout_engine

    seen = {}

    def fake_run(what, cmd, env, log, timeout):
        seen.update(cmd=cmd, env=env)
        (log.parent / "samples.json").write_text('{"samples": []}')

    monkeypatch.setattr(parity_run, "_run", fake_run)
    monkeypatch.setattr(rollout_engine, "sgl_kernel_installed", lambda: kernel)
    monkeypatch.delenv("SGLANG_FORCE_FUSED_OP_BACKEND", raising=False)
    pair = parse_pair(f"{rollout}:world1")
    one_gpu = CONFIG.with_name("one-gpu.toml")
    cfg = pair_config(one_gpu, {}, pair)
    run = ParityRun(config=str(one_gpu), workdir=tmp_path)
    parity_run.rollout(run, cfg, tmp_path / "ckpt", pair.rollout, [[1, 2]], tmp_path / "r")
    native = rollout == "tp1-stock" and not kernel
    assert ("--eager" in seen["cmd"]) is native
    assert (seen["env"].get("SGLANG_FORCE_FUSED_OP_BACKEND") == "torch") is native


# --- which processes run: one rollout per engine, one trainer job per training side -----------
PAIRS = ["tp1:world1", "tp1-stock:world1", "tp1:world1-stock"]
ROLLOUT = "onpolicy.parity.rollout_worker"


def fake_workers(monkeypatch, tmp_path, dies=lambda cmd: False) -> list[list[str]]:
    """`parity.run`'s processes replaced by writers of their outputs (every rollout the same two
    samples, every score equal to them); a command `dies` picks exits 1. The commands run, in
    order."""
    from onpolicy.parity import run as parity_run

    samples, scores = rollout_and_scores()
    calls: list[list[str]] = []

    def fake_run(what, cmd, env, log, timeout):
        calls.append(cmd)
        if dies(cmd):
            raise WorkerError(f"{what} exited 1; log: {log}")
        if ROLLOUT in cmd:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"samples": samples}))
            return
        for i, arg in enumerate(cmd):
            if arg == "--score":
                torch.save(scores, Path(cmd[i + 2]) / "scores.pt")

    monkeypatch.setattr(parity_run, "_run", fake_run)
    monkeypatch.setattr(parity_run, "model_checkpoint", lambda cfg, work: tmp_path / "ckpt")
    return calls


def _kinds(calls: list[list[str]]) -> list[tuple[str, int, bool]]:
    """Per command: rollout or trainer, how many rollouts it scores, whether it is stock."""
    return [("rollout" if ROLLOUT in c else "trainer", c.count("--score"), "--stock" in c)
            for c in calls]  # fmt: skip


def test_pairs_share_rollouts_and_trainer_jobs(monkeypatch, tmp_path):
    from onpolicy.parity import ParityRun, run_pairs

    calls = fake_workers(monkeypatch, tmp_path)
    run = ParityRun(config=str(CONFIG), workdir=tmp_path)
    results = run_pairs(run, [parse_pair(p) for p in PAIRS], log=lambda m: None)
    # two engines (exact, stock); the exact spec's job scores both rollouts, the local spec's one
    assert _kinds(calls) == [("rollout", 0, False), ("rollout", 0, True), ("trainer", 2, False),
                             ("trainer", 1, True)]  # fmt: skip
    assert [r.pair for r in results] == PAIRS and all(r.ok for r in results)


@pytest.mark.parametrize("dead", ["stock engine", "local-spec trainer"])
def test_a_dead_process_fails_only_the_pairs_that_need_it(monkeypatch, tmp_path, capsys, dead):
    """A stock engine that dies fails tp1-stock:world1 alone; a local-spec trainer job that dies
    fails tp1:world1-stock alone. The other pairs are still scored and compared; the CLI prints
    their table and exits 3, naming the dead pair."""
    engine = dead == "stock engine"
    calls = fake_workers(monkeypatch, tmp_path,
                         dies=lambda c: "--stock" in c and (ROLLOUT in c) == engine)  # fmt: skip
    code = main(["parity", "--config", str(CONFIG), "--pairs", *PAIRS, "--workdir", str(tmp_path)])
    out, err = capsys.readouterr()
    gone = "tp1-stock:world1" if engine else "tp1:world1-stock"
    assert code == 3, (out, err)
    assert f"onpolicy parity: {gone}: " in err and " exited 1; log: " in err, err
    rows = [line.split()[0] for line in out.splitlines()[1:] if line.strip()]
    assert rows == [p for p in PAIRS if p != gone] and "DIFFER" not in out, out
    scored = [k for k in _kinds(calls) if k[0] == "trainer"]
    # a dead engine's pair is not scored: the exact spec's job scores the one rollout left
    want = [("trainer", 1, False), ("trainer", 1, True)] if engine else [
        ("trainer", 2, False), ("trainer", 1, True)]  # fmt: skip
    assert scored == want, scored
