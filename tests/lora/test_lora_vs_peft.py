"""LoRA adapters end to end: random PEFT adapters over a tiny random Llama, each served by llmserve
in float32 against PEFT's own merged model (`merge_and_unload`), alone, mixed in one batch with
other adapters and the base model, swapped in LRU order, and kept apart in the prefix cache."""

from __future__ import annotations

import dataclasses
import json
import os

import gguf
import numpy as np
import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.lora.request import LoRARequest
from llmserve.quantization.kernels import RoundedInputKernel
from tests.helpers import TINY_LLAMA_CONFIG, make_tiny_llama_dir, rounding_hook
from tests.lora.adapters import ADAPTERS, load_base, make_adapter, make_model_dirs, write_gguf_lora
from tests.models.families import make_family_dir

PROMPTS = [[1, 520, 3310, 91, 4012, 77, 8001, 12, 600], [1, 42, 42, 9000, 15, 3, 777], [1, 2048, 31, 64]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return make_model_dirs(tmp_path_factory.mktemp("lora"))


def _merged_greedy(
    base_dir: str, adapter_dir: str | None, model: torch.nn.Module | None = None
) -> list[tuple[list[int], list[float]]]:
    """PEFT's merged model's greedy tokens and their log-probs, per prompt (the base's for None);
    `model`: the base model to merge into instead of the checkpoint's."""
    model = load_base(base_dir) if model is None else model
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    results = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, tokens, logprobs = list(prompt), [], []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
                token = int(logits.argmax())
                tokens.append(token)
                logprobs.append(float(logits[token]))
                ids.append(token)
            results.append((tokens, logprobs))
    return results


def _llm(model_dirs: dict[str, str], max_loras: int, **kwargs) -> LLM:
    modules = [f"{name}={model_dirs[name]}" for name in ADAPTERS]
    return LLM(
        model_dirs["base"],
        dtype=kwargs.pop("dtype", "float32"),
        kv_cache_memory="64MiB",
        enable_lora=True,
        lora_modules=modules,
        max_loras=max_loras,
        **kwargs,
    )


def _params(name: str | None) -> SamplingParams:
    return dataclasses.replace(GREEDY, lora_name=name)


def _tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    return ids, [entry[token] for entry, token in zip(completion.logprobs, ids, strict=True)]


@pytest.fixture(scope="module")
def llm(model_dirs):
    with _llm(model_dirs, max_loras=len(ADAPTERS)) as engine:
        yield engine


@pytest.mark.parametrize("name", [None, *ADAPTERS])
def test_each_adapter_matches_peft_merged_model(llm, model_dirs, name):
    """Each adapter's greedy tokens equal PEFT's merged model's and its log-probs are within 1e-3; an
    adapter's reference differs from the base's, so an adapter ignored would fail."""
    expected = _merged_greedy(model_dirs["base"], None if name is None else model_dirs[name])
    outputs = llm.generate(PROMPTS, _params(name), use_tqdm=False)
    assert len(outputs) == len(PROMPTS)
    for output, (tokens, logprobs) in zip(outputs, expected, strict=True):
        got_tokens, got_logprobs = _tokens_and_logprobs(output)
        assert got_tokens == tokens
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)
    if name is not None:
        assert [tokens for tokens, _ in expected] != [
            tokens for tokens, _ in _merged_greedy(model_dirs["base"], None)
        ]


def _check_against(outputs, expected) -> None:
    for output, (tokens, logprobs) in zip(outputs, expected, strict=True):
        got_tokens, got_logprobs = _tokens_and_logprobs(output)
        assert got_tokens == tokens
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)


FAMILIES = [
    "qwen3-qk-norm",
    "mistral-sliding-window",
    "gemma2-softcap-interleaved-window",
    "gemma3-qk-norm-local-rope",
]


@pytest.mark.parametrize("case", FAMILIES)
def test_other_families_adapters_match_peft_merged_model(tmp_path, case):
    """Other families (q/k norms, sliding windows, soft-capping, Gemma's norms), every module
    targeted, with rsLoRA."""
    base, adapter = str(tmp_path / "base"), str(tmp_path / "all")
    make_family_dir(base, case, seed=3)
    make_adapter(base, adapter, 11, **ADAPTERS["all"])
    expected = _merged_greedy(base, adapter)
    options = dict(dtype="float32", kv_cache_memory="64MiB", enable_lora=True)
    with LLM(base, lora_modules=[f"all={adapter}"], **options) as llm:
        _check_against(llm.generate(PROMPTS, _params("all"), use_tqdm=False), expected)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params(None), use_tqdm=False)] != [
            tokens for tokens, _ in expected
        ]


def test_a_phi3_adapter_on_its_fused_projections_matches_peft_merged_model(tmp_path):
    """Phi-3's checkpoint fuses q/k/v and gate/up: its adapters target qkv_proj and gate_up_proj whole."""
    base, adapter = str(tmp_path / "phi3"), str(tmp_path / "phi3-lora")
    make_family_dir(base, "phi3-partial-rotary", seed=5)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    make_adapter(base, adapter, 13, r=4, lora_alpha=8, target_modules=targets)
    expected = _merged_greedy(base, adapter)
    options = dict(dtype="float32", kv_cache_memory="64MiB", enable_lora=True)
    with LLM(base, lora_modules=[f"phi={adapter}"], **options) as phi3:
        _check_against(phi3.generate(PROMPTS, _params("phi"), use_tqdm=False), expected)
        base_tokens = [o.outputs[0].token_ids for o in phi3.generate(PROMPTS, _params(None), use_tqdm=False)]
        assert base_tokens != [tokens for tokens, _ in expected]


def _qlora_greedy(base_dir: str, adapter_dir: str | None, served: torch.nn.Module):
    """Greedy tokens and log-probs of PEFT's adapter, unmerged (its delta sees the unrounded input, as
    the served one does), over the dequantized base, whose layers round their inputs as the served
    kernels do (at the AVX2 level the float32 int8/int4 kernels round every row). Decoded a token at
    a time, as the engine does."""
    model = _dequantized_base(base_dir, served)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    _round_as_served(model, served)
    results, margins = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model(torch.tensor([list(prompt)]), use_cache=True)
            tokens, logprobs, margin = [], [], []
            for _ in range(MAX_TOKENS):
                logits = out.logits[0, -1].log_softmax(-1)
                top = logits.topk(2).values
                token = int(logits.argmax())
                tokens.append(token)
                logprobs.append(float(logits[token]))
                margin.append(float(top[0] - top[1]))
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            results.append((tokens, logprobs))
            margins.append(margin)
    return results, margins


def _round_as_served(model: torch.nn.Module, served: torch.nn.Module) -> int:
    """Hooks on the HF base layers whose served (fused) layer rounds its input; returns how many."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    hooked = 0

    fused = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj",),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.down_proj": ("mlp.down_proj",),
    }
    for index, layer in enumerate(served.model.layers):
        for served_name, names in fused.items():
            kernel = layer.get_submodule(served_name).kernel
            if not (isinstance(kernel, RoundedInputKernel) and kernel.takes(torch.float32)):
                continue
            for name in names:
                module = base.model.layers[index].get_submodule(name)
                getattr(module, "base_layer", module).register_forward_pre_hook(rounding_hook())
                hooked += 1
    if isinstance(served.lm_head.kernel, RoundedInputKernel) and served.lm_head.kernel.takes(torch.float32):
        base.lm_head.register_forward_pre_hook(rounding_hook())
        hooked += 1
    return hooked


def _dequantized_base(base_dir: str, served: torch.nn.Module) -> torch.nn.Module:
    """The HF base model with every linear layer llmserve quantized replaced by its dequantized
    weights (fused qkv/gate_up rows split back), so PEFT's merge of it is what QLoRA serves."""
    model = load_base(base_dir)
    with torch.no_grad():
        for index, layer in enumerate(served.model.layers):
            hf = model.model.layers[index]
            attention = layer.self_attn
            sizes = (attention.q_size, attention.kv_size, attention.kv_size)
            parts = {
                "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), sizes),
                "self_attn.o_proj": (("o_proj",), None),
                "mlp.gate_up_proj": (("gate_proj", "up_proj"), None),
                "mlp.down_proj": (("down_proj",), None),
            }
            for fused, (names, split) in parts.items():
                weight = layer.get_submodule(fused).kernel.dequantize(torch.float32)
                rows = weight.split(split) if split else weight.chunk(len(names))
                parent = hf.get_submodule(fused.split(".")[0])
                for name, part in zip(names, rows, strict=True):
                    getattr(parent, name).weight.copy_(part)
        # a new Parameter unties lm_head from the (float) embeddings
        model.lm_head.weight = torch.nn.Parameter(served.lm_head.kernel.dequantize(torch.float32))
    return model


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_over_a_quantized_base_match_peft_over_the_dequantized_model(model_dirs, quantization):
    """QLoRA-style: the delta in float over a quantized base equals PEFT's adapter over the dequantized
    base, for each adapter, alone and mixed with the base model. Where the served kernels round their
    inputs to 8 bits (the AVX2 level's float32 int8/int4 kernels) the reference's base layers round the
    same inputs; a last-bit difference of the delta there can move an input across a rounding step, so
    log-probs agree within ROUNDING_STEP_LOGPROB and tokens until the reference's top two come closer."""
    with _llm(model_dirs, max_loras=2, quantization=quantization) as quantized:
        served = quantized.engine.model_runner.model
        rounds = _round_as_served(load_base(model_dirs["base"]), served)
        for name in [None, *ADAPTERS]:
            adapter = None if name is None else model_dirs[name]
            expected, margins = _qlora_greedy(model_dirs["base"], adapter, served)
            outputs = quantized.generate(PROMPTS, _params(name), use_tqdm=False)
            if not rounds:
                _check_against(outputs, expected)
                continue
            for output, (tokens, logprobs), margin in zip(outputs, expected, margins, strict=True):
                got_tokens, got_logprobs = _tokens_and_logprobs(output)
                for step, (got, want) in enumerate(zip(got_tokens, tokens, strict=True)):
                    assert abs(got_logprobs[step] - logprobs[step]) <= ROUNDING_STEP_LOGPROB or got != want
                    if got != want:  # a divergence only where the reference had a near-tie
                        assert margin[step] <= 2 * ROUNDING_STEP_LOGPROB
                        break
        # a row's output does not depend on its batch: mixed with others as alone, the same tokens
        long_prompts = [prompt * 3 for prompt in PROMPTS]
        names = [None, "qv", "all"]
        mixed = quantized.generate(long_prompts, [_params(n) for n in names], use_tqdm=False)
        alone = [
            quantized.generate([p], _params(n), use_tqdm=False)[0]
            for p, n in zip(long_prompts, names, strict=True)
        ]
        assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]


ROUNDING_STEP_LOGPROB = 0.05  # one 8-bit input code flipped moves a log-prob of this tiny model by ~0.02


def test_a_phi3_adapter_for_another_size_is_refused_and_its_name_stays_free(tmp_path):
    """A fused-projection B with another model's rows is refused in one line (not torch's split
    error), the name is not left half-loaded, and the slot serves the next adapter."""
    base, adapter, bad = str(tmp_path / "phi3"), str(tmp_path / "phi3-lora"), tmp_path / "bad"
    make_family_dir(base, "phi3-partial-rotary", seed=5)
    make_adapter(base, adapter, 13, r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"])
    config = json.loads((tmp_path / "phi3-lora" / "adapter_config.json").read_text())
    weights = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    weights = {k: torch.cat([w, w[:8]]) if ".lora_B." in k else w for k, w in weights.items()}
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(config))
    save_file(weights, str(bad / "adapter_model.safetensors"))
    options = dict(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=1)
    with LLM(base, **options) as phi3:
        with pytest.raises(
            ValueError, match=r"LoRA B of \w+_proj has \d+ rows; the model's layer has"
        ) as error:
            phi3.engine.add_lora("phi", str(bad))
        assert "\n" not in str(error.value)
        phi3.engine.add_lora("phi", adapter)
        assert phi3.generate(PROMPTS[:1], _params("phi"), use_tqdm=False)[0].outputs[0].token_ids


def test_adapters_change_the_output(llm):
    """The fixture's adapters are strong enough that a wrong or missing delta would show."""
    firsts = {name: llm.generate(PROMPTS[:1], _params(name), use_tqdm=False)[0] for name in [None, *ADAPTERS]}
    assert len({tuple(output.outputs[0].token_ids) for output in firsts.values()}) == len(firsts)


def test_mixed_batch_gives_each_row_what_it_gets_alone(llm):
    names = [None, *ADAPTERS]
    alone = {
        (prompt_index, name): llm.generate([PROMPTS[prompt_index]], _params(name), use_tqdm=False)[0]
        for prompt_index in range(len(PROMPTS))
        for name in names
    }
    keys = list(alone)
    mixed = llm.generate([PROMPTS[p] for p, _ in keys], [_params(n) for _, n in keys], use_tqdm=False)
    for key, output in zip(keys, mixed, strict=True):
        assert output.outputs[0].token_ids == alone[key].outputs[0].token_ids, key


@pytest.mark.cpu_kernels("avx2")
def test_the_compiled_delta_serves_every_layer_and_equals_the_grouped_matmuls(llm, monkeypatch):
    """On the CPU each targeted layer adds its rows' deltas in one compiled call (kernels/csrc/lora.cpp);
    the per-adapter matmuls it replaced give the same greedy tokens and log-probs to float32 rounding."""
    layers = llm.engine.model_runner.lora.layers.values()
    assert all(weights.kernel is not None for weights in layers)
    names = [None, *ADAPTERS]
    params = [_params(name) for name in names for _ in PROMPTS]
    prompts = [prompt for _ in names for prompt in PROMPTS]
    compiled = llm.generate(prompts, params, use_tqdm=False)
    for weights in layers:
        monkeypatch.setattr(weights, "kernel", None)
    monkeypatch.setattr(llm.engine.model_runner.decode_stack, "lora_bound", False)  # it calls the kernel
    grouped = llm.generate(prompts, params, use_tqdm=False)
    for ours, theirs in zip(compiled, grouped, strict=True):
        (ours_ids, ours_lp), (theirs_ids, theirs_lp) = (
            _tokens_and_logprobs(ours),
            _tokens_and_logprobs(theirs),
        )
        assert ours_ids == theirs_ids
        torch.testing.assert_close(torch.tensor(ours_lp), torch.tensor(theirs_lp), atol=1e-4, rtol=0)


def test_lru_swap_with_one_slot_keeps_every_answer(model_dirs, llm):
    """With one resident slot the scheduler runs one adapter at a time and swaps the others in."""
    names = [None, *ADAPTERS, *reversed(ADAPTERS)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    expected = [llm.generate([p], _params(n), use_tqdm=False)[0] for p, n in zip(prompts, names, strict=True)]
    with _llm(model_dirs, max_loras=1) as small:
        got = small.generate(prompts, [_params(n) for n in names], use_tqdm=False)
        assert set(small.engine.model_runner.lora.slots.resident.values()) == {0}
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids


def test_an_adapter_for_another_base_is_refused_and_leaves_its_slot_free(model_dirs, llm, tmp_path):
    """With one slot: an adapter whose shapes are another model's is refused in one line when
    loaded (it was written over the resident adapter's slot first), and the next adapter gets the slot."""
    other = make_tiny_llama_dir(str(tmp_path / "other"), intermediate_size=96)
    make_adapter(other, str(tmp_path / "bad"), 5, **ADAPTERS["all"])
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params("all"), use_tqdm=False)]
    options = dict(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=1)
    with LLM(model_dirs["base"], **options) as small:
        small.engine.add_lora("qv", model_dirs["qv"])
        with pytest.raises(ValueError, match="do not fit a layer of") as error:
            small.engine.add_lora("bad", str(tmp_path / "bad"))
        assert "\n" not in str(error.value)
        with pytest.raises(ValueError, match="LoRA adapter 'bad' does not exist"):
            small.generate(PROMPTS[:1], _params("bad"), use_tqdm=False)
        small.engine.add_lora("all", model_dirs["all"])
        got = small.generate(PROMPTS, _params("all"), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want


def test_prefix_cache_is_not_shared_across_adapters(model_dirs):
    prompt = list(range(100, 180))  # five full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with _llm(model_dirs, max_loras=2, block_size=16) as engine:

        def cached(name):
            output = engine.generate([prompt], dataclasses.replace(params, lora_name=name), False)
            return output[0].num_cached_tokens

        assert cached("qv") == 0
        assert cached("all") == 0  # the same tokens under another adapter: no hit
        assert cached(None) == 0  # nor for the base model
        assert cached("qv") == 64  # its own blocks are reused
        assert cached("all") == 64


def test_unknown_adapter_is_refused(llm):
    with pytest.raises(ValueError, match="LoRA adapter 'nope' does not exist"):
        llm.generate(PROMPTS[:1], _params("nope"), use_tqdm=False)


def test_dora_adapter_is_refused(model_dirs, tmp_path):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, init_lora_weights=False)
    peft.get_peft_model(load_base(model_dirs["base"]), config).save_pretrained(str(tmp_path / "dora"))
    with pytest.raises(ValueError, match="DoRA adapters are not supported"):
        LLM(
            model_dirs["base"],
            dtype="float32",
            kv_cache_memory="64MiB",
            enable_lora=True,
            lora_modules=[f"dora={tmp_path / 'dora'}"],
        )


def test_rank_above_max_lora_rank_is_refused(model_dirs):
    with pytest.raises(ValueError, match="exceeds --max-lora-rank 4"):
        _llm(model_dirs, max_loras=1, max_lora_rank=4)


def test_saved_config_fields_are_what_the_loader_reads(model_dirs):
    """PEFT writes the fields the loader checks (a renamed field would otherwise pass unchecked)."""
    with open(os.path.join(model_dirs["all"], "adapter_config.json")) as file:
        config = json.load(file)
    assert config["use_rslora"] is True and config["use_dora"] is False and config["r"] == 8


def _run_all(engine) -> dict[str, list[int]]:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    return finished


def test_load_and_unload_at_run_time_under_load(model_dirs, llm):
    """Adapters loaded while requests run, with one resident slot: every request gets its own
    adapter's tokens; an adapter in use cannot be unloaded; a name loaded again is a new adapter."""
    names = ["qv", "all", "mlp"]
    want = {
        (p, n): llm.generate([PROMPTS[p]], _params(n), use_tqdm=False)[0].outputs[0].token_ids
        for p in range(len(PROMPTS))
        for n in [None, *names]
    }
    with LLM(model_dirs["base"], dtype="float32", kv_cache_memory="64MiB", enable_lora=True) as offline:
        engine = offline.engine
        engine.add_lora("qv", model_dirs["qv"])
        for p in range(len(PROMPTS)):
            engine.add_request(f"qv-{p}", PROMPTS[p], _params("qv"))
            engine.add_request(f"base-{p}", PROMPTS[p], _params(None))
        engine.step()
        engine.add_lora("all", model_dirs["all"])  # while qv's requests run
        engine.add_lora("mlp", model_dirs["mlp"])
        for p in range(len(PROMPTS)):
            engine.add_request(f"all-{p}", PROMPTS[p], _params("all"))
            engine.add_request(f"mlp-{p}", PROMPTS[p], _params("mlp"))
        with pytest.raises(ValueError, match="'qv' is in use by 3 unfinished requests"):
            engine.remove_lora("qv")
        finished = _run_all(engine)
        for request_id, tokens in finished.items():
            name, p = request_id.split("-")
            assert tokens == want[(int(p), None if name == "base" else name)], request_id
        assert len(finished) == 4 * len(PROMPTS)

        engine.remove_lora("qv")
        with pytest.raises(ValueError, match="LoRA adapter 'qv' does not exist"):
            engine.add_request("gone", PROMPTS[0], _params("qv"))
        engine.add_lora("qv", model_dirs["all"])  # the name again, other weights: none of the old KV
        engine.add_request("again", PROMPTS[0], _params("qv"))
        assert _run_all(engine) == {"again": want[(0, "all")]}


def test_an_adapter_loaded_again_shares_no_cached_blocks_with_its_old_load(model_dirs):
    long_prompt = list(range(100, 180))  # five full blocks of 16
    options = dict(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, block_size=16)
    with LLM(model_dirs["base"], **options) as llm:
        llm.engine.add_lora("x", model_dirs["qv"])

        def cached() -> int:
            return llm.generate([long_prompt], _params("x"), use_tqdm=False)[0].num_cached_tokens

        assert (cached(), cached()) == (0, 64)
        llm.engine.remove_lora("x")
        llm.engine.add_lora("x", model_dirs["all"])
        assert (cached(), cached()) == (0, 64)
        llm.engine.add_lora("same-weights", model_dirs["all"])  # another name, the same KV: a hit
        hit = llm.generate([long_prompt], _params("same-weights"), use_tqdm=False)[0].num_cached_tokens
        assert hit == 64


@pytest.mark.cpu_kernels("avx2")
def test_fused_decode_stack_serves_steps_with_and_without_adapters(llm, monkeypatch):
    """Decode steps take the compiled stack as without --enable-lora, those with adapters too (it adds
    the deltas after its projections with the hooks' kernel): the same tokens and log-probs as the
    modules, which serve those steps where the stack has no adapters bound."""
    stack = llm.engine.model_runner.decode_stack
    assert stack is not None and stack.lora_bound  # float32 on the CPU: every layer on the float32 kernel
    names = [None, *ADAPTERS]
    for name in names:
        before = stack.calls
        llm.generate(PROMPTS[:1], _params(name), use_tqdm=False)
        assert stack.calls == before + MAX_TOKENS - 1  # every decode step after the prompt's
    params = [_params(name) for name in names for _ in PROMPTS]
    prompts = [prompt for _ in names for prompt in PROMPTS]
    stacked = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(stack, "lora_bound", False)
    before = stack.calls
    modules = llm.generate(prompts, params, use_tqdm=False)
    assert stack.calls == before  # every step of this batch has a row with an adapter
    for ours, theirs in zip(stacked, modules, strict=True):
        assert _tokens_and_logprobs(ours) == _tokens_and_logprobs(theirs)  # the same kernels: bit for bit


@pytest.fixture(params=[None, 3], ids=["threads", "three-threads"])
def region_threads(request):
    """torch's threads as they are, or at 3 (more than this CI's cores: each adapter's columns and
    output rows split unevenly among the region's threads)."""
    threads = torch.get_num_threads()
    if request.param:
        torch.set_num_threads(request.param)
    yield
    torch.set_num_threads(threads)


@pytest.mark.cpu_kernels("avx2")
@pytest.mark.parametrize("quantization", ["int4", None])
def test_adapters_in_the_stacks_one_region(model_dirs, monkeypatch, quantization, region_threads):
    """Over int4 or bf16 layers the stack runs each step in one parallel region, each thread shrinking
    its share of an adapter's columns and expanding all of them into the output rows it wrote: the same
    tokens and log-probs as the modules, for each adapter alone and for all of them (and none) in one
    batch of 8 rows (several tiles a call)."""
    with _llm(model_dirs, max_loras=len(ADAPTERS), quantization=quantization, dtype="bfloat16") as llm:
        stack = llm.engine.model_runner.decode_stack
        assert stack is not None and stack.lora_bound
        names = [None, *ADAPTERS]
        batch = PROMPTS[: 8 // len(names)]  # at most 8 rows: the region's limit
        params = [_params(name) for name in names for _ in batch]
        prompts = [prompt for _ in names for prompt in batch]
        alone = []
        for name in names:
            before = stack.one_region_calls
            alone.append(llm.generate([PROMPTS[0]], _params(name), use_tqdm=False)[0])
            # every decode step after the prompt's, where there are threads to hold
            assert stack.one_region_calls - before == (MAX_TOKENS - 1 if torch.get_num_threads() > 1 else 0)
        before = stack.one_region_calls
        together = llm.generate(prompts, params, use_tqdm=False)
        assert (stack.one_region_calls > before) == (torch.get_num_threads() > 1)
        monkeypatch.setattr(stack, "lora_bound", False)
        monkeypatch.setattr(stack, "max_rows", 0)  # every step on the modules
        for output, name in zip(alone, names, strict=True):
            module_output = llm.generate([PROMPTS[0]], _params(name), use_tqdm=False)[0]
            assert _tokens_and_logprobs(output) == _tokens_and_logprobs(module_output)
        modules = llm.generate(prompts, params, use_tqdm=False)
        for ours, theirs in zip(together, modules, strict=True):
            assert _tokens_and_logprobs(ours) == _tokens_and_logprobs(theirs)


@pytest.mark.cpu_kernels("avx2")
def test_the_stack_refuses_a_slot_out_of_range(model_dirs):
    """A step's slots are checked once before the stack's layers (not in every delta): a slot past the
    stacks is an error raised to the caller, and the engine serves on."""
    with _llm(model_dirs, max_loras=2, quantization="int4", dtype="bfloat16") as llm:
        stack = llm.engine.model_runner.decode_stack
        assert stack is not None and stack.lora_bound
        with pytest.raises(RuntimeError, match="token slot 5 out of range"):
            stack.stack.forward(
                stack.embed_tokens(torch.tensor([5])),
                torch.tensor([0], dtype=torch.int64),
                torch.tensor([0], dtype=torch.int64),
                torch.zeros(1, 1, dtype=torch.int64),
                torch.tensor([1], dtype=torch.int64),
                torch.tensor([0, 1], dtype=torch.int64),
                16,
                0,
                0,
                torch.tensor([5], dtype=torch.int64),
            )
        output = llm.generate([PROMPTS[0]], _params(next(iter(ADAPTERS))), use_tqdm=False)[0]
        assert len(output.outputs[0].token_ids) == MAX_TOKENS


def test_gguf_lora_files_match_peft_merged_model(model_dirs, tmp_path):
    """llama.cpp's adapter format (q/k rows permuted, alpha in the metadata) loads to the same model."""
    heads = TINY_LLAMA_CONFIG["num_attention_heads"], TINY_LLAMA_CONFIG["num_key_value_heads"]
    names = ("qv", "mlp")  # rsLoRA has no GGUF form: llama.cpp scales by alpha / rank
    paths = {n: write_gguf_lora(model_dirs[n], str(tmp_path / f"{n}.gguf"), *heads) for n in names}
    options = dict(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=2)
    with LLM(model_dirs["base"], lora_modules=[f"{n}={p}" for n, p in paths.items()], **options) as llm:
        for name in paths:
            expected = _merged_greedy(model_dirs["base"], model_dirs[name])
            _check_against(llm.generate(PROMPTS, _params(name), use_tqdm=False), expected)
        with pytest.raises(ValueError, match="is not a GGUF LoRA adapter"):
            llm.engine.add_lora("model", _write_plain_gguf(str(tmp_path / "model.gguf")))


def _write_plain_gguf(path: str) -> str:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("method", ["ngram", "early_exit"])
def test_speculative_decoding_verifies_drafts_against_the_adapted_model(model_dirs, llm, method):
    """Drafts come from the text (n-gram) or the base model's first layer (early exit: no adapter);
    greedy verification against the adapted model keeps each adapter's tokens."""
    prompts = [[1, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], *PROMPTS]
    names = [None, *ADAPTERS]
    want = {n: [o.outputs[0].token_ids for o in llm.generate(prompts, _params(n), False)] for n in names}
    options = dict(speculative_method=method, num_speculative_tokens=3, speculative_disable_batch_size=0)
    if method == "early_exit":
        options["speculative_draft_layers"] = 1
    with _llm(model_dirs, len(ADAPTERS), **options) as spec:
        for name in names:
            outputs = spec.generate(prompts, _params(name), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == want[name], name
        drafted = spec.engine.scheduler.spec_decode_stats.num_draft_tokens
    if method == "early_exit":  # n-gram drafts need the random model's text to repeat itself
        assert drafted > 0  # drafts were verified, not only proposed


@pytest.mark.parametrize("case", ["mixtral-top2-of-4", "qwen3-moe-dense-layer"])
def test_mixture_of_experts_models_refuse_lora_in_one_line(tmp_path, case):
    base = str(tmp_path / "moe")
    make_family_dir(base, case)
    with pytest.raises(ValueError, match=r"LoRA adapters need mlp.gate_up_proj in every decoder") as error:
        LLM(base, dtype="float32", kv_cache_memory="64MiB", enable_lora=True)
    assert "\n" not in str(error.value)


def test_vllm_style_lora_request_loads_on_first_use(model_dirs, llm):
    params = [_params(n) for n in ("qv", None, "mlp")]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    options = dict(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=2)
    with LLM(model_dirs["base"], **options) as fresh:
        requests = [LoRARequest("qv", 1, model_dirs["qv"]), None, LoRARequest("mlp", 2, model_dirs["mlp"])]
        got = fresh.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests)
        assert [o.outputs[0].token_ids for o in got] == want
        again = fresh.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=requests[0])  # loaded once
        assert again[0].outputs[0].token_ids == want[0]
    without = LLM(model_dirs["base"], dtype="float32", kv_cache_memory="64MiB")
    with without, pytest.raises(ValueError, match="LoRA adapters need --enable-lora"):
        without.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=requests[0])
