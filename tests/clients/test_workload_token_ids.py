"""Random prompts as token ids: exact lengths, reproducible, completions only."""

from __future__ import annotations

import pytest

from clients.loadtest_args import build_parser, check_args
from clients.workload import RandomWorkload


def test_token_id_prompts_have_exact_lengths_and_repeat_per_seed():
    work = RandomWorkload((5, 9), (3, 3), seed=1, token_ids=True)
    specs = [work.request(i) for i in range(20)]
    assert all(isinstance(s.prompt, list) and 5 <= len(s.prompt) <= 9 for s in specs)
    again = RandomWorkload((5, 9), (3, 3), seed=1, token_ids=True)
    assert [again.request(i).prompt for i in range(20)] == [s.prompt for s in specs]


def test_token_ids_need_random_lengths_and_completions():
    parser = build_parser()
    for argv in (
        ["--prompt-token-ids"],
        ["--prompt-token-ids", "--input-len-range", "4", "8", "--endpoint", "/v1/chat/completions"],
    ):
        with pytest.raises(SystemExit):
            check_args(parser.parse_args(argv), parser)
