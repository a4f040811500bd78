"""A real Prometheus, run with the project's cluster/prometheus.yml, and the committed
Grafana dashboard's queries as Grafana would send them: what the dashboard test and the
autoscaling run use to see the metrics as a deployment's Prometheus and Grafana see them.

Prometheus finds Ray's metrics ports the way it does on a cluster: by the file service
discovery of cluster/prometheus.yml, here pointed at a file the caller keeps up to date
(`set_targets`), so nodes that come and go are followed within a second or two."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "cluster/grafana/specdec-dashboard.json"


class Prometheus:
    """Started on enter (Debian's `prometheus` binary, scraping every second), stopped on
    exit; its data lives in a temp dir of its own."""

    def __init__(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.tmp = Path(tempfile.mkdtemp(prefix="sdprom-"))
        self.targets_file = self.tmp / "targets.json"
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        binary = shutil.which("prometheus")
        if not binary:
            raise FileNotFoundError("prometheus is not installed (`make prometheus`)")
        cfg = yaml.safe_load((ROOT / "cluster/prometheus.yml").read_text())
        cfg["global"]["scrape_interval"] = "1s"
        job = cfg["scrape_configs"][0]
        job.pop("static_configs", None)
        job["file_sd_configs"] = [{"files": [str(self.targets_file)], "refresh_interval": "1s"}]
        self.set_targets([])
        (self.tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self._log = open(self.tmp / "prometheus.log", "wb")  # noqa: SIM115 (closed on exit)
        self._proc = subprocess.Popen(
            [binary, f"--config.file={self.tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + 60
        while True:  # ready, or say why not (a port taken, a bad config)
            if self._proc.poll() is not None:
                err = (self.tmp / "prometheus.log").read_text(errors="replace")[-2000:]
                self.__exit__()
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {err}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise TimeoutError(f"prometheus not ready at {self.url} in 60 s")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def set_targets(self, addresses: list[str]) -> None:
        """Ray's metrics export addresses (host:port), as Ray's head writes them for
        Prometheus's file discovery; replaced atomically, as Prometheus expects."""
        part = self.targets_file.with_suffix(".part")
        part.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": addresses}]))
        part.replace(self.targets_file)

    def targets_up(self) -> int:
        r = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()
        return sum(t["health"] == "up" for t in r["data"]["activeTargets"])

    def query(self, expr: str) -> list:
        return query(self.url, expr)

    def label_values(self, metric: str, label: str) -> list[str]:
        """What Grafana's `label_values(metric, label)` variable query lists."""
        r = httpx.get(f"{self.url}/api/v1/series", params={"match[]": metric}, timeout=30)
        return sorted({s[label] for s in r.json()["data"] if label in s})


def query(url: str, expr: str) -> list:
    """An instant query's result (a list of series) from the Prometheus at url."""
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        raise ValueError(f"Prometheus refused {expr!r}: {body}")
    return body["data"]["result"]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def instantiate(expr: str, rate_interval: str = "2m") -> str:
    """A dashboard query as Grafana sends it with All selected for every variable."""
    return expr.replace("$application", ".*").replace("$replica", ".*") \
        .replace("$__rate_interval", rate_interval)


def replica_variable_query() -> str:
    """The metric selector behind the dashboard's `replica` variable."""
    var = next(v for v in dashboard()["templating"]["list"] if v["name"] == "replica")
    inner = var["query"].removeprefix("label_values(").rsplit(",", 1)[0]
    return instantiate(inner)


def panel(title: str) -> list[str]:
    """The queries of one dashboard panel, as Grafana sends them."""
    p = next(p for p in dashboard()["panels"] if p.get("title") == title)
    return [instantiate(t["expr"]) for t in p.get("targets", [])]
