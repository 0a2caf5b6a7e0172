"""A TCP proxy in front of a server, which the harness can take down for a while on the same port.

    with FlakyProxy(upstream_port) as proxy:      # clients use proxy.url
        proxy.arm(re.compile(rb"^PUT \\S*/datasets/"), seconds=30)

Armed, the first request whose first bytes match the pattern starts an outage: that connection and
every open one are reset (RST), the listening socket is closed, so new connections are refused, and
after `seconds` it listens again on the same port: what clients see when the server restarts.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Outage:
    trigger: str
    """The request line that started it."""
    started: float
    ended: float | None = None


@dataclass
class FlakyProxy:
    upstream_port: int
    port: int = 0
    outages: list[Outage] = field(default_factory=list)
    _armed: list[tuple[re.Pattern[bytes], float]] = field(default_factory=list)
    _conns: set[socket.socket] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _listener: socket.socket | None = None
    _stopped: bool = False
    _up: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FlakyProxy:
        self._listen()
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped = True
        self._close_listener()
        self._reset_all()

    def arm(self, pattern: re.Pattern[bytes], seconds: float) -> None:
        """The next request matching pattern starts an outage of `seconds` (patterns fire in arming order)."""
        with self._lock:
            self._armed.append((pattern, seconds))

    # ---- the server side

    def _listen(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._up.set()

    def _close_listener(self) -> None:
        self._up.clear()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None

    def _serve(self) -> None:
        while not self._stopped:
            self._up.wait(1)
            listener = self._listener
            if listener is None:
                continue
            try:
                client, _ = listener.accept()
            except OSError:
                continue  # closed for an outage (or for good)
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            _reset(client)
            return
        with self._lock:
            self._conns.update((client, upstream))
        back = threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True)
        back.start()
        self._pump(client, upstream, True)
        back.join(5)
        with self._lock:
            self._conns.difference_update((client, upstream))
        for sock in (client, upstream):
            sock.close()

    def _pump(self, src: socket.socket, dst: socket.socket, inspect: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if inspect and self._triggers(chunk):
                    return
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _triggers(self, chunk: bytes) -> bool:
        """True when the chunk starts an outage (it is then never forwarded)."""
        with self._lock:
            if not self._armed or not self._armed[0][0].search(chunk):
                return False
            _, seconds = self._armed.pop(0)
        outage = Outage(chunk.split(b"\r\n", 1)[0].decode(errors="replace")[:200], time.time())
        self.outages.append(outage)
        self._close_listener()
        self._reset_all()
        threading.Thread(target=self._restore, args=(outage, seconds), daemon=True).start()
        return True

    def _restore(self, outage: Outage, seconds: float) -> None:
        time.sleep(seconds)
        if not self._stopped:
            self._listen()
        outage.ended = time.time()

    def _reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for sock in conns:
            _reset(sock)


def _reset(sock: socket.socket) -> None:
    """Close with RST, as a server process that died would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
