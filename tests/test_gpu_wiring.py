"""The GPU code paths' decisions, checked where no GPU is: rules on literal dtypes and device
lists, and graphs traced (not run) with the ops a GPU would run."""

import pytest
import tensorflow as tf

from tfstrat.mesh import collectives


@pytest.mark.parametrize(
    "dtype,wire",
    [
        (tf.float32, tf.float32),
        (tf.float16, tf.float16),
        (tf.float64, tf.float64),
        (tf.int32, tf.int32),
        (tf.int64, tf.int64),
        (tf.bfloat16, tf.float32),  # no NcclAllReduce kernel: summed in float32
        (tf.int8, None),
        (tf.bool, None),
    ],
)
def test_nccl_sums_cross_in_a_dtype_nccl_has_a_kernel_for(dtype, wire):
    assert collectives.nccl_dtype(dtype) == wire


def test_a_bfloat16_nccl_sum_is_traced_in_float32_and_handed_back_in_bfloat16():
    """`NcclAllReduce` allows half, float, double, int32 and int64 (its op definition): a
    bfloat16 sum (ModelParallel under mixed_bfloat16 on GPUs) failed when the step was traced.
    Traced here on the CPU (building the graph needs no kernel)."""

    @tf.function(autograph=False)
    def sums(a, b):
        with tf.device("/device:GPU:0"):
            a = tf.identity(a)
        with tf.device("/device:GPU:1"):
            b = tf.identity(b)
        return collectives.nccl_all_sum([a, b])

    spec = tf.TensorSpec([4], tf.bfloat16)
    graph = sums.get_concrete_function(spec, spec).graph
    nccl = [op for op in graph.get_operations() if op.type == "NcclAllReduce"]
    assert len(nccl) == 2 and all(op.get_attr("T") == tf.float32 for op in nccl), nccl
    assert [t.dtype for t in graph.structured_outputs] == [tf.bfloat16, tf.bfloat16]
    assert [op.device for op in nccl] == ["/device:GPU:0", "/device:GPU:1"]
    with pytest.raises(TypeError, match="NCCL cannot sum int8"):
        collectives.nccl_all_sum([tf.zeros([2], tf.int8)] * 2)
