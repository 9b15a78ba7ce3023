"""Files for the `server` fixture (tests/conftest.py): a local HTTP server on 127.0.0.1 serving generated weight
files the way real servers fail."""
from __future__ import annotations

import http.server
import time

STALL_S = 0.5  # the client's timeout in these tests; the stalled route waits longer


class Files(http.server.BaseHTTPRequestHandler):
    """GET /ROUTE/NAME: `good` serves the file (with ranges; 416 past its end), `whole` all of it whatever the
    range, `unsized` all of it without a Content-Length, `short` half of it then closes, `wrong` other bytes
    of the same size, `stall` a few bytes then nothing, `slow` as `good` after a pause, anything else 404.
    Requests are logged."""

    files: dict[str, bytes] = {}
    log: list[tuple[str, str | None]] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        route, _, name = self.path.strip("/").partition("/")
        self.log.append((self.path, self.headers.get("Range")))
        body = self.files.get(name)
        if body is None or route not in ("good", "short", "wrong", "stall", "whole", "unsized", "slow"):
            self.send_error(404, "Not Found")
            return
        if route == "unsized":  # no Content-Length: the body ends when the connection closes
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True
            return
        if route == "slow":  # answers late: a second client asks while the first is still waiting
            time.sleep(STALL_S / 2)
        if route == "wrong":
            body = bytes(255 - b for b in body)
        start = 0
        rng = self.headers.get("Range")
        if rng and route == "good":  # "whole" ignores ranges, as some servers do
            start = int(rng.removeprefix("bytes=").rstrip("-"))
            if start >= len(body):
                self.send_error(416, "Range Not Satisfiable")
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if route == "short":
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if route == "stall":
            self.wfile.write(body[:10])
            self.wfile.flush()
            time.sleep(STALL_S * 4)
            return
        self.wfile.write(body[start:])

    def log_message(self, *args):
        """Silent: http.server would log every request on stderr."""
