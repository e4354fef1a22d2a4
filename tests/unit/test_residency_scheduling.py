"""The scheduler's side of sleep and new weights, with real sockets and a fake worker: when the worker
is told to sleep, wake or swap, what is refused, and that no request runs on two sets of weights."""

from __future__ import annotations

import time

import pytest
import zmq

from crane_mp.ipc import Addresses, encode, frontend_decoder, make_socket, worker_decoder
from crane_mp.protocol import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    EngineState,
    GenerateRequest,
    LoadWeights,
    ResidencyDone,
    SamplingParams,
    Sleep,
    StepPlan,
    SwapWeights,
    TokenBatch,
    WakeUp,
)
from crane_mp.scheduler.process import SchedulerLoop
from crane_mp.scheduler.residency import ResidencyState
from tests.factories import FakeWorker, make_scheduler


class Harness:
    """A SchedulerLoop driven by hand: the test plays the frontend and the worker."""

    def __init__(self, tmp_path, **config) -> None:
        addresses = Addresses(str(tmp_path))
        self.loop = SchedulerLoop(make_scheduler(weights_path="/models/old", **config), addresses, num_frontends=1)
        self.worker_inbox = make_socket(self.loop.ctx, zmq.PULL, addresses.worker_inbox, bind=False)
        self.frontend_inbox = make_socket(self.loop.ctx, zmq.PULL, addresses.frontend_inbox(0), bind=False)
        self.fake = FakeWorker(block_size=4)
        self.replies: list[ControlReply] = []
        self.states: list[EngineState] = []
        self.finished: dict[int, list[int]] = {}

    def send(self, message) -> None:
        self.loop.receive(encode(message))
        self.loop._acknowledge()
        self.loop._tend_residency()

    def control(self, kind: str, **fields) -> None:
        self.send(ControlRequest(kind, len(self.replies) + 100, **fields))

    def to_worker(self) -> list:
        messages = []
        while self.worker_inbox.poll(100):
            messages.append(worker_decoder.decode(self.worker_inbox.recv()))
        return messages

    def drain_frontend(self) -> None:
        while self.frontend_inbox.poll(100):
            message = frontend_decoder.decode(self.frontend_inbox.recv())
            if isinstance(message, ControlReply):
                self.replies.append(message)
            elif isinstance(message, EngineState):
                self.states.append(message)
            elif isinstance(message, TokenBatch):
                for out in message.outputs:
                    self.finished.setdefault(out.rid, []).extend(out.new_token_ids)

    def step(self) -> StepPlan | None:
        """One step planned and run by the fake worker (as the loop would, when steps are allowed)."""
        if not self.loop.residency.steps_allowed:
            return None
        plan = self.loop.scheduler.schedule()
        if plan is None:
            return None
        self.loop.steps_in_flight += 1
        self.send(self.fake.execute(plan))
        return plan

    def close(self) -> None:
        self.worker_inbox.close()
        self.frontend_inbox.close()
        self.loop.close()


@pytest.fixture
def harness(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def _request(rid: int, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_sleep_is_refused_while_busy_then_frees_and_a_request_wakes_the_worker(harness):
    harness.send(_request(1))
    harness.control("sleep", level=1)
    harness.drain_frontend()
    assert harness.replies[-1].ok is False and harness.replies[-1].status == 409
    while harness.step():
        pass
    harness.control("sleep", level=3)
    harness.drain_frontend()
    assert harness.replies[-1].status == 400

    harness.control("sleep", level=2)
    assert harness.to_worker() == [Sleep(2)]
    assert not harness.loop.residency.steps_allowed  # until the worker answers, and while it sleeps
    harness.send(ResidencyDone("sleep", weights_path="/models/old"))
    harness.drain_frontend()
    assert harness.replies[-1].ok and harness.states[-1] == EngineState(2, "/models/old")

    harness.send(_request(2))  # waits in the queue while the worker wakes
    assert harness.to_worker() == [WakeUp()] and harness.step() is None
    harness.send(ResidencyDone("wake", weights_path="/models/old"))
    while harness.step():
        pass
    harness.drain_frontend()
    assert harness.states[-1] == EngineState(0, "/models/old")
    assert len(harness.finished[2]) == 4


def test_a_sync_is_answered_after_the_states_announced_before_it(harness):
    """A frontend asked whether the model sleeps syncs first: the reply comes after every state the
    scheduler sent it before (one socket keeps the order). The sleep's own answer follows the state too."""
    harness.send(ControlRequest("sleep", 998, level=1))
    harness.send(ResidencyDone("sleep", weights_path="/models/old"))
    harness.send(ControlRequest("sync", 999))
    messages = []
    while harness.frontend_inbox.poll(100):
        messages.append(frontend_decoder.decode(harness.frontend_inbox.recv()))
    replies = {m.token: i for i, m in enumerate(messages) if isinstance(m, ControlReply)}
    state = messages.index(EngineState(1, "/models/old"))
    assert messages[replies[999]].ok and messages[replies[998]].ok
    assert state < replies[998] < replies[999]


def test_sleeping_drops_the_prefix_cache(harness):
    harness.send(_request(1))
    while harness.step():
        pass
    assert harness.loop.scheduler.pool.num_cached_blocks
    harness.control("sleep", level=1)
    assert harness.loop.scheduler.pool.num_cached_blocks == 0


def test_wake_up_of_an_awake_model_answers_at_once(harness):
    harness.control("wake_up")
    harness.drain_frontend()
    assert harness.replies[-1].ok and harness.to_worker() == []


def test_new_weights_wait_for_the_old_weights_requests_and_new_requests_wait_for_them(harness):
    harness.send(_request(1, max_tokens=6))
    harness.step()  # request 1 started on the old weights
    harness.control("update_weights", path="/models/new")
    assert harness.to_worker()[-1] == LoadWeights("/models/new")
    harness.step()  # the old weights keep serving while the new ones load
    harness.send(ResidencyDone("load", weights_path="/models/new"))
    harness.send(_request(2))
    while (plan := harness.step()) is not None:
        assert all(sched.req_id == 1 for sched in plan.scheduled), "a new request started on the old weights"
    assert harness.fake.tokens == {}  # the worker was told request 1 finished; request 2 never reached it
    assert [message for message in harness.to_worker() if not isinstance(message, StepPlan)] == [SwapWeights()]
    harness.send(ResidencyDone("swap", weights_path="/models/new"))
    while harness.step():
        pass
    harness.drain_frontend()
    assert harness.replies[-1] == ControlReply(100, True, "/models/new")
    assert harness.states[-1] == EngineState(0, "/models/new")
    assert len(harness.finished[1]) == 6 and len(harness.finished[2]) == 4
    assert harness.loop.scheduler.pool.num_cached_blocks <= 2  # only request 2's, on the new weights


def test_a_failed_load_answers_the_error_and_holds_nothing(harness):
    harness.control("update_weights", path="/models/broken")
    harness.control("update_weights", path="/models/other")
    harness.send(ResidencyDone("load", "the weights at /models/broken are not this model's shape"))
    harness.drain_frontend()
    assert [reply.status for reply in harness.replies] == [409, 400]
    assert "shape" in harness.replies[-1].message
    harness.send(_request(1))
    assert harness.step() is not None and not harness.loop.scheduler.hold_new


def test_a_preempted_request_of_the_old_weights_finishes_before_the_swap(tmp_path):
    harness = Harness(tmp_path, num_blocks=6, max_model_len=24)
    try:
        for rid in (1, 2):
            harness.send(GenerateRequest(rid, [5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=12,
                                                                                             ignore_eos=True)))
        harness.step()
        harness.control("update_weights", path="/models/new")
        harness.send(ResidencyDone("load", weights_path="/models/new"))
        while harness.step():
            pass
        assert harness.loop.scheduler.num_preemptions  # one of them was set back and resumed before the swap
        assert SwapWeights() in harness.to_worker()
        harness.drain_frontend()
        assert len(harness.finished[1]) == 12 and len(harness.finished[2]) == 12
    finally:
        harness.close()


def test_idle_sleep_falls_due_after_the_idle_seconds_and_never_while_a_change_is_under_way():
    state = ResidencyState("/m", idle_sleep_seconds=5.0, idle_sleep_level=2, last_busy=100.0)
    assert not state.idle_sleep_due(104.0) and state.idle_sleep_due(105.0)
    assert state.seconds_to_idle_sleep(103.0) == pytest.approx(2.0)
    state.changing = "wake"
    assert not state.idle_sleep_due(200.0) and state.seconds_to_idle_sleep(200.0) is None
    assert not ResidencyState("/m").idle_sleep_due(time.monotonic() + 1e6)  # 0: never by itself


def test_the_loop_sleeps_by_itself_when_idle_long_enough(tmp_path):
    harness = Harness(tmp_path, sleep_idle_seconds=30.0, sleep_level=1)
    try:
        harness.loop._tend_residency()
        assert harness.to_worker() == []
        harness.loop.residency.last_busy -= 31.0
        harness.loop._tend_residency()
        assert harness.to_worker() == [Sleep(1)]
    finally:
        harness.close()


def test_a_sleep_asked_while_the_last_step_runs_starts_when_it_ends(harness):
    harness.send(_request(1))
    plan = harness.loop.scheduler.schedule()
    harness.loop.steps_in_flight += 1
    harness.send(AbortRequest(1))  # the client left; its step is still on the worker
    harness.control("sleep", level=1)
    assert [m for m in harness.to_worker() if not isinstance(m, StepPlan)] == []
    harness.send(harness.fake.execute(plan))
    while harness.step():  # the worker is told the request ended
        pass
    assert harness.to_worker()[-1] == Sleep(1)
    harness.send(ResidencyDone("sleep", weights_path="/models/old"))
    harness.drain_frontend()
    assert harness.replies[-1].ok


def test_new_weights_refused_at_the_swap_leave_the_old_serving(harness):
    harness.send(_request(1))
    while harness.step():
        pass
    harness.control("update_weights", path="/models/odd")
    harness.send(ResidencyDone("load", weights_path="/models/odd"))
    assert harness.to_worker()[-1] == SwapWeights()
    cached = harness.loop.scheduler.pool.num_cached_blocks
    harness.send(ResidencyDone("swap", "the new weights' KV cache would differ", "/models/old"))
    harness.drain_frontend()
    assert harness.replies[-1] == ControlReply(100, False, "the new weights' KV cache would differ", 400)
    assert harness.states[-1] == EngineState(0, "/models/old")
    assert harness.loop.scheduler.pool.num_cached_blocks == cached  # the old weights' prefixes still hold
    harness.send(_request(2))
    assert harness.step() is not None
