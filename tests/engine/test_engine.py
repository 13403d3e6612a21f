"""Engine behaviour beyond exactness: validation, aborts, leaks, loader errors, demo."""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checks import out_of_vocab
from engine.models.loader import ModelLoadError, load_model
from tests.introspection import is_frozen


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return LLM(tiny_gpt2_dir, device="cpu", max_model_len=64, block_size=4)


def test_prompt_longer_than_max_model_len_is_rejected_before_work(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate(["ok", [5] * 64], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not engine.has_unfinished_requests()  # the valid prompt was not started either


def test_max_tokens_past_max_model_len_is_rejected(llm):
    with pytest.raises(ValueError, match=r"requested 70 tokens \(10 in the prompt, 60"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=60), use_tqdm=False)


def test_out_of_vocabulary_prompt_is_rejected(llm):
    with pytest.raises(ValueError, match="1000000 is out of vocabulary"):
        llm.engine.check_request([10**6], SamplingParams())


def test_out_of_vocab_names_the_first_bad_id():
    assert out_of_vocab([0, 5, 9], 10) is None
    assert out_of_vocab([3, 10, -1], 10) == 10
    assert out_of_vocab([3, -1, 10], 10) == -1


def test_priority_scheduling_runs_requests_by_priority(llm, tiny_gpt2_dir):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="priority 1 needs priority scheduling"):
        llm.engine.check_request([1, 2], dataclasses.replace(params, priority=1))
    one = LLM(tiny_gpt2_dir, device="cpu", max_num_seqs=1, scheduling_policy="priority")
    engine = one.engine
    for name, priority in (("late", 2), ("first", -1), ("middle", 0), ("second", -1)):
        engine.add_request(name, [5, 6, 7], dataclasses.replace(params, priority=priority))
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["first", "second", "middle", "late"]

    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [1, 2, 3, 4, 5, 6, i + 7], params)
    engine.step()
    engine.step()
    engine.abort_request("r0")
    engine.abort_request("r3")
    engine.abort_request("missing")  # unknown ids are ignored
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.requests == {}


def test_aborted_request_gets_no_more_outputs(llm):
    engine = llm.engine
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
    engine.step()
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        assert all(o.request_id != "x" for o in engine.step())
    assert engine.step() == []


def test_latency_metrics_ride_on_the_first_and_last_outputs_only(llm):
    engine = llm.engine
    engine.add_request("m", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    with_tokens = [o for o in outs if o.new_token_ids]
    assert len(with_tokens) >= 3  # streamed: first, middle, last
    first, last = with_tokens[0], outs[-1]
    assert first.metrics.first_token_time >= first.metrics.first_scheduled_time
    assert last.finished and last.metrics.finished_time >= first.metrics.first_token_time
    assert all(o.metrics is None for o in with_tokens[1:-1])


def test_without_detokenize_outputs_carry_ids_and_no_text(llm):
    engine = llm.engine
    texts = {}
    for detokenize in (True, False):
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add_request(
            str(detokenize), [1, 2, 3], dataclasses.replace(params, detokenize=detokenize)
        )
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        texts[detokenize] = (
            [t for o in outs for t in o.new_token_ids],
            "".join(o.new_text for o in outs),
        )
    assert texts[False][0] == texts[True][0] and texts[True][1]
    assert texts[False][1] == ""
    with pytest.raises(ValueError, match="stop needs detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate(
        "Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    choice = out[0].outputs[0]
    assert len(choice.token_ids) == 5 and choice.finish_reason == "length"
    assert choice.text == llm.tokenizer.decode(choice.token_ids, skip_special_tokens=True)


def test_without_max_tokens_the_context_length_ends_it(llm):
    prompts = [[7] * 10, [7] * 63]  # 54 tokens to go; 1 (the prefill samples it)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        choice = out.outputs[0]
        assert len(prompt) + len(choice.token_ids) == 64 and choice.finish_reason == "length"


def test_unsupported_architecture_names_the_file(tmp_path, tiny_gpt2_dir):
    shutil.copytree(tiny_gpt2_dir, tmp_path / "m", dirs_exist_ok=True)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["model_type"] = "t5"
    config["architectures"] = ["T5ForConditionalGeneration"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json.*unsupported architecture 't5'"):
        load_model(str(tmp_path / "m"), torch.device("cpu"), torch.float32)


def test_broken_directories_are_explained(tmp_path, tiny_gpt2_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.device("cpu"), torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        load_model(str(tmp_path / "empty"), torch.device("cpu"), torch.float32)
    shutil.copytree(tiny_gpt2_dir, tmp_path / "noweights")
    for f in (tmp_path / "noweights").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(tmp_path / "noweights"), torch.device("cpu"), torch.float32)
    shutil.copytree(tiny_gpt2_dir, tmp_path / "sharded")
    index = {"weight_map": {"wte.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00001-of-00002.safetensors, which is missing"):
        load_model(str(tmp_path / "sharded"), torch.device("cpu"), torch.float32)


def test_a_broken_tokenizer_fails_the_engine_build_with_its_file_named(tmp_path, tiny_gpt2_dir):
    shutil.copytree(tiny_gpt2_dir, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        LLM(str(tmp_path / "m"), device="cpu", max_model_len=64)


def test_sharded_checkpoint_loads(tmp_path, tiny_llama_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours, _ = load_model(str(tmp_path / "sharded"), torch.device("cpu"), torch.float32)
    ref, _ = load_model(tiny_llama_dir, torch.device("cpu"), torch.float32)
    for (name, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_demo_model_is_built_and_served():
    llm = LLM(device="cpu", max_model_len=128)
    assert llm.engine.model_name == "pagoda-demo"
    out = llm.generate(
        "Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_llm_keeps_the_collector_off_its_startup_heap(tiny_gpt2_dir):
    gc.unfreeze()
    llm = LLM(tiny_gpt2_dir, device="cpu", max_model_len=64)
    assert is_frozen(llm.engine) and is_frozen(llm.engine.scheduler)
    # What a request allocates later is still collected.
    [out] = llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert not is_frozen(out)


def test_slots_reused_across_calls_and_preemption_give_same_outputs(tiny_gpt2_dir):
    # Request ids repeat across generate calls and preempted requests come back on
    # recycled slots: each must start from an empty block-table row.
    llm = LLM(tiny_gpt2_dir, device="cpu", block_size=4, num_kv_blocks=20, max_model_len=64)
    prompts = ["Hello", "The quick brown fox", "1 2 3 4 5", "Once upon a time"]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)]
    assert again == first[::-1]
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == first


def test_final_only_reports_once_with_everything_deltas_would_give(llm):
    engine = llm.engine
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True, stop=["zz"])
    engine.add_request("d", [7, 8, 9], SamplingParams(**params))
    engine.add_request("f", [7, 8, 9], SamplingParams(**params, final_only=True))
    outs: dict[str, list] = {"d": [], "f": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    (final,) = outs["f"]
    assert final.finished and len(outs["d"]) > 1
    assert final.new_token_ids == [t for o in outs["d"] for t in o.new_token_ids]
    assert final.new_text == "".join(o.new_text for o in outs["d"])
    assert final.finish_reason == outs["d"][-1].finish_reason == "length"


def test_deferred_outputs_report_the_same_news_once(llm):
    """step(emit=False) keeps the news; take_outputs() gives one output per choice with
    all of it, and a stop string still ends its request at the token it ends in."""
    engine = llm.engine
    probe = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=16, temperature=0.0), False)
    text = probe[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # ends the request midway
    prompts = {"plain": ([7, 8, 9], []), "stops": ([7, 8, 9], [stop]), "other": ([3, 4], [])}

    def run(emit: bool) -> dict[str, list]:
        outs: dict[str, list] = {rid: [] for rid in prompts}
        for rid, (prompt, stops) in prompts.items():
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=stops)
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step(emit=emit):
                outs[out.request_id].append(out)
        for out in engine.take_outputs():
            outs[out.request_id].append(out)
        return outs

    every_step, deferred = run(emit=True), run(emit=False)
    for rid in prompts:
        (once,) = deferred[rid]
        steps = every_step[rid]
        assert len(steps) > 1 and once.finished
        assert once.new_token_ids == [t for o in steps for t in o.new_token_ids]
        assert once.new_text == "".join(o.new_text for o in steps)
        assert (once.finish_reason, once.stop_reason) == (
            steps[-1].finish_reason,
            steps[-1].stop_reason,
        )
        assert once.num_output_tokens == steps[-1].num_output_tokens
    assert deferred["stops"][0].stop_reason == stop
    assert deferred["stops"][0].num_output_tokens < 16
    assert engine.take_outputs() == []


def test_stream_interval_sends_every_nth_token_with_the_first_and_last_at_once(llm):
    """The same tokens, text and ending as streaming every token, in deltas of
    1, N, N, ..., rest; a stop string still ends its request at the same token."""
    engine = llm.engine
    probe = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=11, temperature=0.0), False)
    text = probe[0].outputs[0].text
    stop = text[-3:-1]  # ends "stops" a token or two before its length limit
    cases = {"plain": [], "stops": [stop]}

    def run(interval: int) -> dict[str, list]:
        engine.config.stream_interval = interval
        outs: dict[str, list] = {rid: [] for rid in cases}
        try:
            for rid, stops in cases.items():
                params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, stop=stops)
                engine.add_request(rid, [7, 8, 9], params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outs[out.request_id].append(out)
        finally:
            engine.config.stream_interval = 1
        return outs

    every, fours = run(1), run(4)
    assert [len(o.new_token_ids) for o in every["plain"]] == [1] * 11
    assert [len(o.new_token_ids) for o in fours["plain"]] == [1, 4, 4, 2]
    for rid in cases:
        a, b = every[rid], fours[rid]
        assert [t for o in b for t in o.new_token_ids] == [t for o in a for t in o.new_token_ids]
        assert "".join(o.new_text for o in b) == "".join(o.new_text for o in a)
        assert [o.finished for o in b] == [False] * (len(b) - 1) + [True]
        assert (b[-1].finish_reason, b[-1].stop_reason) == (a[-1].finish_reason, a[-1].stop_reason)
    assert fours["stops"][-1].stop_reason == stop


def test_aborted_request_drops_its_untaken_news(llm):
    engine = llm.engine
    engine.add_request("gone", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("kept", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(4):
        engine.step(emit=False)
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        engine.step(emit=False)
    assert [out.request_id for out in engine.take_outputs()] == ["kept"]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("max_tokens", [5, 6, 7])
def test_a_follow_up_prompt_finds_every_computed_full_block(
    tiny_gpt2_dir, max_tokens, async_scheduling
):
    # A chat's next turn repeats the last answer: every block whose KV was computed
    # (all but the last sampled token) must be in the prefix cache, including one
    # that filled on the answer's final computed token (6 + 7 - 1 = 12).
    llm = LLM(
        tiny_gpt2_dir,
        device="cpu",
        block_size=4,
        max_model_len=64,
        async_scheduling=async_scheduling,
    )
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (first,) = llm.generate(prompt, params, use_tqdm=False)
    answer = first.outputs[0].token_ids
    (second,) = llm.generate(prompt + answer + [11, 12, 13, 14, 15], params, use_tqdm=False)
    computed = len(prompt) + max_tokens - 1
    assert second.num_cached_tokens == computed // 4 * 4


def test_a_running_request_shares_the_blocks_it_has_filled(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("long", [5, 6, 7, 8, 9, 10], params)
    a = engine.requests["long"][0]
    while len(a.output_token_ids) < 8:  # positions 0-11 computed: three full blocks
        engine.step()
    engine.add_request("b", a.all_token_ids[:12] + [11], SamplingParams(max_tokens=1))
    engine.step()
    assert engine.requests["b"][0].num_cached_tokens == 12
    while engine.has_unfinished_requests():
        engine.step()


def test_nvtx_ranges_wrap_the_phases_and_all_close(tiny_gpt2_dir, monkeypatch):
    """--nvtx (CUDA only: forced here, with the NVTX calls recorded) wraps the step's
    phases in ranges, every one closed, and changes no token."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    prompts = ["a b", "c d e"]
    llm = LLM(tiny_gpt2_dir, device="cpu", block_size=4)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    events: list[str] = []
    depth = [0]

    class Range:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            events.append(self.name)
            depth[0] += 1

        def __exit__(self, *exc):
            assert depth[0] > 0
            depth[0] -= 1

    monkeypatch.setattr(llm.engine, "_range", Range)
    monkeypatch.setattr(llm.engine.reader, "_range", Range)  # the step's read
    marked = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert marked == plain
    assert depth[0] == 0
    assert {"schedule", "forward", "sample", "read", "outputs"} <= set(events)


def test_startup_log_says_what_the_engine_chose(caplog):
    with caplog.at_level("INFO", logger="pagoda.engine"):
        llm = LLM(num_kv_blocks=64)
    lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.engine"]
    assert any(line.startswith("loading ") and " on cpu in float32" in line for line in lines)
    assert any(line.startswith("weights loaded: ") for line in lines)
    block_size = llm.engine.config.block_size
    kv = f"KV cache: 64 blocks of {block_size} tokens ({64 * block_size} tokens, "
    assert any(line.startswith(kv) for line in lines)
    assert lines[-1].startswith("engine ready in ")
