"""Non-finite and absurd numbers in the config are one-line errors naming the field (issue 12, item 3).

Before: --actor.lr=.inf (and the other fields below) was accepted; the run wrote NaN/Inf weights and exited 0.
"""

from __future__ import annotations

import time

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.config import load_config

FLOAT_FIELDS = (
    "actor.lr",
    "actor.weight_decay",
    "actor.grad_clip",
    "actor.adam_beta1",
    "rollout.temperature",
    "rollout.top_p",
    "algorithm.overlong_penalty_factor",
    "algorithm.adv_eps",
    "algorithm.eps_high",
    "algorithm.eps_low",
    "trainer.eval_temperature",
    "reward.verify_timeout_s",
    "distributed.timeout_minutes",
)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_non_finite_number_is_rejected_naming_the_field(name, value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--{name}={value}"])
    message = str(err.value)
    assert f"{name}:" in message and "\n" not in message, message


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--actor.lr=1e30", "actor.lr: must be in (0, 1], got 1e+30"),
        ("--actor.weight_decay=1e30", "actor.weight_decay: must be in [0, 1]"),
        ("--algorithm.adv_eps=1e30", "algorithm.adv_eps: must be in (0, 1]"),
        ("--trainer.max_skipped_steps=-1", "trainer.max_skipped_steps: must be >= 0"),
        ("--distributed.timeout_minutes=0", "distributed.timeout_minutes: must be > 0"),
    ],
)
def test_absurd_values_are_rejected(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace("[", r"\[").replace("+", r"\+")):
        load_config(None, [override])


def test_new_fields_have_bounded_defaults():
    c = load_config(None, [])
    assert c.algorithm.max_gen_batches == 10 and c.trainer.max_skipped_steps == 10
    assert c.distributed.timeout_s == 1800.0
    assert load_config(None, ["--distributed.timeout_minutes=0.05"]).distributed.timeout_s == pytest.approx(3.0)


def test_python_yaml_tag_is_an_error_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    run = tmp_path / "run.yaml"
    run.write_text(f"actor:\n  lr: !!python/object/apply:os.makedirs ['{marker}']\n")
    with pytest.raises(ConfigError, match="run.yaml line 2: invalid YAML"):
        load_config(run)
    assert not marker.exists()


def test_billion_laughs_aliases_fail_fast(tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    run = tmp_path / "run.yaml"
    run.write_text("\n".join(lines) + "\n")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="unknown section 'a0'"):
        load_config(run)
    assert time.monotonic() - start < 5.0
