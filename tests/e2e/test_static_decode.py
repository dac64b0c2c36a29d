"""The capturable decode step (worker/cuda_graphs.py) on the CPU: the stand-in for "a CUDA graph can
replay it".

A CUDA graph replays the kernels it recorded, with the shapes and addresses it recorded, and cannot
read anything back to the host. So the step a graph records, `DecodeGraphs.run_static`, is run here
as the engine's runner runs it on CUDA, with the capture replaced by calling it, and the test asserts
that (a) it issues the same operations on the same shapes and arguments whatever the context lengths
and whichever requests (or padding) fill the batch, (b) none of them is a host sync, and (c) a run of
steps on it gives the eager path's greedy tokens and KV cache (the reference attention backend; padded
rows touch only the scratch block). Its attention and layers are the CUDA ones, the Triton kernels, run
by Triton's interpreter; the runner takes the static step on a CPU only through the test's subclass.
"""

import pytest

from tests.triton_interpreter import triton_loop_bounds, use_interpreter  # noqa: F401

use_interpreter(always=True)  # before the kernels are imported: CPU tensors, so interpreted
import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

pytest.importorskip("triton", reason="the static decode step's attention is the Triton kernel")

from llmserve.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelArchConfig,
    ModelConfig,
    SchedulerConfig,
)
from llmserve.core.step_plan import CachedRequestData, NewRequestData, StepPlan  # noqa: E402
from llmserve.models.layers.custom_op import CustomOp, load_triton_ops  # noqa: E402
from llmserve.models.registry import build_model  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from llmserve.worker.cuda_graphs import capture_sizes  # noqa: E402
from llmserve.worker.model_runner import ModelRunner  # noqa: E402

VOCAB, BLOCK, NUM_BLOCKS, MAX_LEN = 128, 8, 40, 512  # 64 table columns: the kernel splits the keys
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_LEN,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
# Host syncs: aten ops whose result is read on the host, or whose output shape depends on values.
SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bincount",
}


class StaticDecodeRunner(ModelRunner):
    """The engine's runner with the static decode step on a CPU, where the engine keeps it off."""

    def _uses_static_decode(self) -> bool:
        return True


class OpRecorder(TorchDispatchMode):
    """Every aten op as (name, its arguments' shapes, dtypes and values), and the host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a Python value computed from a tensor's was read on the host (not so a dtype's promotion)
        reads_value = isinstance(out, bool | int | float) and any(isinstance(a, torch.Tensor) for a in args)
        if func.overloadpacket.__name__ in SYNC_OPS or reads_value:
            self.syncs.append(str(func))
        self.ops.append((str(func), _describe(args), _describe(kwargs or {}), _describe(out)))
        return out


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.stride())
    if isinstance(value, list | tuple):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _describe(v)) for k, v in value.items())
    if isinstance(value, torch.UntypedStorage):  # the interpreter's host copies: their size, not bytes
        return ("storage", value.nbytes())
    return repr(value)


def engine_config(attention_backend: str) -> EngineConfig:
    arch = ModelArchConfig(architecture="llama", head_dim=16, **SHAPE)
    model = ModelConfig(
        path="", arch=arch, dtype=torch.float32, max_model_len=MAX_LEN, attention_backend=attention_backend
    )
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS, kv_cache_memory=0),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=6, max_model_len=MAX_LEN),
    )


def tiny_llama_weights() -> dict[str, torch.Tensor]:
    """A random HF Llama's state dict, its weights drawn wide so greedy tokens have no near-ties."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    return hf.state_dict()


def make_runner(runner_cls, attention_backend: str, weights, cuda_layers: bool = False) -> ModelRunner:
    """`cuda_layers`: the layers' CUDA forms (the Triton kernels, interpreted) instead of the CPU's."""
    config = engine_config(attention_backend)
    model = build_model(config.model, weights)
    if cuda_layers:
        for module in model.modules():
            if isinstance(module, CustomOp):
                module.bind(load_triton_ops(), "cuda")
    runner = runner_cls(config, model)
    runner.kv_cache.fill_(float("nan"))  # a slot read before it is written poisons the output
    return runner


class Planner:
    """Step plans by hand: whole prompts, then one token per step, on scrambled blocks."""

    def __init__(self) -> None:
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
        self.tokens: dict[str, list[int]] = {}  # known tokens (prompt and output)
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.new: list[NewRequestData] = []
        self.finished: list[str] = []

    def add(self, request_id: str, prompt: list[int]) -> None:
        self.tokens[request_id], self.computed[request_id] = list(prompt), 0
        self.blocks[request_id] = self._take(-(-len(prompt) // BLOCK))
        self.new.append(NewRequestData(request_id, prompt, [], GREEDY, (), self.blocks[request_id], 0))

    def finish(self, request_id: str) -> None:
        self.free += self.blocks.pop(request_id)
        del self.tokens[request_id], self.computed[request_id]
        self.finished.append(request_id)

    def plan(self, sampled: dict[str, list[int]]) -> StepPlan:
        """The next step: new prompts whole, every other request its token sampled last step."""
        new_ids = {data.request_id for data in self.new}
        cached, scheduled = [], {}
        for request_id, tokens in self.tokens.items():
            if request_id in new_ids:
                scheduled[request_id] = len(tokens)
                continue
            tokens += sampled[request_id]
            self.computed[request_id] = len(tokens) - 1
            added = self._take(-(-len(tokens) // BLOCK) - len(self.blocks[request_id]))
            self.blocks[request_id] += added
            cached.append(
                CachedRequestData(request_id, sampled[request_id], added, False, False, len(tokens) - 1)
            )
            scheduled[request_id] = 1
        plan = StepPlan(self.new, cached, scheduled, finished_request_ids=self.finished)
        self.new, self.finished = [], []
        return plan

    def _take(self, count: int) -> list[int]:
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def prompts() -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = {"a": 5, "b": 19, "c": 33, "d": 11, "e": 2, "f": 41}
    return {r: torch.randint(0, VOCAB, (n,), generator=generator).tolist() for r, n in lengths.items()}


# step -> (requests that arrive, requests that finish) before it; the other steps are decodes
SCHEDULE = {0: ("abc", ""), 4: ("d", ""), 7: ("ef", ""), 11: ("", "ac"), 14: ("", "bd"), 16: ("", "e")}
NUM_STEPS = 18


def test_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_recorder_sees_a_host_sync():
    recorder = OpRecorder()
    with recorder:
        torch.ones(2).sum().item()
    assert recorder.syncs


def test_static_decode_step_is_capturable_and_matches_eager(monkeypatch):
    weights, texts = tiny_llama_weights(), prompts()
    static = make_runner(StaticDecodeRunner, "triton", weights, cuda_layers=True)
    eager = make_runner(ModelRunner, "torch", weights)
    assert eager.decode_graphs is None and static.decode_graphs.sizes == [1, 2, 4, 6]
    graphs = static.decode_graphs
    recorded: dict[int, list[OpRecorder]] = {}  # padded size -> a recording per static step
    run_static = graphs.run_static

    def recording(size: int) -> None:
        recorder = OpRecorder()
        with recorder:
            run_static(size)
        recorded.setdefault(size, []).append(recorder)

    monkeypatch.setattr(graphs, "run_static", recording)
    planner, sampled, num_rows = Planner(), {}, {}
    for step in range(NUM_STEPS):
        arrive, leave = SCHEDULE.get(step, ("", ""))
        for request_id in leave:
            planner.finish(request_id)
        for request_id in arrive:
            planner.add(request_id, texts[request_id])
        plan = planner.plan(sampled)
        num_rows[step] = len(plan.num_scheduled_tokens)
        sampled = eager.execute(plan).sampled_token_ids
        assert static.execute(plan).sampled_token_ids == sampled, f"step {step}"

    # every decode-only step ran static, padded to the next size (3 rows ran as 4, 5 would as 6)
    decode_steps = [s for s in range(NUM_STEPS) if not SCHEDULE.get(s, ("", ""))[0]]
    expected = [next(size for size in graphs.sizes if size >= num_rows[s]) for s in decode_steps]
    assert sum(map(len, recorded.values())) == len(decode_steps)
    assert sorted(recorded) == sorted(set(expected)) == [1, 2, 4, 6]
    for size, recorders in recorded.items():
        assert not any(r.syncs for r in recorders), (size, recorders[0].syncs)
        first = recorders[0].ops
        assert first and all(r.ops == first for r in recorders), f"size {size}: ops differ between steps"
    # the same K/V in every slot a request wrote, NaN in the rest: padding wrote the scratch block only
    pool = NUM_BLOCKS * BLOCK
    torch.testing.assert_close(
        static.kv_cache[:, :, :pool], eager.kv_cache[:, :, :pool], equal_nan=True, atol=1e-4, rtol=1e-4
    )
    assert not static.kv_cache[:, :, pool : pool + 1].isnan().any()  # the scratch slot padding wrote
