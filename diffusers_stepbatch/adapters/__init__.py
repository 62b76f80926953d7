"""Adapters inside merged batches: per-request LoRA (`lora.py`, `state.py`) and IP-Adapter (`ip_*.py`, `sd3_*.py`)."""
