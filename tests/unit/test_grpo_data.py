"""The dataset task's data (`onpolicy.grpo.data`, `onpolicy.grpo.tasks.dataset`): the generated
arithmetic set in JSONL and Parquet, prompts through the tiny tokenizer's chat template, the
stream order (epochs, shuffle, resume), decode and stop ids, rewards on decoded text, and every
bad input refused by rule; the `[data]`, `[reward]`, `[eval]` tables; eval metrics and group
filtering. Nothing comes from a hub: the tokenizer is the tiny one, written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from onpolicy.contract import ContractError
from onpolicy.grpo.config import load_e2e_config
from onpolicy.grpo.data import (
    DataConfig,
    Stream,
    arithmetic_rows,
    epoch_order,
    load_prompts,
    read_table,
    write_arithmetic,
)
from onpolicy.grpo.evaluation import eval_due, eval_metrics
from onpolicy.grpo.filtering import fill, has_signal, select_groups
from onpolicy.grpo.rewards import RewardConfig, math_reward
from onpolicy.grpo.tasks import DatasetConfig, TaskContext, make_task
from onpolicy.models.tiny import TINY, write_tokenizer

REPO = Path(__file__).resolve().parents[2]
MATH_CONFIG = REPO / "configs" / "tiny-cpu-math.toml"
TINY_CONFIG = REPO / "configs" / "tiny-cpu.toml"
V, EOS = TINY.vocab_size, TINY.eos_token_id


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A folder with the tiny tokenizer (chat template) and generation config."""
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, V)
    return out


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("data")
    return {
        "jsonl": write_arithmetic(d / "train.jsonl", 24, seed=0),
        "parquet": write_arithmetic(d / "eval.parquet", 6, seed=1),
    }


def task(ckpt, data: DataConfig, reward: RewardConfig | None = None, seed: int = 0):
    context = TaskContext(checkpoint=ckpt, data=data, reward=reward or RewardConfig(name="math"),
                          seed=seed)  # fmt: skip
    return make_task(DatasetConfig(), V, EOS, context)


# --- the generated set ------------------------------------------------------------------------
def test_arithmetic_rows_are_deterministic_and_right():
    from fractions import Fraction

    rows = arithmetic_rows(60, seed=0)
    assert rows == arithmetic_rows(60, seed=0) and rows != arithmetic_rows(60, seed=1)
    assert {r["op"] for r in rows} == set("+-*/")
    for r in rows:
        q = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][0]["content"]
        a, b = (int(x) for x in q.split("What is ")[1].split("?")[0].split(",")[0].split(r["op"]))
        want = {"+": a + b, "-": a - b, "*": a * b, "/": Fraction(a, b)}[r["op"]]
        assert Fraction(r["label"]) == want, r
    assert isinstance(rows[2]["prompt"], list) and isinstance(rows[0]["prompt"], str)


def test_jsonl_and_parquet_read_back(files):
    j = list(read_table(str(files["jsonl"]), "data.train_file"))
    assert [r["label"] for r in j] == [r["label"] for r in arithmetic_rows(24, 0)]
    assert j[0]["prompt"] == arithmetic_rows(24, 0)[0]["prompt"]  # a string
    assert j[2]["prompt"][0]["role"] == "user"  # chat messages
    p = list(read_table(str(files["parquet"]), "data.eval_file"))
    assert [r["label"] for r in p] == [r["label"] for r in arithmetic_rows(6, 1)]
    assert all(isinstance(r["prompt"], list) for r in p)  # one type per Parquet column


def test_the_committed_math_config_files_are_the_generated_set():
    e = load_e2e_config(MATH_CONFIG)
    train = list(read_table(str(REPO / e.data.train_file), "data.train_file"))
    assert [(r["prompt"], r["label"], r["id"]) for r in train] == [
        (r["prompt"], r["label"], r["id"]) for r in arithmetic_rows(64, seed=0)
    ]
    ev = list(read_table(str(REPO / e.data.eval_file), "data.eval_file"))
    assert [r["label"] for r in ev] == [r["label"] for r in arithmetic_rows(16, seed=1)]


# --- prompts through the tokenizer ------------------------------------------------------------
def test_the_tiny_tokenizer_has_a_chat_template(tokenizer):
    msgs = [{"role": "user", "content": "What is 1 + 1?"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    off = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)  # fmt: skip
    assert off == text + "<think>\n\n</think>\n\n"
    assert tokenizer.eos_token_id == EOS


def test_prompts_go_through_the_chat_template(ckpt, tokenizer, files):
    cfg = DataConfig(train_file=str(files["jsonl"]), system_prompt="Be exact.",
                     enable_thinking=False)  # fmt: skip
    ps = load_prompts(cfg.train_file, "data.train_file", cfg, tokenizer)
    assert ps.total == 24 and len(ps.rows) == 24 and ps.dropped_long == 0
    src = arithmetic_rows(24, 0)
    for r in ps.rows:
        q = src[r.row]["prompt"]
        q = q if isinstance(q, str) else q[0]["content"]
        assert r.text == (f"<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\n{q}"
                          "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")  # fmt: skip
        assert r.ids == tokenizer(r.text, add_special_tokens=False)["input_ids"]
        assert r.ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert r.label == src[r.row]["label"]
        assert r.metadata == {"id": r.row, "op": src[r.row]["op"]}


def test_a_rows_own_system_message_wins(ckpt, tokenizer, tmp_path):
    f = tmp_path / "sys.jsonl"
    msgs = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]
    f.write_text(json.dumps({"prompt": msgs, "label": "1"}) + "\n")
    cfg = DataConfig(train_file=str(f), system_prompt="Theirs.")
    (row,) = load_prompts(str(f), "data.train_file", cfg, tokenizer).rows
    assert "Mine." in row.text and "Theirs." not in row.text


def test_raw_prompts_without_the_template(tokenizer, tmp_path):
    f = tmp_path / "raw.jsonl"
    f.write_text(json.dumps({"prompt": "2 + 2 =", "label": "4"}) + "\n")
    cfg = DataConfig(train_file=str(f), apply_chat_template=False)
    (row,) = load_prompts(str(f), "data.train_file", cfg, tokenizer).rows
    assert row.text == "2 + 2 =" and row.ids == tokenizer("2 + 2 =")["input_ids"]


def test_long_prompts_are_dropped_and_counted(tokenizer, files):
    full = load_prompts(str(files["jsonl"]), "k", DataConfig(), tokenizer)
    lengths = sorted(len(r.ids) for r in full.rows)
    cut = lengths[len(lengths) // 2]
    ps = load_prompts(str(files["jsonl"]), "k", DataConfig(max_prompt_tokens=cut), tokenizer)
    assert ps.dropped_long == sum(n > cut for n in lengths) > 0
    assert len(ps.rows) + ps.dropped_long == 24 and all(len(r.ids) <= cut for r in ps.rows)


# --- the order --------------------------------------------------------------------------------
def test_epoch_order():
    assert epoch_order(5, 0, 0, shuffle=False) == [0, 1, 2, 3, 4]
    a = epoch_order(50, 0, 7, shuffle=True)
    assert sorted(a) == list(range(50)) and a != list(range(50))
    assert a == epoch_order(50, 0, 7, True)
    assert a != epoch_order(50, 1, 7, True) and a != epoch_order(50, 0, 8, True)


def test_stream_walks_epochs_in_order():
    rows = list(range(5))
    s = Stream(rows, seed=3, shuffle=True, epochs=2)  # Stream only indexes its rows
    assert s.length == 10
    first = [s.at(p) for p in range(5)]
    second = [s.at(p) for p in range(5, 10)]
    assert sorted(first) == sorted(second) == rows
    assert first == [rows[i] for i in epoch_order(5, 0, 3, True)]
    assert second == [rows[i] for i in epoch_order(5, 1, 3, True)]
    with pytest.raises(IndexError, match="outside \\[0, 10\\)"):
        s.at(10)


def test_step_prompts_are_a_function_of_config_and_step(ckpt, files):
    cfg = DataConfig(train_file=str(files["jsonl"]), epochs=2)
    t = task(ckpt, cfg, seed=5)
    try:
        steps = {s: t.prompts(s, 4, 5) for s in range(1, 13)}
        assert [p.index for p in steps[1]] == [0, 1, 2, 3]
        # steps 1-6 are epoch 0 (24 rows), each row once; 7-12 epoch 1, in another order
        epoch0 = [p.row for s in range(1, 7) for p in steps[s]]
        epoch1 = [p.row for s in range(7, 13) for p in steps[s]]
        assert sorted(epoch0) == sorted(epoch1) == list(range(24)) and epoch0 != epoch1
        assert epoch0 == epoch_order(24, 0, 5, True)
        # a fresh task (a resumed run) gives steps 3 and 4 the same prompts
        again = task(ckpt, cfg, seed=5)
        assert again.prompts(3, 4, 5) == steps[3] and again.prompts(4, 4, 5) == steps[4]
        assert t.prompts_at(8, 8) == [p.__class__(**{**_fields(p), "index": i})
                                      for i, p in enumerate(steps[3] + steps[4])]  # fmt: skip
        again.close()
        with pytest.raises(ContractError) as e:
            t.prompts(13, 4, 5)
        assert e.value.rule == "data_epochs"
        assert "24 usable rows x data.epochs 2 = 48" in str(e.value)
        unshuffled = task(ckpt, DataConfig(train_file=str(files["jsonl"]), shuffle=False))
        assert [p.row for p in unshuffled.prompts(2, 4, 0)] == [4, 5, 6, 7]
        unshuffled.close()
    finally:
        t.close()


def _fields(p) -> dict:
    return {k: getattr(p, k) for k in p.__slots__}


# --- responses: stop ids, decode, rewards -----------------------------------------------------
def test_stop_ids_decode_and_math_rewards_on_text(ckpt, tokenizer, files):
    t = task(ckpt, DataConfig(train_file=str(files["jsonl"]), eval_file=str(files["parquet"])))
    try:
        assert t.stop_token_ids() == [EOS]  # the tokenizer's EOS = the generation config's
        ps = t.prompts(1, 3, 0)

        def enc(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        right = enc(f"so \\boxed{{{ps[0].label}}}") + [EOS] + enc(" \\boxed{999}")
        wrong = enc("\\boxed{-1000}")
        truncated = enc("I think it is") + [tokenizer.convert_tokens_to_ids("<|im_start|>")]
        assert t.decode(right) == f"so \\boxed{{{ps[0].label}}}"  # cut at the stop id
        assert t.decode(truncated) == "I think it is"  # special tokens skipped
        scores = t.score(ps, [right, wrong, truncated])
        assert [s.reward for s in scores] == [1.0, 0.0, 0.0]
        assert [s.metrics for s in scores] == [{"answered": 1.0}, {"answered": 1.0},
                                               {"answered": 0.0}]  # fmt: skip
        assert [s.text for s in scores] == [t.decode(r) for r in (right, wrong, truncated)]
        for p, s in zip(ps, scores, strict=True):  # what the pool ran is the rule on the text
            assert math_reward(p.text, s.text, p.label, p.metadata)["score"] == s.reward
        ev = t.eval_prompts()
        assert [p.row for p in ev] == list(range(6)) and len(t.eval_prompts(2)) == 2
    finally:
        t.close()


def test_a_custom_dict_reward_on_decoded_text(ckpt, tokenizer, files):
    t = task(ckpt, DataConfig(train_file=str(files["jsonl"])),
             RewardConfig(name="custom", path="reward_fixtures:digits", workers=1))  # fmt: skip
    try:
        ps = t.prompts(1, 2, 0)
        resp = [tokenizer(f"maybe {ps[0].label}", add_special_tokens=False)["input_ids"],
                tokenizer("no", add_special_tokens=False)["input_ids"]]  # fmt: skip
        scores = t.score(ps, resp)
        assert scores[0].reward == 1.0 and scores[1].reward == 0.0
        assert scores[0].metrics == {"chars": len(f"maybe {ps[0].label}"), "has_row_id": 1.0}
    finally:
        t.close()


# --- bad input: each refused by rule ----------------------------------------------------------
def _bad(tmp_path: Path, name: str, lines: list[dict]) -> str:
    f = tmp_path / name
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(f)


@pytest.mark.parametrize(
    ("make", "rule", "needle"),
    [
        (lambda d, f: DataConfig(train_file=str(d / "missing.jsonl")), "data_file", "no such file"),
        (lambda d, f: DataConfig(train_file=_bad(d, "x.csv", [])), "data_file", "not a .jsonl"),
        (lambda d, f: DataConfig(train_file=str(f["jsonl"]), prompt_key="question"), "data_keys",
         "no column 'question'"),
        (lambda d, f: DataConfig(train_file=str(f["jsonl"]), label_key="answer"), "data_keys",
         "set data.label_key"),
        (lambda d, f: DataConfig(train_file=_bad(d, "nolabel.jsonl", [
            {"prompt": "a", "label": "1"}, {"prompt": "b"}])), "data_keys", "row 1 has no 'label'"),
        (lambda d, f: DataConfig(train_file=_bad(d, "num.jsonl", [{"prompt": 3, "label": "1"}])),
         "data_prompt", "a string or a list of {role, content}"),
        (lambda d, f: DataConfig(train_file=str(f["jsonl"]), max_prompt_tokens=5), "data_empty",
         "no prompt left of 24 rows"),
        (lambda d, f: DataConfig(train_file=str(f["jsonl"]), eval_file=_bad(d, "ev.jsonl", [
            {"prompt": "a"}])), "data_keys", "data.eval_file"),
        (lambda d, f: DataConfig(train_file=str(f["jsonl"]), apply_chat_template=False),
         "data_prompt", "a chat-message prompt with data.apply_chat_template = false"),
    ],
)  # fmt: skip
def test_bad_data_is_refused_by_rule(ckpt, files, tmp_path, make, rule, needle):
    with pytest.raises(ContractError) as e:
        task(ckpt, make(tmp_path, files))
    assert e.value.rule == rule and needle in str(e.value), str(e.value)


def test_an_unreadable_file_is_refused(ckpt, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a", "label": \n')
    with pytest.raises(ContractError) as e:
        task(ckpt, DataConfig(train_file=str(f)))
    assert e.value.rule == "data_file" and "cannot be read as json" in str(e.value)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path, files):
    write_tokenizer(tmp_path, V)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ContractError) as e:
        task(tmp_path, DataConfig(train_file=str(files["jsonl"])))
    assert e.value.rule == "data_template"


# --- the config tables ------------------------------------------------------------------------
def test_the_math_config():
    e = load_e2e_config(MATH_CONFIG)
    assert e.task.name == "dataset" and e.reward.name == "math"
    assert e.data.train_file.endswith(".jsonl") and e.data.eval_file.endswith(".parquet")
    assert e.eval.every == 2 and e.run.save_samples
    t = load_e2e_config(TINY_CONFIG)  # the CI default stays the band task
    assert t.task.name == "band" and t.reward.name == "band" and t.data == DataConfig()
    again = load_e2e_config(MATH_CONFIG, {"grpo.steps": 3})
    from onpolicy.grpo.config import e2e_config_from_dict

    assert e2e_config_from_dict(again.to_dict()).to_dict() == again.to_dict()


@pytest.mark.parametrize(
    ("config", "overrides", "rule", "needle"),
    [
        (TINY_CONFIG, {"data.train_file": "x.jsonl"}, "data_task", "generates its own prompts"),
        (MATH_CONFIG, {"data.train_file": ""}, "data_task", "without data.train_file"),
        (MATH_CONFIG, {"data.epochs": 0}, "data_config", "data.epochs = 0"),
        (MATH_CONFIG, {"data.label_key": "prompt"}, "data_config", "two different columns"),
        (MATH_CONFIG, {"data.shuffle": "yes"}, "config_types", "'data.shuffle'"),
        (MATH_CONFIG, {"data.split": "train"}, "config_keys", "unknown config key 'data.split'"),
        (MATH_CONFIG, {"reward.name": "band"}, "reward_task", "'math' or 'custom'"),
        (TINY_CONFIG, {"reward.name": "math"}, "reward_task", "takes 'band'"),
        (MATH_CONFIG, {"reward.name": "poetry"}, "reward_config", "'poetry'"),
        (MATH_CONFIG, {"reward.name": "custom"}, "reward_config", "reward.path = ''"),
        (MATH_CONFIG, {"reward.path": "reward_fixtures:digits"}, "reward_config", "'math'"),
        (MATH_CONFIG, {"reward.workers": 0}, "reward_config", "reward.workers = 0"),
        (MATH_CONFIG, {"reward.name": "custom", "reward.path": "no_such_mod_q:fn"},
         "reward_path", "does not import"),
        (MATH_CONFIG, {"reward.name": "custom", "reward.path": "reward_fixtures:two_args"},
         "reward_signature", "(prompt, response, label, metadata)"),
        (MATH_CONFIG, {"eval.samples_per_prompt": 0}, "eval_config", "samples_per_prompt = 0"),
        (MATH_CONFIG, {"eval.temperature": -1.0}, "eval_config", "eval.temperature = -1.0"),
        (MATH_CONFIG, {"data.eval_file": ""}, "eval_config", "eval.every = 2 without"),
        (MATH_CONFIG, {"eval.every": -1}, "eval_config", "eval.every = -1"),
        (TINY_CONFIG, {"grpo.filter_groups": True}, "grpo_config", "grpo.filter_groups"),
        (MATH_CONFIG, {"grpo.filter_max_batches": 0}, "grpo_config", "filter_max_batches = 0"),
    ],
)  # fmt: skip
def test_bad_tables_are_refused_by_rule(config, overrides, rule, needle):
    with pytest.raises(ContractError) as e:
        load_e2e_config(config, overrides)
    assert e.value.rule == rule and needle in str(e.value), str(e.value)


def test_a_custom_reward_is_read():
    e = load_e2e_config(MATH_CONFIG, {"reward.name": "custom",
                                      "reward.path": "reward_fixtures:digits"})  # fmt: skip
    assert e.reward == RewardConfig(name="custom", path="reward_fixtures:digits", workers=2,
                                    timeout_s=30.0)  # fmt: skip


# --- eval metrics and group filtering ---------------------------------------------------------
def test_eval_metrics():
    # 3 prompts x 2 samples: passes (1, 0), (0, 0), (1, 1)
    m = eval_metrics([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], 2, 1.0, [True, False] * 3)
    assert m["eval/reward_mean"] == 0.5 and m["eval/pass@1"] == 0.5
    assert m["eval/pass@k"] == 2 / 3 and m["eval/k"] == 2
    assert m["eval/truncated_frac"] == 0.5 and (m["eval/prompts"], m["eval/samples"]) == (3, 6)
    assert eval_metrics([0.4, 0.6], 2, 0.5, [False, False])["eval/pass@k"] == 1.0  # threshold
    with pytest.raises(ValueError):
        eval_metrics([1.0, 0.0, 1.0], 2, 1.0, [False] * 3)
    assert [s for s in range(1, 8) if eval_due(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(1, 5) if eval_due(s, 4, 0)] == [4]


def test_group_filtering():
    assert has_signal([0.0, 1.0]) and not has_signal([0.5, 0.5]) and not has_signal([1.0])
    rewards = [0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0.5, 0]  # 6 groups of 2: signal in 1, 3, 5
    kept, dropped = select_groups(rewards, 2, 2)
    assert (kept, dropped) == ([1, 3], [0, 2])  # full after group 3: groups 4, 5 not looked at
    assert select_groups(rewards, 2, 5) == ([1, 3, 5], [0, 2, 4])
    assert fill([1, 3, 5], [0, 2, 4], 5) == [0, 1, 2, 3, 5]  # topped up with the earliest dropped
    assert fill([1, 3], [0, 2], 2) == [1, 3]
    with pytest.raises(ValueError):
        select_groups([0.0] * 3, 2, 1)
