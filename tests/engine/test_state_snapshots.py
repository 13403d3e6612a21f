"""The prefix cache of models with recurrent layers (engine/state_snapshots.py): states
saved where a prompt's last full block ends, restored for a later prompt that starts
with it, token for token against transformers; off unless asked for."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from engine.request import Request
from engine.state_snapshots import StateSnapshots
from server.cli import parse_configs
from tests.reference import PROMPTS, hf_greedy

BLOCK = 4
MAX_NEW = 6


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt alone, in order: (its tokens, its cached prompt tokens)."""
    outs = []
    for ids in prompts:
        (out,) = llm.generate([{"prompt_token_ids": ids}], greedy(), use_tqdm=False)
        outs.append((out.outputs[0].token_ids, out.num_cached_tokens))
    return outs


def saved_at(ids: list[int]) -> int:
    """Where a prompt's state is saved: its last block boundary before its last token."""
    return (len(ids) - 1) // BLOCK * BLOCK


# Gated DeltaNet (conv + rule states) and Mamba-2 mixers (conv + SSM states) beside
# attention layers, and a model of mixers only (no KV cache).
@pytest.fixture(scope="module", params=["qwen3_5", "granitemoehybrid", "mamba2"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(kind, tiny_family_dir) -> str:
    return tiny_family_dir(kind)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    # Two sequences: two snapshot rows, so a third prompt evicts the oldest. A 16-token
    # budget chunks the longer prompts on top of the cut at their save points.
    return LLM(
        model_dir,
        device="cpu",
        block_size=BLOCK,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )


def test_a_prompt_and_its_next_turn_start_from_saved_states(llm, model_dir):
    tokenizer = load_tokenizer(model_dir)
    first = tokenizer.encode(PROMPTS[5])
    (answer, cached), *_ = run(llm, [first])
    assert cached == 0
    turn = first + answer + tokenizer.encode(" and then?")
    again, extended = run(llm, [first, turn])
    assert again == (answer, saved_at(first))
    assert extended[1] == saved_at(first)  # its first prompt's snapshot, no further
    assert answer == hf_greedy(model_dir, first, MAX_NEW)
    assert extended[0] == hf_greedy(model_dir, turn, MAX_NEW)
    # The next turn saved its own state: a third turn starts from there.
    (_, cached), *_ = run(llm, [turn + answer])
    assert cached == saved_at(turn)


def test_a_shared_prefix_saves_its_state_where_prompts_part(llm, model_dir):
    """The second prompt to share a system prompt finds its KV blocks but no saved
    states there: it saves them, and the third starts from them."""
    tokenizer = load_tokenizer(model_dir)
    system = tokenizer.encode(PROMPTS[4] + " " + PROMPTS[2])  # no other test's prompt
    tails = (" Tell me a story.", " Say it again, please.", " Why not, after all?")
    prompts = [system + tokenizer.encode(tail) for tail in tails]
    outs = run(llm, prompts)
    shared = len(system) // BLOCK * BLOCK
    assert [cached for _, cached in outs] == [0, 0, shared]
    assert [tokens for tokens, _ in outs] == [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]


def test_the_least_recently_used_snapshot_goes_first(llm, model_dir):
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(PROMPTS[i] + " once more") for i in (1, 3, 6)]
    assert all(saved_at(p) for p in prompts)
    run(llm, prompts)  # two rows: the third prompt's snapshot took the first's
    (first, cached_first), (last, cached_last) = run(llm, [prompts[0], prompts[2]])
    assert cached_first == 0 and cached_last == saved_at(prompts[2])
    assert first == hf_greedy(model_dir, prompts[0], MAX_NEW)
    assert last == hf_greedy(model_dir, prompts[2], MAX_NEW)


def test_requests_in_one_batch_share_a_prefix_they_saved_earlier(llm, model_dir):
    """Three requests at once from one cached prefix, beside each other's prefills."""
    tokenizer = load_tokenizer(model_dir)
    shared = tokenizer.encode(PROMPTS[3] + " and so")
    run(llm, [shared])
    prompts = [shared + tokenizer.encode(tail) for tail in (" on", " forth, and on", "!")]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    # The last one admitted may start further on, from another's snapshot.
    assert min(o.num_cached_tokens for o in outs) >= saved_at(shared)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(model_dir, p, MAX_NEW) for p in prompts
    ]


def test_recurrent_models_cache_prefixes_only_when_asked(tiny_family_dir):
    model_dir = tiny_family_dir("qwen3_5")
    default = LLM(model_dir, device="cpu", max_num_seqs=3).engine
    assert not default.config.enable_prefix_caching and default.scheduler.snapshots is None
    asked = LLM(model_dir, device="cpu", max_num_seqs=3, enable_prefix_caching=True).engine
    assert asked.config.state_snapshots == 3
    # Each state tensor: 3 slots, the spare row, 3 snapshot rows.
    assert {len(layer.conv_state) for layer in asked.runner.state_layers} == {7}
    engine, _ = parse_configs(["--model", model_dir, "--enable-prefix-caching"])
    assert engine.enable_prefix_caching is True
    engine, _ = parse_configs(["--model", model_dir, "--no-enable-prefix-caching"])
    assert engine.enable_prefix_caching is False


def request(ids: list[int]) -> Request:
    return Request("r", ids, greedy())


def test_chunks_are_cut_at_save_points_and_saves_registered_after_admissions():
    snaps = StateSnapshots(first_row=5, num_rows=1, block_size=BLOCK)
    a, b = request(list(range(11))), request(list(range(100, 109)))
    # a's last boundary before its last token, and where its cached KV would end.
    assert snaps.save_points(a, 0, 4) == [4, 8] and snaps.save_points(a, 8, 8) == []
    snaps.admit(a, 0, None, [8])
    snaps.admit(b, 1, None, snaps.save_points(b, 0, 0))
    num_new = np.array([11, 9])
    assert snaps.cut(np.array([0, 1]), np.array([0, 0]), num_new)
    assert num_new.tolist() == [8, 8]
    assert snaps.step(np.array([0]), np.array([6])) is None  # short of it: nothing yet
    copies = snaps.step(np.array([0, 1]), np.array([8, 8]))
    # One row: b's save takes it from a's, after a's (in that order on the stream).
    assert (copies.source, copies.target, copies.num_restores) == ([0, 1], [5, 5], 0)
    (key,) = snaps.rows
    snaps.admit(request(list(range(100, 112))), 0, key, [])
    copies = snaps.step(np.array([0]), np.array([9]))
    assert (copies.source, copies.target, copies.num_saves) == ([5], [0], 0)


def test_saving_a_prompt_again_makes_its_snapshot_the_most_recent():
    """Two rows: k1 then k2 saved; the same prompt as k1 saves again (no copy, a touch);
    a third prompt's save then takes k2's row, not k1's."""
    snaps = StateSnapshots(first_row=3, num_rows=2, block_size=BLOCK)
    prompts = [list(range(9)), list(range(50, 59)), list(range(9)), list(range(80, 89))]
    keys, rows = [], []
    for slot, ids in enumerate(prompts):
        snaps.admit(request(ids), slot % 2, None, [8])
        copies = snaps.step(np.array([slot % 2]), np.array([8]))
        rows.append(None if copies is None else copies.target[0])
        keys.append(next(reversed(snaps.rows)))
    assert rows == [3, 4, None, 4]  # the repeat copied nothing; the last took k2's row
    assert keys[0] in snaps.rows and keys[1] not in snaps.rows and keys[3] in snaps.rows
