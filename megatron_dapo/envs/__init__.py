"""Environments for multi-turn rollouts with tools (issue 40), and what they run.

    sandbox.py     LocalSandbox: model-written Python in a fresh, contained process per call (namespaces, a policy
                   hook, resource limits, the caller's wall clock and output cap); RemoteSandbox: the same over HTTP
                   in SandboxFusion's run_code shape
    tool_calls.py  tool calls parsed from a model's turn (Hermes / Qwen <tool_call> JSON, fenced python blocks),
                   malformed ones answered with a one-line observation, the observation text of each outcome

Not yet (issue 40): the environment interface and its registry, token-in / token-out multi-turn trajectories in the
engines and the stream, budgets, metrics and the viewer, the CPU experiment.
"""
