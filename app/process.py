"""The app's mutable state, one owner: `ProcessState`, built by create_app (app/main.py), kept on `app.state.process`.

Nothing of it is a module global: two apps in one process (tests make several) each have their own job board, job
logs, lifecycle, fleet state and counts. Who reaches it, and how:
- the middleware is given its part when create_app adds it (RequestGuard the lifecycle, FleetRouter the fleet,
  RequestCounter the status counts);
- routes and app/streams.py through their request (`request.app.state.process`); a job's thread takes what it needs
  from the request that started it (its board, its log, the lifecycle's cut-off), and work inside a job reaches the
  board through the job (`job.board`, set when it was registered);
- the lifespan starts and stops the fleet; serve.py's signal handling finds the served app's state (the drain thread
  and the shutdown get it passed in).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from app.costs import CostMeasures
from app.fleet import Fleet
from app.jobs import JobBoard
from app.lifecycle import Lifecycle
from app.metrics import StatusCounts
from app.streams import JobLogs


@dataclass
class ProcessState:
    jobs: JobBoard = field(default_factory=JobBoard)  # the unfinished jobs (app/jobs.py)
    job_logs: JobLogs = field(default_factory=JobLogs)  # the jobs' numbered events, kept for a re-attach (app/streams.py)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # shutdown begun, cut off (app/lifecycle.py)
    status: StatusCounts = field(default_factory=StatusCounts)  # responses by status (/metrics)
    measures: CostMeasures = field(default_factory=CostMeasures)  # its models' measured speed (app/costs.py)
    fleet: Fleet = field(init=False)  # the registry and the drain (app/fleet.py), over `jobs`

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.jobs)

