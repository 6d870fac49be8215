"""Build hooks pyproject.toml cannot express.

- The version is read from include/kvferry.h (KVF_VERSION_STRING), so the
  package and the library it ships never disagree; the build fails when
  kvferry/__init__.py's __version__ says otherwise. Building from an sdist,
  where the header is absent, reads PKG-INFO instead.
- A build with kvferry/libkvferry.so present (copied in by `make python` or
  scripts/build_wheel.sh) makes a platform wheel tagged py3-none-<platform>:
  the library is loaded with ctypes, so any CPython 3 can use it, but only on
  the platform it was built for. auditwheel then turns linux_x86_64 into a
  manylinux tag. Without the library the wheel is pure and finds libkvferry
  at $KVFERRY_LIBRARY or through the system's loader; the build says so.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Tuple

from setuptools import setup
from setuptools.dist import Distribution

try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # older setuptools: the wheel package's
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
LIBRARY = HERE / "kvferry" / "libkvferry.so"


def _checked_version() -> str:
    """The version, refused when kvferry/__init__.py's __version__ says otherwise."""
    version = _version()
    init = HERE / "kvferry" / "__init__.py"
    m = re.search(r'^__version__ = "([^"]+)"$', init.read_text(), re.MULTILINE) if init.is_file() else None
    if m and m.group(1) != version:
        raise SystemExit(f"setup.py: {init} says __version__ = {m.group(1)!r}, include/kvferry.h {version!r}")
    return version


def _version() -> str:
    """KVF_VERSION_STRING from include/kvferry.h, or the sdist's PKG-INFO."""
    header = HERE.parent.parent / "include" / "kvferry.h"
    if header.is_file():
        m = re.search(r'^#define KVF_VERSION_STRING "([0-9]+\.[0-9]+\.[0-9]+)"$',
                      header.read_text(), re.MULTILINE)
        if not m:
            raise SystemExit(f"setup.py: no KVF_VERSION_STRING in {header}")
        return m.group(1)
    pkg_info = HERE / "PKG-INFO"
    if pkg_info.is_file():
        m = re.search(r"^Version: (\S+)$", pkg_info.read_text(), re.MULTILINE)
        if m:
            return m.group(1)
    raise SystemExit(f"setup.py: cannot find the version: neither {header} nor {pkg_info} exists")


@functools.lru_cache(maxsize=None)
def _has_library() -> bool:
    """Whether the build ships kvferry/libkvferry.so (said once when not)."""
    if LIBRARY.is_file():
        return True
    print(f"setup.py: {LIBRARY} is absent: building a pure wheel without the library; it will load "
          "libkvferry.so from $KVFERRY_LIBRARY or the system's loader (run `make python` first to ship it)",
          file=sys.stderr)
    return False


class BinaryDistribution(Distribution):
    """A distribution that counts as binary when it ships libkvferry.so, so
    that it installs into platlib and the wheel is not Root-Is-Purelib (which
    auditwheel requires of a wheel with shared libraries)."""

    def has_ext_modules(self) -> bool:
        return _has_library()


class PlatformWheel(bdist_wheel):
    """bdist_wheel that tags a wheel shipping libkvferry.so py3-none-<platform>."""

    def get_tag(self) -> Tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        if _has_library():
            # ctypes, not a CPython extension: no interpreter or ABI constraint.
            return "py3", "none", plat
        return python, abi, plat


setup(version=_checked_version(), distclass=BinaryDistribution, cmdclass={"bdist_wheel": PlatformWheel})
