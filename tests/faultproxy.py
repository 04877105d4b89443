"""A loopback HTTP proxy that injects faults, per request, in front of a real server (moto's S3, the
test HTTP server): drop the connection after N bytes of body, stall, end a body early while its full
Content-Length is announced, or answer an error status instead of the server.

Each client connection carries one request: the proxy forwards it (``Connection: close`` both ways),
reads the server's whole response, then sends it, or its faulty version, back. Tests script faults
with :meth:`FaultProxy.inject` and read :attr:`FaultProxy.log` to see what the clients asked for.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from dataclasses import dataclass, field

__all__ = ["Drop", "Fault", "FaultProxy", "IgnoreRange", "Request", "Stall", "Status", "Truncate"]


@dataclass(frozen=True)
class Fault:
    """What to do to one response."""


@dataclass(frozen=True)
class Drop(Fault):
    """Send the headers and ``after`` bytes of the body, then reset the connection (RST)."""

    after: int = 0


@dataclass(frozen=True)
class Truncate(Fault):
    """Send the headers (with the full Content-Length) and ``after`` bytes of the body, then close cleanly."""

    after: int = 0


@dataclass(frozen=True)
class Stall(Fault):
    """Send the headers and ``after`` bytes of the body (nothing at all when ``after`` is None), then
    go silent for ``seconds`` (or until the proxy stops), then close."""

    after: int | None = 0
    seconds: float = 60.0


@dataclass(frozen=True)
class IgnoreRange(Fault):
    """Forward the request without its ``Range`` header, as a server that does not do ranges answers."""


_S3_CODES = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 503: "SlowDown"}


@dataclass(frozen=True)
class Status(Fault):
    """Answer ``code`` instead of the server, with an S3-style XML error body."""

    code: int = 503


@dataclass
class Request:
    """One request as the proxy saw it, and the fault it got (None: passed through)."""

    method: str
    path: str
    headers: dict[str, str]
    fault: Fault | None = None

    @property
    def range_start(self) -> int | None:
        """The first byte of a ``Range: bytes=N-`` header, None without one."""
        value = self.headers.get("range")
        return int(value.removeprefix("bytes=").split("-")[0]) if value else None


def _aimed_at(path: str, request_path: str) -> bool:
    """Whether a rule for ``path`` concerns a request: its path contains ``path``, except that a rule
    for a shard is not spent on the request for the shard's index beside it (``SHARD.idx``)."""
    target = request_path.split("?", 1)[0]
    if target.endswith(".idx") and not path.endswith(".idx"):
        return False
    return path in request_path


@dataclass
class _Rule:
    fault: Fault
    method: str | None
    path: str
    skip: int
    times: int
    when_range: int | None
    used: int = 0

    def matches(self, request: Request) -> bool:
        if self.method is not None and request.method != self.method:
            return False
        if not _aimed_at(self.path, request.path):
            return False
        return self.when_range is None or request.range_start == self.when_range


@dataclass
class FaultProxy:
    """``FaultProxy(upstream_host, upstream_port)``; ``url`` is where clients connect."""

    upstream: tuple[str, int]
    log: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._clients: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def inject(
        self,
        fault: Fault,
        *,
        path: str = "",
        method: str | None = "GET",
        skip: int = 0,
        times: int = 1,
        range_start: int | None = None,
    ) -> None:
        """Give ``fault`` to the requests whose path contains ``path`` (and method, and Range start
        when given): after letting ``skip`` of them through, to the next ``times`` of them. Rules are
        consulted in the order given; a request goes to the first one that matches and is not spent."""
        with self._lock:
            self._rules.append(_Rule(fault, method, path, skip, times, range_start))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.log.clear()

    def requests(self, path: str = "", method: str | None = "GET") -> list[Request]:
        with self._lock:
            return [r for r in self.log if _aimed_at(path, r.path) and (method is None or r.method == method)]

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in the serving thread (Linux)
        self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            _close(client)
        self._thread.join(timeout=5)

    # -- serving ------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._clients.add(client)
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _choose(self, request: Request) -> Fault | None:
        with self._lock:
            self.log.append(request)
            for rule in self._rules:
                if rule.used < rule.skip + rule.times and rule.matches(request):
                    rule.used += 1  # the first live rule that matches decides: skip (pass) or fault
                    if rule.used <= rule.skip:
                        return None
                    request.fault = rule.fault
                    return rule.fault
            return None

    def _handle(self, client: socket.socket) -> None:
        try:
            head, body = _read_message(client, request=True)
            if head is None:
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = _headers(lines[1:])
            fault = self._choose(Request(method, path, headers))
            if isinstance(fault, Status):
                client.sendall(_error_response(fault.code))
                return
            if isinstance(fault, Stall) and fault.after is None:
                self._stop.wait(fault.seconds)
                return
            if isinstance(fault, IgnoreRange):
                head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"range:"))
            upstream = socket.create_connection(self.upstream, timeout=30)
            try:
                upstream.sendall(_with_close(head) + body)
                response_head, response_body = _read_message(upstream, request=False, head_only=method == "HEAD")
            finally:
                upstream.close()
            if response_head is None:
                return
            response_head = _with_close(response_head)
            if fault is None or isinstance(fault, IgnoreRange):
                client.sendall(response_head + response_body)
            elif isinstance(fault, (Drop, Truncate, Stall)):
                client.sendall(response_head + response_body[: fault.after])
                if isinstance(fault, Drop):
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif isinstance(fault, Stall):
                    self._stop.wait(fault.seconds)
                else:
                    client.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # a client that gave up (a timeout) closes its end: nothing to report
        finally:
            with self._lock:
                self._clients.discard(client)
            _close(client)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def _headers(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name:
            found[name.strip().lower()] = value.strip()
    return found


def _with_close(head: bytes) -> bytes:
    """The head with its Connection header replaced by ``Connection: close`` (one request per connection)."""
    lines = [line for line in head.split(b"\r\n") if line and not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _read_message(sock: socket.socket, request: bool, head_only: bool = False) -> tuple[bytes | None, bytes]:
    """Read one HTTP message: its head (through the blank line) and its body (Content-Length bytes, or
    up to the close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    headers = _headers(head.decode("latin-1").split("\r\n")[1:])
    status = 0 if request else int(head.split(b" ", 2)[1])
    if head_only or status in (204, 304) or 100 <= status < 200:
        return head + b"\r\n\r\n", b""
    if "content-length" in headers:
        length = int(headers["content-length"])
        while len(body) < length:
            chunk = sock.recv(min(1 << 20, length - len(body)))
            if not chunk:
                break
            body += chunk
        return head + b"\r\n\r\n", body
    if request:
        return head + b"\r\n\r\n", body
    while chunk := sock.recv(1 << 20):  # no length: the body ends at the close
        body += chunk
    return head + b"\r\n\r\n", body


def _error_response(code: int) -> bytes:
    name = _S3_CODES.get(code, "InjectedError")
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{name}</Code>'
        f"<Message>injected by the fault proxy</Message></Error>"
    ).encode()
    reason = {403: "Forbidden", 404: "Not Found", 500: "Internal Server Error", 503: "Service Unavailable"}
    head = (
        f"HTTP/1.1 {code} {reason.get(code, 'Error')}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body
