"""The on-disk format (docs/FORMAT.md): step metadata and its validation, the tagged JSON of
non-tensor state, the dtypes a step can store, and a step's state in memory."""
