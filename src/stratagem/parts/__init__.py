"""Synchronisation parts: small objects that each take a :class:`~stratagem.comm.Comm` and do
one kind of synchronisation, from which strategies are assembled.

A strategy is "these parts, in this order" (see ``Strategy._build_parts``): ``Mirrored`` is
``[GradientSync]``, ``LocalSGD`` is ``[ParameterAveraging]``, ``DiLoCo`` is ``[OuterStep]``,
and ``Hierarchical`` puts its inner strategy's parts on a node's Comm and its outer
strategy's parts on a Comm across nodes. Each part is testable alone with a Comm of threads
(:func:`stratagem.testing.run_ranks`).
"""

from .averaging import ParameterAveraging
from .base import Part
from .elastic import ElasticExchange
from .grad_sync import GradientSync
from .outer import OuterStep
from .tensors import average_, dtype_groups, gather_ranks, load_rank, mean_copy, synced_tensors

__all__ = ["Part", "GradientSync", "ParameterAveraging", "OuterStep", "ElasticExchange", "average_", "mean_copy",
           "gather_ranks", "load_rank", "synced_tensors", "dtype_groups"]
