"""Environments for multi-turn rollouts with tools (issue 40), and what they run.

sandbox.py   LocalSandbox: model-written Python in a fresh, contained process per call (namespaces, a policy
             hook, resource limits, the caller's wall clock and output cap)
"""
