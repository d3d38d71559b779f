"""The opt-in timeline: what it records in one process, and a decode token followed round a real route;
and a process's CPU split by thread, as the kernel names and counts them (both read by ``benchmarks.breakdown``)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from benchmarks.breakdown import per_token, thread_cpu
from benchmarks.tokenpath import token_stages
from noderuntime.operations import timeline
from noderuntime.operations.threadnames import name_this_thread
from noderuntime.seams.client import GenerationRequest
from noderuntime.seams.dialer import open_dialer
from noderuntime.testing.clusters import running_cluster


def test_stages_are_recorded_only_while_on_in_order_with_their_thread(tmp_path: Path) -> None:
    timeline.stop()
    timeline.mark("before")
    assert timeline.events() == []
    timeline.start(limit=3)
    try:
        timeline.mark("a")
        worker = threading.Thread(target=timeline.mark, args=("b",), name="worker")
        worker.start()
        worker.join()
        timeline.mark("c")
        stages = timeline.events()
        assert [(s, t) for s, _, t in stages] == [("a", "MainThread"), ("b", "worker"), ("c", "MainThread")]
        assert [ns for _, ns, _ in stages] == sorted(ns for _, ns, _ in stages)
        timeline.mark("d")  # bounded: the oldest goes
        assert [s for s, _, _ in timeline.events()] == ["b", "c", "d"]
        timeline.write(tmp_path / f"timeline-{os.getpid()}.json")
        (tmp_path / "other.json").write_text("{}")  # not a timeline: not read
        (record,) = timeline.read(tmp_path)
        assert record["pid"] == os.getpid() and [s for s, _, _ in record["events"]] == ["b", "c", "d"]
    finally:
        timeline.stop()
    assert timeline.events() == []


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["grpc", "relay"])
async def test_every_decode_token_is_followed_round_a_two_process_route(
    tiny_model: Path, tmp_path: Path, transport: str
) -> None:
    records = tmp_path / "timelines"
    records.mkdir()
    new_tokens = 12
    relay_only = [1] if transport == "relay" else []
    with running_cluster(
        tiny_model, [0, 2, 4], tmp_path, relay_only=relay_only, env={timeline.ENV: str(records)}
    ) as cluster:
        async with open_dialer() as dialer:
            await cluster.generate(dialer, GenerationRequest((1, 2, 3), 4))
            since = time.perf_counter_ns()
            tokens = await cluster.generate(dialer, GenerationRequest((5, 6, 7, 8), new_tokens))
            until = time.perf_counter_ns()
        assert len(tokens) == new_tokens
    # the nodes wrote their timelines as they exited
    nodes = [r for r in timeline.read(records) if "--layers" in r["argv"]]
    assert len(nodes) == 2
    for record in nodes:  # every batch of a node ran on its one engine thread
        assert {thread for stage, _, thread in record["events"] if stage.startswith("engine.")} == {"engine"}
    stages = token_stages(nodes, transport, [(since, until)])
    # the prompt's tail tick starts the first token's way; the last token's way stops at the
    # head, which runs no step for a finished generation
    assert stages["tokens"] == new_tokens - 1
    steps = stages["steps"]
    crossing = 4 if transport == "grpc" else 2
    assert len(steps) == 2 * (crossing + 6)
    assert [(s["shard"], s["stage"]) for s in steps][-1] == ("tail", "tick.finished")
    assert all(s["us"] >= 0 for s in steps)
    engine = [s["us"] for s in steps if s["stage"] == "engine.finished"]
    assert len(engine) == 2 and all(us > 0 for us in engine)
    assert stages["token_us"] > sum(engine)
    if transport == "grpc":
        assert set(stages["grpclib_send_us"]) == {"head", "tail"}
    else:
        assert stages["grpclib_send_us"] == {}


def test_a_named_threads_cpu_is_counted_under_its_name_and_the_main_threads_apart() -> None:
    started, stop = threading.Event(), threading.Event()

    def burn() -> None:
        name_this_thread("burner-thread-with-a-long-name")
        started.set()
        while not stop.is_set():
            sum(range(1000))  # user time

    pids = {"me": os.getpid()}
    before = thread_cpu(pids)
    worker = threading.Thread(target=burn)
    worker.start()
    try:
        assert started.wait(5)
        with open(f"/proc/self/task/{worker.native_id}/comm") as comm:
            assert comm.read().strip() == "burner-thread-w"  # the kernel keeps 15 bytes
        deadline = time.monotonic() + 20  # on a busy machine it may have a core only part of the time
        while True:
            time.sleep(0.1)
            during = thread_cpu(pids)
            label, user, system = during["me"][str(worker.native_id)]
            if user >= 0.1 or time.monotonic() > deadline:
                break
    finally:
        stop.set()
        worker.join()
    assert label == "burner-thread-w" and user >= 0.1  # its loop runs in user time
    assert during["me"][str(os.getpid())][0] == "main"
    split = per_token(before, during, tokens=10)["me"]["burner-thread-w"]
    assert split == {"user_ms": pytest.approx(user * 100), "system_ms": pytest.approx(system * 100)}

    # of two threads of one name, one ended between the readings: the other's CPU counts, and
    # the ended one's counts for nothing, not less than nothing
    before_two = {"p": {"1": ("main", 1.0, 0.0), "2": ("trio workers", 5.0, 0.5), "3": ("trio workers", 1.0, 0.0)}}
    after_one = {"p": {"1": ("main", 2.0, 0.0), "3": ("trio workers", 1.5, 0.25)}}
    assert per_token(before_two, after_one, tokens=1000) == {
        "p": {"main": {"user_ms": 1.0, "system_ms": 0.0}, "trio workers": {"user_ms": 0.5, "system_ms": 0.25}}
    }


def test_a_process_that_ended_is_left_out() -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()
    assert thread_cpu({"ended": ended.pid}) == {}
