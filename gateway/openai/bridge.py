"""The thread <-> asyncio bridge: the gateway's blocking ``stream()`` iterators, one thread per output,
fed to the event loop; cancellation when the client goes away; SSE framing.

Each output gets a thread of its own (not a shared pool that a large n could fill). Leaving the
iteration early sets a cancel flag: each thread stops at its next round, and its generator's cleanup
releases both services' caches.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.generation import Gateway, deadline_from_timeout
from specdec.sequence import SequenceState


async def deltas(gateway: Gateway, seqs: list[SequenceState], k: int | None, timeout: float | None):
    """Run every sequence in its own thread; yield (index, Delta) as rounds complete.

    Leaving the iteration early (client disconnect) sets the cancel flag: each thread stops at its
    next round and its generator's cleanup releases both services' caches. An exception in a thread
    is raised here.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()
    done = object()

    def run(i: int, seq: SequenceState) -> None:
        try:
            for delta in gateway.stream(seq, k, deadline_from_timeout(timeout), cancelled=cancel.is_set):
                loop.call_soon_threadsafe(queue.put_nowait, (i, delta))
        except BaseException as exc:  # surfaced to the client as an error event
            loop.call_soon_threadsafe(queue.put_nowait, (i, exc))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, (i, done))

    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(seqs)]
    for t in threads:
        t.start()
    remaining = len(seqs)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        cancel.set()


async def run_to_end(gateway: Gateway, seqs: list[SequenceState], k: int | None, timeout: float | None,
                     request: Request) -> None:
    """A non-streamed request: every sequence runs to its end on a thread of its own; a client that
    goes away cancels them all, freeing the caches."""
    async def disconnected() -> None:  # the body is read: the next ASGI message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    rounds = deltas(gateway, seqs, k, timeout)
    try:
        async for _ in rounds:
            if watcher.done():
                break
    finally:
        watcher.cancel()
        await rounds.aclose()


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: one ``data: <json>`` event per chunk, then ``data: [DONE]``. A client that
    disconnects stops the iteration, which cancels the generation (see ``deltas``)."""
    async def body():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
