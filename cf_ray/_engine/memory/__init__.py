"""Snapshot memory and how its bytes move, shared by the worker and the node rooms (no Ray, no torch).

* :mod:`.slots`: a slot's layout (header page, data), its identity checks, locks, and both sides'
  access: the holder creates slots, the worker fills them, readers map them.
* :mod:`.wire`: the direct transfer's wire format, its TLS settings and its reader (the server is the
  holder's, ``node/stream.py``).
* :mod:`.crc`: CRC-32 arithmetic: a whole buffer's from its blocks', and block checks as bytes land.

It stands on ``protocol`` (the descriptors are messages) and on nothing of ``worker``, ``node`` or
``driver``, which stand on it.
"""
