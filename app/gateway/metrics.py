"""Prometheus metrics of the gateway's own work: upstream, routing, events."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)

UPSTREAM_ERRORS = Counter(
    "rtrl_upstream_errors_total",
    "Failed calls to vLLM replicas, by replica and kind: connect (failed over) or broken.",
    ["replica", "error"],
)
UPSTREAM_UNAVAILABLE = Counter(
    "rtrl_upstream_unavailable_total", "Requests answered 503 because no vLLM replica answered."
)
UPSTREAM_BUSY = Counter(
    "rtrl_upstream_busy_total",
    "Requests answered 503 because every connection to vLLM stayed in use for the whole pool"
    " wait (RTRL_UPSTREAM_MAX_CONNECTIONS, RTRL_UPSTREAM_POOL_WAIT_S); no replica was tried.",
)
COMPLETIONS = Counter(
    "rtrl_completions_total",
    "Completions served, by checkpoint and status.",
    ["checkpoint", "status"],
)
HISTORY_EVIDENCE = Counter(
    "rtrl_history_evidence_total",
    "Feedback the gateway read from the next request of a run (`app.signals.history`), by "
    "source (`history:<client>:<rule>`).",
    ["source"],
)
TRAJECTORY_LINKS = Counter(
    "rtrl_trajectory_links_total",
    "How requests were placed in agent runs: continued (parent found), new_run, new_segment "
    "(history holds assistant turns no completion matches: edited or compacted), "
    "token_prefix / token_mismatch (the parent's tokens do or do not prefix the new prompt), "
    "unavailable (Redis down).",
    ["outcome"],
)
TTFT = Histogram(
    "rtrl_completion_ttft_seconds",
    "Time to the first token, by checkpoint.",
    ["checkpoint"],
    buckets=LATENCY_BUCKETS,
)
COMPLETION_LATENCY = Histogram(
    "rtrl_completion_seconds",
    "Time to the last token, by checkpoint.",
    ["checkpoint"],
    buckets=LATENCY_BUCKETS,
)
FALLBACKS = Counter(
    "rtrl_routing_fallbacks_total",
    "Requests whose arm's checkpoint was not served, so production answered.",
    ["checkpoint"],
)
EVENTS_PUBLISHED = Counter(
    "rtrl_events_published_total", "Events acknowledged by Kafka, by topic.", ["topic"]
)
EVENTS_SET_ASIDE = Counter(
    "rtrl_events_set_aside_total",
    "Events Kafka can never take (over its size limits), sent to the DLQ as ids and a reason"
    " instead, by the topic they were for.",
    ["topic"],
)
EVENTS_SPOOLED = Counter(
    "rtrl_events_spooled_total", "Events written to the on-disk spool, by topic.", ["topic"]
)
EVENTS_DROPPED = Counter(
    "rtrl_events_dropped_total", "Events lost because neither memory nor the spool could hold them."
)
KAFKA_CONNECTED = Gauge(
    "rtrl_kafka_connected", "1 while the gateway's last send reached Kafka, 0 while events spool."
)
SPOOL_DEPTH = Gauge("rtrl_spool_depth", "Events waiting for Kafka, by where they wait.", ["where"])
SPOOL_RETAINED_BYTES = Gauge(
    "rtrl_spool_retained_bytes",
    "Bytes of delivered events kept for a replay, should the broker lose them.",
)
SPOOL_RETAINED_SEGMENTS = Gauge(
    "rtrl_spool_retained_segments", "Spool segments of delivered events kept for a replay."
)
SPOOL_REPLAYS = Counter(
    "rtrl_spool_replays_total",
    "Times a spool's retained events were sent again because the broker had lost their log.",
)

PRIVATE_UNREMEMBERED = Counter(
    "rtrl_private_requests_unremembered_total",
    "Privacy-mode requests whose messages could not be remembered (Redis unavailable): a "
    "later request that re-sends them is logged private only if its own run lookup fails.",
)
