"""Grammar rows in a batch: each request gets its tokens as if alone, masks are each
row's own and allow EOS only where the grammar may end, and compiles, failures, aborts
and preemptions leave the rest of the batch alone."""

from __future__ import annotations

import re
import sys
from concurrent.futures import Future

import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.structured import mask_worker
from engine.structured.spec import GrammarSpec
from tests.engine.test_structured import CHOICES, EBNF, REGEX, SCHEMA


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return LLM(tiny_gpt2_dir, device="cpu", max_num_seqs=64, num_kv_blocks=1024)


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
