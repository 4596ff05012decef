"""Stop strings on a real tokenizer (SmolLM2): speculative runs stop exactly where plain ones do."""

from __future__ import annotations

import pytest

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.drafters import NgramDrafter
from drafter.model.loading import encode_prompt, load_model


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_stop_string_cuts_text_and_matches_plain(smollm2):
    engine = Engine(smollm2.model, smollm2.tokenizer)
    prompt = encode_prompt(smollm2.tokenizer, "Count from 1 to 30, separated by commas.")
    free = engine.generate([Request(prompt, SamplingParams(max_new_tokens=48))])[0]
    stop = free.text[len(free.text) // 2 :][:3]  # a string the policy does produce, mid-answer
    assert stop.strip(), free.text
    params = SamplingParams(max_new_tokens=48, stop_strings=(stop,))
    plain = engine.generate([Request(prompt, params)])[0]
    spec = engine.generate([Request(prompt, params)], k=4, drafter=NgramDrafter())[0]
    assert plain.finish_reason == "stop"
    assert stop not in plain.text and free.text.startswith(plain.text)
    assert plain.token_ids == free.token_ids[: len(plain.token_ids)]
    # the last token is the one that completed the stop string
    assert stop in smollm2.tokenizer.decode(plain.token_ids)
    assert stop not in smollm2.tokenizer.decode(plain.token_ids[:-1])
    assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)


def test_chat_eos_stops_generation(smollm2):
    engine = Engine(smollm2.model, smollm2.tokenizer)
    out = engine.generate([Request(encode_prompt(smollm2.tokenizer, "What is the capital of France?"),
                                   SamplingParams(max_new_tokens=64))], k=2, drafter=NgramDrafter())[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm2.model.cfg.eos_token_ids
    assert "Paris" in out.text
