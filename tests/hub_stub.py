"""A loopback HTTP stub of the Hub endpoints that huggingface_hub's uploads use (no Xet, no LFS).

Real HTTP from the real client: ``create_repo``, model-card YAML validation, ``preupload`` (every file
answered as a regular upload) and the NDJSON ``commit``. Received files are kept for assertions.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubStub:
    def __init__(self) -> None:
        self.repos: list[str] = []
        self.files: dict[str, dict[str, bytes]] = {}
        self.commit_messages: list[str] = []
        self.authorizations: list[str] = []
        self.served: dict[str, dict[str, bytes]] = {}  # repo -> files a download may fetch
        self.requested: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _json(self, payload, status: int = 200) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _file(self, head: bool) -> None:
                path = self.path.split("?")[0]
                if path.startswith("/api/models/"):
                    repo = path[len("/api/models/"):].split("/revision/")[0]
                    files = stub.served.get(repo)
                    if files is None:
                        return self._json({"error": "not found"}, status=404)
                    return self._json({"id": repo, "modelId": repo, "sha": "b" * 40, "private": False,
                                       "siblings": [{"rfilename": f} for f in sorted(files)]})
                if "/resolve/" in path:
                    repo, rest = path.lstrip("/").split("/resolve/")
                    filename = rest.split("/", 1)[1]
                    data = stub.served.get(repo, {}).get(filename)
                    if data is None:
                        return self._json({"error": "not found"}, status=404)
                    if not head:
                        stub.requested.append(filename)
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("ETag", f'"{abs(hash(data))}"')
                    self.send_header("X-Repo-Commit", "b" * 40)
                    self.end_headers()
                    if not head:
                        self.wfile.write(data)
                    return None
                return self._json({"error": f"stub has no {path}"}, status=404)

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                self._file(head=False)

            def do_HEAD(self) -> None:  # noqa: N802 - http.server API
                self._file(head=True)

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                stub.authorizations.append(self.headers.get("Authorization", ""))
                body = self._body()
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo = f"{req.get('organization') or 'tester'}/{req['name']}" if "/" not in req["name"] else req["name"]
                    stub.repos.append(repo)
                    self._json({"url": f"{stub.url}/{repo}", "name": repo, "id": repo})
                elif path == "/api/validate-yaml":
                    self._json({})
                elif "/preupload/" in path:
                    files = json.loads(body)["files"]
                    self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                          for f in files]})
                elif "/commit/" in path:
                    repo = path.split("/api/models/")[1].split("/commit/")[0]
                    received = stub.files.setdefault(repo, {})
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "header":
                            stub.commit_messages.append(item["value"].get("summary", ""))
                        elif item["key"] == "file":
                            received[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    oid = "a" * 40
                    self._json({"commitUrl": f"{stub.url}/{repo}/commit/{oid}", "commitOid": oid})
                else:
                    self._json({"error": f"stub has no {path}"}, status=404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
