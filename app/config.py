"""One place for every setting, read from `RTRL_*` environment variables."""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.signals.rewards import (
    FEEDBACK_CLOCK_SKEW_S,
    LATEST_REWARD_VERSION,
    MAX_ACCEPT_DELAY_S,
    reward_open_limit,
)


def embedded_database_url(port: int) -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/rtrl"


def embedded_kafka_servers(port: int) -> str:
    return f"127.0.0.1:{port}"


def embedded_redis_url(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def embedded_vllm_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


DEVELOPMENT_USER_HASH_SECRET = "rtrl-development-only"
_LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1", ""}


class SettingsError(Exception):
    """A setting has an invalid value; the message names the variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RTRL_", extra="ignore")

    data_dir: Path = Path("./var")
    """Where embedded services, models, checkpoints, spools and logs live."""

    # Loopback ports of the embedded services. The URLs below default to them; a URL set
    # to anything else means "a managed service runs there, do not start one".
    embedded_postgres_port: int = Field(default=54329, ge=1, le=65535)
    embedded_kafka_port: int = Field(default=19092, ge=1, le=65535)
    embedded_redis_port: int = Field(default=16379, ge=1, le=65535)
    embedded_vllm_port: int = Field(default=18000, ge=1, le=65535)

    database_url: str = ""
    """SQLAlchemy URL of Postgres (psycopg 3 driver)."""

    kafka_bootstrap_servers: str = ""
    """Comma-separated Kafka bootstrap servers."""

    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How every Kafka client rtrl builds talks to the brokers (the embedded one: PLAINTEXT);
    the SASL ones authenticate with the mechanism and credentials below."""

    kafka_sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        default="", validate_default=True
    )
    """SASL mechanism; required with, and only with, a SASL_* security protocol."""

    kafka_sasl_username: str = ""
    kafka_sasl_password: SecretStr = Field(default=SecretStr(""), validate_default=True)
    """The SASL credentials (PLAIN sends them as they are: use it over a private network or
    SASL_SSL)."""

    redis_url: str = ""
    """Redis URL (rate limits, experiment change notifications)."""

    vllm_urls: Annotated[list[str], NoDecode] = []
    """Comma-separated base URLs of the vLLM OpenAI servers (one per replica)."""

    vllm_api_key: SecretStr = SecretStr("")
    """The key the vLLM servers were started with (`--api-key`): every call rtrl makes to
    them sends it as `Authorization: Bearer`; empty sends none."""

    tool_call_parser: str = "hermes"
    """vLLM's tool-call parser, matching the served model's chat template (hermes for the
    bootstrapped model; e.g. qwen3_coder or llama3_json for others); empty disables tools."""

    vllm_stream_interval: int = Field(default=1, ge=1)
    """Tokens the embedded vLLM gathers into one stream chunk (its `--stream-interval`; the
    first token is always sent at once). The gateway spends CPU on each chunk it relays, so
    raising it lets each gateway core carry more streamed completions (the cost per chunk is
    measured in docs/results/benchmarks.md, gateways sized by it in docs/operators/scaling.md).
    1 (vLLM's default): each token as it comes. A vLLM run outside rtrl takes the same flag."""

    heartbeat_file: Path | None = None
    """A worker or trainer touches this file as its loop runs (liveness for `rtrl healthcheck`)."""

    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """`rtrl worker` and `rtrl trainer` serve Prometheus metrics at :PORT/metrics (the gateway
    serves its own at /metrics); unset: they serve none. One port per process on a host."""

    base_model: Path | None = None
    """HF causal LM directory; defaults to the bootstrapped model under the data dir."""

    train_interval: timedelta = timedelta(hours=5)
    """Time between training cycles (seconds or ISO 8601 duration, e.g. PT5H)."""

    survival_horizon: timedelta = timedelta(minutes=15)
    """Edit survival is read at this time after acceptance (seconds or ISO 8601)."""

    reward_version: int = Field(default=LATEST_REWARD_VERSION, ge=0)
    """Reward formula version new rewards are computed with."""

    latency_budget_ms: float = Field(default=2000.0, gt=0)
    """End-to-end latency budget (an A/B metric; formula 1's penalty)."""

    ttft_budget_ms: float = Field(default=1000.0, gt=0)
    """A completion whose first token takes longer earns the time-to-first-token penalty."""

    tpot_budget_ms: float = Field(default=100.0, gt=0)
    """A completion generated slower than this per token earns the per-token penalty."""

    reward_grace: timedelta = timedelta(minutes=2)
    """How long past the survival horizon a reward waits for late reports before the sweep."""

    reward_reopen_window: timedelta = timedelta(hours=1)
    """Evidence arriving this long after its reward was finalized re-opens and recomputes it;
    later evidence is stored and counted on the reward, not applied."""

    reward_max_accept_delay: timedelta = timedelta(seconds=MAX_ACCEPT_DELAY_S)
    """Latest acceptance after a completion that still earns a full survival horizon. Every
    reward is due no later than this + the survival horizon + the grace after its completion
    was served, and the sweep finalizes one still open then as `censored`; the trainer's
    cohort does not wait for longer."""

    feedback_clock_skew: timedelta = timedelta(seconds=FEEDBACK_CLOCK_SKEW_S)
    """How far past the gateway's receipt a feedback event's own `occurred_at` may lie (IDE
    clocks drift): rewards read it within [served_at, received_at + this], and a survival
    report may claim at most this more time since the acceptance than had passed when it
    was received."""

    guardrail_interval: timedelta | None = None
    """How often workers test running canaries against their guardrails and roll back the
    harmful ones (seconds or ISO 8601); unset: only when ops ask (`/admin/guardrails/check`)."""

    auth_failures_per_minute: int = Field(default=30, ge=1)
    """Failed authentications one client address may make per minute before it waits (429);
    keys the gateway already knows to be valid are never held back by others' failures."""

    trusted_proxies: str = ""
    """Addresses or networks (comma-separated, e.g. `10.0.0.0/8`) of the load balancers in
    front of the gateway. A request from one of them is counted against the client that its
    `X-Forwarded-For` names (the nearest address that is not itself trusted); empty: the
    peer's address counts and `X-Forwarded-For` is ignored, since any client can send it."""

    trust_proxy_headers: bool = False
    """Behind a TLS-offloading proxy: take the scheme from X-Forwarded-Proto (dashboard cookies
    are then marked Secure). Only where the proxy overwrites the header clients send."""

    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8080, ge=1, le=65535)

    user_hash_secret: SecretStr = SecretStr(DEVELOPMENT_USER_HASH_SECRET)
    """Key of the HMAC that turns user ids into the hashes stored and used for A/B buckets."""

    rate_limit_per_minute: int = Field(default=600, ge=1)
    """Requests per minute per API key, unless the key sets its own."""

    max_in_flight_per_key: int = Field(default=64, ge=1)
    """Completions one API key may have in flight on one gateway process; its next one is a
    429 (`too_many_requests_in_flight`) until one ends. With N gateway processes behind a
    load balancer a key may hold up to N times this on the replicas."""

    export_streams: int = Field(default=2, ge=1, le=64)
    """Streamed CSV exports one gateway process runs at once, each on a connection of a pool
    of their own (the serving path's pool is never lent to a download); one more is a 429
    (`too_many_exports`)."""

    max_request_bytes: int = Field(default=1_000_000, ge=1024)
    """Largest request body the gateway accepts."""

    kafka_replication_factor: int = Field(default=3, ge=1)
    """Replicas of each partition of rtrl's topics (`rtrl migrate` creates them so; the
    gateway and workers refuse to start on less). A single-broker cluster (the embedded one)
    holds one replica and is let through with a warning."""

    kafka_min_insync_replicas: int = Field(default=2, ge=1)
    """Replicas that must have an event before the broker acknowledges it (topic config
    `min.insync.replicas`; rtrl's producers send with `acks=all`). Below the replication
    factor, so that one broker lost stops no write."""

    kafka_max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=1024 * 1024)
    """Largest event the gateway sends (its producer's `max_request_size`). The default fits
    the completion event of the largest body `max_request_bytes` admits (its messages, its
    prompt's token ids, the answer's ids and logprobs). The brokers and topics must take it
    too: `message.max.bytes` on the brokers, `max.message.bytes` on the topics (set by
    `rtrl migrate` when it creates them), `fetch.max.bytes` on the consumers. An event over it
    goes to the DLQ as its ids and a reason."""

    max_feedback_batch: int = Field(default=500, ge=1)
    """Most events one `POST /v1/feedback` may carry."""

    feedback_verdicts_per_request: int = Field(default=1, ge=1)
    """Most `edit_accepted` events, and most `edit_rejected` events, an API key may send on
    one request; one more is a 409 (`feedback_limit_reached`). Distillation reads whether
    any was sent and when the first was, so a repeat carries nothing."""

    feedback_survival_reports_per_request: int = Field(default=8, ge=1)
    """Most `edit_survival` events an API key may send on one request (the usual windows are
    30 s, 2, 5, 10 and 15 min); one more is a 409 (`feedback_limit_reached`)."""

    feedback_followups_per_request: int = Field(default=4, ge=1)
    """Most `followup_message` events an API key may send on one request (only the first is
    read); one more is a 409 (`feedback_limit_reached`)."""

    feedback_session_ends_per_request: int = Field(default=1, ge=1)
    """Most `session_end` events an API key may send naming one request (a session's end
    names its last request, and ends every completion of the session); one more is a 409
    (`feedback_limit_reached`)."""

    upstream_timeout_s: float = Field(default=120.0, gt=0)
    """How long the gateway waits for a vLLM replica."""

    upstream_max_connections: int = Field(default=512, ge=1)
    """Connections one gateway process holds open to vLLM at most, all replicas together
    (its completions in flight, streams included)."""

    upstream_pool_wait_s: float = Field(default=10.0, gt=0)
    """How long a request waits for one of those connections when all are in use; then it is
    a 503 (`upstream_busy`, Retry-After), sent to no replica, counted in
    `rtrl_upstream_busy_total`."""

    upstream_max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """The largest non-streamed answer a gateway reads from vLLM (32 MiB: a 32k-token answer
    with its logprobs is about 5 MB); a larger one is a 502 (`upstream_answer_too_large`),
    never held whole in memory."""

    max_completion_tokens: int = Field(default=4096, ge=1)
    """Most tokens one completion may have (`max_tokens`, `max_completion_tokens` or
    `max_output_tokens`; a larger ask is served at this, and its event records what was
    asked). The vLLM rtrl starts uses it as the default and ceiling for requests that set
    neither, which would otherwise run to the model's context length."""

    spool_memory_events: int = Field(default=10_000, ge=100)
    """Events held in memory while the disk spool refuses writes; beyond that the oldest go."""

    spool_min_free_bytes: int = Field(default=64 << 20, ge=0)
    """Free space the spool's filesystem must have for the spool to count as able to hold
    events (64 MiB: four segments); below it, with Kafka unreachable too, `/readyz` answers
    503 (`failing: ["events"]`) so the load balancer sends requests to another gateway."""

    spool_retention: timedelta = timedelta(hours=6)
    """How long delivered events stay in the gateway's spool, to be sent again should the
    broker lose them (seconds or ISO 8601; 0 deletes them once Kafka has them)."""

    spool_retention_bytes: int = Field(default=2 << 30, ge=0)
    """At most this many bytes of delivered events are retained; the oldest go first."""

    shutdown_drain: timedelta = timedelta(seconds=20)
    """After SIGTERM, how long a gateway lets requests finish and sends its spool to Kafka
    before it exits (seconds or ISO 8601)."""

    retention: timedelta | None = None
    """How long raw history (samples, feedback, rewards) stays in Postgres: `rtrl maintain`
    archives older days to `archive_url` and drops them (ISO 8601 such as P30D, or seconds;
    unset keeps everything). The analytics rollups are kept whatever the retention."""

    archive_url: str = ""
    """Where archived days go as Parquet: a directory or any fsspec URL (s3://bucket/rtrl);
    defaults to `<data_dir>/archive`."""

    partitions_ahead: int = Field(default=3, ge=0, le=60)
    """Days of partitions `rtrl maintain` creates ahead of today."""

    @property
    def history_archive_url(self) -> str:
        """The archive's URL, the local default filled in."""
        return self.archive_url or str(self.data_dir / "archive")

    @model_validator(mode="after")
    def _insync_within_replicas(self) -> Settings:
        if self.kafka_min_insync_replicas > self.kafka_replication_factor:
            raise ValueError(
                f"RTRL_KAFKA_MIN_INSYNC_REPLICAS ({self.kafka_min_insync_replicas}) cannot"
                f" exceed RTRL_KAFKA_REPLICATION_FACTOR ({self.kafka_replication_factor})"
            )
        return self

    @model_validator(mode="after")
    def _embedded_defaults(self) -> Settings:
        self.database_url = self.database_url or embedded_database_url(self.embedded_postgres_port)
        self.kafka_bootstrap_servers = self.kafka_bootstrap_servers or embedded_kafka_servers(
            self.embedded_kafka_port
        )
        self.redis_url = self.redis_url or embedded_redis_url(self.embedded_redis_port)
        self.vllm_urls = self.vllm_urls or [embedded_vllm_url(self.embedded_vllm_port)]
        return self

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, value: str) -> str:
        if not value:
            return value
        if not value.startswith(("postgresql://", "postgresql+psycopg://")):
            raise ValueError("must be a postgresql:// or postgresql+psycopg:// URL")
        return value.replace("postgresql://", "postgresql+psycopg://", 1)

    @field_validator("kafka_bootstrap_servers")
    @classmethod
    def _host_ports(cls, value: str) -> str:
        for server in value.split(",") if value else []:
            host, sep, port = server.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{server!r} is not host:port")
        return value

    @field_validator("kafka_sasl_mechanism")
    @classmethod
    def _sasl_mechanism_with_sasl_protocol(cls, value: str, info: ValidationInfo) -> str:
        protocol = info.data.get("kafka_security_protocol", "PLAINTEXT")
        if protocol.startswith("SASL_") and not value:
            raise ValueError(
                f"RTRL_KAFKA_SECURITY_PROTOCOL={protocol} needs a mechanism: PLAIN, SCRAM-SHA-256 "
                "or SCRAM-SHA-512"
            )
        if value and not protocol.startswith("SASL_"):
            raise ValueError(
                f"{value} needs RTRL_KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT or SASL_SSL"
            )
        return value

    @field_validator("kafka_sasl_password")
    @classmethod
    def _sasl_credentials(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        if info.data.get("kafka_sasl_mechanism") and not (
            info.data.get("kafka_sasl_username") and value.get_secret_value()
        ):
            raise ValueError("SASL needs RTRL_KAFKA_SASL_USERNAME and RTRL_KAFKA_SASL_PASSWORD")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value

    @field_validator("vllm_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):
            value = [url.strip() for url in value.split(",") if url.strip()]
        if isinstance(value, list):
            for url in value:
                if not str(url).startswith(("http://", "https://")):
                    raise ValueError(f"{url!r} is not an http(s) URL")
            return [str(url).rstrip("/") for url in value]
        return value

    @field_validator(
        "train_interval",
        "survival_horizon",
        "reward_grace",
        "reward_reopen_window",
        "reward_max_accept_delay",
        "feedback_clock_skew",
        "guardrail_interval",
        "spool_retention",
        "shutdown_drain",
        "retention",
        mode="before",
    )
    @classmethod
    def _seconds(cls, value: object) -> object:
        if value == "":
            return None
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return value
        return value

    @field_validator(
        "train_interval",
        "survival_horizon",
        "reward_grace",
        "reward_reopen_window",
        "reward_max_accept_delay",
        "guardrail_interval",
        "retention",
    )
    @classmethod
    def _positive(cls, value: timedelta | None) -> timedelta | None:
        if value is not None and value <= timedelta(0):
            raise ValueError("must be a positive duration")
        return value

    @field_validator("spool_retention", "shutdown_drain", "feedback_clock_skew")
    @classmethod
    def _not_negative(cls, value: timedelta) -> timedelta:
        if value < timedelta(0):
            raise ValueError("must not be a negative duration")
        return value

    @property
    def external_services(self) -> list[str]:
        """The backing services addressed away from this machine (production's managed ones)."""
        urls = {
            "RTRL_DATABASE_URL": [self.database_url],
            "RTRL_KAFKA_BOOTSTRAP_SERVERS": [
                f"kafka://{server.strip()}" for server in self.kafka_bootstrap_servers.split(",")
            ],
            "RTRL_REDIS_URL": [self.redis_url],
            "RTRL_VLLM_URLS": self.vllm_urls,
        }
        return [
            name
            for name, values in urls.items()
            if any(not _on_loopback(value) for value in values)
        ]

    @property
    def base_model_path(self) -> Path:
        return self.base_model or self.data_dir / "models" / "base"

    @property
    def reward_open_limit(self) -> timedelta:
        """The longest a reward stays open after its completion was served."""
        return reward_open_limit(
            horizon_s=self.survival_horizon.total_seconds(),
            grace_s=self.reward_grace.total_seconds(),
            max_accept_delay_s=self.reward_max_accept_delay.total_seconds(),
        )

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def spool_dir(self) -> Path:
        return self.data_dir / "spool"


def settings_environment(settings: Settings) -> dict[str, str]:
    """The `RTRL_*` variables that make a child process read the same settings."""
    env = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, SecretStr):
            text = value.get_secret_value()
        elif isinstance(value, list):
            text = ",".join(str(item) for item in value)
        elif isinstance(value, timedelta):
            text = str(value.total_seconds())
        else:
            text = str(value)
        env[f"RTRL_{name.upper()}"] = text
    return env


def _on_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def refuse_development_secrets(settings: Settings) -> None:
    """SettingsError when services are external (production) but a secret is a default one.

    The user hash keys every A/B bucket and every stored user id: with the published
    development value anyone can map a user id to its hash.
    """
    external = settings.external_services
    secret = settings.user_hash_secret.get_secret_value()
    if external and secret in ("", DEVELOPMENT_USER_HASH_SECRET):
        raise SettingsError(
            "RTRL_USER_HASH_SECRET must be set to a secret of your own: "
            f"{', '.join(external)} point at external services, and the development value "
            "is public"
        )


def load_settings() -> Settings:
    """Read the settings from the environment, or fail naming the bad variable."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else "?"
            problems.append(f"RTRL_{field.upper()}: {error['msg']}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once."""
    return load_settings()
