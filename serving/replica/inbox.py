"""A replica's inbox: the submissions and aborts that came on its channel, waiting for the model thread,
which takes everything at the start of a step (docs/architecture.md, "The engine on a thread of its own").

Three threads touch it, each through its own methods: the event loop counts an arrival in
(count_in), the preparing thread puts it once it is ready (put), the model thread takes the lot (take).
All under one condition, whose lock none of them holds for longer than a list swap. The lifecycle's
orders to the model thread come through it too: stop, and end every request held (end_all)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from serving.replica.step_result import Arrival
from serving.transport.protocol import Submit

# The longest the model thread sleeps in take() before it looks again whether the loop has closed
# without stop() (an exception on the way out), which must end the thread too, or the interpreter waits
# for it at exit.
MAX_WAIT_S = 0.5

# A submission prepared off the model thread, or one as it came for the model thread to prepare itself
# (Inbox.count_in).
Submission = Arrival | Submit


@dataclass(slots=True)
class Taken:
    """What the model thread took at the start of a step."""

    submissions: list[Submission]
    aborts: list[str]

    def __len__(self) -> int:
        return len(self.submissions) + len(self.aborts)


class Inbox:
    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._submissions: list[Submission] = []
        self._aborts: list[str] = []
        self._num_preparing = 0  # counted in, still being prepared
        self._is_model_waiting = False  # the model thread waits for work, its engine empty
        self._is_stopping = False
        self._end_message: str | None = None
        self._is_end_pending = False
        # Arrivals ever counted in. Written on the loop only; the outbox compares it, on the loop too, with
        # what the model thread had taken, to tell that nothing is left anywhere (idle).
        self.num_queued = 0

    @property
    def num_pending(self) -> int:
        """Arrivals not yet taken by the model thread (being prepared, or waiting in the inbox)."""
        return self._num_preparing + len(self._submissions)

    @property
    def is_stopping(self) -> bool:
        return self._is_stopping

    @property
    def end_message(self) -> str | None:
        """Set by end_all(): the message every request held, and every one admitted later, ends with."""
        return self._end_message

    # --- the event loop ----------------------------------------------------------------------------

    def count_in(self, submission: Submit | None) -> bool:
        """Count an arrival in. A submission that finds the model thread waiting with an empty engine and
        nothing being prepared goes in as it came (True): the model thread prepares it itself, with no
        step for it to hold up, and the request skips one thread's wake-up on its way to its first
        forward pass; nothing earlier is being prepared, so the inbox keeps arrival order. Otherwise
        (False) it is counted as being prepared, and the caller hands it to the preparing thread."""
        with self._ready:
            self.num_queued += 1
            if submission is not None and self._is_model_waiting and self._num_preparing == 0:
                self._submissions.append(submission)
                self._ready.notify()
                return True
            self._num_preparing += 1
            return False

    def count_out(self) -> None:
        """Take back a count_in() whose arrival the preparing thread refused (it is shutting down)."""
        with self._ready:
            self.num_queued -= 1
            self._num_preparing -= 1

    def stop(self) -> None:
        """The model thread returns once the step it is in, if any, ends."""
        with self._ready:
            self._is_stopping = True
            self._ready.notify()

    def end_all(self, message: str) -> None:
        """The model thread ends every request it holds with `message`, and any it admits later."""
        with self._ready:
            self._end_message = message
            self._is_end_pending = True
            self._ready.notify()

    # --- the preparing thread ----------------------------------------------------------------------

    def put(self, arrival: Arrival | None, abort: str | None) -> None:
        with self._ready:
            self._num_preparing -= 1
            if arrival is not None:
                self._submissions.append(arrival)
            if abort is not None:
                self._aborts.append(abort)
            self._ready.notify()

    # --- the model thread --------------------------------------------------------------------------

    def take(
        self, seconds_until_ready: Callable[[], float | None], is_loop_closed: Callable[[], bool]
    ) -> Taken | None:
        """Wait until there is something to do, and take it: None when the thread must return (stopped,
        or its loop closed). `seconds_until_ready` is the engine's: 0 when it is due (a generative engine
        whenever it holds work, an encoder's batch when full or its oldest input has waited its delay),
        None when it holds nothing. A new arrival wakes the wait."""
        with self._ready:
            while not (self._is_stopping or self._submissions or self._aborts or self._is_end_pending):
                due_s = seconds_until_ready()
                if due_s == 0:
                    break
                if is_loop_closed():
                    return None
                self._is_model_waiting = due_s is None
                self._ready.wait(timeout=MAX_WAIT_S if due_s is None else min(due_s, MAX_WAIT_S))
                self._is_model_waiting = False
            if self._is_stopping:
                return None
            taken = Taken(self._submissions, self._aborts)
            self._submissions, self._aborts = [], []
            self._is_end_pending = False
            return taken

    @property
    def is_model_waiting(self) -> bool:
        """Whether the model thread sleeps in take() with an empty engine (tests wait for it)."""
        with self._ready:
            return self._is_model_waiting
