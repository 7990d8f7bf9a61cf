"""tools/experiments/compare_trl.py and tools/experiments/paper_ablations.py: every arm is a valid run of the main
job's config that differs from it exactly by the arm's switch; reports summarize synthetic metrics; the RSS sampler
sees a child's memory; and the TRL arm really trains with the pinned TRL (tiny model, one step) and logs the time
split and held-out accuracy."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.dev import experiments

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "examples" / "smollm2_arith_cpu.yaml"
TOOLS = ROOT / "tools" / "experiments"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare = _load("compare_trl")
ablations = _load("paper_ablations")


def _config_of(cmd: list[str]):
    return load_config(MAIN, [a for a in cmd if a.startswith("--")])


def test_ablation_arms_differ_from_the_main_job_by_their_switch_only(tmp_path):
    arms = ablations.ARMS
    configs = {}
    for arm, switches in arms.items():
        cmd = experiments.main_job_command(tmp_path / arm, 3, 11, switches)
        cfg = _config_of(cmd)
        assert cfg.trainer.total_steps == 3 and cfg.trainer.seed == 11 and cfg.trainer.eval_every == 3
        configs[arm] = cfg.to_dict()
    base = configs["ours"]

    def diff(arm: str) -> dict:
        changed = {(s, k): v for s, section in configs[arm].items() for k, v in section.items() if base[s][k] != v}
        return {key: v for key, v in changed.items() if key != ("trainer", "run_dir")}

    assert diff("ours_no_ds") == {("algorithm", "dynamic_sampling"): False}
    assert diff("seq_mean_token_mean") == {("loss", "loss_agg_mode"): "seq-mean-token-mean"}
    assert diff("clip_higher_4mb") == {("trainer", "mini_batch_prompts"): 2}
    assert diff("symmetric_4mb") == {("trainer", "mini_batch_prompts"): 2, ("loss", "clip_higher"): False}
    # compare_trl's arms of the same name are the same runs (same command), so either tool can reuse the other's
    for arm, switches in compare.OURS.items():
        assert tuple(switches) == ablations.ARMS[arm]


def test_useful_prompts_with_and_without_dynamic_sampling():
    with_ds = {"sampling/prompts_kept": 8.0, "sampling/prompts_sampled": 24.0, "sampling/groups_all_correct": 1.0,
               "sampling/groups_all_wrong": 15.0}  # fmt: skip
    without = {"sampling/prompts_kept": 8.0, "sampling/prompts_sampled": 8.0, "sampling/groups_all_correct": 1.0,
               "sampling/groups_all_wrong": 4.0}  # fmt: skip
    assert ablations.useful_prompts(with_ds) == 8.0
    assert ablations.useful_prompts(without) == 3.0
    assert ablations.useful_prompts({"reward/acc": 0.5}) is None


def _write(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_ablation_report_table_and_plots(tmp_path, capsys):
    for k, arm in enumerate(ablations.ARMS):
        rows = [{"step": 0, "eval/avg@4": 0.25}]
        rows += [
            {"step": s, "reward/acc": 0.1 * s + k, "actor/entropy": 0.2, "actor/clipfrac_high": 0.01 * k,
             "actor/clipfrac_low": 0.0, "actor/ratio_max": 1.0 + s, "response/length_mean": 20.0 + k,
             "sampling/prompts_kept": 8.0, "sampling/prompts_sampled": 8.0 + 8 * (arm == "ours"),
             "sampling/groups_all_correct": 0.0, "sampling/groups_all_wrong": 8.0 * (arm == "ours") + 2.0}
            for s in (1, 2)
        ]  # fmt: skip
        rows[-1]["eval/avg@4"] = 0.5
        _write(tmp_path / arm, rows)
    assert ablations.main(["report", "--out", str(tmp_path), "--img", str(tmp_path / "img")]) == 0
    text = capsys.readouterr().out
    assert "| ours | 2 | 0.200 | 0.0000 | 0.0000 | 3.00 | 8.0 | 16.0 |" in text
    assert "| ours_no_ds | 2 | 0.200 | 0.0100 | 0.0000 | 3.00 | 6.0 | 8.0 |" in text
    assert "eval/avg@4 0.250 -> 0.500" in text
    for name in ("clip_entropy", "clip_clipfrac_high", "dynamic_sampling_useful", "loss_agg_length"):
        assert (tmp_path / "img" / f"ablation_{name}.png").exists()


def test_compare_report_reads_runs_and_metrics(tmp_path, capsys):
    (tmp_path / "runs.json").write_text(json.dumps({"trl": {"peak_rss_gib": 3.5}, "ours": {"peak_rss_gib": 6.25}}))
    for arm in ("trl", "ours"):
        rows = [{"step": 0, "eval/avg@4": 0.3}]
        rows += [
            {"step": s, "reward/acc": 0.5, "time/step": 100.0 * s, "time/generate": 10.0 * s, "time/logprobs": 5.0,
             "time/update": 60.0, "perf/gen_tokens_per_s": 40.0}
            for s in (1, 2, 3)
        ]  # fmt: skip
        rows[-1]["eval/avg@4"] = 0.4
        _write(tmp_path / arm, rows)
    assert compare.main(["report", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| trl | 3 | 200 | 20 | 5 | 60 | nan | 40 | 3.50 | 0.500 | eval/avg@4 0.300 -> 0.400 |" in text
    assert "| ours | 3 | 200 |" in text and "6.25" in text


def test_rss_sampler_sees_the_child_processes_memory():
    # a child that holds ~400 MB for 1.5 s: the sampled peak of its process tree must see it
    code = "import time; x = bytearray(400 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(1.5)"
    result = compare.run_sampled([sys.executable, "-c", code], period_s=0.1)
    assert result["rc"] == 0
    assert 0.38 < result["peak_rss_gib"] < 0.6, result


def test_rss_sampler_counts_forked_copy_on_write_pages_once():
    # the parent touches 300 MB, then forks a child that keeps them (copy-on-write) for a while: the job holds ~300 MB,
    # a plain RSS sum would report ~600 MB
    code = (
        "import os, time; x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096]); pid = os.fork(); "
        "time.sleep(1.5); os._exit(0) if pid == 0 else os.waitpid(pid, 0)"
    )
    result = compare.run_sampled([sys.executable, "-c", code], period_s=0.1)
    assert result["rc"] == 0
    assert 0.28 < result["peak_rss_gib"] < 0.45, result


def test_dry_run_lists_every_arm(tmp_path, capsys):
    assert compare.main(["run", "--dry-run", "--steps", "2", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "_trl" in lines[0] and "--algorithm.dynamic_sampling=false" in lines[1]
    for line in lines[1:]:
        cfg = _config_of(line.split())
        assert cfg.trainer.total_steps == 2 and cfg.trainer.run_dir.startswith(str(tmp_path))


def test_trl_arm_trains_the_tiny_model(tmp_path):
    pytest.importorskip("trl", reason="TRL is pinned in the [test] and [bench] extras")
    from megatron_dapo.dev.tiny import make_tiny_run

    paths = make_tiny_run(tmp_path / "tiny", num_train=8, num_test=4)
    out = tmp_path / "trl"
    overrides = [
        f"--actor.model_path={paths['model']}",
        f"--data.train_files=[{paths['train']}]",
        f"--data.eval_files=[{paths['test']}]",
        "--trainer.prompts_per_step=2",
        "--trainer.gen_prompts_per_batch=2",
        "--trainer.mini_batch_prompts=1",
        "--trainer.micro_batch_size=4",
        "--algorithm.group_size=4",
        "--rollout.max_response_length=8",
        "--algorithm.overlong_buffer=4",
        "--trainer.eval_max_prompts=2",
        "--trainer.eval_samples=2",
    ]
    cmd = [sys.executable, str(TOOLS / "compare_trl.py"), "_trl", "--out", str(out), "--steps", "2"]
    proc = subprocess.run([*cmd, "--threads", "1", "--", *overrides], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 2]
    train = [r for r in rows if "time/step" in r]
    for r in train:
        assert r["time/generate"] > 0 and r["time/logprobs"] > 0 and r["time/update"] > 0  # the hooks ran
        assert r["time/generate"] + r["time/logprobs"] < r["time/step"]
        assert r["perf/gen_tokens_per_s"] > 0 and 1.0 <= r["response/length_mean"] <= 8.0
    # our warm-up (lr_warmup_steps 2 in the example config): updates at lr/2, lr, lr, lr (transformers' own
    # constant_with_warmup would start at 0)
    lr = load_config(MAIN).actor.lr
    assert train[0]["actor/lr"] == pytest.approx(0.75 * lr) and train[1]["actor/lr"] == pytest.approx(lr)
    assert "trl/clip_ratio/high_mean" in train[0]
    assert rows[0]["eval/num_prompts"] == 2.0 and rows[-1]["eval/num_prompts"] == 2.0
