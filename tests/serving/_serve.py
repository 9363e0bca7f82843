"""A real ``rmsnorm-deploy serve`` process on free loopback ports, for the serving tests: started,
waited for until ready (on the wire and in its own output), stopped cleanly."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.serving.triton.process import ServeProcess, start_serve_process

STARTUP_S = 90


class Served:
    """The running server (``serving.server.ServeProcess``: process, ports, log) and the tests'
    helpers around it."""

    def __init__(self, proc: ServeProcess):
        self.proc = proc
        self.children: set[int] = set()

    def __getattr__(self, name: str):  # process, http, grpc, metrics, log, url
        return getattr(self.proc, name)

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            return json.loads(response.read())

    def stats(self) -> dict:
        return self.get_json("/v2/models/model/stats")["model_stats"][0]


@contextlib.contextmanager
def running_server(model_dir: Path, *args: str) -> Iterator[Served]:
    """``serve model_dir [args]`` until the block ends; fails the test if it is not ready in time.
    A server still running at the end (a test may have stopped it) gets SIGTERM, then SIGKILL."""
    try:
        proc = start_serve_process(model_dir, timeout_s=STARTUP_S, args=args)
    except UserError as exc:
        pytest.fail(str(exc))
    try:
        yield Served(proc)
    finally:
        proc.stop()


def post_infer(url: str, body: dict, *, timeout: float = 30) -> tuple[int, str]:
    """POST a KServe v2 JSON inference request to ``url``: the HTTP status and body, errors included."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
