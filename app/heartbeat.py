"""A heartbeat: a daemon thread that calls a function every period until an event is set (this replica's registration
in app/fleet.py, the job leases of app/fleetjobs.py). A module of its own: both import it, and app/fleet.py reaches
app/jobs.py, which imports app/fleetjobs.py."""
from __future__ import annotations

import threading
from collections.abc import Callable


def start_heartbeat(name: str, every_s: float, beat: Callable[[], None], stop: threading.Event) -> threading.Thread:
    """Call `beat` every `every_s` seconds, the first call one period from now, until `stop` is set."""
    def run() -> None:
        while not stop.wait(every_s):
            beat()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
