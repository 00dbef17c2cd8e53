#!/usr/bin/env python3
"""dom0's end of the interop run's checked payloads (HTTP: its framing carries the
length, so a transfer is whole or visibly short): GET /down.bin serves the file to
send the domU; GET /slow.bin serves it paced over 90 s, a stream that lasts through
the back end's restarts; POST /up stores what the domU sends; GET /flag/NAME answers
200 once dom0 has raised that flag (made /root/flag-NAME), else 404. Each file's SHA-256 is
printed where it starts and where it lands, and the run compares them."""
import http.server
import os
import socketserver
import sys
import time

DOWN, UP = sys.argv[1], sys.argv[2]


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/flag/"):
            # A flag dom0 raises (a file /root/flag-NAME) for a domU to wait on.
            name = self.path[len("/flag/") :]
            up = name.isalnum() and os.path.exists(f"/root/flag-{name}")
            self.send_response(200 if up else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path not in ("/down.bin", "/slow.bin"):
            self.send_error(404)
            return
        with open(DOWN, "rb") as f:
            data = f.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.path == "/down.bin":
            self.wfile.write(data)
            return
        # 256 pieces, one every 90/256 s: the pacing of a stream, not a cost.
        piece = len(data) // 256
        for k in range(0, len(data), piece):
            self.wfile.write(data[k : k + piece])
            self.wfile.flush()
            time.sleep(90 / 256)

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        got = self.rfile.read(n)
        with open(UP, "wb") as f:
            f.write(got)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


Server(("0.0.0.0", 8000), Handler).serve_forever()
