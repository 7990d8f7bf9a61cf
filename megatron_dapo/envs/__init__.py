"""Environments for multi-turn rollouts with tools (issue 40), and what they run.

    base.py        the interface: make_environment(name, ...).episode(truth).step(turn ids) -> Turn (observation
                   ids, or done with a reward and details); the registry; "single_turn", the verifier as one
    python_tool.py "python_tool": the model's Python tool calls run between turns, observations tokenised once with
                   the chat template's markers, budgets (turns, tool calls, tokens) that stop the episode
    sandbox.py     LocalSandbox: model-written Python in a fresh, contained process per call (namespaces, a policy
                   hook, resource limits, the caller's wall clock and output cap); RemoteSandbox: the same over HTTP
                   in SandboxFusion's run_code shape
    tool_calls.py  tool calls parsed from a model's turn (Hermes / Qwen <tool_call> JSON, fenced python blocks),
                   malformed ones answered with a one-line observation, the observation text of each outcome

Training: reward.environment chooses one; a multi-turn one is driven turn by turn by the rollout stream
(rollout/stream.py), its trajectories trained on token for token with the observation tokens masked
(docs/environments.md), carried mid-turn across steps with rollout.partial, evaluated the same way
(rollout/turns.py); megatron_dapo/trajectories.py writes readable samples.
"""
