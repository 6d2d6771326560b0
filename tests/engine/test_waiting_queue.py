"""The scheduling policies: one waiting-queue class each behind `waiting_queue(policy)`, and the order in which
an engine then admits requests."""

from __future__ import annotations

import pytest
from pagoda.engine import SamplingParams
from pagoda.engine.core.waiting_queue import FCFSQueue, PriorityQueue, waiting_queue
from pagoda.engine.request import Request


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2], SamplingParams(), max_tokens=4, arrival_time=arrival, priority=priority)


def test_the_factory_gives_one_class_per_policy_and_names_the_choices():
    assert type(waiting_queue("fcfs")) is FCFSQueue and type(waiting_queue("priority")) is PriorityQueue
    with pytest.raises(ValueError, match="fcfs, priority"):
        waiting_queue("lottery")


def test_fcfs_serves_in_arrival_order_and_a_preempted_request_goes_first():
    q = waiting_queue("fcfs")
    a, b, c = req("a", arrival=1), req("b", priority=-5, arrival=2), req("c", arrival=3)
    for r in (a, b, c):
        q.add(r)
    assert [r.request_id for r in q] == ["a", "b", "c"]  # priority is ignored
    assert q.pop() is a
    q.add(a, front=True)  # preempted: back to the head
    assert q.peek() is a and len(q) == 3
    assert q.remove(b) and not q.remove(b) and [r.request_id for r in q] == ["a", "c"]
    running = [c, a]
    q.order_running(running)
    assert running == [c, a] and q.pick_victim(running) is a  # the last admitted gives way


def test_priority_serves_lowest_value_then_earliest_and_preempts_the_other_end():
    q = waiting_queue("priority")
    late_urgent, early, late = req("late-urgent", -1, 3.0), req("early", 0, 1.0), req("late", 0, 2.0)
    for r in (early, late, late_urgent):
        q.add(r)
    assert [r.request_id for r in q] == ["late-urgent", "early", "late"]
    assert q.pop() is late_urgent
    q.add(late_urgent, front=True)  # preempted: its own place, not the head by force
    assert q.peek() is late_urgent
    assert q.remove(early) and [q.pop().request_id, q.pop().request_id] == ["late-urgent", "late"]
    assert q.pick_victim([late, late_urgent, early]) is late  # whatever the list's order
    running = [late, late_urgent, early]
    q.order_running(running)
    assert running == [late_urgent, early, late]


def test_the_priority_policy_admits_the_most_urgent_request_first():
    from pagoda.engine import LLM

    llm = LLM(device="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=1,
              scheduling_policy="priority")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([[101, 102], [103, 104], [105, 106]], params, priority=[5, -3, 0], use_tqdm=False)
    llm.engine.close()
    admitted = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert admitted == [1, 2, 0]
