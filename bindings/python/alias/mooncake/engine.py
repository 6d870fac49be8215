"""``mooncake.engine`` as kvferry-mooncake-alias provides it: everything of
``kvferry.mooncake`` (``TransferEngine``, ``TransferOpcode``,
``TransferNotify``). Its differences from Mooncake are listed in kvferry's
MOONCAKE.md."""

from __future__ import annotations

import logging

from kvferry.mooncake import P2PHANDSHAKE, TransferEngine, TransferNotify, TransferOpcode

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "P2PHANDSHAKE"]

logging.getLogger("kvferry.mooncake").info(
    "mooncake.engine is kvferry's drop-in (kvferry-mooncake-alias), not Mooncake")
