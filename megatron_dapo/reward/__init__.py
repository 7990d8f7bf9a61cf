"""Rule-based reward: DAPO math answer extraction and scoring. See dapo_math.py for the exact rules."""

from megatron_dapo.reward.dapo_math import ANSWER_FORMATS
from megatron_dapo.reward.dapo_math import TAIL_CHARS
from megatron_dapo.reward.dapo_math import Verifier
from megatron_dapo.reward.dapo_math import compute_score
from megatron_dapo.reward.dapo_math import extract_answer
from megatron_dapo.reward.dapo_math import make_verifier
from megatron_dapo.reward.dapo_math import parse_integer

__all__ = [
    "ANSWER_FORMATS",
    "TAIL_CHARS",
    "Verifier",
    "compute_score",
    "extract_answer",
    "make_verifier",
    "parse_integer",
]
