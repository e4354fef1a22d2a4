"""When the scheduler plans ahead of the step in flight: late in it, from what the steps before took."""

from __future__ import annotations

import time

import pytest

from crane_mp.config import EngineConfig
from crane_mp.ipc import Addresses
from crane_mp.scheduler.process import SchedulerLoop
from crane_mp.scheduler.scheduler import scheduler_config
from crane_mp.scheduler.step_clock import StepClock
from tests.factories import FakeWorker, make_requests, make_scheduler


def test_the_delay_follows_the_decode_part_and_the_cost_of_each_prompt_token():
    clock = StepClock(0.75)
    assert clock.plan_delay(256) == 0.0  # nothing measured yet: plan at once
    clock.observe(0, 0.010)
    clock.observe(256, 0.030)  # 20 ms more than a decode step for 256 prompt tokens
    assert clock.plan_delay(0) == pytest.approx(0.0075)
    assert clock.plan_delay(256) == pytest.approx(0.0225)
    assert clock.plan_delay(128) == pytest.approx(0.015)
    clock.observe(4, 1.0)  # too few prompt tokens to say what one costs
    clock.observe(0, 0.020)  # later steps move the estimate part of the way
    assert clock.plan_delay(0) == pytest.approx(0.75 * 0.013)
    assert clock.prompt_token_seconds == pytest.approx(0.02 / 256)


def test_without_a_fraction_the_next_step_is_planned_at_once():
    clock = StepClock(0.0)
    clock.observe(0, 0.010)
    assert clock.plan_delay(100) == 0.0 and clock.decode_seconds == 0.0


@pytest.mark.parametrize("on_cpu", [True, False])
def test_cpu_schedulers_plan_late_in_the_step_in_flight_cuda_ones_at_once(on_cpu):
    config = scheduler_config(EngineConfig(model_path="unused"), num_blocks=64, max_model_len=64,
                              eos_token_ids=(2,), on_cpu=on_cpu)
    assert (config.plan_ahead_fraction > 0) is on_cpu


def test_the_scheduler_times_the_plan_ahead_by_the_step_in_flight():
    sched = make_scheduler(plan_ahead_fraction=0.5, enable_prefix_caching=False)  # the two late prompts are alike
    for req in make_requests(2, prompt_len=8, max_tokens=8):
        sched.add_request(req)
    worker = FakeWorker()

    def finish(plan, seconds: float) -> None:
        result = worker.execute(plan)
        result.seconds = seconds
        sched.update(result)

    assert sched.plan_ahead_delay() == 0.0  # no step in flight
    finish(sched.schedule(), 0.5)  # the two prompts: no decode step measured yet to compare with
    finish(sched.schedule(), 0.1)  # two decode rows
    plan = sched.schedule()
    assert sched.plan_ahead_delay() == pytest.approx(0.05)  # half of a decode step
    finish(plan, 0.1)
    sched.add_request(make_requests(1, prompt_len=16, max_tokens=2)[0])
    finish(sched.schedule(), 0.5)  # 16 prompt tokens beside the two rows: 25 ms each
    sched.add_request(make_requests(1, prompt_len=16, max_tokens=2)[0])
    sched.schedule()
    assert sched.plan_ahead_delay() == pytest.approx(0.5 * (0.1 + 16 * 0.025))


def test_the_loop_waits_for_the_plan_ahead_only_with_one_step_in_flight(tmp_path):
    loop = SchedulerLoop(make_scheduler(plan_ahead_fraction=0.5), Addresses(str(tmp_path)), num_frontends=1)
    try:
        loop.scheduler.clock.observe(0, 20.0)  # a 20 s decode step: the next plan is due 10 s into it
        loop.scheduler._prompt_tokens[1] = 0
        loop.steps_in_flight, loop.step_started = 1, time.monotonic()
        assert 9.0 < loop._plan_ahead_in(ahead=True) <= 10.0
        assert loop._plan_ahead_in(ahead=False) == 0.0  # not streaming yet, or speculating: no plan ahead
        loop.step_started -= 9.9995  # due within the poller's millisecond: now
        assert loop._plan_ahead_in(ahead=True) == 0.0
        loop.steps_in_flight = 0
        assert loop._plan_ahead_in(ahead=True) == 0.0
    finally:
        loop.close()
