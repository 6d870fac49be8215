"""What both wheel smoke tests (wheel_smoke.py, wheel_compat_smoke.py) share:
failing with the script's name, finding the installed package, and listing
the shared objects this process mapped. Imported from the scripts' own
directory, which Python puts first on sys.path when it runs a script.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, NoReturn


def fail(who: str, msg: str) -> NoReturn:
    print(f"{who}: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def installed_package(who: str) -> Path:
    """The directory of the kvferry package imported from site-packages;
    fails when $KVFERRY_LIBRARY is set (the wheel's own library would not be
    the one tested) or when kvferry comes from anywhere else."""
    if "KVFERRY_LIBRARY" in os.environ:
        fail(who, "KVFERRY_LIBRARY is set: the wheel's own library would not be the one tested")
    import kvferry

    pkg = Path(kvferry.__file__).resolve().parent
    if "site-packages" not in str(pkg):
        fail(who, f"kvferry imported from {pkg}, not from an installed package")
    return pkg


def mapped_libraries() -> List[str]:
    """Paths of the shared objects mapped into this process."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and ".so" in parts[5]:
                paths.add(parts[5].strip())
    return sorted(paths)
