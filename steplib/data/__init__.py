"""Data: loaders whose position is part of a checkpoint (``resumable_loader``; with
``shard=True`` a position that resumes on another number of ranks, ``shards``), and moving a
batch to the model's device (``to_device``); several loaders side by side (``Zipped``)."""

from steplib.data.device import on_model_device, to_device
from steplib.data.loader import ResumableLoader
from steplib.data.resumable import resumable_loader
from steplib.data.shards import ShardedSampler, check_new_world
from steplib.data.zipped import Zipped

__all__ = [
    "ResumableLoader",
    "ShardedSampler",
    "Zipped",
    "check_new_world",
    "on_model_device",
    "resumable_loader",
    "to_device",
]
