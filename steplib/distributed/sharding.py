"""``shard_check``: refuse a dataset or global batch that the ranks cannot share evenly,
when the data loader is built, instead of training on silently altered data.

Why it matters: ``DistributedSampler`` evens out a dataset that the world size does not divide
by *repeating* samples (``drop_last=False``, its default) or by dropping them
(``drop_last=True``). Repeated samples are counted twice in every epoch, so 2 ranks no longer
train on what 1 process would (law 6), and the duplicates change with the world size, so a
resharded resume sees other data. steplib refuses the silent repetition and asks for the
choice to be written down.
"""

from __future__ import annotations

from steplib.distributed.process_group import world_size as current_world_size
from steplib.errors import ConfigError, describe


def shard_check(
    dataset_len: int,
    *,
    world_size: int | None = None,
    global_batch_size: int | None = None,
    drop_last: bool = False,
) -> int:
    """Check that ``world_size`` ranks can share ``dataset_len`` samples; return the number of
    samples each rank gets per epoch.

    Call it where the ``DistributedSampler`` is built, with the same ``drop_last``.

    Args:
        dataset_len: the number of samples in the (map-style) dataset, ``len(dataset)``.
        world_size: the number of ranks; the current process group's when ``None`` (1
            without one).
        global_batch_size: if given, the samples of one optimizer step over all ranks
            (micro-batch size x ranks); it must split evenly across the ranks.
        drop_last: what you pass to ``DistributedSampler``: ``True`` drops the
            ``dataset_len % world_size`` last samples of each (shuffled) epoch, on purpose.

    Returns:
        Samples per rank and epoch: ``dataset_len // world_size`` (every rank the same).

    Raises:
        ConfigError: fewer samples than ranks; a world size that does not divide the dataset
            (without ``drop_last=True``); a global batch that does not split across the ranks.

    Example:
        >>> shard_check(512, world_size=2)
        256
        >>> shard_check(513, world_size=2, drop_last=True)  # one sample per epoch dropped
        256
        >>> try:
        ...     shard_check(513, world_size=2)
        ... except ConfigError as err:
        ...     print(str(err)[:59])
        shard_check: 513 samples do not split evenly across 2 ranks
    """
    for label, value, optional in (
        ("dataset_len", dataset_len, False),
        ("world_size", world_size, True),
    ):
        if not (optional and value is None) and (
            isinstance(value, bool) or not isinstance(value, int)
        ):
            raise ConfigError(
                f"shard_check({label}=...) received {describe(value)}; pass an int, e.g. "
                f"shard_check(len(dataset), world_size=steplib.distributed.world_size())."
            )
    ranks = current_world_size() if world_size is None else world_size
    if ranks < 1 or dataset_len < 0:
        raise ConfigError(
            f"shard_check received dataset_len={dataset_len} and world_size={ranks}; they "
            "must be >= 0 and >= 1. Pass len(dataset) and the number of processes."
        )
    if dataset_len < ranks:
        raise ConfigError(
            f"shard_check: {dataset_len} samples cannot be shared by {ranks} ranks: some "
            "rank would get no data and wait forever in the first gradient all-reduce. Use "
            f"at most {max(dataset_len, 1)} ranks, or a larger dataset."
        )
    left_over = dataset_len % ranks
    if left_over and not drop_last:
        keep = dataset_len - left_over
        raise ConfigError(
            f"shard_check: {dataset_len} samples do not split evenly across {ranks} ranks "
            f"({left_over} left over): DistributedSampler would repeat "
            f"{ranks - left_over} samples in every epoch to even the ranks out, so they would "
            "count twice and the ranks would not train on what one process would. Either "
            f"drop {left_over} per epoch on purpose: DistributedSampler(..., drop_last=True) "
            "and shard_check(..., drop_last=True); or trim the dataset to a multiple of "
            f"{ranks}: torch.utils.data.Subset(dataset, range({keep}))."
        )
    if global_batch_size is not None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
            raise ConfigError(
                f"shard_check(global_batch_size=...) received {describe(global_batch_size)}; "
                "pass an int (samples per optimizer step over all ranks), e.g. 256."
            )
        if global_batch_size < ranks or global_batch_size % ranks:
            per_rank = max(global_batch_size // ranks, 1)
            raise ConfigError(
                f"shard_check: a global batch of {global_batch_size} samples does not split "
                f"evenly across {ranks} ranks, so the ranks' batches would differ from one "
                "process's batch. Use a multiple of the world size, e.g. "
                f"global_batch_size={per_rank * ranks} ({per_rank} per rank)."
            )
    return dataset_len // ranks
