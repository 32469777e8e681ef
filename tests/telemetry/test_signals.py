"""stop_signals: SIGTERM and SIGINT set the event on the running loop; the handlers go after."""

import asyncio
import os
import signal

import pytest

from cortex.telemetry import stop_signals

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_signal_sets_the_event_every_time_it_comes(sig: signal.Signals) -> None:
    with stop_signals() as stop:
        os.kill(os.getpid(), sig)
        await asyncio.wait_for(stop.wait(), 5)
        stop.clear()  # a service listening for a second signal
        os.kill(os.getpid(), sig)
        await asyncio.wait_for(stop.wait(), 5)
    loop = asyncio.get_running_loop()
    assert not loop.remove_signal_handler(sig)  # already removed on exit
