"""benchmarks.host_step keeps running against the engine it measures."""

from __future__ import annotations

from benchmarks.host_step import PHASES, measure


def test_host_step_reports_every_phase():
    result = measure(batch=4, context=8, steps=5, repeats=1)
    assert result["batch"] == 4
    engine_phases = [phase for phase in PHASES if phase != "report"]
    assert all(result[f"{phase}_us"] > 0 for phase in [*engine_phases, "step"])
    assert result["report_us"] == 0  # nothing is sent without --report
    assert result["step_us"] >= result["schedule_us"] + result["process_us"]


def test_host_step_measures_streamed_outputs_with_and_without_text():
    for detokenize in (True, False):
        result = measure(batch=4, context=8, steps=5, repeats=1, stream=True, detokenize=detokenize)
        assert (result["stream"], result["detokenize"]) == (True, detokenize)
        assert result["outputs_us"] > 0


def test_host_step_measures_the_engine_process_report():
    result = measure(batch=4, context=8, steps=5, repeats=1, stream=True, report=True)
    assert result["report"] and result["report_us"] > 0
    assert result["step_us"] > result["report_us"] + result["outputs_us"]


def test_host_step_churn_keeps_the_batch_full_and_admits_as_requests_end():
    # Requests of 8 tokens in a batch of 16: about 2 end a step, replaced every 2 steps.
    result = measure(
        batch=16, context=8, steps=12, repeats=1, stream=True, report=True, churn=8, admit_every=2
    )
    assert result["churn"] == 8
    # 12 steps end ~24 requests; each is replaced within 2 steps of its end.
    assert 16 <= result["admitted_per_step"] * 12 <= 32
    assert result["report_us"] > 0
