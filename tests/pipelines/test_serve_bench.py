"""The serve_bench stage's process handling without a GPU (the stage's flow on CPU, the skip, runs in the smoke
e2e test, tests/pipelines/test_dvc_pipeline.py)."""

from __future__ import annotations

import pytest


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_the_stage_waits_for_the_server_and_reports_one_that_died(tmp_path):
    """serve_bench's wait: returns once /health answers; a server that exits first is an error carrying its log."""
    import socket
    import subprocess
    import sys

    from pipelines.common import stop_process
    from pipelines.serve_bench import _wait_until_served

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    log.write_text("loading weights...\nCUDA out of memory\n")
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="(?s)the SGLang server .* exited with code 3.*CUDA out of memory"):
        _wait_until_served(port, dead, 5, log)
    alive = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER, str(port)])
    try:
        _wait_until_served(port, alive, 30, log)
        assert alive.poll() is None
    finally:
        stop_process(alive)
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="raise serve.startup_timeout_s"):
            _wait_until_served(port, silent, 1, log)
    finally:
        stop_process(silent)
