"""TokenDeltas: with columns to fill, the engine reports a plain stream's one-token
news as three list entries. Rebuilt with `follow` from each choice's previous output,
every step's outputs must be the ones the engine builds without columns, on a mix of
requests where most news may not go in columns (text, logprobs, final-only, first and
last outputs, several tokens after steps without emitting, an abort)."""

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


def run(model_dir: str, columns: bool) -> tuple[list[list[tuple]], int]:
    """Every step's outputs (rebuilt from columns when asked), and the column entries."""
    llm = LLM(model_dir, device="cpu", max_num_seqs=4, max_num_batched_tokens=16)
    engine = llm.engine
    plans = list(PLANS)
    last: dict[tuple[str, int], RequestOutput] = {}
    steps, num_entries, step = [], 0, 0
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
        for rid, index, token_id in zip(*dataclasses.astuple(deltas or TokenDeltas())):
            out = last[rid, index] = follow(last[rid, index], token_id)
            rebuilt.append(out)
        num_entries += len(rebuilt)
        steps.append(sorted(map(fields, outputs + rebuilt), key=lambda f: (f[0], f[1])))
        step += 1
        assert step < 500
    return steps, num_entries


def test_columns_rebuild_to_the_outputs_the_engine_builds(tiny_gpt2_dir):
    expected, none = run(tiny_gpt2_dir, columns=False)
    got, num_entries = run(tiny_gpt2_dir, columns=True)
    assert none == 0
    assert num_entries >= 60  # most of the plain streams' tokens went in columns
    assert got == expected
