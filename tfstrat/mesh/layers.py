"""How each layer computes with sharded variables: Megatron-LM's scheme, read off the layout.

`install_split(layer)` (as soon as a layer is built) gives each layer that owns a sharded
variable a call that runs on the parts (an instance attribute; the class is untouched), chosen
by the layer and by which dimension the layout splits; `prepare(model)` does it for a whole
model, and mends split activations (below):

- `Dense` and `EinsumDense` (and so `MultiHeadAttention`, built on it): a kernel split on an
  output dimension is **column-parallel** (the whole input through `copy`; the output stays
  split: a `MultiHeadAttention` projection split by heads computes its heads on their device);
  a kernel split on a contracted dimension is **row-parallel** (the input split, or taken as it
  arrives split from a column-parallel layer; the partial outputs summed by `reduce`, then the
  bias). A bias follows its output dimension. An activation that is not elementwise (softmax)
  sees the whole output.
- `Embedding` (and `ReversibleEmbedding`'s lookup): a table split over rows is
  **vocabulary-parallel** (each device looks up the ids in its rows, zeros elsewhere, summed by
  `reduce`); `ReversibleEmbedding`'s tied logits are computed per part and gathered. A table
  split over columns gives split rows, gathered.
- An attention layer without weights of its own whose `query`/`key` projections are split by
  heads and which reshapes by its configured `num_query_heads`/`num_key_value_heads`
  (keras-hub's Gemma) runs, inside a step, with the counts each device holds.
- Any other layer with a sharded variable (or a layer above with LoRA, quantization or an
  overridden `call`) reads its variables **whole** for the call (`variables.whole_reads`): the
  memory saving of its variables stays, its compute is not split, and a start-up line says so.

A split activation is whole again wherever it is needed: a layer with weights whose input
arrives split on the last axis (compared with the shape it was built for) gathers it first, and
so does the model's output. Between a column-parallel layer and its row-parallel partner only
elementwise operations may run (activations, dropout, products): Megatron-LM's rule.
"""

from __future__ import annotations

import logging
import threading

import keras
import tensorflow as tf

from tfstrat.errors import UsageError
from tfstrat.mesh import collectives
from tfstrat.mesh.variables import ShardedVariable, is_sharded, whole_reads

logger = logging.getLogger(__name__)

_ELEMENTWISE = {
    "linear", "relu", "relu6", "gelu", "silu", "swish", "tanh", "sigmoid", "elu", "selu",
    "softplus", "softsign", "exponential", "leaky_relu", "hard_sigmoid", "hard_silu", "mish",
}  # fmt: skip


def _active(strategy) -> bool:
    """Whether a step of `strategy` is being traced on this replica."""
    if tf.distribute.in_cross_replica_context() or not tf.distribute.has_strategy():
        return False
    return tf.distribute.get_strategy() is strategy


def own_variables(layer) -> list:
    return list(getattr(layer, "_trainable_variables", [])) + list(
        getattr(layer, "_non_trainable_variables", [])
    )


# --- reading variables and inputs as a computation needs them ---------------------------


def _as(tensor, split_dim: int | None, now_split: int | None):
    """`tensor` (split along `now_split`, or whole: None) made split along `split_dim` (None:
    whole)."""
    if now_split is not None and split_dim is not None and now_split == split_dim:
        return tensor
    if now_split is not None:
        tensor = collectives.gather(tensor, now_split)
    if split_dim is not None:
        tensor = collectives.split(tensor, split_dim)
    return tensor


def _read(variable, split_dim: int | None = None):
    """`variable`'s value on this device, split along `split_dim` or whole (None)."""
    if is_sharded(variable):
        return _as(variable.local(), split_dim, variable.sharding.dim)
    return _as(tf.convert_to_tensor(variable), split_dim, None)


def _split_axis(x, axis: int, whole: int) -> bool:
    """Whether `x` arrives split over the model axis along `axis` (whole size `whole`)."""
    parts = collectives.model_size()
    size = x.shape[axis] if x.shape.rank else None
    return parts > 1 and size is not None and size != whole and size * parts == whole


def _whole_last(x, whole: int | None):
    if whole is not None and isinstance(x, tf.Tensor) and _split_axis(x, -1, whole):
        return collectives.gather(x, -1)
    return x


# --- Dense and EinsumDense ---------------------------------------------------------------


def _letters(spec: str) -> tuple[list[str], bool]:
    """A subscript's letters and whether it starts with "..." (its positions count from the end)."""
    if spec.startswith("..."):
        return list(spec[3:]), True
    return list(spec), False


def _position(spec: str, letter: str) -> int:
    letters, from_end = _letters(spec)
    index = letters.index(letter)
    return index - len(letters) if from_end else index


def _plan_einsum(equation: str, kernel) -> tuple[str | None, int | None, int | None]:
    """("column", output axis, None) or ("row", None, input axis) for `kernel`'s split, or
    (None, None, None): computed whole."""
    if not is_sharded(kernel) or kernel.sharding.dim is None or "->" not in equation:
        return None, None, None
    inputs, output = equation.split("->")
    source, weights = inputs.split(",")
    if "..." in weights or any("..." in s[3:] for s in (source, output)):
        return None, None, None
    letter = weights[kernel.sharding.dim]
    in_source, in_output = letter in source, letter in output
    if in_output and not in_source:
        return "column", _position(output, letter), None
    if in_source and not in_output:
        return "row", None, _position(source, letter)
    return None, None, None


def _bias(bias, out_axis: int | None, out_rank: int):
    """The bias, split along the output axis `out_axis` when it varies along it."""
    if bias is None:
        return None
    if out_axis is None:
        return _read(bias)
    axis = out_axis % out_rank - (out_rank - len(bias.shape))
    if axis < 0 or bias.shape[axis] == 1:
        return _read(bias)
    return _read(bias, axis)


def _project(layer, inputs, equation: str, multiply, expected_last: int | None):
    """`activation(multiply(x, kernel) + bias)` on the parts (see the module's docstring)."""
    kernel, bias = layer._kernel, layer.bias
    mode, out_axis, in_axis = _plan_einsum(equation, kernel)
    x = tf.convert_to_tensor(inputs)
    if mode == "row":
        whole = kernel.sharding.shape[kernel.sharding.dim]
        x = x if _split_axis(x, in_axis, whole) else collectives.split(x, in_axis)
        y = collectives.reduce(multiply(x, _read(kernel, kernel.sharding.dim)))
        out_axis = None
    elif mode == "column":
        x = _split.copy(_whole_last(x, expected_last))
        y = multiply(x, _read(kernel, kernel.sharding.dim))
    else:
        y = multiply(_whole_last(x, expected_last), _read(kernel))
    b = _bias(bias, out_axis, y.shape.rank)
    if b is not None:
        y = y + tf.cast(b, y.dtype)
    activation = layer.activation
    if activation is not None:
        name = getattr(activation, "__name__", "")
        if out_axis is not None and name not in _ELEMENTWISE:
            y, out_axis = collectives.gather(y, out_axis), None
        y = activation(y)
    if out_axis is not None:
        _split.note(y, out_axis)  # whole again if it leaves the model so
    return y


def _dense_call(layer, inputs, training=None):
    return _project(
        layer,
        inputs,
        "...a,ab->...b",
        lambda x, k: keras.ops.matmul(x, tf.cast(k, x.dtype)),
        layer._kernel.shape[0],
    )


def _einsum_dense_call(layer, inputs, training=None):
    equation = layer.equation
    return _project(
        layer,
        inputs,
        equation,
        lambda x, k: keras.ops.einsum(equation, x, tf.cast(k, x.dtype)),
        None,
    )


# --- Embedding ---------------------------------------------------------------------------


def _lookup(layer, inputs):
    table = layer._embeddings
    ids = tf.convert_to_tensor(inputs)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    sharding = table.sharding
    if sharding.dim is None:  # sharded over the batch axis only: the whole table
        return tf.cast(keras.ops.take(table.local(), ids, axis=0), layer.compute_dtype)
    if sharding.dim == 1:
        rows = keras.ops.take(table.local(), ids, axis=0)
        return tf.cast(collectives.gather(rows, -1), layer.compute_dtype)
    lo, hi = sharding.bounds(table._tfstrat_mesh.model_index(collectives.replica()))
    inside = tf.logical_and(ids >= lo, ids < hi)
    local = tf.where(inside, ids - tf.cast(lo, ids.dtype), tf.zeros_like(ids))
    rows = keras.ops.take(table.local(), local, axis=0)
    rows = rows * tf.cast(inside, rows.dtype)[..., None]
    return tf.cast(collectives.reduce(rows), layer.compute_dtype)


def _reversible_call(layer, original):
    def call(inputs, reverse=False):
        if not reverse:
            if layer.mask_zero:  # it sets the mask inside its call: whole table
                return _whole_call(layer, original)(inputs, reverse=reverse)
            return _lookup(layer, inputs)
        table = layer._embeddings
        if not layer.tie_weights or table.sharding.dim != 0 or layer.logit_soft_cap is not None:
            return _whole_call(layer, original)(inputs, reverse=reverse)
        x = _split.copy(tf.convert_to_tensor(inputs))
        if layer.reverse_dtype is not None:
            x = tf.cast(x, layer.reverse_dtype)
        kernel = tf.cast(tf.transpose(table.local()), x.dtype)
        return collectives.gather(keras.ops.matmul(x, kernel), -1)

    return call


# --- every other layer -------------------------------------------------------------------


def _whole_call(layer, original):
    def call(*args, **kwargs):
        wholes = {id(v): _read(v) for v in own_variables(layer) if is_sharded(v)}
        with whole_reads(wholes):
            return original(*args, **kwargs)

    return call


def _repairing_call(layer, original, expected_last: int):
    def call(inputs, *args, **kwargs):
        return original(_whole_last(inputs, expected_last), *args, **kwargs)

    return call


def _built_last(layer) -> int | None:
    """The last dimension of the input `layer` was built for, when it has one input."""
    shapes = getattr(layer, "_build_shapes_dict", None)
    if not shapes or len(shapes) != 1:
        return None
    shape = next(iter(shapes.values()))
    if not isinstance(shape, (tuple, list)) or not shape or not isinstance(shape[-1], int):
        return None
    return shape[-1]


# --- installing ----------------------------------------------------------------------------


def _plain(layer, base) -> bool:
    """Whether `layer` computes as `base` does: its class keeps `base.call`, no LoRA, no
    quantization."""
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return False
    return type(layer).call is base.call


def _choose(layer):
    """(kind, the call on the parts) for a layer that owns a sharded variable."""
    original = layer.call
    sharded = [v for v in own_variables(layer) if is_sharded(v)]
    names = {v.name for v in sharded}
    if isinstance(layer, keras.layers.Dense) and _plain(layer, keras.layers.Dense):
        if names <= {"kernel", "bias"}:
            mode = _plan_einsum("...a,ab->...b", layer._kernel)[0]
            return mode or "whole kernel", lambda inputs, training=None: _dense_call(layer, inputs)
    if isinstance(layer, keras.layers.EinsumDense) and _plain(layer, keras.layers.EinsumDense):
        if names <= {"kernel", "bias"}:
            mode = _plan_einsum(layer.equation, layer._kernel)[0]
            return mode or "whole kernel", lambda inputs, training=None: _einsum_dense_call(
                layer, inputs
            )
    reversible = getattr(keras.layers, "ReversibleEmbedding", None)
    if reversible is not None and isinstance(layer, reversible) and names == {"embeddings"}:
        if not getattr(layer, "lora_enabled", False) and not layer.quantization_mode:
            if type(layer).call is reversible.call or _keeps_call(layer, reversible):
                kind = _table_kind(layer._embeddings)
                return kind, _reversible_call(layer, original)
    if isinstance(layer, keras.layers.Embedding) and _plain(layer, keras.layers.Embedding):
        if names == {"embeddings"}:  # Keras computes a mask_zero mask outside the call
            kind = _table_kind(layer._embeddings)
            return kind, lambda inputs: _lookup(layer, inputs)
    return "whole", _whole_call(layer, original)


def _table_kind(table) -> str:
    return {0: "vocabulary-parallel", 1: "columns", None: "whole table"}[table.sharding.dim]


def _keeps_call(layer, base) -> bool:
    """Whether `layer`'s class overrides `call` only by inheriting `base`'s through a subclass
    that adds nothing to it (keras-hub's ReversibleEmbedding subclasses Keras's)."""
    for cls in type(layer).__mro__:
        if cls is base:
            return True
        if "call" in vars(cls):
            return False
    return False


class ModelGroupPenalty:
    """A sharded variable's regularizer: inside a step each device computes the penalty of its
    model part (a variable sharded over the batch axis reads its part all-gathered, so the
    penalty's gradient reaches the blocks as the loss's does), summed over the model group
    (`collectives.reduce`: the whole variable's penalty in the loss Keras reports, each part's
    gradient its own). Exact for penalties that add over elements (L1, L2); one that couples
    elements across parts would see only its part."""

    def __init__(self, regularizer, sharding):
        self.regularizer = regularizer
        self.sharding = sharding

    def __call__(self, x):
        if tf.distribute.in_cross_replica_context() or not tf.distribute.has_strategy():
            return self.regularizer(x)  # read whole
        if is_sharded(x):
            x = x.local()
        penalty = self.regularizer(x)
        if self.sharding.dim is not None and collectives.model_size() > 1:
            return collectives.reduce(penalty)
        return penalty

    def get_config(self):
        return self.regularizer.get_config()


def install_split(layer, strategy) -> str | None:
    """Gives `layer`, if it owns a split variable, its call on the parts (once); returns its
    start-up line. Run as soon as a layer is built (`Layer._maybe_build`), so that even the
    call that built it computes on the parts, and again for every layer of a model."""
    if getattr(layer, "_tfstrat_mesh_call", None) is not None:
        return None
    sharded = [v for v in own_variables(layer) if is_sharded(v)]
    if not sharded:
        return _install_local_heads(layer, strategy)
    for v in sharded:
        if getattr(v, "constraint", None) is not None:
            raise UsageError(
                f"Variable {v.path!r} is split by layout rule {v.sharding.rule!r} and has a "
                f"constraint ({type(v.constraint).__name__}), which Keras applies to the whole "
                "variable: leave it unsplit, or drop the constraint."
            )
    for v in sharded:
        if getattr(v, "regularizer", None) is not None and not isinstance(
            v.regularizer, ModelGroupPenalty
        ):
            v.regularizer = ModelGroupPenalty(v.regularizer, v.sharding)
    original = layer.call
    kind, call = _choose(layer)
    if kind in ("row", "column"):
        layer.input_spec = None  # a row-parallel layer's input arrives split
    _install(layer, strategy, original, call)
    layer._tfstrat_mesh_call = kind
    return _line(layer, kind)


# An attention layer that reshapes by its configured head counts (keras-hub's Gemma: q as
# (kv heads, q heads // kv heads, head dim)) runs, inside a step, with the counts one device
# holds when its query / key projections are split by heads.
_HEAD_COUNTS = (("num_query_heads", "query"), ("num_key_value_heads", "key"))


def _install_local_heads(layer, strategy) -> str | None:
    parts = strategy.extended._tfstrat_mesh.model_size
    children = {c.name: c for c in vars(layer).values() if isinstance(c, keras.layers.Layer)}
    local = {}
    for count, name in _HEAD_COUNTS:
        n, child = getattr(layer, count, None), children.get(name)
        if isinstance(n, int) and getattr(child, "_tfstrat_mesh_call", None) == "column":
            local[count] = n // parts
    if not local or parts == 1:
        return None
    original, lock, state = layer.call, threading.Lock(), {"depth": 0, "whole": {}}

    def call(*args, **kwargs):
        # Replicas trace in turns, one pausing inside the call at an exchange while another
        # enters it: the counts are the local ones until the last replica leaves.
        with lock:
            if state["depth"] == 0:
                state["whole"] = {k: getattr(layer, k) for k in local}
                for k, v in local.items():
                    object.__setattr__(layer, k, v)
            state["depth"] += 1
        try:
            return original(*args, **kwargs)
        finally:
            with lock:
                state["depth"] -= 1
                if state["depth"] == 0:
                    for k, v in state["whole"].items():
                        object.__setattr__(layer, k, v)

    _install(layer, strategy, original, call)
    layer._tfstrat_mesh_call = "local heads"
    counts = ", ".join(f"{k} {getattr(layer, k)} -> {v}" for k, v in local.items())
    return (
        f"{layer.path} ({type(layer).__name__}): its projections split by heads, it runs with "
        f"the heads each device holds ({counts})"
    )


def prepare(model, strategy) -> list[str]:
    """Gives `model`'s layers their calls on the parts; returns one line per layer with a split
    variable not said before. With a model axis, a layer with weights takes an input that
    arrives split whole again, and so do the model's outputs."""
    layers = model._flatten_layers(include_self=True) if hasattr(model, "_flatten_layers") else []
    lines = [line for line in (install_split(layer, strategy) for layer in layers) if line]
    if strategy.extended._tfstrat_mesh.data_size > 1:
        for layer in layers:
            if isinstance(layer, _CONVOLUTIONS) and not hasattr(layer, "_tfstrat_rows_guard"):
                _guard_empty_slices(layer, strategy)
    if strategy.extended._tfstrat_mesh.model_size == 1:
        return lines
    for layer in layers:
        if getattr(layer, "_tfstrat_mesh_call", None) is not None:
            continue
        original = layer.call
        if layer is model:
            kind, call = "outputs", _whole_outputs(model, original)
        elif own_variables(layer) and _built_last(layer) is not None:
            kind, call = "repair", _repairing_call(layer, original, _built_last(layer))
            layer.input_spec = None  # its input may arrive split: whole again in its call
        else:
            continue
        _install(layer, strategy, original, call)
        layer._tfstrat_mesh_call = kind
    return lines


_CONVOLUTIONS = tuple(
    getattr(keras.layers, name)
    for name in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
        "SeparableConv1D", "SeparableConv2D", "DepthwiseConv1D", "DepthwiseConv2D",
    )
    if hasattr(keras.layers, name)
)  # fmt: skip


def _guard_empty_slices(layer, strategy) -> None:
    """A replica whose slice of the batch is empty still runs the forward pass when the model
    holds collectives (its peers wait for it). TensorFlow's oneDNN convolution on the CPU gives
    an input of 0 rows an output of the input's shape (TF 2.21), and the backward pass then
    fails; such a layer computes on one row of zeros instead, its output cut back to the rows
    it was given (exact: the row's gradient is zero)."""
    original = layer.call

    def call(inputs, *args, **kwargs):
        if not _active(strategy) or not isinstance(inputs, tf.Tensor) or not inputs.shape.rank:
            return original(inputs, *args, **kwargs)
        rows = tf.shape(inputs)[0]
        padding = [[0, tf.maximum(1 - rows, 0)]] + [[0, 0]] * (inputs.shape.rank - 1)
        return original(tf.pad(inputs, padding), *args, **kwargs)[:rows]

    object.__setattr__(layer, "call", call)
    layer._tfstrat_rows_guard = True


def _whole_outputs(model, original):
    """The model's outputs whole: the ones a column-parallel layer left split (`_split`), and,
    for a Functional model, any whose last axis is a part of its symbolic output's."""
    outputs = getattr(model, "outputs", None)
    shapes = [tuple(o.shape) for o in keras.tree.flatten(outputs)] if outputs else None

    def call(*args, **kwargs):
        result = original(*args, **kwargs)
        flat = keras.tree.flatten(result)
        mended = []
        for i, t in enumerate(flat):
            axis = _split.axis_of(t)
            if axis is not None:
                t = collectives.gather(t, axis)
            elif shapes is not None and len(shapes) == len(flat) and shapes[i]:
                t = _whole_last(t, shapes[i][-1])
            mended.append(t)
        _split.clear()  # this replica's trace of the model is done
        return keras.tree.pack_sequence_as(result, mended)

    return call


class _SplitOutputs(threading.local):
    """Tensors a column-parallel layer returned split, and the inputs column-parallel layers
    took whole (each replica thread its own, for one trace of the model)."""

    def __init__(self):
        self.by_id: dict[int, tuple] = {}
        self.copies: dict[int, tuple] = {}

    def clear(self) -> None:
        self.by_id.clear()
        self.copies.clear()

    def copy(self, x):
        """`collectives.copy(x)`, once per tensor: column-parallel layers that read the same
        input (an attention layer's query, key and value projections; a gated MLP's two) share
        one copy, so their gradients are added on each device first and summed over the model
        group in one exchange instead of one each."""
        found = self.copies.get(id(x))
        if found is not None and found[0] is x:
            return found[1]
        copied = collectives.copy(x)
        self.copies[id(x)] = (x, copied)
        return copied

    def note(self, tensor, axis: int) -> None:
        self.by_id[id(tensor)] = (tensor, axis)

    def axis_of(self, tensor) -> int | None:
        found = self.by_id.get(id(tensor))
        return found[1] if found is not None and found[0] is tensor else None


_split = _SplitOutputs()


def _install(layer, strategy, original, call):
    sharded = [v for v in own_variables(layer) if is_sharded(v)]

    def dispatch(*args, **kwargs):
        if _active(strategy):
            return call(*args, **kwargs)
        if not sharded:
            return original(*args, **kwargs)
        # Outside a step (Keras's symbolic build, a call of the model by hand): whole values.
        with whole_reads({id(v): v.whole() for v in sharded}):
            return original(*args, **kwargs)

    object.__setattr__(layer, "call", dispatch)


def _line(layer, kind: str) -> str:
    def how_split(sharding):
        said = [f"split on dimension {sharding.dim}"] if sharding.dim is not None else []
        if sharding.fsdp:
            said.append(f"sharded on dimension {sharding.batch_dim} over the batch axis")
        return " and ".join(said)

    parts = ", ".join(
        f"{v.name} {tuple(v.shape)} {how_split(v.sharding)}"
        for v in own_variables(layer)
        if isinstance(v, ShardedVariable)
    )
    how = {
        "column": "column-parallel (output split)",
        "row": "row-parallel (partial outputs summed)",
        "vocabulary-parallel": "vocabulary-parallel lookup",
        "columns": "lookup of split columns, gathered",
        "whole kernel": "kernel read whole for each call",
        "whole table": "table read whole for each call",
        "whole": "variables read whole for each call: tfstrat does not split this layer's "
        "computation (its variables' memory is still split)",
    }[kind]
    own = own_variables(layer)
    where = own[0].path.rsplit("/", 1)[0] if own else layer.name
    return f"{where} ({type(layer).__name__}): {parts}: {how}"
