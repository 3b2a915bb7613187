"""Every private Keras name tfstrat uses (`keras.src`), imported here only (Keras 3.15).

What each is for:
- `TensorFlowTrainer`: the train/test/predict functions (`_make_function`, XLA) and the
  symbolic build (`_maybe_symbolic_build`) tfstrat wraps.
- `CallbackList`, `EpochIterator`, `ArrayDataAdapter`, `array_slicing`: the fit loop's epoch
  hooks, the array input's shuffle (seeded per epoch) and resume in the middle of an epoch.
- `loss_module`: `scale_loss_for_distribution`, the loss scaling per replica.
- `BaseOptimizer`: `build`, for LocalSGD's outer optimizer state.
- `saving_api`: `save_model` / `save_weights`, wrapped for multi-worker saves.
- `KerasSaveable`: the base of objects Keras saves (tfstrat's ps-held tables).
- `tree`, `pythonify_logs`: Keras's structure utilities and log conversion.
- `in_symbolic_scope`: whether Keras is building a model symbolically (a ps-held table read
  whole then comes back to the workers, `tfstrat.keras._ps_tables`).
"""

from keras.src import tree  # noqa: F401
from keras.src.backend.common.symbolic_scope import in_symbolic_scope  # noqa: F401
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer, TFEpochIterator  # noqa: F401
from keras.src.callbacks.callback_list import CallbackList  # noqa: F401
from keras.src.losses import loss as loss_module  # noqa: F401
from keras.src.optimizers.base_optimizer import BaseOptimizer  # noqa: F401
from keras.src.saving import saving_api  # noqa: F401
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: F401
from keras.src.trainers.data_adapters import array_slicing  # noqa: F401
from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter  # noqa: F401
from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: F401
from keras.src.utils.python_utils import pythonify_logs  # noqa: F401
