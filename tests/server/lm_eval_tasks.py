"""lm-eval tasks from local JSONL files, for tests against a live server (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

MULTIPLE_CHOICE = [
    {
        "question": "The quick brown fox jumps over the",
        "choices": [" lazy dog", " moon"],
        "answer": 0,
    },
    {
        "question": "Once upon a time, in a land far",
        "choices": [" away", " below", " up"],
        "answer": 0,
    },
    {"question": "1 2 3 4", "choices": [" 5", " 9"], "answer": 0},
]
GENERATE = [
    {"prompt": "Once upon a time,", "target": " in"},
    {"prompt": "def forward(self, x):", "target": "\n"},
]


def write_tasks(directory: Path) -> None:
    """pagoda_mc (multiple_choice, acc) and pagoda_gen (generate_until, exact_match)."""
    for name, rows in (("mc", MULTIPLE_CHOICE), ("gen", GENERATE)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        common = (
            f"task: pagoda_{name}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        )
        if name == "mc":
            spec = (
                "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
                "metric_list:\n  - metric: acc\n"
            )
        else:
            spec = (
                "output_type: generate_until\ndoc_to_text: '{{prompt}}'\n"
                "doc_to_target: '{{target}}'\n"
                "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n"
            )
        (directory / f"pagoda_{name}.yaml").write_text(common + spec)


def evaluate(base_url: str, model: str, tasks: list[str], directory: Path) -> dict:
    """lm-eval's local-completions model against the server, its tokenizer the server's
    own (/tokenizer_info, /tokenize, /detokenize): no hub, no local files."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_tasks(directory)
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": model,
            "base_url": f"{base_url}/v1/completions",
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
            "max_length": 256,
        },
        tasks=tasks,
        task_manager=TaskManager(include_path=str(directory)),
        log_samples=True,
    )
