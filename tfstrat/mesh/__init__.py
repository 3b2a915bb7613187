"""Model parallelism: the device mesh, sharded variables, and the layers' computation on parts.

`layout` (the mesh and each variable's plan), `variables` (one part per device, the whole to
Keras), `collectives` (the model group's and the batch axis's exchanges) and `layers` (how each
layer computes on its parts). The strategy that uses them is
`tfstrat.strategies.model_parallel.ModelParallel`.
"""
