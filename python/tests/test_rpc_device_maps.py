"""Device maps in tensorwire.rpc, with real processes: PyTorch's device-map tests of
``TensorPipeAgentCudaRpcTest`` (``rpc_test.py``) that run without a GPU, ported with their
messages (the group's maps are validated by the agent, PyTorch's rules and words), a ``cpu``
to ``cpu`` map that carries a call, and a tensor the Python layer does not carry."""

from __future__ import annotations

import pytest
import torch

import tensorwire.rpc as rpc
from harness import run_world


@rpc.expose
def gpu_add_given_devices(x, y, x_to, y_to, z_to):
    # PyTorch's TensorPipeAgentCudaRpcTest._gpu_add_given_devices.
    x_device = "cpu" if x.device.type == "cpu" else x.device.index
    y_device = "cpu" if y.device.type == "cpu" else y.device.index
    if x_device == x_to and y_device == y_to:
        return x.to(z_to) + y.to(z_to)
    raise ValueError("Wrong device affinity")


def worker_name(rank: int) -> str:
    return f"worker{rank}"


class _Case:
    """One rank of one case, with the fixture's names (``self.rank``, ...)."""

    world_size = 2
    rpc_backend = rpc.BackendType.TENSORPIPE

    def __init__(self, rank: int, init_file: str):
        self.rank = rank
        self.init_method = f"file://{init_file}"

    @property
    def rpc_backend_options(self) -> rpc.TensorPipeRpcBackendOptions:
        return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method, rpc_timeout=30)

    # PyTorch: TensorPipeAgentCudaRpcTest._test_device_maps (changed: the agent's state is
    # read through tensorwire.rpc, not torch's private rpc.api._is_current_rpc_agent_set).
    def _test_device_maps(self, options, errMsg):
        with pytest.raises(ValueError, match=errMsg):
            rpc.init_rpc(
                name=worker_name(self.rank),
                backend=self.rpc_backend,
                rank=self.rank,
                world_size=self.world_size,
                rpc_backend_options=options,
            )
        assert rpc._agent is None

    # PyTorch: test_device_maps_wrong_worker_name (unchanged)
    def test_device_maps_wrong_worker_name(self):
        options = self.rpc_backend_options
        options.set_device_map("none_exist", {0: 1})
        self._test_device_maps(
            options,
            errMsg="Node worker0 has invalid target node names in its device maps",
        )

    # PyTorch: test_device_maps_invalid_max_local_device (unchanged; without a GPU, cuda:0
    # is already out of range)
    def test_device_maps_invalid_max_local_device(self):
        options = self.rpc_backend_options
        dst = worker_name((self.rank + 1) % self.world_size)
        options.set_device_map(dst, {torch.cuda.device_count(): 0})
        self._test_device_maps(
            options,
            errMsg="Node worker0 has source devices with invalid indices in its device map for worker1",
        )

    # PyTorch: test_device_maps_many_to_one (unchanged)
    def test_device_maps_many_to_one(self):
        options = self.rpc_backend_options
        dst = worker_name((self.rank + 1) % self.world_size)
        options.set_device_map(dst, {1: 0})
        options.set_device_map(dst, {0: 0})
        self._test_device_maps(
            options,
            errMsg="Node worker0 has duplicated target devices in its device map for worker1",
        )

    # PyTorch: test_device_maps_one_to_many (unchanged)
    def test_device_maps_one_to_many(self):
        if self.rank == 0:
            options = self.rpc_backend_options
            dst = worker_name((self.rank + 1) % self.world_size)
            options.set_device_map(dst, {0: 1})
            with pytest.raises(ValueError, match="`set_device_map` only supports 1-to-1 mapping"):
                options.set_device_map(dst, {0: 0})

    # PyTorch: test_device_maps_invalid_min_device (unchanged)
    def test_device_maps_invalid_min_device(self):
        options = self.rpc_backend_options
        dst = worker_name((self.rank + 1) % self.world_size)
        with pytest.raises(RuntimeError, match="Device index must not be negative"):
            options.set_device_map(dst, {-1: 0})
        with pytest.raises(RuntimeError, match="Device index must not be negative"):
            options.set_device_map(dst, {0: -1})

    # Ours: a declared device this machine does not have.
    def test_devices_beyond_this_machine(self):
        options = self.rpc_backend_options
        options.set_devices([torch.cuda.device_count()])
        self._test_device_maps(options, errMsg="Node worker0 has devices with invalid indices")

    # PyTorch: test_device_map_cpu, through _test_device_maps_gpu (unchanged but for the
    # function's name: a module-level function exposed here, not a private static method)
    def test_device_map_cpu(self):
        x_from, y_from, z_to, device_map = "cpu", "cpu", "cpu", {"cpu": "cpu"}
        x_to = device_map[x_from]
        y_to = device_map[y_from]
        options = self.rpc_backend_options
        dst = worker_name((self.rank + 1) % self.world_size)
        options.set_device_map(dst, device_map)
        rpc.init_rpc(
            name=worker_name(self.rank),
            backend=self.rpc_backend,
            rank=self.rank,
            world_size=self.world_size,
            rpc_backend_options=options,
        )
        x = torch.zeros(2).to(x_from)
        y = torch.ones(2).to(y_from)
        ret = rpc.rpc_sync(dst, gpu_add_given_devices, args=(x, y, x_to, y_to, z_to))
        reverse_device_map = {device_map[k]: k for k in device_map}
        z_from = reverse_device_map[z_to]
        ret_device = "cpu" if ret.device.type == "cpu" else ret.device.index
        assert ret_device == z_from
        assert torch.equal(ret, torch.ones(2).to(z_from))
        # Ours: a tensor that is not on the CPU is refused at the caller, naming its device,
        # and the agent goes on.
        with pytest.raises(RuntimeError, match="carries CPU tensors; this one is on meta"):
            rpc.rpc_sync(dst, torch.add, args=(torch.ones(2, device="meta"), 1))
        assert torch.equal(rpc.rpc_sync(dst, torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))
        rpc.shutdown()


CASES = [
    "test_device_maps_wrong_worker_name",
    "test_device_maps_invalid_max_local_device",
    "test_device_maps_many_to_one",
    "test_device_maps_one_to_many",
    "test_device_maps_invalid_min_device",
    "test_devices_beyond_this_machine",
    "test_device_map_cpu",
]


def run_cases(rank: int, world: int, folder: str) -> None:
    # One world runs every case in turn, each with a rendezvous of its own: a failed
    # init_rpc leaves nothing behind, and the next case starts a new group.
    for i, name in enumerate(CASES):
        getattr(_Case(rank, f"{folder}/init-{i}"), name)()


def test_device_maps_are_validated_as_pytorch_does(tmp_path):
    run_world(run_cases, 2, str(tmp_path))
