"""Membership that proves itself: each quorum member's proof of the job's secret.

torchft's quorum protocol carries, for every member, the reconfigure handle of each of its
processes (a JSON string its process group makes before each quorum request). stratagem's
process group (:func:`stratagem.ft.upstream.bound_gloo_group`) writes into that handle a
*member claim* (the replica id, its manager server's address, its store's address, its
step, its group size and this process's place in it) and a *proof*: an HMAC-SHA256 of the
claim and the handle, under a key derived from the job's secret. Nothing else needs to
change in torchft's messages.

Two places check proofs, both with :class:`MemberKey`:

- the quorum service (:class:`stratagem.ft.quorum.VerifiedQuorumService`) admits a quorum
  request only when every handle of the member proves the secret and its claim is what the
  member's request says (:meth:`MemberKey.admit`); a refused request never enters a quorum;
- each replica checks the quorum it is given (:meth:`MemberKey.check_quorum`) before it
  touches any address in it: every member must have a verified handle, and the addresses it
  is asked to use (the quorum's store, the peer it heals from) must be ones a verified member
  claimed. A quorum with an unverified member is refused with
  :class:`UnverifiedMemberError` naming it.

A proof binds a member's claim, so a copy of it replayed by a process without the secret can
only repeat a genuine member's own request (same id, addresses and step), never name an
address of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from ..errors import StratagemError


def labelled_mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 under ``key`` of ``label``, a zero byte and ``parts`` one after the other:
    the one proof every authenticated channel of fault tolerance uses (the members-only store
    and the heal transport), the label keeping one channel's proofs from serving another."""
    return hmac.new(key, label + b"\0" + b"".join(parts), hashlib.sha256).digest()

__all__ = ["MemberKey", "UnverifiedMemberError", "MAX_HANDLE_BYTES", "MAX_ID_CHARS", "PROOF_LABEL",
           "labelled_mac"]

#: The longest reconfigure handle (bytes) a member may send; torchft's are ~100 bytes.
MAX_HANDLE_BYTES = 4096
#: The longest replica id (characters) the quorum service accepts.
MAX_ID_CHARS = 256
#: Separates these proofs from every other use of the job's secret (the heal transport's).
PROOF_LABEL = b"stratagem-ft-member-v1"
_CLAIM_FIELDS = ("replica_id", "address", "store_address", "step", "world_size", "group_rank")


class UnverifiedMemberError(StratagemError):
    """A quorum (or quorum request) holds a member that does not prove the job's secret."""

    def __init__(self, message: str, *, member: str = "") -> None:
        super().__init__(message)
        self.member = member


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


class MemberKey:
    """The proof key of a job: derived from its secret ``token`` (never the token itself)."""

    def __init__(self, token: bytes) -> None:
        if not isinstance(token, (bytes, bytearray)) or len(token) < 16:
            raise ValueError("the job secret must be at least 16 bytes. Fix: let the launcher "
                             "make it, or give --ft-token-file a file of 32+ random bytes")
        self._key = hmac.new(bytes(token), PROOF_LABEL, hashlib.sha256).digest()

    def derive(self, label: str) -> str:
        """A hex string only holders of the secret can compute (e.g. a store key prefix)."""
        return hmac.new(self._key, b"derive\0" + label.encode(), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ replica ids
    def replica_id(self, base: str) -> str:
        """``base`` with a tag only holders of the secret can make: the quorum service
        counts heartbeats of tagged ids only, so a process without the secret cannot make
        the replicas wait for members that do not exist."""
        if "~" in base or len(base) > MAX_ID_CHARS - 33:
            raise ValueError(f"a replica id base of at most {MAX_ID_CHARS - 33} characters "
                             f"without '~', got {base[:80]!r}")
        return f"{base}~{self.derive('id|' + base)[:32]}"

    def id_ok(self, replica_id: Any) -> bool:
        """Whether ``replica_id`` carries a valid tag (:meth:`replica_id`)."""
        if not isinstance(replica_id, str) or len(replica_id) > MAX_ID_CHARS:
            return False
        base, sep, tag = replica_id.rpartition("~")
        return bool(sep) and hmac.compare_digest(tag.encode(),
                                                 self.derive("id|" + base)[:32].encode())

    def _mac(self, body: dict[str, Any]) -> str:
        return hmac.new(self._key, _canonical(body), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ making a handle
    def sign(self, handle: dict[str, Any], claim: dict[str, Any]) -> str:
        """``handle`` (torchft's reconfigure handle, a dict) with ``claim`` and its proof, as
        the JSON string torchft carries."""
        missing = [k for k in _CLAIM_FIELDS if k not in claim]
        if missing:
            raise ValueError(f"a member claim needs {missing}")
        body = {**handle, "member": {k: claim[k] for k in _CLAIM_FIELDS}}
        body.pop("proof", None)
        text = json.dumps({**body, "proof": self._mac(body)})
        if len(text) > MAX_HANDLE_BYTES:
            raise ValueError(f"a reconfigure handle of {len(text)} bytes is over "
                             f"{MAX_HANDLE_BYTES}")
        return text

    # ------------------------------------------------------------------ checking
    def open(self, handle: Any) -> dict[str, Any]:
        """The verified handle (a dict with ``member``), or :class:`UnverifiedMemberError`.
        Bounded: at most :data:`MAX_HANDLE_BYTES`, parsed only as strict JSON."""
        if not isinstance(handle, str) or len(handle) > MAX_HANDLE_BYTES:
            raise UnverifiedMemberError("a reconfigure handle that is not a string of at most "
                                        f"{MAX_HANDLE_BYTES} bytes")
        try:
            body = json.loads(handle, parse_constant=_no_constant)
        except ValueError as exc:
            raise UnverifiedMemberError(f"a reconfigure handle that is not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise UnverifiedMemberError("a reconfigure handle that is not a JSON object")
        proof = body.pop("proof", None)
        member = body.get("member")
        if not isinstance(proof, str) or not isinstance(member, dict):
            raise UnverifiedMemberError("a reconfigure handle without a member proof (a process "
                                        "that does not hold the job's secret)")
        if not hmac.compare_digest(proof.encode(), self._mac(body).encode()):
            raise UnverifiedMemberError(
                f"member {str(member.get('replica_id'))[:80]!r}: its proof does not match the "
                "job's secret", member=str(member.get("replica_id"))[:80])
        if set(member) != set(_CLAIM_FIELDS):
            raise UnverifiedMemberError("a member claim with unexpected fields")
        return {**body, "proof": proof}

    def admit(self, *, replica_id: str, address: str, store_address: str, step: int,
              world_size: int, handles: list[str]) -> list[dict[str, Any]]:
        """The quorum service's check of one quorum request: every process of the member
        (``world_size`` handles, group ranks ``0..world_size-1`` once each) proves the secret
        and claims exactly this id, these addresses and this step. Returns the handles."""
        if not 1 <= world_size <= 4096 or len(handles) != world_size:
            raise UnverifiedMemberError(
                f"member {replica_id[:80]!r}: {len(handles)} handles for a group of "
                f"{world_size}", member=replica_id[:80])
        if not self.id_ok(replica_id):
            raise UnverifiedMemberError(f"member {replica_id[:80]!r}: its id carries no valid "
                                        "tag", member=replica_id[:80])
        opened = [self.open(h) for h in handles]
        want = {"replica_id": replica_id, "address": address, "store_address": store_address,
                "step": step, "world_size": world_size}
        ranks = []
        for h in opened:
            claim = h["member"]
            wrong = [k for k, v in want.items() if claim.get(k) != v]
            if wrong:
                raise UnverifiedMemberError(
                    f"member {replica_id[:80]!r}: its proof claims other {', '.join(wrong)} "
                    "than its request", member=replica_id[:80])
            ranks.append(claim["group_rank"])
        if sorted(ranks) != list(range(world_size)):
            raise UnverifiedMemberError(f"member {replica_id[:80]!r}: group ranks {ranks}",
                                        member=replica_id[:80])
        return opened

    def check_quorum(self, *, replica_ids: list[str], handles: list[str],
                     store_address: str = "", recover_src: str = "") -> list[dict[str, Any]]:
        """A replica's check of the quorum it was given, before it touches any address in
        it: every handle proves the secret and belongs to a member of ``replica_ids``, every
        member has one, and ``store_address`` / ``recover_src`` (when set) are addresses a
        verified member claimed. Raises :class:`UnverifiedMemberError` naming the member."""
        opened = []
        for handle in handles:
            try:
                opened.append(self.open(handle))
            except UnverifiedMemberError as exc:
                raise UnverifiedMemberError(
                    f"refusing a quorum with an unverified member: {exc}. Every member must "
                    "hold the job's secret; a process without it cannot join",
                    member=exc.member) from None
        claimed = {h["member"]["replica_id"] for h in opened}
        for rid in replica_ids:
            if rid not in claimed:
                raise UnverifiedMemberError(
                    f"refusing a quorum with an unverified member {rid[:80]!r}: none of its "
                    "processes proved the job's secret", member=rid[:80])
        stray = claimed - set(replica_ids)
        if stray:
            rid = sorted(stray)[0]
            raise UnverifiedMemberError(
                f"refusing a quorum whose handles name {rid[:80]!r}, which is not one of its "
                "members", member=rid[:80])
        if store_address and store_address not in {h["member"]["store_address"]
                                                   for h in opened}:
            raise UnverifiedMemberError(
                f"refusing a quorum whose store {store_address[:120]!r} no verified member "
                "claimed")
        if recover_src and recover_src not in {h["member"]["address"] for h in opened}:
            raise UnverifiedMemberError(
                f"refusing a quorum whose recovery source {recover_src[:120]!r} no verified "
                "member claimed")
        return opened


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")
