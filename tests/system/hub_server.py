"""A small stand-in for the Hugging Face Hub's file endpoints, so the real huggingface_hub
client runs against it (``HF_ENDPOINT``) with no internet.

``python hub_server.py REPOS HOST PORT STATS [BYTES_PER_S]`` serves every folder
``REPOS/<org>/<name>`` as model ``org/name`` at one commit:

- ``GET /api/models/<org>/<name>[/revision/<rev>]``: id, sha, siblings with sizes (model_info);
- ``HEAD``/``GET /<org>/<name>/resolve/<rev>/<file>``: the file, with the headers the client
  checks (``X-Repo-Commit``, ``ETag``/``X-Linked-Etag``, ``Content-Length``) and ``Range``
  requests (206) for safetensors headers; ``X-Error-Code`` on a 404 as the Hub sends it.

After every request it writes ``STATS``: per client address, the body bytes and the files it
got whole (``files``) and by range (``ranges``) as ``org/name/file``, so a test asserts what
each host downloaded.
``BYTES_PER_S`` slows bodies down (a download long enough to be seen in progress).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RESOLVE = re.compile(r"^/([\w.-]+/[\w.-]+)/resolve/([\w.-]+)/(.+)$")
_INFO = re.compile(r"^/api/models/([\w.-]+/[\w.-]+)(?:/revision/([\w.-]+))?$")


class Hub:
    def __init__(self, root: Path, stats: Path, rate: float) -> None:
        self.root, self.stats_file, self.rate = root, stats, rate
        self.lock = threading.Lock()
        self.stats: dict[str, dict] = {}

    def repo(self, repo_id: str) -> Path | None:
        folder = self.root / repo_id
        return folder if folder.is_dir() else None

    @staticmethod
    def commit(folder: Path) -> str:
        listing = sorted((p.name, p.stat().st_size) for p in folder.iterdir() if p.is_file())
        return hashlib.sha1(json.dumps(listing).encode()).hexdigest()

    def count(self, client: str, name: str, n: int, ranged: bool) -> None:
        with self.lock:
            mine = self.stats.setdefault(client, {"bytes": 0, "files": {}, "ranges": {}})
            mine["bytes"] += n
            part = mine["ranges" if ranged else "files"]
            part[name] = part.get(name, 0) + n
            tmp = self.stats_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.stats, indent=1, sort_keys=True))
            os.replace(tmp, self.stats_file)


def handler(hub: Hub) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _missing(self, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _info(self, repo_id: str) -> None:
            folder = hub.repo(repo_id)
            if folder is None:
                return self._missing("RepoNotFound")
            files = sorted(p for p in folder.iterdir() if p.is_file())
            body = json.dumps(
                {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": hub.commit(folder),
                    "private": False,
                    "siblings": [{"rfilename": p.name, "size": p.stat().st_size} for p in files],
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _file(self, repo_id: str, name: str) -> None:
            folder = hub.repo(repo_id)
            if folder is None:
                return self._missing("RepoNotFound")
            path = folder / name
            if "/" in name or not path.is_file():
                return self._missing("EntryNotFound")
            data = path.read_bytes()
            start, end, status = 0, len(data) - 1, 200
            wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if wanted:
                start = int(wanted.group(1))
                end = min(int(wanted.group(2) or end), len(data) - 1)
                status = 206
            self.send_response(status)
            self.send_header("X-Repo-Commit", hub.commit(folder))
            etag = '"' + hashlib.sha256(data).hexdigest() + '"'
            self.send_header("ETag", etag)
            self.send_header("X-Linked-Etag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            body = data[start : end + 1]
            step = 64 * 1024
            for i in range(0, len(body), step):
                self.wfile.write(body[i : i + step])
                if hub.rate:
                    time.sleep(min(step, len(body) - i) / hub.rate)
            hub.count(self.client_address[0], f"{repo_id}/{name}", len(body), status == 206)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            info = _INFO.match(path)
            if info:
                return self._info(info.group(1))
            found = _RESOLVE.match(path)
            if found:
                return self._file(found.group(1), found.group(3))
            self._missing("EntryNotFound")

    return Handler


def main(argv: list[str]) -> int:
    root, host, port, stats, *rate = argv
    hub = Hub(Path(root), Path(stats), float(rate[0]) if rate else 0.0)
    server = ThreadingHTTPServer((host, int(port)), handler(hub))
    print("ready", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
