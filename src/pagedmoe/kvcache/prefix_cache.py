"""Content addresses of KV blocks, for automatic prefix caching. Pure Python.

Block i of a sequence (tokens [i * block_size, (i + 1) * block_size)) is named by
    hash_i = sha256(hash_{i-1} || tokens of block i),   hash_{-1} = b""
so a name stands for the block's tokens *and* everything before them: equal names mean equal positions
and equal attention context, hence equal K and V (the model and its weights being the same). A
cryptographic hash makes a collision (two different prefixes sharing KV) practically impossible, and the
same prompt gets the same names in every process.

Only full blocks are named: the last, partial block of a sequence is still being written.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Protocol, Sequence


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class _HasTokens(Protocol):
    request_id: str

    def token_ids(self, start: int, end: int) -> list[int]: ...


class PrefixHasher:
    """The block hashes of each live request, extended as its sequence grows (a request's tokens only
    ever get appended, so earlier hashes stay valid)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hashes: dict[str, list[bytes]] = {}

    def hashes(self, request: _HasTokens, num_blocks: int) -> list[bytes]:
        """The hashes of the request's first `num_blocks` full blocks (the caller knows they are full)."""
        have = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(have), num_blocks):
            have.append(hash_block(have[-1] if have else b"", request.token_ids(i * bs, (i + 1) * bs)))
        return have

    def known(self, request_id: str) -> list[bytes]:
        return self._hashes.get(request_id, [])

    def drop(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)
