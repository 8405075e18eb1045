"""The event sink: every event is written ahead to the disk spool, then sent to Kafka.

`EventSink.publish` appends the event to the spool's current segment (a write to the page
cache, no fsync) before it returns, so an event the gateway has answered for survives the
gateway's own crash, SIGKILL included. A background thread sends the spool to an idempotent
kafka-python producer (acks=all) in order and in batches, fsyncing each batch first, and
records how far Kafka acknowledged in the spool's cursor; while Kafka is unreachable the
spool simply grows, and it drains in order once Kafka answers again.

Delivered events stay in the spool for its retention window. The sink records the topic id
(`app.kafka.topic_ids`) of the log it delivered each topic to, checks it every few seconds,
and when a topic has a new id (the broker lost that log) sends every retained event again,
oldest first. Besides its own spool it sends those that stopped gateways left beside it.

Should the disk refuse a write, events wait in a bounded memory queue and are sent from
there. A crash after Kafka acknowledged a batch but before the cursor moved sends that batch
again, as does a send that timed out after the broker had in fact appended it; consumers
dedupe by `event_id`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from kafka import KafkaProducer
from kafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError
from pydantic import BaseModel

from app.events import DLQ_TOPIC, DeadLetter, encode
from app.gateway.metrics import (
    EVENTS_DROPPED,
    EVENTS_PUBLISHED,
    EVENTS_SET_ASIDE,
    KAFKA_CONNECTED,
    SPOOL_DEPTH,
    SPOOL_REPLAYS,
    SPOOL_RETAINED_BYTES,
    SPOOL_RETAINED_SEGMENTS,
)
from app.gateway.spool import DiskSpool, Envelope, Retention
from app.gateway.spool_dirs import adopt_free_spools, claim_spool
from app.kafka.clients import COMPRESSION, kafka_client
from app.kafka.topic_ids import TopicIds

log = logging.getLogger(__name__)

BATCH_EVENTS = 500
BATCH_WINDOW_S = 0.2
"""How long the first queued event waits for others: each Kafka round trip costs
kafka-python milliseconds of CPU (and the GIL), so events go in batches, not one by one."""
PROBE_INTERVAL_S = 1.0
SYNC_INTERVAL_S = 0.2
"""How often the spool's appends are fsynced, by a thread of their own: however long a send
or a broker outage holds the drain thread, a machine crash loses at most this window."""
TOPIC_CHECK_INTERVAL_S = 2.0
"""How often the topic ids are compared with those the retained events were delivered to."""
LOOK_AFTER_INTERVAL_S = 10.0
"""How often retention is applied and the spool root searched for spools left behind."""
PRODUCER_BATCH_BYTES = 1024 * 1024
"""The producer's batch size per partition. kafka-python's default (16 kB) is smaller than
one completion event of an agent's late turn, so each such event went as a batch of its own,
and building and sending batches is Python on a thread beside the event loop: a batch of a
few events per partition halved the sink's CPU per 33 kB event (0.85-1.04 ms to 0.45-0.48)."""
CLOSE_DRAIN_S = 5.0
"""How long a stopping gateway keeps sending; what is left is sent at its next start."""


TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)
"""Answers that say a message can never be sent as it is, however often it is retried."""
EVENT_IDS = ("event_id", "session_id", "request_id", "privacy")
"""What a dead letter keeps of an event too large to send."""


def event_ids(value: bytes) -> dict[str, Any]:
    """The ids of an encoded event (empty when it is not a JSON object)."""
    try:
        event = orjson.loads(value)
    except orjson.JSONDecodeError:
        return {}
    return {name: event.get(name) for name in EVENT_IDS} if isinstance(event, dict) else {}


class EventSink:
    """Publishes events to Kafka from a background thread, through the write-ahead spool."""

    def __init__(
        self,
        bootstrap_servers: str,
        spool: DiskSpool,
        *,
        spool_root: Path | None = None,
        adopted: Sequence[DiskSpool] = (),
        memory_events: int = 10_000,
        min_free_bytes: int = 64 << 20,
        delivery_timeout_ms: int = 8_000,
        producer_options: dict[str, Any] | None = None,
        security: Mapping[str, Any] | None = None,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.memory_events = memory_events
        self.min_free_bytes = min_free_bytes
        # This gateway's own spool, where its events are written; adopted ones go first.
        self.disk = spool
        self.spool_root = spool_root
        self._adopted = list(adopted)
        self._topic_ids = TopicIds(bootstrap_servers, security=security)
        self._next_topic_check = 0.0
        self._missing_topics: set[str] = set()
        self._next_look_after = 0.0
        self._delivery_timeout_s = delivery_timeout_ms / 1000
        self._producer_options = {
            "bootstrap_servers": bootstrap_servers.split(","),
            "client_id": "rtrl-gateway",
            "enable_idempotence": True,
            "acks": "all",
            "compression_type": COMPRESSION,
            "linger_ms": 5,
            "batch_size": PRODUCER_BATCH_BYTES,
            "metrics_enabled": False,
            "max_block_ms": 2_000,
            "request_timeout_ms": min(5_000, delivery_timeout_ms - 1_000),
            "delivery_timeout_ms": delivery_timeout_ms,
            "bootstrap_timeout_ms": 3_000,
            **(security or {}),
            **(producer_options or {}),
        }
        self._queue: deque[Envelope] = deque()
        """Events the disk refused, oldest first; everything on disk is older."""
        self._dropped = 0
        self._wakeup = threading.Condition()
        self._closing = False
        self._producer: KafkaProducer | None = None
        self._broker_down = False
        self._next_probe = 0.0
        self._close_drain_s = CLOSE_DRAIN_S
        self._thread = threading.Thread(target=self._run, name="rtrl-event-sink", daemon=True)
        self._sync_stop = threading.Event()
        self._syncer = threading.Thread(target=self._sync, name="rtrl-spool-sync", daemon=True)
        KAFKA_CONNECTED.set_function(lambda: self.kafka_connected)
        SPOOL_DEPTH.labels("memory").set_function(lambda: len(self._queue))
        SPOOL_DEPTH.labels("disk").set_function(self._spooled)
        SPOOL_RETAINED_BYTES.set_function(lambda: self.retained["bytes"])
        SPOOL_RETAINED_SEGMENTS.set_function(lambda: self.retained["segments"])

    @classmethod
    def claim(
        cls, bootstrap_servers: str, spool_root: Path, retention: Retention, **options: Any
    ) -> EventSink:
        """A sink on a spool directory of its own under `spool_root`, one a stopped gateway
        left if there is one; it also sends the other spools left there."""
        spool = claim_spool(spool_root, retention)
        return cls(bootstrap_servers, spool, spool_root=spool_root, **options)

    def start(self) -> None:
        """Adopt the spools left beside this one, then connect and start draining, what
        earlier runs spooled first; Kafka may be down."""
        self.adopt_free_spools()
        self._thread.start()
        self._syncer.start()

    def adopt_free_spools(self) -> None:
        """Take over the spools under the root that no running gateway holds."""
        if self.spool_root is None:
            return
        held = [spool.directory for spool in self._spools()]
        for spool in adopt_free_spools(self.spool_root, self.disk.retention, held):
            log.info("adopted the spool %s (%d events to send)", spool.directory, spool.pending)
            self._adopted.append(spool)

    def rewind(self, since: datetime | None = None) -> int:
        """Mark every spool's retained events (since `since`) for sending again; before `start`."""
        assert not self._thread.is_alive(), "rewind belongs to the thread that sends"
        return sum(spool.rewind(since) for spool in self._spools())

    @property
    def kafka_connected(self) -> bool:
        """Whether the last send reached Kafka."""
        return self._producer is not None and not self._broker_down

    @property
    def spool_free_bytes(self) -> int:
        """Free bytes on the spool's filesystem (0 if it cannot be read)."""
        try:
            return shutil.disk_usage(self.disk.directory).free
        except OSError:
            return 0

    @property
    def spool_can_hold(self) -> bool:
        """Whether the spool can take the next events: its directory is writable, its
        filesystem has `min_free_bytes` free, and no write it refused is still held in memory.
        A full disk leaves the directory writable by its permissions, so they alone do not
        tell."""
        return (
            not self._queue
            and os.access(self.disk.directory, os.W_OK)
            and self.spool_free_bytes >= self.min_free_bytes
        )

    @property
    def depth(self) -> dict[str, int]:
        """Events not yet acknowledged by Kafka: on disk, and in memory if the disk refused."""
        return {"memory": len(self._queue), "disk": self._spooled()}

    @property
    def retained(self) -> dict[str, Any]:
        """Delivered events kept for a replay: their bytes, segments, and since when."""
        spools = self._spools()
        since = min((t for s in spools if (t := s.retained_since) is not None), default=None)
        return {
            "bytes": sum(spool.retained_bytes for spool in spools),
            "segments": sum(spool.retained_segments for spool in spools),
            "since": datetime.fromtimestamp(since, UTC).isoformat() if since else None,
            "spools": len(spools),
        }

    def publish(self, topic: str, key: str, event: BaseModel) -> None:
        """Spool an event for Kafka; never blocks on the broker."""
        self.publish_encoded(Envelope(topic, key, encode(event)))

    def publish_encoded(self, envelope: Envelope) -> None:
        """Spool an already encoded event; on return it survives this process's crash."""
        with self._wakeup:
            if not self._queue:
                try:
                    self.disk.append([envelope])
                except OSError:
                    log.exception("event spool unwritable; holding events in memory")
                else:
                    # Wake the drain thread only to start or fill a batch: each wake costs GIL.
                    if self.disk.pending in (1, BATCH_EVENTS):
                        self._wakeup.notify()
                    return
            # Behind events the disk refused, in memory, in order; the oldest go when full.
            if len(self._queue) >= self.memory_events:
                self._queue.popleft()
                if not self._dropped % 1_000:
                    log.error("event spool unwritable and memory full; dropping the oldest")
                self._dropped += 1
                EVENTS_DROPPED.inc()
            self._queue.append(envelope)
            self._wakeup.notify()

    def drain(self, timeout_s: float) -> bool:
        """Wait until Kafka has every spooled event, at most `timeout_s`; True if it has."""
        deadline = time.monotonic() + timeout_s
        with self._wakeup:
            self._wakeup.notify()
        while self._waiting() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._waiting()

    def close(self, drain_s: float = CLOSE_DRAIN_S) -> None:
        """Deliver what Kafka takes within `drain_s`, then stop; the spool keeps the rest."""
        with self._wakeup:
            self._close_drain_s = drain_s
            self._closing = True
            self._wakeup.notify()
        # A send in flight when the time is up may wait out its delivery timeout.
        timeout_s = drain_s + self._delivery_timeout_s + 10
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("event sink did not stop within %.0f s", timeout_s)
            return
        self._sync_stop.set()
        if self._syncer.is_alive():
            self._syncer.join(timeout=5)
        self._close_producer(timeout_s=2.0)
        self._topic_ids.close()
        with self._wakeup:
            self._move_queue_to_disk()
            if self._queue:
                log.error("event spool unwritable; %d events lost at shutdown", len(self._queue))
                EVENTS_DROPPED.inc(len(self._queue))
        for spool in self._spools():
            spool.close()

    def _sync(self) -> None:
        """Fsync the spool's appends every `SYNC_INTERVAL_S`, apart from the drain thread."""
        failing = False
        while not self._sync_stop.wait(SYNC_INTERVAL_S):
            try:
                self.disk.sync()
            except OSError:
                if not failing:
                    log.exception("event spool could not be synced")
                failing = True
            else:
                failing = False

    # -- the drain thread -----------------------------------------------------------------

    def _run(self) -> None:
        self._connect()
        while True:
            with self._wakeup:
                if not self._closing and self._idle():
                    self._wakeup.wait(timeout=self._idle_wait())
                deadline = time.monotonic() + BATCH_WINDOW_S
                while (
                    0 < self._waiting() < BATCH_EVENTS
                    and not self._closing
                    and not self._broker_down
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._wakeup.wait(timeout=left)
                closing = self._closing
            try:
                if closing:
                    self._finish()
                    return
                self._drain()
            except Exception:
                # Only a bug or a broken disk lands here; whatever was spooled stays spooled.
                log.exception("event sink round failed")
                self._mark_down()

    def _spools(self) -> list[DiskSpool]:
        """Adopted spools first: their events are older than this gateway's."""
        return [*self._adopted, self.disk]

    def _spooled(self) -> int:
        return sum(spool.pending for spool in self._spools())

    def _waiting(self) -> int:
        return self._spooled() + len(self._queue)

    def _idle(self) -> bool:
        return self._waiting() == 0 or (self._broker_down and time.monotonic() < self._next_probe)

    def _idle_wait(self) -> float:
        if self._waiting() and self._broker_down:
            return max(self._next_probe - time.monotonic(), 0.01)
        return 1.0

    def _drain(self) -> None:
        """One round: spool what waits in memory, look after the spools, then send a batch
        if Kafka answers."""
        with self._wakeup:
            self._move_queue_to_disk()
        try:
            self.disk.sync()
        except OSError:
            log.exception("event spool could not be synced")
        if time.monotonic() >= self._next_look_after:
            self._look_after_spools()
        if self._broker_down and not self._probe():
            return
        if time.monotonic() >= self._next_topic_check and not self._check_topic_ids():
            self._mark_down()
            return
        if self._spooled():
            self._replay()
        elif self._queue:
            self._deliver_from_memory()

    def _look_after_spools(self) -> None:
        """Apply retention, release adopted spools with nothing left, adopt new ones."""
        self._next_look_after = time.monotonic() + LOOK_AFTER_INTERVAL_S
        for spool in self._spools():
            spool.prune()
        for spool in [s for s in self._adopted if s.empty]:
            log.info("sent and released the adopted spool %s", spool.directory)
            self._adopted.remove(spool)
            spool.remove()
        self.adopt_free_spools()

    def _check_topic_ids(self) -> bool:
        """Send a spool's retained events again when a topic it delivered to has a new id: the
        broker lost that log. False when the broker did not answer."""
        self._next_topic_check = time.monotonic() + TOPIC_CHECK_INTERVAL_S
        spools = self._spools()
        topics = {topic for spool in spools for topic in spool.topic_ids}
        if not topics:
            return True
        current = self._topic_ids.read(topics)
        if current is None:
            return False
        self._missing_topics = {topic for topic in topics if current.get(topic) is None}
        for spool in spools:
            lost = {
                topic: new
                for topic, old in spool.topic_ids.items()
                if (new := current.get(topic)) is not None and new != old
            }
            if not lost:
                continue
            again = spool.rewind()
            # Only once the rewind is durable: a crash in between replays twice, never not.
            spool.save_topic_ids(lost)
            SPOOL_REPLAYS.inc()
            log.warning(
                "Kafka has new logs for %s (the broker lost the old ones); sending the %d "
                "retained events of %s again",
                ", ".join(sorted(lost)),
                again,
                spool.directory,
            )
            # The producer's idempotence state belonged to the lost logs.
            self._close_producer(timeout_s=0.0)
            self._connect()
        return True

    def _know_topics(self, spool: DiskSpool, topics: set[str]) -> bool:
        """Record the log of each topic this spool has not delivered to yet, before it does;
        False when a topic does not exist or the broker did not answer."""
        unknown = topics - spool.topic_ids.keys()
        ids: dict[str, str] = {}
        if unknown:
            current = self._topic_ids.read(unknown)
            if current is None:
                return False
            ids = {topic: new for topic in unknown if (new := current.get(topic)) is not None}
        if missing := sorted((unknown - ids.keys()) | (topics & self._missing_topics)):
            # Whoever starts the broker creates the topics; a send would have the broker
            # create it itself, with its default partitions.
            log.warning("topic %s does not exist; events wait in the spool", ", ".join(missing))
            return False
        if ids:
            spool.save_topic_ids(ids)
        return True

    def _move_queue_to_disk(self) -> None:
        """Behind what the disk holds, in order; the caller holds self._wakeup."""
        if self._queue:
            try:
                self.disk.append(list(self._queue))
            except OSError:
                return
            self._queue.clear()
            log.info("event spool writable again")

    def _replay(self) -> None:
        spool = next(spool for spool in self._spools() if spool.pending)
        spooled = spool.read(BATCH_EVENTS)
        if not spooled:
            return
        if not self._know_topics(spool, {item.envelope.topic for item in spooled}):
            self._mark_down()
            return
        outcome = self._send([item.envelope for item in spooled])
        spool.acknowledge(spooled, outcome)
        if not all(outcome):
            self._mark_down()

    def _deliver_from_memory(self) -> None:
        """While the disk refuses writes: send from memory; what fails stays first in line."""
        with self._wakeup:
            batch = [self._queue.popleft() for _ in range(min(BATCH_EVENTS, len(self._queue)))]
        outcome = self._send(batch)
        failed = [envelope for envelope, ok in zip(batch, outcome, strict=True) if not ok]
        if failed:
            self._mark_down()
            with self._wakeup:
                self._queue.extendleft(reversed(failed))

    def _finish(self) -> None:
        """At shutdown: send what Kafka takes in the time given; the rest stays spooled."""
        deadline = time.monotonic() + self._close_drain_s
        while self._waiting() and not self._broker_down and time.monotonic() < deadline:
            self._drain()
        self.disk.sync()

    def _send(self, batch: Sequence[Envelope]) -> list[bool]:
        """Send and wait for every answer; True where Kafka acknowledged the message, or where
        a message Kafka can never take (over the size limits) went to the DLQ instead."""
        producer = self._producer or self._connect()
        if producer is None:
            return [False] * len(batch)
        futures: list[Any] = []
        for envelope in batch:
            try:
                futures.append(
                    producer.send(envelope.topic, value=envelope.value, key=envelope.key.encode())
                )
            except MessageSizeTooLargeError as exc:
                futures.append(exc)  # this one never can be sent; the rest go on
            except Exception as exc:
                # Not queued (no metadata, buffer full): a definite failure, as is the rest.
                log.warning("Kafka refused a send (%s); it stays spooled", exc)
                break
        outcome = self._wait(producer, futures)
        too_large = {
            index: error
            for index, error in enumerate(
                future if isinstance(future, Exception) else future.exception for future in futures
            )
            if isinstance(error, TOO_LARGE)
        }
        if too_large:
            letters = [
                self._dead_letter(producer, batch[index], error)
                for index, error in too_large.items()
            ]
            for index, ok in zip(too_large, self._wait(producer, letters), strict=True):
                outcome[index] = ok
                if ok:
                    EVENTS_SET_ASIDE.labels(batch[index].topic).inc()
        for index, (envelope, ok) in enumerate(zip(batch, outcome, strict=False)):
            if ok and index not in too_large:
                EVENTS_PUBLISHED.labels(envelope.topic).inc()
        return outcome + [False] * (len(batch) - len(outcome))

    def _wait(self, producer: KafkaProducer, futures: Sequence[Any]) -> list[bool]:
        """Flush, then wait out every future; an exception in place of one is a failure."""
        with contextlib.suppress(Exception):
            producer.flush(timeout=self._delivery_timeout_s + 5)
        outcome = []
        for future in futures:
            if isinstance(future, Exception):
                outcome.append(False)
                continue
            while not future.is_done:
                # Unanswered is not failed: it may still be acknowledged, so wait it out.
                with contextlib.suppress(Exception):
                    future.get(timeout=1.0)
            outcome.append(future.succeeded())
        return outcome

    def _dead_letter(self, producer: KafkaProducer, envelope: Envelope, error: Exception) -> Any:
        """Send a DLQ record in place of an event Kafka cannot take: its ids, size and why,
        never its content (which is what does not fit)."""
        log.error(
            "an event of %d bytes for %s cannot be sent (%s); its ids go to %s",
            len(envelope.value),
            envelope.topic,
            error,
            DLQ_TOPIC,
        )
        letter = DeadLetter(
            source_topic=envelope.topic,
            partition=-1,
            offset=-1,
            key=envelope.key,
            payload=orjson.dumps(event_ids(envelope.value)).decode(),
            reason=(
                f"{len(envelope.value)} bytes: over the size Kafka takes (producer limit"
                f" {self._producer_options.get('max_request_size', 'default')} bytes;"
                f" {type(error).__name__}: {error})"
            )[:2000],
        )
        try:
            return producer.send(DLQ_TOPIC, value=encode(letter), key=envelope.key.encode())
        except Exception as exc:
            return exc

    def _connect(self) -> KafkaProducer | None:
        try:
            self._producer = kafka_client(KafkaProducer, **self._producer_options)
        except (KafkaError, OSError) as exc:
            log.warning(
                "Kafka unreachable at %s (%s); events wait in the spool",
                self.bootstrap_servers,
                exc,
            )
            self._mark_down()
            return None
        if self._broker_down:
            log.info("Kafka is back at %s; replaying the spool", self.bootstrap_servers)
        self._broker_down = False
        self._next_topic_check = 0.0  # before anything is sent: the broker may be a new one
        return self._producer

    def _probe(self) -> bool:
        """Whether Kafka answers again; checked at most once per PROBE_INTERVAL_S."""
        if time.monotonic() < self._next_probe:
            return False
        self._next_probe = time.monotonic() + PROBE_INTERVAL_S
        if not any(_port_open(server) for server in self.bootstrap_servers.split(",")):
            return False
        return self._connect() is not None

    def _mark_down(self) -> None:
        if not self._broker_down:
            log.warning("Kafka unavailable; events wait in the spool at %s", self.disk.directory)
        self._broker_down = True
        self._next_probe = time.monotonic() + PROBE_INTERVAL_S
        # A fresh producer after an outage: a restarted broker may not know the old
        # producer id, and every future of this one has completed.
        self._close_producer(timeout_s=0.0)
        self._topic_ids.close()

    def _close_producer(self, timeout_s: float) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=timeout_s)


def _port_open(server: str, timeout_s: float = 0.5) -> bool:
    host, _, port = server.strip().rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False
