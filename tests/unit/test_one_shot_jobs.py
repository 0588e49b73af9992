"""One-shot jobs (observe/jobs.ObserveJobs.submit): every submitted job runs, however late a worker
picks it up. Under APScheduler a one-shot job picked up more than its misfire grace (1 s) late was
dropped and its future never completed: on a loaded CI box the prober then waited for ever on a probe
that never ran, and every later `tunerd probe` with it."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

from tests.unit.fakes import make_config
from tunerd.observe.jobs import ONE_SHOT_WORKERS, WAKE, ObserveJobs


def test_a_job_that_waits_for_a_free_worker_still_runs_and_wakes_the_loop(tmp_path: Path) -> None:
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    jobs = ObserveJobs(events, make_config(tmp_path, tmp_path))
    gate = threading.Event()
    try:
        busy = [jobs.submit(gate.wait) for _ in range(ONE_SHOT_WORKERS)]  # every worker held
        late = jobs.submit(lambda: "ran")
        # Longer than APScheduler's misfire grace: the old scheduler dropped the job here.
        assert not late.done() and not threading.Event().wait(1.5)
        gate.set()
        assert late.result(timeout=30) == "ran"
        assert all(f.result(timeout=30) for f in busy)
        woken = [events.get(timeout=30) for _ in range(ONE_SHOT_WORKERS + 1)]
        assert woken == [WAKE] * (ONE_SHOT_WORKERS + 1)
    finally:
        gate.set()
        jobs.stop()


def test_a_job_submitted_after_stop_fails_its_future_instead_of_raising(tmp_path: Path) -> None:
    jobs = ObserveJobs(queue.SimpleQueue(), make_config(tmp_path, tmp_path))
    jobs.stop()
    future = jobs.submit(lambda: 1)
    assert isinstance(future.exception(timeout=1), RuntimeError)
