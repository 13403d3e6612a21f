"""The official openai SDK against the live server: completions and chat, both ways."""

from __future__ import annotations

import pytest

from tests.reference import hf_greedy

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_models_lists_the_served_model(oai, model_name):
    models = oai.models.list()
    assert [m.id for m in models.data] == [model_name]


def test_completion(oai, model_name):
    out = oai.completions.create(model=model_name, prompt="Hello", max_tokens=5, **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == model_name
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5


def test_greedy_completion_equals_transformers(oai, model_name, tiny_gpt2_dir, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog."
    out = oai.completions.create(model=model_name, prompt=prompt, max_tokens=12, **GREEDY)
    want = hf_greedy(tiny_gpt2_dir, tokenizer.encode(prompt), 12)
    assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def test_greedy_chat_equals_transformers(oai, model_name, tiny_gpt2_dir, tokenizer):
    messages = [{"role": "user", "content": "Tell me a story."}]
    out = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=10, **GREEDY)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = hf_greedy(tiny_gpt2_dir, tokenizer.encode(text, add_special_tokens=False), 10)
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_text_equals_non_streamed(oai, model_name, kind):
    if kind == "completion":
        kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=16, **GREEDY)
        whole = oai.completions.create(**kwargs).choices[0].text
        chunks = list(oai.completions.create(stream=True, **kwargs))
        streamed = "".join(c.choices[0].text for c in chunks)
    else:
        messages = [{"role": "user", "content": "Hi there"}]
        kwargs = dict(model=model_name, messages=messages, max_tokens=16, **GREEDY)
        whole = oai.chat.completions.create(**kwargs).choices[0].message.content
        chunks = list(oai.chat.completions.create(stream=True, **kwargs))
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole and whole
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices(oai, model_name):
    out = oai.completions.create(model=model_name, prompt="Hello", n=2, max_tokens=4, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 8
    chat = oai.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_streamed_n_choices_each_finish(oai, model_name):
    chunks = list(
        oai.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Hi"}],
            n=2,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(finished) == [0, 1] and sorted(roles) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_list_prompts_and_token_id_prompts(oai, model_name, tokenizer):
    prompts = ["Hello", "def forward(self, x):"]
    texts = oai.completions.create(model=model_name, prompt=prompts, max_tokens=6, **GREEDY)
    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = oai.completions.create(model=model_name, prompt=ids, max_tokens=6, **GREEDY)
    single = oai.completions.create(model=model_name, prompt=ids[1], max_tokens=6, **GREEDY)
    assert [c.index for c in texts.choices] == [0, 1]
    assert [c.text for c in texts.choices] == [c.text for c in by_ids.choices]
    assert single.choices[0].text == texts.choices[1].text
    assert texts.usage.prompt_tokens == sum(len(i) for i in ids)


def test_list_prompts_with_n_number_choices_prompt_major(oai, model_name):
    out = oai.completions.create(model=model_name, prompt=["a", "b"], n=2, max_tokens=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


def test_seed_reproducibility(oai, model_name):
    kwargs = dict(model=model_name, prompt="Hello", max_tokens=12, temperature=1.0)
    a = oai.completions.create(seed=1234, **kwargs).choices[0].text
    b = oai.completions.create(seed=1234, **kwargs).choices[0].text
    c = oai.completions.create(seed=99, **kwargs).choices[0].text
    assert a == b
    assert a != c  # 12 tokens at temperature 1 on a 512-token vocabulary


def test_echo(oai, model_name):
    out = oai.completions.create(model=model_name, prompt="Hello", echo=True, max_tokens=3)
    assert out.choices[0].text.startswith("Hello")


def test_completion_logprobs(oai, model_name):
    out = oai.completions.create(model=model_name, prompt="Hello", max_tokens=4, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # vLLM's legacy format: the sampled token's entry, then the 3 most likely.
    assert all(len(top) <= 4 for top in lp.top_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(v <= 0 for v in lp.token_logprobs)


def test_chat_logprobs(oai, model_name):
    out = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].token == token.token  # greedy takes the top token
        assert token.bytes == list(token.token.encode())


def test_max_completion_tokens(oai, model_name):
    out = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_vllm_extras_accepted(oai, model_name, tokenizer):
    stop_id = tokenizer.encode(" the")[0]
    out = oai.completions.create(
        model=model_name,
        prompt="Hello",
        max_tokens=8,
        extra_body=dict(
            top_k=5,
            min_p=0.01,
            repetition_penalty=1.1,
            min_tokens=2,
            ignore_eos=True,
            stop_token_ids=[stop_id],
            include_stop_str_in_output=True,
            skip_special_tokens=False,
        ),
    )
    assert out.usage.completion_tokens >= 2
