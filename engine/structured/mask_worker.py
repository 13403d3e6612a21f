"""MaskWorker: the thread that fills grammar rows' token bitmasks on the host.

A job (handed over by GrammarMasks on the engine thread) names matchers and their
slots' host rows, and maybe a launched step's ids: the worker waits for the ids to
land, has the matchers accept them, and fills their next masks; or it fills
first masks, or resets rows to all ones. Jobs run in order, each in a few
xgrammar calls that release the GIL (the fill splits the rows over xgrammar's
threads). When a job is done, the worker sets the DeviceFlag to its number: on
CUDA the stream waits for that before it reads the host rows (device_flag.py);
elsewhere the engine thread waits for the job.

The worker starts the moment a step's ids land, not when the engine thread gets
to them. It takes the GIL back after each call, and a thread waiting for the GIL
gets it when its holder blocks or else after the switch interval (5 ms by
default): with the engine thread running Python, the worker would wait that long,
and the device behind it. So the interval is lowered while grammars run.

A stop id completes its grammar (the mask allows one only there): no next mask,
its row all ones. An id a matcher refuses (possible only when the mask allowed
nothing) ends that request: the worker marks it done and notes it in `refused`,
which the engine thread takes before it reads the next ids.

Host rows and id buffers are rewritten only after the device used them: a job
writes rows after the ids of the step that read them last have landed, and a
grammar step's build makes the device wait for every earlier job, so an id
buffer (or its event) comes back to `step_ids` only after the job that read it.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr
from xgrammar.base import _core

from engine.structured.device_flag import DeviceFlag

if TYPE_CHECKING:
    from engine.request import Request

logger = logging.getLogger("pagoda.engine")

# Rows per fill thread: a row costs microseconds, and a thread's start and join about
# as much as a few rows.
ROWS_PER_THREAD = 16
SWITCH_INTERVAL_S = 2e-5  # the interpreter's, while grammars run (see above)


def accept_all(handles: list, token_ids: list[int]) -> list[int] | None:
    """Each matcher (by its xgrammar handle) accepts its id, in one call that releases
    the GIL. None if all did; else whether each did ([0 or 1]). xgrammar's public
    batch_accept_token reads its result back one FFI call per row, each also releasing
    and taking the GIL again: its core call is used, and the result read only when it
    holds a refusal (one call for `in`)."""
    result = _core.BatchGrammarMatcher.batch_accept_token(handles, token_ids, False)
    return list(result) if 0 in result else None


@dataclass
class StepIds:
    """A launched step's ids as the worker reads them: `array` once `ready` has
    completed (None: there already), at `positions` (the live grammar rows'; None: all)."""

    array: np.ndarray
    ready: torch.cuda.Event | None
    positions: np.ndarray | None

    def wait(self) -> np.ndarray:
        if self.ready is not None and not self.ready.query():
            self.ready.synchronize()  # releases the GIL
        return self.array if self.positions is None else self.array[self.positions]


class MaskWorker:
    def __init__(
        self, words: int, max_num_seqs: int, device: torch.device, threads: int, is_stop: np.ndarray
    ) -> None:
        self.device = device
        self.is_stop = is_stop  # [vocab] bool: the ids that end a grammar
        pin = device.type == "cuda"
        # The host rows [slots, words], as xgrammar fills them.
        self.host = torch.full((max_num_seqs, words), -1, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.threads = threads  # xgrammar's for a fill, at most
        self.batch_matchers: dict[int, xgr.BatchGrammarMatcher] = {}  # by thread count
        # The launched steps' ids: two buffers, each with its event (see above).
        self.id_buffers = [
            torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in "ab"
        ]
        self.id_arrays = [buffer.numpy() for buffer in self.id_buffers]
        self.id_events = [torch.cuda.Event() for _ in "ab"] if pin else []
        self.num_sent = 0
        self.cuda_index = None
        if pin:
            self.cuda_index = torch.cuda.current_device() if device.index is None else device.index
        self.pool = ThreadPoolExecutor(
            1, thread_name_prefix="pagoda-grammar-masks", initializer=self._start
        )
        # (slot, owner) of ids a matcher refused: the worker's, taken by the engine thread.
        self.refused: list[tuple[int, Request]] = []
        self.num_jobs = 0  # handed over; each sets the flag to its number when done
        self.last: Future | None = None  # the last job
        self.failure: BaseException | None = None  # a job's, raised by the next build
        self.flag = DeviceFlag.create(device)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    def _start(self) -> None:
        """Events are waited for on the engine's device (a thread's first CUDA call
        would otherwise make device 0's context)."""
        if self.cuda_index is not None:
            torch.cuda.set_device(self.cuda_index)

    # -- the engine thread's -------------------------------------------------------

    def submit(
        self, owners: list[Request], slots: list[int], ids: StepIds | None, reset: list[int]
    ) -> None:
        """A job: the owners' matchers accept their ids (if any) and fill their slots'
        next masks; the slots in reset go to all ones."""
        self.num_jobs += 1
        self.last = self.pool.submit(self._job, self.num_jobs, owners, slots, ids, reset)

    def step_ids(
        self, token_ids: torch.Tensor | np.ndarray, positions: np.ndarray | None
    ) -> StepIds:
        """A launched step's ids on their way to a job: on CUDA, copied to an id buffer
        of the worker's own (each time the other one), behind an event."""
        if isinstance(token_ids, np.ndarray) or self.device.type != "cuda":
            return StepIds(np.asarray(token_ids).copy(), None, positions)
        self.num_sent += 1
        which = self.num_sent % 2
        n = token_ids.numel()
        self.id_buffers[which][:n].copy_(token_ids, non_blocking=True)
        ready = self.id_events[which]
        ready.record()
        return StepIds(self.id_arrays[which][:n], ready, positions)

    def take_refused(self) -> list[tuple[int, Request]]:
        refused, self.refused = self.refused, []
        return refused

    def hold(self) -> None:
        """What is queued next on the stream waits for every job handed over; without
        a device flag, the host does."""
        if self.failure is not None:
            raise self.failure
        if self.flag is None:
            self.drain()
        else:
            self.flag.wait(self.num_jobs)

    def drain(self) -> None:
        """Wait for the last job (and raise what it raised)."""
        if self.last is not None:
            self.last.result()
            self.last = None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.flag is not None:  # a cancelled job's wait must not hold the stream
            self.flag.set(self.num_jobs)

    # -- the worker's --------------------------------------------------------------

    def _job(
        self,
        number: int,
        owners: list[Request],
        slots: list[int],
        ids: StepIds | None,
        reset: list[int],
    ) -> None:
        try:
            if reset:
                self.host_np[reset] = -1
            if ids is None:
                self.fill([owner.structured.matcher for owner in owners], slots)
            else:
                self._accept_and_fill(owners, slots, ids)
        except BaseException as exc:
            self.failure = exc
            raise
        finally:
            if self.flag is not None:  # even after a failure: the stream must go on
                self.flag.set(number)

    def _accept_and_fill(self, owners: list[Request], slots: list[int], step: StepIds) -> None:
        """What can be is done before the ids land, so that little Python (and GIL) is
        left between them and the masks."""
        # Ended by an id of an earlier job (refused): this one is void.
        done = [i for i, owner in enumerate(owners) if owner.structured.done]
        matchers = [owner.structured.matcher for owner in owners]
        handles = [matcher._handle for matcher in matchers]
        ids = step.wait()
        stops = self.is_stop[ids]  # complete (the engine thread ends the request)
        if done or stops.any():
            stops[done] = True
            self.host_np[np.asarray(slots)[stops]] = -1
            go_on = np.flatnonzero(~stops).tolist()
            owners, slots = [owners[i] for i in go_on], [slots[i] for i in go_on]
            matchers, handles = [matchers[i] for i in go_on], [handles[i] for i in go_on]
            ids = ids[~stops]
        id_list = ids.tolist()
        refused = accept_all(handles, id_list)
        if refused is not None:
            for i in (i for i, ok in enumerate(refused) if not ok):
                # The mask allowed no other id: only a grammar that no token can continue
                # gets here (every logit masked). It ends that request, not the batch, at
                # the engine's next read; its next id is void.
                owner = owners[i]
                logger.error("%s: token %d is outside its grammar", owner.request_id, id_list[i])
                owner.structured.done = True
                self.host_np[slots[i]] = -1
                self.refused.append((slots[i], owner))
            matchers = [m for m, ok in zip(matchers, refused) if ok]
            slots = [s for s, ok in zip(slots, refused) if ok]
        self.fill(matchers, slots)

    def fill(self, matchers: list[xgr.GrammarMatcher], slots: list[int]) -> None:
        """Fill these matchers' host rows (each where its next id starts), in one
        xgrammar call that releases the GIL and splits the rows over its threads."""
        if not slots:
            return
        threads = min(self.threads, max(1, len(slots) // ROWS_PER_THREAD))
        batch = self.batch_matchers.get(threads)
        if batch is None:
            batch = self.batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
        batch.batch_fill_next_token_bitmask(matchers, self.host, slots)
