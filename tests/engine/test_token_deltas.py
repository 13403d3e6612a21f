"""TokenDeltas: with columns to fill, the engine reports a plain stream's news as
list entries. Rebuilt with `follow` from each choice's previous output,
every step's outputs must be the ones the engine builds without columns, on a mix of
requests where much of the news may not go in columns (text, logprobs, final-only,
first and last outputs, an abort), with steps that do not emit, after which an
entry holds several tokens; and again with too few KV blocks for them all, so that
requests are preempted, some with their first id still on the device."""

from __future__ import annotations

import dataclasses

from engine import LLM, SamplingParams
from engine.request import RequestOutput, TokenDeltas, follow

PLANS = [
    ([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True, detokenize=False)),
    ([9] * 7, SamplingParams(max_tokens=25, temperature=0.0, detokenize=False)),  # may hit EOS
    ([3, 1, 4], SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=3, detokenize=False)),
    ([2, 7, 1], SamplingParams(max_tokens=18, ignore_eos=True)),  # text
    ([8, 8], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1, detokenize=False)),
    ([4] * 5, SamplingParams(max_tokens=22, ignore_eos=True, final_only=True, detokenize=False)),
    ([6, 5, 4], SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False)),  # aborted
]


def fields(out: RequestOutput) -> tuple:
    """What must agree (the metrics hold times: only whether they come along)."""
    return dataclasses.astuple(dataclasses.replace(out, metrics=None)) + (out.metrics is None,)


def run(
    model_dir: str, columns: bool, num_kv_blocks: int | None = None
) -> tuple[list[list[tuple]], list[int], int]:
    """Every step's outputs (rebuilt from columns when asked), each column entry's
    number of tokens, and the preemptions."""
    llm = LLM(
        model_dir,
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        num_kv_blocks=num_kv_blocks,
        block_size=4,
    )
    engine = llm.engine
    plans = list(PLANS)
    last: dict[tuple[str, int], RequestOutput] = {}
    steps, entries, step = [], [], 0
    while plans or engine.has_unfinished_requests():
        if plans and step % 3 == 0:
            engine.add_request(f"r{step}", *plans.pop(0))
        if step == 25:
            engine.abort_request("r18")
        emit = step % 7 != 4  # a step without emitting: the next news is two tokens
        deltas = TokenDeltas() if columns else None
        outputs = engine.step(emit=emit, deltas=deltas)
        for out in outputs:
            last[out.request_id, out.index] = out
        rebuilt = []
        for rid, index, token_ids in (deltas or TokenDeltas()).entries():
            out = last[rid, index] = follow(last[rid, index], token_ids)
            rebuilt.append(out)
        entries += [len(out.new_token_ids) for out in rebuilt]
        steps.append(sorted(map(fields, outputs + rebuilt), key=lambda f: (f[0], f[1])))
        step += 1
        assert step < 500
    return steps, entries, engine.scheduler.num_preemptions


def test_columns_rebuild_to_the_outputs_the_engine_builds(tiny_gpt2_dir):
    expected, none, _ = run(tiny_gpt2_dir, columns=False)
    got, entries, _ = run(tiny_gpt2_dir, columns=True)
    assert not none
    assert len(entries) >= 50 and entries.count(2) >= 5  # after steps that did not emit
    assert got == expected


def test_columns_rebuild_the_same_outputs_across_preemptions(tiny_gpt2_dir):
    expected, _, preemptions = run(tiny_gpt2_dir, columns=False, num_kv_blocks=14)
    got, entries, _ = run(tiny_gpt2_dir, columns=True, num_kv_blocks=14)
    assert preemptions >= 3 and len(entries) >= 50
    assert got == expected


def scripted(model_dir: str, columns: bool, add_at: int) -> tuple[list[tuple], int]:
    """a decodes alone in four KV blocks; b arrives before step add_at. Every output
    (rebuilt from columns when asked), and the preemptions."""
    llm = LLM(model_dir, device="cpu", max_num_seqs=4, num_kv_blocks=4, block_size=4)
    engine = llm.engine
    params = SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False)
    engine.add_request("a", [5, 6, 7], params)
    last, got, step = {}, [], 0
    while engine.has_unfinished_requests() or step <= add_at:
        if step == add_at:
            engine.add_request("b", [1, 2, 3], params)
        deltas = TokenDeltas() if columns else None
        for out in engine.step(deltas=deltas):
            last[out.request_id, out.index] = out
            got.append(fields(out))
        for rid, index, token_ids in (deltas or TokenDeltas()).entries():
            out = last[rid, index] = follow(last[rid, index], token_ids)
            got.append(fields(out))
        step += 1
    return got, engine.scheduler.num_preemptions


def test_a_first_id_read_after_its_request_was_preempted_comes_as_an_output(tiny_gpt2_dir):
    # Four blocks of four: b takes the last one as a's third fills, and is preempted
    # at once for a's fourth, its first id still on the device.
    expected, preemptions = scripted(tiny_gpt2_dir, columns=False, add_at=9)
    got, _ = scripted(tiny_gpt2_dir, columns=True, add_at=9)  # no KeyError: an output came first
    assert preemptions == 1
    assert got == expected
