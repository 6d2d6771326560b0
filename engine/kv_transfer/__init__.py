"""Prefill/decode disaggregation: finished prefill blocks sent from a producer engine to a consumer engine."""
