"""A draft head: a small network trained on the target's own outputs, drafting from its last hidden state.

The target's forward already computes, for each request, the final hidden state f_t that its next
token was sampled from. The head turns (f_t, embedding of the token x_{t+1} just sampled) into a guess
of f_{t+1}, whose logits under the target's lm_head propose x_{t+2}; fed its own guess and its draft,
it proposes x_{t+3}, and so on (a recurrent MLP in the spirit of Hydra's sequentially dependent heads
and EAGLE's feature-level drafting, without EAGLE's attention layer, so it keeps no KV cache):

    f_{t+1} = out_norm(f_t + W_out silu(W_in [f_t ; token_norm(e_{x_{t+1}})] + b_in) + b_out)

Drafts are proposed right after the step that sampled x_{t+1}, for the next step to verify, so the
head adds no target forward and needs no catch-up; where prompt lookup finds a match it proposes
instead (its drafts are then right more often than the head's). Only logits over a fixed vocabulary
subset are computed (the tokens the target actually emits in the training text: 8,192 of SmolLM2's
49,152 cover 99.1% of them), which keeps a draft step to a few MB of weights.

The head is trained by `llmserve train-draft-head` (spec_decode/head_training.py) on text the target
itself generates, and is tied to that target by a sample of its embedding rows. The package ships
one for the default model (spec_decode/heads/).
"""

from __future__ import annotations

import functools
import json
import logging
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from llmserve.config.speculative import SpeculativeConfig
from llmserve.kernels.cpu_ops import cpu_ops_for
from llmserve.kernels.small_batch_linear import MAX_ROWS, use_small_batch_linear
from llmserve.models.layers.custom_op import bind_kernels
from llmserve.models.layers.lm_head import LMHead
from llmserve.models.layers.norm import RMSNorm
from llmserve.models.layers.vocab_embedding import embedding_rows, embedding_table
from llmserve.request import DraftProposal
from llmserve.sample.logits_processors import needs_processing
from llmserve.sample.sampler import greedy_token_ids
from llmserve.sample.speculative import (
    build_row_metadata,
    exponential_race,
    greedy_rows,
    process_logits,
    uniform_rows,
)
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.spec_decode.proposers.ngram import PromptLookup
from llmserve.worker.request_state import CachedRequestState

logger = logging.getLogger("llmserve")

FORMAT = "llmserve-draft-head-v1"
# Embedding rows a head keeps of its target, to recognize it (see is_head_target).
_SAMPLE_ROWS = 64
# A request's drafts end where the head's chained confidence (product of its top probabilities) drops
# below this: a wrong draft costs a verify row and a head step, a right one saves a whole step.
DEFAULT_MIN_CONFIDENCE = 0.2


class DraftHead(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, vocab_ids: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.token_norm = RMSNorm(hidden_size, eps)
        self.fc_in = nn.Linear(2 * hidden_size, intermediate_size)
        self.fc_out = nn.Linear(intermediate_size, hidden_size)
        self.out_norm = RMSNorm(hidden_size, eps)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.int64), persistent=False)

    def forward(self, feature: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """The next position's feature, guessed from this one's and the embedding of the token there."""
        # The compiled norm kernel has no backward: training takes the PyTorch formulation.
        norm = RMSNorm.reference if torch.is_grad_enabled() else RMSNorm.forward
        hidden = F.silu(self.fc_in(torch.cat([feature, norm(self.token_norm, token_embedding)], dim=-1)))
        return norm(self.out_norm, feature + self.fc_out(hidden))

    @property
    def intermediate_size(self) -> int:
        return self.fc_in.out_features


def target_sample(target: nn.Module) -> torch.Tensor:
    """What ties a head to its target: embedding rows spread over the vocabulary ([64, H] float32)."""
    embedding = target.model.embed_tokens
    ids = torch.linspace(0, embedding.num_embeddings - 1, _SAMPLE_ROWS).round().long()
    return embedding_rows(embedding, ids).detach().to("cpu", torch.float32)


def is_head_target(sample: torch.Tensor, target: nn.Module) -> bool:
    """Whether `target` is the model a head was trained for: the same embedding rows up to rounding
    (a bf16, float16 or float32 load of one checkpoint agree; another model's rows do not)."""
    own = target_sample(target)
    return own.shape == sample.shape and torch.allclose(own, sample.float(), rtol=2e-2, atol=2e-3)


def subset_lm_head_weight(target: nn.Module, vocab_ids: torch.Tensor) -> torch.Tensor:
    """The target's output embedding rows of `vocab_ids`: from the input embedding when they are tied
    (a quantized lm_head then needs no dequantizing), else from the lm_head's weight, or the rows its
    quantized kernel rebuilds exactly (float32; a kernel that cannot is refused)."""
    if target.arch.tie_word_embeddings:
        return embedding_rows(target.model.embed_tokens, vocab_ids).detach().contiguous()
    weight = getattr(target.lm_head, "weight", None)
    if weight is not None:
        return weight.detach()[vocab_ids.to(weight.device)].contiguous()
    if hasattr(target.lm_head, "weight_rows"):  # a bf16 head on its packed copy alone (LogitsLinear)
        return target.lm_head.weight_rows(vocab_ids).contiguous()
    kernel = getattr(target.lm_head, "kernel", None)
    device = next(kernel.buffers()).device if kernel is not None else None
    rows = None if kernel is None else kernel.weight_rows(vocab_ids.to(device))
    if rows is None:
        raise ValueError(
            "the draft-head methods need the lm_head's rows, which its quantized kernel cannot rebuild "
            "exactly (--quantization none serves it in float)"
        )
    return rows.contiguous()


def save_draft_head(path: str | Path, head: DraftHead, target: nn.Module, info: dict) -> None:
    """Weights in bf16 (as they are served), the vocabulary subset and the target's sample rows."""
    tensors = {
        name: tensor.detach().to("cpu", torch.bfloat16).contiguous()
        for name, tensor in head.state_dict().items()
    }
    tensors["vocab_ids"] = head.vocab_ids.to("cpu", torch.int32).contiguous()
    tensors["target_sample"] = target_sample(target).contiguous()
    metadata = {
        "format": FORMAT,
        "hidden_size": str(head.fc_out.out_features),
        "intermediate_size": str(head.intermediate_size),
        "rms_norm_eps": str(head.out_norm.eps),
        "info": json.dumps(info, sort_keys=True),
    }
    save_file(tensors, str(path), metadata=metadata)


def load_draft_head(
    path: str | Path, target: nn.Module, dtype: torch.dtype, device: torch.device
) -> DraftHead:
    """The head at `path`; ValueError if it is not a head or was trained for another target."""
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not an llmserve draft head (format {metadata.get('format')!r})")
        tensors = load_file(str(path))
        if not is_head_target(tensors.pop("target_sample"), target):
            raise ValueError(
                f"draft head {path} was trained for another model; train one for this model with "
                "`llmserve train-draft-head`"
            )
        head = DraftHead(
            int(metadata["hidden_size"]),
            int(metadata["intermediate_size"]),
            tensors.pop("vocab_ids"),
            float(metadata["rms_norm_eps"]),
        )
        head.load_state_dict(tensors)
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - unreadable, truncated or inconsistent: one user error
        raise ValueError(f"cannot read draft head {path}: {error}") from error
    head = head.to(device=device, dtype=dtype).eval()
    bind_kernels(head, device)
    return head


def packaged_draft_head() -> Path:
    """The head shipped for the default model (SmolLM2-135M-Instruct)."""
    return Path(str(resources.files("llmserve.spec_decode") / "heads" / "smollm2-135m-instruct.safetensors"))


class DraftHeadProposer:
    """The Proposer of `--speculative-method draft_head`: after each step, prompt lookup where it finds
    a match and the head elsewhere, for the requests that sampled (the head's drafts as q over the
    vocabulary where the request samples, its argmax where it is greedy)."""

    def __init__(
        self,
        head: DraftHead,
        target: nn.Module,
        config: SpeculativeConfig,
        vocab_size: int,
        min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    ) -> None:
        self.head = head
        self.embed_tokens = target.model.embed_tokens
        self.config = config
        self.max_drafts = config.draft_head_tokens
        self.vocab_size = vocab_size
        lookup = config.prompt_lookup_max  # 0: the head alone
        self.lookup = PromptLookup(config.prompt_lookup_min, lookup) if lookup else None
        self.min_confidence = min_confidence
        # The lm_head rows of the vocabulary subset: logits for the tokens the head can propose.
        weight = subset_lm_head_weight(target, head.vocab_ids).to(head.fc_in.weight.dtype)
        self.subset_head = LMHead(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        self.subset_head.weight = nn.Parameter(weight, requires_grad=False)

    def modules(self) -> list[nn.Module]:
        """The modules to hand to `use_small_batch_linear` (the compiled small-batch linear kernel)."""
        return [self.head, self.subset_head]

    @torch.inference_mode()
    def propose(self, batch: SampledBatch) -> dict[str, DraftProposal | None]:
        """Prompt lookup's drafts where it finds a match, else the head's from the final hidden state
        each request's last new token was sampled from.

        A request's head drafts stop where the head's confidence that all of them are right (the
        product of its top probabilities) falls below `min_confidence`: a wrong draft costs a verify
        row and a head step, a right one saves a whole step.
        """
        proposals: dict[str, DraftProposal | None] = {}
        counts = [self._lookup_or_head(batch, index, proposals) for index in range(len(batch.requests))]
        rows = [i for i, k in enumerate(counts) if k > 0]
        if not rows:
            return proposals
        features = batch.last_hidden()
        requests = [batch.requests[i] for i in rows]
        new_token_ids = [batch.new_token_ids[i] for i in rows]
        counts = [counts[i] for i in rows]
        feature = features[rows] if len(rows) < len(features) else features
        tokens = torch.tensor([ids[-1] for ids in new_token_ids], dtype=torch.int64, device=feature.device)
        # the full processing (q over the vocabulary) where a row samples or has a logits processor
        sampling = any(not _plain_greedy(r.sampling_params) for r in requests)
        chain = None if sampling or len(requests) > MAX_ROWS else self.compiled_chain
        if chain is not None:
            drafts, confident = chain.greedy(feature, tokens, max(counts), self.min_confidence)
            probs = []
        else:
            drafts, confident, probs = self._run(feature, tokens, requests, new_token_ids, counts, sampling)
        lengths = confident.cumprod(dim=1).sum(dim=1).tolist()
        draft_ids = drafts.tolist()  # the host sync
        for i, (request, count, length) in enumerate(zip(requests, counts, lengths, strict=True)):
            k = min(count, length)
            q = None
            if k and sampling and not request.sampling_params.is_greedy:
                q = torch.stack([step_probs[i] for step_probs in probs[:k]])
            num_tokens = request.num_tokens + len(new_token_ids[i])
            proposals[request.request_id] = DraftProposal(num_tokens, draft_ids[i][:k], q)
        return proposals

    def _run(
        self,
        feature: torch.Tensor,
        tokens: torch.Tensor,
        requests: list[CachedRequestState],
        new_token_ids: list[list[int]],
        counts: list[int],
        sampling: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The head's steps op by op: drafts [B, steps], whether each row's chained confidence held
        there [B, steps], and when some request samples the q of each step ([B, V] per step)."""
        drafts: list[torch.Tensor] = []  # [B] per draft position
        probs: list[torch.Tensor] = []  # [B, V] per draft position, when some request samples
        confident: list[torch.Tensor] = []  # [B] per draft position: the chained confidence holds
        chained = torch.ones(len(requests), device=feature.device)
        for step in range(max(counts)):
            feature = self.head(feature, self.embed_tokens(tokens))
            logits = self.subset_head(feature)
            if sampling:
                # Only requests still drafting draw from their generators, so a seeded request's
                # draws do not depend on how long the others in the batch draft.
                still = (chained >= self.min_confidence).tolist()
                drafting = [step < k and c for k, c in zip(counts, still, strict=True)]
                tokens_before = [
                    ids + d for ids, d in zip(new_token_ids, _so_far(drafts, len(requests)), strict=True)
                ]
                tokens, step_probs = self._sample(logits, requests, tokens_before, drafting)
                probs.append(step_probs)
            else:
                tokens = self.head.vocab_ids[greedy_token_ids(logits)]
            chained = chained * logits.float().softmax(dim=-1).amax(dim=-1)
            drafts.append(tokens)
            confident.append(chained >= self.min_confidence)
            if not bool(confident[-1].any()):  # a host sync per draft position, cheap next to a step
                break
        return torch.stack(drafts, dim=1), torch.stack(confident, dim=1), probs

    @functools.cached_property
    def compiled_chain(self) -> object | None:
        """The compiled greedy chain (kernels/csrc/draft_head.cpp) over this head's kernel-packed
        weights, or None where the head's linears are not on the small-batch kernels (no compiled
        kernels, not a CPU, a dtype they do not take). Built on first use: `create_draft_head_proposer`
        swaps the head's linears to their kernels after creating this proposer."""
        linears = (self.head.fc_in, self.head.fc_out, self.subset_head)
        packed = [getattr(module, "small_batch_weight", None) for module in linears]
        ops = cpu_ops_for(self.head.token_norm.weight)  # the linears' own weights may be freed
        if ops is None or any(weight is None for weight in packed):
            return None
        return ops.DraftHeadChain(
            self._embedding_table(),
            self.head.token_norm.weight.detach(),
            packed[0],
            self.head.fc_in.bias.detach(),
            packed[1],
            self.head.fc_out.bias.detach(),
            self.head.out_norm.weight.detach(),
            packed[2],
            self.head.vocab_ids,
            self.head.intermediate_size,
            self.head.out_norm.eps,
        )

    def _embedding_table(self) -> torch.Tensor:
        """The chain looks up any token in the whole table: a quantized embedding's float copy is
        rebuilt for it (kept as long as the chain)."""
        if not isinstance(self.embed_tokens, nn.Embedding):
            logger.info(
                "draft head: its compiled chain keeps a copy of the embedding rebuilt from the head's"
            )
        return embedding_table(self.embed_tokens).detach()

    def _lookup_or_head(
        self, batch: SampledBatch, index: int, proposals: dict[str, DraftProposal | None]
    ) -> int:
        """Put prompt lookup's proposal for request `index` in `proposals` where it finds a match (and
        return 0), else None, and return how many drafts the head may propose."""
        request = batch.requests[index]
        proposal = None
        if self.lookup is not None:
            k = batch.draft_limit(index, self.config.drafts_for(request.sampling_params))
            proposal = self.lookup.proposal(batch, index, k)
        proposals[request.request_id] = proposal
        if proposal is not None:
            return 0
        k = request.sampling_params.num_speculative_tokens
        return batch.draft_limit(index, min(self.max_drafts if k is None else k, self.max_drafts))

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[CachedRequestState],
        tokens_before: list[list[int]],
        drafting: list[bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts drawn from q, the head's distribution processed like the target's (greedy rows: its
        argmax), and q over the whole vocabulary ([B, V], zero outside the subset)."""
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.head.vocab_ids] = logits
        # tokens_before[i]: this step's new tokens (not yet in the request) and the drafts so far
        metadata = build_row_metadata(requests, tokens_before, self.vocab_size, full.device)
        greedy_ids, processed = process_logits(full, metadata)
        probs = processed.softmax(dim=-1)
        greedy = greedy_rows(metadata, len(requests), full.device)
        is_random = [r and d for r, d in zip((~greedy).tolist(), drafting, strict=True)]
        noise = uniform_rows(
            [1] * len(requests), metadata.generators, is_random, full.device, probs.shape[-1]
        )
        return torch.where(greedy, greedy_ids, exponential_race(probs, noise)), probs


def _plain_greedy(params: SamplingParams) -> bool:
    return params.is_greedy and not needs_processing(params)


def _so_far(drafts: list[torch.Tensor], num_rows: int) -> list[list[int]]:
    """Per row, the drafts proposed so far (`drafts`: one [B] tensor per draft position)."""
    if not drafts:
        return [[] for _ in range(num_rows)]
    return torch.stack(drafts, dim=1).tolist()


def create_draft_head_proposer(config, target: nn.Module) -> DraftHeadProposer:
    """`--speculative-method draft_head`: the head at `--speculative-draft-head` (default: the one
    shipped for the default model), its linears on the small-batch kernels with bf16 weights."""
    spec = config.speculative
    path = spec.draft_head or packaged_draft_head()
    head = load_draft_head(path, target, config.model.dtype, config.model.device)
    logger.info(
        "speculative decoding: draft head %s (%d-wide, %d-token vocabulary subset), up to %d drafts per step",
        path,
        head.intermediate_size,
        len(head.vocab_ids),
        spec.draft_head_tokens,
    )
    proposer = DraftHeadProposer(head, target, spec, config.model.arch.vocab_size)
    for module in proposer.modules():  # drafts need not be exact: bf16 reads
        use_small_batch_linear(module, float32_kernel_weights=torch.bfloat16)
    return proposer
