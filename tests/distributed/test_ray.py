"""`--distributed-executor-backend ray` on a two-node Ray cluster of this machine (one CPU each,
`ray.cluster_utils.Cluster`, started once for the module): rank 1 is an actor on the other node
than rank 0 (this process), the greedy tokens equal one process's, a cluster too small for the
placement group is a one-line error, a killed actor fails the step with its rank named, and an
actor's own RankStats reach rank 0."""

from __future__ import annotations

import os

import pytest
import ray
from ray.cluster_utils import Cluster

from llmserve import LLM, SamplingParams
from llmserve.worker.executor import TensorParallelError
from tests.distributed.conftest import ENGINE_KWARGS, assert_same_greedy, engine
from tests.distributed.test_tensor_parallel import PROMPTS
from tests.e2e.conftest import hf_greedy
from tests.helpers import wait_until
from tests.models.families import make_family_dir

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
RAY_KWARGS = dict(distributed_executor_backend="ray", distributed_timeout_seconds=120)


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_tp2_across_two_nodes_gives_one_process_greedy_tokens(two_nodes, tiny_llama_dir):
    with engine(tiny_llama_dir) as llm:
        reference = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with engine(tiny_llama_dir, tensor_parallel_size=2, **RAY_KWARGS) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        launcher = llm.engine.executor.launcher
        (actor_node,) = launcher.node_ids()
        placement_group = launcher.placement_group
    assert actor_node != ray.get_runtime_context().get_node_id()  # rank 0 is this process, on the head
    assert len({node["NodeID"] for node in ray.nodes() if node["Alive"]}) == 2
    for want, got in zip(reference, outputs, strict=True):
        assert_same_greedy(want, got)
    # shutdown gave the cluster back its CPUs: the placement group is removed
    assert ray.util.placement_group_table(placement_group)["state"] == "REMOVED"


def _wait_for_reports(llm, ranks: int) -> tuple:
    """Every rank's RankStats once each has reported a step (rank 0 asks the actors in the background)."""

    def reported():
        stats = llm.engine.rank_stats()
        return stats if all(report.num_steps > 0 for report in stats) else None

    return wait_until(reported, 30, "every rank's report of a step")


def test_an_actor_reports_its_own_rank_stats(two_nodes, tiny_llama_dir):
    """The actor's step count, forward time and KV pool reach rank 0 (for the per-rank series on
    /metrics), with the actor's own pid."""
    with engine(tiny_llama_dir, tensor_parallel_size=2, **RAY_KWARGS) as llm:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = _wait_for_reports(llm, 2)
        actor = llm.engine.executor.launcher.actors[0]
        actor_pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    assert [report.rank for report in stats] == [0, 1]
    rank1 = stats[1]
    assert rank1.num_steps > 0 and rank1.forward_seconds > 0
    assert rank1.pid == actor_pid != os.getpid()
    assert rank1.kv_num_blocks == stats[0].kv_num_blocks > 0 and rank1.kv_cache_bytes > 0
    assert rank1.exit_code is None


def test_expert_parallel_across_two_nodes(two_nodes, tmp_path):
    """Qwen3-MoE with --enable-expert-parallel, rank 1 an actor on the other node: transformers'
    greedy tokens (the all-to-alls on gloo between the nodes), and the actor's expert load (its
    half of the experts) reaches rank 0."""
    hf = make_family_dir(str(tmp_path), "qwen3-moe-dense-layer")  # 8 experts
    prompt = PROMPTS[2][:12]
    kwargs = dict(tensor_parallel_size=2, enable_expert_parallel=True, **RAY_KWARGS)
    with engine(str(tmp_path), max_model_len=128, **kwargs) as llm:
        (output,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        stats = _wait_for_reports(llm, 2)
    assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    assert stats[1].first_expert == 4 and len(stats[1].expert_tokens) == 4
    assert stats[1].all_to_all_bytes > 0


def test_a_cluster_too_small_for_the_placement_group_is_one_line(two_nodes, tiny_llama_dir):
    with pytest.raises(
        ValueError, match=r"the Ray cluster has 2 CPU; tensor_parallel_size 3 needs 3 CPU"
    ) as error:
        LLM(tiny_llama_dir, tensor_parallel_size=3, **ENGINE_KWARGS, **RAY_KWARGS)
    assert "\n" not in str(error.value)


def test_a_killed_actor_fails_the_step_with_its_rank_named(two_nodes, tiny_llama_dir):
    with engine(tiny_llama_dir, tensor_parallel_size=2, **RAY_KWARGS) as llm:
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        llm.engine.step()
        launcher = llm.engine.executor.launcher
        ray.kill(launcher.actors[0])  # asynchronous: a step right after it may still run on the actor
        wait_until(lambda: launcher.exited() is not None, 30, "the killed actor to be seen as exited")
        for _ in range(2):  # and every step after it
            with pytest.raises(
                TensorParallelError, match=r"^tensor-parallel rank 1 \(Ray actor\) exited: "
            ) as error:
                llm.engine.step()
            assert "\n" not in str(error.value)
