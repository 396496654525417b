"""A replacement's replica id (``FaultTolerantComm._replica_id``): its predecessor's exact id,
so the Lighthouse counts the slot as live and joined as soon as the replacement asks, unless
the predecessor died with a quorum request outstanding (then a fresh id, as torchft does)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

pytest.importorskip("torchft")

from stratagem.ft.comm import FaultTolerantComm  # noqa: E402
from stratagem.ft.membership import MemberKey  # noqa: E402

KEY = MemberKey(b"k" * 32)


def _comm(store: dist.Store, slot: int = 3) -> SimpleNamespace:
    return SimpleNamespace(_job_store=store, _id_key=f"ft/id/{slot}",
                           _asking_key=f"ft/asking/{slot}", _keeps_id=True, _key=KEY)


def _replica_id(store: dist.Store, joining: bool) -> str:
    return FaultTolerantComm._replica_id(_comm(store), 3, joining)  # type: ignore[arg-type]


def _asking(store: dist.Store, value: str) -> None:
    FaultTolerantComm._asking(_comm(store), value)  # type: ignore[arg-type]


def test_a_first_process_takes_a_fresh_id_and_its_replacement_takes_it_over() -> None:
    store = dist.HashStore()
    first = _replica_id(store, joining=False)
    assert first.startswith("slot3:") and len(first) > len("slot3:")
    assert _replica_id(dist.HashStore(), joining=False) != first  # fresh each job
    _asking(store, "1")
    _asking(store, "0")  # the quorum answered: nothing of it left in the Lighthouse
    assert _replica_id(store, joining=True) == first
    assert _replica_id(store, joining=True) == first  # and the next replacement too


def test_a_predecessor_that_died_asking_for_a_quorum_is_not_impersonated() -> None:
    store = dist.HashStore()
    first = _replica_id(store, joining=False)
    _asking(store, "1")  # died before the Lighthouse answered
    second = _replica_id(store, joining=True)
    assert second != first and second.startswith("slot3:")
    # The fresh id is now the slot's: a later replacement (its predecessor answered) keeps it.
    _asking(store, "0")
    assert _replica_id(store, joining=True) == second


def test_ids_carry_the_secret_s_tag_and_a_planted_id_is_not_taken_over() -> None:
    """The job's store is not authenticated: an id another process wrote there without the
    secret's tag is not the predecessor's; the replacement takes a fresh (tagged) one."""
    store = dist.HashStore()
    first = _replica_id(store, joining=False)
    assert KEY.id_ok(first)
    store.set("ft/id/3", "slot3:planted")
    _asking(store, "0")
    second = _replica_id(store, joining=True)
    assert second != "slot3:planted" and KEY.id_ok(second)


def test_a_joiner_without_a_recorded_id_takes_a_fresh_one() -> None:
    store = dist.HashStore()
    fresh = _replica_id(store, joining=True)
    assert fresh.startswith("slot3:")
    assert _replica_id(store, joining=True) == fresh
