"""Adapters inside merged batches: per-request LoRA (`lora.py`, `state.py`)."""
