"""The path of a save, which only runs downward.

A save runs capture -> snapshot -> (queue) -> plan -> encode -> write ->
commit:

1. **capture** (:func:`deltackpt.save.capture.capture`, on the caller's thread):
   the model, optimizer, RNG states and ``extra`` as named tensors and a
   JSON tree, without copying tensor data.
2. **snapshot** (:mod:`deltackpt.save.snapshot`, on the caller's thread, for
   ``save(..., blocking=False)``): every tensor copied into host buffers
   that training never touches; the caller returns once they are taken.
   A delta of CUDA tensors is planned and encoded on their device first,
   by the call, once the saves in flight ended, on every rank
   (:func:`deltackpt.save.driver.encode_at_call`): only the tensors it stores
   exactly are snapshotted, and only coded bytes cross to the host.
3. **queue** (:mod:`deltackpt.save.queue`): a ``SaveQueue`` hands the save to one
   background thread. Saves run one after another in the order they were
   made, each planned once the one before it is committed or failed, so a
   delta is always coded against what a reader of its base decodes. A
   blocking save skips the snapshot and the queue, and runs the next
   stages on the caller's thread once the saves in flight ended.
4. **plan, encode and write, commit** (:func:`deltackpt.save.driver.save_step`),
   the same for one process and for the ranks of a torch.distributed run
   (a single process is a group of one rank): the plan takes the rank's
   layout (:func:`deltackpt.dist.shards.shard_parts`) and chooses the base,
   full or delta against the last committed reconstruction, agreed by every
   rank; each rank encodes its boxes (:class:`deltackpt.encode.encoder.StepEncoder`)
   and writes them on the manager's encoding threads
   (:func:`deltackpt.io.writer.write_data`); rank 0 commits what every rank
   wrote (:func:`deltackpt.io.writer.commit_step`), and the reconstruction of
   the committed step becomes the base of the next delta
   (:class:`deltackpt.save.reference.Reference`). Under torch.distributed
   the save thread of every rank runs the save's collectives on a gloo group
   of their own (:meth:`deltackpt.dist.group.Group.background`).
5. **after the commit**, once the driver has returned, the manager uploads
   the step from its cache and applies its retention policy.

The driver receives what it reads and advances (:class:`deltackpt.save.driver.Writer`)
and imports nothing above this package.
"""
