"""A small OpenAI-compatible streaming server over real HTTP, with latencies the tests control.

It stands in for the model server (the real one, vLLM behind Ray Serve, is exercised by the demo and
the serving tests); what is under test is the load generator's client side: timing, SSE parsing,
open-loop sending, timeouts and errors.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL = "fake-model"


@dataclass
class Behaviour:
    ttft_s: float = 0.05  # from request received to the first token
    itl_s: float = 0.01  # between tokens
    status: int = 200
    hang: bool = False  # accept the request and never answer
    report_usage: bool = True


@dataclass
class Received:
    t: float  # time.perf_counter() when the request arrived
    path: str
    body: dict[str, Any]


@dataclass
class FakeServer:
    base_url: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    received: list[Received] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _app(server: FakeServer) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        server.received.append(Received(time.perf_counter(), request.path, body))
        b = server.behaviour
        if b.hang:
            await asyncio.sleep(3600)
        if b.status != 200:
            return web.json_response({"error": {"message": "overloaded", "code": b.status}}, status=b.status)
        if body.get("model") != MODEL:
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        chat = request.path.endswith("/chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # like vLLM: an immediate role-only chunk that carries no token
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        await asyncio.sleep(b.ttft_s)
        n = int(body["max_tokens"])
        for i in range(n):
            if i:
                await asyncio.sleep(b.itl_s)
            tok = f" w{i}"
            choice = {"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok}
            await resp.write(_sse({"choices": [choice], "usage": None}))
        if b.report_usage:
            prompt = body.get("prompt") or body["messages"][0]["content"]
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
            await resp.write(_sse({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


def serve_in_thread() -> Iterator[FakeServer]:
    """Runs the server on its own event loop in a thread until the generator is closed."""
    port = _free_port()
    server = FakeServer(base_url=f"http://127.0.0.1:{port}")
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = web.AppRunner(_app(server), handle_signals=False, shutdown_timeout=1.0)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        started.set()

    def run() -> None:
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=run, name="fake-openai", daemon=True)
    thread.start()
    assert started.wait(10), "fake server did not start"
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
