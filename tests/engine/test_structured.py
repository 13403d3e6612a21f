"""Structured outputs in the engine: every output of a random-weight model matches its
grammar (only the constraint can make noise valid), greedy output equals transformers
masked by the same xgrammar matcher, and grammar rows leave the rest of a batch alone."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from engine.structured import mask_worker
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


CACHED_STRING_SCHEMAS = {
    "bounded 0-6": {"type": "string", "minLength": 0, "maxLength": 6},
    "bounded 2-9": {"type": "string", "minLength": 2, "maxLength": 9},
    "bounded 3-3": {"type": "string", "minLength": 3, "maxLength": 3},
    "plain": {"type": "string"},
}
# A vocabulary whose tokens cross a string's end the ways real BPE vocabularies' do
# ('"]', '", "', '"},' ...), where a rule's lookahead decides what a mask allows.
CROSSING_VOCAB = [
    *(chr(c) for c in range(32, 127)),  # any JSON the schemas allow can be written
    *['"]', '",', '"}', '":', '", "', '": "', '"]}', '"},', '"}]', '"],', '""', '"",'],
    *["ab", "xyz", 'x"', 'ab"]', 'z",', '{"', '["', '[""', "\\n", '\\"', ', "', '" ', '"\n'],
    "</s>",
]


@pytest.fixture(scope="module")
def crossing_compiler() -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo(
        CROSSING_VOCAB, xgr.VocabType.RAW, stop_token_ids=[len(CROSSING_VOCAB) - 1]
    )
    return xgr.GrammarCompiler(info, cache_enabled=False)


def cached_string_walks(compiler, schema: dict, walks: int, steps: int = 200) -> list:
    """xgrammar's JSON grammar (JSON's own characters) and Pagoda's, compiled, after
    random walks on which their masks agreed at every step."""
    from engine.structured.spec import strict_characters

    spec = GrammarSpec.json_schema(schema)
    own = xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)
    pair = [build_grammar(spec), xgr.Grammar.from_ebnf(strict_characters(str(own)))]
    compiled = [compiler.compile_grammar(g) for g in pair]
    words = xgr.get_bitmask_shape(1, len(CROSSING_VOCAB))[1]
    rng = np.random.default_rng(0)
    crossed = 0  # tokens taken that close a string and go on past it
    for _ in range(walks):
        matchers = [xgr.GrammarMatcher(c) for c in compiled]
        for _ in range(steps):
            masks = [torch.zeros(1, words, dtype=torch.int32) for _ in matchers]
            for matcher, mask in zip(matchers, masks):
                matcher.fill_next_token_bitmask(mask)
            # Bits past the vocabulary are the fill's own: the engine sets those.
            bits = [np.unpackbits(m.numpy().view(np.uint8), bitorder="little") for m in masks]
            bits = [b[: len(CROSSING_VOCAB)] for b in bits]
            assert (bits[0] == bits[1]).all()
            pick = int(rng.choice(np.flatnonzero(bits[0])))
            assert [m.accept_token(pick) for m in matchers] == [True, True]
            crossed += len(CROSSING_VOCAB[pick]) > 1 and CROSSING_VOCAB[pick][0] == '"'
            if matchers[1].is_terminated():
                break
        assert matchers[0].is_terminated() == matchers[1].is_terminated()
    assert crossed
    return compiled


@pytest.mark.parametrize("name", CACHED_STRING_SCHEMAS)
@pytest.mark.parametrize("where", ["top level", "in an object", "in an array"])
def test_cached_strings_allow_what_xgrammar_does(crossing_compiler, name, where):
    """Pagoda's JSON strings (nothing but a separator, a bracket or a colon after one;
    an unbounded one as runs of characters, a length-bounded one as a chain of rules)
    give xgrammar's own masks at every step of random walks to the grammar's end,
    tokens that cross a string's end included, and both take strings of every allowed
    length and no other (the rewrite only makes the masks cheaper to fill)."""
    string = CACHED_STRING_SCHEMAS[name]
    schema, wrap = {
        "top level": (string, lambda s: s),
        "in an object": (
            {"type": "object", "properties": {"s": string, "n": {"type": "integer"}}},
            lambda s: {"s": s, "n": 1},
        ),
        "in an array": ({"type": "array", "items": string}, lambda s: [s, s]),
    }[where]
    text = str(build_grammar(GrammarSpec.json_schema(schema)))
    if name != "plain":
        assert "_left0" in text
    else:  # runs of characters between escapes
        assert re.search(r"^basic_string_sub ::= \(\(\[[^\n]*\]\* ", text, re.MULTILINE)
    compiled = cached_string_walks(crossing_compiler, schema, walks=8)
    lo, hi = string.get("minLength", 0), string.get("maxLength", 12)

    def accepted(length: int) -> list[bool]:
        text = json.dumps(wrap("x" * length), separators=(", ", ": "))
        matchers = [xgr.GrammarMatcher(c) for c in compiled]
        return [m.accept_string(text) and m.is_completed() for m in matchers]

    for length in range(lo, hi + 1):
        assert accepted(length) == [True, True], length
    if "maxLength" in string:
        assert accepted(hi + 1) == [False, False]
    if lo:
        assert accepted(lo - 1) == [False, False]


def test_strings_share_chains_within_a_budget_of_rules():
    """Strings of the same characters followed by the same characters share one chain
    whatever their bounds; past MAX_CHAIN_RULES (each rule costs the compiler a pass
    over the vocabulary) a string keeps xgrammar's repetition, with the whitespace-free
    lookahead all the same."""
    from engine.structured.spec import MAX_CHAIN_RULES

    def rules(*bounds: int) -> str:
        props = {f"f{i}": {"type": "string", "maxLength": n} for i, n in enumerate(bounds)}
        return str(build_grammar(GrammarSpec.json_schema({"type": "object", "properties": props})))

    def count(text: str) -> int:
        return len(re.findall(r"^\w+_characters_(left|must)\w* ::=", text, re.MULTILINE))

    # Optional properties: "," or "}" after f0 and f1, only "}" after the last.
    assert count(rules(8)) == 9  # left0 .. left8
    assert count(rules(3, 8, 3)) == 9 + 4  # f0 and f1 share one; f2 has left0 .. left3
    assert re.search(r'_left0 ::= \(\("\\""\)\) \(=\(\[,\}\]\)\)$', rules(8, 8, 3), re.M)
    full = MAX_CHAIN_RULES - 1
    assert count(rules(full)) == MAX_CHAIN_RULES
    over = rules(full, full + 1)  # one rule more than the budget: f1 keeps its repetition
    assert count(over) == MAX_CHAIN_RULES and f"{{0, {full + 1}}}" in over
    assert "(=([,}\\]:]))" in over and "[ \\n\\r\\t]*" not in over


def test_cached_strings_in_the_test_schema_and_json_objects(crossing_compiler):
    """The same agreement for the nested test schema, for any JSON object (its keys are
    strings followed by a colon), and for strings of several bounds on one chain."""
    cached_string_walks(crossing_compiler, SCHEMA, walks=8)
    cached_string_walks(crossing_compiler, {"type": "object"}, walks=8, steps=120)
    bounds = [(0, 3), (2, 4), (0, 2), (2, 4), (1, 1)]  # one shared chain, two must runs
    props = {
        f"f{i}": {"type": "string", "minLength": lo, "maxLength": hi}
        for i, (lo, hi) in enumerate(bounds)
    }
    shared = {"type": "object", "properties": props, "required": list(props)}
    assert str(build_grammar(GrammarSpec.json_schema(shared))).count("_left0 ::=") == 1
    cached_string_walks(crossing_compiler, shared, walks=8)


STRING = {"type": "string"}
# Unbounded strings where different characters follow them: before a required or an
# optional property, last in an object, in arrays (nested), as keys and values of free
# objects, in anyOf and oneOf, in a recursive definition, beside a string enum and a
# pattern.
FOLLOW_SCHEMAS = {
    "optional properties": {
        "type": "object",
        "properties": {"a": STRING, "b": STRING, "c": {"type": "integer"}, "d": STRING},
        "required": ["a"],
    },
    "nested arrays": {
        "type": "array",
        "items": {"type": "array", "items": STRING},
    },
    "records": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"k": {"enum": ["x", "y"]}, "v": STRING},
                    "required": ["k", "v"],
                    "additionalProperties": False,
                },
            },
            "extra": {"type": "object", "additionalProperties": STRING},
        },
        "required": ["rows", "extra"],
    },
    "any of": {
        "type": "array",
        "items": {"anyOf": [STRING, {"type": "integer"}, {"type": "object"}]},
    },
    "one of": {
        "type": "array",
        "items": {"oneOf": [{"type": "object", "properties": {"k": STRING}}, STRING]},
        "maxItems": 4,
    },
    "recursive": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "name": STRING,
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["name", "kids"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "pattern beside": {  # a pattern's string is a macro of xgrammar's EBNF
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[a-z]{2,4}$"}, "note": STRING},
        "required": ["id", "note"],
    },
}


@pytest.mark.parametrize("name", FOLLOW_SCHEMAS)
def test_strings_keep_only_what_may_follow_them(crossing_compiler, name):
    """Each unbounded string's lookahead holds only the characters that may follow it
    where it is; the masks agree with xgrammar's own at every step of random walks,
    tokens crossing a string's end included."""
    schema = FOLLOW_SCHEMAS[name]
    assert "basic_string_sub_n0 ::=" in str(build_grammar(GrammarSpec.json_schema(schema)))
    cached_string_walks(crossing_compiler, schema, walks=12, steps=150)


def test_string_lookaheads_are_the_follow_sets():
    """The characters a string's lookahead allows, by where the string is: a property
    before another (","), the last ("}"), either; an array item; a key (":")."""
    from engine.structured.string_follow import _lookahead, string_follows

    def lookaheads(schema: dict) -> dict[str, str]:
        text = str(build_grammar(GrammarSpec.json_schema(schema)))
        subs = dict(re.findall(r"^(basic_string_sub_n\d+) ::= .*\(=\((.*)\)\)$", text, re.M))
        uses = re.findall(r'"\\"(\w+)\\"" ": " (basic_string_n\d+)', text)
        return {prop: subs[wrapper.replace("string", "string_sub")] for prop, wrapper in uses}

    object_of = {"type": "object", "properties": {"a": STRING, "b": STRING, "c": STRING}}
    assert lookaheads({**object_of, "required": ["a", "b", "c"]}) == {
        "a": '","',
        "b": '","',
        "c": '"}"',
    }
    # Only for places the document reaches (xgrammar's basic_any is there unused).
    text = str(build_grammar(GrammarSpec.json_schema({**object_of, "required": ["a"]})))
    assert len(re.findall(r"^basic_string_sub_n\d+ ::=", text, re.M)) == 2
    assert lookaheads({**object_of, "required": ["a"]}) == {
        "a": "[,}]",
        "b": "[,}]",
        "c": '"}"',
    }
    keys = str(build_grammar(GrammarSpec("json_object")))
    key = re.search(r'basic_object ::= \(\("\{" basic_string_(n\d+) ": "', keys)[1]
    assert re.search(rf"^basic_string_sub_{key} ::= .*\(=\(\":\"\)\)$", keys, re.M)
    # Nothing it does not read is touched, nor a string that may end the document.
    assert string_follows("root ::= oops {", "x", "y") == ("root ::= oops {", {})
    top = str(build_grammar(GrammarSpec.json_schema(STRING)))
    assert re.search(r"^root ::= \(\(basic_string\)\)$", top, re.M)
    # Characters a class must escape stay themselves in the lookahead xgrammar reads.
    for chars in (frozenset('"]\\-^\n,'), frozenset("^}")):
        rule = xgr.Grammar.from_ebnf('root ::= "a"' + _lookahead(chars))
        assert str(rule).strip() == 'root ::= (("a"))' + _lookahead(chars)


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


# ---------------------------------------------------------------- batches


def test_mixed_batch_gives_each_request_its_tokens_alone(llm):
    prompts = ["Hello", "1 2 3", "Once upon a time", "def forward(self, x):"] * 3
    specs = [None, GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", REGEX), None] * 3
    params = [
        SamplingParams(max_tokens=40, temperature=0.0 if i % 3 == 0 else 1.0, seed=i, grammar=s)
        for i, s in enumerate(specs)
    ]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [
        llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params)
    ]
    assert together == alone


def test_a_requests_first_mask_is_filled_apart_and_the_rest_follow_its_ids(llm, monkeypatch):
    """Once a request sampled, the worker has its matcher accept each id and fills its
    next mask in one job for the batch: a separate fill happens only for each
    request's first mask (the outputs stay exact: the other structured tests)."""
    submit, accept_all = mask_worker.MaskWorker.submit, mask_worker.accept_all
    rows: dict[str, list[int]] = {"build": [], "follow": []}
    accepted = []

    def counting(self, owners, slots, ids, reset):
        rows[sys._getframe(1).f_code.co_name].extend(slots)
        submit(self, owners, slots, ids, reset)

    def accepting(handles, token_ids):
        accepted.extend(token_ids)
        return accept_all(handles, token_ids)

    monkeypatch.setattr(mask_worker.MaskWorker, "submit", counting)
    monkeypatch.setattr(mask_worker, "accept_all", accepting)
    spec = GrammarSpec("regex", "[a-z]{30}")
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=spec) for i in range(8)
    ]
    outs = llm.generate(["Hello"] * 8, params, use_tqdm=False)
    assert all(re.fullmatch("[a-z]{30}", o.outputs[0].text) for o in outs)
    assert len(rows["build"]) == 8  # each request's first mask
    # Every later one follows an id; the matchers accept each but the last (EOS, which
    # ends the grammar).
    assert len(rows["follow"]) == sum(len(o.outputs[0].token_ids) for o in outs)
    assert len(accepted) == sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert llm.tokenizer.eos_token_id not in accepted


def test_a_failure_on_the_masks_worker_fails_the_step(tiny_gpt2_dir, monkeypatch):
    """A fill that raises on the worker thread is raised by the engine's step, not lost
    (and nothing waits forever)."""
    from engine.structured.mask_worker import MaskWorker

    fill = MaskWorker.fill
    calls = []

    def failing(self, matchers, slots):
        calls.append(slots)
        if len(calls) == 3:
            raise RuntimeError("fill failed")
        fill(self, matchers, slots)

    monkeypatch.setattr(MaskWorker, "fill", failing)
    engine = LLM(tiny_gpt2_dir, device="cpu", max_num_seqs=8).engine
    params = SamplingParams(
        max_tokens=30, temperature=1.0, seed=0, grammar=GrammarSpec.choice(["a" * 40])
    )
    engine.add_request("r", [1, 2, 3], params)
    with pytest.raises(RuntimeError, match="fill failed"):
        for _ in range(10):
            engine.step()


def test_abort_mid_grammar_frees_everything(llm):
    engine = llm.engine
    spec = GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}})
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=0, grammar=spec)
    for i in range(4):
        engine.add_request(f"abort{i}", [1, 2, 3, i + 4], params)
    for _ in range(5):
        engine.step()
    assert any(r.structured.matcher is not None for rs in engine.requests.values() for r in rs)
    for i in range(4):
        engine.abort_request(f"abort{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests == {} and not engine.scheduler.running
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len(engine.batch.free_slots) == engine.config.max_num_seqs
    assert engine.batch.num_grammar == 0  # the batch's count of grammar rows
    assert not engine.grammars.waiting


def test_a_compiling_grammar_waits_while_others_run(llm, monkeypatch):
    engine = llm.engine
    grammars = engine.grammars
    pending: Future = Future()
    monkeypatch.setattr(grammars.pool, "submit", lambda fn, spec: pending)
    spec = GrammarSpec("regex", "[a-c]{4}")
    engine.add_request("slow", [1, 2, 3], SamplingParams(max_tokens=8, grammar=spec))
    engine.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    plain_done = False
    for _ in range(6):
        for out in engine.step():
            plain_done |= out.request_id == "plain" and out.finished
    assert plain_done  # ran to its end while the grammar compiled
    (slow,) = engine.requests["slow"]
    assert slow.num_computed_tokens == 0 and slow in engine.scheduler.waiting
    monkeypatch.undo()
    pending.set_result(grammars._compile(spec))
    text = ""
    while engine.has_unfinished_requests():
        text += "".join(out.new_text for out in engine.step())
    assert re.fullmatch("[a-c]{4}", text)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_failed_compile_ends_its_request(llm, monkeypatch):
    engine = llm.engine
    failed: Future = Future()
    failed.set_exception(RuntimeError("boom"))
    monkeypatch.setattr(engine.grammars.pool, "submit", lambda fn, spec: failed)
    engine.add_request("bad", [1, 2], SamplingParams(grammar=GrammarSpec("regex", "[x-z]{9}")))
    monkeypatch.undo()
    from engine.structured.grammars import GrammarError

    with pytest.raises(GrammarError) as info:
        engine.step()
    assert info.value.request_ids == ["bad"]
    engine.abort_request("bad")
    assert not engine.has_unfinished_requests()
    assert GrammarSpec("regex", "[x-z]{9}") not in engine.grammars.cache  # retried next time


def test_the_batch_mask_allows_eos_only_where_the_grammar_may_end(llm):
    from types import SimpleNamespace

    grammars = llm.engine.grammars
    tokenizer = llm.tokenizer
    eos = tokenizer.eos_token_id

    def row(spec: GrammarSpec | None, text: str = ""):
        state = None
        if spec is not None:
            state = grammars.state("unit", spec)
            state.compiled.result()
            assert state.ready()
            for token_id in tokenizer.encode(text):
                assert state.matcher.accept_token(token_id)
        return SimpleNamespace(structured=state, request_id="unit", is_finished=False)

    # Each call: new requests in the slots (numbered past any the engine's batch gave).
    generation = iter(range(10**9, 10**9 + 100))

    def mask(rows):
        grammar = np.array([r.structured is not None for r in rows])
        if not grammar.any():
            return None
        slots = np.arange(len(rows))
        generations = np.full_like(slots, next(generation))
        return grammars.masks.build(slots, generations, grammar, rows)

    rows = [row(GrammarSpec("regex", "ab+")), row(GrammarSpec("regex", "ab+"), "ab"), row(None)]
    assert rows[1].structured.matcher.accept_token(tokenizer.encode("b")[0])  # "abb": goes on
    logits = torch.zeros(3, llm.engine.vocab_size)
    mask(rows).apply(logits)
    allowed = logits > float("-inf")
    assert not allowed[0, eos] and allowed[1, eos]  # "" cannot end; "abb" can
    assert allowed[1, tokenizer.encode("b")[0]]
    assert allowed[0, tokenizer.encode("a")[0]] and not allowed[0, tokenizer.encode("b")[0]]
    assert allowed[2].all()  # no grammar: nothing masked
    assert mask([row(None)]) is None
    choice = row(GrammarSpec.choice(["ab"]), "ab")  # complete: only EOS may follow
    logits = torch.zeros(1, llm.engine.vocab_size)
    mask([choice]).apply(logits)
    assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [eos]

    def follow(rows, ids: list[int]) -> list[tuple[object, str]]:
        """The matchers' accept of a step's ids (the rows' last mask built just before)."""
        slots = np.arange(len(rows))
        every = np.ones(len(rows), dtype=bool)
        return grammars.masks.follow(slots, slots, every, np.array(ids)).completed(np.array(ids))

    assert follow([choice], [eos]) == [(choice, "stop")]
    assert choice.structured.done
    # An id the grammar refuses ends that request alone, as an abort: found by the
    # worker, and taken before the step's next ids are read.
    again = [row(GrammarSpec("regex", "ab+")), row(GrammarSpec("regex", "ab+"))]
    mask(again)
    a, z = tokenizer.encode("a")[0], tokenizer.encode("z")[0]
    assert follow(again, [z, a]) == []
    grammars.masks.worker.drain()
    assert grammars.masks.take_refused() == [(again[0], "abort")]
    assert again[0].structured.done and not again[1].structured.done
    assert grammars.masks.take_refused() == []
    # A refusal the engine thread has not taken yet when the next ids are handed over
    # (both wait for the same ids): the worker skips the ended row's void id itself.
    b = tokenizer.encode("b")[0]
    late = [row(GrammarSpec("regex", "ab+")), row(GrammarSpec("regex", "ab+"))]
    mask(late)
    slots, every = np.arange(2), np.ones(2, dtype=bool)
    for ids in ([z, a], [a, b]):
        ids = np.array(ids)
        assert grammars.masks.follow(slots, slots, every, ids).completed(ids) == []
    grammars.masks.worker.drain()
    assert grammars.masks.take_refused() == [(late[0], "abort")]
    assert not late[0].structured.matcher.accept_token(b)  # still at "": its "a" was skipped
    assert late[1].structured.matcher.accept_token(b)  # "abb": row 1 took both of its ids
    assert sys.getswitchinterval() <= mask_worker.SWITCH_INTERVAL_S  # lowered by the masks


def test_masks_filled_for_a_batch_are_each_rows_own(llm):
    """64 rows under different grammars, at different points: the masks the worker
    fills (over 4 threads), first and after the matchers accept a step's
    ids, are each matcher's own, and a row whose id ends its grammar ends as "stop"."""
    from types import SimpleNamespace

    from engine.structured.grammars import Grammars

    tokenizer = llm.tokenizer
    eos = tokenizer.eos_token_id
    vocab = llm.engine.vocab_size
    grammars = Grammars(tokenizer, vocab, [eos], 64, torch.device("cpu"), max_threads=4)
    masks = grammars.masks
    specs = [
        GrammarSpec.json_schema(SCHEMA),
        GrammarSpec("regex", REGEX),
        GrammarSpec.choice(CHOICES),
        GrammarSpec("grammar", EBNF),
    ]

    def own(matcher) -> np.ndarray:
        bits = torch.zeros(1, masks.words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(bits, 0)
        return bits[0].numpy()

    def allowed_ids(matcher, n: int) -> np.ndarray:
        return np.unpackbits(own(matcher).view(np.uint8), bitorder="little")[:n]

    rows = []
    for i in range(64):
        state = grammars.state(f"r{i}", specs[i % 4])
        state.compiled.result()
        assert state.ready()
        for _ in range(i % 7):  # up to i % 7 steps in: each its lowest allowed id but EOS
            allowed = np.flatnonzero(allowed_ids(state.matcher, len(tokenizer)))
            allowed = allowed[allowed != eos]
            if not len(allowed):
                break
            assert state.matcher.accept_token(int(allowed[0]))
        rows.append(SimpleNamespace(structured=state, request_id=f"r{i}", is_finished=False))
    done = xgr.GrammarMatcher(grammars._compile(GrammarSpec.choice(["red"])))
    for token_id in tokenizer.encode("red"):
        assert done.accept_token(token_id)
    rows[5].structured.matcher = done  # only EOS may follow: its id ends it

    slots = np.arange(64)
    generations = np.zeros(64, dtype=np.int64)
    grammar = np.ones(64, dtype=bool)
    first = masks.build(slots, generations, grammar, rows).bits().numpy()
    for i in range(64):
        assert (first[i, : masks.words] == own(rows[i].structured.matcher)).all(), i
    # Each row's lowest allowed id but EOS, if any (row 5: EOS); the matchers accept them.
    bits = np.unpackbits(first[:, : masks.words].view(np.uint8), axis=1, bitorder="little")
    ids = []
    for i in range(64):
        allowed = np.flatnonzero(bits[i, : len(tokenizer)])
        ids.append(allowed[allowed != eos][0] if (allowed != eos).any() else eos)
    stopped = [i for i in range(64) if ids[i] == eos]
    assert 5 in stopped
    ended = masks.follow(slots, generations, grammar, np.array(ids)).completed(np.array(ids))
    assert [(r.request_id, reason) for r, reason in ended] == [(f"r{i}", "stop") for i in stopped]
    second = masks.build(slots, generations, grammar, rows).bits().numpy()
    for i in range(64):
        if i in stopped:
            assert (second[i] == -1).all()  # its next id is void
        else:
            assert (second[i, : masks.words] == own(rows[i].structured.matcher)).all(), i
    assert 4 in masks.worker.batch_matchers  # the first fill went over four threads
    grammars.close()


def check_padding_masks(tokenizer, device: str, greedy: bool = False) -> None:
    """A model vocabulary padded past the tokenizer's (Qwen's 151936 rows for ~151k
    tokens): the matchers know the tokenizer's ids only, grammar rows mask the padding
    ids, and rows without a grammar keep them, also when a slot changes kind; in the
    mask applied to the logits and (greedy) in the masked argmax, which reads the rows
    by slot (a Triton kernel: on CUDA, or in Triton's interpreter)."""
    from types import SimpleNamespace

    from engine.structured.grammars import Grammars

    vocab = len(tokenizer) + 100
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id], 4, torch.device(device))
    masks = grammars.masks
    assert masks.words < masks.width
    a, b = tokenizer.encode("a")[0], tokenizer.encode("b")[0]

    def row(regex: str | None):
        if regex is None:
            return SimpleNamespace(structured=None, is_finished=False)
        state = grammars.state("unit", GrammarSpec("regex", regex))
        state.compiled.result()
        assert state.ready()
        return SimpleNamespace(structured=state, is_finished=False)

    def allowed(slots: list[int], rows, generation: int) -> torch.Tensor:
        logits = torch.zeros(len(rows), vocab, device=device)
        by_slot = [rows[slots.index(s)] for s in range(len(rows))]
        grammar = np.array([r.structured is not None for r in rows])
        slots = np.array(slots)
        generations = np.full_like(slots, generation)
        bitmask = masks.build(slots, generations, grammar, by_slot)
        if greedy:  # the padding ids' logits the largest
            scores = torch.randn(len(rows), vocab, device=device)
            scores[:, len(tokenizer) :] += 100
            applied = scores.clone()
            bitmask.apply(applied)
            assert torch.equal(masks.greedy(scores, slots, grammar), applied.argmax(-1))
        bitmask.apply(logits)
        return (logits > float("-inf")).cpu()

    # Rows in another order than their slots; slot 1 has a grammar, slot 0 not.
    first = allowed([1, 0], [row("[ab]+"), row(None)], 0)
    assert not first[0, len(tokenizer) :].any()
    assert first[0, a] and first[0, b] and first[0].sum() == 2
    assert first[1].all()
    # Each slot changes kind (new requests: a new generation): slot 0 now has a
    # grammar ("b"), slot 1 not.
    second = allowed([0, 1], [row("b"), row(None)], 1)
    assert not second[0, len(tokenizer) :].any()
    assert second[0, b] and second[0].sum() == 1
    assert second[1].all()
    # And back, in the first step's order again (its gather's slots kept on the device).
    third = allowed([1, 0], [row("a"), row(None)], 2)
    assert not third[0, len(tokenizer) :].any()
    assert third[0, a] and third[0].sum() == 1
    assert third[1].all()
    grammars.close()


def test_padding_ids_past_the_tokenizer_are_masked_in_grammar_rows_only(llm):
    check_padding_masks(llm.tokenizer, "cpu")


def test_preempted_grammar_requests_keep_their_matchers(tiny_gpt2_dir, monkeypatch):
    """Tight KV preempts running grammar rows, some with an id still on the device: their
    matchers accept it when it is read after they left, and every output still matches
    and equals the request's output alone (seeded)."""
    from engine.request import Request

    departed = []
    receive = Request.receive_departed

    def counting(self, token_id):
        if self.structured is not None:
            departed.append(token_id)
        receive(self, token_id)

    monkeypatch.setattr(Request, "receive_departed", counting)
    tight = LLM(tiny_gpt2_dir, device="cpu", block_size=4, num_kv_blocks=24, max_model_len=96)
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=i, grammar=GrammarSpec("regex", REGEX))
        for i in range(6)
    ]
    prompts = ["Hello", "1 2 3", "Once upon a time", "def forward(self, x):"] * 2
    outs = [o.outputs[0] for o in tight.generate(prompts[:6], params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0 and departed
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    roomy = LLM(tiny_gpt2_dir, device="cpu", block_size=4, max_model_len=96)
    alone = [roomy.generate(p, sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
