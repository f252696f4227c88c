"""A method's wheel read as untrusted input (``witness.methods.wheel``): its pin computed from the
archive's bytes equals the one a trainer's installed copy gives, and every malformed or hostile
archive is refused with a reason before anything is unpacked or run."""

from __future__ import annotations

import io
import stat
import sys
import warnings
import zipfile

import pytest
from methods_helpers import method_source, wheel_bytes

from witness.errors import MalformedInput
from witness.methods import wheel as wheel_mod
from witness.methods.wheel import read_wheel
from witness.task import registry


def test_the_pin_read_from_the_archive_is_the_installed_copys(tmp_path, monkeypatch):
    w = read_wheel(wheel_bytes(method_source()))
    assert (w.distribution, w.version, w.tasks) == ("sandboxed-mlp", "1.0", {"sandboxed-mlp": "sandboxed_mlp:Method"})
    site = w.install(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    try:
        assert w.files_sha256 == registry.package_files_sha256("sandboxed_mlp", ("sandboxed_mlp",))
    finally:
        sys.modules.pop("sandboxed_mlp", None)
    assert read_wheel(wheel_bytes(method_source("x = 1"))).files_sha256 != w.files_sha256  # its code, not its name


def _rezip(entries: list[tuple[str | zipfile.ZipInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a name twice is what one test sends
        for name, data in entries:
            z.writestr(name, data)
    return buf.getvalue()


def _entries(extra: list[tuple[str | zipfile.ZipInfo, bytes]] = (), drop: str = "") -> bytes:
    with zipfile.ZipFile(io.BytesIO(wheel_bytes(method_source()))) as z:
        kept = [(n, z.read(n)) for n in z.namelist() if not (drop and n.endswith(drop))]
    return _rezip([*kept, *extra])


def _link() -> zipfile.ZipInfo:
    info = zipfile.ZipInfo("sandboxed_mlp/data")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


@pytest.mark.parametrize("data, reason", [
    (b"not a zip", "not a wheel"),
    (_entries([("../evil.py", b"x")]), "would leave the folder"),
    (_entries([("/etc/evil.py", b"x")]), "would leave the folder"),
    (_entries([("sandboxed_mlp/../../evil.py", b"x")]), "would leave the folder"),
    (_entries([(_link(), b"/etc/passwd")]), "holds a link"),
    (_entries([("sandboxed_mlp/__init__.py", b"again")]), "twice"),
    (_entries([("other-1.0.dist-info/METADATA", b"Name: other\nVersion: 1\n")]), "exactly one .dist-info"),
    (_entries([("sandboxed_mlp-1.0.data/scripts/run", b"#!/bin/sh")]), "outside site-packages"),
    (_entries(drop="entry_points.txt"), "names no entry points"),
    (_entries(drop="METADATA"), "has no sandboxed_mlp-1.0.dist-info/METADATA"),
    (_entries(drop="__init__.py"), "is not a package or module the wheel holds"),
])
def test_a_malformed_or_hostile_wheel_is_refused(data, reason):
    with pytest.raises(MalformedInput, match=reason):
        read_wheel(data)


def test_a_wheel_too_large_or_unpacking_too_large_is_refused(monkeypatch):
    with pytest.raises(MalformedInput, match="over the"):
        read_wheel(b"x" * (wheel_mod.MAX_WHEEL_BYTES + 1))
    bomb = _entries([("sandboxed_mlp/zeros.bin", b"\0" * (wheel_mod.MAX_UNPACKED_BYTES + 1))])
    assert len(bomb) < wheel_mod.MAX_WHEEL_BYTES  # small packed, large unpacked
    with pytest.raises(MalformedInput, match="unpacks to over"):
        read_wheel(bomb)
    monkeypatch.setattr(wheel_mod, "MAX_FILES", 5)
    with pytest.raises(MalformedInput, match="entries, over"):
        read_wheel(_entries([(f"sandboxed_mlp/f{i}.py", b"") for i in range(5)]))


def test_an_entry_point_that_is_not_module_colon_class_is_refused():
    bad = _entries([("sandboxed_mlp-1.0.dist-info/entry_points.txt", b"[witness.tasks]\nx = os.system('id')\n")],
                   drop="entry_points.txt")
    with pytest.raises(MalformedInput, match="not module:Class"):
        read_wheel(bad)
