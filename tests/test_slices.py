"""SlicedCall: a call run on its own thread in slices, pausing between layers (kvboost_core.model.slices)."""

from __future__ import annotations

import threading

import pytest

from kvboost_core.model import slices
from kvboost_core.model.slices import SlicedCall


def _layers(n: int, rows: int, layers: int, log: list[str]) -> str:
    for i in range(n):
        log.append(f"layer{i}")
        slices.layer_done(rows, layers)
    return "result"


def test_slices_follow_the_budget_and_never_overlap_the_owner():
    log: list[str] = []
    call = SlicedCall(lambda: _layers(12, rows=10, layers=4, log=log))  # 2.5 token equivalents a layer
    steps = 0
    while not call.step(5.0):  # two layers a slice
        steps += 1
        log.append("owner")
    # six slices of two layers; the seventh step finds the call past its last pause point and lets it return
    assert call.result() == "result" and call.steps == steps + 1 == 7
    assert log.count("owner") == 6 and log[:6] == ["layer0", "layer1", "owner", "layer2", "layer3", "owner"]


def test_at_least_one_layer_per_step_and_a_call_without_pause_points_runs_whole():
    log: list[str] = []
    call = SlicedCall(lambda: _layers(3, rows=1, layers=100, log=log))
    assert not call.step(1e-9) and log == ["layer0"]
    whole = SlicedCall(lambda: 42)
    assert whole.step(1) and whole.result() == 42 and whole.step(1)  # a finished call stays finished


def test_errors_reach_the_owner_and_setup_runs_on_the_calls_thread():
    seen: list[str] = []

    def boom() -> None:
        seen.append(threading.current_thread().name)
        raise ValueError("bad document")

    call = SlicedCall(boom, setup=lambda: seen.append("setup"), name="kvboost-test")
    assert call.step(1)
    with pytest.raises(ValueError, match="bad document"):
        call.result()
    assert seen == ["setup", "kvboost-test"]


def test_close_unwinds_a_paused_call_and_hooks_do_not_leak_to_other_threads():
    log: list[str] = []
    finished: list[bool] = []

    def fn() -> None:
        try:
            _layers(10, rows=1, layers=1, log=log)
        finally:
            finished.append(True)

    call = SlicedCall(fn)
    assert not call.step(1)
    slices.layer_done(1, 1)  # this thread has no hook: nothing happens
    call.close()
    assert call.done and finished == [True] and log == ["layer0"]
    call.result()  # interrupted: no result and no error
    with pytest.raises(RuntimeError, match="before the sliced call ended"):
        SlicedCall(lambda: None).result()


@pytest.mark.parametrize("budget", [0, -1, True, "5", float("nan")])
def test_bad_budgets_are_value_errors(budget):
    with pytest.raises(ValueError, match="budget"):
        SlicedCall(lambda: None).step(budget)
