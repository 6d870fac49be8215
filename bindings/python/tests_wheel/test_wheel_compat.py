"""Checks of the manylinux_2_28 wheel that `make wheel-compat` builds.

Run by `make test-wheel-compat` (scripts/test_wheel_compat.sh), which skips
with its reason when no such wheel was built. The wheel is
$KVFERRY_COMPAT_WHEEL, else the one kvferry-*.whl in $KVFERRY_COMPAT_DIR
(default dist/compat/); the glibc it must run on is $KVFERRY_GLIBC (default
2.28), as for the build.

- its tag is manylinux_2_28 (that one, not an older one it was not built for);
- every ELF file in it needs only glibc's own libraries (no libzmq, no
  libstdc++: both are linked in) and no glibc symbol version newer than 2.28;
- libkvferry.so exports the kvf_* API and nothing else (the static libzmq
  and libc++ stay private, so they cannot clash with a host's copies);
- kvferry/licenses/ holds THIRD_PARTY_NOTICES.txt and every licence text it
  names, for Go, each Go module recorded in the library's build info, libzmq,
  LLVM's C++ runtime, zig's compiler_rt and glibc;
- `auditwheel show` accepts it for manylinux_2_28 or an older policy;
- installed into a fresh venv, it moves data: WRITE then READ on loopback,
  byte-checked, with no libzmq shared library loaded (wheel_compat_smoke.py).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[3]
GLIBC = os.environ.get("KVFERRY_GLIBC", "2.28")
ARCH = platform.machine()
PLAT = f"manylinux_{GLIBC.replace('.', '_')}_{ARCH}"
# glibc's own libraries, which every manylinux policy promises.
GLIBC_LIBS = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libresolv.so.2",
              "libutil.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def _version(v: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _find_wheel() -> Path:
    env = os.environ.get("KVFERRY_COMPAT_WHEEL")
    if env:
        return Path(env)
    folder = Path(os.environ.get("KVFERRY_COMPAT_DIR", REPO / "dist" / "compat"))
    found = sorted(folder.glob("kvferry-*.whl"))
    if not found:
        pytest.skip(f"no wheel in {folder}: `make wheel-compat` builds one (it needs ziglang from PyPI "
                    "and Debian's zeromq3 source package the first time)")
    if len(found) > 1:
        pytest.fail(f"several wheels in {folder}: {[p.name for p in found]}; set KVFERRY_COMPAT_WHEEL")
    return found[0]


@pytest.fixture(scope="module")
def wheel() -> Path:
    path = _find_wheel()
    if not path.is_file():
        pytest.fail(f"KVFERRY_COMPAT_WHEEL={path} is not a file")
    return path


@pytest.fixture(scope="module")
def unpacked(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root)
    return root


@pytest.fixture(scope="module")
def elf_files(unpacked: Path) -> List[Path]:
    files = [p for p in unpacked.rglob("*") if p.is_file() and p.open("rb").read(4) == b"\x7fELF"]
    assert any(p.name == "libkvferry.so" for p in files), "no kvferry/libkvferry.so in the wheel"
    return files


def _readelf(*args: str) -> str:
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    return subprocess.run(["readelf", *args], check=True, capture_output=True, text=True).stdout


def _version_needs(path: Path) -> List[str]:
    """The symbol versions PATH needs from other libraries (.gnu.version_r)."""
    out = _readelf("-V", "-W", str(path))
    section = out.split(".gnu.version_r", 1)[1] if ".gnu.version_r" in out else ""
    return re.findall(r"Name: (\S+)\s+Flags", section)


def test_platform_tag(wheel: Path, unpacked: Path) -> None:
    tags = wheel.name[:-len(".whl")].split("-")[-1].split(".")
    assert tags == [PLAT], f"{wheel.name}: platform tags {tags}, want only {PLAT}"
    (info,) = unpacked.glob("kvferry-*.dist-info/WHEEL")
    wheel_tags = re.findall(r"^Tag: (\S+)$", info.read_text(), re.MULTILINE)
    assert wheel_tags == [f"py3-none-{PLAT}"], f"WHEEL says {wheel_tags}"


def test_libraries_need_only_glibc(elf_files: List[Path], unpacked: Path) -> None:
    assert not (unpacked / "kvferry.libs").exists(), "kvferry.libs/: the wheel bundles separate libraries"
    for path in elf_files:
        needed = re.findall(r"\(NEEDED\).*\[(.+)\]", _readelf("-d", "-W", str(path)))
        extra = sorted(set(needed) - GLIBC_LIBS)
        assert not extra, f"{path.name} needs {extra}, which are not part of glibc"


def test_max_glibc_version(elf_files: List[Path]) -> None:
    newest: Dict[str, str] = {}
    for path in elf_files:
        needs = _version_needs(path)
        glibc = [n[len("GLIBC_"):] for n in needs if re.fullmatch(r"GLIBC_\d+(\.\d+)+", n)]
        assert glibc, f"{path.name}: no GLIBC_ symbol versions read (is it a glibc library?)"
        top = max(glibc, key=_version)
        newest[path.name] = top
        assert _version(top) <= _version(GLIBC), f"{path.name} needs GLIBC_{top}, newer than {GLIBC}"
        cxx = [n for n in needs if n.startswith(("GLIBCXX_", "CXXABI_", "GCC_"))]
        assert not cxx, f"{path.name} needs {cxx}: the C++ runtime must be linked in, not the system's"
    print(f"newest GLIBC symbol versions needed: {newest}")


def test_exports_only_the_api(elf_files: List[Path]) -> None:
    (lib,) = [p for p in elf_files if p.name == "libkvferry.so"]
    out = _readelf("--dyn-syms", "-W", str(lib))
    defined = []
    for line in out.splitlines():
        f = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(f) >= 8 and f[0].endswith(":") and f[6] != "UND" and f[4] in ("GLOBAL", "WEAK"):
            defined.append(f[7].split("@")[0])
    assert defined, "libkvferry.so defines no dynamic symbols"
    other = sorted(s for s in defined if not s.startswith("kvf_"))
    assert not other, f"libkvferry.so exports more than kvf_*: {other[:20]}"


def _notices(unpacked: Path) -> Tuple[Path, str]:
    lic = unpacked / "kvferry" / "licenses"
    index = lic / "THIRD_PARTY_NOTICES.txt"
    assert index.is_file(), "no kvferry/licenses/THIRD_PARTY_NOTICES.txt in the wheel"
    return lic, index.read_text()


def test_licence_files(unpacked: Path) -> None:
    lic, text = _notices(unpacked)
    named = set()
    for line in text.splitlines():
        m = re.match(r"\s+files:\s+(.*)$", line)
        if m:
            named.update(m.group(1).split())
    for name in sorted(named):
        f = lic / name
        assert f.is_file() and f.stat().st_size > 0, f"THIRD_PARTY_NOTICES.txt names {name}, absent or empty"
    present = {p.name for p in lic.iterdir()} - {"THIRD_PARTY_NOTICES.txt"}
    assert present == named, f"licence files the index does not name: {sorted(present - named)}"

    def read(name: str) -> str:
        return (lic / name).read_text(errors="replace")

    assert "The Go Authors" in read("go-LICENSE.txt")
    zmq = [n for n in named if n.startswith("libzmq-")]
    assert any("SPECIAL EXCEPTION" in read(n) or "Mozilla Public License" in read(n) for n in zmq), \
        f"no libzmq licence text (LGPL-3.0 with its linking exception, or MPL-2.0) among {zmq}"
    for part in ("libcxx", "libcxxabi", "libunwind"):
        assert "LLVM Exceptions" in read(f"llvm-{part}-LICENSE.TXT"), f"llvm-{part}: not the LLVM licence"
    assert "MIT License" in read("zig-LICENSE.txt")
    assert "GNU C Library" in read("glibc-LICENSES.txt")
    for component in ("libzmq ", "LLVM libc++", "compiler_rt", "libc_nonshared", "Go go1."):
        assert component in text, f"THIRD_PARTY_NOTICES.txt does not list {component.strip()}"


def test_licences_cover_every_go_module(unpacked: Path) -> None:
    """Every module `go version -m` finds in the library has its licence."""
    go = shutil.which(os.environ.get("GO", "go"))
    if go is None:
        pytest.skip("no Go toolchain to read the library's build info with")
    lib = unpacked / "kvferry" / "libkvferry.so"
    r = subprocess.run([go, "version", "-m", str(lib)], capture_output=True, text=True)
    assert r.returncode == 0, f"go version -m cannot read libkvferry.so's build info: {r.stderr.strip()}"
    info = r.stdout
    deps = re.findall(r"^\s*dep\s+(\S+)\s+(\S+)", info, re.MULTILINE)
    assert deps, f"no dependencies in the build info:\n{info}"
    _, text = _notices(unpacked)
    for path, version in deps:
        assert f"Go module {path} {version}\n" in text, f"no licence entry for {path} {version}"


def _auditwheel() -> str:
    for candidate in (os.environ.get("AUDITWHEEL"), str(REPO / "build" / "wheel-compat" / "venv" / "bin" / "auditwheel"),
                      shutil.which("auditwheel")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("auditwheel is not installed (make wheel-compat installs it into build/wheel-compat/venv)")


def test_auditwheel_accepts(wheel: Path) -> None:
    out = subprocess.run([_auditwheel(), "show", str(wheel)], check=True, capture_output=True, text=True).stdout
    print(out)
    m = re.search(r'consistent\s+with\s+the\s+following\s+platform\s+tag:\s+"manylinux_(\d+)_(\d+)_', out)
    assert m, f"auditwheel show names no manylinux tag:\n{out}"
    assert (int(m.group(1)), int(m.group(2))) <= _version(GLIBC), f"auditwheel: {m.group(0)}"


def test_smoke_transfer_in_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                    "--no-deps", str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "KVFERRY_LIBRARY" and not k.startswith("PYTHON")}
    smoke = REPO / "bindings" / "python" / "scripts" / "wheel_compat_smoke.py"
    r = subprocess.run([str(py), str(smoke)], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    assert r.returncode == 0 and "wheel_compat_smoke: OK" in r.stdout, "the smoke transfer failed"
