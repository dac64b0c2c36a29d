"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU.

Other families subclass these modules and swap parts at construction (`attention_cls`, `mlp_cls`,
`layer_cls`, `model_cls`, `make_rotary`), so this path's forward has no per-family branch.

The model runs on a flat batch of tokens from many sequences (no padding) with per-token positions.
It knows nothing of batching or the KV cache layout: its Attention layers read those from the forward
context. Module names follow the HF checkpoint so weights load by name; q/k/v and gate/up are fused
into one matmul each and filled shard by shard at load time.

Under tensor parallelism (docs/parallelism.md) each rank builds the part `ShardLayout` gives it:
q/k/v and gate/up column-parallel (its heads, its intermediate units), o_proj and down_proj
row-parallel with an all-reduce after them, the embedding and lm_head split by vocabulary rows.
Every linear layer stays a plain `nn.Linear` of the rank's shape, so the compiled CPU kernels and
the small-batch packing (kernels/small_batch_linear.py) serve a shard as they serve a whole model;
with one rank every collective returns its input.

Under pipeline parallelism each rank builds its stage's layers (`PipelineStage`); the others are
`MissingLayer` placeholders, so parameter names keep the checkpoint's layer numbers. The first
stage embeds the tokens, the others start from the previous stage's hidden states; only the last
applies the final norm and has the output projection (a tied one loads the embedding's weights).
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.layer import Attention
from llmserve.config import ModelArchConfig
from llmserve.distributed.group import TensorParallelGroup, single_rank
from llmserve.distributed.pipeline import PipelineStage
from llmserve.distributed.shard import ShardLayout
from llmserve.models.layers.activation import SiluAndMul
from llmserve.models.layers.lm_head import LMHead
from llmserve.models.layers.norm import RMSNorm
from llmserve.models.layers.rotary import RotaryEmbedding
from llmserve.models.layers.vocab_embedding import VocabParallelEmbedding


class LlamaAttention(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, rotary: RotaryEmbedding, shard: ShardLayout, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        num_heads, num_kv_heads = len(shard.q_heads), len(shard.kv_heads)
        self.q_size = num_heads * arch.head_dim
        self.kv_size = num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = Attention(num_heads, num_kv_heads, arch.head_dim)
        self.tp = tp

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, key = self.rotary(positions, query, key, self.head_dim)
        return self.tp.all_reduce(self.o_proj(self.attn(query, key, value)))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, shard: ShardLayout, tp: TensorParallelGroup) -> None:
        super().__init__()
        intermediate = len(shard.intermediate)
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, arch.hidden_size, bias=False)
        self.act_fn = SiluAndMul()
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(hidden))))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention  # a family's own attention or MLP (qwen3.py, ...)
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(
        self, arch: ModelArchConfig, rotary: RotaryEmbedding, shard: ShardLayout, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self.attention_cls(arch, rotary, shard, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = self.mlp_cls(arch, shard, tp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden))
        # attn_out becomes hidden + attn_out, and its normalization comes back with it: one pass
        normed, hidden = self.post_attention_layernorm(attn_out, residual=hidden)
        return hidden + self.mlp(normed)


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters, never called."""


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(
        self,
        arch: ModelArchConfig,
        rotary: RotaryEmbedding,
        shard: ShardLayout,
        tp: TensorParallelGroup,
        stage: PipelineStage,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.embed_tokens = VocabParallelEmbedding(shard, arch.hidden_size, tp) if stage.is_first else None
        self.layers = nn.ModuleList(
            self.make_layer(index, arch, rotary, shard, tp) if index in stage.layers else MissingLayer()
            for index in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if stage.is_last else None

    def make_layer(self, index: int, arch, rotary, shard, tp) -> nn.Module:
        """Decoder layer `index` (a family with layers of several kinds chooses here: gemma.py)."""
        return self.layer_cls(arch, rotary, shard, tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final hidden states, or on a stage before the last its output for the next stage;
        `hidden`: the previous stage's output (every stage but the first)."""
        if self.stage.is_first:
            hidden = self.embed_tokens(input_ids)
        for index in self.stage.layers:
            hidden = self.layers[index](positions, hidden)
        return self.norm(hidden) if self.stage.is_last else hidden


class LlamaForCausalLM(nn.Module):
    model_cls: type[nn.Module] = LlamaModel
    # models/decode_stack.py runs exactly this layer structure; a family that differs turns it off
    fused_decode_stack = True
    # scores the compiled paged kernel cannot compute (soft-capping): the reference attention backend
    reference_attention_only = False

    # fused parameter -> the checkpoint tensors stacked into it, in order
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    # checkpoint tensor -> (the dimension split over ranks, the layout's range along it, its unit)
    tensor_parallel_splits = {
        "q_proj": (0, "q_heads", "head"),
        "k_proj": (0, "kv_heads", "head"),
        "v_proj": (0, "kv_heads", "head"),
        "o_proj": (1, "q_heads", "head"),
        "gate_proj": (0, "intermediate", "row"),
        "up_proj": (0, "intermediate", "row"),
        "down_proj": (1, "intermediate", "row"),
        "embed_tokens": (0, "vocab", "row"),
        "lm_head": (0, "vocab", "row"),
    }

    def __init__(
        self,
        arch: ModelArchConfig,
        max_positions: int,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp or single_rank()
        self.stage = stage or PipelineStage.whole(arch.num_hidden_layers)
        self.shard = ShardLayout.of(arch, self.tp.world_size, self.tp.rank)
        self.model = self.model_cls(
            arch, self.make_rotary(arch, max_positions, device), self.shard, self.tp, self.stage
        )
        self.lm_head = (
            LMHead(arch.hidden_size, self.shard.vocab_rows, bias=False) if self.stage.is_last else None
        )

    @staticmethod
    def make_rotary(arch: ModelArchConfig, max_positions: int, device: torch.device):
        return RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] for a flat batch of tokens; under pipeline parallelism
        this stage's, from the previous stage's `hidden`."""
        return self.model(input_ids, positions, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab] (models/layers/lm_head.py says why float32); under tensor
        parallelism every rank's vocabulary block gathered on rank 0, None on the others."""
        logits = self.tp.gather_to_first(self.lm_head(hidden))
        if logits is None or self.tp.world_size == 1:
            return logits
        return logits[:, : self.arch.vocab_size].contiguous()  # the last block's padding off

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers (every layer's without pipeline parallelism), in order."""
        return [self.model.layers[index].self_attn.attn for index in self.stage.layers]

    def load_weights(self, weights: dict[str, torch.Tensor], left_out: frozenset[str] = frozenset()) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, filling fused ones by shard.
        `left_out`: checkpoint tensors a quantization fills instead (`parameters_left_out`)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        if self.stage.is_last and not self.stage.is_first and self.arch.tie_word_embeddings:
            weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}  # no embedding here
        for name, tensor in weights.items():
            target, offset = self._fused_target(name, params)
            param = params.get(target)
            if param is None:
                if "rotary_emb" in name or not self._on_this_stage(name):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
            tensor = self._rank_part(name, tensor)
            rows = tensor.shape[0]
            param.data[offset : offset + rows].copy_(tensor)
            if target == name and rows < param.shape[0]:  # the last vocabulary block's padding: zeros
                param.data[rows:].zero_()
            loaded.add(name)
        if self.arch.tie_word_embeddings and self.stage.is_first and self.stage.is_last:
            self.lm_head.weight = self.model.embed_tokens.weight
            loaded.add("lm_head.weight")
        self._check_complete(loaded | left_out)

    def parameters_left_out(self, left_out: frozenset[str]) -> set[str]:
        """The parameters no checkpoint tensor is copied into, which stay unallocated: those whose
        every tensor is in `left_out` (a quantization replaces their module), and a tied head, which
        becomes the embedding's. A fused parameter with only some of its tensors left out is an error."""
        names = set()
        for name, _ in self.named_parameters():
            sources = set(self.checkpoint_names(name))
            if sources <= left_out:
                names.add(name)
            elif sources & left_out:
                raise ValueError(f"{name}: only {sorted(sources & left_out)} of its tensors are left out")
        if self.arch.tie_word_embeddings and self.stage.is_first and self.stage.is_last:
            names.add("lm_head.weight")
        return names

    def _on_this_stage(self, name: str) -> bool:
        """Whether the checkpoint tensor belongs to a module this pipeline stage builds."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.stage.layers
        if name.startswith("model.embed_tokens."):
            return self.stage.is_first
        if name.startswith(("model.norm.", "lm_head.")):
            return self.stage.is_last
        return True

    def _fused_target(self, name: str, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        """Map e.g. layers.0.self_attn.k_proj.weight to (layers.0.self_attn.qkv_proj.weight, row offset)."""
        for fused, shards in self.packed_modules.items():
            for index, shard in enumerate(shards):
                if f".{shard}." in name:
                    target = name.replace(shard, fused)
                    return target, sum(self._shard_rows(fused, s) for s in shards[:index])
        return name, 0

    def _shard_rows(self, fused: str, shard: str) -> int:
        """Rows of `shard` (q_proj, gate_proj, ...) in this rank's fused parameter."""
        if fused == "gate_up_proj":
            return len(self.shard.intermediate)
        heads = self.shard.q_heads if shard == "q_proj" else self.shard.kv_heads
        return len(heads) * self.arch.head_dim

    def _split_of(self, name: str) -> tuple[int, str, str] | None:
        module = name.split(".")[-2]  # model.layers.0.self_attn.q_proj.weight -> q_proj
        return self.tensor_parallel_splits.get(module)  # None: replicated (the norms)

    def _rank_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a checkpoint tensor this rank holds (all of it with one rank)."""
        split = self._split_of(name)
        if split is None or self.tp.world_size == 1:
            return tensor
        dim, part, unit = split
        units = getattr(self.shard, part)
        scale = self.arch.head_dim if unit == "head" else 1
        return tensor.narrow(dim, units.start * scale, len(units) * scale)

    def checkpoint_names(self, parameter: str) -> list[str]:
        """The checkpoint tensors (HF names) a parameter is filled from: a fused one's shards, in order."""
        fused = next((f for f in self.packed_modules if f".{f}." in parameter), None)
        if fused is None:
            return [parameter]
        return [parameter.replace(fused, shard) for shard in self.packed_modules[fused]]

    def _check_complete(self, loaded: set[str]) -> None:
        expected = {source for name, _ in self.named_parameters() for source in self.checkpoint_names(name)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
