"""LLM.chat (vLLM's offline chat): conversations through the chat template, the same
ids generate() would take from the rendered text; a template, tools and template
options passed on; what the server refuses is a ValueError."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, device="cpu", num_kv_blocks=256)


def rendered_ids(llm: LLM, conversation: list[dict], **options) -> list[int]:
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, **options)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_a_conversation_is_generated_from_its_templates_ids(llm):
    want = rendered_ids(llm, HELLO, add_generation_prompt=True)
    (out,) = llm.chat(HELLO, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == want
    (plain,) = llm.generate(want, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 6


def test_several_conversations_answer_in_order(llm):
    other = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a list "}, {"type": "text", "text": "of parts"}],
        }
    ]
    outs = llm.chat([HELLO, other, HELLO], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        rendered_ids(llm, HELLO, add_generation_prompt=True),
        rendered_ids(
            llm, [{"role": "user", "content": "a list of parts"}], add_generation_prompt=True
        ),
        rendered_ids(llm, HELLO, add_generation_prompt=True),
    ]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_a_template_tools_and_options_reach_the_template(llm):
    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{{ suffix }}"
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    (out,) = llm.chat(
        HELLO, GREEDY, use_tqdm=False, chat_template=template, tools=[tool],
        chat_template_kwargs={"suffix": "!"},
    )  # fmt: skip
    text = "[get_weather]<system>be brief<user>hello there<assistant>!"
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    answer = [*HELLO, {"role": "assistant", "content": "Hi"}]
    (out,) = llm.chat(
        answer, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert out.prompt_token_ids == rendered_ids(llm, answer, continue_final_message=True)


@pytest.mark.parametrize(
    "messages, kwargs, message",
    [
        (HELLO, {"continue_final_message": True}, "cannot both be true"),
        ([{"role": "robot", "content": "hi"}], {}, "role"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
            {},
            "takes text content parts only",
        ),
    ],
)
def test_what_the_server_refuses_is_a_value_error(llm, messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_vllms_dict_prompts(llm):
    ids = llm.tokenizer.encode("hello there")
    want = llm.generate("hello there", GREEDY, use_tqdm=False)[0]
    by_text, by_ids = llm.generate(
        [{"prompt": "hello there"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
    )
    assert by_text.prompt == "hello there" and by_ids.prompt is None
    for out in (by_text, by_ids):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    for bad, message in [
        ({"prompt": "a", "prompt_token_ids": ids}, "holds prompt or prompt_token_ids"),
        ({"text": "a"}, "holds prompt or prompt_token_ids"),
        ({"prompt": "a", "multi_modal_data": {"image": object()}}, "reads no images"),
        ({"prompt": "a", "multi_modal_data": {"audio": object()}}, "images only"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, GREEDY, use_tqdm=False)
