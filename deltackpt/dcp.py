"""deltackpt as a ``torch.distributed.checkpoint`` storage layer: ``dcp.save(state_dict,
storage_writer=deltackpt.dcp.Writer(path, step=N))`` and ``dcp.load(state_dict,
storage_reader=deltackpt.dcp.Reader(path, step=N))`` (:mod:`deltackpt.integrations.dcp`)."""

from deltackpt.integrations.dcp import Reader, Writer

__all__ = ["Reader", "Writer"]
