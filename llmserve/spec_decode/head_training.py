"""Training a draft head (proposers/draft_head.py) on text the target model generates itself.

1. **Text.** The target answers prompts of two kinds through the engine: tasks on documents
   (docstrings of standard-library modules that the benchmarks' corpus does not use, with an
   instruction to summarize, explain, list or quote) and open-ended chat requests
   (heads/train_prompts.txt), greedily and, for the chat requests, also sampled at temperature 0.8
   so the head sees more than one answer per prompt.
2. **Features.** Each prompt + answer runs through the target once more, in one forward, keeping
   the final hidden state at every position: f_t, and the target's greedy token after it,
   y_{t+1} = argmax lm_head(f_t), which is what a greedy draft must guess.
3. **Training.** From f_t and the token x_{t+1} the head predicts f_{t+1}, scored by cross-entropy
   of its logits over the vocabulary subset against y_{t+2} plus a smooth-L1 pull towards the true
   f_{t+1}; the prediction is fed back for `unroll` steps (its second and third drafts start from its
   own guesses, as at serving time). AdamW with a one-cycle schedule, on the CPU (bf16 autocast
   where the CPU has native bf16).

Everything is seeded; `llmserve train-draft-head` runs it and reports the held-out acceptance of each
draft position. It takes hours on 2 CPU cores, mostly steps 1 and 2 (the shipped head's
metadata records its `train_seconds`); `--text-cache` keeps their result for training other sizes.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.config import cpu_has_native_bf16
from llmserve.corpus import CORPUS_MODULES
from llmserve.models.layers.vocab_embedding import embedding_table
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposers.draft_head import DraftHead, subset_lm_head_weight

logger = logging.getLogger("llmserve")

# The benchmark corpus (llmserve/corpus.py) is left out of the documents, so the benchmarks measure
# the head on text it was not trained on; so are modules whose import has side effects.
_SKIPPED_MODULES = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip", "venv",
    "pydoc_data", "pydoc", "test", "msilib", "winreg", "winsound", "nt", "msvcrt",
})  # fmt: skip
TRAIN_TASKS = (
    "Summarize this text briefly.",
    "What is the main point of the text above?",
    "Explain the text above to a beginner.",
    "Give the key points of the text above as a list.",
    "Rewrite the passage above more concisely.",
    "Which functions or classes does the text mention?",
    "What does the text above say about errors or exceptions?",
    "Paraphrase the text above.",
    "Write a short summary of the documentation above, then one example of its use.",
    "Quote the most important sentence of the text above and explain it.",
    "Turn the text above into a short FAQ.",
    "What would a programmer use this for, according to the text?",
)
# Open-ended requests: each template with each topic (heads/train_prompts.txt adds hand-written ones).
CHAT_TEMPLATES = (
    "Write a short poem about {}.", "Explain {} to a ten-year-old.", "What are the pros and cons of {}?",
    "Give me five tips about {}.", "Write a short story about {}.", "Describe {} in a few sentences.",
    "How does {} work?", "Write a friendly email to a colleague about {}.", "What is the history of {}?",
    "Why do people care about {}?", "Write a short dialogue between two friends about {}.",
    "List some interesting facts about {}.", "What are common mistakes people make with {}?",
    "Write a blog post introduction about {}.", "Compare {} with something similar.",
    "What questions should I ask an expert on {}?", "Write a product description related to {}.",
    "Give a step-by-step guide to getting started with {}.", "What does the future of {} look like?",
    "Write a persuasive paragraph about {}.",
)  # fmt: skip
CHAT_TOPICS = (
    "gardening", "the ocean", "electric cars", "learning a language", "coffee", "space travel", "bees",
    "video games", "public libraries", "running a marathon", "baking bread", "volcanoes", "chess",
    "social media", "climate change", "renewable energy", "dogs", "cats", "the human brain", "music",
    "photography", "recycling", "the internet", "ancient Rome", "the moon", "forests", "budgeting",
    "cooking pasta", "winter", "friendship", "robots", "trains", "mountains", "rainy days", "museums",
    "remote work", "meditation", "sleep", "vaccines", "birds", "bicycles", "deserts", "jazz",
    "painting", "the solar system", "public speaking", "time management", "smartphones", "tea",
    "earthquakes", "dinosaurs", "the Olympics", "chocolate", "islands", "lighthouses", "kindness",
    "airplanes", "rivers", "history books", "board games", "camping", "city parks", "farming",
    "birthdays", "the stock market", "artificial intelligence", "recycling plastic", "fishing",
    "architecture", "poetry", "the water cycle", "honey", "snow", "autumn", "summer holidays",
    "moving to a new city", "starting a business", "writing a novel", "learning to code", "yoga",
    "healthy breakfasts", "old maps", "castles", "pirates", "dragons", "the night sky", "bridges",
    "electricity", "magnets", "the heart", "DNA", "clouds", "tides", "rainbows", "deep sea creatures",
    "spiders", "mushrooms", "cheese", "street food", "languages of the world", "handwriting", "clocks",
    "science fairs", "first jobs", "teachers", "grandparents", "neighbors", "kites", "puzzles",
)  # fmt: skip


@dataclass(frozen=True)
class HeadTrainingConfig:
    num_grounded: int = 1200  # document prompts, answered greedily
    num_chat: int = 1200  # chat requests (see chat_requests), answered greedily
    num_sampled_chat: int = 400  # of those, answered a second time sampling at temperature 0.8
    max_tokens: int = 256  # answer length at most
    intermediate_size: int = 1536
    vocab_subset: int = 8192  # the most frequent target tokens the head can propose
    unroll: int = 3  # draft steps trained on the head's own guesses
    epochs: int = 3
    batch_size: int = 512
    learning_rate: float = 2e-3
    feature_loss_weight: float = 0.1
    held_out: float = 0.1  # sequences kept for the acceptance report
    seed: int = 0
    medusa_heads: int = 0  # > 0: train that many Medusa heads instead (medusa_training.py)

    def __post_init__(self) -> None:
        if self.medusa_heads < 0:
            raise ValueError(f"medusa_heads must be >= 0, got {self.medusa_heads}")
        for name in ("max_tokens", "intermediate_size", "vocab_subset", "unroll", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_grounded", "num_chat", "num_sampled_chat"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_sampled_chat and not self.num_chat:
            raise ValueError("num_sampled_chat needs num_chat >= 1 (it samples answers to those requests)")
        if self.learning_rate <= 0 or not 0 < self.held_out < 1:
            raise ValueError("learning_rate must be > 0 and held_out in (0, 1)")


@dataclass
class TrainingText:
    sequences: list[list[int]]  # prompt + answer
    num_prompt_tokens: list[int]
    greedy: list[bool]  # answered greedily (acceptance is reported on these)


def chat_prompts() -> list[str]:
    text = (resources.files("llmserve.spec_decode") / "heads" / "train_prompts.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def documents() -> list[str]:
    """Distinct docstrings (over 200 characters) of standard-library modules and their public classes
    and functions, the benchmark corpus's modules left out."""
    skipped = _SKIPPED_MODULES | set(CORPUS_MODULES)
    docs: dict[str, None] = {}
    for name in sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in skipped):
        try:
            with warnings.catch_warnings():  # modules deprecated in this Python say so on import
                warnings.simplefilter("ignore", DeprecationWarning)
                module = importlib.import_module(name)
        except ImportError:
            continue
        docs[inspect.getdoc(module) or ""] = None
        for attr in sorted(dir(module)):
            member = getattr(module, attr, None)
            if not attr.startswith("_") and (inspect.isclass(member) or inspect.isfunction(member)):
                docs[inspect.getdoc(member) or ""] = None
    return [doc for doc in docs if len(doc) > 200]


def chat_requests(rng: np.random.Generator) -> list[str]:
    """The hand-written requests, then every template x topic pair in a seeded order."""
    pairs = [t.format(topic) for t in CHAT_TEMPLATES for topic in CHAT_TOPICS]
    return chat_prompts() + [pairs[i] for i in rng.permutation(len(pairs))]


def training_requests(tokenizer, config: HeadTrainingConfig) -> list[tuple[list[int], SamplingParams]]:
    """The prompts the target answers for its training text, and how (greedy, or sampled), seeded."""
    rng = np.random.default_rng(config.seed)
    docs = documents()

    def chat(content: str) -> list[int]:
        messages = [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    greedy = SamplingParams(temperature=0, max_tokens=config.max_tokens)
    requests = []
    for _ in range(config.num_grounded):  # a window of 100-450 tokens at a random offset of a document
        ids = tokenizer.encode(docs[int(rng.integers(len(docs)))])
        length = int(rng.integers(100, 450))
        start = int(rng.integers(max(1, len(ids) - length + 1)))
        task = TRAIN_TASKS[int(rng.integers(len(TRAIN_TASKS)))]
        requests.append((chat(f"{tokenizer.decode(ids[start : start + length]).strip()}\n\n{task}"), greedy))
    chats = chat_requests(rng)[: config.num_chat]
    requests += [(chat(c), greedy) for c in chats]
    for index in range(config.num_sampled_chat):  # a second, sampled answer to some requests
        sampled = SamplingParams(
            temperature=0.8, top_p=0.95, seed=config.seed + index, max_tokens=config.max_tokens
        )
        requests.append((chat(chats[index % len(chats)]), sampled))
    return requests


def generate_text(llm, config: HeadTrainingConfig) -> TrainingText:
    """The target's own answers to the training prompts (step 1 of the module docstring)."""
    prompts, params = zip(*training_requests(llm.tokenizer, config), strict=True)
    outputs = llm.generate(list(prompts), list(params))
    sequences = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    greedy = [p.is_greedy for p in params]
    return TrainingText(sequences, [len(p) for p in prompts], greedy)


@torch.inference_mode()
def collect_features(llm, text: TrainingText) -> list[torch.Tensor]:
    """Each sequence's final hidden states [len, H] on the CPU from one prefill (step 2), caught by the
    model runner while the engine computes the sequence as a prompt (prefix caching must be off)."""
    if llm.engine.config.cache.enable_prefix_caching:
        raise ValueError("collect_features needs an engine without prefix caching")
    features = []
    with llm.engine.model_runner.capture_hidden_states() as captured:
        for sequence in text.sequences:
            captured.clear()
            llm.generate([sequence], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            features.append(torch.cat(captured)[: len(sequence)].to("cpu"))
    return features


@dataclass
class _Examples:
    """Training examples, one per (sequence, anchor position j), for `unroll` steps from there."""

    features: torch.Tensor  # [N, H] f at the anchor
    tokens: torch.Tensor  # [N, U] the tokens fed at steps 1..U (x_{j+1}..x_{j+U})
    target_features: torch.Tensor  # [N, U, H] f_{j+1}..f_{j+U}
    labels: torch.Tensor  # [N, U] greedy tokens y_{j+2}..y_{j+U+1}, as indices into the vocabulary subset

    def take(self, index: torch.Tensor) -> _Examples:
        return _Examples(
            self.features[index], self.tokens[index], self.target_features[index], self.labels[index]
        )


@torch.no_grad()
def _answer_arrays(target, text: TrainingText, features: list[torch.Tensor]):
    """Per sequence, over its answer: the tokens, the features before each, and the greedy labels."""
    befores = [  # f_t for t from the last prompt token on, each predicting the token at t + 1
        feature[num_prompt - 1 : len(sequence) - 1]
        for sequence, num_prompt, feature in zip(
            text.sequences, text.num_prompt_tokens, features, strict=True
        )
    ]
    labels = _greedy_tokens(target, torch.cat(befores)).split([len(b) for b in befores])
    return [
        (torch.tensor(sequence[num_prompt:]), before, label)
        for sequence, num_prompt, before, label in zip(
            text.sequences, text.num_prompt_tokens, befores, labels, strict=True
        )
    ]


def _greedy_tokens(target, hidden: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """argmax lm_head(hidden) per row, in chunks of one size (oneDNN keeps a primitive, and its
    memory, per input shape: one call per sequence length grew the process by gigabytes)."""
    device = target.model.norm.weight.device
    return torch.cat([
        target.compute_logits(hidden[i : i + chunk].to(device)).argmax(dim=-1).cpu()
        for i in range(0, len(hidden), chunk)
    ])  # fmt: skip


def _examples(arrays, indices, unroll: int, remap: torch.Tensor) -> _Examples:
    parts = []
    for i in indices:
        tokens, before, labels = arrays[i]
        if len(labels) < unroll + 2:
            continue
        anchors = torch.arange(len(labels) - unroll)
        steps = anchors[:, None] + torch.arange(unroll)[None, :]
        parts.append((before[anchors], tokens[steps], before[steps + 1], remap[labels[steps + 1]]))
    if not parts:
        raise ValueError(f"too little training text: no answer of at least {unroll + 2} tokens")
    features, tokens, targets, labels = (torch.cat(column) for column in zip(*parts, strict=True))
    return _Examples(features.float(), tokens, targets, labels)


def train_draft_head(
    target,
    text: TrainingText,
    features: list[torch.Tensor],
    config: HeadTrainingConfig,
    progress: Callable[[str], None] = logger.info,
) -> tuple[DraftHead, dict]:
    """(head in float32, report): step 3 of the module docstring; `progress` gets a line per epoch."""
    torch.manual_seed(config.seed)
    arrays = _answer_arrays(target, text, features)
    counts = torch.bincount(torch.cat([labels for _, _, labels in arrays]), minlength=target.arch.vocab_size)
    vocab_ids = torch.argsort(counts, descending=True, stable=True)[: config.vocab_subset]
    coverage = counts[vocab_ids].sum().item() / counts.sum().item()
    remap = torch.full((len(counts),), -100, dtype=torch.int64)  # -100: outside the subset, not scored
    remap[vocab_ids] = torch.arange(len(vocab_ids))

    # held out: greedy answers only (acceptance is reported for greedy drafting)
    order = torch.randperm(len(arrays), generator=torch.Generator().manual_seed(config.seed)).tolist()
    greedy_order = [i for i in order if text.greedy[i]]
    held = set(greedy_order[: max(1, int(len(greedy_order) * config.held_out))])
    train = _examples(arrays, [i for i in range(len(arrays)) if i not in held], config.unroll, remap)
    test = _examples(arrays, sorted(held), config.unroll, remap)

    # The head trains on the CPU in float32 whatever device the target serves on, with bf16 autocast
    # where the CPU computes bf16 natively (elsewhere PyTorch's bf16 matmul falls back to a scalar loop).
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_native_bf16())
    embedding = embedding_table(target.model.embed_tokens).detach().to("cpu", torch.float32)
    subset_weight = subset_lm_head_weight(target, vocab_ids).to("cpu", torch.float32)
    arch = target.arch
    head = DraftHead(arch.hidden_size, config.intermediate_size, vocab_ids, arch.rms_norm_eps)
    with torch.no_grad():  # start at "the next feature is this one" with the target's output scale
        head.fc_out.weight.zero_()
        head.fc_out.bias.zero_()
        head.out_norm.weight.copy_(target.model.norm.weight.float())
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate, weight_decay=0.0)
    steps_per_epoch = len(train.features) // config.batch_size
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, config.learning_rate, total_steps=steps_per_epoch * config.epochs, pct_start=0.05
    )

    def run(batch: _Examples) -> tuple[torch.Tensor, torch.Tensor]:
        feature, loss, correct = batch.features, 0.0, []
        for step in range(config.unroll):
            with autocast:
                feature = head(feature, embedding[batch.tokens[:, step]])
                logits = feature @ subset_weight.T
            feature, logits, labels = feature.float(), logits.float(), batch.labels[:, step]
            target_feature = batch.target_features[:, step].float()
            loss = loss + F.cross_entropy(logits, labels, ignore_index=-100)
            loss = loss + config.feature_loss_weight * F.smooth_l1_loss(feature, target_feature)
            correct.append(logits.argmax(dim=-1) == labels)
        return loss, torch.stack(correct, dim=1)

    start = time.monotonic()
    acceptance: list[float] = []
    for epoch in range(config.epochs):
        head.train()
        permutation = torch.randperm(len(train.features))
        total = 0.0
        for step in range(steps_per_epoch):
            index = permutation[step * config.batch_size : (step + 1) * config.batch_size]
            loss, _ = run(train.take(index))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item()
        head.eval()
        with torch.no_grad():
            _, correct = run(test)
        # P(the first j drafts are all right), teacher-forced on the held-out greedy answers
        acceptance = correct.cumprod(dim=1).float().mean(dim=0).tolist()
        progress(
            f"epoch {epoch + 1}/{config.epochs}: loss {total / steps_per_epoch:.3f}, held-out acceptance "
            f"of drafts 1..{config.unroll}: {', '.join(f'{a:.3f}' for a in acceptance)} "
            f"({time.monotonic() - start:.0f} s)"
        )
    report = {
        "config": asdict(config),
        "training_tokens": int(sum(len(labels) for _, _, labels in arrays)),
        "vocab_subset_coverage": round(coverage, 4),
        "held_out_acceptance": [round(a, 4) for a in acceptance],
        "train_seconds": round(time.monotonic() - start, 1),
    }
    return head, report
