"""cuda_kernels/pdl.py: programmatic dependent launch keeps a waiting kernel behind its producer, and the
launch attribute is set for pdl.launch and for nothing else."""

import numpy as np
import pytest
from kernel_support import SIM, device_empty, to_device
from numba import cuda

from cuda_kernels import pdl
from tinyvllm.cuda_graph import CUDAGraph

N = 4096


@pytest.mark.parametrize("graph", [False, True])
def test_a_waiting_dependent_sees_its_producers_writes(graph):
    a, b = to_device(np.full(N, -5, np.float32)), device_empty(N, np.float32)
    spins = 10 if SIM else 20000
    stream = cuda.stream()
    if graph and not SIM:
        pdl.producer_consumer(a, b, spins, stream)   # compiles outside the capture
        stream.synchronize()
        a.copy_to_device(np.full(N, -5, np.float32))
        b.copy_to_device(np.zeros(N, np.float32))
        CUDAGraph(lambda s: pdl.producer_consumer(a, b, spins, s), stream).replay()
    else:
        pdl.producer_consumer(a, b, spins, stream)
    stream.synchronize()
    np.testing.assert_array_equal(b.copy_to_host(), np.arange(N, dtype=np.float32) + 1)


def test_the_attribute_is_set_inside_launch_only():
    """On a device that has PDL, pdl.launch launches with programmatic stream serialization and a plain
    launch without; the simulator has neither."""
    if SIM:
        assert not pdl.enabled()
        return
    from numba.cuda import dispatcher

    seen = []
    factory = dispatcher.LaunchConfig
    assert factory is pdl._launch_config

    def recording(*args, **kwargs):
        config = factory(*args, **kwargs)
        seen.append(bool(config.programmatic_stream_serialization))
        return config

    a, b = to_device(np.zeros(N, np.float32)), device_empty(N, np.float32)
    pdl.producer_consumer(a, b, 1)   # compiled before the count
    dispatcher.LaunchConfig = recording
    try:
        pdl.producer_consumer(a, b, 1)
    finally:
        dispatcher.LaunchConfig = factory
    cuda.synchronize()
    assert seen == [False, pdl.enabled()]   # the producer plain, the consumer through launch
    np.testing.assert_array_equal(b.copy_to_host(), np.arange(N, dtype=np.float32) + 1)
