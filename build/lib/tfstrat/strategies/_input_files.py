"""Input read from files: each worker reads only its share of the files.

By default CollectiveAllReduce (and Hybrid) give worker w rows [w*n//W, (w+1)*n//W) of every
global batch of n rows (`collective._Extended._distribute`): exactly single-device training,
but every worker reads and parses all the input. For a dataset read from files
(`tf.data.Dataset.list_files(...)` then `interleave`/`flat_map` of a `TFRecordDataset`,
`TextLineDataset` or `FixedLengthRecordDataset`, or such a reader given a list of files),
this module hands the dataset to TensorFlow's own multi-worker input path with
`AutoShardPolicy.FILE`: worker w reads files w, w+W, w+2W, ... of the list (TensorFlow's
graph rewrite shards the list of names before any shuffle of it, so the shares never
overlap), and each of its global batches of n rows is re-batched into steps of about n/W
rows. The choice follows the dataset's `options().experimental_distribute.auto_shard_policy`:

- FILE: by file. Refused when the pipeline reads no files (no reader TensorFlow can shard)
  or has fewer files than workers, with an error naming both counts and the fix.
- AUTO (the default): by file when the dataset is read from files and there are at least as
  many files as workers; otherwise by data (the slicing above), with one log line saying why.
- DATA: by data (the slicing above).
- OFF: not sharded: every worker trains on the dataset it was given, re-batched to about
  n/W rows per step (for a dataset each worker already made its own, e.g. with
  `dataset.shard(strategy.num_workers, strategy.worker_index)`).

What changes with files (FILE, and AUTO with enough files) and OFF: a step's global batch is
the W workers' local batches, each from its own files, so training is not the
single-device run on the same global batches (which depends on how records are spread over
files). Workers may run out of input at different steps (files of unequal size): a per-step
all-reduce asks whether any worker still has a batch; a worker that has none trains on an
empty batch (tfstrat weighs each replica's gradient by its rows, so the others' rows count
alone) until every worker is done, and the epoch ends at the same step everywhere.
`predict` returns the workers' rows of each step in worker order, not the input order.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import tensorflow as tf

from tfstrat._compat.tf import collective_all_reduce_strategy as _cars
from tfstrat._compat.tf import distribute_lib
from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)

_Policy = tf.data.experimental.AutoShardPolicy

# TensorFlow's own lists (tensorflow/core/grappler/optimizers/data/auto_shard.cc, TF 2.21):
# the sharding walk goes from the last dataset towards the source through `_PASS_THROUGH`
# ops, and shards the file names feeding the first reader it finds (or the input of a
# function dataset whose function holds one).
_READERS = (
    "ArrayRecordDataset",
    "FixedLengthRecordDataset",
    "RecordIODataset",
    "SSTableDataset",
    "TextLineDataset",
    "TFRecordDataset",
)
_FUNCTION_DATASETS = (
    "ExperimentalParallelInterleaveDataset",
    "FlatMapDataset",
    "InterleaveDataset",
    "LegacyParallelInterleaveDataset",
    "ParallelInterleaveDataset",
)
_MULTIPLE_INPUTS = ("ConcatenateDataset", "ZipDataset")
_UNSHARDABLE_SOURCES = (
    "GeneratorDataset",
    "RangeDataset",
    "SparseTensorsSliceDataset",
    "TensorDataset",
    "TensorSliceDataset",
)
_PASS_THROUGH = (
    "_Retval",
    "AssertNextDataset",
    "BatchDataset",
    "CacheDataset",
    "ExperimentalMapAndBatchDataset",
    "ExperimentalParseExampleDataset",
    "ExperimentalRebatchDataset",
    "FilterDataset",
    "FinalizeDataset",
    "Identity",
    "MapAndBatchDataset",
    "MapDataset",
    "MaxIntraOpParallelismDataset",
    "ModelDataset",
    "OptimizeDataset",
    "OptionsDataset",
    "PaddedBatchDataset",
    "ParallelBatchDataset",
    "ParallelMapDataset",
    "ParseExampleDataset",
    "PrefetchDataset",
    "PrivateThreadPoolDataset",
    "ReduceDataset",
    "RebatchDataset",
    "RepeatDataset",
    "ShardDataset",
    "ShuffleAndRepeatDataset",
    "ShuffleDataset",
    "SkipDataset",
    "TakeDataset",
    "WindowDataset",
)
# Between a reader and its list of names: ops that keep every name (list_files shuffles).
_KEEP_NAMES = ("ShuffleDataset", "PrefetchDataset", "OptionsDataset", "CacheDataset", "Identity")


def _is(op: str, names: tuple[str, ...]) -> bool:
    """TensorFlow's `MatchesAnyVersion`: "TFRecordDataset" also matches "TFRecordDatasetV2"."""
    return any(re.fullmatch(f"{re.escape(n)}(V\\d+)?", op) for n in names)


@dataclasses.dataclass(frozen=True)
class FileSource:
    """The files TensorFlow's FILE sharding would divide among the workers.

    Attributes:
        count: the number of files each sharded list holds (the smallest, when several
            readers are zipped or concatenated); None when the list is computed inside the
            pipeline and is not known before reading.
        names: the file names of the first list, when it is a constant.
    """

    count: int | None
    names: tuple[str, ...] = ()


def find_files(dataset: tf.data.Dataset) -> FileSource | None:
    """The files of `dataset`, or None when TensorFlow's FILE sharding would find no reader.

    A cheap look at the Python datasets and their functions comes first: serializing the
    graph of a dataset made from large in-memory arrays copies them (seconds for 400 MB).
    """
    if not _mentions_reader(dataset):
        return None
    try:
        graph = tf.compat.v1.GraphDef()
        graph.ParseFromString(dataset._as_serialized_graph().numpy())
    except (tf.errors.OpError, ValueError) as e:  # e.g. a stateful op that cannot serialize
        logger.debug("tfstrat: cannot inspect the input pipeline for files: %s", e)
        return None
    nodes = {node.name: node for node in graph.node}
    functions = {f.signature.name: f for f in graph.library.function}
    sink = next((n for n in graph.node if n.op == "_Retval"), None)
    return None if sink is None else _walk(sink, nodes, functions)


def _mentions_reader(dataset) -> bool:
    seen, stack = set(), [dataset]
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        if any(name in type(ds).__name__ for name in _READERS):
            return True
        for wrapper in _functions(ds):
            graph = wrapper.function.graph.as_graph_def()
            ops = [n.op for n in graph.node]
            ops += [n.op for f in graph.library.function for n in f.node_def]
            if any(_is(op, _READERS) for op in ops):
                return True
        stack.extend(_inputs(ds))
    return False


def _functions(ds) -> list:
    try:
        return list(ds._functions())
    except (AttributeError, NotImplementedError):
        return []


def _inputs(ds) -> list:
    try:
        return list(ds._inputs())
    except (AttributeError, NotImplementedError):
        return []


def _input(node, nodes, i: int = 0):
    name = node.input[i].split(":")[0].lstrip("^")
    return nodes.get(name)


def _walk(node, nodes, functions) -> FileSource | None:
    """TensorFlow's `RecursivelyHandleOp` (auto_shard.cc), reporting instead of rewriting."""
    for _ in range(10_000):  # a dataset graph is a chain; a bound keeps a cycle from hanging
        if node is None or _is(node.op, _UNSHARDABLE_SOURCES):
            return None
        if _is(node.op, _MULTIPLE_INPUTS):
            parts = [
                _walk(_input(node, nodes, i), nodes, functions)
                for i in range(len(node.input))
                if not node.input[i].startswith("^") and _is_dataset(_input(node, nodes, i))
            ]
            if not parts or any(p is None for p in parts):
                return None
            counts = [p.count for p in parts]
            count = None if None in counts else min(counts)
            return FileSource(count, parts[0].names)
        reads = _is(node.op, _FUNCTION_DATASETS) or _is(node.op, _PASS_THROUGH)
        if (reads and _reader_in_function(node, functions)) or _is(node.op, _READERS):
            return _names(_input(node, nodes), nodes)
        if not (_is(node.op, _FUNCTION_DATASETS) or _is(node.op, _PASS_THROUGH)):
            return None
        node = _input(node, nodes)
    return None


def _is_dataset(node) -> bool:
    return node is not None and "Dataset" in node.op


def _reader_in_function(node, functions, depth: int = 0) -> bool:
    f = functions.get(node.attr["f"].func.name) if "f" in node.attr else None
    if f is None or depth > 20:
        return False
    for inner in f.node_def:
        if _is(inner.op, _READERS) and len(inner.input) > 0:
            return True
        if _is(inner.op, _FUNCTION_DATASETS) and _reader_in_function(inner, functions, depth + 1):
            return True
    return False


def _names(node, nodes) -> FileSource:
    """The list of names a reader reads: a TensorSliceDataset of a constant, or unknown."""
    while node is not None and _is(node.op, _KEEP_NAMES):
        node = _input(node, nodes)
    if node is None or not _is(node.op, ("TensorSliceDataset",)):
        return FileSource(None)
    const = _input(node, nodes)
    if const is None or const.op != "Const":
        return FileSource(None)
    proto = const.attr["value"].tensor
    dims = [d.size for d in proto.tensor_shape.dim]
    if len(dims) != 1 or dims[0] < 0:
        return FileSource(None)
    try:  # strings in a serialized dataset graph are packed in tensor_content
        values = tf.io.parse_tensor(proto.SerializeToString(), tf.string).numpy().tolist()
        names = tuple(v.decode(errors="replace") for v in values)
    except (tf.errors.OpError, ValueError):
        names = ()
    return FileSource(dims[0], names)


# --- The choice ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a dataset is distributed: "file", "data" (tfstrat's slicing) or "off"."""

    mode: str
    reason: str


def choose(policy, source: FileSource | None, workers: int) -> Choice:
    """The sharding of a dataset with `policy` whose files are `source`, over `workers`.

    Raises:
        ValueError: FILE was asked for a dataset with no files, or with fewer than `workers`.
    """
    if policy == _Policy.DATA:
        return Choice("data", "the dataset asks for AutoShardPolicy.DATA")
    if policy == _Policy.OFF:
        return Choice("off", "the dataset asks for AutoShardPolicy.OFF")
    if policy == _Policy.FILE:
        if source is None:
            raise UsageError(
                "Received: a dataset with auto_shard_policy=AutoShardPolicy.FILE that reads no "
                "files TensorFlow can shard (no TFRecordDataset, TextLineDataset or "
                "FixedLengthRecordDataset fed by a list of names was found in it). Read the "
                "input with such a reader (e.g. tf.data.Dataset.list_files(pattern)."
                "interleave(tf.data.TFRecordDataset)), or set AutoShardPolicy.DATA (every "
                "worker reads everything and takes its slice of each global batch)."
            )
        if source.count is not None and source.count < workers:
            raise UsageError(_too_few(source.count, workers))
        counted = "an unknown number of" if source.count is None else f"{source.count}"
        return Choice("file", f"the dataset asks for AutoShardPolicy.FILE ({counted} files)")
    if source is None:
        return Choice("data", "the dataset reads no files")
    if source.count is None:
        return Choice(
            "data",
            "its list of files is computed in the pipeline (unknown before reading); set "
            "AutoShardPolicy.FILE on the dataset to shard it by file anyway",
        )
    if source.count < workers:
        return Choice(
            "data",
            f"it reads {source.count} file(s), fewer than the {workers} workers; write at "
            f"least {workers} files to shard by file",
        )
    return Choice("file", f"it reads {source.count} files, at least one per worker")


def _too_few(files: int, workers: int) -> str:
    return (
        f"Received: a dataset read from {files} file(s) with auto_shard_policy="
        f"AutoShardPolicy.FILE, for {workers} workers. Sharding by file gives each worker "
        f"whole files, so it needs at least {workers} files. Split the input into {workers} "
        "or more files (more files than workers also balances them better), or set "
        "AutoShardPolicy.DATA on the dataset (every worker reads every file and takes its "
        "slice of each global batch)."
    )


# --- The hook ------------------------------------------------------------------------------


def distribute(extended, dataset, options):
    """The dataset distributed by file (or unsharded), or None for tfstrat's slicing by data.

    The hook of `collective._Extended._distribute`: a multi-worker CollectiveAllReduce or
    Hybrid calls it first and slices by data when it returns None.

    Args:
        extended: the strategy's `_Extended` (a CollectiveAllReduceExtended).
        dataset: the `tf.data.Dataset` given to `fit` / `evaluate` / `predict`, batched with
            the global batch size.
        options: the `tf.distribute.InputOptions`, or None.

    Returns:
        A DistributedDataset from TensorFlow's multi-worker input path (re-batched to about
        global/W rows per worker and step, with its per-step check for exhausted input),
        or None.

    Raises:
        ValueError: the dataset asks for AutoShardPolicy.FILE and reads no files, or fewer
            files than workers.
    """
    workers = extended._num_workers
    per_replica = options is not None and (
        options.experimental_replication_mode == distribute_lib.InputReplicationMode.PER_REPLICA
    )
    if workers == 1 or per_replica or len(extended.worker_devices) != 1:
        return None  # `_distribute` hands these to TensorFlow as they are
    policy = dataset.options().experimental_distribute.auto_shard_policy
    source = None if policy in (_Policy.DATA, _Policy.OFF) else find_files(dataset)
    choice = choose(policy, source, workers)
    index = extended._id_in_cluster
    if choice.mode == "data":
        if source is not None:  # a dataset of files sliced by data: say why
            _log_once(f"tfstrat: input read from files, sharded by data: {choice.reason}")
        return None
    if choice.mode == "file":
        _log_once(_file_line(source, index, workers, choice.reason))
        if policy != _Policy.FILE:  # what TensorFlow does for AUTO, made explicit
            chosen = tf.data.Options()
            chosen.experimental_distribute.auto_shard_policy = _Policy.FILE
            dataset = dataset.with_options(chosen)
    else:
        _log_once(
            f"tfstrat: input not sharded ({choice.reason}): every worker trains on the "
            f"dataset it was given, each global batch re-batched into steps of about 1/"
            f"{workers} of it; give each worker its own data (e.g. dataset.shard("
            "strategy.num_workers, strategy.worker_index))"
        )
    # TensorFlow's path: re-batch, shard by the policy, check every step for exhausted input.
    return _cars.CollectiveAllReduceExtended._experimental_distribute_dataset(
        extended, dataset, options
    )


def _file_line(source: FileSource, index: int, workers: int, reason: str) -> str:
    share = ""
    if source.names:
        mine = source.names[index::workers]
        shown = ", ".join(mine[:3]) + (f", ... ({len(mine)} files)" if len(mine) > 3 else "")
        share = f" ({shown})"
    return (
        f"tfstrat: input sharded by file ({reason}): worker {index} of {workers} reads "
        f"files {index}, {index + workers}, ... of the list{share}; each global batch of its "
        f"own records is re-batched into steps of about 1/{workers} of it, and a per-step "
        "check lets workers whose files run out first train on empty batches until all are "
        "done. Not single-device training on the same global batches; set "
        "AutoShardPolicy.DATA on the dataset for that"
    )


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
