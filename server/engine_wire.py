"""The messages between an API process and the engine process, and how they pickle.

Each API process talks to the engine process over two pipes of pickled messages:
  API → engine   Put([Add | Abort | LoRAUpdate | Sync, ...]), Stop()
  engine → API   Ready(EngineInfo, stats), Failed(message), WireReport(...)
A WireReport is a StepReport (server/engine_loop.py) cut to one API process:
its own outputs and errors, the step's TokenDeltas as bytes pickled once for
all API processes, and the engine's stats and count of requests taken in.

Pickling is positional, without field names: a report carries one output per
running choice per step, so a WireReport takes its outputs apart with one C call
each (operator.attrgetter) instead of a reducer per object; the rarer objects
inside them (metrics, logprobs) get a positional reducer. The engine sends a
report to every API process at almost every step, from the thread that
launches the GPU's work: what all of them get (deltas, stats) is pickled once
per step (`pack_shared`), and each one's message by a pickler whose reducer
table is built once (multiprocessing's ForkingPickler copies it per message).
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.request import RequestMetrics, RequestOutput, TokenDeltas, TokenLogprob
from server.engine_loop import Batch, Credit, Item, StepReport
from server.errors import APIError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.engine import Engine
    from engine.stats import EngineStats


def _positional(cls: type) -> Callable[[object], tuple]:
    """Pickle a dataclass as its constructor's arguments: no per-object dict of
    field names."""
    fields = operator.attrgetter(*[f.name for f in dataclasses.fields(cls)])
    return lambda obj: (cls, fields(obj))


_output_row = operator.attrgetter(*[f.name for f in dataclasses.fields(RequestOutput)])


@dataclass
class EngineInfo:
    """What the API side needs of the engine: in the engine thread's layout read off
    the engine, in the engine process's sent in Ready. The tokenizer is the API
    side's own, loaded from model_dir while the engine builds."""

    model_name: str
    model_dir: str
    config: EngineConfig  # as the engine resolved it (max_model_len filled in)
    vocab_size: int
    tokenizer: PreTrainedTokenizerBase | None = None
    hidden_size: int = 0  # an embedding's length (0: unknown)
    can_generate: bool = True  # False: a bare model, embeddings only
    eos_token_ids: frozenset[int] = frozenset()  # the ids that end a choice (beam search's)
    labels: list[str] = field(default_factory=list)  # a sequence classifier's (/classify)
    token_types: int = 1  # an encoder's type_vocab_size (engine/checks.py's TOKEN_TYPE_SHIFT)

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        return cls(
            engine.model_name,
            engine.model_dir,
            engine.config,
            engine.vocab_size,
            hidden_size=engine.embedding_size,
            can_generate=engine.can_generate,
            eos_token_ids=frozenset(engine.eos_set),
            labels=engine.labels,
            token_types=engine.token_types,
        )

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None  # the engine fills it in
        return self.config.max_model_len


@dataclass
class EngineEndpoint:
    """One API process's ends of its link to the engine process (picklable, so a
    spawned API process can be handed one)."""

    to_engine: Connection
    from_engine: Connection
    credit: Credit  # a multiprocessing.RawValue("b") in shared memory


@dataclass
class Put:
    items: list[Item]


@dataclass
class Stop:
    """This API process is leaving: fail its requests and let it go."""


@dataclass
class Ready:
    info: EngineInfo
    stats: EngineStats


@dataclass
class Failed:
    message: str  # why the engine could not be built


@dataclass
class WireReport:
    """A step's report as one API process receives it."""

    outputs: list[RequestOutput]  # its own, in step order
    errors: dict[str, APIError]  # its requests that the step ended with an error
    deltas: bytes  # the step's TokenDeltas columns for every API process; b"" if none
    step_time: float
    stats: EngineStats
    taken_in: int
    done: list[str]  # every API process's LoRAUpdates made and Syncs (each knows its own ids)

    @staticmethod
    def pack_shared(
        deltas: bytes, step_time: float, stats: EngineStats, taken_in: int, done: list[str]
    ) -> bytes:
        """What every API process's report of a step holds, pickled once for all of them."""
        return pickle.dumps((deltas, step_time, stats, taken_in, done), pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def pack(outputs: list[RequestOutput], errors: dict[str, APIError], shared: bytes) -> bytes:
        """One API process's report: its outputs and errors, and the step's shared part
        (pack_shared), pickled with _WirePickler's reducers. Conn.recv() on the other end
        gives the WireReport."""
        buf = io.BytesIO()
        packed = _Packed(list(map(_output_row, outputs)), errors, shared)
        _WirePickler(buf, pickle.HIGHEST_PROTOCOL).dump(packed)
        return buf.getvalue()

    @staticmethod
    def pack_deltas(deltas: TokenDeltas) -> bytes:
        if not deltas:
            return b""
        columns = (deltas.request_ids, deltas.indices, deltas.num_tokens, deltas.token_ids)
        return pickle.dumps(columns, pickle.HIGHEST_PROTOCOL)

    def step_report(self) -> StepReport:
        """The StepReport the engine loop made, as far as it concerns this API process."""
        batch: Batch = {}
        for out in self.outputs:  # grouped by request, in step order
            batch.setdefault(out.request_id, []).append(out)
        batch.update(self.errors)
        deltas = TokenDeltas(*pickle.loads(self.deltas)) if self.deltas else TokenDeltas()
        return StepReport(batch, deltas, self.step_time, self.stats, self.taken_in, self.done)


@dataclass
class _Packed:
    """A WireReport on its way: its outputs as rows, the step's shared part as bytes."""

    rows: list[tuple]
    errors: dict[str, APIError]
    shared: bytes

    def __reduce__(self) -> tuple:
        return _rebuild_report, (self.rows, self.errors, self.shared)


def _rebuild_report(rows: list[tuple], errors: dict[str, APIError], shared: bytes) -> WireReport:
    return WireReport([RequestOutput(*row) for row in rows], errors, *pickle.loads(shared))


class _WirePickler(pickle.Pickler):
    """Positional reducers for the objects inside a report's outputs, in a table built
    once."""

    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table.update({cls: _positional(cls) for cls in (RequestMetrics, TokenLogprob)})
