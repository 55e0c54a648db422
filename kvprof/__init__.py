"""kvprof: what storage does during LLM prefill and decode."""
__version__ = "0.1.0"
