"""Non-finite and absurd numbers in the config are one-line errors naming the field (issue 12, item 3), and so are
absurd finite numbers, keys written twice and files that are not UTF-8 (issue 20).

Before: --actor.lr=.inf (and the other fields below) was accepted; the run wrote NaN/Inf weights and exited 0.
algorithm.overlong_penalty_factor=3e38 skipped every update and exited 0; reward.verify_timeout_s=1e30 scored every
non-integer answer wrong; trainer.seed=2**64 and rollout.temperature=1e-300 were tracebacks; a second `actor:`
section silently replaced the first; a Latin-1 file was a UnicodeDecodeError.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import typing

import numpy as np
import pytest

from megatron_dapo import cli
from megatron_dapo.config import FIELD_RANGES
from megatron_dapo.config import SECTIONS
from megatron_dapo.config import ConfigError
from megatron_dapo.config import RunConfig
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
    "loss.eps_high",
    "loss.eps_low",
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
        ("--trainer.max_skipped_steps=-1", "trainer.max_skipped_steps: must be in [0, 10000000] (0: never stop)"),
        ("--distributed.timeout_minutes=0", "distributed.timeout_minutes: must be in (0, 10080], got 0.0"),
        # Found by a probe (issue 20): each ran, and either did nothing useful or ended in a traceback.
        (
            "--algorithm.overlong_penalty_factor=3e38",
            "algorithm.overlong_penalty_factor: must be in [0, 100], got 3e+38",
        ),
        ("--algorithm.overlong_penalty_factor=1e300", "algorithm.overlong_penalty_factor: must be in [0, 100]"),
        ("--algorithm.rollout_is_threshold=1e300", "algorithm.rollout_is_threshold: must be in (0, 1000]"),
        ("--loss.clip_ratio_c=1e300", "loss.clip_ratio_c: must be in (1, 100] (or null)"),
        ("--reward.verify_timeout_s=1e30", "reward.verify_timeout_s: must be in (0, 3600], got 1e+30"),
        ("--trainer.seed=18446744073709551616", "trainer.seed: must be in [0, 2147483648), got 18446744073709551616"),
        ("--trainer.seed=-1", "trainer.seed: must be in [0, 2147483648), got -1"),
        ("--data.seed=-1", "data.seed: must be in [0, 2147483648), got -1"),
        ("--rollout.temperature=1e-300", "rollout.temperature: must be in [0.001, 10], got 1e-300"),
        ("--trainer.eval_temperature=1e-300", "trainer.eval_temperature: must be in [0.001, 10], got 1e-300"),
        ("--rollout.generation_timeout_minutes=1e30", "rollout.generation_timeout_minutes: must be in (0, 10080]"),
        ("--checkpoint.preempt_grace_s=1e30", "checkpoint.preempt_grace_s: must be in (0, 86400]"),
        ("--rollout.max_response_length=10000000000", "rollout.max_response_length: must be in [1, 1048576]"),
        ("--actor.lr=1" + "0" * 400, "actor.lr: must be a finite number"),  # float() of this int overflows
    ],
)
def test_absurd_values_are_rejected(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def _number_fields() -> list[tuple[str, type]]:
    """("section.field", int or float) for every int and float field of every section (float | None as float)."""
    out = []
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = {t for t in (hints[f.name], *typing.get_args(hints[f.name])) if t in (int, float)}
            if kinds:
                out.append((f"{name}.{f.name}", kinds.pop()))
    return out


def test_every_number_field_has_a_range_and_every_range_a_field():
    fields = dict(_number_fields())
    assert sorted(fields) == sorted(FIELD_RANGES)
    defaults = RunConfig()
    for key, allowed in FIELD_RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(defaults, section), name)
        assert value is None or value in allowed, (key, value)


def _beyond(value: int | float, kind: type, direction: int) -> int | float:
    return value + direction if kind is int else math.nextafter(float(value), direction * math.inf)


@pytest.mark.parametrize("key, kind", _number_fields(), ids=[key for key, _ in _number_fields()])
def test_each_range_end_is_enforced_on_its_section(key, kind):
    """Just past each end is refused naming the field and the range; a closed end itself passes the range check (a
    rule between fields may still refuse it)."""
    section, name = key.split(".")
    cls, allowed = SECTIONS[section], FIELD_RANGES[key]
    for end, direction, closed in ((allowed.lo, -1, allowed.ends[0] == "["), (allowed.hi, 1, allowed.ends[1] == "]")):
        outside = _beyond(end, kind, direction) if closed else kind(end)
        with pytest.raises(ConfigError) as err:
            cls(**{name: outside})
        assert str(err.value) == f"{key}: must be in {allowed}, got {outside}"
        if closed:
            try:
                cls(**{name: kind(end)})
            except ConfigError as other:
                assert not str(other).startswith(f"{key}: must be in"), other


def test_seed_bound_leaves_room_for_derived_seeds():
    """trainer.seed < 2**31: numpy (SGLang and vLLM seed it) needs < 2**32, and the seeds derived from it add
    offsets (megatron: seed + 2718 + tp_rank, seed + 1024 + 100 * ep_rank; evaluation: seed + rank)."""
    top = FIELD_RANGES["trainer.seed"].hi - 1
    assert load_config(None, [f"--trainer.seed={top}", f"--data.seed={top}"]).trainer.seed == top
    np.random.seed(top + 2718 + 1_000_000)
    np.random.default_rng([top, 1_000_000]).permutation(3)


def test_verify_timeout_at_its_bound_still_scores_off_the_main_thread():
    """1e30 overflowed the verifier's thread join, so every answer needing math-verify scored wrong; the top of
    the range works."""
    pytest.importorskip("math_verify")
    from megatron_dapo.reward import dapo_math

    verifier = dapo_math.Verifier.from_config(load_config(None, ["--reward.verify_timeout_s=3600"]).reward)
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(verifier("so\nAnswer: \\frac{1}{2}", "0.5")), daemon=True)
    worker.start()
    worker.join(60)
    assert out.get("acc") is True, out


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


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "actor:\n  tensor_parallel: 2\n  dtype: fp32\nrollout:\n  temperature: 0.7\nactor:\n  lr: 2.0e-6\n",
            "run.yaml line 6: duplicate section 'actor' (first at line 1)",
        ),
        (
            "trainer:\n  total_steps: 5\nactor:\n  lr: 1.0e-6\n  dtype: fp32\n  lr: 2.0e-6\n",
            "run.yaml line 6: duplicate key 'lr' in section [actor] (first at line 4)",
        ),
        (
            'actor:\n  lr: 1.0e-6\n  "lr": 2.0e-6\n',
            "run.yaml line 3: duplicate key 'lr' in section [actor] (first at line 2)",
        ),
        (
            "actor: {lr: 1.0e-6, lr: 2.0e-6}\n",
            "run.yaml line 1: duplicate key 'lr' in section [actor] (first at line 1)",
        ),
    ],
    ids=["section", "key", "quoted-key", "flow-mapping"],
)
def test_duplicate_sections_and_keys_are_one_line_naming_both(tmp_path, text, expected):
    run = tmp_path / "run.yaml"
    run.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(run)
    assert str(err.value) == f"{tmp_path}/{expected}"


def test_the_same_key_in_two_sections_is_not_a_duplicate(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("actor:\n  tensor_parallel: 2\nrollout:\n  tensor_parallel: 4\n")
    c = load_config(run)
    assert (c.actor.tensor_parallel, c.rollout.tensor_parallel) == (2, 4)


def test_billion_laughs_of_mappings_fail_fast(tmp_path):
    """Keys are checked as each mapping is composed, once per node: aliases are not expanded."""
    lines = ["m0: &m0 {" + ", ".join(f"k{j}: lol" for j in range(9)) + "}"]
    lines += [f"m{i}: &m{i} {{{', '.join(f'k{j}: *m{i - 1}' for j in range(9))}}}" for i in range(1, 10)]
    run = tmp_path / "run.yaml"
    run.write_text("\n".join(lines) + "\n")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="unknown section 'm0'"):
        load_config(run)
    assert time.monotonic() - start < 5.0


def test_non_utf8_file_is_one_line_naming_the_file_and_byte(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_bytes("trainer:\n  run_dir: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_config(run)
    assert str(err.value) == f"{run}: not valid UTF-8 (byte 0xe9 at offset 23)"
    assert cli.main(["check", "--config", str(run)]) == 2
    assert capsys.readouterr().err == f"error: {run}: not valid UTF-8 (byte 0xe9 at offset 23)\n"
