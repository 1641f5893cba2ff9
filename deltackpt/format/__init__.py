"""The on-disk format (docs/FORMAT.md): step metadata and its validation, the tagged JSON of
non-tensor state, the dtypes a step can store, and a step's state in memory. Also the checks of
configuration values (:mod:`deltackpt.format.checks`), down here so that every layer above can
word the same kind of mistake the same way."""
