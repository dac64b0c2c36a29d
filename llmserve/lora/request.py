"""vLLM's offline way of naming an adapter: `LLM.generate(..., lora_request=LoRARequest(...))`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the adapter's name (SamplingParams.lora_name)
    lora_int_id: int  # vLLM's numeric id; unused here (adapters are keyed by name and weights)
    lora_path: str  # a PEFT directory or a .gguf LoRA file, loaded on first use
