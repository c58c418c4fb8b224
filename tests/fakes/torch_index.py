"""PyTorch's CPU wheel index, as a test serves it on 127.0.0.1: the simple-index pages (PEP 503
HTML) for torch and torchvision, listing ``+cpu`` builds. The wheels themselves are not served:
the tests ask install.sh for its decision (``--dry-run``), not for a download."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def cpu_index(pages: dict[str, str]) -> Iterator[str]:
    """A simple index on 127.0.0.1 serving ``pages`` (path -> HTML); yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write((body or "not found").encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/whl"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def simple_page(name: str, *versions: str) -> str:
    links = "".join(
        f'<a href="/whl/cpu/{name}-{v.replace("+", "%2B")}-cp311-cp311-manylinux_2_28_x86_64.whl'
        f'#sha256=00">{name}-{v}-cp311-cp311-manylinux_2_28_x86_64.whl</a><br/>\n'
        for v in versions
    )
    return f"<!DOCTYPE html><html><body>\n{links}</body></html>\n"


CPU_PAGES = {
    "/whl/cpu/torch/": simple_page("torch", "2.13.0+cpu", "2.14.1+cpu"),
    "/whl/cpu/torchvision/": simple_page("torchvision", "0.29.1+cpu"),
}
