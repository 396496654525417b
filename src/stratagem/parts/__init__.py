"""Synchronisation parts: small objects that each take a :class:`~stratagem.comm.Comm` and do
one kind of synchronisation, from which every strategy is assembled.

A strategy is "these parts, in this order" (its ``plan()``): ``Mirrored`` is
``Plan(GradientSync.spec(...))``, ``LocalSGD`` ``ParameterAveraging``, ``DiLoCo``
``OuterStep``, ``ElasticAveraging`` ``ElasticAveragingPart`` (``ElasticExchange`` as
``Hierarchical``'s outer layer), ``ParameterServer`` a parameter-server link, and
``Hierarchical`` a :class:`NodePlan` of an inner plan on a node's Comm and an outer plan
across nodes. A strategy's capabilities are its parts' (:class:`Capability`). Each part is
testable alone with a Comm of threads (:func:`stratagem.testing.run_ranks`).
``stratagem.parts.fsdp.FSDPSharding`` (FSDP2) is imported from its module: torch's FSDP
modules cost most of a second to import, which no other strategy should pay.
"""

from .averaging import ParameterAveraging
from .base import Capability, Part, PartSpec
from .easgd import ElasticAveragingPart
from .elastic import ElasticExchange
from .grad_sync import GradientSync
from .outer import OuterStep
from .plan import NodePlan, Plan
from .runner import Parts
from .tensors import average_, dtype_groups, gather_ranks, load_rank, mean_copy, synced_tensors

__all__ = ["Part", "PartSpec", "Capability", "Plan", "NodePlan", "Parts", "GradientSync",
           "ParameterAveraging", "OuterStep", "ElasticExchange", "ElasticAveragingPart",
           "average_", "mean_copy", "gather_ranks", "load_rank", "synced_tensors",
           "dtype_groups"]
