"""An ASGI middleware that refuses bodies over a size with an OpenAI-shaped 413, before the
body is read whole (a declared Content-Length is refused at once; a chunked body is
counted as it arrives and answered 413 as soon as it passes the limit)."""

from __future__ import annotations

import json
import logging

log = logging.getLogger("ray.serve")


class BodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _message(self) -> bytes:
        return json.dumps({"error": {
            "message": f"request body is larger than {self.max_bytes} bytes",
            "type": "invalid_request_error", "param": None,
            "code": "request_too_large"}}).encode()

    async def _refuse(self, send) -> None:
        body = self._message()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await self._refuse(send)
                except ValueError:
                    pass
        seen = 0
        started = refused = False

        async def counting_receive():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Answered here, at once (a parser that caught an error here would have
                    # made it a 400); the app sees the client gone. After the app has begun
                    # its answer, the body is cut off all the same.
                    refused = not started
                    if refused:
                        await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message):
            nonlocal started
            if refused:
                return  # the 413 is the answer
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception:
            if not refused:
                raise
            log.debug("a refused body's request ended with an error", exc_info=True)
