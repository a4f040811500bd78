"""Autoscaling seen to work: the application of serve_config.gpu.yaml on Ray's own
autoscaler with the node types of cluster/ray-cluster.yaml (specdec_bench/fake_cluster.py: the
fixture models on CPU, custom resources standing in for GPUs, times scaled down), driven
through three phases:

  start  the autoscaler launches the worker nodes (min_workers, and what the first
         replica's placement group needs); the application becomes ready;
  load   clients keep more requests in flight than one replica's target: Serve adds an
         engine replica, the autoscaler a node for its draft, the ingress spreads requests
         over both;
  idle   two clients keep a long request in flight while the extra replica drains (the
         moment the drain begins is taken to a twentieth of a second, so a request caught
         in flight on the draining replica is seen), then one, below one replica's target,
         while its node goes away.

Every request is recorded (sent, status, latency, the replica that served it, whether it
speculated), and the cluster is sampled every second (replicas, nodes, requests in flight).
Where Prometheus is installed, one runs beside the cluster with cluster/prometheus.yml,
following the nodes' metrics ports as they come and go, and the run records what the
committed Grafana dashboard shows once both replicas serve (its `replica` variable, the
batch panel's series, tokens by replica).

    .venv/bin/python -m specdec_bench.autoscale [--clients 6] [--plot autoscale.png] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx

from specdec_bench.fake_cluster import FakeCluster, Scaling, app_args, load_gpu_config
from specdec_bench.prometheus import Prometheus, panel, replica_variable_query
from specdec_bench.table import print_table


@dataclasses.dataclass
class Call:
    sent: float
    done: float
    status: int           # HTTP status; 0: no answer (a timeout or a broken connection)
    retry_after: bool
    replica: str | None
    speculated: bool
    phase: str


@dataclasses.dataclass
class Report:
    calls: list[Call]
    samples: list[dict]   # t, replicas running/starting, nodes by type, in flight
    events: dict[str, float]  # what happened when (s since the cluster started)
    min_nodes: dict[str, int]
    # The drain began between these two polls of Serve's status (s since the cluster
    # started, unrounded): the last that saw two replicas serving, the first that did not.
    drain_window: tuple[float, float] | None = None
    # What the dashboard showed once both replicas served ({} without Prometheus).
    dashboard: dict = dataclasses.field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        ok = sum(c.status == 200 for c in self.calls)
        refused = sum(c.status == 503 and c.retry_after for c in self.calls)
        return {"sent": len(self.calls), "succeeded": ok, "refused_503": refused,
                "failed": len(self.calls) - ok - refused}

    def replicas_serving(self, phase: str | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            if c.status == 200 and c.replica and (phase is None or c.phase == phase):
                out[c.replica] = out.get(c.replica, 0) + 1
        return out


class _Recorder:
    def __init__(self, t0: float) -> None:
        self.t0, self.calls, self.lock = t0, [], threading.Lock()
        self.in_flight = 0

    def call(self, client: httpx.Client, phase: str, max_tokens: int) -> None:
        with self.lock:
            self.in_flight += 1
        sent = time.monotonic() - self.t0
        status, retry, replica, spec = 0, False, None, False
        try:
            r = client.post("/v1/completions", json={
                "model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0})
            status, retry = r.status_code, "retry-after" in r.headers
            if status == 200:
                sd = r.json().get("spec_decode", {})
                replica, spec = sd.get("replica"), bool(sd.get("rounds"))
        except httpx.HTTPError:
            pass
        finally:
            with self.lock:
                self.in_flight -= 1
                self.calls.append(Call(sent, time.monotonic() - self.t0, status, retry,
                                       replica, spec, phase))


def _engine_replicas() -> dict[str, int]:
    from ray import serve

    try:
        st = serve.status().applications["specdec"].deployments["Engine"]
    except KeyError:
        return {}
    return {str(getattr(k, "value", k)).lower(): v for k, v in st.replica_states.items()}


BATCH_PANEL = "Batch, queue and KV slots"


def dashboard_view(prom: Prometheus) -> dict:
    """The replicas the dashboard offers and shows: its `replica` variable's values, the
    replicas of each series of the batch panel, and tokens generated by replica."""
    tokens = prom.query("sum by (replica) (ray_specdec_generated_tokens_total)")
    return {
        "replica_variable": prom.label_values(replica_variable_query(), "replica"),
        "batch_panel": [sorted(r["metric"].get("replica", "") for r in prom.query(q))
                        for q in panel(BATCH_PANEL)],
        "tokens_by_replica": {r["metric"].get("replica", ""): float(r["value"][1])
                              for r in tokens}}


def run(clients: int = 6, max_tokens: int = 48, load_s: float = 150.0, idle_s: float = 240.0,
        scaling: Scaling | None = None, log=print) -> Report:
    from ray import serve

    from deployments.app import build_app
    from deployments.launch import free_port
    from specdec.pack.tiny import make_perturbed_copy, make_tiny_checkpoint

    scaling = scaling or Scaling()
    models = Path(tempfile.mkdtemp(prefix="sdfake-models-"))
    target = make_tiny_checkpoint(models / "target", "llama",
                                  max_position_embeddings=max(256, scaling.max_len))
    draft = make_perturbed_copy(target, models / "draft", 0.05, 1)
    args = app_args(load_gpu_config(), target, draft, scaling=scaling)
    prom = Prometheus(free_port()) if shutil.which("prometheus") else None
    if prom is None:
        log("prometheus is not installed (`make prometheus`): the dashboard is not checked")
    # Prometheus first: its port is taken before Ray's processes start taking ports.
    with prom or contextlib.nullcontext(), FakeCluster(scaling=scaling) as cluster:
        dashboard: dict = {}
        drain_window = None
        t0 = time.monotonic()
        rec, samples, events = _Recorder(t0), [], {}
        stop_sampling, stop = threading.Event(), threading.Event()

        def stamp(name: str) -> None:
            events[name] = round(time.monotonic() - t0, 1)
            log(f"[{events[name]:6.1f} s] {name}")

        def take_sample() -> None:
            if prom is not None:  # Prometheus follows the nodes as Ray's head file would
                prom.set_targets(cluster.metrics_addresses())
            reps = _engine_replicas()
            samples.append({"t": round(time.monotonic() - t0, 1),
                            "running": reps.get("running", 0),
                            "starting": reps.get("starting", 0),
                            "stopping": reps.get("stopping", 0),
                            "nodes": cluster.nodes(), "in_flight": rec.in_flight})

        def sample() -> None:
            while not stop_sampling.is_set():
                take_sample()
                stop_sampling.wait(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        port = free_port()
        # One proxy, on the head: a proxy on a node the autoscaler removes would take the
        # client connections pinned to it along.
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    proxy_location="HeadOnly")
        try:
            serve.run(build_app(args), name="specdec", route_prefix="/", blocking=False)
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=base, timeout=120) as c:
                while True:  # ready: a request served
                    try:
                        if c.post("/v1/completions", json={"model": "tiny", "prompt": "w5",
                                                           "max_tokens": 2}).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() - t0 > 300:
                        raise TimeoutError("the application did not become ready in 300 s")
                    time.sleep(1)
            min_nodes = cluster.nodes()
            stamp(f"ready (nodes {min_nodes})")

            idle_tokens = scaling.max_len - 32  # as long as a slot holds: a long drain

            def client(phase: str, pause: float, own: threading.Event = stop) -> None:
                with httpx.Client(base_url=base, timeout=120) as cx:
                    while not (stop.is_set() or own.is_set()):
                        rec.call(cx, phase, max_tokens if phase == "load" else idle_tokens)
                        stop.wait(pause)

            workers = [threading.Thread(target=client, args=("load", 0.0), daemon=True)
                       for _ in range(clients)]
            for w in workers:
                w.start()
            stamp(f"load: {clients} clients")
            deadline = time.monotonic() + load_s
            while time.monotonic() < deadline:
                if _engine_replicas().get("running", 0) >= 2 and \
                        "second replica running" not in events:
                    stamp("second replica running")
                served = rec.calls and len({c.replica for c in rec.calls
                                            if c.status == 200 and c.replica}) >= 2
                if served and "both replicas serving" not in events:
                    stamp("both replicas serving")
                if "both replicas serving" in events and prom is not None and \
                        "dashboard shows both replicas" not in events:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        dashboard = dashboard_view(prom)
                    if len(dashboard.get("replica_variable", ())) >= 2:
                        stamp("dashboard shows both replicas")
                if "both replicas serving" in events and \
                        time.monotonic() - t0 > events["both replicas serving"] + 10:
                    break  # ten more seconds on both, to see the spread
                time.sleep(0.5)
            stop.set()
            for w in workers:
                w.join(timeout=180)
            if prom is not None:  # after the spread: both replicas' counts
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    dashboard = dashboard_view(prom)
            stamp("load over")
            stop.clear()
            # Two clients keep a long request in flight, each sending the next as the last
            # returns, while the extra replica drains: its last one is answered by it as
            # it goes. Once it has gone, one client stops: two requests always in flight
            # are one replica's whole target, where Serve's averaging can ask for the
            # second replica again (a run once saw it come back for 44 s).
            second_quits = threading.Event()
            workers = [threading.Thread(target=client, args=("idle", 0.0, own), daemon=True)
                       for own in (stop, second_quits)]
            for w in workers:
                w.start()
            deadline = time.monotonic() + idle_s
            serving_seen = time.monotonic() - t0  # the last poll that saw both serving
            while time.monotonic() < deadline:
                polled = time.monotonic() - t0
                reps = _engine_replicas()
                if "drain began" not in events and reps:  # {}: status unknown this poll
                    if reps.get("stopping") or reps.get("running", 0) < 2:
                        drain_window = (serving_seen, polled)
                        stamp("drain began")
                    else:
                        serving_seen = polled
                if reps.get("running", 0) == 1 and not reps.get("stopping") and \
                        "back to one replica" not in events:
                    stamp("back to one replica")
                    second_quits.set()
                if "back to one replica" in events and cluster.nodes() == min_nodes:
                    stamp(f"nodes back to the minimum ({min_nodes})")
                    break
                time.sleep(0.05 if "drain began" not in events else 0.5)
            stop.set()
            for w in workers:
                w.join(timeout=180)
            stamp("done")
        finally:
            stop.set()  # whatever ended the run, no client keeps sending
            stop_sampling.set()
            sampler.join()
            take_sample()  # the state at the end, after the last event
            serve.shutdown()
    shutil.rmtree(models, ignore_errors=True)
    return Report(rec.calls, samples, events, min_nodes, drain_window, dashboard)


def changes(report: Report) -> list[dict]:
    """The samples at which the replicas or the nodes changed: the run's timeline."""
    out, prev = [], None
    for smp in report.samples:
        key = (smp["running"], smp["starting"], smp.get("stopping", 0),
               tuple(sorted(smp["nodes"].items())))
        if key != prev:
            out.append({"t": smp["t"], "running": key[0], "starting": key[1],
                        "stopping": key[2],
                        "nodes": ", ".join(f"{k} {v}" for k, v in key[3])})
            prev = key
    return out


def served_through_drain(report: Report) -> tuple[str | None, int]:
    """The replica that went away, and how many of its requests were in flight when it
    began to drain and were answered 200: sent before the last poll that saw it serving,
    answered after the first that saw it draining (so in flight whenever in between the
    drain began)."""
    ok = sorted((c for c in report.calls if c.status == 200 and c.replica),
                key=lambda c: c.done)
    if not ok:
        return None, 0
    staying = ok[-1].replica
    gone = next((r for r in report.replicas_serving() if r != staying), None)
    if gone is None or report.drain_window is None:
        return gone, 0
    before, seen = report.drain_window
    return gone, sum(c.replica == gone and c.sent <= before and c.done >= seen for c in ok)


def first_speculation_after_first_serve(report: Report) -> dict[str, float]:
    """Per replica: seconds from its first served request to its first that speculated."""
    out = {}
    for replica in report.replicas_serving():
        mine = sorted((c for c in report.calls if c.replica == replica and c.status == 200),
                      key=lambda c: c.done)
        spec = next((c for c in mine if c.speculated), None)
        out[replica] = round(spec.done - mine[0].done, 1) if spec else float("nan")
    return out


def plot(report: Report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in report.samples]
    fig, (r, n, b, c) = plt.subplots(4, 1, figsize=(9, 8), sharex=True)
    r.step(t, [s["running"] for s in report.samples], where="post", label="running")
    r.step(t, [s["starting"] for s in report.samples], where="post", label="starting")
    r.set_ylabel("engine replicas")
    r.legend(loc="upper left", fontsize=8)
    for k in sorted({k for s in report.samples for k in s["nodes"]}):
        n.step(t, [s["nodes"].get(k, 0) for s in report.samples], where="post", label=k)
    n.set_ylabel("nodes")
    n.legend(loc="upper left", fontsize=8)
    b.plot(t, [s["in_flight"] for s in report.samples])
    b.set_ylabel("requests in flight")
    ok = [x for x in report.calls if x.status == 200]
    c.scatter([x.done for x in ok], [x.done - x.sent for x in ok], s=4)
    bad = [x for x in report.calls if x.status != 200]
    c.scatter([x.done for x in bad], [x.done - x.sent for x in bad], s=12, c="red")
    c.set_ylabel("latency (s)")
    c.set_xlabel("seconds since the cluster started")
    for at in report.events.values():
        for ax in (r, n, b, c):
            ax.axvline(at, color="grey", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--plot")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    report = run(args.clients, args.max_tokens)
    print_table([{"event": k, "at_s": v} for k, v in report.events.items()], ["event", "at_s"],
                title="timeline (seconds since the cluster started)")
    print_table(changes(report), ["t", "running", "starting", "stopping", "nodes"],
                title="replicas and nodes, as sampled each second (s since the cluster started)")
    print_table([report.counts()], list(report.counts()), title="requests")
    gone, through = served_through_drain(report)
    print(f"replica {gone} drained: {through} of its requests were in flight when its "
          "drain began, and were answered")
    print_table([{"replica": r, "served_load": n,
                  "served_all": report.replicas_serving().get(r, 0),
                  "first_spec_after_first_serve_s":
                      first_speculation_after_first_serve(report).get(r)}
                 for r, n in report.replicas_serving("load").items()],
                ["replica", "served_load", "served_all", "first_spec_after_first_serve_s"],
                title="engine replicas")
    if report.dashboard:
        print_table([{"query": "replica variable", "replicas": report.dashboard["replica_variable"]}]
                    + [{"query": f"{BATCH_PANEL} #{i}", "replicas": r}
                       for i, r in enumerate(report.dashboard["batch_panel"])]
                    + [{"query": "tokens by replica", "replicas": report.dashboard["tokens_by_replica"]}],
                    ["query", "replicas"], title="what the Grafana dashboard shows under load")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "events": report.events, "counts": report.counts(), "samples": report.samples,
            "dashboard": report.dashboard, "drain_window": report.drain_window,
            "calls": [dataclasses.asdict(c) for c in report.calls]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
