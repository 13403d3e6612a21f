"""What rank 0 sends the other tensor-parallel ranks each step, so they run the same forward.

Rank 0 schedules, fills the step's metadata and chooses its path; the workers
need only enough to replay it: a fixed-size header (path, bucket, counts) over
the gloo control group, host to host, then one broadcast of the whole staged
device buffer over the tensors' group (the step's metadata and, in its
device-only tail, the ids rank 0 sampled last step, which this step's inputs
are gathered from). Block-table rows sent as a copy rather than as pairs follow
as a broadcast of their span; a step that scores prompts sends its scoring rows,
and one that embeds images its image rows and features (rank 0 alone encodes images).
Nothing is pickled per step.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch
import torch.distributed as dist

from engine.block_table import BlockTable
from engine.distributed import GATE, TensorParallel
from engine.images import ImageRows
from engine.staging import StagedFields

# StepHeader.path; LORA: no step, a LoRA adapter to read into slot `bucket` (its name
# and directory follow as objects over the control group).
STOP, DECODE_GRAPH, PREFILL_GRAPH, EAGER, VERIFY_GRAPH, LORA = range(6)


@dataclass
class StepHeader:
    path: int  # STOP (the workers leave), DECODE_GRAPH, PREFILL_GRAPH, EAGER or VERIFY_GRAPH
    bucket: int = 0  # a graph's batch or token bucket
    num_tokens: int = 0
    num_seqs: int = 0
    max_query_len: int = 0
    is_decode: int = 0
    num_sampling: int = 0
    table_lo: int = 0  # block-table rows [lo, hi) follow as a broadcast
    table_hi: int = 0
    num_score_rows: int = 0  # prompt-scoring rows follow as a broadcast
    per_token: int = 0  # an eager verify step's tokens attend as sequences of their own
    prompts_only: int = 0  # an eager step's sequences are all whole prompts
    num_image_rows: int = 0  # image rows and their features follow as broadcasts
    image_horizons: int = 0  # and their horizons (engine/images.py)
    image_positions: int = 0  # and their 3-D rotary positions
    image_deepstack: int = 0  # and this many layers' deepstack features
    state_restores: int = 0  # recurrent-state copies around the forward (ModelInput's)
    state_saves: int = 0


HEADER_WORDS = len(fields(StepHeader))


@dataclass
class ReceivedStep:
    """What a worker receives for one step, beside its staged buffer and table rows."""

    header: StepHeader
    score_rows: torch.Tensor | None = None
    images: ImageRows | None = None
    adapter: tuple[str, str] | None = None  # LORA: the adapter's name and directory


class StepChannel:
    def __init__(
        self,
        tp: TensorParallel,
        control: dist.ProcessGroup,
        staged: StagedFields,
        block_table: BlockTable,
        device: torch.device,
        hidden: tuple[int, torch.dtype],  # the model's (hidden_size, dtype): image features'
    ) -> None:
        self.tp = tp
        self.hidden = hidden
        self.control = control
        self.staged = staged
        self.block_table = block_table
        self.device = device
        self.header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        self.header_np = self.header.numpy()

    def publish(
        self,
        header: StepHeader,
        score_rows: torch.Tensor | None = None,
        images: ImageRows | None = None,
    ) -> None:
        """Rank 0, after the step's staged copy: send the workers what this step runs on."""
        table = self.block_table
        if table.rows_sent is not None:
            header.table_lo, header.table_hi = table.rows_sent
            table.rows_sent = None
        header.num_score_rows = 0 if score_rows is None else len(score_rows)
        header.num_image_rows = 0 if images is None else len(images.rows)
        header.image_horizons = int(images is not None and images.ends is not None)
        header.image_positions = int(images is not None and images.positions3 is not None)
        deepstack = None if images is None else images.deepstack
        header.image_deepstack = 0 if deepstack is None else len(deepstack)
        words = astuple(header)
        self.header_np[: len(words)] = words
        self._send_all(header, ReceivedStep(header, score_rows, images))

    def publish_lora(self, slot: int, name: str, path: str) -> None:
        """Rank 0, between steps: the workers read the adapter into the slot too."""
        self.header_np[:] = 0
        self.header_np[0], self.header_np[1] = LORA, slot
        with GATE.call():
            dist.broadcast(self.header, src=0, group=self.control)
            dist.broadcast_object_list([name, path], src=0, group=self.control)

    def stop(self) -> None:
        """Rank 0: the workers leave their loop."""
        self.header_np[:] = 0
        self.header_np[0] = STOP
        with GATE.call():
            dist.broadcast(self.header, src=0, group=self.control)

    def receive(self) -> ReceivedStep:
        """A worker: the next step's header, its staged buffer and table rows in place;
        and its scoring rows and image rows, if any."""
        dist.broadcast(self.header, src=0, group=self.control)
        header = StepHeader(*self.header_np.tolist())
        step = ReceivedStep(header)
        if header.path == STOP:
            return step
        if header.path == LORA:
            adapter = [None, None]
            dist.broadcast_object_list(adapter, src=0, group=self.control)
            step.adapter = (adapter[0], adapter[1])
            return step
        if header.num_score_rows:
            step.score_rows = self._empty(header.num_score_rows)
        if header.num_image_rows:
            size, dtype = self.hidden
            features = torch.empty(header.num_image_rows, size, dtype=dtype, device=self.device)
            step.images = ImageRows(self._empty(header.num_image_rows), features)
            if header.image_horizons:
                step.images.ends = torch.empty_like(step.images.rows, dtype=torch.int32)
            if header.image_positions:
                step.images.positions3 = self._empty(3 * header.num_image_rows).view(3, -1)
            if header.image_deepstack:
                step.images.deepstack = [
                    torch.empty_like(features) for _ in range(header.image_deepstack)
                ]
        self._send_all(header, step)
        return step

    def _empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, device=self.device)

    def _send_all(self, header: StepHeader, step: ReceivedStep) -> None:
        """The broadcasts, in one order on every rank (rank 0 sends, the rest receive)."""
        group = self.tp.group
        with GATE.call():
            if self.tp.is_driver:
                dist.broadcast(self.header, src=0, group=self.control)
            dist.broadcast(self.staged.device, src=0, group=group)
            if header.table_hi > header.table_lo:
                rows = self.block_table.gpu[header.table_lo : header.table_hi]
                dist.broadcast(rows, src=0, group=group)
            if step.score_rows is not None:
                dist.broadcast(step.score_rows, src=0, group=group)
            if step.images is not None:
                dist.broadcast(step.images.rows, src=0, group=group)
                dist.broadcast(step.images.features, src=0, group=group)
                if step.images.ends is not None:
                    dist.broadcast(step.images.ends, src=0, group=group)
                if step.images.positions3 is not None:
                    dist.broadcast(step.images.positions3, src=0, group=group)
                for level in step.images.deepstack or ():
                    dist.broadcast(level, src=0, group=group)
