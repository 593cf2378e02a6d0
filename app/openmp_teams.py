"""One OpenMP team at a time in the served process, when requests overlap.

Why. GNU OpenMP (the OpenMP of torch's CPU wheels) gives every thread that starts a parallel region a team of helper
threads of its own, kept while that thread lives. anyio runs each request on whichever worker thread is free, so two
requests at once leave two workers with a team each, and an idle worker keeps its team for the 10 s anyio keeps it.
Once the process has more OpenMP threads than cores, GNU OpenMP spins ~100 times instead of ~300,000 at the end of a
parallel region before its threads sleep, and a forward (~100 regions) wakes them again at each one. A 128-token
minilm forward took 34-37 ms instead of 21-24 while two clients posted views, and 28-35 ms for one client right
after; with the rule below 23-28 and 21-24 ms (benchmarks/view_threads.py; benchmarks/results/first_view.md,
2026-11-29 10:50).

The rule. The thread that did a plain request's work ends its own team at the end of that work (app/streams.py
answered; omp_pause_resource_all) when another model request's handler is working: the other request's forward then
runs beside no idle team. One client alone keeps its worker's team from view to view and pays nothing; an ended team
costs the next forward on that thread a new helper thread, so it is not ended when nothing else is in flight.
- Not at the end of the model's turn: the first view's own tensor work, after it, would start a team again there.
- A request counts while its handler works (the routers' route class), not until its response is sent: counted that
  long, nearly every view ended its team and paid for a new one (two clients 41 ms a forward).
A job's thread ends its team as it hands the model to interactive work between two layers (app/scheduler.py), and
starts a new one at its next layer: views posted while a 1,500-token smollm2 job ran took 21-26 ms a forward instead
of 28-37, and the job itself did not get slower (`view_threads --job-tokens`). Otherwise jobs keep their teams.

Off with the setting `openmp_one_team` (ATTNLAB_OPENMP_ONE_TEAM=0)."""
from __future__ import annotations

import threading

from app.attention import drop_openmp_team
from app.in_flight import MODEL_REQUESTS


class TeamStats:
    released = 0  # threads that ended their team, if they had one (/metrics: attnlab_openmp_team_releases_total)
    enabled = True  # the setting openmp_one_team (set by create_app)
    _lock = threading.Lock()

    @classmethod
    def release(cls) -> bool:
        """End the calling thread's team (app/attention.py drop_openmp_team) and count it; False where it cannot."""
        if not drop_openmp_team():
            return False
        with cls._lock:
            cls.released += 1
        return True


def plain_work_done() -> bool:
    """Called on the thread that did a plain request's work, at its end (app/streams.py answered). Ends this thread's
    OpenMP team when another model request's handler is working too (this one counts itself); True when it did."""
    return TeamStats.enabled and MODEL_REQUESTS.in_flight > 1 and TeamStats.release()


def job_hands_over_team() -> bool:
    """Called on a job's thread between two layers of its forward as it hands the model to interactive work
    (app/scheduler.py): ends the job's team, so the interactive forward runs beside no other team."""
    return TeamStats.enabled and TeamStats.release()
