"""XXH3-64 (seed 0, the default secret) of a byte buffer: the `xxhash` package's, else numpy's.

The batch files' per-image checksums are XXH3-64 digests. The `xxhash` package (requirements.txt)
computes one 256x256 image in ~4 us and releases the GIL. Where it cannot be installed (a machine used
as it is, e.g. a lent GPU machine with its own preinstalled packages), :func:`xxh3_64_numpy` computes
the very same digest with numpy, about a millisecond per image: slow, but every checksum is still
checked, and a notice says how to get the fast one.

The numpy version implements XXH3's long-input path (more than 240 bytes; images are larger), after
the reference description of XXH3 (github.com/Cyan4973/xxHash, doc/xxhash_spec.md): 64-byte stripes
accumulated into 8 lanes, 16 stripes per block, the accumulators scrambled after each block, then a
last partial block, a last stripe, and the merge. Within a block everything is a sum, so it is
vectorised over all blocks at once; only the scrambles run in sequence.
"""
from __future__ import annotations

import sys

import numpy as np

try:
    import xxhash
except ImportError:  # the numpy version below; announced once, where a checksum is first needed
    xxhash = None

MASK = (1 << 64) - 1
PRIME32_1, PRIME32_2, PRIME32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
PRIME64_1, PRIME64_2, PRIME64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
PRIME64_4, PRIME64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
STRIPE, LANES, STRIPES_PER_BLOCK = 64, 8, (len(SECRET) - 64) // 8
_KEYS = np.frombuffer(SECRET, dtype="<u8")  # stripe s, lane i reads the secret at byte 8 (s + i)
_SWAP = np.arange(LANES) ^ 1               # each lane's input is also added to its neighbour
_INIT = [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1]
_notified = [False]


def _stripes(words: np.ndarray, key_offset_words: np.ndarray) -> np.ndarray:
    """Σ over the stripes of one block of every lane's contribution: (..., stripes, 8) -> (..., 8)."""
    keyed = words ^ key_offset_words
    product = (keyed & np.uint64(0xFFFFFFFF)) * (keyed >> np.uint64(32))
    return product.sum(axis=-2, dtype=np.uint64) + words.sum(axis=-2, dtype=np.uint64)[..., _SWAP]


def _u64(buf: bytes, offset: int) -> int:
    return int.from_bytes(buf[offset:offset + 8], "little")


def _mul128_fold64(a: int, b: int) -> int:
    product = a * b
    return (product ^ (product >> 64)) & MASK


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & MASK
    return h ^ (h >> 32)


def xxh3_64_numpy(buf) -> int:
    """XXH3-64 of more than 240 bytes (any C-contiguous array or bytes-like), equal to xxhash's."""
    data = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    n = data.size
    if n <= 240:
        raise ValueError(f"the numpy XXH3 covers inputs over 240 bytes, got {n}: install xxhash")
    block = STRIPE * STRIPES_PER_BLOCK
    blocks = (n - 1) // block
    keys = np.lib.stride_tricks.sliding_window_view(_KEYS, LANES)  # row s: secret words s .. s+7
    full = data[:blocks * block].view("<u8").reshape(blocks, STRIPES_PER_BLOCK, LANES)
    sums = _stripes(full, keys[:STRIPES_PER_BLOCK]).tolist()
    scramble_key = [_u64(SECRET, len(SECRET) - STRIPE + 8 * i) for i in range(LANES)]
    acc = list(_INIT)
    for block_sum in sums:  # the scramble is not linear: block after block
        acc = [(a + s) & MASK for a, s in zip(acc, block_sum)]
        acc = [(((a ^ (a >> 47)) ^ k) * PRIME32_1) & MASK for a, k in zip(acc, scramble_key)]
    rest = ((n - 1) - blocks * block) // STRIPE
    if rest:
        tail = data[blocks * block:blocks * block + rest * STRIPE].view("<u8").reshape(rest, LANES)
        acc = [(a + s) & MASK for a, s in zip(acc, _stripes(tail, keys[:rest]).tolist())]
    last = np.ascontiguousarray(data[n - STRIPE:]).view("<u8")
    last_key = np.frombuffer(SECRET[len(SECRET) - STRIPE - 7:len(SECRET) - 7], dtype="<u8")
    acc = [(a + s) & MASK for a, s in zip(acc, _stripes(last[None], last_key[None]).tolist())]
    h = (n * PRIME64_1) & MASK
    for i in range(4):
        h = (h + _mul128_fold64(acc[2 * i] ^ _u64(SECRET, 11 + 16 * i), acc[2 * i + 1] ^ _u64(SECRET, 19 + 16 * i)))
        h &= MASK
    return _avalanche(h)


def xxh3_64(buf) -> int:
    """XXH3-64 of `buf` (~4 us per 256x256 image with xxhash installed, ~1 ms with numpy)."""
    if xxhash is not None:
        return xxhash.xxh3_64_intdigest(buf)
    if not _notified[0]:
        _notified[0] = True
        print("notice: the xxhash package is not installed; image checksums are checked with numpy, about "
              "200x slower (pip install xxhash, see requirements.txt)", file=sys.stderr, flush=True)
    return xxh3_64_numpy(buf)
