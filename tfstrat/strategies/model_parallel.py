"""`ModelParallel`: tensor parallelism for Keras 3 on TensorFlow (Mesh-TensorFlow's idea).

Every device of a 2-D mesh (batch x model) is one replica of TensorFlow's mirrored strategy,
running the same step on its own parts (SPMD):

- **variables** (`tfstrat.mesh.variables`): a layout rule that puts the model axis on a
  dimension splits that variable, and its optimizer slots, into parts; each device holds only
  its part. One that puts the batch axis on a dimension shards it over the batch axis too
  (FSDP): each device holds one block, all-gathered for each use inside a step, its gradient
  reduce-scattered. Every other variable is whole on every device.
- **input**: each batch is cut into one slice per coordinate of the batch axis; the devices of
  one model group read the same slice.
- **the forward and backward passes** (`tfstrat.mesh.layers`): Megatron-LM's column- and
  row-parallel Dense and EinsumDense (attention by heads), vocabulary-parallel Embedding,
  with the model group's collectives (`tfstrat.mesh.collectives`).
- **the step's exchange**: the gradients (each device's of its parts), the rows and the metric
  states are summed over the batch axis only (`DataAxisReduce`), weighted by rows as in every
  tfstrat strategy (`_exact_step`), so a step equals one device's on the same global batch
  (an FSDP block's gradient arrives summed by its reduce-scatter: only divided by the rows).
  Clipping by norm takes the norm over all parts.

TensorFlow internals it depends on (`tfstrat._compat.tf`): `MirroredExtended`'s variable
creation (`_create_variable`, `_get_variable_creator_initial_value`) to create each device's
part, `PerReplica`/`Mirrored` values to hand each replica its own result from `merge_call`.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import tensorflow as tf

from tfstrat._compat import patches
from tfstrat._compat.tf import mirrored_strategy, values
from tfstrat.errors import UsageError
from tfstrat.keras import _shuffle
from tfstrat.strategies import _common, collective

logger = logging.getLogger(__name__)
_SUM = tf.distribute.ReduceOp.SUM


class _SplitsVariables:
    """Extended-object mixin: creates split variables as one part per device (see
    `tfstrat.mesh.variables`)."""

    _tfstrat_planned = None  # the sharding of the variable being created
    _tfstrat_whole = None  # its whole initial value, drawn once (across workers: the chief's)

    def _create_variable(self, next_creator, **kwargs):
        planned, self._tfstrat_planned = self._tfstrat_planned, None
        colocate_with = kwargs.get("colocate_with")
        if colocate_with is not None:  # an optimizer slot: split as its variable, or whole
            sharding = getattr(colocate_with, "_tfstrat_sharding", None)
        else:
            sharding = planned
            if sharding is not None and kwargs.get("trainable") is False:
                raise UsageError(
                    f"Layout rule {sharding.rule!r} splits {sharding.path!r}, a non-trainable "
                    "variable (moving statistics, a counter): tfstrat splits trainable "
                    "variables only. Leave it unsplit (narrow the rule's regular expression)."
                )
        if sharding is None:
            return super()._create_variable(next_creator, **kwargs)
        self._tfstrat_planned = sharding
        try:
            variable = super()._create_variable(next_creator, **kwargs)
        finally:
            self._tfstrat_planned, self._tfstrat_whole = None, None
        variable._tfstrat_sharding = sharding
        return variable

    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        sharding = self._tfstrat_planned
        if sharding is None or replica_id == 0:
            value = super()._get_variable_creator_initial_value(
                replica_id, device, primary_var, **kwargs
            )
            if sharding is None:
                return value
            with tf.init_scope():  # the whole value: this one's, or the chief's broadcast
                self._tfstrat_whole = tf.convert_to_tensor(value() if callable(value) else value)
        mesh = self._tfstrat_mesh
        whole, replica = self._tfstrat_whole, mesh.local[replica_id]
        if tuple(whole.shape) != sharding.shape:
            raise UsageError(
                f"Variable {sharding.path!r}: its initial value has shape {tuple(whole.shape)}, "
                f"its layout was planned for {sharding.shape}."
            )
        block = sharding.take(whole, mesh.model_index(replica), mesh.data_index(replica))
        return lambda: tf.identity(block)

    def _get_cross_device_ops(self, value):
        return self._cross_device_ops  # int32 values too: every sum is over the batch axis


class _Extended(_SplitsVariables, mirrored_strategy.MirroredExtended):
    def _reduce_to(self, reduce_op, value, destinations, options):
        # MirroredStrategy sends a reduction to a CPU device, or elsewhere than the value's
        # devices (a metric's read, `strategy.reduce`), through ReductionToOneDevice, which
        # sums every device: here each slice of the batch counts once.
        if isinstance(value, values.DistributedValues) and not isinstance(value, values.Mirrored):
            return self._cross_device_ops.reduce(reduce_op, value, destinations, options)
        if not isinstance(value, values.DistributedValues) and reduce_op == _SUM:
            value = value * tf.cast(self._tfstrat_mesh.data_size, value.dtype)  # once a slice
            return self.broadcast_to(value, destinations)
        return super()._reduce_to(reduce_op, value, destinations, options)


class _WorkersExtended(_SplitsVariables, collective._Extended):
    pass


def _shape_of(value) -> tuple:
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else np.shape(value)


def _plan_keras_variables() -> None:
    """Keras variables created under a ModelParallel scope are planned by their path."""
    import keras

    if patches.is_patched(keras.Variable, "_initialize"):
        return
    keras_initialize = patches.original(keras.Variable, "_initialize")

    def _initialize(self, value):
        strategy = tf.distribute.get_strategy()
        plan = getattr(strategy, "_tfstrat_plan", None)
        if plan is None:
            return keras_initialize(self, value)
        plan(self, self._shape if self._shape is not None else _shape_of(value))
        try:
            keras_initialize(self, value)
        finally:
            strategy.extended._tfstrat_planned = None
        if getattr(self._value, "_tfstrat_sharding", None) is not None:
            from tfstrat.mesh.variables import adopt

            adopt(self, strategy.extended._tfstrat_mesh)  # its shape: the whole's

    patches.patch(
        keras.Variable,
        "_initialize",
        _initialize,
        "under tfstrat.ModelParallel, a variable its layout map splits is created as one part "
        "per device",
    )
    keras_maybe_build = patches.original(keras.layers.Layer, "_maybe_build")

    def _maybe_build(self, call_spec):
        was_built = self.built
        keras_maybe_build(self, call_spec)
        if was_built or not self.built:
            return  # the hook runs once per layer, as it is built
        built = getattr(tf.distribute.get_strategy(), "_tfstrat_layer_built", None)
        if built is not None:
            built(self)

    patches.patch(
        keras.layers.Layer,
        "_maybe_build",
        _maybe_build,
        "under tfstrat.ModelParallel, a layer with a split variable computes on its parts from "
        "the call that builds it",
    )


def _once_per_slice(fn, mesh):
    """`fn` (a predict step) whose outputs are empty on every replica but model coordinate
    0's: the devices of a model group compute the same rows, which `predict` returns once."""

    @functools.wraps(fn)
    def step(*args, **kwargs):
        from tfstrat.mesh import collectives

        outputs = fn(*args, **kwargs)
        if mesh.model_index(collectives.replica()) == 0:
            return outputs
        none = lambda t: t[:0] if isinstance(t, tf.Tensor) and t.shape.rank else t  # noqa: E731
        return tf.nest.map_structure(none, outputs)

    return step


def _device_mesh(layout_map, device_mesh):
    if layout_map is None and device_mesh is None:
        raise UsageError(
            "Received: ModelParallel() with neither layout_map nor device_mesh. Pass "
            "layout_map=tfstrat.LayoutMap(tfstrat.DeviceMesh(shape, axis_names))."
        )
    mesh_of = getattr(layout_map, "device_mesh", None) if layout_map is not None else None
    device_mesh = device_mesh if device_mesh is not None else mesh_of
    if device_mesh is None:
        raise UsageError(
            "Received: a layout_map without a device_mesh. Create it as "
            "tfstrat.LayoutMap(tfstrat.DeviceMesh(shape, axis_names))."
        )
    return device_mesh


def _worker_count(tf_config) -> int:
    if tf_config is None:
        return 1
    return len(tf_config.addresses("chief")) + len(tf_config.addresses("worker"))


class _OnMesh:
    """What both ModelParallel classes share: planning variables, preparing layers, clipping,
    input and results (the strategy's `mesh`, `layout_map`, `planned`)."""

    mesh = None  # until set up (a multi-worker start-up runs collectives before)
    # Row gradients are concatenated, as one device's: clipping scales them as Keras does.
    _tfstrat_dense_rows = True

    def _mesh_setup(self, mesh, layout_map) -> None:
        if mesh.model_axis is None and layout_map is not None and len(layout_map):
            logger.warning(
                "tfstrat: ModelParallel's mesh %s has no model axis (its one axis %r is the "
                "batch's): every variable stays whole (data parallelism). Give the mesh a "
                "second axis for the model, e.g. DeviceMesh((1, %d), ['batch', 'model']).",
                list(mesh.axis_names),
                mesh.batch_axis,
                len(mesh.devices),
            )
        self.extended._tfstrat_mesh = mesh
        self.extended._tfstrat_model_exchange = _exchange(mesh, mesh.model_group(mesh.local[0]))
        ops = getattr(self.extended, "_cross_device_ops", None)
        if hasattr(ops, "exchange"):  # the batch axis's sums in this process
            first = mesh.model_index(mesh.local[0])
            ops.exchange = _exchange(mesh, [r for r in mesh.local if mesh.model_index(r) == first])
        self.mesh = mesh
        self.layout_map = layout_map if layout_map is not None else {}
        self.planned: dict[str, str | None] = {}  # variable path -> its start-up line
        self._reported: set[int] = set()
        _plan_keras_variables()
        logger.info(
            "tfstrat: ModelParallel over a mesh %s (%s), %d replica(s) here %s; batch axis "
            "%r, model axis %r (its sums: %s)",
            mesh.shape,
            ", ".join(mesh.axis_names),
            len(mesh.local),
            list(mesh.local_devices),
            mesh.batch_axis,
            mesh.model_axis,
            "NCCL" if self.extended._tfstrat_model_exchange == "nccl" else "device copies",
        )
        if getattr(ops, "exchange", None) == "nccl":
            logger.info("tfstrat: ModelParallel sums the batch axis in this process over NCCL")

    # -- variables ------------------------------------------------------------------------

    def _tfstrat_plan(self, variable, shape) -> None:
        """Plans the Keras `variable` of `shape` being created (`_plan_keras_variables`)."""
        from tfstrat.mesh.layout import plan

        sharding, line = plan(self.layout_map, self.mesh, variable.path, shape)
        self.planned[variable.path] = line
        self.extended._tfstrat_planned = sharding

    # -- steps ----------------------------------------------------------------------------

    def run(self, fn, args=(), kwargs=None, options=None):
        from tfstrat.strategies import _compute

        predicting = _compute.keras_predict_model(fn)
        model = predicting or getattr(fn, "__self__", None)
        if model is not None and hasattr(model, "_flatten_layers"):
            self._tfstrat_prepare_model(model)
        if predicting is not None and self.mesh is not None and self.mesh.model_size > 1:
            fn = _once_per_slice(fn, self.mesh)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _tfstrat_layer_built(self, layer) -> None:
        """A layer was just built in this strategy's scope (`Layer._maybe_build`)."""
        from tfstrat.mesh import layers

        line = layers.install_split(layer, self)
        if line:
            logger.info("tfstrat: %s", line)

    def _tfstrat_prepare_model(self, model) -> None:
        from tfstrat.mesh import layers
        from tfstrat.mesh.layout import unused_rules

        for line in layers.prepare(model, self):
            logger.info("tfstrat: %s", line)
        if id(model) in self._reported:
            return
        self._reported.add(id(model))
        for path, line in list(self.planned.items()):
            if line is not None:
                logger.info("tfstrat: %s", line)
                self.planned[path] = None  # said once
        if hasattr(self.layout_map, "keys"):
            for rule in unused_rules(self.layout_map, list(self.planned)):
                logger.warning(
                    "tfstrat: layout rule %r matches no variable created under this strategy "
                    "(paths look like %r): check the regular expression.",
                    rule,
                    next(iter(self.planned), "dense/kernel"),
                )

    def _tfstrat_check_apply(self, optimizer, variables) -> None:
        """A custom loop's optimizer (`fit` hands its own to `run`, which takes it over before
        its step is traced): at its first `apply`, its gradients are reduced and clipped as
        under `fit`: a block of a variable sharded over the batch axis arrives summed by its
        reduce-scatter and is left out of the step's sum, and clipping norms run over every
        part and block."""
        from tfstrat.strategies import _common

        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if not getattr(inner, "_tfstrat_clipping", False):
            replicas = self.num_replicas_in_sync
            norms = self._tfstrat_square_norms
            _common._take_over_clipping(inner, None, replicas, norms, self._tfstrat_dense_rows)

    def _tfstrat_square_norms(self, grads, variables) -> list:
        """Each gradient's squared norm for clipping: a sharded variable's is its blocks' sum,
        over the batch axis (FSDP), then over the model axis."""
        from tfstrat.mesh import collectives

        norms = []
        for g in grads:
            if g is None:
                norms.append(None)
                continue
            # Row gradients arrive as one device's, each looked-up row once (repeats apart):
            # Keras's one-device norm squares their values as they are.
            values = g.values if isinstance(g, tf.IndexedSlices) else g
            norms.append(tf.reduce_sum(tf.square(tf.cast(values, tf.float32))))
        shardings = [getattr(v, "_tfstrat_sharding", None) for v in variables]
        for over, total in (
            (lambda s: s.fsdp, collectives.data_sum),
            (lambda s: s.dim is not None and s.parts > 1, collectives.model_sum),
        ):
            split = [i for i, s in enumerate(shardings) if norms[i] is not None and s and over(s)]
            if split:
                summed = total(tf.stack([norms[i] for i in split]))
                for k, i in enumerate(split):
                    norms[i] = summed[k]
        return norms

    # -- input ----------------------------------------------------------------------------

    def experimental_distribute_dataset(self, dataset, options=None):
        """Each replica gets its slice of every global batch (`Mesh.batch_slice`): the devices
        of a model group read the same one."""
        _common.check_not_empty(dataset)
        mesh = self.mesh
        if mesh.model_size == 1 and len(mesh.local) == len(mesh.devices):
            return _common.name_empty_input(
                super().experimental_distribute_dataset(dataset, options)
            )
        replicas = len(mesh.local)
        slice_of = tf.constant([mesh.batch_slice(r) for r in mesh.local], tf.int64)
        slices, is_tuple = mesh.data_size, isinstance(dataset.element_spec, tuple)

        def expand(*args):
            structure = args if is_tuple else args[0]
            flat = tf.nest.flatten(structure)
            if any(isinstance(t, (tf.SparseTensor, tf.RaggedTensor)) for t in flat):
                raise UsageError(
                    "tfstrat ModelParallel slices dense inputs: densify sparse or ragged ones "
                    "(`.to_tensor()`) in the dataset."
                )
            ranked = [t for t in flat if t.shape.rank]
            if not ranked:
                raise UsageError(
                    "tfstrat ModelParallel: an input element has no batch dimension; batch the "
                    "dataset (`.batch(global_batch)`)."
                )
            rows = tf.cast(tf.shape(ranked[0])[0], tf.int64)

            def take(replica):
                k = tf.gather(slice_of, replica)
                lo, hi = rows * k // slices, rows * (k + 1) // slices
                return tf.nest.map_structure(lambda t: t[lo:hi] if t.shape.rank else t, structure)

            return tf.data.Dataset.range(replicas).map(take)

        expanded = dataset.flat_map(expand)
        extended = self.extended
        saved = extended.experimental_enable_get_next_as_optional
        extended.experimental_enable_get_next_as_optional = False  # every replica, every batch
        try:
            distributed = super().distribute_datasets_from_function(lambda _: expanded, options)
        finally:
            extended.experimental_enable_get_next_as_optional = saved
        return _common.name_empty_input(distributed)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """`dataset_fn(input_context)` once per process, as under tf.distribute: its
        InputContext counts the batch axis's slices as the replicas (`get_per_replica_batch_size`
        is the global batch over the mesh's data size), and each batch it yields goes to every
        device of the model group of its slice (consecutive batches to this process's slices,
        in order)."""
        mesh = self.mesh
        if mesh.model_size == 1 and len(mesh.local) == len(mesh.devices):
            return super().distribute_datasets_from_function(dataset_fn, options)
        extended = self.extended
        context = tf.distribute.InputContext(
            num_input_pipelines=getattr(extended, "_num_workers", 1),
            input_pipeline_id=getattr(extended, "_id_in_cluster", 0),
            num_replicas_in_sync=mesh.data_size,
        )
        dataset = dataset_fn(context)
        slices = sorted({mesh.batch_slice(r) for r in mesh.local})
        position = tf.constant([slices.index(mesh.batch_slice(r)) for r in mesh.local], tf.int64)
        replicas, is_tuple = len(mesh.local), isinstance(dataset.element_spec, tuple)

        def to_replicas(*windows):  # `len(slices)` consecutive batches, one per slice
            window = windows if is_tuple else windows[0]
            zipped = window if isinstance(window, tf.data.Dataset) else tf.data.Dataset.zip(window)
            return tf.data.Dataset.range(replicas).flat_map(
                lambda r: zipped.skip(tf.gather(position, r)).take(1)
            )

        expanded = dataset.window(len(slices)).flat_map(to_replicas)
        saved = extended.experimental_enable_get_next_as_optional
        extended.experimental_enable_get_next_as_optional = False  # every replica, every batch
        try:
            distributed = super().distribute_datasets_from_function(lambda _: expanded, options)
        finally:
            extended.experimental_enable_get_next_as_optional = saved
        return _common.name_empty_input(distributed)


class ModelParallel(_OnMesh, _common.AdoptsKerasOptimizers, tf.distribute.MirroredStrategy):
    """Tensor-parallel (and data-parallel) training over a device mesh: this process's devices, or
    every worker's (TF_CONFIG with 2+ workers; the model axis within each worker).

    Args:
        layout_map: a `tfstrat.LayoutMap` or `keras.distribution.LayoutMap` (its `device_mesh`
            is the mesh): regular expressions on variable paths to layouts, e.g.
            `layout_map["dense.*kernel"] = (None, "model")`.
        batch_dim_name: the mesh axis the batch is split over (default: the mesh's first).
        device_mesh: the mesh, when `layout_map` is None (no variable split: data parallel).
        tf_config: the cluster; None reads `TF_CONFIG`. With 2+ workers this returns a
            `ModelParallelOnWorkers` over every worker's devices; else one process's mesh.
        timeout: across workers, seconds a step's exchange may wait for a peer (as in
            CollectiveAllReduce); unused in one process.

    Example:
        >>> import tfstrat, keras  # doctest: +SKIP
        >>> tfstrat.split_cpu(4)  # doctest: +SKIP
        >>> mesh = tfstrat.DeviceMesh((2, 2), ["batch", "model"])  # doctest: +SKIP
        >>> layout = tfstrat.LayoutMap(mesh)  # doctest: +SKIP
        >>> layout["dense/kernel"] = (None, "model")  # column-parallel  # doctest: +SKIP
        >>> layout["dense_1/kernel"] = ("model", None)  # row-parallel  # doctest: +SKIP
        >>> strategy = tfstrat.ModelParallel(layout_map=layout, batch_dim_name="batch")  # doctest: +SKIP
    """

    def __new__(cls, *args, tf_config=None, **kwargs):
        tf_config = tf_config if tf_config is not None else collective._env_config()
        if cls is ModelParallel and _worker_count(tf_config) > 1:
            return ModelParallelOnWorkers(*args, tf_config=tf_config, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        *,
        layout_map=None,
        batch_dim_name: str | None = None,
        device_mesh=None,
        tf_config=None,
        timeout: float | None = None,
    ):
        from tfstrat.mesh.collectives import DataAxisReduce
        from tfstrat.mesh.layout import Mesh

        mesh = Mesh.of(_device_mesh(layout_map, device_mesh), batch_dim_name)
        _shuffle.seed_shuffles(set_global_seed=False)
        super().__init__(devices=list(mesh.devices), cross_device_ops=DataAxisReduce(mesh))
        self.extended.__class__ = _Extended
        self._mesh_setup(mesh, layout_map)


class ModelParallelOnWorkers(_OnMesh, collective.CollectiveAllReduce):
    """`ModelParallel` across workers (what `tfstrat.ModelParallel(...)` returns under a
    TF_CONFIG of 2+ workers): the mesh's devices are the workers' devices in rank order
    (`tfstrat.split_cpu(n)` alike on every worker), the model axis within each worker, the
    batch axis across them; the batch axis's sums cross workers in one exchange of tfstrat's
    TCP ring per step. The cluster (start-up, agreement, stopping, the chief's saving) is
    CollectiveAllReduce's."""

    _extended_class = _WorkersExtended

    def __init__(
        self,
        *,
        layout_map=None,
        batch_dim_name: str | None = None,
        device_mesh=None,
        tf_config=None,
        timeout: float | None = collective.DEFAULT_TIMEOUT,
    ):
        from tfstrat.cluster.devices import local_devices
        from tfstrat.mesh.collectives import DataAxisReduce
        from tfstrat.mesh.layout import Mesh

        device_mesh = _device_mesh(layout_map, device_mesh)
        tf_config = tf_config if tf_config is not None else collective._env_config()
        here = local_devices()
        if any("GPU" in d.upper() for d in here):
            raise UsageError(
                f"Received: ModelParallel across workers on GPUs ({here}). Across workers it "
                "runs on logical CPUs for now (tfstrat.split_cpu(n) on every worker); on one "
                "machine's GPUs, run one process (no TF_CONFIG)."
            )
        count = len(here)
        rules = {key: list(getattr(v, "axes", v)) for key, v in dict(layout_map or {}).items()}
        super().__init__(
            tf_config,
            devices=count if count > 1 else None,
            communication="auto",
            timeout=timeout,
            _agree_on={
                "mesh": list(device_mesh.shape),
                "axes": list(device_mesh.axis_names),
                "batch_dim_name": batch_dim_name,
                "layout": rules,
            },
        )
        names = [
            [f"{task}/device:CPU:{k}" for k in range(max(count, 1))]
            for task in _task_prefixes(tf_config)
        ]
        mesh = Mesh.of(device_mesh, batch_dim_name, (self.worker_index, names))
        ring = self.extended._cross_device_ops.ring  # the start-up's (`_uses_tcp_ring`)
        self.extended._cross_device_ops = DataAxisReduce(mesh, ring)
        self._mesh_setup(mesh, layout_map)

    def _uses_tcp_ring(self, communication, count, tf_config) -> bool:
        """The batch axis's sums go over tfstrat's ring whatever the devices per worker."""
        return _worker_count(tf_config) > 1


def _task_prefixes(tf_config) -> list[str]:
    """Every worker task's device prefix, by rank (the chief first, as TensorFlow ranks)."""
    return [
        f"/job:{job}/replica:0/task:{i}"
        for job in ("chief", "worker")
        for i in range(len(tf_config.addresses(job)))
    ]


def model_exchange(devices, cuda_build: bool, virtual_gpus: bool = False) -> str:
    """How a group of a mesh's devices sums: "nccl" (one NcclAllReduce, each device its result)
    where `transport.choose` would carry a gradient all-reduce over NCCL, else "copies" (each
    device adds the group's copies). One decision from the device names and the build, so
    every case is tested on literal device lists."""
    from tfstrat.strategies import transport

    if len(devices) < 2:
        return "copies"
    kind = transport.choose("auto", devices, 1, cuda_build, virtual_gpus).kind
    return "nccl" if kind == "nccl" else "copies"


def _exchange(mesh, replicas) -> str:
    """`model_exchange` for a group of this process's `replicas`."""
    from tfstrat.strategies import transport

    group = [mesh.local_devices[mesh.position(r)] for r in replicas]
    cuda = bool(tf.sysconfig.get_build_info().get("is_cuda_build", False))
    return model_exchange(group, cuda, transport.replica_devices(None)[1])
