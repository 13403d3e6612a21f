"""The host's work in a steady decode step, on any machine: the forward is stubbed out.

    python -m benchmarks.host_step            # batch 64, the demo model, on the CPU
    python -m benchmarks.host_step --batch 128 --repeats 9
    python -m benchmarks.host_step --batch 256 --stream [--no-detokenize]

What the engine does in Python around each forward (schedule, write the step's
metadata, sample, read the ids and apply stops) costs the same whatever the
model, so it can be measured without a GPU: the forward returns a zero logits
tensor, everything else is the real engine. Figures hold for the machine
they were taken on; compare commits side by side in one run. On CUDA the
copies, graph replay and sampler launch add their own host time: see
`benchmarks.offline --profile`.

`--stream` makes the requests stream as a server's do (an output per request
every step, phase "outputs"); `--no-detokenize` sends ids without text, as
the engine process does for requests the API process decodes; `--report`
also sends each step's outputs the way the engine process reports them to an
API process (`Clients.report`, pickled down a pipe that a thread drains:
phase "report"), and has the engine put one-token outputs of id-only streams
in columns (TokenDeltas) as the engine process does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from benchmarks.offline import _timed, start_decoding
from engine import LLM, SamplingParams
from engine.request import TokenDeltas
from server.engine_loop import Add
from server.engine_process import Clients

PHASES = ["schedule", "fill", "execute", "sample", "process", "outputs", "report"]


def stub_forward(engine) -> None:
    """Replace the engine's forward with fixed logits (every row picks the token for
    "a", so a stream shows text); the runner still writes and copies each step's
    metadata, as before a graph replay."""
    runner = engine.runner
    logits = torch.zeros(runner.max_num_seqs, engine.vocab_size, device=runner.device)
    logits[:, engine.tokenizer.encode("a")[-1]] = 1.0

    def execute(step_batch, on_device=False):  # the runner's work without the model
        runner._fill(step_batch, on_device)
        runner._copy()
        return logits[: len(step_batch.sampling())]  # the sampling rows, as the runner returns

    runner.execute = execute


class _Loop:
    """What Clients.report asks of the engine loop: every request still active."""

    def __init__(self, request_ids: list[str]) -> None:
        self.active = dict.fromkeys(request_ids, 1)

    def is_active(self, request_id: str) -> bool:  # the name before 57c21db (for A/B runs)
        return request_id in self.active

    def stop(self) -> None:
        pass


def reporter(
    engine, params: SamplingParams
) -> tuple[Callable[[list, TokenDeltas], None], Callable[[], None]]:
    """A report function for each step's outputs, as the engine process sends them to
    one API process, and a function that closes its pipe."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    clients = Clients([writer], [multiprocessing.RawValue("b", 1)])
    clients.own(0, [Add(rid, [], params, 0.0) for rid in engine.requests])
    loop = _Loop(list(engine.requests))

    def drain() -> None:
        try:
            while True:
                reader.recv_bytes()
        except (EOFError, OSError):
            pass

    threading.Thread(target=drain, daemon=True).start()

    def report(outputs: list, deltas: TokenDeltas) -> None:
        batch: dict[str, list] = {}
        for out in outputs:  # grouped by request, as EngineLoop._step does
            batch.setdefault(out.request_id, []).append(out)
        clients.report(loop, batch, deltas, time.time(), engine.get_stats(), [])

    return report, writer.close


def measure(
    batch: int,
    context: int,
    steps: int,
    repeats: int,
    stream: bool = False,
    detokenize: bool = True,
    report: bool = False,
) -> dict:
    llm = LLM(None, device="cpu", max_num_seqs=batch, max_model_len=context + steps * repeats + 64)
    engine, runner = llm.engine, llm.engine.runner
    max_tokens = steps * repeats + 32
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        final_only=not stream,
        detokenize=detokenize,
    )
    start_decoding(engine, batch, context, max_tokens, params)
    stub_forward(engine)
    totals = dict.fromkeys(PHASES, 0.0)
    wrapped = [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "_fill", "fill"),
        (runner, "execute", "execute"),
        (engine.sampler, "sample", "sample"),
        (engine, "_process", "process"),
        (engine, "take_outputs", "outputs"),
    ]
    for obj, attr, phase in wrapped:
        setattr(obj, attr, _timed(getattr(obj, attr), totals, phase, runner))
    send, close = reporter(engine, params) if report else (None, None)
    if send is not None:
        send = _timed(send, totals, "report", runner)
    runs = []
    for _ in range(repeats):
        totals.update(dict.fromkeys(PHASES, 0.0))
        start = time.perf_counter()
        for _ in range(steps):
            if send is None:
                engine.step()
            else:  # one-token outputs of id-only streams in columns, as the engine process asks
                deltas = TokenDeltas()
                send(engine.step(deltas=deltas), deltas)
        elapsed = time.perf_counter() - start
        assert len(engine.scheduler.running) == batch, "requests finished during the run"
        runs.append({"step": elapsed, **totals})
    if close is not None:
        close()
    median = {k: 1e6 * statistics.median(r[k] for r in runs) / steps for k in runs[0]}
    # fill runs inside execute; "other" is step() itself: lists and bookkeeping.
    median["other"] = median["step"] - sum(median[k] for k in PHASES if k != "fill")
    setup = {"batch": batch, "context": context, "steps": steps, "repeats": repeats}
    setup |= {"stream": stream, "detokenize": detokenize, "report": report}
    return setup | {f"{k}_us": round(v, 1) for k, v in median.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=100, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=150, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="the median repeat is reported")
    p.add_argument("--stream", action="store_true", help="an output per request every step")
    p.add_argument("--no-detokenize", dest="detokenize", action="store_false")
    p.add_argument("--report", action="store_true", help="send outputs as the engine process does")
    args = p.parse_args(argv)
    if args.report and not args.stream:
        p.error("--report needs --stream (final-only requests report nothing per step)")
    figures = measure(
        args.batch,
        args.context,
        args.steps,
        args.repeats,
        args.stream,
        args.detokenize,
        args.report,
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
