"""torch.distributed: the ranks of a run and their collectives, and which shard of each tensor
a rank writes and loads."""
