"""Speculative acceptance per draft position on a real server: a draft that is the target itself
accepts every draft, so position 0 counts every verification step and the positions sum to the
accepted tokens the clients were told of."""

from __future__ import annotations

import pytest

from tests.entrypoints.test_server_lifecycle import delta, scrape
from tests.entrypoints.test_speculative import MODEL, NO_EOS, PROMPT, client, spec_server  # noqa: F401

pytestmark = pytest.mark.server

PER_POS = "llmserve:spec_decode_num_accepted_tokens_per_pos_total{{position={}}}"


def test_acceptance_per_position_adds_up(spec_server, client):  # noqa: F811
    before = scrape(spec_server)
    usages = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=12, extra_body=NO_EOS).usage
        for p in (PROMPT, "alpha beta")
    ]
    after = scrape(spec_server)
    drafts = sum(u.model_extra["speculative"]["num_drafts"] for u in usages)
    accepted = sum(u.model_extra["speculative"]["num_accepted_tokens"] for u in usages)
    per_position = [delta(after, before, PER_POS.format(p)) for p in range(4)]
    assert delta(after, before, "llmserve:spec_decode_num_drafts_total") == drafts
    assert per_position[0] == drafts  # every step accepted its first draft
    assert per_position == sorted(per_position, reverse=True)  # a later position only after the ones before
    assert sum(per_position) == accepted
    assert after["vllm:" + PER_POS.format(0).removeprefix("llmserve:")] == after[PER_POS.format(0)]
