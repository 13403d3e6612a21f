"""The host's work in a decode step, on any machine: the forward is stubbed out.

    python -m benchmarks.host_step            # batch 64, the demo model, on the CPU
    python -m benchmarks.host_step --batch 128 --repeats 9
    python -m benchmarks.host_step --batch 256 --stream [--no-detokenize]
    python -m benchmarks.host_step --batch 256 --stream --no-detokenize --report --churn 128

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

`--churn M` keeps the batch full the way a server under load does: requests
of M output tokens, staggered so that about batch/M finish every step, and
every `--admit-every` steps as many new ones (distinct prompts of `--context`
tokens) as finished since. Steps then admit prompts beside their decodes, as
a server's do under load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.decode_step import phase_timer, start_decoding
from engine import LLM, SamplingParams
from engine.request import TokenDeltas
from server.engine_loop import Add, StepReport

try:
    from server.engine_process import Clients
except ImportError:  # a tree from before Clients moved into engine_process.py (for A/B runs)
    from server.engine_clients import Clients

PHASES = ["schedule", "fill", "execute", "sample", "process", "outputs", "report"]


def stub_forward(engine) -> None:
    """Replace the engine's forward with fixed logits (every row picks the token for
    "a", so a stream shows text); the runner still writes and copies each step's
    metadata, as before a graph replay. Like the CUDA graphs, the stub hands over the
    rows' greedy ids too (`runner.argmax`), so a greedy batch's sampler returns them
    without an argmax on the CPU (which alone took ~57 us a step at batch 64)."""
    runner = engine.runner
    token = engine.tokenizer.encode("a")[-1]
    logits = torch.zeros(runner.max_num_seqs, engine.vocab_size, device=runner.device)
    logits[:, token] = 1.0
    argmax = torch.full((runner.max_num_seqs,), token, dtype=torch.int64, device=runner.device)

    def execute(step_batch):  # the runner's work without the model
        runner.fill(step_batch)
        runner.copy_staged()
        num_sampling = step_batch.num_sampling
        runner.argmax = argmax[:num_sampling]
        return logits[:num_sampling]  # the sampling rows, as the runner returns

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
) -> tuple[Callable[[list, TokenDeltas], None], Callable[[], None], Callable[[str], None]]:
    """A report function for each step's outputs, as the engine process sends them to
    one API process, a function that closes its pipe, and one that makes a request
    added later that API process's own."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    clients = Clients([writer], [multiprocessing.RawValue("b", 1)])
    clients.own(0, [Add(rid, [], params, 0.0) for rid in engine.requests])
    loop = _Loop(list(engine.requests))

    def own(request_id: str) -> None:
        clients.own(0, [Add(request_id, [], params, 0.0)])
        loop.active[request_id] = 1

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
        clients.report(loop, StepReport(batch, deltas, time.time(), engine.get_stats(), 0))

    return report, writer.close, own


class Churn:
    """Requests of `max_tokens` output tokens, finishing about batch/max_tokens a step
    and replaced every `admit_every` steps (distinct random prompts: no prefix hits)."""

    def __init__(self, engine, params: SamplingParams, context: int, admit_every: int) -> None:
        self.engine, self.params, self.context = engine, params, context
        self.admit_every = admit_every
        self.rng = np.random.default_rng(0)
        self.num_added = 0
        self.steps = 0
        self.own: Callable[[str], None] | None = None

    def start(self, batch: int) -> None:
        """The first batch, staggered: request i stops after 1 + i * max_tokens // batch
        tokens, so that its replacements (of max_tokens each) finish a few a step."""
        for i in range(batch):
            limit = 1 + i * self.params.max_tokens // batch
            self._add(dataclasses.replace(self.params, max_tokens=limit))

    def after_step(self) -> None:
        self.steps += 1
        engine = self.engine
        missing = engine.config.max_num_seqs - engine.scheduler.num_unfinished
        if missing > 0 and self.steps % self.admit_every == 0:
            for _ in range(missing):
                self._add(self.params)

    def _add(self, params: SamplingParams) -> None:
        rid = f"c{self.num_added}"
        self.num_added += 1
        prompt = self.rng.integers(1, self.engine.vocab_size, self.context).tolist()
        self.engine.add_request(rid, prompt, params)
        if self.own is not None:
            self.own(rid)


def measure(
    batch: int,
    context: int,
    steps: int,
    repeats: int,
    stream: bool = False,
    detokenize: bool = True,
    report: bool = False,
    churn: int = 0,
    admit_every: int = 7,
) -> dict:
    max_tokens = churn or steps * repeats + 32
    llm = LLM(None, device="cpu", max_num_seqs=batch, max_model_len=context + max_tokens + 64)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        final_only=not stream,
        detokenize=detokenize,
    )
    churner = Churn(engine, params, context, admit_every) if churn else None
    if churner is None:
        start_decoding(engine, batch, context, max_tokens, params)
    else:
        churner.start(batch)
    stub_forward(engine)
    totals = dict.fromkeys(PHASES, 0.0)
    wrapped = [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "fill", "fill"),
        (runner, "execute", "execute"),
        (engine.sampler, "sample", "sample"),
        (engine.reader, "read", "process"),
        (engine, "take_outputs", "outputs"),
    ]
    for obj, attr, phase in wrapped:
        setattr(obj, attr, phase_timer(getattr(obj, attr), totals, phase, runner))
    send, close, own = reporter(engine, params) if report else (None, None, None)
    if send is not None:
        send = phase_timer(send, totals, "report", runner)
    if churner is not None:
        churner.own = own
        for _ in range(2 * max_tokens):  # the staggered start settles into a few a step
            engine.step()
            churner.after_step()
    runs = []
    for _ in range(repeats):
        totals.update(dict.fromkeys(PHASES, 0.0))
        admitted = churner.num_added if churner is not None else 0
        start = time.perf_counter()
        for _ in range(steps):
            if send is None:
                engine.step()
            else:  # one-token outputs of id-only streams in columns, as the engine process asks
                deltas = TokenDeltas()
                send(engine.step(deltas=deltas), deltas)
            if churner is not None:
                churner.after_step()
        elapsed = time.perf_counter() - start
        if churner is None:
            assert len(engine.scheduler.running) == batch, "requests finished during the run"
        else:  # adding requests is the API side's work, not the step's
            totals["admitted"] = churner.num_added - admitted
        runs.append({"step": elapsed, **totals})
    if close is not None:
        close()
    median = {k: 1e6 * statistics.median(r[k] for r in runs) / steps for k in runs[0]}
    # fill runs inside execute; "other" is step() itself: lists and bookkeeping.
    median["other"] = median["step"] - sum(median[k] for k in PHASES if k != "fill")
    setup = {"batch": batch, "context": context, "steps": steps, "repeats": repeats}
    setup |= {"stream": stream, "detokenize": detokenize, "report": report}
    if churner is not None:
        admitted = median.pop("admitted") / 1e6  # per step
        setup |= {"churn": churn, "admit_every": admit_every, "admitted_per_step": admitted}
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
    p.add_argument(
        "--churn",
        type=int,
        default=0,
        metavar="M",
        help="requests of M tokens, replaced as they end",
    )
    p.add_argument(
        "--admit-every", type=int, default=7, help="with --churn: steps between admissions"
    )
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
        args.churn,
        args.admit_every,
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
