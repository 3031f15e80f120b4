"""A local model hub that speaks the Hugging Face Hub's protocol, over real HTTP.

``GET /api/models/{repo}/revision/{rev}`` answers the commit and the file list (with sizes);
``GET /{repo}/resolve/{sha}/{file}`` redirects (302, as the Hub does for large files) to
``/cdn/{repo}/{sha}/{file}``, which serves the bytes. Repositories are directories given to
the constructor; the commit is a digest of their content, so changing a file makes a new one.
With ``token`` set, every request must carry it as a bearer token (401 otherwise). ``hits``
counts requests per kind (``api``, ``resolve``, ``cdn``).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote


class LocalHub:
    """The hub in a thread; ``url`` once entered."""

    def __init__(self, repos: dict[str, Path], token: str | None = None) -> None:
        self.repos = repos
        self.token = token
        self.hits: Counter[str] = Counter()
        self._server: ThreadingHTTPServer | None = None
        self.url = ""

    def sha(self, repo: str) -> str:
        digest = hashlib.sha1()
        for path in sorted(p for p in self.repos[repo].rglob("*") if p.is_file()):
            digest.update(path.relative_to(self.repos[repo]).as_posix().encode())
            digest.update(path.read_bytes())
        return digest.hexdigest()

    def _files(self, repo: str) -> list[tuple[str, int]]:
        root = self.repos[repo]
        return sorted(
            (p.relative_to(root).as_posix(), p.stat().st_size)
            for p in root.rglob("*")
            if p.is_file()
        )

    def __enter__(self) -> LocalHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return

            def _send(
                self, code: int, body: bytes = b"", headers: dict[str, str] | None = None
            ) -> None:
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path = unquote(self.path)
                if hub.token and self.headers.get("authorization") != f"Bearer {hub.token}":
                    self._send(401, b"unauthorized")
                    return
                if path.startswith("/api/models/") and "/revision/" in path:
                    hub.hits["api"] += 1
                    repo = path[len("/api/models/") :].split("/revision/")[0]
                    if repo not in hub.repos:
                        self._send(404, b"no such repo")
                        return
                    body = {
                        "id": repo,
                        "sha": hub.sha(repo),
                        "siblings": [{"rfilename": n, "size": s} for n, s in hub._files(repo)],
                    }
                    self._send(200, json.dumps(body).encode(), {"content-type": "application/json"})
                    return
                if "/resolve/" in path:
                    hub.hits["resolve"] += 1
                    repo, rest = path[1:].split("/resolve/", 1)
                    self._send(302, headers={"location": f"/cdn/{repo}/{rest}"})
                    return
                if path.startswith("/cdn/"):
                    hub.hits["cdn"] += 1
                    for repo in hub.repos:
                        prefix = f"/cdn/{repo}/{hub.sha(repo)}/"
                        if path.startswith(prefix):
                            file = hub.repos[repo] / path[len(prefix) :]
                            if file.is_file():
                                self._send(200, file.read_bytes())
                                return
                    self._send(404, b"no such file")
                    return
                self._send(404, b"unknown path")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
