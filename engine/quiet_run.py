"""A quiet run: steady decode steps whose per-request bookkeeping waits.

While the scheduler repeats one batch (its steady state) and every request in
it is quiet (final-only, no stop strings) and samples without the host, a
step's per-request work would be: count its token in flight, then append the
id, check it against the stop ids and the length limit, and report nothing.
The length limit cannot be reached inside the steady state (the scheduler
leaves it first), and a stop id is found for the whole batch with one lookup.
So the run books each step's ids as a row of a numpy array, and appends them
to the requests' lists only when it ends (`Engine._settle`), or when its array
is full. Until then a request's `output_token_ids`, `all_token_ids` and
`num_inflight` lag behind; only the steady state, which reads none of them,
runs meanwhile.
"""

from __future__ import annotations

import numpy as np

from engine.request import Request

ROWS = 256  # steps booked before they are appended (a full run appends and goes on)


class QuietRun:
    def __init__(self, requests: list[Request], stop_table: np.ndarray | None) -> None:
        self.requests = requests  # the steady batch: the same list every step
        self.stop_table = stop_table  # [vocab] bool: a stop id of some request; None: none
        self.ids = np.empty((ROWS, len(requests)), dtype=np.int64)  # [step, request]
        self.rows = 0  # steps read and not yet appended
        self.unread = 0  # steps launched whose ids are not read yet

    def read(self, ids: np.ndarray) -> bool:
        """Book a step's ids [num_requests]; False (nothing booked) if one is a stop id."""
        if self.stop_table is not None and self.stop_table[ids].any():
            return False
        if self.rows == ROWS:
            self.append()
        self.ids[self.rows] = ids
        self.rows += 1
        self.unread -= 1
        return True

    def append(self) -> None:
        """Append the booked ids to each request's lists."""
        for req, new_ids in zip(self.requests, self.ids[: self.rows].T.tolist()):
            req.output_token_ids += new_ids
            req.all_token_ids += new_ids
        self.rows = 0


def stop_table(requests: list[Request], vocab_size: int) -> np.ndarray | None:
    """A lookup of every id that stops some request (None: no request has one)."""
    stops = frozenset().union(*[req.stop_ids for req in requests])
    if not stops:
        return None
    table = np.zeros(vocab_size, dtype=bool)
    table[list(stops)] = True
    return table
