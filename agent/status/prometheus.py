"""The Prometheus exposition of a ``/status`` document (``GET /metrics``).

Its own module so that ``prometheus_client`` is imported on the first scrape, not when the
daemon starts: :func:`agent.status.views.render` loads it (a supervising agent that nobody scrapes
never pays for the library). See :mod:`agent.status.views` for what the series say and why a missing
value is left out.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.policy.resume import counted
from agent.state import Phase

#: Every series is named ``libreyolo_agent_<what>``, after Prometheus' naming rules
#: (https://prometheus.io/docs/practices/naming/): base units as suffixes (``_seconds``,
#: ``_bytes``, ``_ratio``), ``_total`` on counters, ``_timestamp_seconds`` on epoch times, and no
#: label Prometheus sets itself (``job``, ``instance``). Prices keep the providers' ``_per_hour``.
PREFIX = "libreyolo_agent_"

#: Series renamed to follow those rules (old name -> new name), for the README's note: a
#: dashboard built on an old name finds its new one here.
RENAMED = {
    "libreyolo_agent_seconds_since_progress": "libreyolo_agent_time_since_progress_seconds",
    "libreyolo_agent_seconds_to_deadline": "libreyolo_agent_time_to_deadline_seconds",
    "libreyolo_agent_job_info{job}": "libreyolo_agent_job_info{job_name}",
    "libreyolo_agent_resumes": "libreyolo_agent_resumes_total",
}


def render(doc: Mapping[str, Any], *, now: float | None = None) -> bytes:
    """The Prometheus text exposition (:data:`CONTENT_TYPE`) of a ``/status`` document.

    ``now`` (epoch seconds) is what ``libreyolo_agent_time_to_deadline_seconds`` counts from: the
    document's own ``now`` when it has one, else ``now``, else the wall clock.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(doc, now=now))
    return generate_latest(registry)


def _num(value: Any) -> float | None:
    """A number the document really holds (NaN and infinities included: Prometheus takes
    them); None for a missing value, a bool, a string or anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


class _StatusCollector(Collector):
    """One scrape's worth of series, read defensively out of one /status document."""

    def __init__(self, doc: Mapping[str, Any], *, now: float | None) -> None:
        self.doc = doc
        doc_now = _num(doc.get("now"))
        self.now = doc_now if doc_now is not None else (now if now is not None else time.time())

    def collect(self) -> Iterator[Metric]:
        yield from self._agent()
        yield from self._training()
        yield from self._sync()
        yield from self._limits()
        yield from self._notify()

    # ---- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _gauge(name: str, doc: str, value: Any) -> Iterator[Metric]:
        number = _num(value)
        if number is not None:
            yield GaugeMetricFamily(PREFIX + name, doc, value=number)

    @classmethod
    def _flag(cls, name: str, doc: str, value: Any) -> Iterator[Metric]:
        """A 0/1 gauge of a bool the document holds (left out when it holds something else)."""
        if isinstance(value, bool):
            yield from cls._gauge(name, doc, int(value))

    @staticmethod
    def _counter(name: str, doc: str, value: Any) -> Iterator[Metric]:
        number = _num(value)
        if number is not None and number >= 0:
            yield CounterMetricFamily(PREFIX + name, doc, value=number)

    @staticmethod
    def _labelled(
        name: str, doc: str, label: str, values: Iterable[tuple[str, Any]]
    ) -> Iterator[Metric]:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=[label])
        for key, value in values:
            number = _num(value)
            if number is not None:
                family.add_metric([key], number)
        if family.samples:
            yield family

    # ---- the parts of the document ----------------------------------------------------------

    def _agent(self) -> Iterator[Metric]:
        doc = self.doc
        yield GaugeMetricFamily(PREFIX + "up", "1: the agent answered this scrape", value=1)
        job = doc.get("job")
        if isinstance(job, str):
            # ``job_name``: Prometheus sets ``job`` itself (the scrape job) and would rename ours.
            info = GaugeMetricFamily(
                PREFIX + "job_info", "the job this agent runs", labels=["job_name"]
            )
            info.add_metric([job], 1)
            yield info
        phase = doc.get("phase")
        if isinstance(phase, str):
            names = [p.value for p in Phase]
            if phase not in names:
                names.append(phase)  # a phase newer than this module still shows
            yield from self._labelled(
                "phase",
                "1 for the run's current phase, 0 for the others",
                "phase",
                ((name, 1 if name == phase else 0) for name in names),
            )
        yield from self._gauge(
            "start_time_seconds", "when the job first booted (epoch seconds)", doc.get("started_at")
        )
        trainer = _dict(doc.get("trainer"))
        yield from self._flag(
            "trainer_alive", "1 while the training process lives", trainer.get("alive")
        )
        yield from self._gauge(
            "trainer_start_time_seconds",
            "when the running trainer was launched (epoch seconds)",
            trainer.get("started_at"),
        )
        if "state_write_error" in doc:
            yield from self._flag(
                "state_write_failing",
                "1 while state.json cannot be written (the run goes on; a restart loses the news)",
                doc["state_write_error"] is not None,
            )
        yield from self._flag(
            "teardown_open",
            "1 while a teardown is decided and the provider has not confirmed it (may still bill)",
            doc.get("teardown_open"),
        )
        yield from self._supervision(_dict(doc.get("supervision")))

    def _supervision(self, supervision: Mapping[str, Any]) -> Iterator[Metric]:
        resumes = supervision.get("resumes")
        if isinstance(resumes, list):
            yield from self._counter(
                "resumes",
                "times the trainer was resumed in this job (crashes, reboots, preemptions, "
                "new boxes; kept in state.json across agent restarts)",
                len(resumes),
            )
            limit = supervision.get("max_restarts")
            if isinstance(limit, int) and not isinstance(limit, bool):
                yield from self._gauge(
                    "restarts_remaining",
                    "resumes left before the agent gives up (limits.max_restarts less the "
                    "resumes that count; a handled preemption does not)",
                    max(0, limit - counted(resumes)),
                )
        stall = _dict(supervision.get("stall"))
        yield from self._gpus(stall.get("gpus"))
        yield from self._gauge(
            "time_since_progress_seconds",
            "seconds since the trainer last showed progress (a new epoch, log line, checkpoint)",
            stall.get("quiet_s"),
        )
        yield from self._gauge(
            "stall_threshold_seconds",
            "the quiet time after which the trainer counts as stalled",
            stall.get("threshold_s"),
        )
        if "box_fault" in supervision:
            yield from self._flag(
                "box_fault",
                "1 once a GPU fault says resuming on this box is pointless (a new box is needed)",
                supervision["box_fault"] is not None,
            )
        preemption = supervision.get("preemption")
        if isinstance(preemption, Mapping):
            notice = preemption.get("notice")
            yield from self._flag(
                "preemption_notice",
                "1 once the provider announced that the box is going away",
                notice is not None,
            )
            yield from self._gauge(
                "preemption_action_timestamp_seconds",
                "when the provider said it will take the box (epoch seconds)",
                _dict(notice).get("action_at"),
            )

    def _gpus(self, gpus: Any) -> Iterator[Metric]:
        """Per GPU (label ``gpu``: its NVML index), from the stall watch's latest NVML sample
        (:meth:`agent.gpu.health.GpuSample.as_dict`): no NVML call of its own."""
        rows = [g for g in gpus if isinstance(g, Mapping)] if isinstance(gpus, list) else []
        indexed = [
            (str(g["index"]), g)
            for g in rows
            if isinstance(g.get("index"), int) and not isinstance(g.get("index"), bool)
        ]
        for name, field, doc in (
            ("gpu_memory_used_bytes", "memory_used_bytes", "device memory in use, bytes"),
            ("gpu_memory_total_bytes", "memory_total_bytes", "device memory in all, bytes"),
        ):
            yield from self._labelled(
                name,
                f"{doc} (NVML, the stall watch's latest sample)",
                "gpu",
                ((index, g.get(field)) for index, g in indexed),
            )

    def _training(self) -> Iterator[Metric]:
        doc = self.doc
        yield from self._gauge("epoch", "epochs completed", doc.get("epoch"))
        yield from self._gauge("total_epochs", "epochs the run trains for", doc.get("total_epochs"))
        yield from self._gauge(
            "eta_seconds",
            "seconds until training ends, at the mean epoch time",
            doc.get("eta_seconds"),
        )
        row = _dict(doc.get("metrics"))
        yield from self._gauge(
            "train_loss", "the last epoch's training loss", row.get("train/loss")
        )
        yield from self._gauge("epoch_seconds", "the last epoch's duration", row.get("time"))
        yield from self._labelled(
            "train_loss_item",
            "the last epoch's training loss components",
            "name",
            (
                (key.removeprefix("train/"), value)
                for key, value in row.items()
                if key.startswith("train/") and key != "train/loss"
            ),
        )
        metrics = {
            key.removeprefix("metrics/"): value
            for key, value in row.items()
            if key.startswith("metrics/")
        }
        current = row.get("current_metric_name")
        if isinstance(current, str) and current not in metrics:
            metrics[current] = row.get("current_metric")
        yield from self._labelled(
            "metric",
            "the last validation's metrics (mAP50_95: the main one)",
            "name",
            metrics.items(),
        )
        best_name = row.get("best_metric_name")
        if isinstance(best_name, str):
            yield from self._labelled(
                "best_metric",
                "the best value of the main metric so far",
                "name",
                [(best_name, doc.get("best_metric"))],
            )
        yield from self._gauge(
            "best_epoch", "the epoch of the best checkpoint", doc.get("best_epoch")
        )
        yield from self._labelled(
            "learning_rate",
            "the last epoch's learning rate per parameter group",
            "group",
            ((k.removeprefix("lr/"), v) for k, v in row.items() if k.startswith("lr/")),
        )
        verdict = _dict(_dict(doc.get("sizing")).get("verdict"))
        gpu_util = _num(verdict.get("gpu_util"))
        yield from self._gauge(
            "gpu_utilization_ratio",
            "mean utilisation of the job's GPUs over the sizing window (0 to 1)",
            None if gpu_util is None else gpu_util / 100.0,
        )

    def _sync(self) -> Iterator[Metric]:
        sync = _dict(self.doc.get("sync"))
        yield from self._gauge(
            "last_synced_epoch",
            "the newest epoch whose checkpoint is verified on the target",
            self.doc.get("last_synced_epoch"),
        )
        yield from self._counter(
            "uploads_verified",
            "uploads read back and verified on the target (this agent process)",
            sync.get("uploads_done"),
        )
        yield from self._counter(
            "uploads_failed",
            "upload attempts that failed (this agent process)",
            sync.get("uploads_failed"),
        )
        yield from self._counter(
            "uploaded_bytes",
            "bytes uploaded and verified (this agent process)",
            sync.get("uploaded_bytes"),
        )
        queue, in_flight = sync.get("queue"), sync.get("in_flight")
        if isinstance(queue, list) and isinstance(in_flight, list):
            yield from self._gauge(
                "uploads_pending", "uploads queued or in flight", len(queue) + len(in_flight)
            )
        yield from self._gauge(
            "upload_bytes_per_second", "observed checkpoint upload speed", sync.get("bytes_per_s")
        )
        yield from self._gauge(
            "last_upload_timestamp_seconds",
            "when the last upload was verified on the target (epoch seconds)",
            sync.get("last_success_at"),
        )
        if "stalled_since" in sync:
            yield from self._gauge(
                "uploads_stalled",
                "1 while uploads are owed and none completes",
                int(sync["stalled_since"] is not None),
            )
        yield from self._flag(
            "disk_full",
            "1 while the disk is too full to snapshot checkpoints",
            sync.get("disk_full"),
        )

    def _limits(self) -> Iterator[Metric]:
        money = _dict(self.doc.get("money"))
        yield from self._gauge("cost_usd", "spent on the box so far (USD)", money.get("spent_usd"))
        yield from self._gauge(
            "projected_cost_usd",
            "spent plus the rest of training (USD)",
            money.get("projected_usd"),
        )
        yield from self._gauge("budget_usd", "the job's budget (USD)", money.get("budget_usd"))
        yield from self._gauge(
            "price_usd_per_hour", "the box's price (USD per hour)", money.get("price_usd_per_hour")
        )
        yield from self._gauge(
            "stopped_price_usd_per_hour",
            "what the box costs per hour once stopped (its disk only)",
            money.get("stopped_usd_per_hour"),
        )
        limits = _dict(self.doc.get("limits"))
        deadlines = {
            name: limits.get(f"{name}_at") for name in ("max_runtime", "budget", "stop_training")
        }
        yield from self._labelled(
            "deadline_timestamp_seconds",
            "when each limit fires (epoch seconds): max_runtime, budget, stop_training",
            "limit",
            deadlines.items(),
        )
        ends = [
            t for t in (_num(deadlines["max_runtime"]), _num(deadlines["budget"])) if t is not None
        ]
        if ends:
            yield from self._gauge(
                "time_to_deadline_seconds",
                "seconds until the earlier of max_runtime and the budget (negative: past it)",
                min(ends) - self.now,
            )
        steering = _dict(self.doc.get("steering"))
        yield from self._gauge(
            "extended_seconds",
            "seconds added to max_runtime by extend",
            steering.get("extended_s"),
        )
        hold = _dict(steering.get("hold"))
        if hold.get("active") is True:
            yield from self._gauge(
                "hold_remaining_seconds",
                "seconds left on the teardown hold",
                hold.get("remaining_s"),
            )

    def _notify(self) -> Iterator[Metric]:
        notify = _dict(self.doc.get("notify"))
        yield from self._counter(
            "notifications_sent",
            "webhook notices delivered (this agent process)",
            notify.get("sent"),
        )
        yield from self._counter(
            "notifications_failed",
            "webhook notices that failed for good (this agent process)",
            notify.get("failed"),
        )
        yield from self._counter(
            "notifications_dropped",
            "webhook notices dropped because the queue was full (this agent process)",
            notify.get("dropped"),
        )
        yield from self._gauge(
            "notifications_queued", "webhook notices waiting to be sent", notify.get("queued")
        )
