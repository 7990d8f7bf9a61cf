import ast
import dataclasses
from pathlib import Path

import pytest

from megatron_dapo.config import SECTIONS
from megatron_dapo.config import ConfigError
from megatron_dapo.config import RunConfig
from megatron_dapo.config import load_config
from megatron_dapo.config import parse_overrides
from megatron_dapo.config import save_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_papers():
    c = RunConfig()
    assert c.algorithm.policy_loss == "dapo" and (c.loss.eps_low, c.loss.eps_high, c.algorithm.group_size) == (
        0.2,
        0.28,
        16,
    )
    assert c.loss.loss_agg_mode == "token-mean" and c.algorithm.dynamic_sampling and c.algorithm.overlong_penalty
    assert (c.rollout.max_response_length, c.algorithm.overlong_buffer) == (20480, 4096)
    assert c.trainer.prompts_per_step == 512 and c.actor.lr == 1e-6 and c.reward.answer_format == "answer_line"
    assert c.trainer.prompts_per_step * c.algorithm.group_size // (c.trainer.mini_batch_prompts * 16) == 16
    assert not hasattr(c.algorithm, "kl_coef")  # DAPO removes the KL term


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_example_loads(path):
    config = load_config(path)
    assert isinstance(config, RunConfig)


def test_every_field_is_documented():
    tree = ast.parse((ROOT / "megatron_dapo" / "config.py").read_text())
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or not node.name.endswith("Config") or node.name == "ConfigError":
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt.value, "value", None), str)
                assert doc, f"{node.name}.{stmt.target.id} has no docstring"


def test_yaml_round_trip(tmp_path):
    config = load_config(None, ["--actor.lr=3e-6", "--trainer.total_steps=7"])
    save_config(config, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == config


def test_overrides_convert_types():
    c = load_config(
        None,
        [
            "--actor.lr=2e-6",
            "--trainer.total_steps=12",
            "--algorithm.dynamic_sampling=false",
            "--trainer.gen_prompts_per_batch=512",
            "--loss.clip_ratio_c=3",
            "--data.train_files=a.jsonl,b.parquet",
            "--rollout.engine=transformers",
        ],
    )
    assert c.actor.lr == 2e-6 and isinstance(c.actor.lr, float)
    assert c.trainer.total_steps == 12 and c.algorithm.dynamic_sampling is False
    assert c.loss.clip_ratio_c == 3.0 and isinstance(c.loss.clip_ratio_c, float)
    assert c.data.train_files == ["a.jsonl", "b.parquet"]
    assert load_config(None, ["--loss.clip_ratio_c=null"]).loss.clip_ratio_c is None


def test_override_wins_over_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("loss:\n  eps_high: 0.3\ntrainer:\n  total_steps: 5\n")
    c = load_config(f, ["--trainer.total_steps=9", "--loss.eps_low=0.1"])
    assert c.loss.eps_high == 0.3 and c.loss.eps_low == 0.1 and c.trainer.total_steps == 9


@pytest.mark.parametrize(
    "override,message",
    [
        ("--loss.eps_low=0", "loss.eps_low: must be in (0, 1)"),
        ("--loss.eps_low=1", "loss.eps_low: must be in (0, 1)"),
        ("--loss.eps_high=0.1", "loss.eps_high: must be >= eps_low"),
        ("--loss.clip_ratio_c=0.5", "loss.clip_ratio_c: must be in (1, 100] (or null), got 0.5"),
        ("--loss.loss_agg_mode=sum", "loss.loss_agg_mode: must be one of"),
        ("--algorithm.eps_high=0.3", "algorithm.eps_high moved to the policy loss's own section: write it as loss."),
        ("--loss.eps=0.2", "unknown key 'eps' in section [loss] of policy loss 'dapo'"),
        ("--algorithm.policy_loss=ppo2", "algorithm.policy_loss: must be one of"),
        ("--algorithm.group_size=1", "algorithm.group_size: must be in [2, 4096], got 1"),
        ("--algorithm.adv_eps=0", "algorithm.adv_eps: must be in (0, 1]"),
        (
            "--algorithm.max_gen_batches=-1",
            "algorithm.max_gen_batches: must be in [0, 10000] (0: no cap, with max_gen_minutes > 0), got -1",
        ),
        ("--algorithm.on_max_gen_batches=retry", "algorithm.on_max_gen_batches: must be one of"),
        ("--algorithm.overlong_buffer=0", "algorithm.overlong_buffer: must be in (0, 1048576], got 0"),
        ("--algorithm.overlong_buffer=20480", "algorithm.overlong_buffer: must satisfy 0 < overlong_buffer <"),
        ("--algorithm.overlong_penalty_factor=-1", "algorithm.overlong_penalty_factor"),
        ("--reward.answer_format=xml", "reward.answer_format: must be one of"),
        ("--rollout.engine=trt", "rollout.engine: must be one of"),
        ("--rollout.mode=server", "rollout.server_urls: must list at least one URL"),
        ("--rollout.mode=remote", "rollout.mode: must be one of"),
        ("--rollout.tensor_parallel=0", "rollout.tensor_parallel: must be in [1, 1024], got 0"),
        ("--rollout.max_response_length=0", "rollout.max_response_length: must be in [1, 1048576], got 0"),
        ("--rollout.temperature=0", "rollout.temperature: must be in [0.001, 10], got 0.0"),
        ("--rollout.top_p=1.5", "rollout.top_p: must be in (0, 1]"),
        ("--rollout.top_k=-1", "rollout.top_k: must be in [0, 1048576] (0: off), got -1"),
        ("--rollout.mem_fraction=1.0", "rollout.mem_fraction: must be in (0, 1)"),
        ("--rollout.weight_sync_bucket_mb=0", "rollout.weight_sync_bucket_mb: must be in [1, 65536], got 0"),
        ("--actor.tensor_parallel=0", "actor.tensor_parallel: must be in [1, 1024], got 0"),
        ("--actor.pipeline_parallel=0", "actor.pipeline_parallel: must be in [1, 1024], got 0"),
        ("--actor.dtype=fp8", "actor.dtype: must be one of"),
        ("--actor.lr=0", "actor.lr: must be in (0, 1]"),
        ("--actor.lr_warmup_steps=-1", "actor.lr_warmup_steps: must be in [0, 10000000], got -1"),
        ("--actor.weight_decay=-0.1", "actor.weight_decay: must be in [0, 1]"),
        ("--actor.adam_beta1=1", "actor.adam_beta1: must be in [0, 1)"),
        ("--actor.adam_beta2=1", "actor.adam_beta2: must be in [0, 1)"),
        ("--actor.grad_clip=-1", "actor.grad_clip: must be in [0, 1000000] (0: off), got -1.0"),
        ("--actor.logprob_impl=cuda", "actor.logprob_impl: must be one of"),
        ("--data.max_prompt_length=0", "data.max_prompt_length: must be in [1, 1048576], got 0"),
        ("--trainer.total_steps=0", "trainer.total_steps: must be in [1, 10000000], got 0"),
        ("--trainer.prompts_per_step=0", "trainer.prompts_per_step: must be in [1, 1048576], got 0"),
        ("--trainer.gen_prompts_per_batch=0", "trainer.gen_prompts_per_batch: must be in [1, 1048576], got 0"),
        ("--trainer.mini_batch_prompts=0", "trainer.mini_batch_prompts: must be in [1, 1048576], got 0"),
        ("--trainer.mini_batch_prompts=30", "trainer.mini_batch_prompts: 30 must divide trainer.prompts_per_step"),
        ("--trainer.micro_batch_size=0", "trainer.micro_batch_size: must be in [1, 1048576], got 0"),
        ("--trainer.micro_batch_size=7", "trainer.micro_batch_size: 7 must divide the responses per mini-batch"),
        ("--trainer.ppo_epochs=0", "trainer.ppo_epochs: must be in [1, 100], got 0"),
        ("--trainer.eval_every=-1", "trainer.eval_every: must be in [0, 10000000] (0: never), got -1"),
        ("--trainer.eval_samples=0", "trainer.eval_samples: must be in [1, 4096], got 0"),
        ("--trainer.eval_top_p=0", "trainer.eval_top_p: must be in (0, 1]"),
        ("--trainer.eval_temperature=0", "trainer.eval_temperature: must be in [0.001, 10], got 0.0"),
        ("--trainer.run_dir=", "trainer.run_dir: must not be empty"),
        ("--checkpoint.save_every=-1", "checkpoint.save_every: must be in [0, 10000000] (0: only at the end), got -1"),
        ("--checkpoint.keep_last=0", "checkpoint.keep_last: must be in [1, 10000], got 0"),
        ("--checkpoint.resume=", "checkpoint.resume"),
        ("--logging.console=html", "logging.console: must be one of"),
    ],
)
def test_validation_rules(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    text = str(err.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--algorithm.old_logp_source=critic"], "algorithm.old_logp_source: must be one of"),
        (["--trainer.max_staleness=-2"], "trainer.max_staleness: must be in [-1, 10000000] (-1: no bound), got -2"),
        (
            ["--trainer.max_staleness=2", "--rollout.partial=true"],
            "trainer.max_staleness: 2 lets tokens come from weights up to 2 updates old, an off-policy batch that "
            "needs algorithm.rollout_correction",
        ),
        (
            ["--algorithm.old_logp_source=engine", "--algorithm.rollout_correction=tis"],
            "algorithm.old_logp_source: 'engine' makes the engine's log-probs pi_old, so rollout_correction 'tis'",
        ),
        (
            ["--algorithm.old_logp_source=engine", "--rollout.compare_logprobs=false"],
            "algorithm.old_logp_source: 'engine' trains against the engine's log-probs: set rollout.compare_logprobs",
        ),
        (
            ["--algorithm.old_logp_source=engine", "--actor.routing_replay=r2", "--actor.shared_prefix=false"],
            "algorithm.old_logp_source: 'engine' skips the old-log-prob pass that actor.routing_replay r2 records",
        ),
        (["--rollout.engine_ranks=-1"], "rollout.engine_ranks: must be in [0, 1024] (0: colocated), got -1"),
        (
            ["--rollout.engine_ranks=1", "--rollout.engine=sglang", "--trainer.max_staleness=0"],
            'rollout.engine_ranks: splits the launch into actor and engine ranks for the engines "transformers", '
            "\"server sglang\"; not rollout.engine 'sglang' with mode 'colocated'",
        ),
        (
            [
                "--rollout.engine_ranks=2",
                "--rollout.engine=sglang",
                "--rollout.mode=server",
                "--trainer.eval_every=0",
                "--rollout.server_urls=http://127.0.0.1:30000",
                "--trainer.max_staleness=0",
            ],
            "rollout.engine_ranks: 2 engine ranks for 1 rollout.server_urls: each engine rank drives at least one",
        ),
        (
            [
                "--rollout.engine_ranks=1",
                "--rollout.engine=sglang",
                "--rollout.mode=server",
                "--trainer.eval_every=2",
                "--rollout.server_urls=http://127.0.0.1:30000",
                "--trainer.max_staleness=0",
            ],
            "trainer.eval_every: evaluation on a split launch over SGLang servers is not wired yet",
        ),
        (
            ["--rollout.engine_ranks=1", "--rollout.engine=transformers", "--trainer.eval_every=0"],
            "trainer.max_staleness: must bound how far the engine ranks run ahead when rollout.engine_ranks > 0",
        ),
    ],
)
def test_off_policy_settings_refusals(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert load_config(None, ["--algorithm.old_logp_source=engine"]).algorithm.old_logp_source == "engine"
    bounded = load_config(None, ["--trainer.max_staleness=2", "--algorithm.rollout_correction=tis"])
    assert bounded.trainer.max_staleness == 2 and load_config(None, ["--trainer.max_staleness=0"])


def test_shared_prefix_needs_packing():
    with pytest.raises(ConfigError, match="actor.shared_prefix: needs actor.packing=true"):
        load_config(None, ["--actor.shared_prefix=true", "--actor.packing=false"])
    assert load_config(None, ["--actor.shared_prefix=true"]).actor.shared_prefix


def test_dynamic_sampling_off_needs_a_full_generation_batch():
    with pytest.raises(ConfigError, match="trainer.gen_prompts_per_batch"):
        load_config(None, ["--algorithm.dynamic_sampling=false", "--trainer.gen_prompts_per_batch=8"])


@pytest.mark.parametrize(
    "text,message",
    [
        ("algorithm:\n  eps_lo: 0.1\n", "run.yaml: unknown key 'eps_lo' in section [algorithm]"),
        ("algorithms:\n  eps_low: 0.1\n", "run.yaml: unknown section 'algorithms'"),
        ("algorithm:\n  policy_loss: gspo\nloss:\n  clip_ratio_c: 3\n", "run.yaml: unknown key 'clip_ratio_c' in"),
        ("algorithm:\n  policy_loss: grpo\nloss:\n  kl_coef: 20\n", "run.yaml: loss.kl_coef: must be in [0, 10]"),
        ("actor:\n  lr: fast\n", "run.yaml: actor.lr: expected a number, got 'fast'"),
        ("trainer:\n  total_steps: 2.5\n", "run.yaml: trainer.total_steps: expected an integer"),
        ("algorithm:\n  dynamic_sampling: maybe\n", "run.yaml: algorithm.dynamic_sampling: expected a boolean"),
        ("data:\n  train_files: 3\n", "run.yaml: data.train_files: expected a list"),
        ("- a\n- b\n", "run.yaml: the top level must be a mapping"),
        ("algorithm: [1, 2]\n", "run.yaml: algorithm: a section must be a mapping"),
        ("loss:\n  eps_low: [\n", "run.yaml line"),
        ("loss:\n  eps_low: 0.5\n  eps_high: 0.3\n", "run.yaml: loss.eps_high: must be >= eps_low"),
    ],
)
def test_file_errors_name_file_section_and_key(tmp_path, text, message):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_file_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")
    for bad in ("actor.lr=1", "--actor.lr", "--lr=1"):
        with pytest.raises(ConfigError, match="expected --section.field=value"):
            parse_overrides([bad])
    with pytest.raises(ConfigError, match="unknown section 'optim'"):
        load_config(None, ["--optim.lr=1"])


def test_sections_are_slotted_dataclasses():
    for cls in SECTIONS.values():
        assert dataclasses.is_dataclass(cls) and hasattr(cls, "__slots__")
        with pytest.raises(TypeError):
            cls(1)  # keyword-only
