"""Reading steps back: the restore chain, the universal checkpoint it gives, and loading it into
live objects."""
