"""The running requests as numpy columns, one row per slot (vLLM v1's InputBatch, small).

A running request owns a slot for its whole run: the same row here and in the
block table. While it runs, its token ids and counts live here, and the
Request's properties read them from here (engine/request.py), so nothing on
either side lags behind the other. A step's bookkeeping is then a few array
operations over the batch's slots, whatever the batch size:

    schedule   num_new = num_tokens - num_computed       (engine/scheduler.py)
    launch     num_tokens[sampling] += 1                 the ids stay on the device
    read       token_ids[slots, num_known] = ids         stops found by one lookup

and only requests with something user-visible (news, a stop, a finish) are
visited one by one. `num_tokens - num_known` are the tokens sampled on the
device whose ids the host has not read yet (0 or 1, briefly 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.request import Request


@dataclass
class ReadTokens:
    """What a step's sampled ids did to the batch: the rows still running when they
    were read, and which of those need a look one by one."""

    slots: np.ndarray  # [k] the live rows' slots
    token_ids: np.ndarray  # [k] their new ids
    done: np.ndarray | None  # [k] bool: a stop id (past min_tokens) or the length limit
    first: np.ndarray | None  # [k] bool: the request's first output token
    streamed: list[Request]  # the live rows' streamed requests (their ids are news)
    # Preempted requests whose id sampled before they left was read now: a stop id or
    # their length limit ends them all the same.
    departed: list[tuple[Request, int]]


@dataclass
class LaunchMark:
    """The batch as a step's sampling rows saw it when launched."""

    departures: int
    generations: np.ndarray  # [k] each row's slot generation


# Rows of InputBatch.counts: one gather reads all of them for a step's slots.
COMPUTED, TOKENS, KNOWN, LIMIT, CAPACITY, PROMPT, MIN_TOKENS = range(7)

# A ufunc takes a 0-d array operand for less host time than a Python int (which
# numpy converts on every call).
ONE = np.array(1, dtype=np.int64)
NO_LIMIT = 1 << 62


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, vocab_size: int) -> None:
        n = max_num_seqs
        # [slot, position] prompt then output ids the host knows. np.zeros maps fresh
        # pages lazily: only the rows and positions written take memory. int64, the
        # sampled ids' type: a fancy write that casts costs several times one that
        # does not, and the step's ids are written through the flat view.
        self.token_ids = np.zeros((n, max_model_len + 1), dtype=np.int64)
        self.token_flat = self.token_ids.reshape(-1)  # a view
        self.row_start = np.arange(n, dtype=np.int64) * (max_model_len + 1)  # by slot
        self.counts = np.zeros((7, n), dtype=np.int64)
        self.num_computed = self.counts[COMPUTED]  # KV computed or scheduled
        self.num_tokens = self.counts[TOKENS]  # known ids plus those on the device
        self.num_known = self.counts[KNOWN]  # ids in token_ids
        self.max_num_tokens = self.counts[LIMIT]  # length limit, prompt included
        self.capacity = self.counts[CAPACITY]  # tokens its KV blocks hold
        self.num_prompt = self.counts[PROMPT]
        self.min_tokens = self.counts[MIN_TOKENS]
        # Ids that end a request (EOS unless ignored, stop_token_ids), -1 padded, and
        # how many running requests each id would end: one lookup tells whether a
        # step's ids hold any stop at all.
        self.stop_ids = np.full((n, 1), -1, dtype=np.int64)
        self.stop_count = np.zeros(vocab_size, dtype=np.int32)
        self.num_stopping = 0  # rows with any stop id
        # A lower bound on every running row's max_num_tokens - num_tokens: while it is
        # positive no row is at its length limit, and neither the scheduler nor a read
        # looks for one. A launch adds at most one token to each row: one less.
        self.headroom = NO_LIMIT
        # Tokens of the running rows not scheduled yet: the sum of num_tokens -
        # num_computed, kept as the columns change (what a step that schedules every
        # row in full schedules, without a sum over them).
        self.num_unscheduled = 0
        # Rows whose first output id has not been read (num_known == num_prompt).
        self.num_awaiting_first = 0
        # What the sampler and the engine ask of every row, every step. Each flag
        # column has a count of its set rows beside it: a step whose count is 0
        # looks at no row.
        self.argmax_only = np.zeros(n, dtype=bool)  # greedy with nothing to apply
        self.argmax_masked = np.zeros(n, dtype=bool)  # the same, but for a grammar's mask
        self.num_sampled_fully = 0  # rows not argmax_only
        self.needs_sync = np.zeros(n, dtype=bool)  # ids read on the host before sampling
        self.num_needs_sync = 0
        # Its prefill scores the prompt (prompt logprobs not all computed): see
        # engine/prompt_logprobs.py.
        self.scores_prompt = np.zeros(n, dtype=bool)
        self.num_scoring = 0
        # Its prompt's embedding is taken when its last prompt token's step runs
        # (engine/pooling.py).
        self.pools = np.zeros(n, dtype=bool)
        self.num_pooling = 0
        # Its prompt holds images, whose features replace their placeholders' embeddings
        # in its prefill steps (engine/images.py): one past its last placeholder's
        # position (0: no images). A step that starts it there (a decode) has no image rows.
        self.images_end = np.zeros(n, dtype=np.int64)
        self.num_images = 0
        # Its images must not be split between steps (engine/images.py).
        self.whole_images = np.zeros(n, dtype=bool)
        self.num_whole_images = 0
        # Its rotary positions are 3-D past its images' (the Qwen VL models').
        self.has_mrope = np.zeros(n, dtype=bool)
        self.num_mrope = 0
        self.streams = np.zeros(n, dtype=bool)  # a read token may be news: look at it
        self.num_streaming = 0
        # Plain streams (ids only) whose first id was read (news carries their first
        # output): their news after it is cut from these columns for all of them at
        # once (engine/outputs.py), no row looked at.
        self.plain = np.zeros(n, dtype=bool)
        self.num_plain = 0
        self.emit_at = np.zeros(n, dtype=np.int64)  # every row's first id not in an output
        self.request_ids = np.full(n, "", dtype=object)
        self.choice = np.zeros(n, dtype=np.int64)  # the request's index among its n
        self.num_matching = 0  # rows with stop strings (matched as their ids are read)
        # A grammar's rows sample under its mask (engine/structured/masks.py).
        self.has_grammar = np.zeros(n, dtype=bool)
        self.num_grammar = 0
        self.temperature = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.lora = np.full(n, -1, dtype=np.int64)  # LoRA adapter index, -1: the base model
        # Speculative decoding (engine/speculative.py): the rows whose sampling lets them
        # draft, and each row's drafts this step (their ids sit in token_ids past
        # num_tokens, where the step's reads overwrite them), summed in num_draft_tokens.
        self.speculates = np.zeros(n, dtype=bool)
        self.num_speculating = 0
        self.num_drafts = np.zeros(n, dtype=np.int64)
        self.num_draft_tokens = 0
        # Bumped whenever a slot changes hands: a step read after its request left
        # (finished, aborted, preempted) is told apart from the slot's next owner.
        self.generation = np.zeros(n, dtype=np.int64)
        self.departures = 0  # requests that left, ever: none since a launch, all live
        self.requests: list[Request | None] = [None] * n  # by slot
        self.running: list[Request] = []  # arrival order: the batch order
        self.slots = np.zeros(0, dtype=np.int64)  # their slots, in that order
        # Bumped whenever `slots` changes (a request enters or leaves): what a reader
        # derived from `slots` under one layout holds until the next.
        self.layout = 0
        self.free_slots = list(range(n - 1, -1, -1))
        # Requests preempted with ids on the device, by (slot, generation): those ids
        # are theirs when read (see read()).
        self.departed: dict[tuple[int, int], Request] = {}

    def __len__(self) -> int:
        return len(self.running)

    def add(self, req: Request) -> int:
        """Give req a slot and its row: its tokens (prompt, and any output a preemption
        left), counts and sampling columns. Returns the slot."""
        slot = self.free_slots.pop()
        tokens = req.all_token_ids
        n = len(tokens)
        self.token_ids[slot, :n] = tokens
        self.num_prompt[slot] = num_prompt = len(req.prompt_token_ids)
        self.num_known[slot] = n
        self.num_tokens[slot] = n
        self.num_computed[slot] = req.num_computed_tokens
        self.num_unscheduled += n - req.num_computed_tokens
        self.max_num_tokens[slot] = req.max_num_tokens
        self.headroom = min(self.headroom, req.max_num_tokens - n)
        params = req.params
        self.min_tokens[slot] = params.min_tokens
        stops = sorted(req.stop_ids)
        more = len(stops) - self.stop_ids.shape[1]
        if more > 0:
            self.stop_ids = np.pad(self.stop_ids, ((0, 0), (0, more)), constant_values=-1)
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(stops)] = stops
        if stops and stops[-1] >= len(self.stop_count):  # an EOS past the model's vocab
            self.stop_count = np.pad(self.stop_count, (0, stops[-1] + 1 - len(self.stop_count)))
        for stop in stops:  # a few: scalar writes cost less than one fancy-indexed write
            self.stop_count[stop] += 1
        self.num_stopping += bool(stops)
        self.num_awaiting_first += n == num_prompt
        self.capacity[slot] = 0  # the scheduler gives it blocks next
        self.argmax_only[slot] = params.argmax_only
        self.argmax_masked[slot] = params.argmax_masked
        self.num_sampled_fully += not params.argmax_only
        self.needs_sync[slot] = params.needs_sync
        self.num_needs_sync += params.needs_sync
        self.scores_prompt[slot] = scores = req.scores_prompt
        self.num_scoring += scores
        self.pools[slot] = pools = params.pooling and req.embedding is None
        self.num_pooling += pools
        images = req.images is not None
        self.images_end[slot] = int(req.images.positions[-1]) + 1 if images else 0
        self.num_images += images
        self.whole_images[slot] = whole = images and req.images.run_starts is not None
        self.num_whole_images += whole
        self.has_mrope[slot] = mrope = images and req.images.mrope is not None
        self.num_mrope += mrope
        self.streams[slot] = req.streamed
        self.num_streaming += req.streamed
        self.plain[slot] = plain = params.plain and n > num_prompt
        self.num_plain += plain
        self.emit_at[slot] = num_prompt + req.num_emitted_tokens  # before req.batch is set: its own
        self.request_ids[slot] = req.request_id
        self.choice[slot] = req.index
        self.num_matching += bool(params.stop)
        self.has_grammar[slot] = grammar = req.structured is not None
        self.num_grammar += grammar
        self.temperature[slot] = 1.0 if params.greedy else params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.lora[slot] = req.lora_index
        self.speculates[slot] = params.speculates
        self.num_speculating += params.speculates
        self.requests[slot] = req
        self.running.append(req)
        self.slots = np.concatenate((self.slots, (slot,)))
        self.layout += 1
        req.batch, req.slot = self, slot
        return slot

    def remove(self, req: Request) -> None:
        """Take req's row back; its tokens and counts go back onto the Request."""
        slot = req.slot
        known, computed = self.num_known.item(slot), self.num_computed.item(slot)
        num_tokens, num_prompt = self.num_tokens.item(slot), self.num_prompt.item(slot)
        inflight = num_tokens - known
        self.num_unscheduled -= num_tokens - computed
        index = self.running.index(req)
        del self.running[index]
        self.slots = np.concatenate((self.slots[:index], self.slots[index + 1 :]))
        self.layout += 1
        req.detach(
            self.token_ids[slot, num_prompt:known].tolist(),
            computed,
            inflight,
            self.emit_at.item(slot) - num_prompt,
        )
        if inflight and not req.is_finished:  # preempted: its ids on the device are its own
            self.departed[(slot, self.generation.item(slot))] = req
        for stop in req.stop_ids:  # as add() counted them
            self.stop_count[stop] -= 1
        self.num_stopping -= bool(req.stop_ids)
        self.num_awaiting_first -= known == num_prompt
        self.num_sampled_fully -= not self.argmax_only.item(slot)
        self.num_streaming -= self.streams.item(slot)
        self.num_plain -= self.plain.item(slot)
        self.num_matching -= bool(req.params.stop)
        self.prompt_scored(slot)
        self.pooled(slot)
        self.num_images -= bool(self.images_end.item(slot))
        self.images_end[slot] = 0
        self.num_whole_images -= self.whole_images.item(slot)
        self.whole_images[slot] = False
        self.num_mrope -= self.has_mrope.item(slot)
        self.has_mrope[slot] = False
        self.num_needs_sync -= self.needs_sync.item(slot)
        self.num_grammar -= self.has_grammar.item(slot)
        self.num_speculating -= self.speculates.item(slot)
        self.generation[slot] += 1
        self.departures += 1
        self.requests[slot] = None
        self.free_slots.append(slot)

    def first_read(self, slot: int) -> None:
        """A plain stream's first id was read: its news after that is the columns'."""
        self.plain[slot] = True
        self.num_plain += 1

    def pooled(self, slot: int) -> None:
        """The row's embedding is taken (or it left)."""
        self.num_pooling -= bool(self.pools[slot])
        self.pools[slot] = False

    def prompt_scored(self, slot: int) -> None:
        """The row's prompt logprobs are all computed (or it left)."""
        self.num_scoring -= bool(self.scores_prompt[slot])
        self.scores_prompt[slot] = False

    def scheduled(self, slots: np.ndarray, ends: np.ndarray, num_scheduled: int) -> None:
        """These rows' KV is computed, or scheduled, up to `ends`: num_scheduled tokens
        more than before, in all."""
        self.num_computed[slots] = ends
        self.num_unscheduled -= num_scheduled

    def set_computed(self, slot: int, num_computed: int) -> None:
        self.num_unscheduled += self.num_computed.item(slot) - num_computed
        self.num_computed[slot] = num_computed

    def refuse(self, slots: np.ndarray, num_refused: np.ndarray) -> None:
        """The KV these rows computed for their last num_refused [k] tokens (refused
        drafts: engine/speculative.py) is void: they are scheduled again."""
        self.num_computed[slots] -= num_refused
        self.num_unscheduled += int(num_refused.sum())

    def launched(self, slots: np.ndarray, void: np.ndarray | None = None) -> LaunchMark:
        """These rows sampled a token on the device; what read() needs to know which
        of them still belong to the same requests then. void: [k] bool, the rows
        whose request left after the step was scheduled (a read before sampling
        finished it): their ids are nobody's."""
        self.num_tokens[slots] += ONE
        self.headroom -= 1
        mark = LaunchMark(self.departures, self.generation[slots])
        if void is None or not void.any():
            self.num_unscheduled += len(slots)
        else:  # read() drops them as departed
            self.num_unscheduled += len(slots) - int(np.count_nonzero(void))
            mark.departures = -1
            mark.generations[void] = -1
        return mark

    def read(self, slots: np.ndarray, mark: LaunchMark, token_ids: np.ndarray) -> ReadTokens | None:
        """Append a step's sampled ids [k] to the rows that sampled them, and find the
        rows they stop. Ids of a request that has left since are dropped, or, if it
        was preempted, appended to its own list (it recomputes them). None: no row
        needs a look (no stop, first token, stream or departed request)."""
        departed: list[tuple[Request, int]] = []
        if mark.departures != self.departures:
            live = self.generation[slots] == mark.generations
            if not live.all():
                for i in np.flatnonzero(~live).tolist():
                    key = (int(slots[i]), int(mark.generations[i]))
                    req = self.departed.pop(key, None)
                    if req is not None and not req.is_finished:
                        req.receive_departed(int(token_ids[i]))
                        departed.append((req, int(token_ids[i])))
                slots, token_ids = slots[live], token_ids[live]
        known = self.num_known[slots]
        self.token_flat[self.row_start[slots] + known] = token_ids
        known += ONE
        self.num_known[slots] = known
        done, num_done = None, 0
        if self.headroom <= 0:  # a row may have reached its length limit
            done = known >= self.max_num_tokens[slots]
            num_done = np.count_nonzero(done)
        # Someone's stop id among the ids: whose, exactly?
        if self.num_stopping and np.count_nonzero(self.stop_count[token_ids]):
            stop = (self.stop_ids[slots] == token_ids[:, None]).any(1)
            stop &= known - self.num_prompt[slots] >= self.min_tokens[slots]
            done = stop if done is None else done | stop
            num_done = np.count_nonzero(done)
        first = None
        if self.num_awaiting_first:
            first = known == self.num_prompt[slots] + ONE
            num_first = np.count_nonzero(first)
            self.num_awaiting_first -= num_first
            if not num_first:
                first = None
        streamed: list[Request] = []
        if self.num_streaming:  # their own lists get the ids too: cut into outputs
            rows = self.streams[slots]
            streamed = [self.requests[s] for s in slots[rows].tolist()]
            for req, token_id in zip(streamed, token_ids[rows].tolist()):
                req.output_ids.append(token_id)
        if not (num_done or first is not None or streamed or departed):
            return None
        return ReadTokens(slots, token_ids, done if num_done else None, first, streamed, departed)

    def token_slice(self, slot: int, start: int, end: int | None = None) -> list[int]:
        """Known ids [start, end) of a row (end: all known)."""
        known = self.num_known.item(slot)
        return self.token_ids[slot, start : known if end is None else min(end, known)].tolist()
