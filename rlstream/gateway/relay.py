"""The one relay of a streamed upstream answer (server-sent events) to the client, for every endpoint.

An endpoint reads the stream up to its first event (:func:`read_head`: what it needs to know before the headers go
out, such as the prompt token ids or the response id), then :func:`relay` hands the client that head and every
later line as the endpoint renders it (filtered, the model renamed, captured on the way), an event at a time, and
records the call once the stream ends, whichever way it ends.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import httpx
from starlette.responses import StreamingResponse

from rlstream.gateway.limits import RequestRejected

#: A streamed answer's lines are handed on an event at a time (up to its blank line); an upstream that writes long
#: runs of lines without one is handed on this many lines at a time.
MAX_LINES_PER_WRITE = 16


def first_data_event(line: str) -> bool:
    """Whether ``line`` is a data event with content (not blank, not ``[DONE]``): where a stream's head ends."""
    return line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")


def is_done(line: str) -> bool:
    """Whether ``line`` is the OpenAI streams' closing ``data: [DONE]`` (a call is captured before it is handed on)."""
    return line.startswith("data:") and line[5:].strip() == "[DONE]"


@dataclass
class CapturedAtDone:
    """A stream whose call is captured when the upstream's ``data: [DONE]`` arrives, before the client hears the
    end: ``capture`` runs once and raises :class:`~rlstream.gateway.limits.RequestRejected` for a capture Kafka
    cannot take, which ``refused(rejection, done_line)`` turns into the closing event(s) the client gets instead."""

    capture: Callable[[], None]
    render_line: Callable[[str], str]
    refused: Callable[[RequestRejected, str], str]
    done: bool = False

    def _capture_once(self) -> None:
        if not self.done:
            self.done = True
            self.capture()

    def render(self, line: str) -> str:
        """``line`` as the client gets it; at ``[DONE]`` the call is captured first."""
        if is_done(line):
            try:
                self._capture_once()
            except RequestRejected as refusal:
                return self.refused(refusal, line)
        return self.render_line(line)

    def at_end(self) -> None:
        """A stream that ended without ``[DONE]``: captured now (a refusal is logged and counted by the core)."""
        with contextlib.suppress(RequestRejected):
            self._capture_once()


async def read_head(response: httpx.Response, lines: AsyncIterator[str],
                    is_last: Callable[[str], bool]) -> list[str]:
    """The stream's lines up to and including the first that ``is_last`` accepts (all of them when none does).
    An upstream failure closes ``response`` and raises its :class:`httpx.HTTPError`."""
    head: list[str] = []
    try:
        async for line in lines:
            head.append(line)
            if is_last(line):
                break
    except httpx.HTTPError:
        await response.aclose()
        raise
    return head


async def relay(response: httpx.Response, lines: AsyncIterator[str], head: str, render: Callable[[str], str],
                on_head: Callable[[], Awaitable[None]], on_end: Callable[[], None]) -> AsyncIterator[str]:
    """Hand on ``head`` (rendered), then call ``on_head`` (the overhead is measured to the first event), then each
    later line through ``render``; at the end (done, failed or the client gone) close ``response`` and call
    ``on_end`` (the capture)."""
    try:
        yield head
        await on_head()
        event: list[str] = []
        async for line in lines:
            event.append(render(line))
            # a blank line ends a server-sent event: it goes on whole, in one write instead of one per line
            if not line or len(event) >= MAX_LINES_PER_WRITE:
                yield "".join(event)
                event.clear()
        if event:
            yield "".join(event)
    finally:
        await response.aclose()
        on_end()


def relayed(response: httpx.Response, lines: AsyncIterator[str], head: str, render: Callable[[str], str],
            on_head: Callable[[], Awaitable[None]], on_end: Callable[[], None],
            headers: dict[str, str]) -> StreamingResponse:
    """The client's streamed response: :func:`relay` as server-sent events with ``headers``."""
    return StreamingResponse(relay(response, lines, head, render, on_head, on_end), media_type="text/event-stream",
                             headers=headers)
