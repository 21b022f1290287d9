"""Megatron-LM / Megatron-Core optimizer state (see docs/megatron.md)."""
