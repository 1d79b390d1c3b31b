"""asyncio task helpers shared by the network and node planes. Never imports torch."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_all(*tasks: asyncio.Task | None) -> None:
    """Cancel ``tasks`` (None skipped) and wait until each has ended, whatever it raised."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
