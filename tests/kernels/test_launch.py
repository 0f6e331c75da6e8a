"""cuda_kernels/launch.py: a kernel launched through `launch` sees its arguments as Numba's own launch would
pass them (arrays of any strides, views over other dtypes and shapes, each scalar type), and `view` refuses
what it cannot express."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, to_device

from cuda_kernels import launch as ln


def echoed(matrix, words, scalars, through_launch=True):
    out = device_empty(10, np.float64)
    out.copy_to_device(np.full(10, np.nan))
    if through_launch:
        ln.echo(matrix, words, *scalars, out)
    else:   # Numba's launch syntax, for comparison
        ln._echo_kernel[1, 32](matrix, words, *scalars, out)
    return out.copy_to_host()


def expected(matrix_host, words_host, scalars):
    f32, f64, i32, u64, flag = scalars
    rows, cols = matrix_host.shape
    return np.array([rows, cols, matrix_host[-1, -1], words_host.shape[0], words_host[-1], np.float32(f32), f64,
                     i32, u64, float(flag)])


scalars = st.tuples(st.floats(-1e6, 1e6, width=32).map(np.float32), st.floats(-1e12, 1e12),
                    st.integers(-2**31, 2**31 - 1).map(np.int32), st.integers(0, 2**40).map(np.uint64),
                    st.booleans())


@given(rows=st.integers(1, 5), cols=st.integers(1, 6), skip=st.integers(0, 2), words=st.integers(1, 6),
       values=scalars, seed=st.integers(0, 2**16))
def test_a_launched_kernel_sees_strided_arrays_views_and_scalars(rows, cols, skip, words, values, seed):
    """matrix: the columns from `skip` of a wider array (strides that are not its shape's); words: a
    uint16 buffer seen as uint64 (each word's high half zero, so that it is exact in float64)."""
    rng = np.random.default_rng(seed)
    wide = rng.standard_normal((rows, cols + skip)).astype(np.float32)
    halves = np.zeros((words, 4), np.uint16)
    halves[:, :2] = rng.integers(0, 2**16, (words, 2))
    matrix = to_device(wide)[:, skip:]
    seen = echoed(matrix, ln.view(to_device(halves), (words,), np.uint64), values)
    np.testing.assert_array_equal(seen, expected(wide[:, skip:], halves.view(np.uint64).reshape(words), values))
    # the same launch through Numba's syntax sees the same
    numba_words = to_device(halves).view(np.uint64).reshape(words)
    np.testing.assert_array_equal(echoed(matrix, numba_words, values, through_launch=False), seen)


def test_view_defaults_to_the_last_dimension_rescaled():
    halves = to_device(np.zeros((2, 3, 8), np.uint16))
    assert (ln.view(halves, dtype=np.uint64).shape, ln.view(halves, dtype=np.uint64).dtype) == ((2, 3, 2), np.uint64)
    assert (ln.view(halves).shape, ln.view(halves, (48,)).shape) == ((2, 3, 8), (48,))


@pytest.mark.parametrize("shape, dtype", [((5,), np.uint64), ((7,), None), ((2, 2), np.uint32)])
def test_view_refuses_a_shape_over_other_bytes(shape, dtype):
    with pytest.raises(ValueError, match="cannot be seen as"):
        ln.view(to_device(np.zeros((2, 8), np.uint16)), shape, dtype)


def test_view_refuses_rows_that_do_not_hold_whole_items():
    with pytest.raises(ValueError, match="whole"):
        ln.view(to_device(np.zeros((2, 3), np.uint16)), dtype=np.uint64)


def test_view_refuses_a_strided_array():
    with pytest.raises(ValueError, match="C-contiguous"):
        ln.view(to_device(np.zeros((4, 8), np.uint16))[:, :4], (16,))


@pytest.mark.skipif(SIM, reason="the simulator launches through Numba's syntax and has no PDL")
def test_the_pdl_attribute_is_set_for_dependent_launches_only(monkeypatch):
    """pdl.producer_consumer launches its producer plain and its consumer dependent: the driver gets one
    launch attribute for the second only (none at all with PDL off)."""
    from cuda_kernels import pdl

    a, b = to_device(np.zeros(4096, np.float32)), device_empty(4096, np.float32)
    pdl.producer_consumer(a, b, 1)   # compiled before the count
    seen, driver = [], ln._drv

    class Recording:
        def __getattr__(self, name):
            return getattr(driver, name)

        @staticmethod
        def cuLaunchKernelEx(config, *args):
            seen.append(config.numAttrs)
            return driver.cuLaunchKernelEx(config, *args)

    monkeypatch.setattr(ln, "_drv", Recording())
    pdl.producer_consumer(a, b, 1)
    assert seen == [0, 1 if pdl.enabled() else 0]
    np.testing.assert_array_equal(b.copy_to_host(), np.arange(4096, dtype=np.float32) + 1)
