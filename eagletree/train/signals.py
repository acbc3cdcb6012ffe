"""SIGINT and SIGTERM during training: the step in progress ends and is saved, then the run stops."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

from .config import TrainingError


class TrainingInterrupted(TrainingError):
    """SIGINT or SIGTERM stopped a run after a step, with a checkpoint of that step (the message names it)."""


@contextlib.contextmanager
def stop_on_signals():
    """Yield a list that SIGINT/SIGTERM append to instead of stopping the process at once (so the step in progress
    ends and is saved); a second signal acts as usual. Only in the main thread, where signals are delivered."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    before = {}

    def handler(signum, frame):
        got.append(signum)
        for sig, old in before.items():
            signal.signal(sig, old)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # one the process was started to ignore (nohup) stays so
            before[sig] = signal.signal(sig, handler)
    try:
        yield got
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def interrupted(got: list[int], step: int, steps: int, out: Path) -> TrainingInterrupted:
    """The error that ends a run stopped after `step` by the signals `got` (empty: another process got one)."""
    name = signal.Signals(got[0]).name if got else "a signal to another process"
    return TrainingInterrupted(
        f"interrupted by {name} after step {step} of {steps}: saved "
        f"{out / 'checkpoints' / f'step-{step:07d}'}; run the same command with --resume to "
        "continue"
    )
