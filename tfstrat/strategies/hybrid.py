"""`Hybrid`: Parallax's split. Dense variables all-reduced, embedding tables on ps tasks.

Dense variables are mirrored on every worker and reduced exactly as in `CollectiveAllReduce`
(this class is one). As in Parallax, a variable goes by its gradient: every table whose gradient
is sparse, that is the table of any `keras.layers.Embedding` (or subclass, from any library)
read only by its lookup, goes to the ps tasks, split into parts, reached over RPC
(`tfstrat.keras._ps_tables`, `tfstrat.ps.tables`, `tfstrat.ps.remote`): a step moves only the
rows its batch touches, each worker sums its rows per id before sending, and the ps updates only
those rows and their optimizer slots. A table with a dense gradient (a regularizer, tied
weights) stays mirrored, and a line says why. Without ps tasks every table stays mirrored and
its gradient goes through the deduplicated sparse all-gather, so `Hybrid()` works on any
cluster and on one machine.
"""

from __future__ import annotations

import fnmatch
import logging
import weakref

import numpy as np
import tensorflow as tf

from tfstrat.cluster import TFConfig
from tfstrat.cluster import ports as _ports
from tfstrat.errors import UsageError
from tfstrat.strategies.collective import DEFAULT_TIMEOUT, CollectiveAllReduce, _env_config

logger = logging.getLogger(__name__)


def _without_ps(tf_config: TFConfig) -> TFConfig:
    cluster = {job: list(a) for job, a in tf_config.cluster.items() if job != "ps"}
    return TFConfig(cluster, tf_config.task_type, tf_config.task_index, tf_config.rpc_layer)


class Hybrid(CollectiveAllReduce):
    """Dense variables all-reduced among the workers; embedding tables on the ps tasks.

    Args:
        tf_config: the cluster; None reads `TF_CONFIG`. ps tasks are optional.
        sparse: which embedding tables go to the ps tasks: "auto" (every table whose gradient
            is sparse), or a list of patterns (fnmatch, matched against the layer's name and
            its table's path, e.g. ["*item*"]); a pattern that starts with "!" keeps the
            tables it matches mirrored (["!*position*"]: every table but those); [] keeps every
            table mirrored.
        partitions: parts per table on the ps tasks: "auto" (the chief times a few counts at
            start-up and fits Parallax's step-time model, `tfstrat.ps.partitions`) or an
            integer.
        sparse_as_dense: for mirrored tables, as in `CollectiveAllReduce`.
        timeout: seconds any collective or RPC may take before failing with an error.
        devices, communication, compression: as in `CollectiveAllReduce` (compression applies
            to the mirrored variables' gradients; the tables on ps tasks get their rows exactly).

    Tables on ps tasks are updated row by row (`tfstrat.ps.rowmath`): SGD and Adagrad exactly as
    Keras's dense update of the same gradient; Adam, SGD with momentum and RMSprop lazily (rows
    outside the batch keep their slots), as a mirrored table with `sparse_updates="lazy"`;
    weight decay (AdamW) decays every row exactly as Keras does, each row when it is next read.
    Other optimizers, and clipping, accumulation or EMA that would not reach the tables, are
    refused at the first step; `sparse=[]` keeps every table mirrored.
    """

    def __init__(
        self,
        tf_config: TFConfig | None = None,
        *,
        sparse: str | list[str] = "auto",
        partitions: str | int = "auto",
        sparse_as_dense: str | float | bool = "auto",
        timeout: float = DEFAULT_TIMEOUT,
        devices=None,
        communication: str = "auto",
        compression=None,
    ):
        tf_config = tf_config if tf_config is not None else _env_config()
        if tf_config is not None:
            tf_config.require_task("Hybrid")
        ps = tuple(tf_config.addresses("ps")) if tf_config is not None else ()
        if tf_config is not None and tf_config.task_type == "ps":
            from tfstrat.ps.server import serve_until_workers_exit

            serve_until_workers_exit(tf_config)  # does not return
        if sparse != "auto" and not (
            isinstance(sparse, (list, tuple)) and all(isinstance(p, str) for p in sparse)
        ):
            raise UsageError(
                f"Received: sparse={sparse!r}. Use 'auto' or a list of name patterns "
                "(e.g. ['*item*'], or ['!*position*'] for every table but those)."
            )
        if partitions != "auto" and not (isinstance(partitions, int) and partitions >= 1):
            raise UsageError(f"Received: partitions={partitions!r}. Use 'auto' or an integer >= 1.")
        super().__init__(
            _without_ps(tf_config) if ps else tf_config,
            devices=devices,
            communication=communication,
            sparse_as_dense=sparse_as_dense,
            timeout=timeout,
            compression=compression,
            _agree_on={"ps": list(ps), "sparse": sparse, "partitions": partitions},
        )
        self.ps_addresses = ps
        self.sparse = sparse
        self.partitions = partitions
        self.timeout = timeout
        self.tables: dict[str, object] = {}
        self.mirrored_why: dict[str, str] = {}  # table path -> why it stays on the workers
        self._clients = None
        self._optimizer = None
        self._next_table = 0
        self._next_meta = 0
        self._warned: set[str] = set()
        if ps:
            from tfstrat.keras import _ps_tables
            from tfstrat.ps.connect import wait_for_ps
            from tfstrat.ps.remote import TableClients

            _ps_tables.install()
            wait_for_ps(tf_config, timeout, port_offset=_ports.offset())  # table servers
            self._clients = TableClients(ps, timeout, self.worker_index)
            self._begin_run()
        logger.info(
            "tfstrat: Hybrid, %d ps task(s): %s; one line per embedding table at the first step",
            len(ps),
            f"every embedding table whose gradient is sparse on the ps tasks (sparse={sparse!r}), "
            "every other variable mirrored"
            if ps
            else "every variable mirrored",
        )

    def _begin_run(self):
        """Tells every ps that this run begins, with an id the workers agree on (the chief's
        random bytes): a ps that outlived an earlier run of the job (its workers relaunched,
        the ps not) drops that run's tables and a failed step's pushes, as a new ps starts."""
        import os

        mine = os.urandom(16)
        run = mine if self.extended._num_workers == 1 else self._all_gather_bytes(mine)[0]
        self._clients.call_all(
            [(i, "begin", (np.frombuffer(run, np.uint8),)) for i in range(len(self.ps_addresses))]
        )

    # -- tables --------------------------------------------------------------------------

    def _mirrored_because(self, layer, path: str) -> str | None:
        """Why `layer`'s table stays on the workers, or None to hold it on the ps tasks."""
        if not self.ps_addresses:
            return "no ps tasks in TF_CONFIG"
        if self.sparse != "auto":
            names = (layer.name, path)
            take = [p for p in self.sparse if not p.startswith("!")]
            drop = [p[1:] for p in self.sparse if p.startswith("!")]
            if any(fnmatch.fnmatch(n, p) for n in names for p in drop):
                return f"sparse={self.sparse!r} excludes it"
            if (take or not drop) and not any(fnmatch.fnmatch(n, p) for n in names for p in take):
                return f"sparse={self.sparse!r} does not name it"
        if layer.embeddings_regularizer is not None:
            name = type(layer.embeddings_regularizer).__name__
            return f"embeddings_regularizer={name} gives every row a gradient"
        if layer.embeddings_constraint is not None:
            name = type(layer.embeddings_constraint).__name__
            return f"embeddings_constraint={name} applies to every row after each step"
        return None

    def remote_table(self, layer):
        """A table on the ps tasks for `layer` (a Keras Embedding being built), or None to
        mirror it (`mirrored_why` says why)."""
        from tfstrat.keras._ps_tables import table_path

        path = table_path(layer)
        why = self._mirrored_because(layer, path)
        if why is not None:
            self.mirrored_why[path] = why
            return None
        from tfstrat.ps.remote import RemoteTable

        if self.partitions == "auto":
            parts = self._choose_partitions(layer)
        else:
            parts = max(1, min(int(self.partitions), layer.input_dim))
        layout = self._layout(layer.input_dim, parts, self._next_table)
        self._next_table += parts
        initializer = layer.embeddings_initializer
        import keras

        init = {
            "initializer": keras.initializers.serialize(initializer),
            "seed": getattr(initializer, "seed", None),
            "timeout": self.timeout,
        }
        if not isinstance(init["seed"], (int, type(None))):
            init["seed"] = None
        table = RemoteTable(
            self._clients,
            layer.name,
            layer.input_dim,
            layer.output_dim,
            layout,
            self.num_replicas_in_sync,
            init,
            local=len(self.extended.worker_devices),
        )
        self.tables[path] = table  # a later model's table of the same path replaces it here
        logger.info(
            "tfstrat: table %s (%d x %d) on ps %s in %d part(s)",
            path,
            layer.input_dim,
            layer.output_dim,
            sorted({ps for ps, *_ in layout}),
            parts,
        )
        return table

    def mirror_table(self, layer, why: str) -> None:
        """Forgets `layer`'s ps-held table (it comes back to the workers, `_ps_tables.mirror`)."""
        from tfstrat.keras._ps_tables import remote, table_path

        held = remote(layer)
        for key in [k for k, t in self.tables.items() if t is held]:
            del self.tables[key]
        held.drop(self.num_workers)  # every worker process drops it; the last one frees it
        self.mirrored_why[table_path(layer)] = why

    def _layout(self, rows: int, parts: int, first: int):
        """(ps task, table number, first row, end row) of each part; parts go round-robin."""
        from tfstrat.keras.layers import part_bounds

        num_ps = len(self.ps_addresses)
        bounds = part_bounds(rows, parts)
        return [((first + k) % num_ps, first + k, lo, hi) for k, (lo, hi) in enumerate(bounds)]

    def _choose_partitions(self, layer) -> int:
        """Parallax's search (`tfstrat.ps.partitions`), run by the chief, read by the others."""
        from tfstrat.ps import partitions
        from tfstrat.ps.remote import RemoteTable

        key = self._next_meta  # tables are made in the same order on every worker
        self._next_meta += 1
        rows, dim = layer.input_dim, layer.output_dim
        if self.worker_index != 0:
            return self._clients.wait_meta(key, self.timeout, f"the partitions of {layer.name}")

        def trial_table(parts, first):
            layout = self._layout(rows, parts, first)
            init = {"zeros": True, "timeout": self.timeout}
            return RemoteTable(self._clients, "trial", rows, dim, layout, 1, init)

        samples = partitions.measure(trial_table, rows, dim)
        chosen = partitions.best(samples, max(samples))
        b, a, c = partitions.fit(samples)
        logger.info(
            "tfstrat: table %s: %d part(s), from step times %s ms (fit t(P) = b/P + a(P-1) + c: "
            "b %.2f ms, a %.2f ms, c %.2f ms)",
            layer.name,
            chosen,
            {p: round(t * 1000, 2) for p, t in samples.items()},
            b * 1000,
            a * 1000,
            c * 1000,
        )
        self._clients.put_meta(key, chosen)
        return chosen

    def table_step(self):
        """The step number a table push carries: the optimizer's iteration counter."""
        if self._optimizer is None:
            return tf.constant(0, tf.int64)
        return tf.cast(self._optimizer.iterations, tf.int64)

    def table_hyper(self, decays: bool = False):
        """The optimizer numbers a push carries; `decays`: whether weight decay reaches the table."""
        from tfstrat.ps.remote import optimizer_hyper

        if self._optimizer is None:
            raise UsageError(
                "Received: a ps-held embedding table trained with no optimizer made in "
                "tfstrat.Hybrid's scope. A table on the ps is updated as its rows' gradient "
                "is computed, with its optimizer's settings and step: create the optimizer "
                "in `strategy.scope()` before the first step (as TensorFlow's custom-loop "
                "tutorials do), or keep the table mirrored: Hybrid(sparse=[])."
            )
        return optimizer_hyper(self._optimizer, decays)

    # -- custom training loops (`_custom_loops`) ------------------------------------------

    _made = ()  # weak references to the optimizers made in the scope, oldest first

    def _tfstrat_note_optimizer(self, optimizer) -> None:
        """An optimizer made in this strategy's scope: a custom loop's tables train with the
        latest one still alive (`fit` names its model's)."""
        alive = [ref for ref in self._made if ref() is not None]
        self._made = (*alive, weakref.ref(optimizer))

    def _tfstrat_check_apply(self, optimizer, variables) -> None:
        """Refuses an optimizer stepping a ps-held table that was pushed with another's settings."""
        if not self.ps_addresses:
            return
        variables = variables if variables is not None else optimizer._trainable_variables
        tables = [v.path for v in variables if hasattr(v, "_tfstrat_table")]
        pushed = self._optimizer
        if not tables or optimizer is pushed or optimizer is getattr(pushed, "inner_optimizer", 0):
            return
        raise UsageError(
            f"Received: optimizer {optimizer.name!r} applying gradients to {tables[0]}, a "
            "table tfstrat.Hybrid holds on the ps tasks, whose rows were pushed with "
            f"optimizer {getattr(pushed, 'name', None)!r}'s settings (the latest made in the "
            "strategy's scope and still alive). Create the loop's optimizer last, train the "
            "tables with one optimizer, or keep the table mirrored: Hybrid(sparse=[])."
        )

    def placement(self) -> dict[str, list[str]]:
        """Where each ps-held table lives (its parts' ps devices), by the table's path (the
        latest model's, when several have one of the same path)."""
        return {path: table.devices for path, table in self.tables.items()}

    # -- steps --------------------------------------------------------------------------

    def run(self, fn, args=(), kwargs=None, options=None):
        optimizer = getattr(getattr(fn, "__self__", None), "optimizer", None)
        if optimizer is None:  # a custom loop's step: the latest optimizer still alive
            alive = [o for o in (ref() for ref in self._made) if o is not None]
            if alive:
                self._optimizer = alive[-1]
        else:  # fit's (its model's optimizer; hooked once, with the model it reports)
            self._optimizer = optimizer
            self._warn_sparse_dense(optimizer, getattr(fn, "__self__", None))
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _warn_sparse_dense(self, optimizer, model=None):
        """At the first step: one line per embedding table (where it lives, how its gradient is
        reduced, why; `_tables_report`), and one warning per other mirrored variable whose
        gradient is sparse (still reduced sparsely)."""
        if getattr(optimizer, "_tfstrat_hybrid", False):
            return
        optimizer._tfstrat_hybrid = True
        apply = optimizer.apply

        def checked(grads, trainable_variables=None):
            variables = trainable_variables or optimizer._trainable_variables
            reported = self._report_tables(model, grads, variables)
            for g, v in zip(grads, variables):
                expected = v.path in self.mirrored_why or v.path in reported
                if isinstance(g, tf.IndexedSlices) and not expected and v.path not in self._warned:
                    self._warned.add(v.path)
                    logger.warning(
                        "tfstrat: %s is mirrored but its gradient is sparse: it is reduced "
                        "sparsely (deduplicated all-gather). Hybrid holds on the ps tasks the "
                        "tables of Keras Embedding layers (and their subclasses); this variable "
                        "is read by another layer%s.",
                        v.path,
                        "" if self.ps_addresses else ", and there are no ps tasks",
                    )
            return apply(grads, trainable_variables)

        optimizer.apply = checked

    def _report_tables(self, model, grads, variables) -> set[str]:
        """Logs `_tables_report.lines` once per model (the chief); the reported paths."""
        from tfstrat.strategies import _tables_report

        if model is None:
            return set()
        by_path = {v.path: g for g, v in zip(grads, variables)}
        lines, paths = _tables_report.lines(self, model, by_path)
        if self.worker_index == 0 and not getattr(model, "_tfstrat_tables_reported", False):
            model._tfstrat_tables_reported = True
            for line in lines:
                mirrored = "mirrored on every worker" in line
                log = logger.warning if mirrored and self.ps_addresses else logger.info
                log("%s", line)
        return paths
