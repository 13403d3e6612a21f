"""Pagoda's JSON strings (engine/structured/string_follow.py): each string's lookahead
holds only what may follow it, and the grammars' masks equal xgrammar's own at every step
of random walks, over a vocabulary whose tokens cross a string's end as real BPE ones do."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine.structured.spec import GrammarSpec, build_grammar
from tests.engine.test_structured import SCHEMA

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
