"""`make test-clock-ahead`: every Python process of the run starts with its wall clock moved ahead.

The Makefile puts this folder first on PYTHONPATH and sets LLMFT_TEST_CLOCK_AHEAD_DAYS; Python imports
``sitecustomize`` at start-up (the ``site`` module), so pytest and every Python process it starts (trainers,
torchrun workers, kfp.local tasks, the MLflow server) inherit the variable and move their clock too. The
time-machine package moves the wall clock only (time.time, time.gmtime, datetime.now, ...): the monotonic clock,
and so every sleep and timeout, stays real. A Python without time-machine (the vLLM venv) runs unmoved.

libfaketime was tried first (LD_PRELOAD, moves C programs too): 0.9.10 (Debian 12) fails Python's
``time.sleep`` with EINVAL when the monotonic clock is left alone, and hangs it when it is moved.
"""

import os

_DAYS = os.environ.get("LLMFT_TEST_CLOCK_AHEAD_DAYS")
if _DAYS:
    try:
        import datetime

        import time_machine
    except ImportError:
        pass
    else:
        _ahead = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=float(_DAYS))
        time_machine.travel(_ahead, tick=True).start()
