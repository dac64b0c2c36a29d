"""LoRA adapters served over the base model (llmserve/lora, docs/lora.md): which, and how many at once."""

from __future__ import annotations

from dataclasses import dataclass

# rank times a fused layer's shards the CPU's compiled delta takes (kMaxWidth in kernels/csrc/lora.cpp)
LORA_KERNEL_MAX_WIDTH = 512


@dataclass(frozen=True)
class LoRAConfig:
    modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT directory) of each adapter loaded at start
    max_loras: int = 1  # adapters resident in the stacked weights at once; others wait in host memory
    max_lora_rank: int = 16  # the largest rank an adapter may have (the stacked weights' width)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names a LoRA adapter twice: {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.modules)

    @classmethod
    def create(
        cls, enable: bool, modules: tuple[str, ...] | list[str] | None, max_loras: int, max_lora_rank: int
    ) -> LoRAConfig | None:
        """None unless `enable`; `modules`: "name=path" strings (vLLM's --lora-modules form)."""
        if not enable:
            if modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return None
        return cls(tuple(_parse_module(text) for text in modules or ()), max_loras, max_lora_rank)


def _parse_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path, got {text!r}")
    return name, path
