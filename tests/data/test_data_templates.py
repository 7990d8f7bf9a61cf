import pytest

from megatron_dapo.data.templates import DAPO_TEMPLATE
from megatron_dapo.data.templates import TEMPLATES
from megatron_dapo.data.templates import Shot
from megatron_dapo.data.templates import get_template
from megatron_dapo.data.templates import render_prompt


def test_registry_names_and_keys_match():
    assert set(TEMPLATES) == {"dapo", "plain", "few_shot", "few_shot_compact", "boxed"}
    for name, tmpl in TEMPLATES.items():
        assert tmpl.name == name


def test_dapo_wording_is_the_paper_format():
    msgs = render_prompt("dapo", "What is 2 + 3?")
    assert msgs == [
        {
            "role": "user",
            "content": "Solve the following math problem step by step. The last line of your response should be of "
            "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
            'What is 2 + 3?\n\nRemember to put your answer on its own line after "Answer:".',
        }
    ]
    assert render_prompt("dapo", "q") == render_prompt("dapo", "q", [Shot("x", "1")])  # zero-shot ignores shots


def test_plain_and_boxed():
    assert render_prompt("plain", "What is 2 + 3?") == [{"role": "user", "content": "What is 2 + 3?"}]
    boxed = render_prompt("boxed", "What is 2 + 3?")[0]["content"]
    assert "\\boxed{}" in boxed and boxed.endswith("What is 2 + 3?")


def test_few_shot_chat_turns():
    shots = [Shot("1 + 1 =", "2", "1 + 1 = 2"), Shot("2 + 2 =", "4", "")]
    msgs = render_prompt("few_shot", "3 + 3 =", shots)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[0]["content"] == DAPO_TEMPLATE.format(question="1 + 1 =")
    assert msgs[1]["content"] == "1 + 1 = 2\nAnswer: 2"
    assert msgs[3]["content"] == "Answer: 4"
    assert msgs[-1]["content"] == DAPO_TEMPLATE.format(question="3 + 3 =")
    assert get_template("few_shot").num_shots > 0
    with pytest.raises(ValueError, match="few_shot"):
        render_prompt("few_shot", "3 + 3 =")


def test_unknown_template_lists_known():
    with pytest.raises(ValueError, match=r"unknown prompt template 'cot'.*dapo"):
        get_template("cot")
