"""Call a function with a wall-clock limit, in-process (reward functions: a slow one must not stall a step).

On the main thread the limit is a ``SIGALRM`` timer: the call is interrupted where it runs, in Python
code and in C code that checks for signals (``re`` does), and stops. Elsewhere (a worker thread, or
a timer already armed by someone else) the call runs in a daemon thread that is abandoned at the
limit: the caller gets :class:`TimeLimitExceeded` on time, but the abandoned call runs on in the
background until it returns. Neither way stops C code that never checks for signals.
"""

from __future__ import annotations

import signal
import threading


class TimeLimitExceeded(BaseException):
    """The call ran past its limit. A BaseException, so a callee's ``except Exception`` cannot swallow it."""


def call_with_time_limit(seconds: float | None, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or :class:`TimeLimitExceeded` after ``seconds`` (None or <= 0: no limit)."""
    if not seconds or seconds <= 0:
        return fn(*args, **kwargs)
    if threading.current_thread() is threading.main_thread() and signal.getitimer(signal.ITIMER_REAL)[0] == 0:
        return _with_alarm(seconds, fn, args, kwargs)
    return _with_thread(seconds, fn, args, kwargs)


def _with_alarm(seconds, fn, args, kwargs):
    def on_alarm(signum, frame):
        raise TimeLimitExceeded(f"ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def _with_thread(seconds, fn, args, kwargs):
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True, name="grpo_kit_time_limit")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeLimitExceeded(f"ran past {seconds:g} s (left running in a background thread)")
    if "error" in box:
        raise box["error"]
    return box["value"]
