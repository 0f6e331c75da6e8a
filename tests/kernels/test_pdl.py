"""cuda_kernels/pdl.py: programmatic dependent launch keeps a waiting kernel behind its producer, launched
eagerly and replayed from a CUDA graph (tests/kernels/test_launch.py checks that only dependent launches
carry the attribute)."""

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
