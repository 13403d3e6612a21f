"""Structured outputs' cost: a batch under one JSON schema vs the same batch unconstrained.

    python -m benchmarks.structured --out benchmarks/results/structured-h100.json

For each model (GPT-2 124M and the Qwen2.5-0.5B shape, random weights): 64
requests decode `--output-len` tokens each, greedy, once with no constraint and
once all under one JSON schema (a long array of small objects, so that no
request completes its JSON before max_tokens and both runs decode the same
tokens at the same batch size). Reported: both throughputs and their ratio (also
with the mask filled by other numbers of threads, `--fill-threads`), the time
per step the engine thread spends building the mask and the masks' worker in its
xgrammar calls, accepting the ids and filling the mask (`--host-wait`: the engine
thread waits for the worker before the sampler is queued, instead of the device),
the first structured request's costs (the grammars' setup: tokenizer info and the
mask kernels, once per engine; then the schema's compile), and the same schema sent
again, which must compile nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.provenance import provenance, write_result
from engine import LLM, SamplingParams
from engine.structured import mask_worker
from engine.structured.mask_worker import accept_all
from engine.structured.spec import GrammarSpec


def records(fields: dict, **closed) -> dict:
    """An object holding exactly 200 records with `fields`, all required (so that a
    constrained request runs to max_tokens); closed: additionalProperties=False."""
    record = {"type": "object", "properties": fields, "required": list(fields), **closed}
    people = {"type": "array", "minItems": 200, "maxItems": 200, "items": record}
    return {"type": "object", "properties": {"people": people}, "required": ["people"], **closed}


# Records with string length bounds. Inside a bounded string xgrammar's mask takes
# far longer to fill than elsewhere.
BOUNDED = records(
    {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    additionalProperties=False,
)
# Records without length bounds: a typical extraction schema.
PLAIN = records(
    {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
    }
)
SCHEMAS = {"bounded": BOUNDED, "plain": PLAIN}


def decode(llm: LLM, batch: int, output_len: int, grammar: GrammarSpec | None) -> dict:
    """Time `batch` greedy requests of `output_len` tokens each (all end at their length)."""
    engine = llm.engine
    params = SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True, final_only=True, grammar=grammar
    )
    prompt = llm.tokenizer.encode("Write the list as JSON:")
    grammars = engine._grammars
    timed = {}
    if grammars is not None:  # the engine thread's share (build), and the worker's calls
        masks = grammars.masks
        timed = {"build": [0.0, 0], "fill": [0.0, 0], "accept_all": [0.0, 0]}
        masks.build = _timed(masks.build, timed["build"])
        masks.worker.fill = _timed(masks.worker.fill, timed["fill"])
        mask_worker.accept_all = _timed(accept_all, timed["accept_all"])
    _sync(llm)
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    total = time.perf_counter() - start
    if timed:
        del masks.build, masks.worker.fill
        mask_worker.accept_all = accept_all
    tokens = sum(out.num_output_tokens for out in finished)
    assert tokens == batch * output_len, (tokens, batch * output_len)
    assert all(out.finish_reason == "length" for out in finished)
    result = {"total_s": total, "output_tokens": tokens, "tok_per_s": tokens / total}
    if timed and timed["build"][1]:
        steps = timed["build"][1]
        result["mask_build_ms_per_step"] = 1e3 * timed["build"][0] / steps  # engine thread
        # The worker's xgrammar calls: accepting the ids and filling the masks.
        worker_s = timed["accept_all"][0] + timed["fill"][0]
        result["mask_job_ms_per_step"] = 1e3 * worker_s / steps
        result["mask_device_wait"] = masks.worker.flag is not None
    return result


def _timed(method, total: list):
    """method, adding its seconds and calls to total."""

    def run(*args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            total[0] += time.perf_counter() - start
            total[1] += 1

    return run


def _sync(llm: LLM) -> None:
    if llm.engine.config.torch_device.type == "cuda":
        torch.cuda.synchronize()


def compile_costs(llm: LLM, schema: dict) -> dict:
    """The first structured request's costs, then the same schema again."""
    engine = llm.engine
    start = time.perf_counter()
    grammars = engine.grammars  # built with the first structured request
    grammars_init_s = time.perf_counter() - start  # tokenizer info, mask kernel compiled
    spec = GrammarSpec.json_schema(schema)
    params = SamplingParams(max_tokens=1, temperature=0.0, grammar=spec)
    prompt = llm.tokenizer.encode("Hello")
    costs = {"grammars_init_s": grammars_init_s}
    for name in ("first", "again"):
        compiled = grammars.stats.num_compiled
        start = time.perf_counter()
        engine.add_request(name, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        costs[name] = {
            "first_token_s": time.perf_counter() - start,  # compile included, if any
            "compiled": grammars.stats.num_compiled - compiled,
        }
        if name == "first":
            costs["first"]["compile_s"] = grammars.stats.last_compile_s
    assert costs["again"]["compiled"] == 0, "a schema seen before compiled again"
    return costs


def run_model(name: str, args) -> dict:
    if args.host_wait:  # the engine thread waits for the masks, as on a device without
        mask_worker.DeviceFlag.create = staticmethod(lambda device: None)
    dtype = "float16" if name == "gpt2" else "bfloat16"
    if args.device == "cpu":
        dtype = "float32"
    model_dir = checkpoint_dir(name, dtype)
    llm = LLM(
        model_dir,
        device=args.device,
        dtype=dtype,
        enable_prefix_caching=False,
        max_num_seqs=args.batch,
        max_model_len=args.output_len + 64,
    )
    result: dict = {"model": name, "dtype": dtype}
    schema = SCHEMAS[args.schema]
    result["compile"] = compile_costs(llm, schema)
    spec = GrammarSpec.json_schema(schema)
    grammars = llm.engine.grammars
    # The mask fill's threads: the engine's choice, and each count asked for.
    threads = {"json_schema": (grammars.masks.worker.threads, mask_worker.ROWS_PER_THREAD)}
    for n in args.fill_threads:
        threads[f"json_schema_fill_threads_{n}"] = (n, 1)
    # Warm up both paths (Triton kernels compile at their first shapes).
    decode(llm, args.batch, 16, None)
    decode(llm, args.batch, 16, spec)
    runs: dict[str, list[dict]] = {key: [] for key in ["none", *threads]}
    for _ in range(args.repeats):  # alternated, so drift hits all alike
        runs["none"].append(decode(llm, args.batch, args.output_len, None))
        for key, (n, rows_per_thread) in threads.items():
            grammars.masks.worker.threads, mask_worker.ROWS_PER_THREAD = n, rows_per_thread
            runs[key].append(decode(llm, args.batch, args.output_len, spec))
    grammars.masks.worker.threads, mask_worker.ROWS_PER_THREAD = threads["json_schema"]
    for key, values in runs.items():
        best = max(values, key=lambda r: r["tok_per_s"])
        result[key] = best | {"tok_per_s_runs": [r["tok_per_s"] for r in values]}
        if key != "none":
            result[key]["throughput_ratio"] = best["tok_per_s"] / result["none"]["tok_per_s"]
    result["throughput_ratio"] = result["json_schema"]["throughput_ratio"]
    result["decode_paths"] = dict(llm.engine.runner.steps_by_path)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["gpt2", "qwen2-0.5b"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--fill-threads",
        type=int,
        nargs="*",
        default=[1],
        metavar="N",
        help="also time the mask fill with N threads (the engine's default: one per 16 "
        "rows, at most half the cores and 8)",
    )
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="bounded")
    p.add_argument(
        "--host-wait",
        action="store_true",
        help="no device-side wait for the masks: the engine thread waits for the worker",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = p.parse_args(argv)
    result = {
        **provenance("structured", argv),
        "gpu": torch.cuda.get_device_name() if args.device != "cpu" else None,
        "torch": torch.__version__,
        "batch": args.batch,
        "output_len": args.output_len,
        "schema": SCHEMAS[args.schema],
        "host_wait": args.host_wait,
        "models": [run_model(name, args) for name in args.models],
    }
    print(json.dumps(result, indent=2))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
