"""benchmarks.host_step keeps running against the engine it measures."""

from __future__ import annotations

from benchmarks.host_step import PHASES, measure


def test_host_step_reports_every_phase():
    result = measure(batch=4, context=8, steps=5, repeats=1)
    assert result["batch"] == 4
    assert all(result[f"{phase}_us"] > 0 for phase in [*PHASES, "step"])
    assert result["step_us"] >= result["schedule_us"] + result["process_us"]


def test_host_step_measures_streamed_outputs_with_and_without_text():
    for detokenize in (True, False):
        result = measure(batch=4, context=8, steps=5, repeats=1, stream=True, detokenize=detokenize)
        assert (result["stream"], result["detokenize"]) == (True, detokenize)
        assert result["outputs_us"] > 0
