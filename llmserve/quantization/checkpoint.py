"""Quantized checkpoints: a directory with `quantized.safetensors` and `quantization.json`.

`llmserve quantize` writes one; `--quantization DIR` reads it back onto the model it was made from.
Only quantized layers are stored (their float weights are not); everything else (embeddings, norms)
comes from the source model, whose SHA-256 (GGUF) or path (HF directory) the json records.

    quantized.safetensors: for each quantized layer NAME (e.g. model.layers.0.mlp.down_proj)
        NAME.qweight  int8 (int8 codes) or uint8 (int4 or 5-bit codes, one per byte)  [out, in]
        NAME.scales   float32 [out, in // group_size]
        NAME.offsets  float32 [out, in // group_size]  (int4 only)
    quantization.json: {"format": 1, "method": ..., "group_size": ..., "source": ..., "source_sha256": ...,
                        "layers": {NAME: {"kind": "int8" | "int4", "group_size": G (, "bits": 5)}}}
(Folded AWQ scales change the source's norm weights too; those are stored as NAME.float tensors.)
A checkpoint written as its weights are read (`save_quantized_stream`: the weights cache's GGUF entry)
holds the same tensors in several files, listed in the json's "files".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
from safetensors.torch import load_file, save_file

from llmserve.quantization.formats import Int4Weight, Int8Weight, QuantizedWeight

FORMAT_VERSION = 1
TENSORS_FILE = "quantized.safetensors"
SHARD_BYTES = 256 << 20  # a streamed checkpoint's files (save_quantized_stream)
INFO_FILE = "quantization.json"


def save_quantized(
    directory: str,
    weights: dict[str, QuantizedWeight],
    info: dict,
    float_tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write the checkpoint; `info` adds method, source and the like to the json."""
    os.makedirs(directory, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    layers = {}
    for name, weight in weights.items():
        tensors.update(_layer_tensors(name, weight))
        layers[name] = _layer_info(weight)
    for name, tensor in (float_tensors or {}).items():
        tensors[f"{name}.float"] = tensor.detach().float().contiguous()
    save_file(tensors, os.path.join(directory, TENSORS_FILE))
    _write_info(directory, {"format": FORMAT_VERSION, **info, "layers": layers})


def save_quantized_stream(
    directory: str, weights: Iterable[tuple[str, QuantizedWeight]], info: dict, shard_bytes: int = SHARD_BYTES
) -> None:
    """Write a checkpoint from (name, weight) pairs as they come, in files of about `shard_bytes`
    (listed in the json's "files"), so that writing it never holds more than a file's worth of them:
    the weights cache's entry of a GGUF kept in its blocks, written as the file is read."""
    os.makedirs(directory, exist_ok=True)
    layers: dict[str, dict] = {}
    files: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    gathered = 0

    def flush() -> None:
        nonlocal gathered
        files.append(f"quantized-{len(files) + 1:05d}.safetensors")
        save_file(tensors, os.path.join(directory, files[-1]))
        tensors.clear()
        gathered = 0

    for name, weight in weights:
        layer = _layer_tensors(name, weight)
        tensors.update(layer)
        layers[name] = _layer_info(weight)
        gathered += sum(t.numel() * t.element_size() for t in layer.values())
        if gathered >= shard_bytes:
            flush()
    if tensors or not files:
        flush()
    _write_info(directory, {"format": FORMAT_VERSION, **info, "layers": layers, "files": files})


def _layer_tensors(name: str, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    tensors = {
        f"{name}.qweight": weight.qweight.contiguous(),
        f"{name}.scales": weight.scales.float().contiguous(),
    }
    if isinstance(weight, Int4Weight):
        tensors[f"{name}.offsets"] = weight.offsets.float().contiguous()
    return tensors


def _layer_info(weight: QuantizedWeight) -> dict:
    layer = {"kind": weight.kind, "group_size": weight.group_size}
    if isinstance(weight, Int4Weight) and weight.bits != 4:  # 5-bit codes (GGUF Q5_0); older: 4-bit
        layer["bits"] = weight.bits
    return layer


def _write_info(directory: str, info: dict) -> None:
    with open(os.path.join(directory, INFO_FILE), "w") as file:
        json.dump(info, file, indent=1)


def read_info(directory: str) -> dict:
    path = os.path.join(directory, INFO_FILE)
    try:
        with open(path) as file:
            info = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{directory} is not a quantized checkpoint ({INFO_FILE}: {error})") from None
    if info.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format {info.get('format')!r}")
    return info


def load_quantized(directory: str) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor], dict]:
    """(quantized layers, float tensors that replace the source's, the json)."""
    info = read_info(directory)
    tensors = {}
    for name in info.get("files", [TENSORS_FILE]):  # mapped, read where touched
        tensors.update(load_file(os.path.join(directory, name)))
    weights: dict[str, QuantizedWeight] = {}
    for name, layer in info["layers"].items():
        if layer["kind"] == "int8":
            weights[name] = Int8Weight(
                tensors[f"{name}.qweight"], tensors[f"{name}.scales"], layer["group_size"]
            )
        else:
            weights[name] = Int4Weight(
                tensors[f"{name}.qweight"],
                tensors[f"{name}.scales"],
                tensors[f"{name}.offsets"],
                layer["group_size"],
                layer.get("bits", 4),
            )
    floats = {key.removesuffix(".float"): value for key, value in tensors.items() if key.endswith(".float")}
    return weights, floats, info


def source_id(model_path: str) -> str:
    """What a checkpoint must be applied to: a GGUF's SHA-256, or an HF directory's real path."""
    from llmserve.model_loader.weights_cache import file_sha256

    if os.path.isfile(model_path):
        return f"sha256:{file_sha256(model_path)}"
    return f"path:{os.path.realpath(model_path)}"
