"""LoRA adapters over the base model (docs/lora.md): PEFT directories read into host memory
(adapter.py), up to `max_loras` of them resident in per-layer stacked weights (weights.py), and a
manager that assigns resident slots in LRU order and adds each row's adapter delta after the
targeted linear layers (manager.py)."""
