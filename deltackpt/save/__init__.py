"""The path of a save, which only runs downward: capture, snapshot, queue, then the driver
(plan, encode and write, commit), advancing the writer's reference."""
