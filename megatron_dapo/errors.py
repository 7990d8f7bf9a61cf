"""Errors that end a running job with one line (the CLI prints `error: <message>` once and every rank exits 2)."""

from __future__ import annotations

import sys


def rank_notice(line: str) -> None:
    """A one-line notice on this rank's stderr, as every part of a job prints them (start-up and resume decisions,
    a dead engine, a preemption)."""
    print(f"[megatron_dapo] {line}", file=sys.stderr, flush=True)


def first_line(err: BaseException, limit: int = 200) -> str:
    """What a one-line error quotes of another library's exception: its first line, at most `limit` characters (its
    type's name when it has no text)."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


class JobError(RuntimeError):
    """A condition found while training that ends the job; the message is one line naming what and why.

    report_rank: the rank that prints it (the lowest rank that found it and is still alive; 0 by default).
    retryable: whether restarting the job from its last checkpoint can help (a stalled or dead peer, a failed write:
    yes; a condition of the data or config that a restart meets again: no, the default); megatron_dapo/restarts.py.
    """

    def __init__(self, message: str, report_rank: int = 0, retryable: bool = False) -> None:
        super().__init__(message)
        self.report_rank = report_rank
        self.retryable = retryable
