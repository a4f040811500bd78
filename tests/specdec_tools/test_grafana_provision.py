"""`specdec grafana provision` against a local stand-in for Grafana's HTTP API (a real
Grafana is not installable here): it checks the requests grafana-client sends (paths,
payload shapes, the auth header) and answers as Grafana's API documentation says. A second
run changes nothing; wrong credentials, a wrong URL and a Grafana that is down get clear
errors."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdec.ports import free_port
from specdec_cli.main import main
from specdec_tools.dashboard import DATASOURCE_UID, UID, build
from specdec_tools.grafana_provision import ProvisionError, provision

TOKEN = "glsa_test_token"


class Grafana:
    """State and request log of the stand-in."""

    def __init__(self) -> None:
        self.datasources: dict[str, dict] = {}
        self.folders: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        self.writes: list[tuple[str, str]] = []
        self.down = False

    def handle(self, h: BaseHTTPRequestHandler, method: str):
        if self.down:
            return 503, {"message": "Service unavailable"}
        auth = h.headers.get("Authorization", "")
        basic = "Basic " + base64.b64encode(b"admin:secret").decode()
        if auth not in (f"Bearer {TOKEN}", basic):
            return 401, {"message": "Unauthorized"}
        body = json.loads(h.rfile.read(int(h.headers.get("Content-Length") or 0)) or b"null")
        path = h.path.split("?")[0]
        if method != "GET":
            self.writes.append((method, path))
        if path == "/api/frontend/settings":
            return 200, {"buildInfo": {"version": "12.1.0"}}
        if path.startswith("/api/datasources/uid/"):
            uid = path.rsplit("/", 1)[1]
            if method == "GET":
                ds = self.datasources.get(uid)
                return (200, ds) if ds else (404, {"message": "Data source not found"})
            assert method == "PUT" and body["uid"] == uid and body["type"] == "prometheus"
            self.datasources[uid] = {**self.datasources[uid], **body}
            return 200, {"datasource": self.datasources[uid], "id": 1,
                         "message": "Datasource updated", "name": body["name"]}
        if path == "/api/datasources" and method == "POST":
            assert {"uid", "name", "type", "url", "access"} <= set(body)
            self.datasources[body["uid"]] = {**body, "id": 1, "version": 1}
            return 200, {"datasource": self.datasources[body["uid"]], "id": 1,
                         "message": "Datasource added", "name": body["name"]}
        if path.startswith("/api/folders/") and method == "GET":
            f = self.folders.get(path.rsplit("/", 1)[1])
            return (200, f) if f else (404, {"message": "folder not found"})
        if path == "/api/folders" and method == "POST":
            assert set(body) == {"title", "uid"}
            self.folders[body["uid"]] = {"id": 7, **body, "version": 1}
            return 200, self.folders[body["uid"]]
        if path.startswith("/api/dashboards/uid/"):
            d = self.dashboards.get(path.rsplit("/", 1)[1])
            return (200, d) if d else (404, {"message": "Dashboard not found"})
        if path == "/api/dashboards/db" and method == "POST":
            dash = body["dashboard"]
            assert body["overwrite"] is True and body["folderUid"] in self.folders
            assert dash["uid"] == UID and dash["panels"]
            version = self.dashboards.get(UID, {}).get("dashboard", {}).get("version", 0) + 1
            self.dashboards[UID] = {"dashboard": {**dash, "id": 3, "version": version},
                                    "meta": {"folderUid": body["folderUid"], "slug": "specdec"}}
            return 200, {"id": 3, "uid": UID, "url": f"/d/{UID}/specdec", "status": "success",
                         "version": version, "slug": "specdec"}
        return 404, {"message": "Not found"}


@pytest.fixture
def grafana():
    state = Grafana()

    class Handler(BaseHTTPRequestHandler):
        def _do(self, method):
            status, body = state.handle(self, method)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._do("GET")

        def do_POST(self):
            self._do("POST")

        def do_PUT(self):
            self._do("PUT")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_provision_creates_then_changes_nothing(grafana):
    state, url = grafana
    first = provision(url, TOKEN, "http://prometheus:9090")
    assert (first.datasource, first.folder, first.dashboard) == ("created",) * 3
    assert state.datasources[DATASOURCE_UID]["url"] == "http://prometheus:9090"
    stored = {k: v for k, v in state.dashboards[UID]["dashboard"].items()
              if k not in ("id", "version")}
    assert stored == build()
    writes = list(state.writes)
    again = provision(url, ("admin", "secret"), "http://prometheus:9090")
    assert (again.datasource, again.folder, again.dashboard) == ("unchanged",) * 3
    assert state.writes == writes, "a second run must not write anything"
    moved = provision(url, TOKEN, "http://prom-2:9090")
    assert moved.datasource == "updated" and moved.dashboard == "unchanged"


def test_clear_errors_for_credentials_url_and_a_grafana_that_is_down(grafana, capsys):
    state, url = grafana
    with pytest.raises(ProvisionError, match="refused the credentials"):
        provision(url, "wrong-token", "http://p:9090")
    with pytest.raises(ProvisionError, match="cannot reach Grafana"):
        provision(f"http://127.0.0.1:{free_port()}", TOKEN, "http://p:9090", timeout_s=2)
    state.down = True
    with pytest.raises(ProvisionError, match="is it up"):
        provision(url, TOKEN, "http://p:9090")
    # The CLI prints one line and exits non-zero.
    assert main(["grafana", "provision", "--url", url, "--token", TOKEN]) == 1
    assert "error: Grafana at" in capsys.readouterr().err
