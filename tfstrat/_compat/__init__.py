"""The one seam between tfstrat and the internals of TensorFlow and Keras.

Every `tensorflow.python` import is in `tf.py`, every `keras.src` import in `keras.py`, and
every change tfstrat makes to a Keras class or module goes through `patches.patch`, which
lists them (`patches.installed()`) and can undo them (`patches.remove_all()`); `surface.py`
lists every patched Keras attribute with its signature. `versions.py` names the TensorFlow and
Keras releases tfstrat supports and the ones tested; a strategy refuses to start outside the
supported range or on a Keras whose patched attributes differ (`VersionError`), unless
`TFSTRAT_ALLOW_UNSUPPORTED=1`.

When a new TensorFlow or Keras release comes out, `scripts/test -m compat --pair
tf=X,keras=Y` runs the equivalence set on it; the names to check by hand are the ones
imported in `tf.py` and `keras.py`.
"""
