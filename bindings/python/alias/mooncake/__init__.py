"""kvferry-mooncake-alias: the package ``mooncake`` as kvferry provides it.

Only ``mooncake.engine`` exists, and it is ``kvferry.mooncake``. This package
never silently shadows the real Mooncake: if a Mooncake distribution is
installed too (both provide the package ``mooncake``, and whichever was
installed last owns its files), importing it raises ImportError naming both,
so that the process uses neither by surprise.
"""

from __future__ import annotations

import importlib.metadata as _md

# Distributions of the real Mooncake that provide the package "mooncake".
_REAL = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda", "mooncake")


def _real_mooncake() -> str:
    for dist in _md.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name in _REAL:
            return f"{dist.metadata['Name']} {dist.version}"
    return ""


_found = _real_mooncake()
if _found:
    raise ImportError(
        f"kvferry-mooncake-alias and the real Mooncake ({_found}) are both installed; both provide the "
        "package 'mooncake', so which one an import gets depends on install order. Uninstall one of them: "
        "'pip uninstall kvferry-mooncake-alias' to use Mooncake, or uninstall Mooncake to use kvferry "
        "(or import kvferry.mooncake directly)."
    )
