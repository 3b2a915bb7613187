"""Row-wise optimizer steps, written once for TensorFlow tensors and NumPy arrays.

tfstrat updates an embedding table's touched rows only, in two places: a Keras optimizer on a
worker or one device (`tfstrat.keras._rowwise`, TensorFlow ops) and Hybrid's table server on a
ps task (`tfstrat.ps.tables`, NumPy). Both gather the touched rows of the table's slots, call
one of these functions with the rows' deduplicated gradient, scatter the new slot rows back and
subtract the returned step from the table's rows. The arithmetic follows Keras 3's own
`update_step` term by term (same operations, same order), so for the touched rows SGD and
Adagrad give Keras's dense result, and the lazy variants give what Keras's formula gives for
those rows (rows outside the batch keep their slots and values: tf-keras's and TF1's sparse
behaviour, not Keras 3's dense one).

Each function takes `slots` (name -> the touched rows), the gradient rows `g`, the
hyper-parameters as scalars (Python floats where Keras uses them so, e.g. `1 - beta_1`, else
of the rows' dtype), and `sqrt`; it returns (new slot rows, step).
"""

from __future__ import annotations

# The slots each update keeps per row, by name (a ps task stores them under these names).
SLOTS = {
    "sgd": (),
    "sgd_momentum": ("momentum",),
    "adagrad": ("accumulator",),
    "adam": ("momentum", "velocity"),
    "rmsprop": ("velocity",),
    "rmsprop_momentum": ("velocity", "momentum"),
}


def sgd(slots, g, *, lr, **_):
    return {}, g * lr


def sgd_momentum(slots, g, *, lr, momentum, nesterov, **_):
    """Keras's SGD with momentum: m = m * momentum - g * lr; variable += m (or, Nesterov,
    += m * momentum - g * lr). Returned as a step to subtract."""
    m = slots["momentum"] * momentum - g * lr
    if nesterov:
        return {"momentum": m}, -(m * momentum - g * lr)
    return {"momentum": m}, -m


def adagrad(slots, g, *, lr, epsilon, sqrt, **_):
    accumulator = slots["accumulator"] + g * g
    return {"accumulator": accumulator}, (lr * g) / sqrt(accumulator + epsilon)


def adam(
    slots,
    g,
    *,
    lr,
    one_minus_beta_1,
    one_minus_beta_2,
    epsilon,
    beta_1_power,
    beta_2_power,
    sqrt,
    **_,
):
    """Keras's Adam (without amsgrad) for the rows: `beta_k_power` = beta_k ** (iterations + 1)
    in the rows' dtype; `one_minus_beta_k` = 1 - beta_k computed in Python (float64) first, as
    Keras does (in float32 it differs by 2e-7, which Adam's steps grow to 1e-5)."""
    alpha = lr * sqrt(1 - beta_2_power) / (1 - beta_1_power)
    m = slots["momentum"] + (g - slots["momentum"]) * one_minus_beta_1
    v = slots["velocity"] + (g * g - slots["velocity"]) * one_minus_beta_2
    return {"momentum": m, "velocity": v}, (m * alpha) / (sqrt(v) + epsilon)


def rmsprop(slots, g, *, lr, rho, one_minus_rho, epsilon, momentum, sqrt, **_):
    """Keras's RMSprop (not centered), with or without momentum (`one_minus_rho` as in `adam`)."""
    velocity = rho * slots["velocity"] + one_minus_rho * (g * g)
    increment = (lr * g) / sqrt(velocity + epsilon)
    if "momentum" not in slots:
        return {"velocity": velocity}, increment
    m = momentum * slots["momentum"] + increment
    return {"velocity": velocity, "momentum": m}, m


# Each step by the name its users pass around (rmsprop takes its momentum slot when present).
STEPS = {
    "sgd": sgd,
    "sgd_momentum": sgd_momentum,
    "adagrad": adagrad,
    "adam": adam,
    "rmsprop": rmsprop,
    "rmsprop_momentum": rmsprop,
}
