"""The adapters an engine serves: all of them in host memory, up to `max_loras` resident in the
stacked weights (weights.py), swapped in least-recently-used order; and the hooks that add each
row's adapter delta after the targeted linear layers of the base model.

The delta is added by forward hooks on the model's own linear modules (the model file knows
nothing of adapters, and the modules keep their names and kernels). The fused C++ decode stack runs
no hooks: the model runner binds the stacked adapters to it (`stack_layers`), which adds the same
deltas with the same kernel, or gives it only steps without an adapter where it cannot. CUDA graphs
are not captured when LoRA is enabled.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from llmserve.config import ModelArchConfig
from llmserve.config.lora import LoRAConfig
from llmserve.distributed.shard import ShardLayout
from llmserve.lora.adapter import LoRAAdapter, load_peft_adapter
from llmserve.lora.gguf_adapter import load_gguf_adapter
from llmserve.lora.weights import LoRALayerWeights, SlotGroups

# fused module of a decoder layer -> the checkpoint modules stacked into it, in order
_FUSED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
_SHARD_OF = {
    module: (fused, index) for fused, modules in _FUSED.items() for index, module in enumerate(modules)
}
# a checkpoint module that is a whole fused layer (Phi-3): one A for every shard, B's rows split
_WHOLE = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}


def _fused_of(module: str) -> str:
    return _WHOLE[module] if module in _WHOLE else _SHARD_OF[module][0]


class SlotTable:
    """Which adapters hold the `max_loras` slots, least recently used first; `write(slot, name)`
    copies an adapter into a slot when it is swapped in."""

    def __init__(self, max_loras: int, write: Callable[[int, str], None]) -> None:
        self.max_loras = max_loras
        self.write = write
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.free = list(range(max_loras - 1, -1, -1))

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """A slot for each named adapter, swapping in the missing ones over the least recently used
        adapters not named; ValueError if more are named than there are slots."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters; --max-loras is {self.max_loras}")
        for name in wanted:
            if name in self.resident:
                self.resident.move_to_end(name)
        for name in wanted:
            if name not in self.resident:
                slot = self.free.pop() if self.free else self._evict(set(wanted))
                try:
                    self.write(slot, name)
                except BaseException:
                    self.free.append(slot)  # a refused adapter leaves its slot free, not lost
                    raise
                self.resident[name] = slot
        return {name: self.resident[name] for name in wanted}

    def _evict(self, keep: set[str]) -> int:
        victim = next(name for name in self.resident if name not in keep)
        return self.resident.pop(victim)

    def release(self, name: str) -> None:
        """Forget an unloaded adapter's slot (it is free for the next one)."""
        slot = self.resident.pop(name, None)
        if slot is not None:
            self.free.append(slot)


class LoRAManager:
    def __init__(
        self, config: LoRAConfig, model: nn.Module, dtype: torch.dtype, device: torch.device
    ) -> None:
        """`dtype`, `device`: the model's compute dtype and device (a quantized layer has no float
        weight to read them from); the deltas are kept and added in `dtype`."""
        self.config = config
        self.dtype = dtype
        self.arch = model.arch  # a GGUF adapter's q/k rows are put back in order by its heads
        self.shard = model.shard  # tensor parallelism: the heads and units this rank holds
        self.adapters: dict[str, LoRAAdapter] = {}  # every loaded adapter, in host memory
        self._cache_keys: dict[str, bytes] = {}  # name -> the prefix-cache key of its requests
        self.slots = SlotTable(config.max_loras, self._write_slot)
        self.layers: dict[tuple[int, str], LoRALayerWeights] = {}  # (layer, fused module) -> stacks
        self._groups: SlotGroups | None = None  # the step being run's rows by slot; None: no adapter
        self._token_slots: torch.Tensor | None = None  # and each of its rows' slot (on the device)
        self._device = torch.device(device)
        for index, layer in _decoder_layers(model):
            for fused, modules in _FUSED.items():
                self._attach(index, fused, layer.get_submodule(fused), _shard_sizes(layer, fused, modules))
        for name, path in config.modules:
            self.load(name, path)

    def _attach(self, index: int, fused: str, linear: nn.Module, shard_sizes: tuple[int, ...]) -> None:
        config = self.config
        weights = LoRALayerWeights(
            linear, shard_sizes, config.max_loras, config.max_lora_rank, self.dtype, self._device
        )
        self.layers[(index, fused)] = weights

        def add_delta(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if self._groups is None:  # no row of this step has an adapter
                return None
            weights.add_delta(inputs[0], output, self._groups, self._token_slots)
            return output

        linear.register_forward_hook(add_delta)

    def add(self, adapter: LoRAAdapter) -> None:
        """Hold an adapter in host memory (resident once a step uses it); ValueError if its layers or
        shapes do not fit the model, or the name is taken."""
        if adapter.name in self.adapters:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        missing = [
            layer for layer, module in adapter.weights if (layer, _fused_of(module)) not in self.layers
        ]
        if missing:
            raise ValueError(f"adapter {adapter.name!r} targets layer {missing[0]}, which the model lacks")
        self.adapters[adapter.name] = adapter
        try:
            self.slots.slots_for([adapter.name])  # written once now: its shapes are checked at load
        except BaseException:  # whatever refused it, the name stays free
            del self.adapters[adapter.name]
            raise
        self._cache_keys[adapter.name] = _content_key(adapter)

    def cache_key(self, name: str | None) -> bytes:
        """The prefix-cache key of requests under adapter `name` (b"": the base model): a digest of
        what the adapter computes, so blocks cached under an unloaded adapter never serve other
        weights loaded again by its name, and the key is the same on every replica and restart."""
        return b"" if name is None else self._cache_keys[name]

    def load(self, name: str, path: str) -> None:
        """Read the adapter at `path` (a PEFT directory or a llama.cpp GGUF LoRA file) into host memory
        as `name` (add's errors)."""
        if path.endswith(".gguf"):
            adapter = load_gguf_adapter(name, path, self.config.max_lora_rank, self.dtype, self.arch)
        else:
            adapter = load_peft_adapter(name, path, self.config.max_lora_rank, self.dtype)
        self.add(adapter)

    def check_name(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"the LoRA adapter {name!r} does not exist")

    def remove(self, name: str) -> None:
        """Unload an adapter (ValueError if unknown); requests using it must have finished."""
        self.check_name(name)
        del self.adapters[name]
        del self._cache_keys[name]
        self.slots.release(name)

    def _write_slot(self, slot: int, name: str) -> None:
        adapter = self.adapters[name]
        by_layer: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            a, b = _rank_part(module, a.to(self._device), b.to(self._device), self.shard, self.arch)
            if module in _WHOLE:
                by_layer[(layer, _WHOLE[module])] = self._split_whole(layer, module, a, b)
                continue
            fused, shard = _SHARD_OF[module]
            by_layer.setdefault((layer, fused), {})[shard] = (a, b)
        for key, weights in self.layers.items():
            weights.load(slot, by_layer.get(key, {}), adapter.scale)

    def _split_whole(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor) -> dict:
        """A whole fused layer's (A, B) as its shards' pairs: x A^T B_i^T is shard i's part."""
        sizes = self.layers[(layer, _WHOLE[module])].shard_sizes
        if b.shape[0] != sum(sizes):
            raise ValueError(f"LoRA B of {module} has {b.shape[0]} rows; the layer has {sum(sizes)}")
        return dict(enumerate((a, rows) for rows in b.split(sizes)))

    def rows_computed_alone(self) -> bool:
        """Whether every layer adds its deltas by the compiled CPU kernel at any row count, each row
        alone (batch invariant); the grouped matmuls of a layer it does not take (and of CUDA's prompt
        steps) are blocked by the step's row count."""
        layers = self.layers.values()
        return all(weights.kernel is not None and weights.kernel_max_rows is None for weights in layers)

    @property
    def token_slots(self) -> torch.Tensor | None:
        """The step being run's slot of each row (-1: none), where a row has an adapter."""
        return self._token_slots

    def stack_layers(self) -> list[tuple[LoRALayerWeights, ...]]:
        """Per decoder layer in order, the stacks of qkv, o, gate_up and down (the fused decode stack's)."""
        indices = sorted({index for index, _ in self.layers})
        return [tuple(self.layers[(index, fused)] for fused in _FUSED) for index in indices]

    def row_slots(self, names: list[str | None]) -> np.ndarray:
        """Each row's slot (-1: the base model), swapping in the adapters the rows name."""
        slots = self.slots.slots_for(name for name in names if name is not None)
        return np.array([-1 if name is None else slots[name] for name in names], dtype=np.int64)

    @contextlib.contextmanager
    def activate(self, token_slots: np.ndarray | None) -> Iterator[None]:
        """Within the block, the hooks add each token's adapter delta (`token_slots`: per flat token,
        -1 for the base model; None: no token has an adapter)."""
        self._groups = None if token_slots is None else self._group(token_slots)
        if self._groups is not None:  # the kernels' per-row slots, on the device they run on
            self._token_slots = self._to_device(token_slots)
        try:
            yield
        finally:
            self._groups = self._token_slots = None

    def _group(self, token_slots: np.ndarray) -> SlotGroups | None:
        first = int(token_slots[0])
        if token_slots.size == 1 or (token_slots == first).all():  # one adapter or none (batch 1)
            return None if first < 0 else [(first, None)]
        slots = np.unique(token_slots)
        if slots[-1] < 0:
            return None
        if len(slots) == 1:
            return [(int(slots[0]), None)]
        return [(int(s), self._to_device(np.flatnonzero(token_slots == s))) for s in slots if s >= 0]

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        """An int64 host array on the engine's device; on CUDA from pinned memory, queued (no sync)."""
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self._device.type == "cuda":
            return tensor.pin_memory().to(self._device, non_blocking=True)
        return tensor.to(self._device)


def _content_key(adapter: LoRAAdapter) -> bytes:
    """sha256 of the adapter's scale and weights (its name and path do not change its KV)."""
    digest = hashlib.sha256(struct.pack("<d", adapter.scale))
    for key in sorted(adapter.weights):
        digest.update(repr(key).encode())
        for tensor in adapter.weights[key]:
            digest.update(memoryview(tensor.contiguous().view(torch.uint8).numpy()))
    return b"lora:" + digest.digest()


def _rank_part(module: str, a: torch.Tensor, b: torch.Tensor, shard: ShardLayout, arch: ModelArchConfig):
    """The (A, B) of this rank's shard of its layer (all of it with one rank): a column-parallel
    layer's B rows of the rank's heads or units, a row-parallel one's A columns of its inputs. The
    row-parallel delta is then a partial sum, added before the layer's all-reduce like its output."""
    hd, units = arch.head_dim, shard.intermediate
    q, kv, mlp = (
        slice(shard.q_heads.start * hd, shard.q_heads.stop * hd),
        slice(shard.kv_heads.start * hd, shard.kv_heads.stop * hd),
        slice(units.start, units.stop),
    )
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    if module in rows:
        return a, b[rows[module]]
    if module in ("o_proj", "down_proj"):
        return a[:, q if module == "o_proj" else mlp], b
    if module == "qkv_proj":  # Phi-3's whole fused layer: [q; k; v] rows, each part sliced
        parts = _split_rows(module, b, [arch.num_attention_heads * hd, *[arch.num_key_value_heads * hd] * 2])
        return a, torch.cat([parts[0][q], parts[1][kv], parts[2][kv]])
    parts = _split_rows(module, b, [arch.intermediate_size] * 2)  # gate_up_proj: [gate; up]
    return a, torch.cat([parts[0][mlp], parts[1][mlp]])


def _split_rows(module: str, b: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """B's rows split into the fused layer's parts; ValueError (not torch's error) for an adapter
    built for another model's shapes."""
    if b.shape[0] != sum(sizes):
        raise ValueError(f"LoRA B of {module} has {b.shape[0]} rows; the model's layer has {sum(sizes)}")
    return b.split(sizes)


def _decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, layer) of the decoder layers this model builds, with the modules adapters target."""
    layers = list(enumerate(model.model.layers))
    for index, layer in layers:
        for fused in _FUSED:
            try:
                layer.get_submodule(fused)
            except AttributeError:
                raise ValueError(
                    f"LoRA adapters need {fused} in every decoder layer; layer {index} of this model lacks it"
                ) from None
    return layers


def _shard_sizes(layer: nn.Module, fused: str, modules: tuple[str, ...]) -> tuple[int, ...]:
    linear = layer.get_submodule(fused)
    if fused == "self_attn.qkv_proj":
        attention = layer.self_attn
        return (attention.q_size, attention.kv_size, attention.kv_size)
    return tuple(linear.out_features // len(modules) for _ in modules)
