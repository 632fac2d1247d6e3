"""The divergence guard's weight scale under FSDP2, on CPU: each parameter is a DTensor there, and the scale
must be gathered from the plain local shards (a gather of a DTensor fails on a GPU: no sharding strategy for
all_gather). One process, gloo, a one-rank mesh: the same DTensor parameters FSDP2 makes."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from mha2gqa.uptrain.guard import weight_scale


@pytest.fixture
def one_rank_mesh(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


class PlainGather:
    """accelerate's gather at one process, refusing what a multi-GPU gather cannot take."""

    device = torch.device("cpu")

    def __init__(self):
        self.gathered = []

    def gather(self, tensor):
        assert type(tensor) is torch.Tensor, f"gathered a {type(tensor).__name__}, not the local shard"
        self.gathered.append(tensor.clone())
        return tensor


def test_weight_scale_of_dtensor_parameters_is_their_largest_value(one_rank_mesh):
    layer = torch.nn.Linear(4, 3, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, -7.25, 1.0, 0.0]] + [[0.1] * 4] * 2))
        layer.bias.fill_(2.0)
    for name in ("weight", "bias"):
        sharded = distribute_tensor(getattr(layer, name).detach(), one_rank_mesh, [Shard(0)])
        setattr(layer, name, torch.nn.Parameter(sharded))
    assert type(layer.weight.data).__name__ == "DTensor"
    accelerator = PlainGather()
    scale = weight_scale(layer, accelerator)
    assert scale == 7.25
    assert [t.tolist() for t in accelerator.gathered] == [[7.25]]


def test_weight_scale_keeps_a_nan_of_a_plain_model():
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight[0, 1] = float("nan")
    scale = weight_scale(layer, PlainGather())
    assert scale != scale  # NaN: the guard must see a broken weight
