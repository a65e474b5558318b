"""Sharded checkpoints: the model and optimizer of a DDP, FSDP2 or tensor-parallel state
through torch.distributed.checkpoint (DCP) and fsspec, with the guarantees of the
single-process ones.

``steplib.checkpoint.save`` / ``load`` / ``AsyncSaver`` come here by themselves when the state's
model is DDP or FSDP2 or holds DTensor parameters (``apply_tp``, FSDP2 x TP) and a process
group is initialised; every rank must call them (they are collectives). A sharded checkpoint
is a directory like any other (same names, same listing, same retention), holding::

    step-00000120/
      dcp/.metadata, dcp/__0_0.distcp, ...  DCP: model and optimizer tensors; each rank writes
                                            its shard, replicated tensors are written once
      rank-00000.pt, rank-00001.pt, ...     torch.save, one per rank: that rank's train state
                                            (counters, window, scheduler, scaler, extras,
                                            RNG states, data position) and the non-tensor
                                            part of the model and optimizer state dicts
      manifest.json                         written last, by rank 0: size and checksum of every
                                            file above, the counters, and the world size

The commit is the one of ``storage`` (``save.py``): every rank writes into a staging directory
that rank 0 opened; once every rank has reported its files (with their checksums, computed while
they were written) rank 0 writes the manifest and renames the directory (or, on an object store,
the manifest written last is the commit). Every rank learns the outcome from rank 0, so all of
them return the same URL or raise the same error; none is left waiting in a collective.

Loading (``load.py``) goes through ``get_state_dict`` / ``set_state_dict`` of
``torch.distributed.checkpoint.state_dict``, whose parameter names are the same for DDP,
FSDP2 and a plain module, and DCP reshards: a checkpoint of 2 ranks loads into 1 rank, 4 ranks,
or a plain module in a process without a process group. On another world size, what belongs
to one rank cannot be mapped onto another: the RNG states are not restored, an open
accumulation window is refused (``ConfigError`` with the fix), and so is a data position,
unless it is a sharded loader's (``resumable_loader(..., shard=True)``): that one counts the
samples of all ranks, and the new ranks continue from it (``steplib.data.shards``).

Modules: ``layout`` (which states are sharded, the names of their files; no DCP import),
``save`` (gather, snapshot, write and commit), ``load``, and ``dcp_io`` (DCP's side: the
checksumming writer, the safe metadata reader, the tensor / plain split). DCP costs ~0.8 s to
import, which single-process users should not pay: only ``layout`` is imported by
``steplib.checkpoint`` itself, the rest when a sharded checkpoint is written or read.
"""
