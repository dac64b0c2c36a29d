"""Rank 0's GPU under `--distributed-executor-backend ray`: rank 0 is the engine's process, not an
actor, so it computes on the GPU Ray reserved for bundle 0 of the placement group, which a claim
actor holds; an actor of another bundle on the same node is handed another GPU. Ray hands out GPU
ids from what a node declares, so a one-node cluster declaring two GPUs checks the placement on a
machine without any (CUDA itself is not touched)."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from llmserve.worker.ray_launcher import GpuClaim, _place, local_cuda_index

BUNDLE = {"CPU": 1.0, "GPU": 1.0}


@pytest.fixture(scope="module")
def node_with_two_gpus():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    ray.init(address=cluster.address, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


class GpuProbe:
    def gpu_ids(self) -> list[str]:
        return [str(gpu) for gpu in ray.get_gpu_ids()]


def _in_bundle(actor_class, group, index: int):
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
    return ray.remote(actor_class).options(num_cpus=0, num_gpus=1, scheduling_strategy=strategy).remote()


@pytest.mark.ray
def test_rank_0_claims_bundle_0s_gpu_and_the_actor_gets_the_other(node_with_two_gpus):
    group = _place(ray, BUNDLE, 2, 60)
    try:
        claim = _in_bundle(GpuClaim, group, 0)
        probe = _in_bundle(GpuProbe, group, 1)
        rank0_gpu = ray.get(claim.gpu_id.remote())
        (actor_gpu,) = ray.get(probe.gpu_ids.remote())
        assert {rank0_gpu, actor_gpu} == {"0", "1"}
        # the claim holds its GPU: a third claim on the node finds none free
        third = ray.remote(GpuProbe).options(num_cpus=0, num_gpus=1).remote()
        ready, _ = ray.wait([third.gpu_ids.remote()], timeout=2)
        assert not ready
        ray.kill(third)
    finally:
        ray.util.remove_placement_group(group)


def test_the_claimed_gpu_maps_to_this_process_cuda_index():
    assert local_cuda_index("1", None) == 1
    assert local_cuda_index("3", "2,3") == 1
    with pytest.raises(
        ValueError, match=r"Ray reserved GPU 1 for rank 0, which CUDA_VISIBLE_DEVICES=2,3"
    ) as error:
        local_cuda_index("1", "2,3")
    assert "\n" not in str(error.value)
