"""statekit: see, move and replay optimizer state (burn, PyTorch, candle/safetensors)."""

__version__ = "0.1.0"
