"""Atomic, verified, portable checkpoints: safetensors + JSON, never pickle.

Layout: ``path`` is a symbolic link to ``<parent>/.<name>.versions/<step>-<id>/``, a directory
holding ``model.safetensors`` (the model users keep, under the module's own names: the
replicated model, or the global/center model of parameter-server and elastic-averaging
strategies), optimizer state (``optimizer.safetensors``: tensors plus the JSON skeleton in its
metadata; ``optimizer.rank<r>.safetensors`` per rank when the state is local to each worker),
``strategy.safetensors`` (center, outer momentum, ...), ``rng.rank<r>.safetensors`` (every
rank's RNG states), ``extra.safetensors`` (tensor extras) and ``manifest.json`` (strategy,
world size, step, JSON extras, aliases of shared parameters, sha256 of every file).

A save writes and fsyncs a new version directory, then swaps the link with one
``os.replace``: a crash at any instant leaves ``path`` pointing at a complete checkpoint.
``restore`` verifies every checksum and, if ``path`` is damaged, falls back to the newest
intact version with a warning. ``save`` and ``restore`` are collectives: each replica
contributes what only it holds, the chief writes.

Ownership: ``save`` replaces ``path`` only when it is a link of ours (relative, into our own
versions directory, our naming pattern) or a legacy checkpoint directory, and removes only
version directories of our naming pattern holding our manifest, and inside them only the
files of our naming pattern; a versions directory or member that is a symbolic link is
refused. ``restore`` opens each member once (``O_NOFOLLOW``, regular files only, names from
the manifest checked against our pattern), hashes those bytes and parses the same bytes.

Shared (tied) parameters are stored once under their first name (safetensors' own convention,
so ``safetensors.torch.load_model`` re-ties them); the other names are recorded as
``aliases`` in the manifest and filled in again on restore. ``torch.compile``'s ``_orig_mod.``
segments never reach a file.

Nothing is ever unpickled: every ``.safetensors`` header is checked (length proportionate to
the data, nesting depth, JSON, dtypes, shapes, offsets, number of entries) against the file
size *before* any tensor is allocated, so a malicious or truncated file raises
:class:`~stratagem.CheckpointError` instead of allocating what its header claims; a ``.pt``
file is read only through ``torch.load(weights_only=True)``, only after its zip directory
showed uncompressed members no larger than the file, and only when it holds tensors
(:func:`load_pt`). See ``docs/reliability.md`` for the guarantees.

The package is split by concept (torchtitan's checkpointer is the model): ``format`` (the
files' bytes: safetensors, manifest, bounded parsing), ``storage`` (atomic versioned
directories, ownership, verified reading), ``sharded`` (per-replica files of sharded state:
each replica writes its own rows, a JSON index in the manifest), ``state`` (what a strategy saves and restores,
through its public state protocol, and any object with ``state_dict()``/``load_state_dict()``)
and ``tree`` (the codec of nested state: tensors + a strict JSON skeleton, also used by the
fault-tolerant heal transport, :mod:`stratagem.ft.transport`). This module re-exports the
public names.
"""

from __future__ import annotations

from .format import (
    FORMAT_VERSION,
    MAX_EMPTY_TENSORS,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_PT_MEMBERS,
    load_pt,
    read_safetensors,
)
from .state import restore, save
from .storage import exists, load_model_state, read_extras

__all__ = ["save", "restore", "exists", "read_extras", "load_model_state", "load_pt",
           "read_safetensors", "FORMAT_VERSION", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH",
           "MAX_MANIFEST_BYTES", "MAX_EMPTY_TENSORS", "MAX_PT_MEMBERS"]
