"""Engine metrics: the Prometheus exporter (vLLM names) and the periodic log line."""

from pagoda.engine.metrics.log_line import LoggingStatLogger
from pagoda.engine.metrics.prometheus import PrometheusStatLogger

__all__ = ["LoggingStatLogger", "PrometheusStatLogger"]
