"""Requests in flight, counted process-wide, for work that reacts to them or waits for none.

Process-wide on purpose, unlike the app's state (app/process.py): what they guard is shared by every app in the
process, its threads' OpenMP teams and the CPU time a file write takes from any response.

- `MODEL_REQUESTS`: API POSTs (the requests that may run a model) whose handlers are working, counted by the API
  routers' route class (app/lifecycle.py ParsedJsonRoute). A plain request's thread ends its OpenMP team when another
  one is working (app/openmp_teams.py).
- `API_POSTS`: API POSTs from their admission (their body read) to the end of their response, counted by app/main.py
  AdmissionGate.
  The run store's writer waits for none before it writes a run that left RAM (app/runstore.py): counted only while
  handlers work, a file's CPU time still landed on the response being sent and read."""
from __future__ import annotations

import threading


class InFlight:
    def __init__(self) -> None:
        self._none = threading.Condition(threading.Lock())
        self.in_flight = 0

    def entered(self) -> None:
        with self._none:
            self.in_flight += 1

    def left(self) -> None:
        with self._none:
            self.in_flight -= 1
            if self.in_flight <= 0:
                self._none.notify_all()

    def wait_for_none(self, timeout: float) -> bool:
        """Wait at most `timeout` s until none is in flight; True when none is."""
        with self._none:
            return self._none.wait_for(lambda: self.in_flight <= 0, timeout)


MODEL_REQUESTS = InFlight()
API_POSTS = InFlight()
