from megatron_dapo.dev.simulate import SimConfig
from megatron_dapo.dev.simulate import format_table
from megatron_dapo.dev.simulate import simulate


def test_simulation_shows_sampling_cost_rising_at_both_ends():
    rows = simulate(
        SimConfig(
            steps=5,
            prompts_per_step=16,
            gen_prompts_per_batch=16,
            group_size=8,
            seed=3,
            skill_start=-4.0,
            skill_end=5.0,
        )
    )
    per_useful = [r["sampling/prompts_per_useful"] for r in rows]
    assert all(r["sampling/prompts_kept"] == 16 for r in rows)
    # The weak policy's batches are dominated by all-wrong groups, the strong policy's by all-correct ones.
    assert rows[0]["sampling/groups_all_wrong"] > rows[0]["sampling/groups_all_correct"]
    assert rows[-1]["sampling/groups_all_correct"] > rows[-1]["sampling/groups_all_wrong"]
    assert per_useful[0] > min(per_useful) and per_useful[-1] > min(per_useful)
    assert rows[-1]["train/acc"] > rows[0]["train/acc"]
    assert "per_useful" in format_table(rows)
