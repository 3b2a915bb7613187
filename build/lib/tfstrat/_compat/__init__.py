"""The one seam between tfstrat and the internals of TensorFlow and Keras.

Every `tensorflow.python` import is in `tf.py`, every `keras.src` import in `keras.py`, and
every change tfstrat makes to a Keras class or module goes through `patches.patch`, which
lists them (`patches.installed()`) and can undo them (`patches.remove_all()`). `versions.py`
names the TensorFlow and Keras releases these were written against; a strategy refuses to
start on others (`VersionError`), unless `TFSTRAT_ALLOW_UNSUPPORTED=1`.

When a new TensorFlow or Keras release comes out, the names to check are the ones imported in
`tf.py` and `keras.py` and the patched attributes `patches.installed()` lists after a run.
"""
