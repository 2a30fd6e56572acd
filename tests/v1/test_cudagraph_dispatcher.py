"""Capture sizes and the choice of a step's graph."""

from vllm.v1.cudagraph_dispatcher import (
    StepPlan,
    decode_capture_sizes,
    mixed_capture_sizes,
    plan_step,
)


def test_capture_sizes():
    assert decode_capture_sizes(1) == [1]
    assert decode_capture_sizes(12) == [12, 8, 4, 2, 1]
    assert decode_capture_sizes(24) == [24, 16, 8, 4, 2, 1]
    assert mixed_capture_sizes(40) == [40]
    assert mixed_capture_sizes(160) == [160, 128, 64]
    assert mixed_capture_sizes(2048) == [2048, 1536, 1024, 512, 256, 128, 64]
    assert mixed_capture_sizes(1000) == [1000, 512, 256, 128, 64]


def test_plan_step_takes_the_smallest_graph_that_holds_the_step():
    decode, mixed = decode_capture_sizes(12), mixed_capture_sizes(160)
    assert plan_step(5, True, decode, mixed) == StepPlan(True, 8)
    assert plan_step(12, True, decode, mixed) == StepPlan(True, 12)
    assert plan_step(1, False, decode, mixed) == StepPlan(False, 64)
    assert plan_step(129, False, decode, mixed) == StepPlan(False, 160)
    # a decode step beyond the decode graphs fits one with prefill
    assert plan_step(13, True, decode, mixed) == StepPlan(False, 64)
    assert plan_step(161, False, decode, mixed) == StepPlan(False, None)
    assert plan_step(3, True, [], []) == StepPlan(False, None)  # eager engine
