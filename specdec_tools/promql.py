"""The queries operators look at first, in one place: the Grafana dashboard's panels are
built from them (specdec_tools/dashboard.py), cluster/README.md documents them, and the
Prometheus test runs every one against a real Prometheus scraping a real app.

Ray exports our series with a `ray_` prefix (counters also get `_total`) and adds the
labels application, deployment, replica. `$application` and `$replica` are the dashboard's
template variables; `$__rate_interval` is Grafana's.
"""

from __future__ import annotations

import dataclasses

SEL = 'application=~"$application", replica=~"$replica"'
W = "$__rate_interval"


def rate(series: str, by: str = "", extra: str = "") -> str:
    """sum [by (...)] (rate(ray_<series>{selector}[window]))"""
    sel = SEL + (", " + extra if extra else "")
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate(ray_{series}{{{sel}}}[{W}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    group = "le" + (", " + by if by else "")
    return (f"histogram_quantile({q}, sum by ({group}) "
            f"(rate(ray_{histogram}_bucket{{{SEL}}}[{W}])))")


@dataclasses.dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclasses.dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"   # timeseries | stat


ALPHA = (f"{rate('specdec_spec_accepted_tokens_total', 'method')} / ("
         f"{rate('specdec_spec_accepted_tokens_total', 'method')} + "
         f"{rate('specdec_spec_rejections_total', 'method')})")
MEAN_ACCEPTANCE_LENGTH = (f"1 + {rate('specdec_spec_accepted_tokens_total', 'method')} / "
                          f"{rate('specdec_spec_rounds_total', 'method')}")
PER_POSITION = (f"{rate('specdec_spec_position_accepted_total', 'method, position')} / "
                f"{rate('specdec_spec_position_drafted_total', 'method, position')}")
GOODPUT = rate("specdec_generated_tokens_total")
_SPECULATING = rate("specdec_requests_total", extra='method!="none"')
SPECULATION_SHARE = f"{_SPECULATING} / {rate('specdec_requests_total')}"
PREFIX_HIT_RATE = (f"{rate('specdec_prefix_cache_reused_tokens_total')} / "
                   f"{rate('specdec_prompt_tokens_total')}")

PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("Route mix", "Requests the policy sent plain or speculative, and why "
              "(goodput, no_gain, short_output, request, explore, no_proposer).",
              (Query(rate("specdec_policy_decisions_total", "mode, why"), "{{mode}} ({{why}})"),),
              "reqps"),
    PanelSpec("Speculation share", "Share of admitted requests that speculate.",
              (Query(SPECULATION_SHARE, "speculative share"),), "percentunit", "stat"),
    PanelSpec("Acceptance alpha", "Per-token acceptance: kept / tested, a guess being "
              "tested only up to its round's first rejection.",
              (Query(ALPHA, "alpha {{method}}"),), "percentunit"),
    PanelSpec("Mean acceptance length", "Tokens per speculative round (kept guesses plus "
              "the target's own token).",
              (Query(MEAN_ACCEPTANCE_LENGTH, "{{method}}"),), "short"),
    PanelSpec("Per-position acceptance", "Of the rounds that drafted a guess at position i, "
              "the share that kept guesses 1..i.",
              (Query(PER_POSITION, "{{method}} position {{position}}"),), "percentunit"),
    PanelSpec("Goodput", "Output tokens per second (every one accepted by the target), and "
              "the draft's guesses kept per second.",
              (Query(GOODPUT, "output tokens/s"),
               Query(rate("specdec_spec_accepted_tokens_total"), "draft tokens kept/s")),
              "short"),
    PanelSpec("Latency", "End to end, time to first token and between tokens (p50, p99), "
              "measured in the engine replica.",
              (Query(quantile(0.5, "specdec_e2e_latency_seconds"), "e2e p50"),
               Query(quantile(0.99, "specdec_e2e_latency_seconds"), "e2e p99"),
               Query(quantile(0.5, "specdec_time_to_first_token_seconds"), "TTFT p50"),
               Query(quantile(0.99, "specdec_time_to_first_token_seconds"), "TTFT p99"),
               Query(quantile(0.5, "specdec_inter_token_latency_seconds"), "ITL p50"),
               Query(quantile(0.99, "specdec_inter_token_latency_seconds"), "ITL p99"),
               Query(quantile(0.99, "specdec_queue_seconds"), "queue p99")), "s"),
    PanelSpec("Batch, queue and KV slots", "Rows decoding, requests waiting, free KV slots.",
              (Query(f"sum by (replica) (ray_specdec_running_requests{{{SEL}}})",
                     "running {{replica}}"),
               Query(f"sum by (replica) (ray_specdec_waiting_requests{{{SEL}}})",
                     "waiting {{replica}}"),
               Query(f"sum by (replica) (ray_specdec_free_kv_slots{{{SEL}}})",
                     "free slots {{replica}}")), "short"),
    PanelSpec("Prefix cache", "Share of prompt tokens whose K/V came from the cache (a "
              "conversation's history, a shared system prompt), tokens the target's slots "
              "hold, and the cache's events per second.",
              (Query(PREFIX_HIT_RATE, "prompt tokens reused"),
               Query(f"sum by (replica) (ray_specdec_prefix_cache_held_tokens{{{SEL}}})",
                     "held tokens {{replica}}"),
               Query(rate("specdec_prefix_cache_events_total", "event"), "{{event}}/s")),
              "short"),
    PanelSpec("Draft cost ratio c", "One draft step / one plain target step, as measured: "
              "speculation pays while tokens per round exceed k*c + verify cost.",
              (Query(f"max by (replica) (ray_specdec_policy_draft_cost_ratio{{{SEL}}})",
                     "c {{replica}}"),), "short"),
    PanelSpec("Draft group", "1 while the draft serves guesses, 0 while it is rebuilt "
              "(rounds run plainly meanwhile); the k chosen in the last step.",
              (Query(f"min by (replica) (ray_specdec_draft_up{{{SEL}}})", "up {{replica}}"),
               Query(f"max by (replica) (ray_specdec_chosen_k{{{SEL}}})", "k {{replica}}")),
              "short"),
    PanelSpec("Step time", "Target forward per step (p50, p99) and tokens per step.",
              (Query(quantile(0.5, "specdec_step_seconds"), "step p50"),
               Query(quantile(0.99, "specdec_step_seconds"), "step p99")), "s"),
    PanelSpec("Failures", "Requests failed or refused in the engine, by kind; error "
              "answers of the ingress, by status.",
              (Query(rate("specdec_requests_failed_total", "kind"), "engine {{kind}}"),
               Query(rate("specdec_http_errors_total", "status"), "HTTP {{status}}")),
              "reqps"),
)
