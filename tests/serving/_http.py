"""Plain HTTP to a server on 127.0.0.1 for the hostile tests: a request through ``http.client``, and
bytes on a raw socket as they are (framing that a client library would not send)."""

from __future__ import annotations

import http.client
import socket


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None,
            timeout: float = 30) -> tuple[int, dict, bytes]:
    """Status, headers and the whole body (a stream read to its end)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def raw(port: int, data: bytes) -> tuple[int, bytes]:
    """Bytes on a socket as they are; the status and body of the server's one answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                       if k.strip().lower() == "content-length"), None)
        while (length is None or len(body) < length) and (chunk := sock.recv(65536)):
            body += chunk
    return int(lines[0].split()[1]), body
