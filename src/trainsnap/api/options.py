"""What a save records and how it stores it: :class:`SaveOptions`.

Defined with the save it configures (:mod:`trainsnap.protocol.rank_save`, where
:class:`~trainsnap.protocol.rank_save.SaveRequest` holds the options of one save), and
exported here as part of the public API.
"""

from __future__ import annotations

from trainsnap.protocol.rank_save import SaveOptions

__all__ = ["SaveOptions"]
