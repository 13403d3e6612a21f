"""Structured outputs in the engine: every output of a random-weight model matches its
grammar (only the constraint can make noise valid), and greedy output equals transformers
masked by the same xgrammar matcher. Grammar rows in a batch: test_structured_batches.py;
JSON strings' lookaheads: test_string_follow.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from engine.structured.spec import GrammarSpec, build_grammar

N = 60  # samples per grammar, in one generate call

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1,
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "verified": {"type": "boolean"},
            },
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)"
CHOICES = ["red", "green", "blue", "dark purple", 'say "hi"']
EBNF = r"""
root ::= pair ("," pair){0,3}
pair ::= key "=" value
key ::= [a-z]{1,6}
value ::= [0-9]{1,4} | "true" | "false"
"""
EBNF_AS_REGEX = r"[a-z]{1,6}=([0-9]{1,4}|true|false)(,[a-z]{1,6}=([0-9]{1,4}|true|false)){0,3}"


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return LLM(tiny_gpt2_dir, device="cpu", max_num_seqs=64, num_kv_blocks=1024)


def sample(llm: LLM, spec: GrammarSpec, n: int = N, **kwargs) -> list:
    settings = dict(max_tokens=120, temperature=1.0) | kwargs
    params = [SamplingParams(seed=i, grammar=spec, **settings) for i in range(n)]
    prompts = ["Hello", "1 2 3", "def forward(self, x):", "Once upon a time"] * (n // 4 + 1)
    outs = llm.generate(prompts[:n], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_json_schema_outputs_validate(llm):
    outs = sample(llm, GrammarSpec.json_schema(SCHEMA))
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)  # strict json: no raw control chars
    assert len({o.text for o in outs}) > N // 2  # sampled, not one forced string


def test_json_object_outputs_parse(llm):
    outs = sample(llm, GrammarSpec("json_object"), max_tokens=200)
    done = [o.text for o in outs if o.finish_reason == "stop"]
    assert len(done) > N // 2
    for text in done:
        assert isinstance(json.loads(text), dict)
        # Whitespace is bounded: outside strings, only json.dumps's separators.
        bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text).replace(": ", ":").replace(", ", ",")
        assert not re.search(r"\s", bare), text


def test_regex_outputs_match(llm):
    for out in sample(llm, GrammarSpec("regex", REGEX)):
        assert out.finish_reason == "stop"
        assert re.fullmatch(REGEX, out.text), out.text


def test_choice_outputs_are_choices(llm):
    outs = sample(llm, GrammarSpec.choice(CHOICES))
    assert all(o.finish_reason == "stop" and o.text in CHOICES for o in outs)
    assert len({o.text for o in outs}) >= 3


def test_ebnf_outputs_match(llm):
    for out in sample(llm, GrammarSpec("grammar", EBNF)):
        assert out.finish_reason == "stop"
        assert re.fullmatch(EBNF_AS_REGEX, out.text), out.text


def test_every_choice_of_n_follows_the_grammar(llm):
    params = SamplingParams(n=4, seed=3, temperature=1.0, grammar=GrammarSpec.choice(CHOICES))
    (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in out.outputs)


def test_grammar_ends_the_request_even_with_ignore_eos(llm):
    (out,) = sample(llm, GrammarSpec.choice(["yes", "no"]), n=1, ignore_eos=True)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_invalid_specs_are_value_errors(llm):
    for spec, match in (
        (GrammarSpec("json", '{"type": "nonsense"}'), "invalid JSON schema"),
        (GrammarSpec("regex", "a(b"), "invalid regex"),
        (GrammarSpec("grammar", "root ::= missing"), "invalid EBNF grammar"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.generate("x", SamplingParams(grammar=spec), use_tqdm=False)
    with pytest.raises(ValueError, match="not valid JSON"):
        GrammarSpec.json_schema("{oops")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, grammar=GrammarSpec("json_object"))


def test_a_spec_seen_before_compiles_no_more(llm):
    spec = GrammarSpec("regex", "[0-9]{3}")
    sample(llm, spec, n=4)
    stats = llm.engine.grammars.stats
    compiled, hits = stats.num_compiled, stats.num_cache_hits
    sample(llm, spec, n=4)
    assert stats.num_compiled == compiled and stats.num_cache_hits == hits + 4


# ---------------------------------------------------------------- exactness


@dataclass
class Reference:
    """transformers' model of a checkpoint, and an xgrammar compiler for its tokenizer."""

    model: Any
    tokenizer: Any
    compiler: xgr.GrammarCompiler

    @classmethod
    def load(cls, model_dir: str) -> Reference:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = load_tokenizer(model_dir)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[tokenizer.eos_token_id]
        )
        return cls(model, tokenizer, xgr.GrammarCompiler(info))


def masked_greedy(ref: Reference, prompt_ids: list[int], spec: GrammarSpec, limit: int):
    """transformers' greedy continuation under the same xgrammar matcher."""
    model, tokenizer, compiler = ref.model, ref.tokenizer, ref.compiler
    vocab = model.config.vocab_size
    compiled = compiler.compile_grammar(build_grammar(spec))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < limit and not matcher.is_terminated():
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax(-1))
            assert matcher.accept_token(token)
            out.append(token)
            ids.append(token)
            if token == tokenizer.eos_token_id:
                break
    return out


@pytest.fixture(scope="module")
def llm_and_reference(tiny_model_dir) -> tuple[LLM, Reference]:
    return LLM(tiny_model_dir, device="cpu"), Reference.load(tiny_model_dir)


@pytest.mark.parametrize(
    "spec",
    [GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", REGEX), GrammarSpec("grammar", EBNF)],
    ids=["json", "regex", "ebnf"],
)
def test_greedy_equals_masked_transformers(llm_and_reference, spec):
    engine_llm, ref = llm_and_reference
    prompts = ["Hello", "The quick brown fox", "1 2 3 4 5"]
    params = SamplingParams(max_tokens=80, temperature=0.0, grammar=spec)
    outs = engine_llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want = masked_greedy(ref, ref.tokenizer.encode(prompt), spec, 80)
        assert out.outputs[0].token_ids == want
