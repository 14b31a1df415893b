"""The stats both connectors share: a keyed stats dict vLLM aggregates across workers and
intervals, and its Prometheus series per engine on vLLM's own ``/metrics`` (counters add,
histograms observe each sample, gauges keep the newest).

Each series is named as vLLM names its connectors' (``vllm:mooncake_<name>``, as NIXL's are
``vllm:nixl_<name>``), which tools that pass on only ``vllm:*`` series (Dynamo's worker
``/metrics``) keep, and under this package's first name, ``mooncake_vllm:<name>``, an alias
kept for one release (docs/architecture.md, "Metrics")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class KeyedStats(KVConnectorStats):
    """Stats as one dict: ``COUNTER_KEYS`` add up, ``SAMPLE_KEYS`` are lists that concatenate,
    ``GAUGE_KEYS`` keep the newest value reported (None: not reported). Subclasses name their
    keys and write ``reduce``."""

    COUNTER_KEYS: ClassVar[tuple[str, ...]] = ()
    SAMPLE_KEYS: ClassVar[tuple[str, ...]] = ()
    GAUGE_KEYS: ClassVar[tuple[str, ...]] = ()

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:  # vLLM rebuilds received stats as cls(data=...): keep those
            self.reset()

    def reset(self) -> None:
        self.data = {
            **dict.fromkeys(self.COUNTER_KEYS, 0),
            **{k: [] for k in self.SAMPLE_KEYS},
            **dict.fromkeys(self.GAUGE_KEYS),
        }

    def count(self, key: str, n: int = 1) -> None:
        self.data[key] += n

    def sample(self, key: str, value: float) -> None:
        self.data[key].append(value)

    def aggregate(self, other: KVConnectorStats) -> KeyedStats:
        for key in self.COUNTER_KEYS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        for key in self.SAMPLE_KEYS:
            self.data[key] = self.data.get(key, []) + list(other.data.get(key, []))
        for key in self.GAUGE_KEYS:
            if other.data.get(key) is not None:
                self.data[key] = other.data[key]
        return self

    def is_empty(self) -> bool:
        d = self.data
        return not any(d.get(k) for k in (*self.COUNTER_KEYS, *self.SAMPLE_KEYS)) and all(
            d.get(k) is None for k in self.GAUGE_KEYS
        )


OLD_PREFIX, PREFIX = "mooncake_vllm:", "vllm:mooncake_"


def vllm_name(name: str) -> str:
    """``mooncake_vllm:<name>`` as vLLM names a connector's series: ``vllm:mooncake_<name>``."""
    return PREFIX + name.removeprefix(OLD_PREFIX)


class _Aliased:
    """One engine's child of a series and of its alias: every update goes to both."""

    __slots__ = ("_children",)

    def __init__(self, *children: Any) -> None:
        self._children = children

    def inc(self, amount: float = 1) -> None:
        for child in self._children:
            child.inc(amount)

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)


class ConnectorPromMetrics(KVConnectorPromMetrics):
    """Subclasses fill ``_counters``, ``_histograms`` and ``_gauges`` (stats key → per-engine
    series) with ``per_engine``; ``observe`` is the same for all."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labelnames, self._labelvalues = labelnames, per_engine_labelvalues
        self._counters: dict[str, dict[int, Any]] = {}
        self._histograms: dict[str, dict[int, Any]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}

    def per_engine(self, cls, name: str, doc: str, **kw) -> dict[int, Any]:
        """``name`` (``mooncake_vllm:<name>``) registered as ``vllm:mooncake_<name>`` and under
        ``name``, its alias; per engine, one child that updates both."""
        new = cls(name=vllm_name(name), documentation=doc, labelnames=self._labelnames, **kw)
        old = cls(name=name, documentation=f"{doc} (alias of {vllm_name(name)})",
                  labelnames=self._labelnames, **kw)  # fmt: skip
        return {i: _Aliased(new.labels(*v), old.labels(*v)) for i, v in self._labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metrics in self._counters.items():
            if transfer_stats_data.get(key):
                metrics[engine_idx].inc(transfer_stats_data[key])
        for key, metrics in self._histograms.items():
            for value in transfer_stats_data.get(key, ()):
                metrics[engine_idx].observe(value)
        for key, metrics in self._gauges.items():
            if (value := transfer_stats_data.get(key)) is not None:
                metrics[engine_idx].set(value)
