"""blockspec: an LLM inference engine with DFlash speculative decoding in one-model mode."""

__version__ = "0.1.0"
