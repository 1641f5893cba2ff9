"""What a save stores: the compression policy (presets, :class:`Quantizer`, ``target_ratio``),
what optimizer state means, and the encoder of a step (full or delta, on the host or a device)
with its running reconstruction."""
