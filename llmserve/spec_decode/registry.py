"""Proposers by `--speculative-method`: each builds a `Proposer` (proposer.py) for the target."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from llmserve.config import EngineConfig
from llmserve.spec_decode.proposer import Proposer
from llmserve.spec_decode.proposers.draft_head import create_draft_head_proposer
from llmserve.spec_decode.proposers.draft_model import create_draft_model_proposer, create_early_exit_proposer
from llmserve.spec_decode.proposers.eagle import create_eagle_proposer
from llmserve.spec_decode.proposers.medusa import create_medusa_proposer
from llmserve.spec_decode.proposers.ngram import NgramProposer
from llmserve.spec_decode.proposers.suffix import SuffixProposer
from llmserve.worker.model_runner import ModelRunner

_PROPOSERS: dict[str, Callable[[EngineConfig, nn.Module, ModelRunner], Proposer]] = {
    "ngram": lambda config, target, runner: NgramProposer(config.speculative),
    "draft": create_draft_model_proposer,
    "early_exit": create_early_exit_proposer,
    "draft_head": lambda config, target, runner: create_draft_head_proposer(config, target),
    "suffix": lambda config, target, runner: SuffixProposer(config.speculative, runner.requests),
    "medusa": lambda config, target, runner: create_medusa_proposer(config, target),
    "eagle": lambda config, target, runner: create_eagle_proposer(config, target),
}


def create_proposer(config: EngineConfig, target: nn.Module, target_runner: ModelRunner) -> Proposer | None:
    """The proposer `config.speculative` names, for `target` run by `target_runner`; None when off."""
    if config.speculative is None:
        return None
    return _PROPOSERS[config.speculative.method](config, target, target_runner)
