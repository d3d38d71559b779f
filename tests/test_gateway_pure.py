"""The gateway's request schema and text stream, without a running system."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from noderuntime.gateway.schema import ChatCompletionRequest, CompletionRequest
from noderuntime.gateway.textstream import TextStream

MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_stop_string_that_starts_first_wins_whatever_its_place_in_the_list() -> None:
    text = TextStream(["\n\n", "."])
    assert text.push(b"Hi") == "Hi"
    assert text.push(b".\n\nmore") == ""
    assert text.stopped and text.text == "Hi"


def test_a_possible_stop_string_is_held_back_until_it_is_clear() -> None:
    text = TextStream(["END"])
    assert text.push(b"abc E") == "abc "
    assert text.push(b"N") == ""
    assert text.push(b"x") == "ENx"
    assert text.push(b" EN") == " "
    assert text.push(b"D tail") == "" and text.stopped and text.text == "abc ENx "


@pytest.mark.parametrize(
    "options",
    [
        {"response_format": {"type": "text"}},
        {"tool_choice": "none"},
        {"tool_choice": "auto"},
        {"logprobs": False, "top_logprobs": 0},
        {"stream": None},
        {"top_p": 0},
        {"tools": []},
        {"modalities": ["text"]},
    ],
)
def test_unsupported_options_at_their_defaults_are_accepted(options: dict[str, Any]) -> None:
    ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **options})


def test_legacy_completion_defaults_are_accepted() -> None:
    CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 1, "suffix": "", "echo": False})


@pytest.mark.parametrize(
    "options",
    [
        {"response_format": {"type": "json_object"}},
        {"tool_choice": "required"},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"logprobs": True},
        {"best_of": 2},
        {"suffix": "}"},
        {"stop": [True]},
        {"top_p": -0.1},
    ],
)
def test_options_this_gateway_does_not_implement_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **options})
