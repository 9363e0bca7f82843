"""A real ``rmsnorm-deploy serve`` process on free loopback ports, for the serving tests: started,
waited for until ready (on the wire and in its own output), stopped cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from rmsnorm_deploy.serving.server import free_ports

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 90


class Served:
    """The server process, its ports and everything it printed."""

    def __init__(self, process: subprocess.Popen, http: int, grpc: int, metrics: int, log: list[str]):
        self.process, self.http, self.grpc, self.metrics, self.log = process, http, grpc, metrics, log
        self.children: set[int] = set()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http}{path}"

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            return json.loads(response.read())

    def stats(self) -> dict:
        return self.get_json("/v2/models/model/stats")["model_stats"][0]


@contextlib.contextmanager
def running_server(model_dir: Path) -> Iterator[Served]:
    """``serve model_dir`` until the block ends; fails the test if it is not ready in time.
    A server still running at the end (a test may have stopped it) gets SIGTERM, then SIGKILL."""
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.Popen(
        [sys.executable, "-m", "rmsnorm_deploy", "serve", str(model_dir), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(process.stdout), daemon=True).start()
    server = Served(process, http, grpc, metrics, log)
    deadline = time.monotonic() + STARTUP_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"serve exited with {process.returncode} before it was ready:\n{''.join(log)}")
            try:
                with urllib.request.urlopen(server.url("/v2/health/ready"), timeout=2) as response:
                    # ready on the wire, and serve has said so (it prints after the server is up)
                    if response.status == 200 and any(line.startswith("ready") for line in log):
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve was not ready within {STARTUP_S} s:\n{''.join(log)}")
            time.sleep(0.2)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


def post_infer(url: str, body: dict, *, timeout: float = 30) -> tuple[int, str]:
    """POST a KServe v2 JSON inference request to ``url``: the HTTP status and body, errors included."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
